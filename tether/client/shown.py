"""What a person is shown: a plan's steps with their effects and money (``step_views``,
``shown_arg``, ``plan_summary``), whether an Approve may be offered on what is shown
(``approval_offer_problem``), the approvals still needed, and how old a published view is.
Text from outside reaches a person only escaped (``workflows.display``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from workflows.display import escape_text, show_value
from workflows.wording import effect_words, money
from workflows.contract import Plan
from workflows.run_state import PendingApproval, RunSnapshot


def age(at: datetime, now: datetime | None = None) -> str:
    """How long ago ``at`` was, for a person: ``4 s``, ``12 min``, ``3 h 5 min``."""
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - at).total_seconds()))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def freshness(published_at: datetime, now: datetime | None = None) -> str:
    """``as published at 20:51:03 UTC, 4 s ago``: how old what a view shows is."""
    return f"as published at {published_at.astimezone(timezone.utc):%H:%M:%S} UTC, {age(published_at, now)} ago"


@dataclass(frozen=True)

class ArgView:
    name: str
    value: Any  # as the plan holds it (the page escapes it; the terminal uses ``shown``)
    money: str | None  # ``600.00 EUR`` when the tool's schema declares the argument as money


@dataclass(frozen=True)

class StepView:
    """One step of a plan as an approver is shown it: every argument, in full."""

    n: int
    tool: str
    effect: str  # effect_words
    writes: bool
    args: list[ArgView]
    summary: list[ArgView]  # the tool's declared summary fields
    description: str = ""  # the tool's own description (its docstring), for the approver; not escaped here


def step_views(plan: Plan | None, tools: Sequence[Any]) -> list[StepView]:
    """The plan's steps with their effects in words and money in amount and currency."""
    from workflows.contract import ToolEffect

    if plan is None:
        return []
    by_name = {t.name: t for t in tools}
    views = []
    for n, step in enumerate(plan.steps, start=1):
        info = by_name.get(step.tool)
        properties = (info.args_schema.get("properties") or {}) if info else {}
        args = [ArgView(k, v, money(v, properties.get(k), step.args)) for k, v in step.args.items()]
        fields = set(info.summary_fields if info else [])
        undo = plan.undo[n - 1] if plan.undo is not None and n <= len(plan.undo) else False
        views.append(StepView(
            n=n, tool=step.tool, effect=effect_words(info, undo),
            writes=info is None or info.effect != ToolEffect.READ_ONLY,
            args=args, summary=[a for a in args if a.name in fields],
            description=info.description if info else "",
        ))
    return views


def write_args(call: Any, tools: Sequence[Any]) -> list[ArgView]:
    """The arguments of the write a compensation puts back (``CompensationCall.of_args``), money
    in amount and currency as the write's tool declares it (when the view carries that tool)."""
    info = next((t for t in tools if t.name == call.of_tool), None)
    properties = (info.args_schema.get("properties") or {}) if info else {}
    return [ArgView(k, v, money(v, properties.get(k), call.of_args)) for k, v in call.of_args.items()]


def shown_arg(arg: ArgView, limit: int | None = None) -> str:
    """``name: value`` for a terminal, money as ``600.00 EUR (60000)``; escaped."""
    value = show_value(arg.value, limit)
    return f"{escape_text(arg.name, 80)}: " + (f"{arg.money} ({value})" if arg.money else value)


def plan_summary(plan: Plan | None, tools: Sequence[Any], limit: int = 600) -> str:
    """One line for a list of runs: each write, its summary fields and its effect (escaped)."""
    views = step_views(plan, tools)
    writes = [v for v in views if v.writes]
    if not views:
        return "no plan"
    if not writes:
        return f"{len(views)} step(s), all read-only"
    parts = []
    for v in writes:
        fields = ", ".join(shown_arg(a, 120) for a in v.summary)
        parts.append(f"{escape_text(v.tool, 64)}" + (f" ({fields})" if fields else "") + f": {v.effect}")
    text = f"{len(writes)} of {len(views)} step(s) write: " + "; ".join(parts)  # escaped part by part
    return text if len(text) <= limit else text[: limit - 1] + "…"


def approval_offer_problem(snap: RunSnapshot) -> str | None:
    """Why a page or CLI must offer no Approve on this snapshot (None: the steps it shows hash
    to the plan hash the pending approval binds). A view that lies about the arguments then
    offers nothing; one that shows the real ones binds the real hash."""
    pending = snap.pending_approval
    if pending is None:
        return "no approval is pending"
    if snap.plan is None or snap.plan.plan_hash != pending.plan_hash or not snap.plan.hashes_to_itself():
        return ("the steps shown do not hash to the plan hash the approval binds: what is shown is not "
                "the run's plan (check `tether status RUN --live`)")
    return None


def approvals_needed(pending: PendingApproval) -> str:
    """How many approvals are still needed and from whom (the roles), for a person."""
    done = [a.approver for a in pending.approvals]
    left = max(pending.approvals_required - len(done), 0)
    got = f"{len(done)} of {pending.approvals_required} approval(s)" + (
        f" (by {', '.join(escape_text(a, 64) for a in done)})" if done else "")
    if not left:
        return got
    who = ("someone with role " + " or ".join(escape_text(r, 64) for r in pending.roles)) if pending.roles else "an approver of the tenant"
    others = f", other than {', '.join(escape_text(a, 64) for a in done)}" if done else ""
    return f"{got}; {left} more needed from {who}{others}"
