"""Waiting for an event, never for a wall-clock margin: a run in a state (as published), a
workflow task failing with a message, the audit sink holding a run's last record."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tests.helpers.queries import snapshot
from workflows.run_state import RunSnapshot, RunView


async def wait_for_state(handle: WorkflowHandle, *states: str, timeout: float = 120.0) -> RunSnapshot:
    """Poll the snapshot query until the run is in one of ``states``; ``timeout`` (real time)
    bounds only a hang: a busy machine, or a worker rebuilding every run from history on every
    task (`make test-replay`), only waits longer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        snap = await snapshot(handle)
        if snap.state.value in states and (snap.state.value != "AWAITING_APPROVAL" or await _published_as(handle, snap)):
            return snap
        if loop.time() > deadline:
            raise AssertionError(f"run {handle.id} is {snap.state.value}, expected one of {states} (as published)")
        await asyncio.sleep(0.05)


async def _published_as(handle: WorkflowHandle, snap: RunSnapshot) -> bool:
    """Whether the run's signed view (what the CLI and the inbox decide from) shows the request the
    query answered with: a query can answer from a task whose view is not written yet, and a reset
    run carries its original's view (signed for another run) until it publishes its own."""
    try:
        view = await tether_client.published_view(await handle.describe())
    except tether_client.TetherError:  # a reset run's memo is its original's until it publishes its own
        return False
    pending = view.snapshot.pending_approval if view is not None else None
    return (view is not None and view.snapshot.state == snap.state and pending is not None
            and snap.pending_approval is not None and pending.request_id == snap.pending_approval.request_id)


async def task_failure(client: Client, workflow_id: str, contains: str, run_id: str | None = None) -> str:
    """Wait until a workflow task of the run (its latest, or ``run_id``) fails with a message
    containing ``contains`` (a forgery, a key the worker lacks, an older build): the run
    stands where it was, RUNNING. Returns the message."""
    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    seen: list[str] = []
    for _ in range(6000):  # a condition on history, not a time limit: a busy machine only waits longer
        history = await handle.fetch_history()
        seen = [e.workflow_task_failed_event_attributes.failure.message for e in history.events
                if e.HasField("workflow_task_failed_event_attributes")]
        found = next((m for m in seen if contains in m), None)
        if found is not None:
            assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no workflow task of {workflow_id} failed with {contains!r}: {seen}")


async def audit_collected(client: Client, run_id: str, audit_dir: str | None = None, *, dsn: str | None = None) -> tether_client.AuditTrail:
    """The run's audit trail once the sink holds its current run's last record: a run that has
    closed leaves its last records with its end view, for the workers' audit collector."""
    while True:
        trail = await tether_client.audit_trail(client, run_id, audit_dir, dsn=dsn)
        current = next(b for b in trail.branches if b.current)
        if trail.written in {r.seq for r in current.records} - set(current.from_window):
            return trail
        await asyncio.sleep(0.05)


async def until(check: Any, what: str) -> Any:
    """Until ``check()`` gives a truthy value, which it returns: an event, bounded only against a hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while not (value := await check()):
        assert loop.time() < deadline, what
        await asyncio.sleep(0.1)
    return value


async def wait_published(env: WorkflowEnvironment, run_id: str, state: str) -> RunView:
    """Until the run's memo holds a view in ``state`` (it publishes where it rests)."""
    for _ in range(300):
        view = await tether_client.published_view(await env.client.get_workflow_handle(run_id).describe())
        if view is not None and view.snapshot.state.value == state:
            return view
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id} never published a view in {state} (last: {view and view.snapshot.state})")


async def wait_stuck(env: WorkflowEnvironment, run_id: str) -> tether_client.StuckTask:
    """Until the run's workflow task has failed and is being tried again."""
    for _ in range(600):
        stuck = await tether_client.stuck_task(env.client, await env.client.get_workflow_handle(run_id).describe())
        if stuck is not None:
            return stuck
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id} never got stuck")
