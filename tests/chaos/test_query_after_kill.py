"""A worker killed while a committed write's answer is in flight, replaced, and queried at once
(issue 55): the new worker's first task for the run is a query, so it rebuilds the run from
history before answering. Every id the workflow derives must come out the same on that path as
when the task ran: the run completes with one effect, and no query and no workflow task fails.

The queries come as ``tether approve``, the Web UI's Queries tab or a monitoring script send
them: ``snapshot`` over and over from the moment the new worker polls until the run has ended.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle, WorkflowQueryFailedError
from temporalio.service import RPCError, RPCStatusCode

from tether.client import timed_out
from tests.chaos.harness import Stack
from tether.client import start_run
from tests.chaos.harness import (HELD_TOOL_TIMEOUT, Proc, _ended, _env, _marker, _release, _start_approved, _unique, _wait,
                                 start_worker)
from tests.helpers.runs import approval_for
from workflows.run_state import RunRequest, RunSnapshot
from workflows.states import RunState


async def _query_until_ended(handle: WorkflowHandle, ended: asyncio.Event) -> tuple[int, list[str]]:
    """Ask ``snapshot`` every 0.1 s (each waiting 2 s at most) until ``ended``; (answers, failures). A query the server
    could not hand to a worker in time is not the run's failure; any other error is."""
    answers, failures = 0, []
    while not ended.is_set():
        try:
            await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=timedelta(seconds=2))
            answers += 1
        except WorkflowQueryFailedError as e:  # the worker could not answer: its replay failed
            failures.append(str(e))
        except RPCError as e:
            # Not answered in time, or no worker polling (the dead one's replacement not up yet):
            # the query's, not the run's.
            if not timed_out(e) and e.status != RPCStatusCode.FAILED_PRECONDITION:
                failures.append(f"{e.status.name}: {e.message}")
        await asyncio.sleep(0.1)
    return answers, failures


async def test_a_replaced_worker_queried_at_once_finishes_the_run_with_one_effect(stack: Stack) -> None:
    chaos_dir = stack.workdir / _unique("query-after-kill")
    chaos_dir.mkdir(parents=True)
    queue = _unique("chaos-q")
    # Held after the service committed the refund: its answer is in flight when the worker dies.
    worker = start_worker(stack.server.address, stack.billing.url, queue, chaos_dir, "before,during", HELD_TOOL_TIMEOUT)
    try:
        await worker.wait_for_output("worker ready")
        runs, keys = await _start_approved(stack.client, queue, ["idempotent"], 1)
        (_, handle), = runs
        key, _ = keys[handle.id]
        await _wait(lambda: _marker(chaos_dir, key, 1, "before").exists(), 60, "the refund at its checkpoint")
        (chaos_dir / "release-before").touch()
        await _wait(lambda: stack.billing.effects("idempotent", key) >= 1, 30, "the refund committed", step=0.05)
        worker.kill()
        _release(chaos_dir, key)  # the held answer goes to a dead worker
        # Asked from the moment the worker died: the replacement's first task for the run is one
        # of these queries.
        ended = asyncio.Event()
        querying = asyncio.create_task(_query_until_ended(handle, ended))
        worker = start_worker(stack.server.address, stack.billing.url, queue, chaos_dir, tool_timeout=HELD_TOOL_TIMEOUT)
        await worker.wait_for_output("worker ready")
        try:
            state, _ = await _ended(stack.client, handle.id)
        finally:
            ended.set()
        answers, failures = await querying
    finally:
        worker.stop()

    assert failures == [], f"queries failed on the replaced worker: {failures[:3]}"
    assert answers > 0
    assert state == RunState.COMPLETED
    assert stack.billing.effects("idempotent", key) == 1
    history = await handle.fetch_history()
    failed = [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
    assert not failed, [e.workflow_task_failed_event_attributes.failure.message for e in failed]


# ----------------------------------------------------------------------------- every activity


_ORDERS: list[str] = []


def _order() -> str:
    """An order id of this module's own (the billing tools take ``X-NNNN``)."""
    _ORDERS.append(f"K-{1000 + len(_ORDERS)}")
    return _ORDERS[-1]


def _demo_refund(case: str) -> list[dict]:
    """The demo refund (examples/billing/refund.playbook.json) on an order and a mailbox of the
    case's own: the cases run side by side on one billing service."""
    from tests.helpers.runs import PLAYBOOK

    steps = json.loads(json.dumps(PLAYBOOK).replace("A-1001", case).replace("ada@example.com", f"{case}@example.com"))
    return steps


def _ring(stack: Stack) -> str:
    """The key ring the module's workers share (a worker never creates one)."""
    from tether.store.keys import genkey

    path = stack.workdir / "state.key"
    genkey(path, if_missing=True)
    return str(path)


def _plain_worker(stack: Stack, queue: str, folder: Path) -> Proc:
    cmd = [sys.executable, "worker.py", "--tools", "examples.billing.tools", "--task-queue", queue]
    from tether.store.keys import KEY_SETTING

    env = _env(TEMPORAL_ADDRESS=stack.server.address, BILLING_URL=stack.billing.url,
               **{KEY_SETTING: _ring(stack)})
    return Proc(f"worker {queue}", cmd, folder / f"worker-{_unique('w')}.log", env)


def _held_worker(stack: Stack, queue: str, nth: int, marker: Path, folder: Path) -> Proc:
    from tether.store.keys import KEY_SETTING

    cmd = [sys.executable, "-m", "tests.helpers.held_activity_worker", queue, str(nth), str(marker)]
    env = _env(TEMPORAL_ADDRESS=stack.server.address, BILLING_URL=stack.billing.url,
               **{KEY_SETTING: _ring(stack)})
    return Proc(f"held worker {queue}", cmd, folder / f"held-{nth}.log", env)


async def _approve_when_asked(handle: WorkflowHandle) -> None:
    from tests.chaos.harness import _await_state

    snap = await _await_state(handle, {RunState.AWAITING_APPROVAL}, 600)
    await handle.signal("approve", approval_for(snap, "chaos-bob"))


async def _kill_inside(stack: Stack, nth: int, folder: Path) -> tuple[str, RunState, int, int, list[str], list[str]]:
    """The demo refund with its worker SIGKILLed inside its ``nth`` activity, replaced, and
    queried from the moment of the kill: (what was held, end state, refunds, emails, query
    failures, task failures)."""
    case = _order()
    stack.billing.put(f"/admin/orders/{case}", {"customer_email": f"{case}@example.com", "total_cents": 4999, "currency": "EUR"})
    queue, marker = _unique("kill-q"), folder / f"held-{nth}"
    worker = _held_worker(stack, queue, nth, marker, folder)
    try:
        await worker.wait_for_output("worker ready")
        request = RunRequest(goal=f"Refund order {case}", requested_by="alice", playbook=_demo_refund(case))
        handle = await start_run(stack.client, request, run_id=f"kill-{case}", queue=queue)
        approving = asyncio.create_task(_approve_when_asked(handle))
        await _wait(lambda: marker.exists() and bool(marker.read_text()), 600, f"activity {nth} held")
        held = marker.read_text()
        worker.kill()
        ended = asyncio.Event()
        querying = asyncio.create_task(_query_until_ended(handle, ended))
        worker = _plain_worker(stack, queue, folder)
        await worker.wait_for_output("worker ready")
        try:
            # A planner call's attempt the dead worker held ends at its two-minute deadline:
            # wait for the run's end itself, then read how it ended.
            try:
                await handle.result()
            except WorkflowFailureError:
                pass
            state, timeline = await _ended(stack.client, handle.id)
        finally:
            ended.set()
            approving.cancel()
        reason = timeline[-1].reason
        _, failures = await querying
    finally:
        worker.stop()
    history = await handle.fetch_history()
    failed = [e.workflow_task_failed_event_attributes.failure.message for e in history.events
              if e.HasField("workflow_task_failed_event_attributes")]
    refunds = len(stack.billing.get(f"/refunds?order_id={case}")["refunds"])
    emails = len(stack.billing.get(f"/emails?to={case}@example.com")["emails"])
    return f"{held} ({reason})", state, refunds, emails, failures, failed


@pytest.mark.timeout(1500)
async def test_a_worker_killed_inside_each_activity_and_queried_at_once_finishes_the_run(stack: Stack) -> None:
    """The demo refund's every activity in turn (the plan, the audit appends, the policy checks,
    each tool call): the worker is SIGKILLed inside it, a new one started, and the run queried
    from the moment of the kill. Each run ends as the chaos contract says (completed; an email
    whose attempt may have run is handed off), with at most one refund and one email, and no
    query and no workflow task fails."""
    folder = stack.workdir / _unique("each-activity")
    folder.mkdir(parents=True)
    # How many activities the demo refund takes, from a run nothing interrupts.
    queue = _unique("count-q")
    worker = _plain_worker(stack, queue, folder)
    try:
        await worker.wait_for_output("worker ready")
        case = _order()
        stack.billing.put(f"/admin/orders/{case}", {"customer_email": f"{case}@example.com", "total_cents": 4999, "currency": "EUR"})
        handle = await start_run(stack.client, RunRequest(goal="count", requested_by="alice", playbook=_demo_refund(case)),
                                 run_id=f"count-{case}", queue=queue)
        await _approve_when_asked(handle)
        state, _ = await _ended(stack.client, handle.id)
    finally:
        worker.stop()
    assert state == RunState.COMPLETED
    history = await handle.fetch_history()
    count = sum(1 for e in history.events if e.HasField("activity_task_scheduled_event_attributes"))
    assert count >= 6, count

    # All at once: each waits mostly for the server to give up on its dead worker's attempt
    # (a planner call's deadline is two minutes), with two idle worker processes at most.
    results = await asyncio.gather(*(_kill_inside(stack, n, folder) for n in range(1, count + 1)))
    held_kinds = set()
    for held, state, refunds, emails, failures, failed in results:
        held_kinds.add(held.split()[0])
        assert failures == [] and failed == [], (held, failures[:2], failed[:2])
        assert refunds <= 1 and emails <= 1, (held, refunds, emails)
        assert state in (RunState.COMPLETED, RunState.HANDED_OFF), (held, state)
        if state == RunState.COMPLETED:
            assert (refunds, emails) == (1, 1), (held, refunds, emails)
    assert {"plan", "audit_append", "execute_tool"} <= held_kinds, held_kinds
