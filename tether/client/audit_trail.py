"""Every record of every execution of a workflow id, from the audit sink, with the run's own
window filling its gaps (``audit_trail``, ``full_timeline``): ``tether timeline RUN --all``.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from workflows.run_state import RunSnapshot
from workflows.states import TransitionRecord
from tether.connection import TetherError, UsageError, rpc_error
from tether.runs import ViewUnverified, public_keys, published_view
from tether.client.workers import no_worker_message, worker_serving


class AuditBranch(BaseModel):
    """One execution's records, as the audit sink holds them, and how that execution began."""

    run_id: str
    origin: Literal["first", "continued", "reset", "unknown"]
    parent_run_id: str | None = None  # the run it continued from, or the run that was reset
    at_seq: int | None = None  # where it branches off its parent: records up to here are shared
    reason: str | None = None  # a reset's reason, as Temporal recorded it
    identity: str | None = None  # who reset it, as Temporal recorded it
    status: str | None = None  # Temporal's status of the execution
    current: bool = False
    records: list[TransitionRecord] = []
    from_window: list[int] = []  # seqs the sink lacks, shown from the run's own window


class AuditTrail(BaseModel):
    """``tether timeline RUN --all``: every execution of a workflow id, each its own stream."""

    workflow_id: str
    first_run_id: str
    current_run_id: str
    sink: str
    branches: list[AuditBranch]
    written: int  # records the current run's line wrote (snapshot.timeline_records)
    waiting: int  # of those, not yet written to the sink by the run (snapshot.audit_waiting)
    audit_error: str | None = None  # why the run cannot write to its sink, if it cannot
    missing: list[int] = []  # seqs of the current line the sink does not hold (and not waiting)
    closed: bool = False  # the current run has closed: its last records are the audit collector's
    unchecked: str | None = None  # why the sink could not be checked against the run (gone, no worker)
    # The run's own counts are from the view it published at this workflow time (None: asked live).
    published_at: datetime | None = None
    # What in the sink does not verify (signature, chain), first one first; and how many were checked.
    unverified: list[str] = []
    verified: int = 0

    def line(self) -> list[TransitionRecord]:
        """The current run's line (first run, continued runs, resets it descends from): each
        record once, in seq order, the window filling what the sink lacks."""
        by_id = {b.run_id: b for b in self.branches}
        chain, branch = [], by_id.get(self.current_run_id)
        while branch is not None and branch not in chain:
            chain.append(branch)
            branch = by_id.get(branch.parent_run_id or "")
        records: dict[int, TransitionRecord] = {}
        cut = None
        for branch in chain:  # newest first: a reset's records replace its parent's after the cut
            for r in branch.records:
                if cut is None or r.seq <= cut:
                    records.setdefault(r.seq, r)
            if branch.at_seq is not None:
                cut = branch.at_seq if cut is None else min(cut, branch.at_seq)
        return [records[k] for k in sorted(records)]


async def _origin(client: Client, workflow_id: str, run_id: str) -> AuditBranch:
    """How an execution began, from its history: a reset (reason, by whom), continued, first."""
    from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause

    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    branch = AuditBranch(run_id=run_id, origin="unknown")
    try:
        description = await handle.describe()
        branch.status = description.status.name if description.status else None
        async for event in handle.fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
                started = event.workflow_execution_started_event_attributes
                continued = started.continued_execution_run_id
                branch.origin, branch.parent_run_id = ("continued", continued) if continued else ("first", None)
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                failed = event.workflow_task_failed_event_attributes
                if failed.cause == WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_WORKFLOW and failed.new_run_id == run_id:
                    branch.origin, branch.parent_run_id = "reset", failed.base_run_id
                    branch.reason = failed.failure.message or None
                    branch.identity = failed.identity or None
                    break
    except RPCError:
        pass  # gone from Temporal (retention): the sink's records still show
    return branch


async def audit_trail(
    client: Client, run_id: str, audit_dir: str | None = None, *, dsn: str | None = None
) -> AuditTrail:
    """Every record of every execution of the workflow id ``run_id``, from the audit sink
    (``TETHER_AUDIT_DSN`` or ``TETHER_AUDIT_DIR``), with the run's own window filling gaps and
    what the sink lacks named in ``missing``.

    A run Temporal no longer has (retention), or that no worker answers for, is shown from the
    sink alone; ``unchecked`` then says why its completeness could not be checked.
    """
    from tether.audit.sink import sink_from_env

    current: str | None = None
    window: list[TransitionRecord] = []
    snap: RunSnapshot | None = None
    unchecked = None
    description = None
    try:
        description = await client.get_workflow_handle(run_id).describe()
        current = description.run_id
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise rpc_error(e, run_id) from None
        unchecked = f"Temporal has no run {run_id} (any more): the records are the sink's alone"
    published_at = None
    if current is not None:
        # What the run published where it last rested, signed, fills the sink's gaps and says how
        # many records it had written. A run that has published nothing is never asked: whoever
        # started it may answer its queries (`timeline --live` asks, as asked).
        try:
            view = await published_view(description)
        except ViewUnverified as e:
            view, unchecked = None, f"{e}: the records are the sink's alone"
        if view is not None:
            window, snap, published_at = view.timeline, view.snapshot, view.published_at
        elif unchecked is None and description is not None:
            queue = description.task_queue
            unchecked = (f"run {run_id} is not published yet (no view the fleet's key signed): the records are the "
                         f"sink's alone (`tether timeline --live {run_id}` asks the run, unsigned)")
            if await worker_serving(client, queue) is False:
                unchecked = f"{no_worker_message(queue)}; {unchecked}"
    try:
        sink = sink_from_env(audit_dir, dsn)
        try:
            streams = await sink.read(run_id)
        finally:
            await sink.aclose()
    except Exception as e:  # the sink cannot be read: say which and why
        raise UsageError(f"cannot read the audit sink: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    if current is None and not streams:
        raise UsageError(f"unknown run {run_id!r}: neither Temporal nor the audit sink ({sink.describe()}) has it",
                          rule="unknown_run")
    runs = sorted({*streams, *([current] if current else [])})
    branches = await asyncio.gather(*(_origin(client, run_id, r) for r in runs))
    for branch in branches:
        branch.records = streams.get(branch.run_id, [])
        branch.current = branch.run_id == current
    by_id = {b.run_id: b for b in branches}
    written = snap.timeline_records if snap else 0
    for branch in branches:
        if branch.origin == "reset":
            first = min((r.seq for r in branch.records), default=None)
            branch.at_seq = first - 1 if first is not None else (written if branch.current else 0)
        elif branch.origin == "continued":
            parent = by_id.get(branch.parent_run_id or "")
            branch.at_seq = max((r.seq for r in parent.records), default=0) if parent else None

    def start(b: AuditBranch) -> tuple[int, datetime, str]:
        # In the order the executions wrote their first record; one with none yet goes last.
        return (0, b.records[0].at, b.run_id) if b.records else (1, datetime.min.replace(tzinfo=timezone.utc), b.run_id)

    ordered = sorted(branches, key=start)
    current = current or ordered[-1].run_id
    first_run = snap.first_run_id if snap else next((b.run_id for b in ordered if b.origin == "first"), ordered[0].run_id)
    # A run that has closed waits for nothing: what it left with its end view is the workers'
    # audit collector's to write, so what this sink lacks is missing (or not collected yet).
    closed = description is not None and description.status != WorkflowExecutionStatus.RUNNING
    trail = AuditTrail(
        workflow_id=run_id, first_run_id=first_run, current_run_id=current, sink=sink.describe(),
        branches=ordered, written=written, waiting=snap.audit_waiting if snap and not closed else 0,
        closed=closed,
        audit_error=snap.audit_error if snap else None, unchecked=unchecked, published_at=published_at,
    )
    from tether.audit.verify import verify_streams

    try:
        check = verify_streams(public_keys(), run_id, streams)
        trail.unverified, trail.verified = check.problems, check.records - len(check.problems)
    except TetherError as e:
        trail.unverified = [str(e)]
    held = {r.seq for r in trail.line()}
    if snap is None:
        trail.written = max(held, default=0)
    trail.missing = [n for n in range(1, trail.written - trail.waiting + 1) if n not in held]
    mine = by_id[current]
    for record in window:
        if record.seq and record.seq not in held:
            mine.records.append(record)
            mine.from_window.append(record.seq)
    mine.records.sort(key=lambda r: r.seq)
    return trail


async def full_timeline(client: Client, run_id: str, audit_dir: str | None = None) -> list[TransitionRecord]:
    """Every record of the run's current line, each once: the audit sink's merged with the
    window the run keeps (the timeline query holds the first and the latest records only).
    ``audit_trail`` has every execution (resets too) and what the sink lacks."""
    return (await audit_trail(client, run_id, audit_dir)).line()
