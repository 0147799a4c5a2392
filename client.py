"""Drive Tether from a program: connect to Temporal, start runs, decide, hand off, cancel, inspect.

The ``tether`` CLI (``starter.py``), the demo, the benchmarks and the tests all go through these
functions; none of them needs argparse. Each returns a pydantic model or raises
:class:`TetherError`, whose ``code`` is the CLI's exit code (0 OK, 1 REFUSED, 2 USAGE, 3 PENDING:
``tether.connection`` says what each means, and where the connection's settings come from).
The connection, TetherError and repair live in the ``tether`` package (``tether.connection``,
``tether.repair``); this module names them too, for one release.

    client = await connect()
    handle = await start_run(client, RunRequest(...), run_id="run-1")
    status = await wait_settled(client, "run-1", timeout=60)
    verdict = await decide(client, "run-1", "approve", DecisionInput(by="bob"))
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.api.enums.v1 import PendingWorkflowTaskState, TaskQueueKind, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, CancelledError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from workflows import policy
from workflows.display import escape_text, show_value
from workflows import states
from workflows.wording import effect_words, money
from workflows.published import BUILD, CHANGE_VERSION_ATTRIBUTE, STATE_ATTRIBUTE, TENANT_ATTRIBUTE
from workflows.details import start_details, start_summary
from workflows.contract import (
    NAME_PATTERN,
    CancelRequest,
    CompensationCall,
    DecideRequest,
    DecideResult,
    ExecutedStep,
    HandoffRequest,
    Plan,
    ReviseDecideRequest,
    first_error,
)
from workflows.run_state import PendingApproval, RunOutcome, RunView, RunRequest, RunSnapshot
from workflows.states import TERMINAL, RunState, TransitionRecord

# Moved to the `tether` package (what programs import); client.py names them too, for one release.
from tether.connection import (  # noqa: F401  (connect_config, exit_process: re-exported)
    DEFAULT_TASK_QUEUE, DEPLOYMENT_ENV, MCP_TASK_QUEUE, OK, PENDING, QUERY_TIMEOUT, REFUSED, USAGE, TetherError,
    checkout_stack, connect, connect_config, deployment_name, exit_process, rpc_error, task_queue, timed_out,
)
from tether.repair import RepairResult, forced_reset as _forced_reset, repair, reset_judged  # noqa: F401  (repair)
from tether.runs import StuckTask, ViewUnverified, describe as _describe, public_keys, published_view, stuck_task

# Seconds a decision or handoff waits for the run's verdict (TETHER_VERDICT_TIMEOUT).
VERDICT_TIMEOUT = float(os.environ.get("TETHER_VERDICT_TIMEOUT") or 10.0)


def invalid(what: str, err: ValidationError) -> TetherError:
    """A pydantic error as a usage error naming the field (never a traceback)."""
    first = err.errors()[0]
    names = [str(p) for p in first["loc"] if not isinstance(p, int)]
    return TetherError(f"invalid {what}: {first_error(err)}", field=names[-1] if names else None, detail=first["msg"])


# ----------------------------------------------------------------------------- workers


def start_worker_hint(queue: str) -> str:
    if queue == DEFAULT_TASK_QUEUE:
        return "`make worker`"
    if queue == MCP_TASK_QUEUE:
        return "`make demo-mcp` (or `.venv/bin/python -m examples.devstack up mcp-worker`)"
    return f"`TETHER_TASK_QUEUE={queue} make worker`"


# A task is taken within milliseconds by a worker with a free slot: one scheduled this long
# without being taken means no worker is taking the queue's tasks (or every one is saturated).
TAKE_SECONDS = 10.0


def no_worker_message(queue: str) -> str:
    return f"no worker polls task queue '{escape_text(queue)}' — start one with {start_worker_hint(queue)}"


# A live worker's long polls last up to a minute each, and Temporal lists a poller for minutes
# after its last poll: a poller not seen for longer than this is gone (TETHER_POLLER_FRESH).
POLLER_FRESH = timedelta(seconds=float(os.environ.get("TETHER_POLLER_FRESH") or 75))
# Workers report themselves every minute by default (Runtime worker_heartbeat_interval), and say
# so when they shut down: one not heard from for longer than this is gone.
HEARTBEAT_FRESH = timedelta(seconds=150)
# The one-round-trip calls that judge whether a worker serves: short, so no command hangs on them.
PROBE_TIMEOUT = timedelta(seconds=5)


def _probe_unsupported(err: RPCError) -> bool:
    """A server (or an authorizer) that does not offer the call: judge without it."""
    return err.status in (
        RPCStatusCode.UNIMPLEMENTED, RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.FAILED_PRECONDITION,
        RPCStatusCode.INVALID_ARGUMENT,
    )


async def _gone_workers(client: Client, queue: str, now: datetime) -> dict[str, datetime | None] | None:
    """The workers on ``queue`` that said they stopped, or have not reported for HEARTBEAT_FRESH
    (ListWorkers, from the workers' own heartbeats), by identity: when they were last heard from
    (None: never). An identity with one process still reporting RUNNING is not gone. None: not
    available."""
    from temporalio.api.enums.v1 import WorkerStatus
    from temporalio.api.workflowservice.v1 import ListWorkersRequest

    quoted = queue.replace("\\", "\\\\").replace("'", "\\'")
    try:
        response = await client.workflow_service.list_workers(
            ListWorkersRequest(namespace=client.namespace, page_size=200, query=f"TaskQueue = '{quoted}'"),
            timeout=PROBE_TIMEOUT,
        )
    except RPCError as e:
        if _probe_unsupported(e) or timed_out(e):
            return None
        raise rpc_error(e, queue) from None
    gone: dict[str, datetime | None] = {}
    running = set()
    for info in response.workers_info:
        beat = info.worker_heartbeat
        seen = beat.heartbeat_time.ToDatetime(timezone.utc) if beat.HasField("heartbeat_time") else None
        if beat.status == WorkerStatus.WORKER_STATUS_RUNNING and seen is not None and now - seen <= HEARTBEAT_FRESH:
            running.add(beat.worker_identity)  # one process of this identity reports itself alive
        else:
            last = gone.get(beat.worker_identity)
            gone[beat.worker_identity] = seen if last is None or (seen is not None and seen > last) else last
    return {identity: seen for identity, seen in gone.items() if identity not in running}


async def worker_serving(client: Client, queue: str) -> bool | None:
    """Whether a live worker serves ``queue`` (workflow tasks), judged without waiting on one.

    Temporal lists a poller for minutes after its worker died, so a listed poller is not
    enough: one counts only if it polled within POLLER_FRESH and its worker has not reported
    itself stopped (or silent) in its heartbeats (ListWorkers), or it polled after that report:
    a worker restarted in place (the same identity, as a container's PID 1 on the same host)
    serves from its first poll, before its first heartbeat. False: none does; None: this
    server does not let us tell (DescribeTaskQueue refused). Callers that act on a run still
    find out for sure when a worker takes (or never takes) the run's task.
    """
    try:
        response = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=client.namespace,
                task_queue=TaskQueue(name=queue, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            ),
            timeout=PROBE_TIMEOUT,
        )
    except RPCError as e:
        if _probe_unsupported(e) or timed_out(e):
            return None
        raise rpc_error(e, queue) from None
    now = datetime.now(timezone.utc)
    fresh = {
        p.identity: p.last_access_time.ToDatetime(timezone.utc) for p in response.pollers
        if p.HasField("last_access_time") and now - p.last_access_time.ToDatetime(timezone.utc) <= POLLER_FRESH
    }
    if not fresh:
        return False
    gone = await _gone_workers(client, queue, now) or {}

    def alive(identity: str, polled: datetime) -> bool:
        if identity not in gone:
            return True
        stopped = gone[identity]
        return stopped is not None and polled > stopped  # polled after it said it stopped: restarted

    return any(alive(identity, polled) for identity, polled in fresh.items())


async def has_worker(client: Client, queue: str) -> bool:
    """``worker_serving``, with "cannot tell" taken as yes (the call then finds out)."""
    return await worker_serving(client, queue) is not False


async def require_worker(client: Client, run_id: str) -> None:
    """Raise, naming the run's task queue, when no worker serves it: the run cannot answer a
    query or act on a decision until one does. A run that has closed needs one for queries too."""
    try:
        description = await client.get_workflow_handle(run_id).describe(rpc_timeout=PROBE_TIMEOUT)
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    if not await has_worker(client, description.task_queue):
        raise TetherError(no_worker_message(description.task_queue), rule="no_worker")
    waiting = untaken_seconds(description)
    if waiting is not None and waiting > TAKE_SECONDS:
        raise TetherError(untaken_message(run_id, description.task_queue, waiting), rule="no_worker")


def untaken_seconds(description: Any) -> float | None:
    """How long the run's workflow task has waited for a worker to take it (None: no task is
    waiting; a worker has it or the run has nothing to do)."""

    task = description.raw_description.pending_workflow_task
    if task.state != PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_SCHEDULED or not task.HasField("scheduled_time"):
        return None
    if task.attempt > 1:
        return None  # a task that failed is retried with a backoff: a worker did take it
    return (datetime.now(timezone.utc) - task.scheduled_time.ToDatetime(timezone.utc)).total_seconds()


def untaken_message(run_id: str, queue: str, waited: float) -> str:
    return (
        f"no worker has taken run {run_id}'s task on task queue '{escape_text(queue)}' in {waited:.0f}s — "
        f"start one with {start_worker_hint(queue)} (if one runs, see its log: it may be saturated)"
    )


async def no_answer(client: Client, run_id: str, waited: float) -> TetherError:
    """A query or decision nobody answered in time: say which queue, and what to do."""
    try:
        description = await client.get_workflow_handle(run_id).describe(rpc_timeout=PROBE_TIMEOUT)
    except RPCError:
        description = None
    queue = description.task_queue if description is not None else task_queue()
    untaken = untaken_seconds(description) if description is not None else None
    if untaken is not None and untaken > TAKE_SECONDS:
        return TetherError(untaken_message(run_id, queue, untaken), rule="no_worker")
    return TetherError(
        f"no worker answered for run {run_id} within {waited:g}s on task queue '{escape_text(queue)}' — "
        f"start one with {start_worker_hint(queue)} (if one runs, see its log: it may be overloaded)",
        rule="no_worker",
    )


# ----------------------------------------------------------------------------- runs


class RunStatus(RunSnapshot):
    """The ``snapshot`` query, plus why the run ended (the final record) once it has."""

    end_reason: str | None = None
    end_rule: str | None = None  # the rule or error code on that record, when it names one
    end_actor: str | None = None  # who or what ended it (user:bob, operator:dana, runtime)
    temporal_status: str | None = None  # Temporal's word: RUNNING, COMPLETED, FAILED, TERMINATED, ...
    # Set when Temporal has closed the run while its last Tether state is a working one (a
    # failed or terminated run that still says AWAITING_APPROVAL): it will not go on.
    closed_by_temporal: str | None = None
    # The run's record of the latest decision or handoff (its verdict, once the run has one).
    last_decision: TransitionRecord | None = None
    # Read from what the run published (its memo) at this workflow time; None: read live (queries).
    published_at: datetime | None = None
    # The state the run is listed in (AgentRunState) when it has moved on since it published.
    listed_state: str | None = None
    task_queue: str | None = None
    worker_serving: bool | None = None  # a worker serves the run's queue now (None: cannot tell)
    stuck: StuckTask | None = None  # its workflow task keeps failing
    # Why the view in its memo was not shown: not signed by the fleet for this run (read live).
    view_unverified: str | None = None
    # Why the effect ledger could not be read: where each write stands is then unknown.
    ledger_error: str | None = None
    # Set when the run had published nothing and no worker answered at once: what is shown is
    # only what Temporal lists (its state, start), and why.
    unanswered: str | None = None

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL


def closed_note(state: str | None, temporal_status: str | None) -> str | None:
    """What to say of a run Temporal has closed while its last Tether state is a working one."""
    if temporal_status in (None, "RUNNING", "CONTINUED_AS_NEW") or state is None:
        return None
    try:
        if RunState(state) in TERMINAL:
            return None
    except ValueError:
        return None
    return (
        f"Temporal closed this run ({temporal_status}) while its last Tether state was {state}: "
        f"it will not go on (see the Web UI / `temporal workflow show` for why)"
    )


class RunSummary(BaseModel):
    run_id: str
    state: str | None
    tenant: str | None
    status: str | None
    started: datetime | None
    closed_by_temporal: str | None = None  # as in RunStatus
    published_at: datetime | None = None  # when the run last published its view (None: never)
    view: RunView | None = Field(None, exclude=True)  # what it published (for the inbox; not listed out)
    view_unverified: str | None = None  # its memo holds a view the fleet did not sign for it
    stuck: StuckTask | None = None  # with ``list_runs(stuck=True)``: its workflow task keeps failing


class Verdict(BaseModel):
    """The run's record of a decision or handoff (``record`` None: not processed in time)."""

    run_id: str
    decision_id: str
    record: TransitionRecord | None = None
    plan: Plan | None = None
    pending: PendingApproval | None = None
    reset: RepairResult | None = None  # a forced hand-off's reset


def sign_request(request: RunRequest, run_id: str, key: Path) -> RunRequest:
    """The request with the requester's Ed25519 signature over policy.start_signature_payload:
    where the tenant requires signatures, a run starts only with it."""
    # A fresh nonce and the time of signing: a captured start goes stale after the tenant's
    # start_signature_ttl.
    request = request.model_copy(
        update={"nonce": secrets.token_hex(16), "issued_at": datetime.now(timezone.utc).replace(microsecond=0)}
    )
    payload = policy.start_signature_payload(
        workflow_id=run_id,
        tenant=request.tenant,
        requested_by=request.requested_by,
        request_digest=request.request_digest(),
        nonce=request.nonce,
        issued_at=request.issued_at,
    )
    return request.model_copy(update={"requester_signature": sign(key, payload)})


async def start_run(
    client: Client,
    request: RunRequest,
    *,
    run_id: str,
    queue: str | None = None,
    allow_id_reuse: bool = False,
) -> WorkflowHandle:
    """Start an AgentRun the one way: search attributes and Web UI summary set from the start.

    The id of a run that has finished is not reused unless asked for: decisions and signatures
    name the first run id, but a person reading "run X" should find one run.
    """
    try:
        return await client.start_workflow(
            "AgentRun",
            # The fields at their defaults left out: read back, the request is the same.
            request.model_dump(mode="json", exclude_defaults=True),
            id=run_id,
            task_queue=queue or task_queue(),
            id_reuse_policy=(
                WorkflowIDReusePolicy.ALLOW_DUPLICATE if allow_id_reuse else WorkflowIDReusePolicy.REJECT_DUPLICATE
            ),
            result_type=RunOutcome,
            search_attributes=TypedSearchAttributes(
                [
                    # The state the run's first workflow task moves it to (RECEIVED lasts only
                    # inside that task): listed as it will be, without an upsert of its own.
                    SearchAttributePair(STATE_ATTRIBUTE, states.first_published(compensation=request.compensate_run is not None).value),
                    SearchAttributePair(TENANT_ATTRIBUTE, request.tenant),
                ]
            ),
            # The Web UI renders both as markdown (the requester's text shown inert), and shows
            # them together: the details say what the summary does not.
            static_summary=start_summary(request),
            static_details=start_details(request),
        )
    except WorkflowAlreadyStartedError:
        raise TetherError(f"a run with id {run_id!r} already exists: pick another id", rule="already_started") from None
    except RPCError as e:
        raise rpc_error(e, run_id) from None


async def snapshot(client: Client, run_id: str, *, timeout: float | None = None) -> RunSnapshot:
    handle = client.get_workflow_handle(run_id)
    rpc_timeout = QUERY_TIMEOUT if timeout is None else min(QUERY_TIMEOUT, timedelta(seconds=timeout))
    try:
        return await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=rpc_timeout)
    except RPCError as e:
        if timed_out(e):
            raise await no_answer(client, run_id, rpc_timeout.total_seconds()) from None
        raise rpc_error(e, run_id) from None
    except WorkflowQueryFailedError as e:
        raise TetherError(f"run {run_id} could not answer: {e}") from None


async def timeline(client: Client, run_id: str) -> list[TransitionRecord]:
    handle = client.get_workflow_handle(run_id)
    try:
        return await handle.query("timeline", result_type=list[TransitionRecord], rpc_timeout=QUERY_TIMEOUT)
    except RPCError as e:
        if timed_out(e):
            raise await no_answer(client, run_id, QUERY_TIMEOUT.total_seconds()) from None
        raise rpc_error(e, run_id) from None
    except WorkflowQueryFailedError as e:
        raise TetherError(f"run {run_id} could not answer: {e}") from None


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
    from activities.audit import sink_from_env

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
        # What the run published where it last rested fills the sink's gaps and says how many
        # records it had written; only a run that has published nothing is asked (a query).
        try:
            view = await published_view(description)
        except ViewUnverified as e:
            view, unchecked = None, f"{e}: the records are the sink's alone"
        if view is not None:
            window, snap, published_at = view.timeline, view.snapshot, view.published_at
        elif unchecked is None:
            try:
                queue = description.task_queue
                if await worker_serving(client, queue) is False:
                    raise TetherError(no_worker_message(queue), rule="no_worker")
                window, snap = await timeline(client, run_id), await snapshot(client, run_id)
            except (TetherError, RPCError) as e:
                unchecked = f"the run did not answer ({e}): the records are the sink's alone"
    try:
        sink = sink_from_env(audit_dir, dsn)
        try:
            streams = await sink.read(run_id)
        finally:
            await sink.aclose()
    except Exception as e:  # the sink cannot be read: say which and why
        raise TetherError(f"cannot read the audit sink: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    if current is None and not streams:
        raise TetherError(f"unknown run {run_id!r}: neither Temporal nor the audit sink ({sink.describe()}) has it",
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

    def start(b: AuditBranch) -> tuple:
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
    from activities.audit import verify_streams

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


# ----------------------------------------------------------------------------- published state

# Describes at once when listing runs stuck: one each, a few at a time.
DESCRIBE_CONCURRENCY = 8


def age(at: datetime, now: datetime | None = None) -> str:
    """How long ago ``at`` was, for a person: ``4 s``, ``12 min``, ``3 h 5 min``."""
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - at).total_seconds()))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def freshness(published_at: datetime, now: datetime | None = None) -> str:
    """``as published at 20:51:03 UTC, 4 s ago``: how old what a view shows is."""
    return f"as published at {published_at.astimezone(timezone.utc):%H:%M:%S} UTC, {age(published_at, now)} ago"


async def _sink_records(workflow_id: str, run_id: str) -> list[TransitionRecord]:
    """The records of this execution the audit sink (the workers', TETHER_AUDIT_DSN /
    TETHER_AUDIT_DIR) holds; none when this client cannot read it."""
    from activities.audit import sink_from_env

    try:
        sink = sink_from_env()
        try:
            streams = await sink.read(workflow_id)
        finally:
            await sink.aclose()
    except Exception:  # noqa: BLE001 (not this client's sink to read: the view alone is shown)
        return []
    return streams.get(run_id, [])


async def undo_standing(compensations: list[CompensationCall]) -> list[CompensationCall]:
    """Each write's undo as the workers' effect ledger (beside their audit sink: TETHER_AUDIT_DSN /
    TETHER_AUDIT_DIR) says it stands: undone by which run and when, or started with its outcome
    unknown (it may have applied). ``unknown`` where this client cannot read the ledger (the
    ledger is the witness: never "pending" for want of it); ``ledger_standing`` says why."""
    return (await ledger_standing(compensations))[0]


async def ledger_standing(compensations: list[CompensationCall]) -> tuple[list[CompensationCall], str | None]:
    """``undo_standing``, and why the ledger could not be read (None when it was)."""
    if not any(c.tool and c.status != "ok" for c in compensations):
        return compensations, None
    from activities.audit import sink_from_env
    from activities.effect_ledger import ledger_for
    from activities.recovery import RecoveryActivities

    try:
        ledger = ledger_for(sink_from_env())
        try:
            return await RecoveryActivities.standing_in(ledger, compensations), None
        finally:
            await ledger.aclose()
    except Exception as e:  # noqa: BLE001 (any reason: where each write stands is unknown)
        unread = [c.model_copy(update={"status": "unknown"}) if c.tool and c.status != "ok" else c for c in compensations]
        return unread, f"the effect ledger cannot be read ({type(e).__name__}: {str(e)[:300]})"


async def status(client: Client, run_id: str, *, live: bool = False) -> RunStatus:
    """The run's state, and for a run that has ended the reason on its final record.

    By default from what the run published where it last rested (its memo; ``published_at``
    says when): no worker is needed and nothing reaches the run. ``live``: the ``snapshot`` and
    ``timeline`` queries, through a worker. A run that has published nothing yet is read live.
    Each write's undo is shown as the effect ledger says it stands (``ledger_standing``).
    """
    result = (await read_run(client, run_id, live=live))[0]
    if result.ended:
        result.compensations, result.ledger_error = await ledger_standing(result.compensations)
    return result


# A run that has published nothing yet is asked (the snapshot query) for at most this long when
# not read live: a worker that died holding it looks alive for a minute (its pollers and last
# heartbeat), and the query would wait on it until Temporal gives up (ten seconds). A live
# worker answers from its cache in milliseconds; one that does not in time leaves the answer
# to what Temporal lists (and `--live`).
UNPUBLISHED_QUERY_SECONDS = 0.5


def _listed_snapshot(description: Any) -> RunSnapshot:
    """What Temporal lists of a run that has published nothing: its listed state and start."""
    attrs = description.typed_search_attributes
    listed = attrs.get(STATE_ATTRIBUTE)
    return RunSnapshot(
        run_id=description.id, tenant=attrs.get(TENANT_ATTRIBUTE) or "",
        state=RunState(listed) if listed in RunState.__members__ else RunState.RECEIVED,
        previous_state=None, state_version=0, plan=None, pending_approval=None, step=0, retries=0, last_error=None,
        approved_by=[], answer=None, created_at=description.start_time, updated_at=None,
    )


async def read_run(client: Client, run_id: str, *, live: bool = False) -> tuple[RunStatus, list[TransitionRecord]]:
    """``status`` and the records it was read with (the published view's latest records, or
    the ``timeline`` query's window when ``live``)."""
    description = await _describe(client, run_id)
    queue = description.task_queue
    serving = await worker_serving(client, queue)
    unverified = None
    try:
        view = None if live else await published_view(description)
    except ViewUnverified as e:
        # Read live where a worker can answer; nothing of the memo is shown as the run's.
        view, unverified = None, str(e)
    if view is None:
        if serving is False:
            if unverified:
                raise ViewUnverified(f"run {run_id}: {unverified}; and {no_worker_message(queue)}")
            raise TetherError(no_worker_message(queue), rule="no_worker")
        try:
            snap = await snapshot(client, run_id, timeout=None if live else UNPUBLISHED_QUERY_SECONDS)
        except TetherError as e:
            if unverified:  # what Temporal lists is no better than the memo: nothing is shown
                raise ViewUnverified(f"run {run_id}: {unverified}; and the run did not answer ({e})") from None
            if live or e.rule != "no_worker":
                raise
            snap, records = _listed_snapshot(description), []
            result = RunStatus(**snap.model_dump(), unanswered=(
                f"the run has published nothing yet (it publishes where it rests) and no worker answered within "
                f"{UNPUBLISHED_QUERY_SECONDS:g}s on task queue '{escape_text(queue)}': the one holding it may have died "
                f"(`tether status --live {run_id}` waits for an answer)"
            ))
        else:
            records = await timeline(client, run_id)
            result = RunStatus(**snap.model_dump())
    else:
        # The view holds the latest few records, and the run does not publish it again for every
        # decision it refuses while it waits (a flood would write one each): the audit sink has
        # every record of this execution, the decisions among them.
        from activities.audit import merge_timeline

        records = merge_timeline(await _sink_records(description.id, description.run_id), view.timeline)
        result = RunStatus(**view.snapshot.model_dump(), published_at=view.published_at)
        listed = description.typed_search_attributes.get(STATE_ATTRIBUTE)
        if listed and listed != result.state.value:
            result.listed_state = listed  # it has moved on since it published (states.to_publish)
    result.task_queue = queue
    result.view_unverified = unverified
    result.worker_serving = serving
    result.temporal_status = description.status.name if description.status else None
    result.closed_by_temporal = closed_note(result.state.value, result.temporal_status)
    result.stuck = await stuck_task(client, description)
    result.last_decision = next((r for r in reversed(records) if r.refs.decision_id), None)
    if result.ended:
        moves = [r for r in records if r.kind == "transition"]
        if moves:
            final = moves[-1]
            result.end_reason = final.reason
            result.end_rule = final.rule or final.refs.error_code
            result.end_actor = final.actor
            if final.from_state == RunState.VALIDATION_FAILED and len(moves) > 1:
                # "the replan budget is used up" says little without what failed validation.
                result.end_reason += f"; last validation: {moves[-2].reason}"
    return result, records


async def run_outcome(handle: WorkflowHandle) -> RunOutcome:
    """How a run ended (waits for it), whatever Temporal status it ended with.

    Completed: the workflow's result. Failed with a RunOutcome (FAILED, EXECUTION_FAILED): the
    outcome is the failure's details. Canceled (CANCELLED): read back with the snapshot and
    timeline queries (a cancelled execution carries no result; ``steps`` is then empty). Any
    other failure (an invalid start input, a terminated run) raises WorkflowFailureError.
    The result carries no timeline or steps (RunOutcome.records and steps_executed count them):
    they are read with the ``timeline`` and ``steps`` queries (a worker replays the closed run
    to answer them).
    """
    try:
        raw = await handle.result()
    except WorkflowFailureError as e:
        cause = e.cause
        if isinstance(cause, ApplicationError) and cause.details and cause.type in RunState.__members__:
            return await _with_timeline(handle, RunOutcome.model_validate(cause.details[0]))
        if isinstance(cause, CancelledError):
            snap = await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=QUERY_TIMEOUT)
            if snap.state == RunState.CANCELLED:
                records = await handle.query("timeline", result_type=list[TransitionRecord], rpc_timeout=QUERY_TIMEOUT)
                return RunOutcome(
                    run_id=snap.run_id, state=snap.state, answer=snap.answer, steps=[], timeline=records,
                    records=snap.timeline_records,
                )
        raise
    return await _with_timeline(handle, raw if isinstance(raw, RunOutcome) else RunOutcome.model_validate(raw))


async def _with_timeline(handle: WorkflowHandle, outcome: RunOutcome) -> RunOutcome:
    if not outcome.records or outcome.timeline:
        return outcome  # a run recorded before: its result carried both
    # The chain's last run (a run that continued as new ended in a later one than started).
    last = handle._client.get_workflow_handle(handle.id)  # noqa: SLF001 (the handle's own client)
    outcome.timeline = await last.query("timeline", result_type=list[TransitionRecord], rpc_timeout=QUERY_TIMEOUT)
    if outcome.steps_executed and not outcome.steps:
        outcome.steps = await last.query("steps", result_type=list[ExecutedStep], rpc_timeout=QUERY_TIMEOUT)
    return outcome


async def wait_settled(
    client: Client, run_id: str, timeout: float, *, approval_settles: bool = True,
    progress: Any = None,
) -> RunStatus:
    """Poll until the run has ended (or waits for a person, with ``approval_settles``) or
    ``timeout`` seconds have passed; returns its status then. A run no worker answers for
    within ``timeout`` raises TetherError (rule ``no_worker``) naming its task queue.
    ``progress(snapshot, seconds)`` is called after each look."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline = began + timeout
    await require_worker(client, run_id)
    while True:
        try:
            snap = await snapshot(client, run_id, timeout=max(deadline - loop.time(), 1.0))
        except TetherError as e:
            if e.rule == "no_worker" and loop.time() < deadline:
                continue  # a query can time out before the wait does
            raise
        if progress is not None:
            progress(snap, loop.time() - began)
        waiting = approval_settles and snap.state == RunState.AWAITING_APPROVAL
        if waiting or snap.state in TERMINAL or loop.time() > deadline:
            return await status(client, run_id, live=True)  # as the query just saw it, not as last published
        await asyncio.sleep(0.2)


async def _await_record(client: Client, run_id: str, decision_id: str, timeout: float) -> TransitionRecord | None:
    """The run decides; read its verdict back from the timeline (refs.decision_id): the
    ``timeline`` query, or where no worker that replays the run answers it (another build's
    took it), what the run published and its audit records."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            records = await timeline(client, run_id)
        except TetherError:
            try:
                records = (await read_run(client, run_id))[1]
            except TetherError:
                records = []  # sent all the same: the verdict is read later (`tether status`)
        for record in reversed(records):
            if record.refs.decision_id == decision_id:
                return record
        if loop.time() > deadline:
            return None
        await asyncio.sleep(0.2)


def _refused(record: TransitionRecord | None) -> None:
    if record is not None and record.kind == "refused":
        raise TetherError(f"{record.reason} [rule: {record.rule}]", REFUSED, rule=record.rule)


@dataclass(frozen=True)
class DecisionInput:
    """What a person decides on a pending plan (``plan_hash`` None: the pending one)."""

    by: str
    plan_hash: str | None = None
    decision_id: str | None = None  # None: a random one
    comment: str | None = None
    reason: str | None = None
    key: Path | None = None  # PEM Ed25519 private key: sign the decision
    request_id: str | None = None  # None: the pending one (else refused when it is not)
    # A trusted signer's name (policy [signers.NAME]): ``key`` is that signer's, attesting that
    # it verified ``by`` itself (the inbox); the run shows ``user:BY via NAME``.
    attest_as: str | None = None
    steps: list[int] | None = None  # approve only these steps (1-based); None: all
    # Not bound to a plan the person was shown (`tether approve --unreviewed`): the record says so.
    unreviewed: bool = False


# The shortest plan hash prefix a decision may name: what `tether` prints (timeline, refusals).
HASH_PREFIX = 12


def resolve_plan_hash(given: str | None, pending: str) -> str:
    """The plan hash a decision names: ``given`` in full, or a prefix of at least HASH_PREFIX
    hex characters of the pending hash (the form tether prints) widened to it. Any other hash
    is sent as given, and the run refuses it as stale on its record."""
    if given is None:
        return pending
    text = given.strip().lower()
    if not re.fullmatch(r"[0-9a-f]+", text) or len(text) < HASH_PREFIX:
        raise TetherError(
            f"plan hash {given[:80]!r}: give the plan's hash, or at least its first {HASH_PREFIX} hex characters "
            f"(as `tether status RUN` prints it)", field="plan_hash", detail=f"give at least {HASH_PREFIX} hex characters of the plan hash",
        )
    return pending if pending.startswith(text) else text


def build_decision(snap: RunSnapshot, kind: Literal["approve", "reject"], given: DecisionInput) -> DecideRequest:
    """The one place a decision is built and, with ``given.key``, signed (Ed25519 over
    ``policy.signature_payload``); the approval contract lives here for every client."""
    pending = snap.pending_approval
    if pending is None:
        raise TetherError(f"run {snap.run_id} has no pending approval", REFUSED)
    try:
        decision = DecideRequest(
            kind=kind,
            decision_id=given.decision_id if given.decision_id is not None else uuid.uuid4().hex,
            approver=given.by,
            plan_hash=resolve_plan_hash(given.plan_hash, pending.plan_hash),
            request_id=given.request_id or pending.request_id or None,
            comment=given.comment,
            reason=given.reason,
            attested_by=given.attest_as,
            steps=given.steps,
            unreviewed=given.unreviewed,
        )
    except ValidationError as e:
        raise invalid("decision", e) from None
    if given.key is not None:
        payload = policy.decision_signature_payload(
            workflow_id=snap.run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, kind=kind, decision=decision
        )
        decision.signature = sign(given.key, payload)
    return decision


def revised_steps(plan: Plan, edits: Sequence[tuple[int, str, Any]]) -> list[dict[str, Any]]:
    """The whole plan as ``{tool, args}`` steps with the edits applied (the run validates it)."""
    steps = [{"tool": s.tool, "args": dict(s.args)} for s in plan.steps]
    for number, key, value in edits:
        if number > len(steps):
            raise TetherError(f"--step {number}: the pending plan has {len(steps)} step(s)", REFUSED)
        steps[number - 1]["args"][key] = value
    return steps


async def revise(
    client: Client,
    run_id: str,
    given: DecisionInput,
    steps: list[dict[str, Any]],
    *,
    held: RunSnapshot | None = None,
    timeout: float = VERDICT_TIMEOUT,
) -> Verdict:
    """Revise the run's pending plan (the whole revised list of steps); returns the run's record
    of it (VALIDATED: a new plan version, then a new approval request), or raises REFUSED with
    the rule (``invalid_revision`` and the validation reason, stale, not awaiting, role, ...).
    ``held``: the run as the caller read it, as for ``decide``."""
    snap, pending = await pending_request(client, run_id, held=held)
    try:
        revision = ReviseDecideRequest(
            kind="revise",
            decision_id=given.decision_id if given.decision_id is not None else uuid.uuid4().hex,
            editor=given.by,
            plan_hash=resolve_plan_hash(given.plan_hash, pending.plan_hash),  # a stale one is sent, refused on the record
            request_id=given.request_id or pending.request_id or None,
            steps=steps,
            reason=given.reason or "",
            attested_by=given.attest_as,
        )
    except ValidationError as e:
        raise invalid("revision", e) from None
    if given.key is not None:
        payload = policy.decision_signature_payload(
            workflow_id=snap.run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, kind="revise",
            decision=revision.as_decision(), steps_digest=revision.revised_hash(),
        )
        revision.signature = sign(given.key, payload)
    record = await _send_decision(client, run_id, revision, timeout)
    return Verdict(run_id=run_id, decision_id=revision.decision_id, record=record, plan=snap.plan, pending=pending)


def keygen(path: Path, *, force: bool = False) -> str:
    """Write a new Ed25519 private key (PEM, 0600) to ``path`` and its public key (raw, base64)
    to ``path.pub``; returns the public key, as the policy file lists it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if path.exists() and not force:
        raise TetherError(f"{path} exists; pass --force to overwrite")
    key = Ed25519PrivateKey.generate()
    public = base64.b64encode(
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Each file whole or not at all (written aside, then renamed), the public one first: a
        # reader never sees half a key, nor a private key without its public one.
        for target, data, mode in ((path.with_name(path.name + ".pub"), (public + "\n").encode(), 0o644),
                                   (path, private, 0o600)):
            aside = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
            fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(aside, target)
    except OSError as e:
        raise TetherError(f"cannot write {path}: {e.strerror}") from None
    return public


def ensure_keys(folder: Path, names: Sequence[str]) -> None:
    """Key pairs for these people under ``folder`` (NAME.pem, NAME.pem.pub), made if missing:
    what `make demo` signs with, and what the example policy's signed tenant lists. Processes
    that ask at once (the demo, the inbox, parallel tests) take turns: one makes each pair."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".ensure.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in names:
            if not (folder / f"{name}.pem").exists():
                keygen(folder / f"{name}.pem")


def sign(key: Path, payload: bytes) -> str:
    """The Ed25519 signature (base64) of ``payload`` with the private key in ``key`` (PEM): the one
    way a start, decision, revision, hand-off or cancel is signed."""
    return base64.b64encode(load_private_key(key).sign(payload)).decode()


def load_private_key(path: Path) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        key = load_pem_private_key(path.read_bytes(), password=None)
    except (FileNotFoundError, IsADirectoryError):
        raise TetherError(f"key file not found: {path}") from None
    except (ValueError, TypeError) as e:
        raise TetherError(f"{path} is not a PEM private key ({e}); make one with `tether keygen`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise TetherError(f"{path} is not an Ed25519 key; make one with `tether keygen`")
    return key


async def decide(
    client: Client,
    run_id: str,
    kind: Literal["approve", "reject"],
    given: DecisionInput,
    *,
    held: RunSnapshot | None = None,
    timeout: float = VERDICT_TIMEOUT,
) -> Verdict:
    """Approve or reject the run's pending plan; returns the run's record of the decision.

    ``held``: the run as the caller read it and showed it (``pending_request``): its pending
    request is the one decided, not read a second time.

    Refused before sending (not awaiting approval, stale plan hash) or by the run (four-eyes,
    role, signature, ...): :class:`TetherError` with code REFUSED and the rule.
    """
    snap, pending = await pending_request(client, run_id, held=held)
    # A stale plan hash is sent all the same: the run records the attempt, and refuses it
    # (stale_plan_hash) on its timeline.
    decision = build_decision(snap, kind, given)
    record = await _send_decision(client, run_id, decision, timeout)
    return Verdict(run_id=run_id, decision_id=decision.decision_id, record=record, plan=snap.plan, pending=pending)


async def pending_request(
    client: Client, run_id: str, *, held: RunSnapshot | None = None
) -> tuple[RunSnapshot, PendingApproval]:
    """The run's pending request (a worker is there to take a decision), or REFUSED.

    ``held``: the run as the caller already read it (this function, or a status whose worker
    probe it judged): taken as it is when it holds a pending request, with no call; one that
    holds none (a published view a moment behind the run) is read again, as without one.

    Asked first (the ``snapshot`` query, briefly): the view a run publishes where it rests lags
    a moment behind a revision or a new request. Where no worker of the run's build answers at
    once (another build's worker took the query, or none is left), read from the view it
    published, so no query routing decides whether a decision is sent: the decide Update judges
    it against the run's own state. Either way the steps shown must hash to the plan hash the
    request binds (``approval_offer_problem``), or nothing is offered."""
    if held is not None and held.state == RunState.AWAITING_APPROVAL and held.pending_approval is not None:
        if isinstance(held, RunStatus) and held.worker_serving is False and held.task_queue is not None:
            raise TetherError(no_worker_message(held.task_queue), rule="no_worker")  # as its probe said
        return held, held_request(held)
    await require_worker(client, run_id)
    try:
        snap = await snapshot(client, run_id, timeout=PENDING_QUERY_SECONDS)
    except TetherError:
        view = await published_view(await _describe(client, run_id))
        snap = view.snapshot if view is not None else await snapshot(client, run_id)
    return snap, held_request(snap)


def held_request(snap: RunSnapshot) -> PendingApproval:
    """The pending request of a run as read, or REFUSED: it is not awaiting approval, or the steps
    shown do not hash to the plan hash the request binds (``approval_offer_problem``)."""
    pending = snap.pending_approval
    if snap.state != RunState.AWAITING_APPROVAL or pending is None:
        raise TetherError(
            f"run {snap.run_id} is {snap.state.value}, not awaiting approval", REFUSED, rule="not_awaiting_approval"
        )
    problem = approval_offer_problem(snap)
    if problem is not None:
        raise TetherError(f"run {snap.run_id}: {problem}", REFUSED, rule="plan_unverified")
    return pending


# How long `approve` asks the run for its pending request before it reads the published view.
PENDING_QUERY_SECONDS = 2.0


# How soon a decision the run had no room for is sent again (it is continuing as new).
CONTINUING_RETRY = 0.25


async def _send_decision(
    client: Client, run_id: str, decision: DecideRequest | ReviseDecideRequest, timeout: float
) -> TransitionRecord | None:
    """Through the decide Update; the run's record of it, or REFUSED / PENDING with the rule."""
    handle = client.get_workflow_handle(run_id)
    pending_verdict = TetherError(
        f"decision {decision.decision_id} accepted, verdict pending: the run is still checking it "
        f"(`tether status {run_id}` shows the verdict once it is there)",
        PENDING,
    )
    deadline = asyncio.get_running_loop().time() + timeout
    resent = False  # sent again after Temporal refused it while the run's task failed
    result: DecideResult | None = None
    while True:
        update = None
        try:
            # The decide Update: only a malformed or repeated decision, or one the run has no
            # room for until it continues as new, is refused before history; the answer is the
            # run's own record of the decision (policy check included).
            update = await handle.start_update(
                "decide", decision, wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=DecideResult,
                rpc_timeout=timedelta(seconds=timeout),
            )
            result = await asyncio.wait_for(update.result(rpc_timeout=timedelta(seconds=timeout)), timeout)
            break
        except WorkflowUpdateFailedError as e:
            refused = _refused_update(e, decision.kind)
            if resent and refused.rule == "duplicate_decision":
                break  # the first one was kept and taken once the task went through: read its verdict
            if refused.rule != "continuing_as_new" or asyncio.get_running_loop().time() >= deadline:
                raise refused from None
            # The run continues as new in a moment: the handle's latest run takes it then.
            await asyncio.sleep(CONTINUING_RETRY)
        except WorkflowUpdateRPCTimeoutOrCancelledError:
            if update is not None:
                raise pending_verdict from None  # accepted: on the run's record, to be judged
            # Not acknowledged in time: a worker is in the middle of the run's task (the policy
            # check runs in it, and the acceptance goes out with it), or no worker is there.
            task = await _pending_task(handle)
            if task is not None and task.attempt > 1:
                raise _task_failing_error(run_id) from None
            if task is not None and task.state == PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_STARTED:
                raise pending_verdict from None
            raise await no_answer(client, run_id, timeout) from None
        except asyncio.TimeoutError:
            # Accepted: it is on the run's record, and will be judged; not an error, not a verdict.
            raise pending_verdict from None
        except RPCError as e:
            if not _task_failing(e):
                raise rpc_error(e, run_id) from None
            if asyncio.get_running_loop().time() >= deadline:
                raise _task_failing_error(run_id) from None
            # Not taken: the run's workflow task failed on a worker that does not replay it (another
            # build's, on an unversioned queue). Temporal retries the task; a worker of the run's
            # own build takes it, and then the decision.
            resent = True
            await asyncio.sleep(TASK_FAILING_RETRY)
    if result is not None and result.outcome == "refused":
        raise TetherError(f"{result.reason} [rule: {result.rule}]", REFUSED, rule=result.rule)
    if result is not None and result.record is not None:
        return result.record  # the run's own record of it, in its answer: nothing more to ask
    # A run of an older build answers with the verdict alone: its record is read back.
    return await _await_record(client, run_id, decision.decision_id, timeout)


# How soon a decision is sent again that Temporal refused while the run's workflow task failed.
TASK_FAILING_RETRY = 0.5


def _task_failing(err: RPCError) -> bool:
    """Temporal takes no Update while the run's last workflow task failed (until one completes)."""
    return err.status == RPCStatusCode.FAILED_PRECONDITION and "workflow task in failed state" in err.message.lower()


def _refused_update(err: WorkflowUpdateFailedError, kind: str) -> TetherError:
    """The decide validator's refusal: its rule is the failure's type (``approve refused [rule]:
    why`` shown as ``approve refused: why [rule: rule]``). An older build's validator raised a
    plain error, typed by its Python class (``ValueError``): no rule, its message as it is."""
    cause = err.cause
    message = str(getattr(cause, "message", None) or cause or err)
    rule = cause.type if isinstance(cause, ApplicationError) else None
    if not rule or not rule.islower():  # ValueError, TypeError: a class name, not a rule
        return TetherError(message, REFUSED)
    why = message.removeprefix(f"{kind} refused [{rule}]: ")
    return TetherError(f"{kind} refused: {why} [rule: {rule}]", REFUSED, rule=rule)


async def _pending_task(handle: WorkflowHandle) -> Any:
    """The run's pending workflow task (STARTED: a worker is working on the run right now;
    attempt > 1: it keeps failing); None: none, or the run cannot be described."""
    try:
        description = await handle.describe()
    except RPCError:
        return None
    raw = description.raw_description
    return raw.pending_workflow_task if raw.HasField("pending_workflow_task") else None


def _task_failing_error(run_id: str) -> TetherError:
    return TetherError(
        f"run {run_id} takes no decision while its workflow task keeps failing: `tether status {run_id}` says why "
        f"(older_build: a worker of another build took it, run one of the run's own build; otherwise "
        f"`tether repair {run_id}`)", rule="task_failing",
    )


async def handoff(
    client: Client, run_id: str, *, by: str, reason: str, decision_id: str | None = None,
    key: Path | None = None, timeout: float = VERDICT_TIMEOUT, force: bool = False, workflows: Sequence[type] = (),
) -> Verdict:
    """Hand the run to a human; returns the run's record of it (HANDED_OFF), or raises REFUSED
    with the rule (not a member of the tenant, already ended, a handoff already pending).

    A run in the middle of a tool call hands off once the call has settled: ``record`` is None
    when that takes longer than ``timeout``.

    ``force``: a run whose workflow tasks keep failing never takes a signal. The hand-off is
    signalled to the execution judged, which is then reset (``reset_judged``: compare-and-set)
    to its newest completed task that replays with no tool call pending at it, the hand-off
    applied again: the new run takes it before it schedules anything. The tool calls the reset
    leaves out were in flight and may have applied: the hand-off names them
    (``HandoffRequest.in_flight``), the run never runs them again and records its step's outcome
    as unknown.
    """
    try:
        request = HandoffRequest(by=by, reason=reason, decision_id=decision_id or uuid.uuid4().hex)
    except ValidationError as e:
        raise invalid("handoff", e) from None
    handle = client.get_workflow_handle(run_id)
    try:
        description = await handle.describe()
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    if description.status != WorkflowExecutionStatus.RUNNING:
        raise TetherError(f"run {run_id} already finished", REFUSED)
    if not await has_worker(client, description.task_queue):
        raise TetherError(no_worker_message(description.task_queue))
    reset = None
    if force:
        reset = await _forced_reset(client, description, workflows)
        try:
            request = HandoffRequest.model_validate({**request.model_dump(), "in_flight": reset.in_flight})
        except ValidationError as e:
            raise invalid("handoff", e) from None
    elif (stuck := await stuck_task(client, description)) is not None:
        raise TetherError(
            f"run {run_id} is stuck (workflow task attempt {stuck.attempt} failing: {stuck.cause}): it takes no "
            f"signal, a hand-off included. Heal it (`tether repair {run_id}`) or end it on the record "
            f"(`tether handoff {run_id} --force --by NAME --reason TEXT`)", REFUSED
        )
    if key is not None:
        snap = await snapshot(client, run_id)
        payload = policy.signature_payload(
            workflow_id=run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, request_id="",
            plan_hash="", kind="handoff", decision_id=request.decision_id or "", signer=request.by,
        )
        request.signature = sign(key, payload)
    if reset is not None:
        why = f"tether handoff --force by {by}: {reason}"
        reset.to_run_id = await reset_judged(client, run_id, reset.from_run_id, reset.event_id, why, handoff=request)
    else:
        try:
            await handle.signal("handoff", request)
        except RPCError as e:
            raise rpc_error(e, run_id) from None
    record = await _await_record(client, run_id, request.decision_id or "", timeout)
    try:
        _refused(record)
    except TetherError as e:
        if reset is None:
            raise
        raise TetherError(
            f"{e}; run {reset.from_run_id} was reset all the same (new run {reset.to_run_id}), which does not run "
            f"again what was in flight: {', '.join(reset.in_flight) or 'nothing'} (may have applied)", REFUSED, rule=e.rule,
        ) from None
    return Verdict(run_id=run_id, decision_id=request.decision_id or "", record=record, reset=reset)


def person_name(by: str) -> str:
    """A person's name as the run takes it (normalised), or a usage error naming ``--by``."""
    from pydantic import TypeAdapter

    from workflows.identity import Name

    try:
        return TypeAdapter(Name).validate_python(by)
    except ValidationError as e:
        raise TetherError(f"invalid name: {first_error(e)}", field="by", detail=first_error(e)) from None


def tenant_refusal(tenant: str, policy_path: Path | None) -> TetherError | None:
    """A start for a tenant the policy file does not name, refused before anything is sent (a
    typo would otherwise start a run the worker fails at once). No policy file here: the
    worker's is the only word."""
    if policy_path is None:
        return None
    try:
        policy_tenant(tenant, policy_path)
    except TetherError as e:
        return e
    return None


def policy_tenant(tenant: str, policy_path: Path, code: int = USAGE) -> Any:
    """``tenant``'s policy in the file; a tenant it does not name raises with the nearest names
    it does ("did you mean"), with ``code``; a file that cannot be read, a usage error."""
    import difflib

    from activities.policy_file import PolicyFileError, PolicyStore

    store = PolicyStore(policy_path)
    try:
        tenant_policy, _ = store.tenant(tenant)
        document, _ = store.load()
    except (PolicyFileError, OSError, ValueError) as e:
        raise TetherError(f"cannot read the policy file {policy_path}: {e}") from None
    if tenant_policy is not None:
        return tenant_policy
    known = sorted(document.tenants) if document is not None else []
    near = difflib.get_close_matches(tenant, known, n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(repr(escape_text(n)) for n in near)}?" if near
            else f"its tenants: {', '.join(map(escape_text, known)) or 'none'}")
    raise TetherError(f"tenant {escape_text(tenant)!r} is not in the policy file {policy_path}: {hint}", code,
                      field="tenant", rule="tenant_unknown")


def policy_file() -> Path | None:
    """The policy file a client checks against: TETHER_POLICY, else the one the checkout's dev
    stack's worker applies (none: the worker's alone decides)."""
    path = os.environ.get("TETHER_POLICY") or checkout_stack().get("policy")
    return Path(path) if isinstance(path, str) and path else None


async def cancel(
    client: Client, run_id: str, *, reason: str, by: str, decision_id: str | None = None, key: Path | None = None,
    timeout: float = VERDICT_TIMEOUT,
) -> DecideResult:
    """Ask the run to stop, as ``by``: the run's policy decides (the ``cancel`` Update) and the
    answer is its record: CANCELLED (or COMPENSATING, with on_cancel=compensate) once any tool
    in flight has settled. Refused by the run: REFUSED with the rule (on its record too); no
    verdict within ``timeout``: PENDING. A Temporal cancel (the Web UI, ``temporal workflow
    cancel``) is an operator's, and is not sent from here."""
    try:
        request = CancelRequest(by=by, reason=reason, decision_id=decision_id or uuid.uuid4().hex)
    except ValidationError as e:
        raise invalid("cancel", e) from None
    handle = client.get_workflow_handle(run_id)
    try:
        description = await handle.describe(rpc_timeout=QUERY_TIMEOUT)
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    if description.status != WorkflowExecutionStatus.RUNNING:
        raise TetherError(f"run {run_id} already finished", REFUSED, rule="run_ended")
    if not await has_worker(client, description.task_queue):
        raise TetherError(no_worker_message(description.task_queue))
    if key is not None:
        snap = await snapshot(client, run_id)
        payload = policy.signature_payload(
            workflow_id=run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, request_id="",
            plan_hash="", kind="cancel", decision_id=request.decision_id, signer=request.by,
        )
        request.signature = sign(key, payload)
    update = None
    try:
        update = await handle.start_update(
            "cancel", request, wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=DecideResult,
            rpc_timeout=timedelta(seconds=timeout),
        )
        result = await asyncio.wait_for(update.result(rpc_timeout=timedelta(seconds=timeout)), timeout)
    except WorkflowUpdateFailedError as e:
        raise _refused_update(e) from None
    except (WorkflowUpdateRPCTimeoutOrCancelledError, asyncio.TimeoutError):
        if update is None:
            raise await no_answer(client, run_id, timeout) from None
        raise TetherError(
            f"cancel {request.decision_id} accepted, verdict pending: the run is judging it, or waits for a tool in "
            f"flight to settle (`tether status {run_id}` shows the verdict once it is there)", PENDING,
        ) from None
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    if result.outcome == "refused":
        raise TetherError(f"{result.reason} [rule: {result.rule}]", REFUSED, rule=result.rule)
    return result


def compensation_id(run_id: str) -> str:
    """The workflow id of a run's compensation runs: one at a time; a new one may follow one
    that ended however it ended (refused, failed, cancelled, terminated, handed off)."""
    return f"{run_id}-compensate"


def compensate_refusal(
    by: str, snap: RunSnapshot, standing: list[CompensationCall], policy_path: Path | None
) -> TetherError | None:
    """Why ``tether compensate`` of this ended run is refused, as far as a client can tell: the
    run did not end where its writes are left to a person (a COMPLETED run may be undone, as a
    request its undos' approval governs), nothing of it is left to undo (the undo ledger says every undo is done), or the policy file
    (when this client has it) does not let ``by`` compensate."""
    if snap.state not in policy.COMPENSABLE_STATES | {RunState.COMPLETED}:
        states = ", ".join(sorted(s.value for s in policy.COMPENSABLE_STATES | {RunState.COMPLETED}))
        return TetherError(f"run {snap.run_id} ended {snap.state.value}: its writes are kept; only runs ended {states} "
                           "are compensated [rule: not_compensable]", REFUSED, rule="not_compensable")
    if policy_path is not None:
        from activities.policy_file import PolicyFileError, PolicyStore

        try:
            tenant_policy, _ = PolicyStore(policy_path).tenant(snap.tenant)
        except (PolicyFileError, OSError, ValueError) as e:
            return TetherError(f"cannot read the policy file {policy_path}: {e}")
        refusal = policy.compensator_refusal(tenant_policy, by)
        if refusal is not None:
            return TetherError(f"{refusal.message} [rule: {refusal.rule}]", REFUSED, rule=refusal.rule)
    if not any(c.tool and c.status != "ok" for c in standing):
        done = [c for c in standing if c.status == "ok"]
        return TetherError(f"run {snap.run_id} has no write left to undo ({len(done)} undone) [rule: nothing_to_compensate]",
                           REFUSED, rule="nothing_to_compensate")
    return None


async def compensate(
    client: Client, run_id: str, *, by: str, key: Path | None = None, queue: str | None = None,
    rerun_unknown: Sequence[str] = (), policy_path: Path | None = None, timeout: float = VERDICT_TIMEOUT,
) -> WorkflowHandle:
    """Start the governed compensation run of an ended run: it undoes the ok writes the
    original's approvals covered (read from the original's record by the worker, not sent
    from here), as ``by`` — who must hold an approval role of the run's tenant. Nothing a
    compensation run does uses recovery up: another may follow it, and the worker's undo ledger
    starts each undo at most once whichever run asks. ``rerun_unknown``: the steps (tool call
    ids) whose unsafe undo may have applied that ``by`` instructs it to run again. Returns once
    the compensation run has judged the request (``compensation_judged``): refused, REFUSED."""
    snap = await snapshot(client, run_id)  # its tenant; the worker checks everything again
    if snap.state not in TERMINAL:
        raise TetherError(f"run {run_id} is {snap.state.value}: only an ended run is compensated", REFUSED)
    # Refused here, before anything starts, where this client can tell (a refused request leaves
    # no Failed execution behind); the compensation run's worker judges everything again.
    standing, unread = await ledger_standing(snap.compensations)
    if unread is not None:
        # What no run undid yet is what the ledger says: without it, nothing is started.
        raise TetherError(f"run {run_id} is not compensated now: {unread}; fix the workers' audit sink "
                          "(TETHER_AUDIT_DIR / TETHER_AUDIT_DSN) and try again", USAGE, rule="ledger_unavailable")
    refused = compensate_refusal(by, snap, standing, policy_path)
    if refused is not None:
        raise refused
    try:
        request = RunRequest(
            goal=f"compensate run {run_id}", tenant=snap.tenant, requested_by=by, compensate_run=run_id,
            rerun_unknown=list(rerun_unknown),
        )
    except ValidationError as e:
        raise invalid("compensation request", e) from None
    new_id = compensation_id(run_id)
    if key is not None:
        request = sign_request(request, new_id, key)
    try:
        handle = await start_run(client, request, run_id=new_id, queue=queue, allow_id_reuse=True)
    except TetherError as e:
        if e.rule == "already_started":
            raise TetherError(f"run {run_id} is being compensated now by {new_id}: see `tether status {new_id}`", REFUSED) from None
        raise
    await compensation_judged(client, new_id, timeout)
    return handle


async def compensation_judged(client: Client, run_id: str, timeout: float) -> RunSnapshot:
    """The compensation run's first judgement (its requester may ask it: the current file, Cedar's
    ``compensate``; then what the original left to undo): it has left RECEIVED. Refused (it
    ended FAILED on its record): REFUSED with the rule; no judgement within ``timeout``:
    PENDING."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    await require_worker(client, run_id)
    while True:
        try:
            snap = await snapshot(client, run_id, timeout=max(deadline - loop.time(), 1.0))
        except TetherError as e:
            if e.rule != "no_worker" or loop.time() >= deadline:
                raise
            continue
        if snap.state != RunState.RECEIVED:
            break
        if loop.time() >= deadline:
            raise TetherError(f"compensation {run_id} started, verdict pending: the run has not judged it yet "
                              f"(`tether status {run_id}` shows it)", PENDING)
        await asyncio.sleep(0.2)
    if snap.state == RunState.FAILED:
        final = (await timeline(client, run_id))[-1]
        raise TetherError(f"{final.reason} [rule: {final.refs.error_code}]", REFUSED, rule=final.refs.error_code)
    return snap


def list_query(state: str | None, tenant: str | None) -> str:
    """The visibility query for runs; inputs are checked first (they are quoted into it)."""
    state = state.upper() if state else state  # `--state awaiting_approval` means the same
    if state and state not in RunState.__members__:
        raise TetherError(f"unknown state {state!r}; one of {', '.join(RunState.__members__)}", field="state")
    if tenant and not re.match(NAME_PATTERN, tenant):
        raise TetherError(f"invalid tenant {tenant!r}", field="tenant")
    clauses = ["WorkflowType = 'AgentRun'"]
    if state:
        clauses.append(f"{STATE_ATTRIBUTE.name} = '{state}'")
    if tenant:
        clauses.append(f"{TENANT_ATTRIBUTE.name} = '{tenant}'")
    return " AND ".join(clauses)


def build_order(build: str) -> int:
    """Where a build marker (``tether-build-N``) stands among builds: N; -1 for anything else
    (a run from before builds had a number)."""
    m = re.fullmatch(r"tether-build-(\d+)", build)
    return int(m.group(1)) if m else -1


def run_build(markers: Sequence[str] | None) -> str | None:
    """The build that started a run, from its TemporalChangeVersion markers (None: none)."""
    builds = [m for m in markers or [] if build_order(m) >= 0]
    return max(builds, key=build_order) if builds else None


async def drain(client: Client, *, limit: int = 1000) -> list[RunSummary]:
    """The open runs started by a build older than this one (by build order: their first task
    wrote an earlier build's marker, or none). Their build's workers must serve them until this
    list is empty (docs/changing-workflows.md); a newer build's runs are never listed."""
    rows = []
    ours = build_order(BUILD)
    try:
        async for wf in client.list_workflows("WorkflowType = 'AgentRun' AND ExecutionStatus = 'Running'", limit=limit):
            attrs = wf.typed_search_attributes
            started_by = run_build(attrs.get(CHANGE_VERSION_ATTRIBUTE))
            if started_by is not None and build_order(started_by) >= ours:
                continue
            rows.append(RunSummary(
                run_id=wf.id, state=attrs.get(STATE_ATTRIBUTE), tenant=attrs.get(TENANT_ATTRIBUTE),
                status=wf.status.name if wf.status else None, started=wf.start_time,
            ))
    except RPCError as e:
        raise TetherError(f"listing failed: {e.message}") from None
    return rows


# ----------------------------------------------------------------------------- worker deployments

class DeployedVersion(BaseModel):
    """One build of a Worker Deployment: its routing, its open runs, whether it can be retired."""

    build: str
    status: str  # current, ramping, draining, drained, inactive, created
    ramp_percent: float | None = None
    open_runs: int = 0  # open runs pinned to it (its workers must serve them until they end)
    routed: bool = False  # current or ramping: new runs start on it
    retirable: bool = False  # not routed, and no open run: its workers can stop


class DeploymentStatus(BaseModel):
    deployment: str
    current: str | None = None  # the build new runs start on (None: unversioned workers)
    ramping: str | None = None
    ramp_percent: float | None = None
    versions: list[DeployedVersion] = []
    unversioned_runs: int = 0  # open runs on unversioned workers (from before versioning)


def _deployment_error(err: RPCError, deployment: str) -> TetherError:
    if err.status == RPCStatusCode.NOT_FOUND:
        return TetherError(
            f"Temporal knows no Worker Deployment {escape_text(deployment)!r}: its workers register it with their first "
            f"poll (start them with {DEPLOYMENT_ENV}={escape_text(deployment)})"
        )
    return rpc_error(err, deployment)


def _routed_build(version: Any, legacy: str) -> str | None:
    """The build a routing field names (None: unversioned workers, or nothing)."""
    if version is not None and version.build_id:
        return version.build_id
    if legacy and legacy != "__unversioned__":
        return legacy.split(".", 1)[-1]
    return None


async def _count_open(client: Client, clause: str) -> int:
    query = f"WorkflowType = 'AgentRun' AND ExecutionStatus = 'Running' AND {clause}"
    try:
        return (await client.count_workflows(query, rpc_timeout=QUERY_TIMEOUT)).count
    except RPCError as e:
        raise TetherError(f"counting runs failed: {e.message}") from None


async def deployment_status(client: Client, deployment: str) -> DeploymentStatus:
    """The deployment's versions with their open runs: which can be retired (no open run pinned
    to it, neither current nor ramping), which must keep their workers. Routing new runs is
    Temporal's own CLI (`temporal worker deployment set-current-version`, `set-ramping-version`)."""
    from temporalio.api.enums.v1 import WorkerDeploymentVersionStatus
    from temporalio.api.workflowservice.v1 import DescribeWorkerDeploymentRequest

    try:
        info = (await client.workflow_service.describe_worker_deployment(
            DescribeWorkerDeploymentRequest(namespace=client.namespace, deployment_name=deployment), timeout=QUERY_TIMEOUT,
        )).worker_deployment_info
    except RPCError as e:
        raise _deployment_error(e, deployment) from None
    routing = info.routing_config
    result = DeploymentStatus(
        deployment=deployment,
        current=_routed_build(routing.current_deployment_version if routing.HasField("current_deployment_version") else None,
                              routing.current_version),
        ramping=_routed_build(routing.ramping_deployment_version if routing.HasField("ramping_deployment_version") else None,
                              routing.ramping_version),
    )
    if result.ramping:
        result.ramp_percent = routing.ramping_version_percentage
    for summary in info.version_summaries:
        build = summary.deployment_version.build_id or summary.version.split(".", 1)[-1]
        status = WorkerDeploymentVersionStatus.Name(summary.status).removeprefix("WORKER_DEPLOYMENT_VERSION_STATUS_").lower()
        open_runs = await _count_open(client, f"TemporalWorkerDeploymentVersion = '{deployment}:{build}'")
        result.versions.append(DeployedVersion(
            build=build, status=status, open_runs=open_runs,
            ramp_percent=result.ramp_percent if build == result.ramping else None,
            routed=build in (result.current, result.ramping),
            retirable=build not in (result.current, result.ramping) and open_runs == 0,
        ))
    result.versions.sort(key=lambda v: (build_order(v.build), v.build))
    result.unversioned_runs = await _count_open(client, "TemporalWorkerDeploymentVersion IS NULL")
    return result


async def list_runs(
    client: Client, *, state: str | None = None, tenant: str | None = None, limit: int = 50, stuck: bool = False
) -> list[RunSummary]:
    """Runs from visibility (search attributes and the memo the runs publish; no worker needed).
    ``stuck``: only running runs whose workflow task keeps failing, each with its error (one
    describe per running run)."""
    if limit < 1:
        raise TetherError(f"limit must be at least 1, not {limit}", field="limit")
    query = list_query(state, tenant) + (" AND ExecutionStatus = 'Running'" if stuck else "")
    rows = []
    try:
        async for wf in client.list_workflows(query, limit=limit):
            attrs = wf.typed_search_attributes
            unverified = None
            try:
                view = await published_view(wf)
            except ViewUnverified as e:
                view, unverified = None, str(e)  # listed all the same, its view never shown
            except TetherError:
                view = None  # listed all the same; `tether status` says why it cannot be read
            rows.append(
                RunSummary(
                    run_id=wf.id,
                    state=attrs.get(STATE_ATTRIBUTE),
                    tenant=attrs.get(TENANT_ATTRIBUTE),
                    status=wf.status.name if wf.status else None,
                    started=wf.start_time,
                    closed_by_temporal=closed_note(attrs.get(STATE_ATTRIBUTE), wf.status.name if wf.status else None),
                    published_at=view.published_at if view else None,
                    view=view,
                    view_unverified=unverified,
                )
            )
    except RPCError as e:
        raise TetherError(f"listing failed: {e.message}") from None
    if not stuck:
        return rows
    gate = asyncio.Semaphore(DESCRIBE_CONCURRENCY)

    async def check(row: RunSummary) -> None:
        async with gate:
            try:
                row.stuck = await stuck_task(client, await _describe(client, row.run_id))
            except TetherError:
                row.stuck = None  # it ended (or went) since it was listed

    await asyncio.gather(*(check(r) for r in rows))
    return [r for r in rows if r.stuck is not None]


# ----------------------------------------------------------------------------- what a person is shown

@dataclass(frozen=True)
class ArgView:
    name: str
    value: Any  # as the plan holds it (the page escapes it; the terminal uses ``shown``)
    money: str | None  # ``600.00 EUR`` when the tool's schema declares the argument as money


@dataclass(frozen=True)
class StepView:
    """One step of a plan as an approver is shown it: every argument, in full."""

    n: int
    tool: str
    effect: str  # effect_words
    writes: bool
    args: list[ArgView]
    summary: list[ArgView]  # the tool's declared summary fields


def step_views(plan: Plan | None, tools: Sequence[Any]) -> list[StepView]:
    """The plan's steps with their effects in words and money in amount and currency."""
    from workflows.contract import ToolEffect

    if plan is None:
        return []
    by_name = {t.name: t for t in tools}
    views = []
    for n, step in enumerate(plan.steps, start=1):
        info = by_name.get(step.tool)
        properties = (info.args_schema.get("properties") or {}) if info else {}
        args = [ArgView(k, v, money(v, properties.get(k), step.args)) for k, v in step.args.items()]
        fields = set(info.summary_fields if info else [])
        undo = plan.undo[n - 1] if plan.undo is not None and n <= len(plan.undo) else False
        views.append(StepView(
            n=n, tool=step.tool, effect=effect_words(info, undo),
            writes=info is None or info.effect != ToolEffect.READ_ONLY,
            args=args, summary=[a for a in args if a.name in fields],
        ))
    return views


def shown_arg(arg: ArgView, limit: int | None = None) -> str:
    """``name: value`` for a terminal, money as ``600.00 EUR (60000)``; escaped."""
    value = show_value(arg.value, limit)
    return f"{escape_text(arg.name, 80)}: " + (f"{arg.money} ({value})" if arg.money else value)


def plan_summary(plan: Plan | None, tools: Sequence[Any], limit: int = 600) -> str:
    """One line for a list of runs: each write, its summary fields and its effect (escaped)."""
    views = step_views(plan, tools)
    writes = [v for v in views if v.writes]
    if not views:
        return "no plan"
    if not writes:
        return f"{len(views)} step(s), all read-only"
    parts = []
    for v in writes:
        fields = ", ".join(shown_arg(a, 120) for a in v.summary)
        parts.append(f"{escape_text(v.tool, 64)}" + (f" ({fields})" if fields else "") + f": {v.effect}")
    text = f"{len(writes)} of {len(views)} step(s) write: " + "; ".join(parts)  # escaped part by part
    return text if len(text) <= limit else text[: limit - 1] + "…"


def approval_offer_problem(snap: RunSnapshot) -> str | None:
    """Why a page or CLI must offer no Approve on this snapshot (None: the steps it shows hash
    to the plan hash the pending approval binds). A view that lies about the arguments then
    offers nothing; one that shows the real ones binds the real hash."""
    pending = snap.pending_approval
    if pending is None:
        return "no approval is pending"
    if snap.plan is None or snap.plan.plan_hash != pending.plan_hash or not snap.plan.hashes_to_itself():
        return ("the steps shown do not hash to the plan hash the approval binds: what is shown is not "
                "the run's plan (check `tether status RUN --live`)")
    return None


def plan_to_run(verdict: Verdict, steps: Sequence[int] | None = None) -> Plan | None:
    """The plan an approval lets run, read from the run's record of it (no call): the plan
    decided, or for a partial approval (``steps``) its kept steps, the plan's next version, when
    they hash to the plan hash the record names. None: the record does not tell (it names no
    plan, or the kept steps do not hash to it): ask the run (``snapshot``)."""
    record, plan = verdict.record, verdict.plan
    if record is None or plan is None or not record.refs.plan_hash:
        return None
    if record.refs.plan_hash == plan.plan_hash:
        return plan
    kept = sorted(set(steps or ()))
    if not kept or kept[-1] > len(plan.steps) or kept[0] < 1:
        return None
    narrowed = plan.model_copy(update={
        "steps": [plan.steps[n - 1] for n in kept],
        "undo": None if plan.undo is None else [plan.undo[n - 1] for n in kept],
        "plan_hash": record.refs.plan_hash,
        "version": plan.version + 1,  # a partial approval revises the plan: its next version
    })
    return narrowed if narrowed.hashes_to_itself() else None


def approvals_needed(pending: PendingApproval) -> str:
    """How many approvals are still needed and from whom (the roles), for a person."""
    done = [a.approver for a in pending.approvals]
    left = max(pending.approvals_required - len(done), 0)
    got = f"{len(done)} of {pending.approvals_required} approval(s)" + (
        f" (by {', '.join(escape_text(a, 64) for a in done)})" if done else "")
    if not left:
        return got
    who = ("someone with role " + " or ".join(escape_text(r, 64) for r in pending.roles)) if pending.roles else "an approver of the tenant"
    others = f", other than {', '.join(escape_text(a, 64) for a in done)}" if done else ""
    return f"{got}; {left} more needed from {who}{others}"
