"""Whether a live worker serves a task queue (judged without waiting on one), and what a person
is told when none does, or none takes the run's task: which queue, and how to start a worker.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone
from typing import Any

from temporalio.client import Client
from temporalio.api.enums.v1 import PendingWorkflowTaskState, TaskQueueKind, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.service import RPCError, RPCStatusCode

from workflows.display import escape_text
from tether.connection import DEFAULT_TASK_QUEUE, MCP_TASK_QUEUE, TetherError, rpc_error, task_queue, timed_out


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


async def require_worker(client: Client, run_id: str, description: Any = None) -> None:
    """Raise, naming the run's task queue, when no worker serves it: the run cannot answer a
    query or act on a decision until one does. A run that has closed needs one for queries too.
    ``description``: the run as the caller just described it (not described again)."""
    if description is None:
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
