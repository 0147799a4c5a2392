"""An OpenAI Agents SDK agent that refunds an order, as a Tether planner; runs offline.

    TETHER_PLANNERS=sdk_refunds=examples.agents.sdk_refund_agent:planner python -m examples.devstack restart worker
    tether start --planner sdk_refunds --goal "Refund order A-1003" --requested-by alice --wait

Its model is :class:`RefundModel` below, an Agents SDK ``Model`` that answers from what it is
given (the run so far, as Responses items), so it needs no endpoint and no key, and it serves
every run the worker plans, one after another or at once: it keeps nothing between calls. (The
SDK's ``agents.testing.ScriptedModel`` plays a fixed list of replies and then refuses: one
worker would plan a single run with it.) It looks the order up, refunds its total, and answers.
Swap in a real model (``model="gpt-4.1-mini"``) and nothing else changes: the agent proposes,
Tether validates, asks for approval and executes.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from agents import Agent
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.testing import assistant_message, function_call
from agents.usage import Usage

from tether.planners.openai_agents import AgentsSDKPlanner

ORDER = re.compile(r"\b[A-Z]-\d{4}\b")


def reply(items: list[dict[str, Any]]) -> list[Any]:
    """The model's next output for a run so far: get_order, then issue_refund of the order's
    total, then an answer. What the runtime says back (a refusal) ends it with that said."""
    said = [i["content"] for i in items if i.get("role") == "user" and isinstance(i.get("content"), str)]
    if any(text.startswith("The runtime refused") or text.startswith("A person approved only part") for text in said):
        return [assistant_message(f"I could not refund: refused ({said[-1].splitlines()[0]})")]
    outputs = {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}
    calls = {i["name"]: i["call_id"] for i in items if i.get("type") == "function_call"}
    if "issue_refund" in calls and calls["issue_refund"] in outputs:
        refund = json.loads(outputs[calls["issue_refund"]])
        return [assistant_message(
            f"Refunded {refund['amount_cents'] / 100:.2f} on order {refund['order_id']} (refund {refund['refund_id']})."
        )]
    if "get_order" in calls and calls["get_order"] in outputs:
        order = json.loads(outputs[calls["get_order"]])
        return [function_call("issue_refund", {"order_id": order["id"], "amount_cents": order["total_cents"],
                                               "reason": "requested by the customer"}, call_id="refund-1")]
    match = ORDER.search(said[0] if said else "")
    if match is None:
        return [assistant_message("Which order? Name it like A-1001 in the goal.")]
    return [function_call("get_order", {"order_id": match.group()}, call_id="lookup-1")]


class RefundModel(Model):
    """A model that answers each call from its input alone (:func:`reply`): any number of runs."""

    async def get_response(self, system_instructions: str | None, input: str | list[Any], *args: Any,
                           **kwargs: Any) -> ModelResponse:
        items = [{"role": "user", "content": input}] if isinstance(input, str) else [
            i if isinstance(i, dict) else i.model_dump() for i in input
        ]
        return ModelResponse(output=reply(items), usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the planner calls the model without streaming")


agent = Agent(name="refunds", instructions="You refund orders for the billing team.", model=RefundModel())
planner = AgentsSDKPlanner(agent)
