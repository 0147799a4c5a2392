"""The audit sink: every timeline record, in order, behind an activity.

**Audit sink.** The workflow keeps a bounded window of its timeline (workflows/budgets.py); every
record also comes here, in order, through the activity ``audit_append``. Records are keyed by
workflow id, **run id** and ``seq``: each execution of a workflow id is its own stream, so a
reset (a new run whose history copies the old one up to the reset point, and which writes its
own records from there) never overwrites or hides what the original run wrote. Appends are
idempotent per stream: a retried or repeated batch never writes a record twice.

Two sinks, one contract:

- JSON lines (the embedded default), under ``TETHER_AUDIT_DIR`` (default ``.tether/audit``): one
  folder per workflow id, named by a readable prefix and a hash (``refund-A-1001-3f2c…``: bounded
  whatever the id's length or script), one file per run id. A line torn by a worker killed
  mid-write is cut off and written again by the retry.
- PostgreSQL (``TETHER_AUDIT_DSN=postgresql://…``, kept by activities/postgres.py), for fleets
  whose workers run on several machines: one append-only table (``tether_audit``; a trigger
  refuses UPDATE and DELETE) with a unique key on (workflow_id, run_id, seq); a batch is one
  transaction, ``ON CONFLICT DO NOTHING``.

A sink that cannot write raises ``audit_sink_unavailable`` after a few quick attempts; the
workflow shows the error on the run and retries on a backoff timer, and starts no further work
until every record is in (workflows/agent_run.py). Each failure is logged here and counted
(``tether_audit_sink_failures``). ``tether timeline RUN --all`` reads the sink (tether.client.audit_trail).

The carried-state seal lives in ``activities/keys.py``.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
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

from activities.postgres import Postgres, Table, cause as db_cause, dsn_from_env, redact_dsn
from workflows import keys as ring_math
from workflows.published import COLLECT_EXTERN, VIEW_MEMO
from workflows.run_state import RunView
from workflows.wire import RECORD_UNVERIFIED, SINK_UNAVAILABLE, AuditAck, AuditBatch
from workflows.states import TransitionRecord, record_link, with_links

DEFAULT_AUDIT_DIR = ".tether/audit"
AUDIT_TABLE = "tether_audit"
SINK_FAILURES = "tether_audit_sink_failures"
RECORDS_REFUSED = "tether_audit_records_refused"
_TAIL = 64 * 1024  # enough to hold the last complete record line
_PREFIX_CHARS = 48
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")

log = logging.getLogger("tether.audit")


# ----------------------------------------------------------------------------- signatures
# A record or a view is the fleet's word only when the fleet's key signed it for the run it
# names (workflows/keys.py): whoever completes a task can schedule audit_append with records of
# its own, or write a memo. Verified with the public keys alone (activities/keys.PublicKeys).


def record_problem(publics: Any, workflow_id: str, run_id: str, record: TransitionRecord) -> str | None:
    """Why ``record``'s signature is not the fleet's for run ``run_id`` (None: it is)."""
    why = publics.problem(ring_math.record_statement(workflow_id, run_id, record.seq, record_link(record)), record.sig)
    return None if why is None else f"record seq {record.seq} of run {run_id}: {why}"


def batch_problem(publics: Any, workflow_id: str, run_id: str, records: list[TransitionRecord]) -> str | None:
    """Why ``records`` (a batch a run sends out, in seq order) are not the fleet's for run
    ``run_id`` (None: they are): each links to the one before it, and the last bears the fleet's
    signature, which through the chain covers the rest."""
    for before, record in zip(records, records[1:]):
        if record.seq != before.seq + 1 or record.prev != record_link(before):
            return f"record seq {record.seq} of run {run_id}: not chained to the record before it"
    return record_problem(publics, workflow_id, run_id, records[-1]) if records else None


def view_problem(publics: Any, workflow_id: str, run_id: str, view: RunView) -> str | None:
    """Why ``view`` is not what run ``run_id`` published (None: it is)."""
    why = publics.problem(ring_math.view_statement(workflow_id, run_id, ring_math.view_digest(view)), view.sig)
    return None if why is None else f"the view run {run_id} shows is not signed by the fleet ({why})"


@dataclass
class TrailCheck:
    """``tether audit verify``: every record of a workflow id's streams, signature and chain."""

    records: int = 0
    problems: list[str] = field(default_factory=list)  # the first one names the first bad record


def verify_streams(publics: Any, workflow_id: str, streams: dict[str, list[TransitionRecord]]) -> TrailCheck:
    """Every record of each stream (run id) links to the one before it and is covered by a
    signature of the fleet's for that stream on it or on a record chained after it (a run signs
    the last record of each batch it sends). A stream's first record links to a covered record
    of the seq before it in another stream of the workflow id (a continued or a reset run), or
    is seq 1. A record missing, out of the chain or not covered is named, first one first."""
    check = TrailCheck()
    covered: dict[str, list[TransitionRecord]] = {}
    problems: list[tuple[int, str]] = []
    for run_id, records in streams.items():
        ordered = sorted(records, key=lambda r: r.seq)
        check.records += len(ordered)
        good: list[TransitionRecord] = []
        signed = False  # walking back: a verified signature covers what chains before it
        after: TransitionRecord | None = None
        for record in reversed(ordered):
            if after is not None and (after.seq != record.seq + 1 or after.prev != record_link(record)):
                what = (f"records seq {record.seq + 1}..{after.seq - 1} are missing" if after.seq > record.seq + 1
                        else f"record seq {after.seq} is not chained to the record before it")
                problems.append((after.seq, f"run {run_id}: {what}"))
                signed = False
            if record.sig:
                why = record_problem(publics, workflow_id, run_id, record)
                if why:
                    problems.append((record.seq, why))
                signed = why is None
            if signed:
                good.append(record)
            else:
                problems.append((record.seq, f"record seq {record.seq} of run {run_id}: not covered by a signature of the fleet's"))
            after = record
        covered[run_id] = good
    links: dict[int, set[str]] = {}
    for records in covered.values():
        for record in records:
            links.setdefault(record.seq, set()).add(record_link(record))
    for run_id, records in covered.items():
        first = min(records, key=lambda r: r.seq, default=None)
        if first is not None and not (first.seq == 1 and first.prev == "" or first.prev in links.get(first.seq - 1, set())):
            problems.append((first.seq, f"record seq {first.seq} of run {run_id}: not chained to a record before it"))
    check.problems = [why for _, why in sorted(problems, key=lambda p: p[0])]
    return check


# ----------------------------------------------------------------------------- names


def bounded_name(text: str, *, prefix_chars: int = _PREFIX_CHARS) -> str:
    """A file name for any id: a readable ASCII prefix and a hash of the whole id.

    At most ``prefix_chars + 25`` characters whatever the id's length or script (a workflow id
    may be 1,000 characters, or Japanese: 3 bytes a character, 9 once percent-quoted), never
    ``.``/``..``, never a path separator; distinct ids get distinct names.
    """
    prefix = _SAFE.sub("-", text).strip("-.")[:prefix_chars].rstrip("-.") or "id"
    return f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def _run_file(run_id: str) -> str:
    # Temporal's run ids are UUIDs; anything else is hashed like a workflow id.
    return (run_id if re.fullmatch(r"[A-Za-z0-9-]{1,64}", run_id) else bounded_name(run_id)) + ".jsonl"


def workflow_dir(root: Path, workflow_id: str) -> Path:
    return root / bounded_name(workflow_id)


def audit_path(root: Path, workflow_id: str, run_id: str) -> Path:
    """The JSON-lines file of one execution (workflow id + run id)."""
    return workflow_dir(root, workflow_id) / _run_file(run_id)


# ----------------------------------------------------------------------------- sinks


class AuditSink(Protocol):
    """Where every record goes. ``append`` is idempotent per (workflow id, run id, seq)."""

    def describe(self) -> str: ...

    async def append(self, batch: AuditBatch) -> int: ...

    async def read(self, workflow_id: str) -> dict[str, list[TransitionRecord]]:
        """Every record of every execution of ``workflow_id``: run id -> records in seq order."""
        ...

    async def workflow_ids(self) -> list[str]:
        """Every workflow id the sink holds records of (``tether audit verify --all``)."""
        ...

    async def aclose(self) -> None: ...


@dataclass
class JsonlAuditSink:
    root: Path

    @classmethod
    def from_env(cls, path: str | None = None) -> JsonlAuditSink:
        return cls(Path(path or os.environ.get("TETHER_AUDIT_DIR") or DEFAULT_AUDIT_DIR))

    def describe(self) -> str:
        return f"JSON lines under {self.root}"

    async def aclose(self) -> None:
        pass  # nothing held open between appends

    async def append(self, batch: AuditBatch) -> int:
        # open, flock and fsync block: in a thread, so the worker's event loop (every workflow
        # and activity on this worker) never waits for the disk.
        return await asyncio.to_thread(self.write, batch)

    def write(self, batch: AuditBatch) -> int:
        """Append the records of this execution not written yet; returns the last seq on file."""
        folder = workflow_dir(self.root, batch.workflow_id)
        folder.mkdir(parents=True, exist_ok=True)
        name = folder / "workflow_id"
        if not name.exists():  # the full id, for a person reading the folder
            name.write_text(batch.workflow_id + "\n")
        path = audit_path(self.root, batch.workflow_id, batch.run_id)
        with open(path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # one writer per file, across worker processes
            last = _last_seq(f)
            lines = [_line(batch, r) for r in batch.records if r.seq > last]
            if lines:
                f.write(b"".join(lines))
                f.flush()
                os.fsync(f.fileno())
                last = max(r.seq for r in batch.records)
            return last

    async def workflow_ids(self) -> list[str]:
        def names() -> list[str]:
            found = []
            for marker in sorted(self.root.glob("*/workflow_id")) if self.root.is_dir() else []:
                found.append(marker.read_text().removesuffix("\n"))
            return found

        return await asyncio.to_thread(names)

    async def read(self, workflow_id: str) -> dict[str, list[TransitionRecord]]:
        streams: dict[str, list[TransitionRecord]] = {}
        folder = workflow_dir(self.root, workflow_id)
        for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
            run_id = None
            records = []
            for line in path.read_bytes().splitlines():
                try:
                    raw = json.loads(line)
                    records.append(TransitionRecord.model_validate(raw))
                except ValueError:
                    continue  # a torn last line, cut off by the next append
                run_id = run_id or raw.get("run_id")
            if records:
                streams[run_id or path.stem] = records
        return streams


def _line(batch: AuditBatch, record: TransitionRecord) -> bytes:
    raw = record.model_dump(mode="json")
    # Each line says which execution wrote it (the file name is only a bounded hash).
    raw.update(workflow_id=batch.workflow_id, run_id=batch.run_id, first_run_id=batch.first_run_id)
    if batch.continued_from:
        raw["continued_from"] = batch.continued_from
    return json.dumps(raw, sort_keys=True, ensure_ascii=False).encode() + b"\n"


def _last_seq(f) -> int:
    """The seq of the last complete line; a torn tail (killed mid-write) is truncated."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
        return 0
    start = max(size - _TAIL, 0)
    f.seek(start)
    tail = f.read()
    end = tail.rfind(b"\n")
    if end != len(tail) - 1:
        f.truncate(start + end + 1 if end >= 0 else start)
        f.seek(0, os.SEEK_END)
        if end < 0:
            return 0 if start == 0 else _last_seq(f)
        tail = tail[: end + 1]
    lines = tail.rstrip(b"\n").rsplit(b"\n", 1)
    try:
        return int(json.loads(lines[-1])["seq"])
    except (ValueError, KeyError, TypeError):
        return 0


SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {AUDIT_TABLE} (
    workflow_id    text        NOT NULL,
    run_id         text        NOT NULL,
    seq            bigint      NOT NULL,
    first_run_id   text        NOT NULL,
    continued_from text,
    record         jsonb       NOT NULL,
    written_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT {AUDIT_TABLE}_key UNIQUE (workflow_id, run_id, seq)
);
CREATE OR REPLACE FUNCTION {AUDIT_TABLE}_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '{AUDIT_TABLE} is append-only: % refused', TG_OP;
END $$;
CREATE OR REPLACE TRIGGER {AUDIT_TABLE}_append_only BEFORE UPDATE OR DELETE ON {AUDIT_TABLE}
    FOR EACH ROW EXECUTE FUNCTION {AUDIT_TABLE}_append_only();
"""


@dataclass
class PostgresAuditSink:
    """The fleet's sink: every worker writes to one table, whichever machine runs a task."""

    dsn: str
    # The worker's one connection (activities/postgres.py); the effect ledger's table shares it.
    db: Postgres = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.db = Postgres(self.dsn, [Table(AUDIT_TABLE, SCHEMA)])

    def describe(self) -> str:
        return self.db.describe()

    async def append(self, batch: AuditBatch) -> int:
        async def insert(conn: Any) -> int:
            async with conn.transaction(), conn.cursor() as cur:
                await cur.executemany(
                    f"INSERT INTO {AUDIT_TABLE} (workflow_id, run_id, seq, first_run_id, continued_from, record) "
                    "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (workflow_id, run_id, seq) DO NOTHING",
                    [
                        (batch.workflow_id, batch.run_id, r.seq, batch.first_run_id, batch.continued_from,
                         r.model_dump_json())
                        for r in batch.records
                    ],
                )
            return max((r.seq for r in batch.records), default=0)

        return await self.db.run(insert)

    async def workflow_ids(self) -> list[str]:
        async def select(conn: Any) -> list[str]:
            cur = await conn.execute(f"SELECT DISTINCT workflow_id FROM {AUDIT_TABLE} ORDER BY workflow_id")
            return [row[0] for row in await cur.fetchall()]

        return await self.db.run(select)

    async def read(self, workflow_id: str) -> dict[str, list[TransitionRecord]]:
        async def select(conn: Any) -> dict[str, list[TransitionRecord]]:
            cur = await conn.execute(
                f"SELECT run_id, record::text FROM {AUDIT_TABLE} WHERE workflow_id = %s ORDER BY run_id, seq",
                (workflow_id,),
            )
            streams: dict[str, list[TransitionRecord]] = {}
            for run_id, record in await cur.fetchall():
                streams.setdefault(run_id, []).append(TransitionRecord.model_validate_json(record))
            await conn.rollback()
            return streams

        return await self.db.run(select)

    async def aclose(self) -> None:
        await self.db.aclose()


def sink_from_env(audit_dir: str | None = None, dsn: str | None = None) -> AuditSink:
    """``TETHER_AUDIT_DSN`` (PostgreSQL) when set, else JSON lines under ``TETHER_AUDIT_DIR``.
    An explicit ``audit_dir`` picks the JSON-lines sink."""
    dsn = dsn_from_env(audit_dir, dsn)
    return PostgresAuditSink(dsn) if dsn else JsonlAuditSink.from_env(audit_dir)


def merge_timeline(sink: list[TransitionRecord], window: list[TransitionRecord]) -> list[TransitionRecord]:
    """The sink's records and the workflow's window, each record once, in seq order."""
    by_seq: dict[int, TransitionRecord] = {}
    unsequenced = []
    for record in [*sink, *window]:
        if record.seq:
            by_seq.setdefault(record.seq, record)
        elif record not in unsequenced:
            unsequenced.append(record)  # records written before records had a seq
    return unsequenced + [by_seq[k] for k in sorted(by_seq)]


class AuditActivities:
    def __init__(self, sink: AuditSink | None = None, publics: Any = None) -> None:
        self.sink = sink or sink_from_env()
        self.publics = publics  # the fleet's public keys (worker.create_worker sets them)

    @activity.defn(name="audit_append")
    async def audit_append(self, batch: AuditBatch | bytes) -> AuditAck:
        return AuditAck(last_seq=await self.write(batch))

    async def write(self, batch: AuditBatch | bytes) -> int:
        """The records a run sends (``audit_append``, or along with a write: execute_tool), into
        the stream of the execution whose activity this is; the last seq written. Refused whole
        unless the fleet signed them for that run; a failing sink is an ApplicationError."""
        info = activity.info()
        if not isinstance(batch, AuditBatch):  # packed (AuditBatch.packed), as the workflow sends it
            batch = AuditBatch.model_validate(batch)
        # The execution that asks is the stream's key, and its workflow id (never the batch's);
        # its records' links, which the run leaves out after the first, are filled in again.
        batch = batch.model_copy(update={
            "run_id": info.workflow_run_id or batch.run_id,
            "records": with_links(sorted(batch.records, key=lambda r: r.seq)),
        })
        self._refuse_unsigned(info.workflow_id, batch)
        try:
            return await self.sink.append(batch)
        except Exception as e:  # any sink error: visible on the run, in the log, in a metric
            cause = db_cause(e)
            log.warning(
                "audit sink failing (%s) for workflow %s run %s, records %s-%s, attempt %s: %s",
                self.sink.describe(), batch.workflow_id[:200], batch.run_id,
                batch.records[0].seq if batch.records else "-", batch.records[-1].seq if batch.records else "-",
                info.attempt, cause,
            )
            activity.metric_meter().create_counter(
                SINK_FAILURES, "Audit sink writes that failed (the run retries them)", "1"
            ).add(1, {"sink": type(self.sink).__name__})
            raise ApplicationError(f"{self.sink.describe()}: {cause}", type=SINK_UNAVAILABLE) from None

    def _refuse_unsigned(self, workflow_id: str, batch: AuditBatch) -> None:
        """Only the run's own signed records, into its own stream: anything else is refused
        whole (nothing of the batch is written), logged and counted."""
        if batch.workflow_id != workflow_id:
            why = f"the batch names workflow {batch.workflow_id[:200]!r}, not the run that asks"
        elif self.publics is None:
            why = "this worker has no public keys to verify records with"
        else:
            why = batch_problem(self.publics, workflow_id, batch.run_id, batch.records)
        if why is None:
            return
        log.error("audit sink refused a batch for workflow %s run %s: %s", workflow_id[:200], batch.run_id, why)
        activity.metric_meter().create_counter(
            RECORDS_REFUSED, "Audit records refused: not signed by the fleet for the run that asked", "1"
        ).add(len(batch.records))
        raise ApplicationError(f"audit records refused: {why}", type=RECORD_UNVERIFIED, non_retryable=True)


# ----------------------------------------------------------------------------- the end's records

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
        self._writing: set[asyncio.Task[None]] = set()
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
