"""An agent loop of your own as a Tether planner: plain Python, no model.

    python worker.py --planner desk=examples.agents.order_desk:OrderDesk
    tether start --planner desk --goal "How much were orders A-1001 and A-1003?" --requested-by alice --wait

Each call gets the run so far and returns the next plan or the answer; it keeps no state of its
own (a worker may restart, another worker may take the next call), so everything it needs comes
from ``request``: the goal, the steps run with their results, what the runtime refused.
"""

from __future__ import annotations

import json
import re

from workflows.contract import ToolCatalog
from workflows.wire import PlannerInput, Proposal, ProposedStep

ORDER = re.compile(r"\b[A-Z]-\d{4}\b")


class OrderDesk:
    """Looks up every order the goal names, then answers with their totals."""

    async def propose(self, request: PlannerInput, catalog: ToolCatalog) -> Proposal:
        if catalog.get("get_order") is None:
            return Proposal(answer="This worker serves no get_order tool: nothing to look up.")
        if request.feedback:  # the runtime refused the last plan: say so instead of insisting
            return Proposal(answer=f"Stopped: the runtime refused the lookup ({request.feedback})")
        looked_up = {s.args.get("order_id"): s for s in request.executed if s.tool == "get_order"}
        wanted = list(dict.fromkeys(ORDER.findall(request.goal)))
        missing = [o for o in wanted if o not in looked_up]
        if missing:  # one plan of reads: they run without an approval under the demo's policy
            return Proposal(steps=[ProposedStep(tool="get_order", args={"order_id": o}) for o in missing])
        lines = []
        for order_id in wanted:
            step = looked_up[order_id]
            try:
                order = json.loads(step.observation) if step.status == "ok" else None
            except json.JSONDecodeError:
                order = None  # a result cut to its digest: say it is unknown rather than guess
            lines.append(f"{order_id}: {order['total_cents'] / 100:.2f} {order['currency']}" if order
                         else f"{order_id}: unknown")
        return Proposal(answer="; ".join(lines) or "The goal names no order (like A-1001).")
