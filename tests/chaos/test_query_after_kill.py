"""A worker killed while a committed write's answer is in flight, replaced, and queried at once
(issue 55): the new worker's first task for the run is a query, so it rebuilds the run from
history before answering. Every id the workflow derives must come out the same on that path as
when the task ran: the run completes with one effect, and no query and no workflow task fails.

The queries come as ``tether approve``, the Web UI's Queries tab or a monitoring script send
them: ``snapshot`` over and over from the moment the new worker polls until the run has ended.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.client import WorkflowHandle
from temporalio.service import RPCError

from tether.client import timed_out
from tests.chaos.conftest import Stack
from tests.chaos.harness import HELD_TOOL_TIMEOUT, _ended, _marker, _release, _start_approved, _unique, _wait, start_worker
from workflows.run_state import RunSnapshot
from workflows.states import RunState


async def _query_until_ended(handle: WorkflowHandle, ended: asyncio.Event) -> tuple[int, list[str]]:
    """Ask ``snapshot`` every 0.1 s (each waiting 2 s at most) until ``ended``; (answers, failures). A query the server
    could not hand to a worker in time is not the run's failure; any other error is."""
    answers, failures = 0, []
    while not ended.is_set():
        try:
            await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=timedelta(seconds=2))
            answers += 1
        except RPCError as e:
            if not timed_out(e):
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
