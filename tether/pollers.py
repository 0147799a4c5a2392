"""Which live workers poll a task queue, judged without waiting on one: Temporal's pollers
(DescribeTaskQueue), less those whose workers said they stopped (ListWorkers). The client asks
it before it waits on a worker (tether/client/workers.py); a worker asks it at start, to see who
else serves its queue (worker.py). And which tools those workers serve, as each one's identity
lists them (`tether status` and the inbox warn of a run whose tools none serves).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone

from temporalio.api.enums.v1 import TaskQueueKind, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from tether.connection import rpc_error, timed_out


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


async def live_pollers(client: Client, queue: str) -> list[str] | None:
    """The identities of the live workers polling ``queue`` (workflow tasks), judged without
    waiting on one. None: this server does not let us tell (DescribeTaskQueue refused).

    Temporal lists a poller for minutes after its worker died, so a listed poller is not
    enough: one counts only if it polled within POLLER_FRESH and its worker has not reported
    itself stopped (or silent) in its heartbeats (ListWorkers), or it polled after that report:
    a worker restarted in place (the same identity, as a container's PID 1 on the same host)
    serves from its first poll, before its first heartbeat.
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
        return []
    gone = await _gone_workers(client, queue, now) or {}

    def alive(identity: str, polled: datetime) -> bool:
        if identity not in gone:
            return True
        stopped = gone[identity]
        return stopped is not None and polled > stopped  # polled after it said it stopped: restarted

    return sorted(identity for identity, polled in fresh.items() if alive(identity, polled))


# A worker's identity names the tools it serves: `` tools=a,b,c`` (before its ledger mark,
# LEDGER_MARK), or `` tools=*`` when the list is longer than TOOLS_MARK_CHARS or a name
# cannot be listed so. Kept short: every task-started event of a run's history carries its
# worker's identity (history bytes bring continue-as-new nearer), and Temporal refuses identities
# over limit.maxIDLength (1000 by default). Only the worker writes it; a poller that does not say (an older
# build, another SDK, a long list) is taken to serve anything: no warning is made up.
TOOLS_MARK = " tools="
# A worker's identity ends with the effect ledger it keeps: `` ledger=ID`` (a local one's id,
# tether/store/effect_ledger.local_ledger_id) or `` ledger=shared`` (the fleet's PostgreSQL).
LEDGER_MARK = " ledger="
UNLISTED = "*"
TOOLS_MARK_CHARS = 200


def tools_mark(names: Iterable[str]) -> str:
    """The identity's mark for a worker serving the tools ``names``."""
    listed = sorted(names)
    text = ",".join(listed)
    if len(text) > TOOLS_MARK_CHARS or any(not n or any(c in n for c in ", *") for n in listed):
        text = UNLISTED
    return f"{TOOLS_MARK}{text}"


def identity_tools(identity: str) -> frozenset[str] | None:
    """The tools a worker's identity says it serves (None: it does not say, or `*`)."""
    _, mark, rest = identity.rpartition(TOOLS_MARK)
    if not mark:
        return None
    listed = rest.split(" ", 1)[0]
    if listed == UNLISTED:
        return None
    return frozenset(n for n in listed.split(",") if n)


async def served_tools(client: Client, queue: str) -> frozenset[str] | None:
    """The tools the live workers polling ``queue`` serve, together (:func:`live_pollers`, each
    by its identity's mark). None: cannot tell (the server does not say who polls, or a live
    worker does not list its tools). Empty: no live worker."""
    return served_by(await live_pollers(client, queue))


def served_by(pollers: list[str] | None) -> frozenset[str] | None:
    """``served_tools`` of the live pollers' identities (:func:`live_pollers`) already read."""
    if pollers is None:
        return None
    served: set[str] = set()
    for identity in pollers:
        tools = identity_tools(identity)
        if tools is None:
            return None
        served |= tools
    return frozenset(served)
