"""`temporal workflow reset` as an operator does it: the reset run replays history up to the
reset point and takes the decisions again (Temporal reapplies the signals after it). Every id a
write depends on (tool call ids, idempotency keys, request ids) derives from the run chain and
the decision that made it, so the reset run asks the billing service for the same refund, and
the service's idempotency keeps it at one. Real dev server, real billing service."""

from __future__ import annotations

import asyncio
import uuid

from temporalio.testing import WorkflowEnvironment

from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from workflows.contract import RevisionRequest
from tests.helpers.resets import outcome_of, reset_before_signal

ORDER = "A-1003"


def refund(cents: int) -> dict:
    return {"tool": "issue_refund", "args": {"order_id": ORDER, "amount_cents": cents, "reason": "reset test"}}


def email() -> dict:
    return {"tool": "send_email", "args": {"to": f"{uuid.uuid4().hex[:8]}@example.com", "subject": "s", "body": "b"}}


def refunds_of(billing: Billing, run_id: str) -> list[dict]:
    return [r for r in billing.refunds() if r["idempotency_key"].startswith(run_id)]


async def test_reset_before_a_partial_approval_refunds_once(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    client = dev_env.client
    async with running_worker(client) as worker:
        handle = await start_run(client, worker, make_request([refund(301), email()]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob", steps=[1]))  # the refund only
        first = await run_outcome(handle)
        assert first.state.value == "COMPLETED" and len(refunds_of(billing, handle.id)) == 1
        new_run = await reset_before_signal(client, handle, "approve")
        again = await outcome_of(client, handle.id, new_run)
    assert again.state.value == "COMPLETED"
    assert [s.tool_call_id for s in again.steps] == [s.tool_call_id for s in first.steps]
    assert len(refunds_of(billing, handle.id)) == 1, refunds_of(billing, handle.id)


async def test_reset_before_a_revision_refunds_once(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    client = dev_env.client
    async with running_worker(client) as worker:
        handle = await start_run(client, worker, make_request([refund(302)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        pending = snap.pending_approval
        await handle.signal("revise", RevisionRequest(
            decision_id=uuid.uuid4().hex, editor="carol", plan_hash=pending.plan_hash, request_id=pending.request_id,
            steps=[refund(203)], reason="smaller",
        ))
        for _ in range(600):  # until the revised plan waits for its own approval
            revised = await wait_for_state(handle, "AWAITING_APPROVAL")
            if revised.pending_approval.plan_hash != pending.plan_hash:
                break
            await asyncio.sleep(0.05)
        await handle.signal("approve", approval_for(revised, "bob"))
        first = await run_outcome(handle)
        assert first.state.value == "COMPLETED" and len(refunds_of(billing, handle.id)) == 1
        # The revision is taken again; the approval that followed it is not reapplied (Temporal
        # would deliver it before the revision is acted on, against the old plan): bob approves
        # the revised plan again, as he would.
        new_run = await reset_before_signal(client, handle, "revise", reapply=False)
        reset = client.get_workflow_handle(handle.id, run_id=new_run)
        for _ in range(6000):  # until the reset run has taken the revision again
            again_pending = await wait_for_state(reset, "AWAITING_APPROVAL")
            if again_pending.pending_approval.plan_hash == revised.pending_approval.plan_hash:
                break
            await asyncio.sleep(0.05)
        assert again_pending.pending_approval.request_id == revised.pending_approval.request_id  # derived, not drawn
        await reset.signal("approve", approval_for(again_pending, "bob"))
        again = await outcome_of(client, handle.id, new_run)
    assert again.state.value == "COMPLETED"
    assert [s.tool_call_id for s in again.steps] == [s.tool_call_id for s in first.steps]
    assert [r["amount_cents"] for r in refunds_of(billing, handle.id)] == [203]


async def test_reset_before_a_plain_approval_refunds_once(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    client = dev_env.client
    async with running_worker(client) as worker:
        handle = await start_run(client, worker, make_request([refund(304)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        assert (await run_outcome(handle)).state.value == "COMPLETED"
        new_run = await reset_before_signal(client, handle, "approve")
        assert (await outcome_of(client, handle.id, new_run)).state.value == "COMPLETED"
    assert len(refunds_of(billing, handle.id)) == 1
