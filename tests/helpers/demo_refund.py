"""The demo refund as a newcomer's model proposes it, on an inbox stack: the why-beside-what
test and the approval screens' screenshots share it."""

from __future__ import annotations

import pytest

from examples.fake_openai import call, tool_calls
from tests.helpers.fake_model import fake_model
from tests.helpers.inbox_stack import Stack


GOAL = "Refund order A-1001: the parcel arrived broken (ticket T-77)"


async def a_model_looks_up_then_refunds(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> str:
    """The demo refund as a newcomer's model runs it: it looks order A-1001 up (a read: it runs
    at once), then proposes a 49.99 EUR refund and an email; alice asked. Its run id, once it
    waits on an approver and is listed so."""
    with fake_model(monkeypatch) as fake:
        fake.script(
            tool_calls(call("get_order", {"order_id": "A-1001"})),
            tool_calls(call("issue_refund", {"order_id": "A-1001", "amount_cents": 4999, "reason": "broken"}),
                       call("send_email", {"to": "ada@example.com", "subject": "Your refund", "body": "Refunded."})),
        )
        run_id = await stack.start(requested_by="alice", goal=GOAL, planner="model", playbook=[])
        await stack.wait(run_id, "AWAITING_APPROVAL")
        await stack.visible(run_id)
    return run_id
