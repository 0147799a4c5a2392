"""Redelivered and late events: each one settles once or is refused with a record, and no run
reaches EXECUTING_TOOL for a write step without an accepted approval of the current plan hash
(``tests/helpers/invariants.py`` checks that over every timeline here).

Already covered in tests/workflows/test_agent_run.py, not repeated: a repeated decision id (sent one
after the other), a stale plan hash, a decision for a run that is no longer waiting.

"An approval for an old plan after a replan" needs a replan that changes the plan: the playbook
planner proposes the same steps again (same hash), so this uses the model planner against the
local fake OpenAI endpoint (examples/fake_openai.py), scripted to propose a different refund after
the first approval request expired (``on_expiry="replan"``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator

import pytest

import tether.client as tether_client
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot, timeline
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from examples.fake_openai import FakeOpenAI, call, text, tool_calls
from tests.helpers.invariants import check_timeline, tools_by_call
from workflows.contract import ApprovalDecision, HandoffRequest
from workflows.run_state import RunSnapshot, RunOutcome
from workflows.states import RunState

S = RunState


def refund(amount: int = 300, order: str = "A-1002") -> dict:
    return {"tool": "issue_refund", "args": {"order_id": order, "amount_cents": amount, "reason": "late"}}


def approval(target: RunSnapshot | str, decision_id: str | None = None, approver: str = "bob") -> ApprovalDecision:
    return approval_for(target, approver, decision_id)


def path(records) -> list[str]:
    return [r.to_state.value for r in records if r.kind == "transition"]


def refusals(records) -> list[str]:
    return [r.reason for r in records if r.kind == "refused"]


async def settle(handle: WorkflowHandle) -> RunOutcome | None:
    """The run's outcome, or None when it ended cancelled (the timeline is then queried)."""
    try:
        outcome = await run_outcome(handle)
    except WorkflowFailureError:
        return None
    return None if outcome.state == RunState.CANCELLED else outcome  # read back from the queries


# ----------------------------------------------------------------------------- redelivery


async def test_the_same_approval_delivered_twice_at_once_settles_once(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund()]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        decision = approval(snap, decision_id="once")
        # Both copies in flight together: they may land in the same workflow task.
        await asyncio.gather(handle.signal("approve", decision), handle.signal("approve", decision))
        outcome = await run_outcome(handle)
    check_timeline(outcome.timeline, tools_by_call(outcome))
    assert outcome.state == S.COMPLETED
    assert path(outcome.timeline).count("APPROVED") == 1
    assert [r.refs.decision_id for r in outcome.timeline if r.kind == "refused"] == ["once"]
    assert "duplicate decision_id once" in refusals(outcome.timeline)[0]
    key = next(r.refs.idempotency_key for r in outcome.timeline if r.refs.idempotency_key)
    assert len(billing.refunds(key)) == 1


async def test_racing_approve_and_reject_settle_once(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund()]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        h = snap
        await asyncio.gather(
            handle.signal("approve", approval(h, "yes", "bob")),
            handle.signal("reject", approval_for(h, "carol", "no", reason="no")),
        )
        outcome = await run_outcome(handle)
    check_timeline(outcome.timeline, tools_by_call(outcome))
    decided = [r for r in outcome.timeline if r.kind == "transition" and r.to_state in (S.APPROVED, S.REJECTED)]
    refused = [r for r in outcome.timeline if r.kind == "refused"]
    assert len(decided) == 1 and len(refused) == 1
    assert {decided[0].refs.decision_id, refused[0].refs.decision_id} == {"yes", "no"}
    assert outcome.state == (S.COMPLETED if decided[0].to_state == S.APPROVED else S.REJECTED)


# ----------------------------------------------------------------------------- late


async def test_approval_after_expiry_is_refused_and_nothing_runs(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    before = billing.get("/admin/stats")["requests"].get("POST /refunds", 0)
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund()], limits={"approval_ttl_seconds": 60}))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await ts_env.sleep(61)  # the durable timer fires on skipped time
        outcome = await run_outcome(handle)
        with pytest.raises(RPCError) as refused:
            await handle.signal("approve", approval(snap))
        records = await timeline(handle)
    # The closed run refuses the late signal at the server: the sender gets the error.
    assert refused.value.status == RPCStatusCode.NOT_FOUND and "completed" in refused.value.message.lower()
    assert outcome.state == S.EXPIRED and records == outcome.timeline
    check_timeline(records, tools_by_call(outcome))
    assert "EXECUTING_TOOL" not in path(records) and outcome.steps == []
    assert billing.get("/admin/stats")["requests"].get("POST /refunds", 0) == before


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[FakeOpenAI]:
    caplog.set_level(logging.INFO)
    with FakeOpenAI() as server:
        monkeypatch.setenv("TETHER_MODEL", "fake-model")
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "not-a-secret")
        monkeypatch.setenv("TETHER_MODEL_TIMEOUT", "10")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        yield server


async def test_approval_for_the_old_plan_after_a_replan_is_refused(
    ts_env: WorkflowEnvironment, billing: Billing, fake: FakeOpenAI
) -> None:
    first = {"order_id": "A-1002", "amount_cents": 111, "reason": "first plan"}
    second = {"order_id": "A-1002", "amount_cents": 222, "reason": "second plan"}
    fake.script(
        tool_calls(call("issue_refund", first)),
        tool_calls(call("issue_refund", second)),
        text("Refunded 2.22 EUR."),
    )
    request = make_request(
        [], goal="Refund A-1002", planner="model",
        limits={"approval_ttl_seconds": 60, "on_expiry": "replan", "max_replans": 1},
    )
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, request)
        old = await wait_for_state(handle, "AWAITING_APPROVAL")
        await ts_env.sleep(61)  # expires: back to PLANNING, the model proposes another refund
        for _ in range(200):
            new = await snapshot(handle)
            if new.state == S.AWAITING_APPROVAL and new.plan.plan_hash != old.plan.plan_hash:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"no second plan: {new.state.value}")
        version = new.state_version
        await handle.signal("approve", approval(old, "old-plan"))
        after = await snapshot(handle)
        assert (after.state, after.state_version) == (S.AWAITING_APPROVAL, version)
        await handle.signal("approve", approval(new, "new-plan"))
        outcome = await run_outcome(handle)
    check_timeline(outcome.timeline, tools_by_call(outcome, [old.plan, new.plan]))
    assert outcome.state == S.COMPLETED
    (stale,) = [r for r in outcome.timeline if r.refs.decision_id == "old-plan"]
    assert stale.kind == "refused" and "does not match the plan under review" in stale.reason
    approved = next(r for r in outcome.timeline if r.to_state == S.APPROVED)
    assert approved.refs.decision_id == "new-plan" and approved.refs.plan_hash == new.plan.plan_hash
    # Only the second plan's refund happened.
    amounts = [r["amount_cents"] for s in outcome.steps for r in billing.refunds(f"{handle.id}:{s.tool_call_id}")]
    assert amounts == [222]


async def _approve_or_refused(handle: WorkflowHandle, decision: ApprovalDecision) -> None:
    try:
        await handle.signal("approve", decision)
    except RPCError as e:  # the run already ended: the server refuses the signal to the sender
        assert e.status == RPCStatusCode.NOT_FOUND, e


@pytest.mark.parametrize("order", ["approve-then-cancel", "cancel-then-approve", "together"])
async def test_cancel_racing_an_approval_settles_once(
    dev_env: WorkflowEnvironment, billing: Billing, order: str
) -> None:
    # The dev server, in real time: a cancel that reaches a tool through its heartbeat once
    # stalled time skipping on the shared time-skipping server in a full run (not reproducible
    # alone); nothing here needs a timer.
    ts_env = dev_env
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund()]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        approve = _approve_or_refused(handle, approval(snap, "racing"))
        cancel = handle.cancel(reason="customer withdrew")
        if order == "approve-then-cancel":
            await approve
            await cancel
        elif order == "cancel-then-approve":
            await cancel
            await approve
        else:
            await asyncio.gather(approve, cancel)
        outcome = await settle(handle)
        records = await timeline(handle)
        status = (await handle.describe()).status
    check_timeline(records, tools_by_call(outcome, [snap.plan]))
    assert outcome is None and status == WorkflowExecutionStatus.CANCELED
    key = f"{handle.id}:{snap.plan.steps[0].tool_call_id}"
    refunds = billing.refunds(key)
    if "EXECUTING_TOOL" in path(records):
        # The approval won: the step was entered, and its call settled before the run ended. The
        # record says whether the call reached the tool before the cancel reached the call (ok:
        # one refund) or not (failed: none); the approval no longer waits for an activity, so
        # the cancel can meet the call before its worker calls the tool.
        outcomes = [r.refs.outcome for r in records if r.refs.outcome]
        expected = {"ok": [1], "failed": [0], "unknown": [0, 1]}[outcomes[-1]]
        assert len(refunds) in expected, [(r.to_state.value, r.reason, r.refs.outcome) for r in records]
    else:
        assert refunds == []
    # Whether the timeline ends in CANCELLED whatever the interleaving is what the two tests
    # below pin down deterministically.


async def test_cancel_and_approval_in_one_workflow_task_end_cancelled_on_the_timeline(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    # The dev server: a stopped worker gives its sticky queue back, so the next worker gets the
    # task at once (the time-skipping test server would hold it on the old sticky queue).
    queue = f"late-{uuid.uuid4().hex[:8]}"
    async with running_worker(dev_env.client, task_queue=queue) as worker:
        handle = await start_run(dev_env.client, worker, make_request([refund()]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    # No worker polls now: both events land in the run's next workflow task, together.
    await handle.signal("approve", approval(snap, "together"))
    await handle.cancel(reason="customer withdrew")
    async with running_worker(dev_env.client, task_queue=queue):
        assert await asyncio.wait_for(settle(handle), 30) is None
        records = await timeline(handle)
        final = await snapshot(handle)
    check_timeline(records, tools_by_call(None, [snap.plan]))
    assert final.state == S.CANCELLED, f"run ended Temporal-cancelled but its state is {final.state.value}"
    moves = [r for r in records if r.kind == "transition"]
    assert moves[-1].to_state == S.CANCELLED and "customer withdrew" in moves[-1].reason
    # The approval is answered on the record once, not dropped (issue 19): refused, where the
    # cancel overtook it, or taken in arrival order (bob is on the run's roster, so no activity
    # stands between it and the write), the write then stopped by the cancel before it started.
    decided = [(r.kind, r.rule, r.to_state) for r in records if r.refs.decision_id == "together"]
    assert decided in ([("refused", "run_ended", S.CANCELLED)], [("transition", None, S.APPROVED)]), decided
    if decided[0][0] == "transition":
        assert [r.refs.outcome for r in records if r.refs.outcome] == ["failed"], [r.reason for r in records]
    assert billing.refunds(f"{handle.id}:{snap.plan.steps[0].tool_call_id}") == []


async def test_cancel_before_the_run_starts_ends_cancelled_on_the_timeline(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    queue = f"late-{uuid.uuid4().hex[:8]}"
    request = make_request([refund()])
    handle = await tether_client.start_run(ts_env.client, request, run_id=f"late-{uuid.uuid4().hex[:8]}", queue=queue)
    await handle.cancel(reason="changed my mind")
    async with running_worker(ts_env.client, task_queue=queue):
        assert await asyncio.wait_for(settle(handle), 30) is None
        records = await timeline(handle)
    check_timeline(records)
    assert records and records[-1].to_state == S.CANCELLED and "changed my mind" in records[-1].reason


async def test_handoff_after_completion_is_refused(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    read = {"tool": "get_order", "args": {"order_id": "A-1001"}}
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([read]))
        outcome = await run_outcome(handle)
        with pytest.raises(RPCError) as refused:
            await handle.signal("handoff", HandoffRequest(by="dana", reason="too late"))
        final = await snapshot(handle)
    assert refused.value.status == RPCStatusCode.NOT_FOUND
    assert outcome.state == S.COMPLETED and final.state == S.COMPLETED
    assert final.state_version == outcome.timeline[-1].state_version
    check_timeline(outcome.timeline, tools_by_call(outcome))


async def test_handoff_while_a_tool_runs_settles_after_the_tool(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    # The refund's first call fails after the commit: the handoff arrives while the run waits to
    # retry, and twice (a redelivery): it is honoured once, and never mid-call.
    billing.fail_next("refunds", 1, status=503, when="after_commit")
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund(400)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval(snap))
        await wait_for_state(handle, "RETRY_WAIT", "OBSERVING_RESULT", "PLANNING", "COMPLETED")
        request = HandoffRequest(by="dana", reason="customer called")
        try:
            await asyncio.gather(handle.signal("handoff", request), handle.signal("handoff", request))
        except RPCError:
            pass  # the run may already have completed: then the server refuses it
        outcome = await run_outcome(handle)
    check_timeline(outcome.timeline, tools_by_call(outcome, [snap.plan]))
    assert outcome.state in (S.HANDED_OFF, S.COMPLETED)
    assert path(outcome.timeline).count("HANDED_OFF") <= 1
    key = f"{handle.id}:{snap.plan.steps[0].tool_call_id}"
    assert len(billing.refunds(key)) == 1  # committed once, whoever won
