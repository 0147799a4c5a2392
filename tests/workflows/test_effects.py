"""Effects exactly once under slow attempts, cancels and exhausted retries (issue 13), on the
dev server with the real billing service.

The tools here count effects where nothing deduplicates them: the billing service's emails
endpoint keeps every POST, found again by its ``X-Request-Ref``. (The ledger's UNIQUE key would
turn a duplicate into a 409 and hide the race.) Attempts are held on events the test releases,
so "the attempt is still running when the retry would start" is a fact, not a timing.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from worker import create_replayer

from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot, timeline
from tests.helpers.runs import running_worker
from tests.helpers.waiting import wait_for_state
from tests.helpers.invariants import check_timeline
from workflows.agent_run import AgentRun
from workflows.contract import HandoffRequest
from workflows.run_state import RunOutcome
from workflows.states import RunState
from tests.helpers.effect_tools import ATTEMPTS, DONE, GATES, REGISTRY, _event, approved_run, emails

S = RunState


def last_step_end(outcome: RunOutcome):
    record = outcome.timeline[-1]
    check_timeline(outcome.timeline, {s.tool_call_id: s.tool for s in outcome.steps})
    return record


async def test_a_retry_never_races_the_attempt_it_replaces(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """Case 1: attempt 1 outlives its deadline and writes late. Before, attempt 2's lookup ran
    while attempt 1 still hung, found nothing and wrote too: two effects under one key."""
    tag = uuid.uuid4().hex[:8]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle, key, call_id = await approved_run(dev_env, worker, "held_note", tag)
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
        # The run is over; now the hung attempt writes (what a late commit looks like).
        _event(GATES, tag).set()
        assert await asyncio.to_thread(_event(DONE, tag).wait, 30)
        last_error = (await snapshot(handle)).last_error
    assert emails(billing, key) == 1, "one effect per key"
    assert ATTEMPTS[tag] == 1, "no second attempt while the first may still run"
    # The attempt could not be shown over: a human decides, and the record says the outcome is unknown.
    assert outcome.state == S.HANDED_OFF
    record = last_step_end(outcome)
    assert record.refs.outcome == "unknown" and record.refs.error_code == "attempt_still_running"
    assert call_id in record.reason and "outcome unknown" in record.reason
    assert [(s.status, s.outcome) for s in outcome.steps] == [("failed", "unknown")]
    assert last_error == f"attempt_still_running: tool call {call_id} (held_note), outcome unknown"


async def test_an_attempt_that_finishes_in_the_grace_period_counts(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    tag = uuid.uuid4().hex[:8]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle, key, _ = await approved_run(dev_env, worker, "late_note", tag)
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
    assert outcome.state == S.COMPLETED
    assert emails(billing, key) == 1 and ATTEMPTS[tag] == 1
    assert [(s.status, s.outcome) for s in outcome.steps] == [("ok", "ok")]
    done = [r for r in outcome.timeline if r.to_state == S.OBSERVING_RESULT]
    assert done[0].refs.outcome == "ok"


@pytest.mark.parametrize(
    ("tool_name", "outcome", "code"),
    [("async_email", "unknown", "cancelled_mid_call"), ("patient_email", "ok", "cancelled")],
)
async def test_a_cancel_during_an_unsafe_tool_records_its_outcome(
    dev_env: WorkflowEnvironment, billing: Billing, tool_name: str, outcome: str, code: str
) -> None:
    """Case 2: the cancel reaches the tool through its heartbeat; the run ends CANCELLED with
    the email's outcome on the step, the record and last_error (before: nothing said it was sent)."""
    tag = uuid.uuid4().hex[:8]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle, key, call_id = await approved_run(dev_env, worker, tool_name, tag)
        assert await asyncio.to_thread(_event(DONE, tag).wait, 30)  # the email went out
        await handle.cancel(reason="customer withdrew")
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 60)
        records = await timeline(handle)
        snap = await snapshot(handle)
        history = await handle.fetch_history()
    # The cancel's path through the workflow replays as it ran (the queries above replay it too).
    replayer = create_replayer()
    assert (await replayer.replay_workflow(history, raise_on_replay_failure=False)).replay_failure is None
    assert emails(billing, key) == 1
    last = records[-1]
    assert last.to_state == S.CANCELLED and last.from_state == S.EXECUTING_TOOL
    assert "customer withdrew" in last.reason and call_id in last.reason and f"outcome {outcome}" in last.reason
    assert last.refs.tool_call_id == call_id and last.refs.outcome == outcome
    assert snap.last_error == f"{code}: tool call {call_id} ({tool_name}), outcome {outcome}"
    assert snap.step == 1  # the step is recorded as executed


async def test_an_idempotent_tool_unknown_after_its_last_retry_is_not_failed(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Case 3: every attempt commits, then the service answers 503. Before, the run ended
    EXECUTION_FAILED with the step `failed` though the refund existed."""
    tag = uuid.uuid4().hex[:8]
    billing.fail_next("refunds", 2, status=503, when="after_commit")
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle, key, call_id = await approved_run(dev_env, worker, "quick_refund", tag)
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
        last_error = (await snapshot(handle)).last_error
    assert len(billing.refunds(key)) == 1 and ATTEMPTS[tag] == 2
    assert outcome.state == S.HANDED_OFF
    record = last_step_end(outcome)
    assert record.refs.outcome == "unknown" and "retries exhausted (1/1), outcome unknown" in record.reason
    assert [(s.status, s.outcome) for s in outcome.steps] == [("failed", "unknown")]
    assert last_error == f"injected_fault: tool call {call_id} (quick_refund), outcome unknown"
    # The record names the code, never the error's text (it may quote arguments).
    assert "injected 503" not in record.reason and "injected 503" not in last_error
    waits = [r for r in outcome.timeline if r.to_state == S.RETRY_WAIT]
    assert [r.refs.outcome for r in waits] == ["unknown"]


async def test_a_handoff_before_a_retry_names_the_outcome_of_the_attempt_before(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    tag = uuid.uuid4().hex[:8]
    billing.fail_next("refunds", 1, status=503, when="after_commit")
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle, key, call_id = await approved_run(dev_env, worker, "patient_refund", tag)
        await wait_for_state(handle, "RETRY_WAIT")  # the retry waits >= 5 s: the grace period
        await handle.signal("handoff", HandoffRequest(by="dana", reason="customer called"))
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
        last_error = (await snapshot(handle)).last_error
    assert len(billing.refunds(key)) == 1 and ATTEMPTS[tag] == 1
    assert outcome.state == S.HANDED_OFF
    record = last_step_end(outcome)
    assert record.actor == "operator:dana" and record.refs.outcome == "unknown"
    assert f"retry of tool call {call_id} (patient_refund) not started, outcome unknown" in record.reason
    assert [(s.status, s.outcome) for s in outcome.steps] == [("failed", "unknown")]
    assert last_error == f"handed_off: tool call {call_id} (patient_refund), outcome unknown"
