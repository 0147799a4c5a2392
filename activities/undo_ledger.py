"""The undo ledger: each undo of a write is started at most once, whoever asks for it.

An undo (a compensation) is keyed by its idempotency key, which derives from the original write's
(``<original workflow id>:<tool call id>:undo``; the tool call id derives from the original's run
chain and the decision that made it). That key reaches the tool worker inside the call's
capability, which the run's own workflow code minted with the fleet key: the key is the original
run's keyed record, never a client's claim. Before the tool is called the tool worker *claims* the
key here; after it, the claim becomes ``done`` (with the outcome) or is released (the tool refused
it: known not applied). A claim that was never settled is an undo that **may have applied**.

What a later call of the same undo gets (a second compensation run of the same original under any
workflow id, a reset run, a retry after a crash): ``done`` — the recorded outcome, the tool not
called; ``claimed`` — the retry rule of the undo tool's effect: ``idempotent`` runs again under the
same key (the target dedupes: what the tool declares), ``reconcilable`` looks its effect up first,
``unsafe`` is refused (``undo_may_have_applied``, outcome unknown) unless the capability carries a
recorded re-run instruction from an approver (``tether compensate RUN --rerun-unknown STEP``).

It lives where the audit sink lives: a SQLite file in the JSON-lines sink's folder
(``TETHER_AUDIT_DIR``; ``undo-ledger.sqlite3``), or a table of the PostgreSQL sink
(``tether_undo_ledger``, ``TETHER_AUDIT_DSN``) for fleets whose workers run on several machines.
The CLI reads the same place to say where each write stands (``client.undo_ledger``).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Protocol

from activities.audit import JsonlAuditSink, PostgresAuditSink

LEDGER_FILE = "undo-ledger.sqlite3"
LEDGER_TABLE = "tether_undo_ledger"

# claimed: started, its attempt may still be running (or its worker died); unknown: started, the
# attempt is over and its outcome unknown; done: applied (outcome recorded); released: refused
# by the target, known not applied (free to claim again).
EntryState = Literal["claimed", "unknown", "done", "released"]


@dataclass(frozen=True)
class LedgerEntry:
    key: str
    state: EntryState
    tool: str
    by_workflow: str  # the run (workflow id) that last claimed or finished it
    by_run: str
    at: datetime  # when it was claimed, or finished
    outcome: str = ""  # the ToolOutcome's JSON, once done


class UndoLedger(Protocol):
    def describe(self) -> str: ...

    async def claim(self, key: str, *, tool: str, workflow_id: str, run_id: str) -> LedgerEntry | None:
        """Claim ``key`` for this call: None when it was free (never claimed, or released), else
        the entry that holds it (nothing changed)."""
        ...

    async def reclaim(self, key: str, *, workflow_id: str, run_id: str) -> None:
        """A claimed undo that is run again (its effect class allows it): this call holds it now."""
        ...

    async def done(self, key: str, outcome: str, *, workflow_id: str, run_id: str) -> None: ...

    async def release(self, key: str) -> None:
        """The tool refused the undo: known not applied; a later call may claim it again."""
        ...

    async def unknown(self, key: str) -> None:
        """The attempt is over and its outcome unknown (it may have applied)."""
        ...

    async def entries(self, keys: list[str]) -> dict[str, LedgerEntry]: ...

    async def aclose(self) -> None: ...


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _entry(row: Any) -> LedgerEntry:
    key, state, tool, by_workflow, by_run, at, outcome = row
    when = at if isinstance(at, datetime) else datetime.fromisoformat(at)
    return LedgerEntry(key, state, tool, by_workflow, by_run, when, outcome or "")


_COLUMNS = "key, state, tool, by_workflow, by_run, at, outcome"


@dataclass
class SqliteUndoLedger:
    """The dev ledger: one SQLite file next to the JSON-lines audit sink (one machine). One
    connection, opened on first use; its statements one at a time (they run in threads)."""

    path: Path
    _conn: sqlite3.Connection | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def describe(self) -> str:
        return f"SQLite {self.path}"

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {LEDGER_TABLE} (key TEXT PRIMARY KEY, state TEXT NOT NULL, tool TEXT NOT NULL, "
                "by_workflow TEXT NOT NULL, by_run TEXT NOT NULL, at TEXT NOT NULL, outcome TEXT NOT NULL DEFAULT '')"
            )
            self._conn = conn
        return self._conn

    def _run(self, work: Any) -> Any:
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")  # one writer at a time, across worker processes
            try:
                result = work(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result

    async def claim(self, key: str, *, tool: str, workflow_id: str, run_id: str) -> LedgerEntry | None:
        def work(conn: sqlite3.Connection) -> LedgerEntry | None:
            row = conn.execute(f"SELECT {_COLUMNS} FROM {LEDGER_TABLE} WHERE key = ?", (key,)).fetchone()
            if row is not None and row[1] != "released":
                return _entry(row)
            conn.execute(
                f"INSERT OR REPLACE INTO {LEDGER_TABLE} ({_COLUMNS}) VALUES (?, 'claimed', ?, ?, ?, ?, '')",
                (key, tool, workflow_id, run_id, _now().isoformat()),
            )
            return None

        return await asyncio.to_thread(self._run, work)

    async def reclaim(self, key: str, *, workflow_id: str, run_id: str) -> None:
        await asyncio.to_thread(self._run, lambda conn: conn.execute(
            f"UPDATE {LEDGER_TABLE} SET state = 'claimed', by_workflow = ?, by_run = ?, at = ? "
            "WHERE key = ? AND state IN ('claimed', 'unknown')",
            (workflow_id, run_id, _now().isoformat(), key),
        ))

    async def done(self, key: str, outcome: str, *, workflow_id: str, run_id: str) -> None:
        await asyncio.to_thread(self._run, lambda conn: conn.execute(
            f"UPDATE {LEDGER_TABLE} SET state = 'done', outcome = ?, by_workflow = ?, by_run = ?, at = ? "
            "WHERE key = ? AND state IN ('claimed', 'unknown')",
            (outcome, workflow_id, run_id, _now().isoformat(), key),
        ))

    async def release(self, key: str) -> None:
        await asyncio.to_thread(self._run, lambda conn: conn.execute(
            f"UPDATE {LEDGER_TABLE} SET state = 'released' WHERE key = ? AND state = 'claimed'", (key,)
        ))

    async def unknown(self, key: str) -> None:
        await asyncio.to_thread(self._run, lambda conn: conn.execute(
            f"UPDATE {LEDGER_TABLE} SET state = 'unknown' WHERE key = ? AND state = 'claimed'", (key,)
        ))

    async def entries(self, keys: list[str]) -> dict[str, LedgerEntry]:
        if not keys or not self.path.exists():
            return {}

        def work(conn: sqlite3.Connection) -> dict[str, LedgerEntry]:
            marks = ", ".join("?" for _ in keys)
            rows = conn.execute(f"SELECT {_COLUMNS} FROM {LEDGER_TABLE} WHERE key IN ({marks})", keys).fetchall()
            return {row[0]: _entry(row) for row in rows}

        return await asyncio.to_thread(self._run, work)

    async def aclose(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {LEDGER_TABLE} (
    key         text        PRIMARY KEY,
    state       text        NOT NULL,
    tool        text        NOT NULL,
    by_workflow text        NOT NULL,
    by_run      text        NOT NULL,
    at          timestamptz NOT NULL,
    outcome     text        NOT NULL DEFAULT ''
);
"""


@dataclass
class PostgresUndoLedger:
    """The fleet's ledger: a table in the audit sink's database, whichever machine runs the undo,
    over the sink's own connection (one per worker)."""

    sink: PostgresAuditSink
    _ready: bool = field(default=False, repr=False)

    def describe(self) -> str:
        return f"{self.sink.describe()} ({LEDGER_TABLE})"

    async def _with_connection(self, work: Any) -> Any:
        async def in_transaction(conn: Any) -> Any:
            async with conn.transaction():
                if not self._ready:
                    # Several workers may create the table at once: one at a time.
                    await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (LEDGER_TABLE,))
                    await conn.execute(SCHEMA)
                result = await work(conn)
            self._ready = True
            return result

        return await self.sink.with_connection(in_transaction)

    async def claim(self, key: str, *, tool: str, workflow_id: str, run_id: str) -> LedgerEntry | None:
        async def work(conn: Any) -> LedgerEntry | None:
            cur = await conn.execute(
                f"INSERT INTO {LEDGER_TABLE} ({_COLUMNS}) VALUES (%s, 'claimed', %s, %s, %s, now(), '') "
                "ON CONFLICT (key) DO UPDATE SET state = 'claimed', tool = EXCLUDED.tool, by_workflow = EXCLUDED.by_workflow, "
                f"by_run = EXCLUDED.by_run, at = EXCLUDED.at WHERE {LEDGER_TABLE}.state = 'released' RETURNING key",
                (key, tool, workflow_id, run_id),
            )
            if await cur.fetchone() is not None:
                return None
            cur = await conn.execute(f"SELECT {_COLUMNS} FROM {LEDGER_TABLE} WHERE key = %s", (key,))
            return _entry(await cur.fetchone())

        return await self._with_connection(work)

    async def reclaim(self, key: str, *, workflow_id: str, run_id: str) -> None:
        await self._with_connection(lambda conn: conn.execute(
            f"UPDATE {LEDGER_TABLE} SET state = 'claimed', by_workflow = %s, by_run = %s, at = now() "
            "WHERE key = %s AND state IN ('claimed', 'unknown')",
            (workflow_id, run_id, key),
        ))

    async def done(self, key: str, outcome: str, *, workflow_id: str, run_id: str) -> None:
        await self._with_connection(lambda conn: conn.execute(
            f"UPDATE {LEDGER_TABLE} SET state = 'done', outcome = %s, by_workflow = %s, by_run = %s, at = now() "
            "WHERE key = %s AND state IN ('claimed', 'unknown')",
            (outcome, workflow_id, run_id, key),
        ))

    async def release(self, key: str) -> None:
        await self._with_connection(lambda conn: conn.execute(
            f"UPDATE {LEDGER_TABLE} SET state = 'released' WHERE key = %s AND state = 'claimed'", (key,)
        ))

    async def unknown(self, key: str) -> None:
        await self._with_connection(lambda conn: conn.execute(
            f"UPDATE {LEDGER_TABLE} SET state = 'unknown' WHERE key = %s AND state = 'claimed'", (key,)
        ))

    async def entries(self, keys: list[str]) -> dict[str, LedgerEntry]:
        if not keys:
            return {}

        async def work(conn: Any) -> dict[str, LedgerEntry]:
            cur = await conn.execute(f"SELECT {_COLUMNS} FROM {LEDGER_TABLE} WHERE key = ANY(%s)", (keys,))
            return {row[0]: _entry(row) for row in await cur.fetchall()}

        return await self._with_connection(work)

    async def aclose(self) -> None:
        await self.sink.aclose()


def ledger_for(sink: Any) -> UndoLedger:
    """The ledger that lives where the audit sink does."""
    if isinstance(sink, PostgresAuditSink):
        return PostgresUndoLedger(sink)
    root = sink.root if isinstance(sink, JsonlAuditSink) else JsonlAuditSink.from_env().root
    return SqliteUndoLedger(root / LEDGER_FILE)
