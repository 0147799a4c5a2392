"""Witnesses outside history (issue 39): records, views and judgement lines are the fleet's word
only when its key signed them, and an attested answer is bound to the execution that asked.

Tried as a hostile party would: a keyless poller that schedules ``audit_append`` with records of
its own (into the run's stream and into another run's), a start that sets a view of its own, a
view that shows other arguments than the plan it binds, a hand-written judgement line, a reset
run asked to accept the original execution's answers. Real dev servers, real workers."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
from temporalio.api.command.v1 import Command
from temporalio.api.enums.v1 import CommandType, EventType
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tether.audit.sink import JsonlAuditSink
from tether.audit.verify import verify_streams
from tether.policy.judgements import JsonlJudgementLog, sign as sign_line
from tether.store.keys import KeyRing, PublicKeys
from tether.inbox import desk
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import audit_collected, wait_for_state
from tests.helpers.cli import Cli
from tests.helpers.resets import outcome_of, reset_before_signal
from tests.helpers.rogue import rogue_answer, schedule
from workflows.published import STATE_ATTRIBUTE, TENANT_ATTRIBUTE, VIEW_MEMO
from workflows.run_state import RunSnapshot, RunView
from workflows.states import RunState, TransitionRecord, record_link
from workflows.wire import AuditBatch

CONVERTER = pydantic_data_converter.payload_converter
ORDER = "A-1001"


def refund(cents: int) -> dict:
    return {"tool": "issue_refund", "args": {"order_id": ORDER, "amount_cents": cents, "reason": "signed records"}}


def publics() -> PublicKeys:
    return KeyRing.from_env().public_keys()


def forged(seq: int, reason: str, to_state: RunState = RunState.APPROVED) -> TransitionRecord:
    return TransitionRecord(
        from_state=RunState.AWAITING_APPROVAL, to_state=to_state, at=datetime.now(timezone.utc),
        actor="user:bob", reason=reason, state_version=seq, seq=seq,
    )


async def published(handle, state: str) -> RunView:
    """The view the run published once it rests in ``state`` (it publishes where it rests, a
    moment after a query can see the state)."""
    for _ in range(600):
        view = await tether_client.published_view(await handle.describe())
        if view is not None and view.snapshot.state.value == state:
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {handle.id} never published a view in {state}")


async def activity_failures(client: Client, workflow_id: str, kind: str) -> list[str]:
    events = (await client.get_workflow_handle(workflow_id).fetch_history()).events
    return [
        e.activity_task_failed_event_attributes.failure.application_failure_info.type
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
        and e.activity_task_failed_event_attributes.failure.application_failure_info.type == kind
    ]


# ----------------------------------------------------------------------------- pure


def test_a_record_verifies_only_for_its_run_and_unchanged() -> None:
    ring = KeyRing.of(b"k" * 40, source="test")
    keys = ring.public_keys()
    from workflows import keys as ring_math
    from tether.audit.verify import record_problem

    record = forged(1, "approved")
    record.sig = ring.sign_statement(ring_math.record_statement("wf", "run-1", 1, record_link(record)))
    assert record_problem(keys, "wf", "run-1", record) is None
    assert record_problem(keys, "wf", "run-2", record)  # another stream of the same workflow id
    assert record_problem(keys, "other", "run-1", record)  # another run's stream
    changed = record.model_copy(update={"reason": "approved by the ceo"})
    assert "does not verify" in record_problem(keys, "wf", "run-1", changed)
    # An auditor needs only the published public keys.
    assert record_problem(PublicKeys.parse(keys.text(), "pub"), "wf", "run-1", record) is None
    assert record_problem(KeyRing.of(b"o" * 40).public_keys(), "wf", "run-1", record)


def test_the_chain_names_a_record_removed_or_not_in_the_chain() -> None:
    ring = KeyRing.of(b"k" * 40, source="test")
    from workflows import keys as ring_math
    from workflows.states import Lifecycle

    life = Lifecycle()
    records = [
        life.move(to, at=datetime.now(timezone.utc), actor="runtime", reason=str(to))
        for to in (RunState.PLANNING, RunState.VALIDATED, RunState.EXECUTING_TOOL, RunState.OBSERVING_RESULT)
    ]
    for r in records:
        r.sig = ring.sign_statement(ring_math.record_statement("wf", "r1", r.seq, record_link(r)))
    keys = ring.public_keys()
    assert verify_streams(keys, "wf", {"r1": records}).problems == []
    gap = verify_streams(keys, "wf", {"r1": [records[0], records[2], records[3]]}).problems
    assert gap and "seq 2..2 are missing" in gap[0]
    # A record signed for this stream but from another chain (prev is not its predecessor's link).
    other = records[1].model_copy(update={"prev": "0" * 64})
    other.sig = ring.sign_statement(ring_math.record_statement("wf", "r1", other.seq, record_link(other)))
    assert any("not chained" in p for p in verify_streams(keys, "wf", {"r1": [records[0], other, *records[2:]]}).problems)


def test_a_view_that_shows_other_arguments_than_the_plan_it_binds_offers_no_approve() -> None:
    from workflows.contract import Plan, PlanStep
    from workflows.run_state import PendingApproval

    steps = [PlanStep(tool_call_id="tc-1", tool="issue_refund", args={"order_id": ORDER, "amount_cents": 12000})]
    plan = Plan(steps=steps, plan_hash=Plan.hash_steps(steps))
    now = datetime.now(timezone.utc)
    pending = PendingApproval.model_construct(
        request_id="req-1", plan_hash=plan.plan_hash, expires_at=now.replace(year=now.year + 1), risk="normal",
        approvals=[], roles=[], required=1,
    )
    honest = RunSnapshot.model_construct(
        **{**{k: f.default for k, f in RunSnapshot.model_fields.items() if not f.is_required()},
           "run_id": "r", "state": RunState.AWAITING_APPROVAL, "plan": plan, "pending_approval": pending,
           "tenant": "default", "requested_by": "alice"}
    )
    assert tether_client.approval_offer_problem(honest) is None
    # 12.00 shown, the real 120.00 plan's hash bound: nothing is offered.
    lied = plan.model_copy(update={"steps": [steps[0].model_copy(update={"args": {"order_id": ORDER, "amount_cents": 1200}})]})
    shown = honest.model_copy(update={"plan": lied})
    assert "do not hash" in tether_client.approval_offer_problem(shown)
    refusal = desk.decide_refusal(None, shown, "bob", now=now, can_attest=False)
    assert refusal is not None and refusal.rule == "plan_unverified"


def test_a_hand_written_judgement_line_is_skipped_and_counted(tmp_path: Path) -> None:
    ring = KeyRing.from_env()
    log = JsonlJudgementLog(tmp_path)
    genuine = {"workflow_id": "refund-9", "run_id": "r", "activity_id": "a", "index": 0, "at": "2026-01-01T00:00:00+00:00",
               "tenant": "default", "person": "bob", "action": "approve", "allowed": False, "rule": "not_an_approver",
               "request": {}, "entities": []}
    log.write([sign_line(ring, genuine)])
    # Someone with write access to the log: "ceo approved refund-9", unsigned and re-signed badly.
    hand = {**genuine, "index": 1, "person": "ceo", "allowed": True, "rule": None}
    log.write([hand, {**sign_line(ring, genuine), "allowed": True}])
    read = log.read(workflow_id="refund-9", publics=ring.public_keys())
    assert [(e["person"], e["allowed"]) for e in read] == [("bob", False)]
    assert log.unverified == 2
    # Without keys (how old callers read it) every line is there.
    assert len(log.read(workflow_id="refund-9")) == 2


# ----------------------------------------------------------------------------- real servers


async def test_a_runs_records_are_signed_chained_and_verified_by_the_cli(
    dev_env: WorkflowEnvironment, billing: Billing, audit_dir: Path
) -> None:
    client = dev_env.client
    async with running_worker(client) as worker:
        handle = await start_run(client, worker, make_request([refund(111)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        assert (await tether_client.run_outcome(handle)).state == RunState.COMPLETED
        trail = await audit_collected(client, handle.id)
        assert trail.unverified == [] and trail.verified == trail.written
        cli = Cli(dev_env, worker)
        code, out, err = await cli("audit", "verify", handle.id)
        assert code == 0, out + err
        assert "every signature and chain link verifies" in out
        # Someone with write access to the sink adds a line: verify names it and exits 1.
        sink = JsonlAuditSink(audit_dir)
        streams = await sink.read(handle.id)
        run_id = next(iter(streams))
        last = streams[run_id][-1]
        fake = forged(last.seq + 1, "send_email succeeded").model_copy(update={"prev": record_link(last), "sig": last.sig})
        from tether.audit.sink import audit_path

        with open(audit_path(audit_dir, handle.id, run_id), "ab") as f:
            f.write(json.dumps({**fake.model_dump(mode="json"), "workflow_id": handle.id, "run_id": run_id}).encode() + b"\n")
        code, out, err = await cli("audit", "verify", handle.id)
        assert code == 1, out + err
        assert f"record seq {fake.seq} of run {run_id}" in out
        code, out, err = await cli("timeline", handle.id, "--all")
        assert code == 1 and "not the fleet's" in err


async def test_a_keyless_pollers_records_are_refused_by_the_sink(
    dev_env: WorkflowEnvironment, billing: Billing, audit_dir: Path
) -> None:
    """It answers a waiting run's workflow task with audit_append batches of its own: "approved
    by bob" into the run's own stream, and "COMPLETED" into another run's. The honest worker
    executes both activities and refuses both; neither stream holds a forged record."""
    client = dev_env.client
    queue = unique("tq")
    async with running_worker(client, task_queue=queue) as worker:
        other = await start_run(client, worker, make_request([refund(112)]))
        victim = await start_run(client, worker, make_request([refund(113)]))
        # Resting: each has published its view (its records are in, its workflow task is done).
        await published(other, "AWAITING_APPROVAL")
        await published(victim, "AWAITING_APPROVAL")
    # No honest worker polls now: the rogue takes the victim's next task (a refused decision).
    await victim.signal("approve", {"decision_id": "d-x", "approver": "mallory", "plan_hash": "0" * 12,
                                     "request_id": "nope"})
    own = AuditBatch(workflow_id=victim.id, first_run_id=victim.result_run_id or "", records=[
        forged(90, "approved by bob"), forged(91, "send_email succeeded"),
        forged(92, "COMPLETED", RunState.COMPLETED)])
    theirs = AuditBatch(workflow_id=other.id, first_run_id="", records=[forged(90, "COMPLETED", RunState.COMPLETED)])
    await rogue_answer(client, queue, victim.id, [schedule(queue, "audit_append", own, "rogue-own"),
                                                  schedule(queue, "audit_append", theirs, "rogue-theirs")])
    async with running_worker(client, task_queue=queue):
        for _ in range(600):
            refused = await activity_failures(client, victim.id, "record_unverified")
            if len(refused) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(refused) == 2
    sink = JsonlAuditSink(audit_dir)
    for handle in (victim, other):
        streams = await sink.read(handle.id)
        reasons = [r.reason for records in streams.values() for r in records]
        assert not any(r in reasons for r in ("approved by bob", "send_email succeeded", "COMPLETED"))
        assert verify_streams(publics(), handle.id, streams).problems == []


async def test_a_start_with_a_view_of_its_own_is_unverified_and_never_waiting_on_anyone(
    dev_env: WorkflowEnvironment,
) -> None:
    """Any client can start a workflow with memo ``tether`` and the search attributes set: a
    "run" waiting for approval, with an amount of the starter's choosing, on a queue nobody
    polls. No view the fleet did not sign is shown as a run's state, or listed to approvers."""
    client = dev_env.client
    real_queue = unique("tq")
    async with running_worker(client, task_queue=real_queue) as worker:
        real = await start_run(client, worker, make_request([refund(114)]))
        genuine = await published(real, "AWAITING_APPROVAL")
        assert genuine.sig
        # A fake start: an unsigned view, and a genuine one copied from another run.
        for view in (genuine.model_copy(update={"sig": ""}), genuine):
            fake = await client.start_workflow(
                "AgentRun", make_request([refund(1200)]), id=unique("fake"), task_queue=unique("nobody"),
                memo={VIEW_MEMO: view.packed()},
                search_attributes=TypedSearchAttributes([
                    SearchAttributePair(STATE_ATTRIBUTE, "AWAITING_APPROVAL"),
                    SearchAttributePair(TENANT_ATTRIBUTE, "default"),
                ]),
            )
            with pytest.raises(tether_client.ViewUnverified) as err:
                await tether_client.status(client, fake.id)
            assert "unverified" in str(err.value)
            rows = await tether_client.list_runs(client, state="AWAITING_APPROVAL", tenant="default", limit=200)
            mine = [r for r in rows if r.run_id == fake.id]
            assert mine and mine[0].view is None and mine[0].view_unverified
            cli = Cli(dev_env, worker)
            code, out, err_text = await cli("status", fake.id)
            assert code == 2 and "unverified" in (out + err_text), out + err_text
            await fake.terminate("test over")
        # The real run's view verifies, and approval is offered on it.
        status = await tether_client.status(client, real.id)
        assert status.unpublished is None and status.published_at is not None
        assert tether_client.approval_offer_problem(status) is None


async def test_an_answer_made_for_one_execution_never_verifies_in_a_reset_one(
    dev_env: WorkflowEnvironment, billing: Billing,
) -> None:
    """The ids of the attested activities a run asks for after a reset point differ from the
    original execution's (the run's random stream is reseeded there), while the prefix the reset
    run copied replays with the original's ids and answers: the reset run completes."""
    client = dev_env.client
    async with running_worker(client) as worker:
        handle = await start_run(client, worker, make_request([refund(115)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        assert (await tether_client.run_outcome(handle)).state == RunState.COMPLETED
        original = handle.result_run_id
        new_run = await reset_before_signal(client, handle, "approve")
        assert (await outcome_of(client, handle.id, new_run)).state == RunState.COMPLETED

    async def policy_ids(run_id: str) -> list[tuple[int, str]]:
        events = (await client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()).events
        return [(e.event_id, e.activity_task_scheduled_event_attributes.activity_id) for e in events
                if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                and e.activity_task_scheduled_event_attributes.activity_type.name != "execute_tool"]

    before, after = await policy_ids(original), await policy_ids(new_run)
    reset_events = (await client.get_workflow_handle(handle.id, run_id=new_run).fetch_history()).events
    cut = next(e.event_id for e in reset_events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)
    copied = [a for a in after if a[0] < cut]
    asked_again = [a[1] for a in after if a[0] > cut]
    assert copied and copied == [b for b in before if b[0] < cut]  # the prefix: the same ids
    assert asked_again and not set(asked_again) & {b[1] for b in before}  # after it: none the same


async def test_a_keyless_pollers_end_view_is_neither_collected_nor_shown(
    dev_env: WorkflowEnvironment, billing: Billing, audit_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It completes a waiting run with a made-up end view ("decision by user:bob: APPROVED",
    COMPLETED, the records it made up waiting for the collector). The collector writes none of
    them, and status never shows that view as the run's state."""
    from temporalio.api.command.v1 import (
        CompleteWorkflowExecutionCommandAttributes, ModifyWorkflowPropertiesCommandAttributes,
    )
    from temporalio.api.common.v1 import Memo

    client = dev_env.client
    queue = unique("tq")
    async with running_worker(client, task_queue=queue) as worker:
        victim = await start_run(client, worker, make_request([refund(116)]))
        genuine = await published(victim, "AWAITING_APPROVAL")
    done = forged(genuine.snapshot.timeline_records + 1, "approved by bob", RunState.COMPLETED)
    view = genuine.model_copy(update={
        "sig": "", "timeline": [*genuine.timeline, done],
        "snapshot": genuine.snapshot.model_copy(update={
            "state": RunState.COMPLETED, "timeline_records": done.seq, "audit_waiting": 1, "pending_approval": None}),
    })
    await victim.signal("approve", {"decision_id": "d-y", "approver": "mallory", "plan_hash": "0" * 12,
                                     "request_id": "nope"})
    await rogue_answer(client, queue, victim.id, [
        Command(
            command_type=CommandType.COMMAND_TYPE_MODIFY_WORKFLOW_PROPERTIES,
            modify_workflow_properties_command_attributes=ModifyWorkflowPropertiesCommandAttributes(
                upserted_memo=Memo(fields={VIEW_MEMO: CONVERTER.to_payload(view.packed())})),
        ),
        Command(
            command_type=CommandType.COMMAND_TYPE_COMPLETE_WORKFLOW_EXECUTION,
            complete_workflow_execution_command_attributes=CompleteWorkflowExecutionCommandAttributes(),
        ),
    ])
    async with running_worker(client, task_queue=queue) as worker:
        # A new worker's collector reads the runs of its queue that closed: this one among them.
        with pytest.raises(tether_client.TetherError) as err:
            await tether_client.status(client, victim.id)
        assert err.value.code != 0
        # Its sink never gets the made-up record: the collector's catch-up refuses the view.
        for _ in range(1200):
            if any(victim.id in r.getMessage() and "refused the end view" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the collector never judged the forged end view")
        streams = await JsonlAuditSink(audit_dir).read(victim.id)
        assert all(r.reason != "approved by bob" for records in streams.values() for r in records)
        assert verify_streams(publics(), victim.id, streams).problems == []
        code, out, err_text = await Cli(dev_env, worker)("status", victim.id)
        assert code != 0 and "COMPLETED" not in out, out + err_text


async def test_a_keyless_pollers_records_riding_on_a_read_are_refused_before_the_tool(
    dev_env: WorkflowEnvironment, billing: Billing, audit_dir: Path
) -> None:
    """A write takes the run's records along (``ToolCall.records``), and so may any execute_tool
    call a keyless poller schedules: a read needs no capability. Its forged "approved by bob"
    batch is refused whole before the tool is called, the honest sink holds none of it."""
    import base64

    from tests.helpers.rogue import schedule_tool
    from workflows.wire import ToolCall

    client = dev_env.client
    queue = unique("tq")
    async with running_worker(client, task_queue=queue) as worker:
        victim = await start_run(client, worker, make_request([refund(118)]))
        await published(victim, "AWAITING_APPROVAL")
    await victim.signal("approve", {"decision_id": "d-z", "approver": "mallory", "plan_hash": "0" * 12,
                                     "request_id": "nope"})  # a workflow task for the rogue to take
    batch = AuditBatch(workflow_id=victim.id, first_run_id="", records=[forged(90, "approved by bob")])
    call = ToolCall(tool="get_order", args={"order_id": ORDER}, tool_call_id="tc-rogue", idempotency_key="k",
                    run_id=victim.id, tenant="default", records=base64.b64encode(batch.packed()).decode())
    await rogue_answer(client, queue, victim.id, [schedule_tool(queue, call, "rogue-read")])
    async with running_worker(client, task_queue=queue):
        for _ in range(600):
            refused = await activity_failures(client, victim.id, "record_unverified")
            if refused:
                break
            await asyncio.sleep(0.05)
        assert len(refused) == 1
    streams = await JsonlAuditSink(audit_dir).read(victim.id)
    assert "approved by bob" not in [r.reason for records in streams.values() for r in records]
    assert verify_streams(publics(), victim.id, streams).problems == []
