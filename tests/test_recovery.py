"""Declared recovery end to end: the billing service behind the tools, a real Temporal server.

A refund and a ledger entry succeed, then an email fails: with ``on_failure="compensate"`` the
run puts both back (COMPENSATING -> COMPENSATED), each undo exactly once on the service; a
compensation that fails hands off naming it; ``tether compensate`` after a hand-off undoes the
ok writes in a governed run of its own.
"""

from __future__ import annotations

import pytest
from temporalio.testing import WorkflowEnvironment

import client as tether_client
from tests.invariants import check_timeline, tools_by_call
from tests.conftest import (
    Billing,
    approval_for,
    make_request,
    running_worker,
    snapshot,
    start_run,
    wait_for_state,
)
from workflows.models import RunOutcome
from workflows.states import RunState, is_legal_path

S = RunState
REFUND = {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 1500, "reason": "damaged"}}
LEDGER = {"tool": "post_ledger_entry", "args": {"order_id": "A-1002", "amount_cents": -1500, "memo": "refund A-1002"}}
EMAIL = {"tool": "send_email", "args": {"to": "grace@example.com", "subject": "Your refund", "body": "refunded"}}
PLAN = [REFUND, LEDGER, EMAIL]


def path(outcome: RunOutcome) -> list[str]:
    return [r.to_state.value for r in outcome.timeline if r.kind == "transition"]


async def approved_run(env: WorkflowEnvironment, worker, **request) -> RunOutcome:
    handle = await start_run(env.client, worker, make_request(PLAN, **request))
    snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    # The approver sees how each write is undone, and which cannot be.
    summary = snap.pending_approval.summary
    assert "issue_refund (idempotent, order_id=A-1002, amount_cents=1500, undo: `void_refund`)" in summary
    assert "post_ledger_entry (reconcilable, order_id=A-1002, amount_cents=-1500, undo: `reverse_ledger_entry`)" in summary
    assert "send_email (unsafe, subject=Your refund, no recovery path)" in summary
    await handle.signal("approve", approval_for(snap, "bob"))
    return await handle.result()


def undo_state(billing: Billing, outcome: RunOutcome) -> tuple[list[dict], list[dict]]:
    """The refund the run issued, and the ledger entries of its order key (entry, reversals)."""
    refund_call = next(c for c in outcome.compensations if c.of_tool == "issue_refund")
    ledger_call = next(c for c in outcome.compensations if c.of_tool == "post_ledger_entry")
    refunds = billing.refunds(refund_call.idempotency_key.removesuffix(":undo"))
    entry_id = ledger_call.args["entry_id"]
    reversals = billing.get(f"/ledger?reverses={entry_id}")["entries"]
    return refunds, reversals


async def test_a_permanent_failure_puts_the_ok_writes_back_exactly_once(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    billing.fail_next("emails", 1, status=400)  # the email is refused: known not sent
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker, on_failure="compensate")
    assert outcome.state == S.COMPENSATED, outcome.timeline[-1].reason
    check_timeline(outcome.timeline, tools_by_call(outcome))
    assert path(outcome)[-4:] == ["COMPENSATING", "COMPENSATING", "COMPENSATING", "COMPENSATED"]
    # Newest first: the ledger entry is reversed before the refund is voided.
    undone = [r for r in outcome.timeline if r.from_state == S.COMPENSATING and r.to_state == S.COMPENSATING]
    assert ["reverse_ledger_entry" in undone[0].reason, "void_refund" in undone[1].reason] == [True, True]
    refund_call = next(c for c in outcome.compensations if c.of_tool == "issue_refund")
    assert undone[1].refs.idempotency_key == refund_call.idempotency_key
    assert refund_call.idempotency_key.endswith(":undo") and refund_call.plan_hash
    assert [c.status for c in outcome.compensations] == ["ok", "ok"]
    # The email had no recovery path and was never sent: nothing to undo.
    assert all(c.of_tool != "send_email" for c in outcome.compensations)
    refunds, reversals = undo_state(billing, outcome)
    assert len(refunds) == 1 and refunds[0]["voided_at"] is not None
    assert len(reversals) == 1 and reversals[0]["amount_cents"] == 1500


async def test_stop_is_the_default_and_keeps_the_writes(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    billing.fail_next("emails", 1, status=400)
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker)
    assert outcome.state == S.EXECUTION_FAILED
    assert "COMPENSATING" not in path(outcome)
    refunds, reversals = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is None and reversals == []
    assert [c.status for c in outcome.compensations] == ["pending", "pending"]


async def test_a_compensation_that_fails_hands_off_naming_it_and_compensate_finishes(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    billing.fail_next("emails", 1, status=400)
    billing.fail_next("voids", 1, status=400)  # the service refuses the void: not re-run
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker, on_failure="compensate")
        assert outcome.state == S.HANDED_OFF
        last = outcome.timeline[-1]
        assert last.from_state == S.COMPENSATING and "void_refund" in last.reason
        assert "not re-run" in last.reason and last.refs.error_code == "injected_fault"
        assert [c.status for c in outcome.compensations] == ["failed", "ok"]
        refunds, reversals = undo_state(billing, outcome)
        assert refunds[0]["voided_at"] is None and len(reversals) == 1
        voids = billing.get("/admin/stats")["requests"]["POST /refunds/{id}/void"]

        # A person with an approval role decides to undo the rest: a governed run of its own.
        handle = await tether_client.compensate(ts_env.client, outcome.run_id, by="carol", queue=worker.task_queue)
        undo = await handle.result()
    assert undo.state == S.COMPENSATED, undo.timeline[-1].reason
    first = next(r for r in undo.timeline if r.to_state == S.COMPENSATING)
    assert first.from_state == S.RECEIVED and first.actor == "user:carol"
    assert outcome.run_id in first.reason and first.refs.plan_hash == outcome.compensations[0].plan_hash
    assert [c.of_tool for c in undo.compensations] == ["issue_refund"]  # only what was left
    refunds, reversals = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is not None and len(reversals) == 1
    assert billing.get("/admin/stats")["requests"]["POST /refunds/{id}/void"] == voids + 1


async def test_compensate_after_an_unknown_outcome_hand_off(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    # The email may have been sent (503 after the commit): the run hands off as before, even
    # with on_failure=compensate; a person then asks for the undo.
    billing.fail_next("emails", 1, status=503, when="after_commit")
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker, on_failure="compensate")
        assert outcome.state == S.HANDED_OFF and "COMPENSATING" not in path(outcome)
        handle = await tether_client.compensate(ts_env.client, outcome.run_id, by="carol", queue=worker.task_queue)
        # One compensation run per run: a second request is refused, whoever sends it.
        with pytest.raises(tether_client.TetherError, match="already has its compensation run"):
            await tether_client.compensate(ts_env.client, outcome.run_id, by="erin", queue=worker.task_queue)
        undo = await handle.result()
    assert undo.state == S.COMPENSATED, undo.timeline[-1].reason
    check_timeline(undo.timeline, tools_by_call(undo))
    assert [c.of_tool for c in reversed(undo.compensations)] == ["post_ledger_entry", "issue_refund"]
    refunds, reversals = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is not None and len(reversals) == 1


async def test_compensate_refuses_a_running_run_and_an_unknown_one(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request(PLAN))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        with pytest.raises(tether_client.TetherError, match="only an ended run"):
            await tether_client.compensate(ts_env.client, handle.id, by="carol", queue=worker.task_queue)
        # A compensation run naming a run that is not there fails, saying so (the worker reads
        # the original from the server, never from the request).
        forged = make_request([], compensate_run="no-such-run", requested_by="carol")
        undo = await start_run(ts_env.client, worker, forged)
        result = await undo.result()
        assert result.state == S.FAILED and "unknown_run" in result.timeline[-1].reason
        # (time skipped while waiting: the untouched original has expired by now, nothing ran)
        still = await snapshot(handle)
        assert still.state in (S.AWAITING_APPROVAL, S.EXPIRED) and still.compensations == []
