"""The audit sinks: where every timeline record is kept, and the names of its files.

Records are keyed by workflow id, **run id** and ``seq``: each execution of a workflow id is its
own stream, so a reset (a new run whose history copies the old one up to the reset point, and
which writes its own records from there) never overwrites or hides what the original run wrote.
Appends are idempotent per stream: a retried or repeated batch never writes a record twice.

Two sinks, one contract:

- JSON lines (the embedded default), under ``TETHER_AUDIT_DIR`` (default ``.tether/audit``): one
  folder per workflow id, named by a readable prefix and a hash (``refund-A-1001-3f2c…``: bounded
  whatever the id's length or script), one file per run id. A line torn by a worker killed
  mid-write is cut off and written again by the retry.
- PostgreSQL (``TETHER_AUDIT_DSN=postgresql://…``, kept by tether/store/postgres.py), for fleets
  whose workers run on several machines: one append-only table (``tether_audit``; a trigger
  refuses UPDATE and DELETE) with a unique key on (workflow_id, run_id, seq); a batch is one
  transaction, ``ON CONFLICT DO NOTHING``.

What writes to them: the audit activities (activities/audit.py) and the audit collector
(tether/audit/collector.py); ``tether timeline RUN --all`` and ``tether audit verify`` read them.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from tether.store.postgres import Postgres, Table, dsn_from_env
from tether.store.tables import AUDIT_SCHEMA as SCHEMA, AUDIT_TABLE, DEFAULT_AUDIT_DIR
from workflows.wire import AuditBatch
from workflows.states import TransitionRecord

SINK_FAILURES = "tether_audit_sink_failures"
_TAIL = 64 * 1024  # enough to hold the last complete record line
_PREFIX_CHARS = 48
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


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


def _last_seq(f: BinaryIO) -> int:
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


@dataclass
class PostgresAuditSink:
    """The fleet's sink: every worker writes to one table, whichever machine runs a task."""

    dsn: str
    # The worker's one connection (tether/store/postgres.py); the effect ledger's table shares it.
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
