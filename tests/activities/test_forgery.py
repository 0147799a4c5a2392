"""Authority comes from keys, not from history: a worker without the fleet's key can write
history but never make a write happen. Each forgery is tried by a real rogue worker process (or
a raw gRPC poller) on a real dev server with the real billing service; the honest worker then
takes over and must stop the run where it stands: its workflow task fails naming the forgery,
no write and no undo happen."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

from temporalio.api.common.v1 import Payloads
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

import pytest

import tether.client as tether_client
from tether.repair import repair
from tether.store.keys import KeyRing
from activities.policy_checks import PolicyStore
from tests.helpers.billing import Billing
from tests.helpers.paths import ROOT
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import audit_collected, task_failure, wait_for_state
from tests.helpers.cli import Cli
from tests.helpers.rogue import CONVERTER, continue_as_new, rogue_answer
from workflows.contract import CompensationCall
from workflows.wire import RecoverySource, ToolCall, ToolOutcome
from temporalio.contrib.pydantic import pydantic_data_converter as CONVERTER_CLIENT
from workflows.run_state import RunData, RunOutcome, RunRequest
from workflows.states import RunState
from tests.helpers.queries import events_of
from tests.helpers.billing import emails_to
from tests.helpers.wedged import HELD, RELEASED, WEDGED_POLICY

REFUND = {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 123, "reason": "victim"}}
READ = {"tool": "get_order", "args": {"order_id": "A-1001"}}


async def victims_refund(client: Client, worker, billing: Billing) -> tuple[CompensationCall, dict]:
    """Another run's approved refund, and its undo as that run recorded it."""
    handle = await start_run(client, worker, make_request([REFUND]))
    snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    await handle.signal("approve", approval_for(snap, "bob"))
    outcome = await tether_client.run_outcome(handle)
    undo = next(c for c in outcome.compensations if c.of_tool == "issue_refund")
    refund = billing.refunds(undo.idempotency_key.removesuffix(":undo"))[0]
    return undo, refund


def voided(billing: Billing, refund: dict) -> bool:
    return next(r for r in billing.refunds() if r["refund_id"] == refund["refund_id"])["voided_at"] is not None


async def test_a_rogue_worker_answering_recovery_source_makes_no_undo(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """The review's first forgery: a worker with a non-fleet ring answers a compensation run's
    `recovery_source` with the void of another run's refund (plan hash "x"); then the honest
    worker takes over. Before: it minted a capability and voided the refund."""
    client = dev_env.client
    fleet = KeyRing.from_env()
    queue = unique("tq")
    async with running_worker(client, task_queue=queue) as worker:
        undo, refund = await victims_refund(client, worker, billing)
        original = await start_run(client, worker, make_request([READ]))  # made no write at all
        assert (await tether_client.run_outcome(original)).state == RunState.COMPLETED
    forged = RecoverySource(run_id=original.id, state=RunState.EXECUTION_FAILED,
                            compensations=[undo.model_copy(update={"plan_hash": "x"})])
    rogue = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.rogue_worker", client.service_client.config.target_host, client.namespace,
         queue, fleet.newest, forged.model_dump_json()],
        cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert rogue.stdout is not None and (await asyncio.to_thread(rogue.stdout.readline)).strip() == b"ready"
        request = RunRequest(goal=f"compensate run {original.id}", requested_by="carol", compensate_run=original.id)
        compensation = await tether_client.start_run(client, request, run_id=unique("comp"), queue=queue)
        for _ in range(6000):  # until the rogue's forged answer is in the run's history
            if await events_of(client, compensation.id, EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED) and any(
                e.activity_task_scheduled_event_attributes.activity_type.name == "recovery_source"
                for e in await events_of(client, compensation.id, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
            ) and len(await events_of(client, compensation.id, EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED)) >= 2:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the rogue never answered recovery_source")
    finally:
        rogue.terminate()
        rogue.wait()
    async with running_worker(client, task_queue=queue):
        message = await task_failure(client, compensation.id, "forgery")
        assert "answer of activity" in message and f"tether repair {compensation.id}" in message
        # Whatever the rogue scheduled with its own "capability" is refused by the honest tool worker.
        for _ in range(200):
            if not (await compensation.describe()).raw_description.pending_activities:
                break
            await asyncio.sleep(0.05)
        assert not voided(billing, refund)
        assert (await compensation.describe()).status.name == "RUNNING"  # where it stood
        # The operator's way out, as the failure says: reset to before the forged task. The
        # honest worker then reads the original's own record: it made no write, nothing to undo.
        # The operator names the task before the first forged answer (`tether repair RUN
        # --event-id N`): the history shows which answers the rogue wrote (its identity).
        events = (await compensation.fetch_history()).events
        forged_at = min(e.event_id for e in events if e.HasField("activity_task_completed_event_attributes"))
        point = max(e.event_id for e in events if e.HasField("workflow_task_completed_event_attributes") and e.event_id < forged_at)
        await repair(client, compensation.id, reason="a worker without the fleet key answered it", event_id=point)
        latest = client.get_workflow_handle(compensation.id, result_type=RunOutcome)
        outcome = await asyncio.wait_for(tether_client.run_outcome(latest), 300)
    assert outcome.state in (RunState.FAILED, RunState.COMPENSATED), outcome.state
    assert not [c for c in outcome.compensations if c.status == "ok"]
    assert not voided(billing, refund)


async def test_a_forged_continue_as_new_state_makes_no_undo(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """The review's second forgery: a keyless poller continues a waiting run as new with a state
    of its own (COMPENSATING, another run's refund to void) and a seal naming the fleet's key."""
    client = dev_env.client
    fleet = KeyRing.from_env()
    queue = unique("tq")
    async with running_worker(client, task_queue=queue) as worker:
        undo, refund = await victims_refund(client, worker, billing)
        waiting = await start_run(client, worker, make_request([REFUND]))
        snap = await wait_for_state(waiting, "AWAITING_APPROVAL")
    state = RunData()
    state.lifecycle.state = RunState.COMPENSATING
    state.compensations = [undo]
    request = make_request([REFUND]).model_dump(mode="json")
    forged = {**request, "carryover": state.model_dump(mode="json"), "carryover_seal": f"{fleet.newest}:{'0' * 64}"}
    await waiting.signal("approve", approval_for(snap, "mallory"))  # gives the rogue a workflow task
    await rogue_answer(client, queue, waiting.id, [continue_as_new(queue, Payloads(payloads=[CONVERTER.to_payload(forged)]))])
    async with running_worker(client, task_queue=queue):
        message = await task_failure(client, waiting.id, "forgery")
    assert "the carried state" in message
    assert not voided(billing, refund)
    assert not await events_of(client, waiting.id, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)


@pytest.mark.parametrize("by", ["dana", "mallory"])
async def test_a_run_wedged_by_a_forged_answer_to_an_unsafe_write_ends_handed_off_on_the_record(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, by: str
) -> None:
    """Issue 46: a keyless client completes the email's activity task while the honest worker is
    inside the call (the email is sent). The forged answer is refused and every workflow task
    fails; `repair` would send the email again, so it refuses; a plain hand-off never reaches the
    run. `tether handoff RUN --force` ends it HANDED_OFF, the email on the record as in flight
    (outcome unknown), by whom, and never sent again. By someone the tenant refuses (mallory):
    the hand-off is refused, and still the email is not sent again (HANDED_OFF by the runtime)."""
    client = dev_env.client
    queue, to = unique("wedged"), f"{uuid.uuid4().hex[:10]}@example.com"
    step = {"tool": "held_email", "args": {"to": to, "subject": "Refund", "body": "Your refund is on its way."}}
    forger = await Client.connect(  # holds no key: a client of the namespace, nothing more
        client.service_client.config.target_host, namespace=client.namespace, data_converter=CONVERTER_CLIENT,
    )
    (tmp_path / "policy.toml").write_text(WEDGED_POLICY)
    policy = PolicyStore(tmp_path / "policy.toml")
    cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
    async with running_worker(client, task_queue=queue, registry=HELD, policy=policy) as worker:
        try:
            handle = await start_run(client, worker, make_request([step]))
            await handle.signal("approve", approval_for(await wait_for_state(handle, "AWAITING_APPROVAL"), "bob"))
            while len(emails_to(billing, to)) < 1:  # the honest worker is inside the call: the email is out
                await asyncio.sleep(0.05)
            base = (await handle.describe()).run_id
            [scheduled] = [e.activity_task_scheduled_event_attributes
                           for e in await events_of(client, handle.id, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
                           if e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"]
            await forger.get_async_activity_handle(workflow_id=handle.id, run_id=base, activity_id=scheduled.activity_id).complete(
                ToolOutcome(observation='{"sent": false}', digest="0" * 64, size=15)
            )
            message = await task_failure(client, handle.id, "forgery")
        finally:
            RELEASED.setdefault(to, threading.Event()).set()  # the honest answer comes too late
        assert "The forged answer was refused" in message and "may have applied" in message
        assert "Nothing was written" not in message and f"tether handoff {handle.id} --force" in message
        code, out, err = await cli("repair", handle.id)
        assert code == 1 and "not safe to repeat" in err and f"tether handoff {handle.id} --force" in err, (out, err)
        code, out, err = await cli("handoff", handle.id, "--by", by, "--reason", "forged answer")
        assert code == 1 and "is stuck" in err and "--force" in err, (out, err)
        code, out, err = await cli("handoff", handle.id, "--by", by, "--reason", "forged answer", "--force")
        tool_call_id = scheduled_call(scheduled).tool_call_id
        if by == "dana":
            assert code == 0 and "HANDED_OFF: handed off by dana" in out, (out, err)
            assert f"in flight, may have applied, not run again: {tool_call_id}" in out, (out, err)
        else:
            assert code == 1 and "mallory is not a member of this tenant" in err, (out, err)
            assert "was reset all the same" in err and f"{tool_call_id} (may have applied)" in err, (out, err)
        latest = client.get_workflow_handle(handle.id, result_type=RunOutcome)
        outcome = await asyncio.wait_for(tether_client.run_outcome(latest), 120)
        trail = await audit_collected(client, handle.id)
    if by == "dana":
        assert outcome.state == RunState.HANDED_OFF
        # (The approval took effect in the task that scheduled the email, so the reset went back
        # to before it: the approval signal it reapplies is refused on the record, run_ended.)
        [ended] = [r for r in outcome.timeline if r.kind == "transition" and r.to_state == RunState.HANDED_OFF]
        assert ended.refs.outcome == "unknown" and ended.refs.tool_call_id == tool_call_id
        assert ended.actor == "operator:dana"
        assert "was in flight when its run was ended: it may have applied, outcome unknown; not run again" in ended.reason
        assert [(s.tool_call_id, s.outcome) for s in outcome.steps] == [(tool_call_id, "unknown")]
    else:
        # The refused hand-off's names change nothing (anyone who may signal can send them): the
        # write is scheduled again, and the effect ledger answers with what the attempt the
        # forger answered did: the email, sent once; the run completes on the real outcome.
        assert outcome.state == RunState.COMPLETED
        assert [(s.tool_call_id, s.outcome) for s in outcome.steps] == [(tool_call_id, "ok")]
    assert len(emails_to(billing, to)) == 1  # sent once, by the attempt the forger answered; never again
    assert [b.origin for b in trail.branches] == ["first", "reset"]
    assert f"tether handoff --force by {by}: forged answer" in (trail.branches[1].reason or "")


def scheduled_call(scheduled) -> ToolCall:  # noqa: ANN001
    [found] = CONVERTER_CLIENT.payload_converter.from_payloads(scheduled.input.payloads, [ToolCall])
    return found
