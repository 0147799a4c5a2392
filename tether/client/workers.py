"""Whether a live worker serves a task queue (judged without waiting on one), and what a person
is told when none does, or none takes the run's task: which queue, and how to start a worker.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from temporalio.client import Client
from temporalio.api.enums.v1 import PendingWorkflowTaskState
from temporalio.service import RPCError

from workflows.display import escape_text
from tether.connection import DEFAULT_TASK_QUEUE, MCP_TASK_QUEUE, NoWorker, TetherError, rpc_error, task_queue
# Which workers poll a queue and are alive: tether/pollers.py (a worker asks it too, at start).
from tether.pollers import HEARTBEAT_FRESH, POLLER_FRESH, PROBE_TIMEOUT, _gone_workers, _probe_unsupported, live_pollers  # noqa: F401


def start_worker_hint(queue: str) -> str:
    import shlex

    from tether.connection import checkout_stack

    stack = checkout_stack()
    settings = stack.get("worker_env")
    if stack.get("task_queue") == queue and isinstance(settings, dict) and settings:
        # This checkout's dev stack, whose worker was started with tools (a policy, planners) of
        # its own: the same again, not the demo's.
        words = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(settings.items()))
        return f"`{words} .venv/bin/python -m examples.devstack up worker` (this stack's worker, with its tools)"
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


def unserved_message(queue: str, tools: list[str]) -> str:
    """What a person is told of a run whose tools no live worker on its queue serves."""
    names = ", ".join(escape_text(t, 80) for t in tools[:20]) + (f" and {len(tools) - 20} more" if len(tools) > 20 else "")
    return (
        f"waits for tool{'s' if len(tools) > 1 else ''} {names}: no live worker on task queue '{escape_text(queue)}' "
        f"serves {'them' if len(tools) > 1 else 'it'} — an approval is kept and its writes wait (nothing is called) "
        f"until one does; start a worker with {'these tools' if len(tools) > 1 else 'this tool'} "
        f"(the module that defines it: docs/writing-tools.md), e.g. {start_worker_hint(queue)}"
    )


async def worker_serving(client: Client, queue: str) -> bool | None:
    """Whether a live worker serves ``queue`` (:func:`live_pollers`). False: none does; None:
    this server does not let us tell. Callers that act on a run still find out for sure when a
    worker takes (or never takes) the run's task."""
    pollers = await live_pollers(client, queue)
    return None if pollers is None else bool(pollers)


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
        raise NoWorker(no_worker_message(description.task_queue))
    waiting = untaken_seconds(description)
    if waiting is not None and waiting > TAKE_SECONDS:
        raise NoWorker(untaken_message(run_id, description.task_queue, waiting))


def untaken_seconds(description: Any) -> float | None:
    """How long the run's workflow task has waited for a worker to take it (None: no task is
    waiting; a worker has it or the run has nothing to do)."""

    task = description.raw_description.pending_workflow_task
    if task.state != PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_SCHEDULED or not task.HasField("scheduled_time"):
        return None
    if task.attempt > 1:
        return None  # a task that failed is retried with a backoff: a worker did take it
    scheduled: datetime = task.scheduled_time.ToDatetime(timezone.utc)
    return (datetime.now(timezone.utc) - scheduled).total_seconds()


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
        return NoWorker(untaken_message(run_id, queue, untaken))
    return NoWorker(
        f"no worker answered for run {run_id} within {waited:g}s on task queue '{escape_text(queue)}' — "
        f"start one with {start_worker_hint(queue)} (if one runs, see its log: it may be overloaded)",
    )
