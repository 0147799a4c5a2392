"""Runs of any length, under any flood, finish (issue: bounded state, bounded payloads, safe
upgrades). Real dev servers; the long versions run behind `make soak` (TETHER_SOAK=1)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import uuid
from pathlib import Path

import pytest
from pydantic import BaseModel
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from activities.audit import AuditActivities
from tether.audit.sink import JsonlAuditSink, merge_timeline
from tether.tools.sdk import ToolContext, ToolRegistry, tool
from tether.client import run_outcome
from tether.client.decisions import _send_decision
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot, timeline
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import audit_collected, wait_for_state
from tests.helpers.forger import NewerWorker
from workflows.budgets import QUERY_BUDGET, REFUSALS_RECORDED, RESULT_BUDGET
from workflows.contract import DecideRequest, DecideResult, ToolEffect, canonical_json
from workflows.run_state import RunData, RunOutcome, RunSnapshot
from workflows.states import RunState, is_legal_path

S = RunState
SOAK = os.environ.get("TETHER_SOAK") == "1"
REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 321, "reason": "flood"}}]


async def query_seconds(handle: WorkflowHandle) -> float:
    began = time.monotonic()
    await snapshot(handle)
    return time.monotonic() - began


async def test_a_flood_of_refused_approvals_stays_bounded_and_the_run_completes(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    flood = 5000 if SOAK else 400
    comment = "x" * 2000
    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        stale = [approval_for("0" * 64, "eve", f"flood-{i}", comment=comment) for i in range(flood)]
        latencies: list[float] = []
        for start in range(0, flood, 50):
            await asyncio.gather(*(handle.signal("approve", d) for d in stale[start : start + 50]))
            if start % 500 == 0:
                latencies.append(await query_seconds(handle))
        for _ in range(600):
            latest = await snapshot(handle)
            if latest.refusals.get("stale_plan_hash user:eve") == flood:
                break
            await asyncio.sleep(0.05)
        assert latest.refusals == {"stale_plan_hash user:eve": flood}
        records = await timeline(handle)
        answer = len(json.dumps([r.model_dump(mode="json") for r in records]))
        snap_size = len(latest.model_dump_json())
        refused = [r for r in records if r.kind == "refused"]
        assert len(refused) == REFUSALS_RECORDED + 1 and "counted, not recorded" in refused[-1].reason
        assert answer < QUERY_BUDGET and snap_size < QUERY_BUDGET
        print(f"\nflood of {flood}: query p_max {max(latencies):.3f}s, timeline answer {answer} B, snapshot {snap_size} B")
        await handle.signal("approve", approval_for(latest, "bob"))
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
    assert outcome.state == S.COMPLETED
    assert len(outcome.model_dump_json()) < RESULT_BUDGET
    assert len(billing.refunds(next(r.refs.idempotency_key for r in outcome.timeline if r.refs.idempotency_key))) == 1


class Page(BaseModel):
    page: int


LONG_TOOLS = ToolRegistry()


@tool(effect=ToolEffect.READ_ONLY, registry=LONG_TOOLS, name="read_page", timeout=10)
def read_page(args: Page, ctx: ToolContext) -> dict:
    """A page of 4,000 characters, different on every page."""
    return {"text": hashlib.sha256(str(args.page).encode()).hexdigest() * 62}


async def test_a_long_read_only_run_completes_continuing_as_new(small_history_env: WorkflowEnvironment, dev_env: WorkflowEnvironment) -> None:
    # Short here: a server that suggests continue-as-new every few dozen events. `make soak`
    # runs 1,000 steps on the default settings.
    env = dev_env if SOAK else small_history_env
    steps = 1000 if SOAK else 150
    playbook = [{"tool": "read_page", "args": {"page": i}} for i in range(steps)]
    async with running_worker(env.client, registry=LONG_TOOLS) as worker:
        handle = await start_run(env.client, worker, make_request(playbook, limits={"max_steps": steps}))
        began = time.monotonic()
        outcome = await asyncio.wait_for(run_outcome(handle), 900)
        elapsed = time.monotonic() - began
        trail = await audit_collected(env.client, handle.id)
    # The chain of runs stays visible on the record: the first run, then each continued one,
    # each its own stream, together every record once.
    first, *continued = trail.branches
    assert first.origin == "first" and first.run_id == trail.first_run_id == handle.result_run_id
    assert continued and all(b.origin == "continued" for b in continued)
    assert [b.parent_run_id for b in continued] == [b.run_id for b in trail.branches[:-1]]
    assert [r.seq for r in trail.line()] == list(range(1, trail.written + 1)) and trail.missing == []
    assert all(not b.from_window for b in trail.branches)
    assert outcome.state == S.COMPLETED, outcome.timeline[-3:]
    # Continue-as-new carries the latest steps; the ones before are counted and digested.
    assert outcome.steps_before + len(outcome.steps) == steps and all(s.status == "ok" for s in outcome.steps)
    assert outcome.steps_before > 0 and len(outcome.steps_digest) == 64
    size = len(outcome.model_dump_json())
    assert size < RESULT_BUDGET
    description = await env.client.get_workflow_handle(handle.id).describe()
    assert description.run_id != handle.result_run_id, "the run never continued as new"
    print(f"\n{steps} steps: {elapsed:.1f}s, result {size} B")


async def test_an_oversized_proposal_is_refused_with_a_bounded_reason_and_the_run_goes_on(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    # ~600 KB of proposal from the playbook planner (its steps are the proposal): over budget.
    big = [{"tool": "get_order", "args": {"order_id": "A-1001", "note": "n" * 6000}}] * 100
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request(big, limits={"max_replans": 1, "max_steps": 200}))
        outcome = await run_outcome(handle)
    failed = [r for r in outcome.timeline if r.to_state == S.VALIDATION_FAILED]
    assert len(failed) == 2 and outcome.state == S.FAILED  # refused, replanned, refused, ended
    assert "over the 262144-byte budget" in failed[0].reason and len(failed[0].reason) < 600
    assert len(outcome.model_dump_json()) < RESULT_BUDGET


async def settled_history_length(handle: WorkflowHandle) -> int:
    """The history's length once the run has finished its current workflow task."""
    length = -1
    while True:
        now = len((await handle.fetch_history()).events)
        if now == length:
            return now
        length = now
        await asyncio.sleep(0.3)


async def test_the_decide_update_puts_every_refusal_on_the_record_and_refuses_only_the_unattributable_before_history(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND, requested_by="alice"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        cases = {
            "stale_plan_hash": DecideRequest(kind="approve", **approval_for("0" * 64, "bob").model_dump()),
            "stale_request": DecideRequest(kind="approve", **{**approval_for(snap, "bob").model_dump(), "request_id": "r-old"}),
            "four_eyes": DecideRequest(kind="approve", **approval_for(snap, "alice").model_dump()),
        }
        for rule, request in cases.items():
            # Answered by the handler with the rule, and on the timeline: a policy refusal is a
            # decision attempt like any other.
            verdict = await handle.execute_update("decide", request, result_type=DecideResult)
            assert (verdict.outcome, verdict.rule, verdict.state) == ("refused", rule, S.AWAITING_APPROVAL), verdict
        records = {r.refs.decision_id: r for r in await timeline(handle) if r.kind == "refused"}
        assert {records[c.decision_id].rule for c in cases.values()} == set(cases)
        assert (await snapshot(handle)).refusals == {
            "stale_plan_hash user:bob": 1, "stale_request user:bob": 1, "four_eyes user:alice": 1,
        }
        # What cannot be attributed or cannot count at all is refused before history.
        before = await settled_history_length(handle)
        with pytest.raises(WorkflowUpdateFailedError) as malformed:
            await handle.execute_update("decide", {"kind": "approve"}, result_type=DecideResult)
        assert "malformed" in str(malformed.value.cause)
        with pytest.raises(WorkflowUpdateFailedError) as repeated:
            await handle.execute_update("decide", cases["four_eyes"], result_type=DecideResult)
        assert "[duplicate_decision]" in str(repeated.value.cause)
        history = await handle.fetch_history()
        assert len(history.events) == before, "refused-before-history decisions reached history"
        # The same decision twice at once: one verdict counts, the other is a duplicate.
        twice = DecideRequest(kind="approve", **approval_for(snap, "bob", "ok").model_dump())
        verdicts = await asyncio.gather(
            *(handle.execute_update("decide", twice, result_type=DecideResult) for _ in range(2)),
            return_exceptions=True,
        )
        counted = [v for v in verdicts if isinstance(v, DecideResult) and v.outcome == "transition"]
        assert len(counted) == 1, verdicts
        verdict = counted[0]
        assert (verdict.outcome, verdict.state, verdict.decision_id) == ("transition", S.APPROVED, "ok")
        other = next(v for v in verdicts if v is not verdict)
        assert "duplicate_decision" in str(getattr(other, "rule", None) or getattr(other, "cause", other))
        with pytest.raises(WorkflowUpdateFailedError) as again:
            await handle.execute_update(
                "decide", DecideRequest(kind="approve", **approval_for(snap, "bob", "ok").model_dump()), result_type=DecideResult
            )
        assert "[duplicate_decision]" in str(again.value.cause)
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED


async def test_an_update_flood_is_answered_and_continues_as_new_before_temporals_limit(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Every decide Update is answered and counted; past UPDATES_CONTINUE_AT in one execution
    the run continues as new (Temporal refuses Updates past 2,000 a run). Short here: `make
    soak` sends 1,600."""
    from workflows.budgets import UPDATES_CONTINUE_AT

    count = UPDATES_CONTINUE_AT + 100 if SOAK else 24
    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND, requested_by="alice"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        first_run = (await handle.describe()).run_id
        began = time.monotonic()
        async def decide_once() -> str | None:
            # Sent without a pause, the way `tether approve` sends it: past the Updates an
            # execution takes, the run refuses one before history (continuing_as_new) until it
            # has continued, and the client sends it again to the continued run, where it counts.
            request = DecideRequest(kind="approve", **approval_for("0" * 64, "bob").model_dump())
            try:
                await _send_decision(dev_env.client, handle.id, request, 30)
            except tether_client.TetherError as refused:
                return refused.rule
            return None

        for start in range(0, count, 8):  # 8 at a time: Temporal allows 10 in flight
            rules = await asyncio.gather(*(decide_once() for _ in range(start, min(start + 8, count))))
            assert rules == ["stale_plan_hash"] * len(rules), rules
        elapsed = time.monotonic() - began
        now = await snapshot(dev_env.client.get_workflow_handle(handle.id))
        assert now.refusals["stale_plan_hash user:bob"] == count  # counted, across the runs
        if SOAK:
            assert (await handle.describe()).run_id != first_run, "the run never continued as new"
            assert now.updates < UPDATES_CONTINUE_AT
        else:
            assert now.updates == count
        await dev_env.client.get_workflow_handle(handle.id).signal("approve", approval_for(now, "bob"))
        outcome = await run_outcome(dev_env.client.get_workflow_handle(handle.id, result_type=RunOutcome))
    assert outcome.state == S.COMPLETED
    print(f"\n{count} decide Updates: {elapsed:.1f}s")


async def test_a_carried_state_from_a_newer_worker_continues(dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path) -> None:
    # A newer worker version wrote the state, with fields this version does not know, and
    # sealed it with the key the workers share: this version continues the run.
    import examples.billing.tools  # noqa: F401  (registers the billing tools)
    from tether.tools.sdk import REGISTRY
    from workflows import policy as rules
    from workflows.engine import Engine
    from workflows.wire import PolicySnapshot, Proposal, ProposedStep

    run_id = unique("newer")
    request = make_request(REFUND)
    data = RunData(
        catalog=REGISTRY.catalog(),
        policy=PolicySnapshot(tenant="default", policy=rules.DEFAULT_TENANT_POLICY, policy_hash="h", source="newer worker"),
    )
    engine = Engine(data, request, workflow_id=run_id, new_request_id=lambda: uuid.uuid4().hex)
    now = __import__("datetime").datetime.now(__import__("datetime").timezone.utc)
    engine.received(now)
    engine.proposal(Proposal(steps=[ProposedStep(**REFUND[0])]), at=now, new_id=lambda n: f"tc-{n:03d}-newer")
    engine.after_validated(now)
    assert data.lifecycle.state == S.AWAITING_APPROVAL
    carried = data.model_dump(mode="json")
    carried["added_in_a_newer_version"] = {"anything": [1, 2, 3]}
    carried["lifecycle"]["also_new"] = True
    digest = hashlib.sha256(canonical_json(carried).encode()).hexdigest()
    newer = {**request.model_dump(mode="json"), "carryover": carried, "new_option": 7}
    async with running_worker(dev_env.client, extra_workflows=[NewerWorker]) as worker:
        await dev_env.client.start_workflow(
            "NewerWorker", {"request": newer, "digest": digest}, id=run_id, task_queue=worker.task_queue
        )
        handle = dev_env.client.get_workflow_handle(run_id, result_type=RunOutcome)
        for _ in range(200):  # until the Forger has continued into AgentRun
            if (await handle.describe()).workflow_type == "AgentRun":
                break
            await asyncio.sleep(0.05)
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert snap.pending_approval.request_id == data.pending_approval.request_id
        await handle.signal("approve", approval_for(snap, "bob"))
        outcome = await asyncio.wait_for(run_outcome(handle), 30)
    assert outcome.state == S.COMPLETED
    assert is_legal_path(outcome.timeline)


async def test_the_audit_sink_holds_every_record_once_after_a_torn_write(tmp_path: Path) -> None:
    from workflows.wire import AuditBatch
    from workflows.states import Lifecycle

    lifecycle = Lifecycle()
    at = __import__("datetime").datetime(2026, 1, 1, tzinfo=__import__("datetime").timezone.utc)
    for i in range(5):
        lifecycle.refuse(at=at, actor=f"user:u{i}", reason="r", rule=f"rule{i}")
    sink = JsonlAuditSink(tmp_path)
    batch = AuditBatch(workflow_id="wf/../x", first_run_id="r1", run_id="r1", records=lifecycle.timeline[:3])
    assert await sink.append(batch) == 3
    path = next(tmp_path.glob("*/*.jsonl"))
    assert path.parent.parent == tmp_path  # the id cannot climb out of the sink's folder
    with open(path, "ab") as f:  # a worker killed in the middle of the next line
        f.write(b'{"actor": "user:u3", "kind": "ref')
    full = AuditBatch(workflow_id="wf/../x", first_run_id="r1", run_id="r1", records=lifecycle.timeline)
    assert await sink.append(full) == 5
    assert await sink.append(full) == 5
    records = (await sink.read("wf/../x"))["r1"]
    assert [r.seq for r in records] == [1, 2, 3, 4, 5]
    assert [r.seq for r in merge_timeline(records, lifecycle.timeline[-2:])] == [1, 2, 3, 4, 5]


def test_what_continue_as_new_carries_stops_growing_with_the_run() -> None:
    """Engine.fold_for_carry (issue 21): the latest EXECUTED_WINDOW steps and the timeline's head
    and latest records; older steps as a count, an ok count and a running digest, older records
    counted in ``omitted`` (the audit sink has every one). Folding twice changes nothing more."""
    from datetime import datetime, timezone

    from workflows.budgets import CARRY_TIMELINE_TAIL, EXECUTED_WINDOW, TIMELINE_HEAD
    from workflows.engine import Engine
    from workflows.contract import ExecutedStep
    from workflows.run_state import RunRequest

    def carried(steps: int) -> tuple[RunData, int]:
        data = RunData()
        at = datetime(2026, 1, 1, tzinfo=timezone.utc)
        for i in range(steps):
            data.executed.append(ExecutedStep(tool_call_id=f"tc-{i}", tool="t", args={}, status="ok" if i % 3 else "failed",
                                              outcome="ok" if i % 3 else "failed", digest="d" * 64))
            data.lifecycle.accept(at=at, actor=f"user:{i}", reason="r")
        engine = Engine(data, RunRequest(goal="g", requested_by="alice"), workflow_id="wf")
        engine.fold_for_carry()
        size = len(data.model_dump_json())
        engine.fold_for_carry()
        return data, size

    small, small_size = carried(5)
    assert small.executed_before == 0 and len(small.executed) == 5 and len(small.lifecycle.timeline) == 5
    long, long_size = carried(300)
    longer, longer_size = carried(600)
    for data, steps in ((long, 300), (longer, 600)):
        assert len(data.executed) == EXECUTED_WINDOW and data.steps_executed == steps
        assert data.steps_ok == sum(1 for i in range(steps) if i % 3)
        assert [r.seq for r in data.lifecycle.timeline] == [
            *range(1, TIMELINE_HEAD + 1), *range(steps - CARRY_TIMELINE_TAIL + 1, steps + 1)]
        assert data.lifecycle.omitted == steps - TIMELINE_HEAD - CARRY_TIMELINE_TAIL and data.lifecycle.records == steps
    assert long.executed_digest != longer.executed_digest and len(long.executed_digest) == 64
    assert abs(longer_size - long_size) < 200  # the same bytes whatever the run's length


def test_continue_as_new_waits_until_it_is_worth_what_it_writes() -> None:
    """Suggested by the server, a run continues once its history is CARRY_AMORTIZE times what
    continuing writes (so carrying never costs more than a quarter of the history), and by
    Temporal's warning marks whatever it carries."""
    from workflows.budgets import CARRY_AMORTIZE, CONTINUE_AT_BYTES, CONTINUE_AT_EVENTS, continue_due

    carry = 40_000
    assert not continue_due(history_bytes=CARRY_AMORTIZE * carry - 1, history_events=400, carry_bytes=carry)
    assert continue_due(history_bytes=CARRY_AMORTIZE * carry, history_events=400, carry_bytes=carry)
    assert continue_due(history_bytes=1_000, history_events=CONTINUE_AT_EVENTS, carry_bytes=carry)
    assert continue_due(history_bytes=CONTINUE_AT_BYTES, history_events=1, carry_bytes=CONTINUE_AT_BYTES)
    assert CONTINUE_AT_EVENTS < 51_200 and CONTINUE_AT_BYTES < 50 * 1024 * 1024  # Temporal's hard limits
    # Put off, a run is woken again once its history gets there (or to the warning marks).
    from workflows.budgets import continue_wanted

    assert continue_wanted(history_bytes=0, history_events=0, deferred_to=None)
    assert not continue_wanted(history_bytes=CARRY_AMORTIZE * carry - 1, history_events=400, deferred_to=CARRY_AMORTIZE * carry)
    assert continue_wanted(history_bytes=CARRY_AMORTIZE * carry, history_events=400, deferred_to=CARRY_AMORTIZE * carry)
    assert continue_wanted(history_bytes=CONTINUE_AT_BYTES, history_events=1, deferred_to=10 * CONTINUE_AT_BYTES)
    assert continue_wanted(history_bytes=1, history_events=CONTINUE_AT_EVENTS, deferred_to=10 * CONTINUE_AT_BYTES)


def test_a_decide_update_past_an_executions_room_is_refused_before_history() -> None:
    """Past UPDATES_CONTINUE_AT in one execution, a decide Update is refused by the validator
    (nothing on the record) with a rule the client sends it again on: the run's handlers
    drain, it continues as new, and the continued run takes it."""
    from workflows.budgets import UPDATES_CONTINUE_AT
    from workflows.policy import updates_refusal

    assert updates_refusal(UPDATES_CONTINUE_AT - 1) is None
    refusal = updates_refusal(UPDATES_CONTINUE_AT)
    assert refusal is not None and refusal.rule == "continuing_as_new" and "send it again" in refusal.message
    assert UPDATES_CONTINUE_AT < 2_000  # Temporal's per-run limit


# Runs in the storm (issue 34): `make soak` runs 20, `make test` a few.
STORM_RUNS = 20 if SOAK else 3
QUERY_LOOPS = 4
# A workflow task failing this many times in a row, or failing on nondeterminism (which the same
# code never gets past), is a stuck run: the storm stops waiting for it.
STUCK_ATTEMPTS = 4


async def settle_or_stuck(client, run_id: str) -> str | None:
    """None once the run has ended as its workflow returns (COMPLETED or another Tether ending),
    else why it cannot: stuck (its workflow task keeps failing), or failed by Temporal without a
    Tether ending (e.g. a carried state refused). Reads nothing through the worker: the query
    loops have it busy."""
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import ApplicationError

    latest = client.get_workflow_handle(run_id)
    done = asyncio.create_task(latest.result())
    try:
        while not done.done():
            stuck = await tether_client.stuck_task(client, await latest.describe())
            if stuck is not None and (stuck.cause == "NON_DETERMINISTIC_ERROR" or stuck.attempt >= STUCK_ATTEMPTS):
                return f"stuck: attempt {stuck.attempt}, {stuck.cause}: {stuck.error[:300]}"
            await asyncio.wait({done}, timeout=0.5)
        done.result()
        return None
    except WorkflowFailureError as failed:
        if isinstance(failed.cause, ApplicationError) and failed.cause.type in S.__members__:
            return None  # a Tether ending Temporal counts as Failed: run_outcome reads it
        return f"failed: {failed.cause}"
    finally:
        done.cancel()


async def published_waiting(handle: WorkflowHandle, first_run: str) -> RunSnapshot:
    """The continued run's published view once it waits for approval again (no query)."""
    for _ in range(600):
        description = await handle.describe()
        view = await tether_client.published_view(description)
        if description.run_id != first_run and view is not None and view.snapshot.state == S.AWAITING_APPROVAL:
            return view.snapshot
        await asyncio.sleep(0.1)
    raise AssertionError(f"{handle.id} never published AWAITING_APPROVAL after continuing as new")


async def task_failures(client, run_id: str) -> list[str]:
    """Every workflow task failure recorded in any execution of the run, and every execution whose
    recorded history a fresh Replayer of today's code cannot replay. The server's own refusal of
    a completion that raced new events (UNHANDLED_COMMAND: the worker is sent them and tries
    again) and its flush of over 100 signals buffered while a task was out (FORCE_CLOSE_COMMAND:
    the next task gets them all; a cache-off worker's task, replaying the whole history, is out
    long enough for a flood) are how Temporal works, not failures: a run they ended would not
    complete, which the test checks."""
    from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause

    from worker import create_replayer

    replayer = create_replayer()
    found, run = [], (await client.get_workflow_handle(run_id).describe()).run_id
    while run:
        history = await client.get_workflow_handle(run_id, run_id=run).fetch_history()
        for event in history.events:
            failed = event.workflow_task_failed_event_attributes
            if (event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
                    and failed.cause not in (WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND,
                                             WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND)):
                found.append(f"{run} event {event.event_id} ({WorkflowTaskFailedCause.Name(failed.cause)}): "
                             f"{failed.failure.message[:300]}")
        replayed = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        if replayed.replay_failure is not None:
            found.append(f"{run} does not replay: {str(replayed.replay_failure)[:300]}")
        run = history.events[0].workflow_execution_started_event_attributes.continued_execution_run_id
    return found


async def test_a_query_storm_on_runs_flooded_until_they_continue_as_new_breaks_none(
    small_history_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Issue 34's storm: each run is flooded with refused approvals until it continues as new while
    four loops query its timeline, then approved. Every run completes: none stuck, none FAILED,
    no workflow task failure in any execution, every history replays. Short here: `make soak`
    runs 20."""
    from tests.helpers.runs import flood_until_continued

    env = small_history_env
    async with running_worker(env.client) as worker:

        async def storm(i: int) -> tuple[str, RunOutcome | str, int]:
            handle = await start_run(env.client, worker, make_request(REFUND))
            await wait_for_state(handle, "AWAITING_APPROVAL")
            latest = env.client.get_workflow_handle(handle.id)
            stop, answered = asyncio.Event(), [0]

            async def read() -> None:
                while not stop.is_set():
                    try:
                        await latest.query("timeline", rpc_timeout=tether_client.QUERY_TIMEOUT)
                        answered[0] += 1
                    except Exception:  # noqa: BLE001 (a stuck run fails its reads: the outcome says why)
                        await asyncio.sleep(0.1)

            readers = [asyncio.create_task(read()) for _ in range(QUERY_LOOPS)]
            try:
                await flood_until_continued(latest, handle.result_run_id, f"storm-{i}")
                waiting = await published_waiting(latest, handle.result_run_id)
                await latest.signal("approve", approval_for(waiting, "bob"))
                broke = await settle_or_stuck(env.client, handle.id)
            except Exception as e:  # noqa: BLE001 (the flood or the approval could not go on: say why)
                described = await latest.describe()
                stuck = await tether_client.stuck_task(env.client, described)
                broke = f"{type(e).__name__}: {str(e)[:200]}; run {described.status.name if described.status else '?'}" + (
                    f", stuck: attempt {stuck.attempt}, {stuck.cause}: {stuck.error[:300]}" if stuck else "")
            finally:
                stop.set()
                await asyncio.gather(*readers)
            # The readers have stopped: the outcome's timeline is read without them in the way.
            outcome = broke if broke is not None else await run_outcome(env.client.get_workflow_handle(handle.id, result_type=RunOutcome))
            return handle.id, outcome, answered[0]

        results = await asyncio.gather(*(storm(i) for i in range(STORM_RUNS)))
        broken = {run_id: outcome for run_id, outcome, _ in results if not isinstance(outcome, RunOutcome)}
        not_completed = {run_id: o.state.value for run_id, o, _ in results if isinstance(o, RunOutcome) and o.state != S.COMPLETED}
        failures = {run_id: f for run_id, _, _ in results if (f := await task_failures(env.client, run_id))}
    print(f"\nstorm: {STORM_RUNS} runs, {sum(a for _, _, a in results)} timeline queries answered; "
          f"{len(broken)} stuck or failed, {len(not_completed)} not COMPLETED, {len(failures)} with task failures")
    assert not broken and not not_completed and not failures, (broken, not_completed, failures)
    for run_id, outcome, _ in results:
        assert isinstance(outcome, RunOutcome)
        keys = {r.refs.idempotency_key for r in outcome.timeline if r.refs.idempotency_key}
        assert len(keys) == 1 and len(billing.refunds(keys.pop())) == 1, run_id
