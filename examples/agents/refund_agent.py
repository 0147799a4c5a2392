"""A pydantic-ai agent that refunds an order, as a Tether planner; runs offline.

    python worker.py --planner refunds=examples.agents.refund_agent:planner
    tether start --planner refunds --goal "Refund order A-1001" --requested-by alice --wait

Its model is pydantic-ai's ``FunctionModel`` running :func:`refund_model` below, so it needs no
endpoint and no key: it looks the order up, refunds its total, and answers. Swap in a real model
(``Agent("openai:gpt-4.1-mini", ...)``) and nothing else changes: the agent proposes, Tether
validates, asks for approval and executes.
"""

from __future__ import annotations

import json
import re

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from tether.planners.pydantic_agent import AgentPlanner

ORDER = re.compile(r"\b[A-Z]-\d{4}\b")


def refund_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """A scripted model: get_order, then issue_refund of the order's total, then an answer.
    What the runtime says back (a refusal, a step left out) ends it with that said."""
    parts = [p for m in messages for p in m.parts]
    said = [p.content for p in parts if isinstance(p, UserPromptPart) and isinstance(p.content, str)]
    if any(text.startswith("The runtime refused") or text.startswith("A person approved only part") for text in said):
        return ModelResponse(parts=[TextPart(f"I could not refund: refused ({said[-1].splitlines()[0]})")])
    results = {p.tool_name: p.content for p in parts if isinstance(p, ToolReturnPart)}
    if "issue_refund" in results:
        refund = json.loads(results["issue_refund"])
        return ModelResponse(parts=[TextPart(
            f"Refunded {refund['amount_cents'] / 100:.2f} on order {refund['order_id']} (refund {refund['refund_id']})."
        )])
    if "get_order" in results:
        order = json.loads(results["get_order"])
        return ModelResponse(parts=[ToolCallPart("issue_refund", {
            "order_id": order["id"], "amount_cents": order["total_cents"], "reason": "requested by the customer",
        })])
    match = ORDER.search(said[0] if said else "")
    if match is None:
        return ModelResponse(parts=[TextPart("Which order? Name it like A-1001 in the goal.")])
    return ModelResponse(parts=[ToolCallPart("get_order", {"order_id": match.group()})])


agent = Agent(FunctionModel(refund_model), instructions="You refund orders for the billing team.")
planner = AgentPlanner(agent)
