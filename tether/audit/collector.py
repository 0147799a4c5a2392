"""The audit collector: the records a run left with its end view, into the audit sink once the
run has closed, and a sweep of the queue's closed runs that a stopped worker left unwritten.
Each failure is logged and counted (``tether_audit_sink_failures``), each record refused too
(``tether_audit_records_refused``), each run a sweep wrote (``tether_audit_swept_runs``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.runtime import Runtime
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import (
    Interceptor,
    Plugin,
    Replayer,
    ReplayerConfig,
    Worker,
    WorkerConfig,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

from tether.audit.sink import SINK_FAILURES, AuditSink
from tether.audit.verify import RECORDS_REFUSED, batch_problem, view_problem
from workflows.published import COLLECT_EXTERN, VIEW_MEMO
from workflows.run_state import RunView
from workflows.wire import AuditBatch
from workflows.states import with_links

log = logging.getLogger("tether.audit")

COLLECT_LOOKBACK = timedelta(hours=24)
COLLECT_FIRST = 0.2  # seconds from a run naming itself to the first look (runs that end together)
COLLECT_GIVE_UP = timedelta(minutes=5)  # a run named that long ago and still open is let go
COLLECT_SKEW = timedelta(seconds=10)  # the server's clock against this worker's, at most
COLLECT_DRAIN = timedelta(seconds=10)  # at shutdown, at most this long for the collections left
COLLECT_SEEN = 10_000  # runs remembered as collected (a replay names a run again)
COLLECT_BACKOFF_MAX = 30.0  # seconds between a failing sink's retries, at most
COLLECT_EVERY = timedelta(seconds=30)  # between two sweeps of the queue's closed runs (TETHER_AUDIT_SWEEP_SECONDS)
COLLECT_OVERLAP = timedelta(minutes=5)  # a sweep looks back this far before the previous one began
SWEPT = "tether_audit_swept_runs"


class AuditCollector(Interceptor, Plugin):
    """Writes the records a run left with its end view to the audit sink, once it has closed.

    A run that ends does not wait for the sink: its last records go with the view it publishes
    (memo ``tether``, in the same workflow task as its end), and it names itself to this
    collector (an extern function of the worker, like the key ring: worker configuration, no I/O
    in workflow code). The collector waits until the run has closed, reads the view and appends
    its records: idempotent per (workflow id, run id, seq), like every append. A worker that
    stops first (killed, say) is caught up by any other collector of the task queue: each one
    sweeps the runs of its queue that closed, at start those of the last COLLECT_LOOKBACK, then
    every ``every`` those closed since shortly before its previous sweep (where the server lists
    runs; the time-skipping test server does not).
    """

    def __init__(
        self, client: Client, sink: AuditSink, *, lookback: timedelta = COLLECT_LOOKBACK, every: timedelta | None = None,
        publics: Any = None,
    ) -> None:
        self.client = client
        self.sink = sink
        self.publics = publics  # a view and its records are written only when the fleet signed them
        self.lookback = lookback
        if every is None:
            every = timedelta(seconds=float(os.environ.get("TETHER_AUDIT_SWEEP_SECONDS") or COLLECT_EVERY.total_seconds()))
        if every <= timedelta(0):
            raise ValueError(f"the collector's sweep interval must be positive, not {every}")
        self.every = every
        self.task_queue = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[tuple[str, str], datetime] = {}  # named, not yet seen closed
        self._wake = asyncio.Event()
        self._writing: set[asyncio.Task[bool]] = set()
        self._seen: dict[tuple[str, str], None] = {}
        self._can_list = True

    # --- as the worker's interceptor (the extern function) and plugin (its lifetime)

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor] | None:
        input.unsafe_extern_functions[COLLECT_EXTERN] = self.named
        return None

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        self.task_queue = config["task_queue"]
        config["interceptors"] = [*config.get("interceptors", ()), self]
        return config

    async def run_worker(self, worker: Worker, next: Callable[[Worker], Awaitable[None]]) -> None:
        self._loop = asyncio.get_running_loop()
        sweep, collect = asyncio.create_task(self.sweep()), asyncio.create_task(self.collect())
        try:
            await next(worker)
        finally:
            self._loop = None
            sweep.cancel()
            await self.drain()
            collect.cancel()

    def configure_replayer(self, config: ReplayerConfig) -> ReplayerConfig:
        return config

    def run_replayer(self, replayer: Replayer, histories: Any, next: Any) -> Any:
        return next(replayer, histories)

    # --- the collection

    def named(self, workflow_id: str, run_id: str) -> None:
        """A run ended (called from the workflow's thread, on every execution of its end). Never
        raises: the run's last task must not fail for its records' sake."""
        try:
            loop = self._loop
            if loop is not None and (workflow_id, run_id) not in self._seen:
                loop.call_soon_threadsafe(self._named, workflow_id, run_id)
        except Exception as e:  # a loop closing as the worker stops: the next worker's sweep catches up
            log.info("audit collector: run %s/%s not taken (%s)", workflow_id[:200], run_id, e)

    def _named(self, workflow_id: str, run_id: str) -> None:
        if (workflow_id, run_id) not in self._seen:
            self._waiting.setdefault((workflow_id, run_id), datetime.now(timezone.utc))
            self._wake.set()

    def _remember(self, workflow_id: str, run_id: str) -> None:
        self._seen[(workflow_id, run_id)] = None
        while len(self._seen) > COLLECT_SEEN:
            del self._seen[next(iter(self._seen))]

    async def collect(self) -> None:
        """Until the worker stops: the runs named wait for the server to have closed them, then
        their views are read, many with one listing (a describe each where the server cannot
        list), and their records written."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            delay = COLLECT_FIRST
            while self._waiting:
                # Named as its last workflow task runs: the server has its end a moment later,
                # and runs that end together are read together.
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                try:
                    closed = await (self._listed() if self._can_list else self._described())
                except RPCError as e:
                    if e.status == RPCStatusCode.UNIMPLEMENTED and self._can_list:
                        self._can_list = False  # the time-skipping test server
                        continue
                    log.warning("audit collector could not read the runs that ended: %s", e)
                    continue
                except Exception as e:  # never the end of collecting: the next look tries again
                    log.warning("audit collector could not read the runs that ended: %s", e)
                    continue
                for key, view in closed:
                    self._waiting.pop(key, None)
                    self._remember(*key)
                    self._write_soon(*key, view)
                # A run still open long after it named itself: its end's task failed (a signal
                # came in with it); when it ends again it names itself again.
                stale = datetime.now(timezone.utc) - COLLECT_GIVE_UP
                for key in [k for k, at in self._waiting.items() if at < stale]:
                    del self._waiting[key]

    async def _listed(self) -> list[tuple[tuple[str, str], Any]]:
        # Closed since shortly before the earliest run waiting (the server's clock may differ).
        since = (min(self._waiting.values()) - COLLECT_SKEW).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        query = (f"WorkflowType = 'AgentRun' AND TaskQueue = '{_quoted(self.task_queue)}' "
                 f"AND ExecutionStatus != 'Running' AND CloseTime >= '{since}'")
        found = []
        async for execution in self.client.list_workflows(query):
            key = (execution.id, execution.run_id)
            if key in self._waiting:
                found.append((key, await _end_view(execution, key)))
        return found

    async def _described(self) -> list[tuple[tuple[str, str], Any]]:
        found = []
        for key in list(self._waiting):
            description = await self.client.get_workflow_handle(key[0], run_id=key[1]).describe()
            if description.status != WorkflowExecutionStatus.RUNNING:
                found.append((key, await _end_view(description, key)))
        return found

    def _write_soon(self, workflow_id: str, run_id: str, view: Any) -> None:
        task = asyncio.create_task(self.write(workflow_id, run_id, view))
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)

    async def write(self, workflow_id: str, run_id: str, view: RunView | None) -> bool:
        """The records ``view`` (a run's end view) says are not in the sink yet, until written:
        a sink that fails is retried on a backoff while this worker runs (logged, counted).
        False when the view left none to write."""
        if view is None:
            return False
        snap = view.snapshot
        # What the run had not written itself: its last ``audit_waiting`` records, their links
        # (left out after the first) filled in again.
        records = with_links([r.model_copy() for r in view.timeline if r.seq > snap.timeline_records - snap.audit_waiting])
        if not records:
            return False
        why = (
            "this worker has no public keys to verify views with" if self.publics is None
            else view_problem(self.publics, workflow_id, run_id, view)
            or batch_problem(self.publics, workflow_id, run_id, records)
        )
        if why is not None:
            log.error("audit collector refused the end view of run %s/%s: %s", workflow_id[:200], run_id, why)
            self._meter().create_counter(
                RECORDS_REFUSED, "Audit records refused: not signed by the fleet for the run that asked", "1"
            ).add(len(records))
            return False
        batch = AuditBatch(
            workflow_id=workflow_id, first_run_id=snap.first_run_id or run_id, run_id=run_id,
            continued_from=view.continued_from, records=records,
        )
        delay = 1.0
        while True:
            try:
                await self.sink.append(batch)
                return True
            except Exception as e:
                log.warning(
                    "audit sink failing (%s) for workflow %s run %s, records %s-%s left at its end: %s; "
                    "the collector tries again in %gs",
                    self.sink.describe(), workflow_id[:200], run_id, records[0].seq, records[-1].seq,
                    " ".join(f"{type(e).__name__}: {e}".split())[:300], delay,
                )
                self._meter().create_counter(
                    SINK_FAILURES, "Audit sink writes that failed (the run retries them)", "1"
                ).add(1, {"sink": type(self.sink).__name__})
                await asyncio.sleep(delay)
                delay = min(delay * 2, COLLECT_BACKOFF_MAX)

    def _meter(self) -> Any:
        # The worker's runtime (its Prometheus endpoint, when it has one), as activities' metrics.
        return (self.client.service_client.config.runtime or Runtime.default()).metric_meter

    async def sweep(self) -> None:
        """Until the worker stops: the runs of this queue that closed and that no collector has
        written yet (their worker stopped or was killed first), at start over COLLECT_LOOKBACK,
        then every ``every`` since COLLECT_OVERLAP before the previous sweep began. Idempotent:
        another collector writing the same run writes nothing twice."""
        since = datetime.now(timezone.utc) - self.lookback
        while True:
            began = datetime.now(timezone.utc)
            try:
                await self.sweep_once(since)
                since = began - COLLECT_OVERLAP
            except asyncio.CancelledError:
                raise
            except RPCError as e:
                if e.status == RPCStatusCode.UNIMPLEMENTED:  # the time-skipping test server: no listing
                    log.info("audit collector: the server lists no runs, no sweep of closed runs")
                    return
                log.warning("audit collector: the sweep of closed runs failed, next in %s: %s", self.every, e)
            except Exception as e:  # a sink down: the next sweep tries again
                log.warning("audit collector: the sweep of closed runs failed, next in %s: %s", self.every,
                            " ".join(f"{type(e).__name__}: {e}".split())[:300])
            await asyncio.sleep(self.every.total_seconds())

    async def sweep_once(self, since: datetime) -> int:
        """One sweep of the runs of this queue closed since ``since`` (the server lists the
        newest first) that this collector has not written: returns how many it wrote the end
        records of (appends are idempotent, so a run another worker collected is unchanged).
        Logged and counted (``tether_audit_swept_runs``)."""
        query = (f"WorkflowType = 'AgentRun' AND TaskQueue = '{_quoted(self.task_queue)}' "
                 f"AND ExecutionStatus != 'Running' AND CloseTime > '{since.strftime('%Y-%m-%dT%H:%M:%SZ')}'")
        wrote = 0
        async for execution in self.client.list_workflows(query):
            key = (execution.id, execution.run_id)
            if key in self._seen or key in self._waiting:  # collected, or being collected here
                continue
            if await self.write(*key, await _end_view(execution, key)):
                wrote += 1
            self._remember(*key)
        if wrote:
            log.info("audit collector: the sweep of queue %s wrote the end records of %d closed run(s)",
                     self.task_queue[:200], wrote)
            self._meter().create_counter(
                SWEPT, "Closed runs whose end records a collector's sweep wrote (idempotently)", "1"
            ).add(wrote)
        return wrote

    async def drain(self) -> None:
        """At shutdown: the runs named and the writes begun, for at most COLLECT_DRAIN (what is
        left, the next worker's sweep catches up)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + COLLECT_DRAIN.total_seconds()
        while (self._waiting or self._writing) and loop.time() < deadline:
            await asyncio.sleep(0.05)


async def _end_view(execution: Any, key: tuple[str, str]) -> RunView | None:
    """A closed run's view (memo ``tether``, published packed), or None when it has none or one
    this worker cannot read (another build's, a forgery, another encryption key): logged, and
    never the end of the collection."""
    try:
        raw = await execution.memo_value(VIEW_MEMO, None)
        return None if raw is None else RunView.model_validate(raw)
    except Exception as e:
        log.warning("audit collector: run %s/%s left a view it cannot read (%s): its last records "
                    "are not written", key[0][:200], key[1], " ".join(str(e).split())[:300])
        return None


def _quoted(text: str) -> str:
    """A value inside a single-quoted visibility query string."""
    return text.replace("\\", "\\\\").replace("'", "\\'")
