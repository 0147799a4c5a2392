"""The effect ledger: each write, and each undo of a write, is started at most once, whoever asks.

Every call of a tool that is not ``read_only`` is keyed by its idempotency key: a plan's write by
``<workflow id>:<tool call id>``, an undo by ``<original workflow id>:<tool call id>:undo`` (the
tool call id derives from the run chain and the decision that made it, so a reset run, a repair
and a retry make the same key). That key reaches the tool worker inside the call's capability,
which the run's own workflow code minted with the fleet key: never a client's claim. Before the
tool is called the tool worker *claims* the key here; after it, the claim becomes ``done`` (with
the outcome), ``released`` (the tool refused it: known not applied) or ``unknown`` (the attempt
is over, its outcome unknown). A claim that was never settled is a call that **may have applied**.

What a later call with the same key gets (a retry, a reset run, a repair, a second compensation
run, a replayed capability): ``done`` — the recorded outcome, the tool not called;
``claimed`` by an attempt that may still be running — not started twice at once; otherwise the
retry rule of the tool's effect: ``idempotent`` runs again under the same key (the target
dedupes: what the tool declares), ``reconcilable`` looks its effect up first, ``unsafe`` is
refused (outcome unknown: ``may_have_applied``) unless the capability carries an approver's
recorded re-run instruction (``tether compensate RUN --rerun-unknown STEP``).

It lives where the audit sink lives: a SQLite file in the JSON-lines sink's folder
(``TETHER_AUDIT_DIR``; ``undo-ledger.sqlite3``), or a table of the PostgreSQL sink
(``tether_undo_ledger``, ``TETHER_AUDIT_DSN``; over the sink's connection, tether/store/postgres.py)
for fleets whose workers run on several machines.
The names are those of the undo ledger it grew from: an existing undo ledger is this ledger, used
as it is (same columns; writes' keys join the undos'). The CLI reads the same place to say where
each write stands (``client.undo_standing``).

**The ledger knows it is the newest.** Every new claim advances the ledger's generation, and
the fleet writes the generation it reached to a witness beside the audit sink
(``ledger-witness.json`` in the sink's folder; the table ``tether_ledger_witness`` in
PostgreSQL). A ledger whose generation is below the witness's is a copy from before some of the
fleet's writes (a restored backup, volume or machine): it would answer "never started" for a
write that went out, so it is :class:`LedgerUnavailable` like a missing one, checked at worker
start and on every claim and read, until the operator's ``--new-ledger`` accepts it (what it
lacks may then be started again).

**The ledger is a witness: losing it is an error, never an empty answer.** Where a ledger was
created a marker says so (``undo-ledger.sqlite3.created`` beside the file; a row of
``tether_ledger_created`` in PostgreSQL). A ledger missing where the marker says one was is
:class:`LedgerUnavailable` (for claims and for reads alike) until the operator starts a worker
with ``--new-ledger``, accepting that what the old one recorded may be started again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sqlite3
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

from tether.store.postgres import LOCK, OWNED_ELSEWHERE, Postgres
from tether.store.tables import DEFAULT_AUDIT_DIR
from workflows.contract import CompensationCall

T = TypeVar("T")

LEDGER_FILE = "undo-ledger.sqlite3"
LEDGER_TABLE = "tether_undo_ledger"
# Where a ledger was created: a file beside the SQLite ledger, a row of this table in PostgreSQL.
MARKER_SUFFIX = ".created"
MARKER_TABLE = "tether_ledger_created"
# The ledger's generation, advanced by every new claim, and its witness beside the audit sink
# (a file in the sink's folder; a table in PostgreSQL): a ledger whose generation is below the
# witness's is an older copy (restored from a backup), refused like a missing one.
GENERATION_TABLE = "tether_ledger_generation"
WITNESS_TABLE = "tether_ledger_witness"
WITNESS_FILE = "ledger-witness.json"
NEW_LEDGER_HINT = (
    "start the worker with --new-ledger to begin an empty one (what the old one recorded may then be started again)"
)

# claimed: started, its attempt may still be running (or its worker died); unknown: started, the
# attempt is over and its outcome unknown; done: applied (outcome recorded); released: refused
# by the target, known not applied (free to claim again).
EntryState = Literal["claimed", "unknown", "done", "released"]


class LedgerUnavailable(Exception):
    """The ledger cannot be read or written: missing where one was created, or unreadable."""


@dataclass(frozen=True)
class LedgerEntry:
    key: str
    state: EntryState
    tool: str
    by_workflow: str  # the run (workflow id) that last claimed or finished it
    by_run: str
    at: datetime  # when it was claimed, or finished
    outcome: str = ""  # the ToolOutcome's JSON, once done


class EffectLedger(Protocol):
    def describe(self) -> str: ...

    async def claim(self, key: str, *, tool: str, workflow_id: str, run_id: str) -> LedgerEntry | None:
        """Claim ``key`` for this call: None when it was free (never claimed, or released), else
        the entry that holds it (nothing changed)."""
        ...

    async def reclaim(self, key: str, *, workflow_id: str, run_id: str) -> None:
        """A claimed call that is run again (its effect class allows it): this call holds it now."""
        ...

    async def done(self, key: str, outcome: str, *, workflow_id: str, run_id: str) -> None: ...

    async def release(self, key: str) -> None:
        """The tool refused the call: known not applied; a later call may claim it again."""
        ...

    async def unknown(self, key: str) -> None:
        """The attempt is over and its outcome unknown (it may have applied)."""
        ...

    async def entries(self, keys: list[str]) -> dict[str, LedgerEntry]:
        """The entries of ``keys`` (none for a key never claimed). Raises LedgerUnavailable where
        the ledger is missing but one was created, or cannot be read."""
        ...

    async def aclose(self) -> None: ...


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _older(generation: int, witnessed: int, at: Any) -> str:
    return (
        f"the ledger is older than the fleet's (generation {generation}, the fleet reached {witnessed} at {at}): "
        f"a restored copy? What went out since would start again; {NEW_LEDGER_HINT}"
    )


def _entry(row: Any) -> LedgerEntry:
    key, state, tool, by_workflow, by_run, at, outcome = row
    when = at if isinstance(at, datetime) else datetime.fromisoformat(at)
    return LedgerEntry(key, state, tool, by_workflow, by_run, when, outcome or "")


_COLUMNS = "key, state, tool, by_workflow, by_run, at, outcome"


@dataclass
class SqliteEffectLedger:
    """The dev ledger: one SQLite file next to the JSON-lines audit sink (one machine). One
    connection, opened on first use; its statements one at a time (they run in threads).
    ``new_ledger``: the operator accepts an empty ledger where one was created before."""

    path: Path
    new_ledger: bool = False
    _conn: sqlite3.Connection | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def describe(self) -> str:
        return f"SQLite {self.path}"

    @property
    def marker(self) -> Path:
        return self.path.with_name(self.path.name + MARKER_SUFFIX)

    def _gone(self) -> LedgerUnavailable | None:
        """The ledger file is missing where the marker says one was created (else None)."""
        if self.path.exists() or not self.marker.exists():
            return None
        try:
            created = json.loads(self.marker.read_text()).get("created_at", "?")
        except (OSError, ValueError):
            created = "?"
        return LedgerUnavailable(f"the ledger {self.path} is missing, but one was created there at {created}; {NEW_LEDGER_HINT}")

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None:
            if self.path.exists():
                return self._conn
            # Removed under us: SQLite would go on writing to the removed file, seen by no one.
            self._conn.close()
            self._conn = None
        gone = self._gone()
        if gone is not None and not self.new_ledger:
            raise gone
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {LEDGER_TABLE} (key TEXT PRIMARY KEY, state TEXT NOT NULL, tool TEXT NOT NULL, "
                "by_workflow TEXT NOT NULL, by_run TEXT NOT NULL, at TEXT NOT NULL, outcome TEXT NOT NULL DEFAULT '')"
            )
            conn.execute(f"CREATE TABLE IF NOT EXISTS {GENERATION_TABLE} (ledger TEXT PRIMARY KEY, generation INTEGER NOT NULL)")
        except BaseException:
            conn.close()
            raise
        if gone is not None or not self.marker.exists():
            # A ledger that predates the marker (or the one the operator asked for) is marked now.
            self.marker.write_text(json.dumps({"ledger": self.path.name, "created_at": _now().isoformat()}) + "\n")
        self._conn = conn
        return conn

    @property
    def witness(self) -> Path:
        return self.path.with_name(WITNESS_FILE)

    def _witnessed(self) -> dict[str, Any]:
        try:
            witnessed: dict[str, Any] = json.loads(self.witness.read_text())
            return witnessed
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise LedgerUnavailable(f"the ledger's witness {self.witness} cannot be read ({e})") from None

    def _witness(self, generation: int) -> None:
        """The fleet reached ``generation``: said beside the sink, after the claim committed. A
        witness that cannot be written leaves the ledger ahead of it, which is safe (only a
        ledger behind its witness is refused): logged, never the claim's failure."""
        tmp = self.witness.with_name(f".{self.witness.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            if int(self._witnessed().get("generation", 0)) >= generation:
                return
            tmp.write_text(json.dumps({"ledger": self.path.name, "generation": generation, "at": _now().isoformat()}) + "\n")
            os.replace(tmp, self.witness)
        except (OSError, LedgerUnavailable) as e:
            logging.getLogger("tether.ledger").warning("ledger witness %s not written: %s", self.witness, e)

    def _generation(self, conn: sqlite3.Connection) -> int:
        """The ledger's generation, checked against the witness: an older copy is refused (or,
        on the operator's --new-ledger, takes the witness's generation)."""
        row = conn.execute(f"SELECT generation FROM {GENERATION_TABLE} WHERE ledger = ?", (LEDGER_TABLE,)).fetchone()
        generation = row[0] if row else 0
        seen = self._witnessed()
        witnessed = int(seen.get("generation", 0))
        if generation < witnessed:
            if not self.new_ledger:
                raise LedgerUnavailable(_older(generation, witnessed, seen.get("at", "?")))
            generation = witnessed
            conn.execute(f"INSERT OR REPLACE INTO {GENERATION_TABLE} (ledger, generation) VALUES (?, ?)", (LEDGER_TABLE, generation))
        return generation

    def _run(self, work: Any, *, advance: bool = False) -> Any:
        """``work(conn)`` in one transaction, the ledger checked to be the newest first.
        ``advance``: a new claim when ``work`` returns None: the generation moves on, and the
        witness with it once committed."""
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")  # one writer at a time, across worker processes
            try:
                generation = self._generation(conn)
                result = work(conn)
                if advance and result is None:
                    generation += 1
                    conn.execute(f"INSERT OR REPLACE INTO {GENERATION_TABLE} (ledger, generation) VALUES (?, ?)",
                                 (LEDGER_TABLE, generation))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            if advance and result is None:
                self._witness(generation)
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

        return await asyncio.to_thread(lambda: self._run(work, advance=True))

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
        if not keys:
            return {}
        if not self.path.exists():
            gone = self._gone()
            if gone is not None and not self.new_ledger:
                raise gone
            return {}  # no ledger was ever created here (or the operator begins anew): nothing claimed

        def work(conn: sqlite3.Connection) -> dict[str, LedgerEntry]:
            marks = ", ".join("?" for _ in keys)
            rows = conn.execute(f"SELECT {_COLUMNS} FROM {LEDGER_TABLE} WHERE key IN ({marks})", keys).fetchall()
            return {row[0]: _entry(row) for row in rows}

        return await asyncio.to_thread(self._run, work)

    def _close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    async def aclose(self) -> None:
        self._close()


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
CREATE TABLE IF NOT EXISTS {MARKER_TABLE} (
    ledger      text        PRIMARY KEY,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {GENERATION_TABLE} (
    ledger      text        PRIMARY KEY,
    generation  bigint      NOT NULL
);
CREATE TABLE IF NOT EXISTS {WITNESS_TABLE} (
    ledger      text        PRIMARY KEY,
    generation  bigint      NOT NULL,
    at          timestamptz NOT NULL DEFAULT now()
);
"""


@dataclass
class PostgresEffectLedger:
    """The fleet's ledger: a table in the audit sink's database, whichever machine runs the call,
    over the sink's own connection (one per worker)."""

    sink: Any  # the PostgreSQL audit sink (tether/audit/sink.py): its connection, ``db``
    new_ledger: bool = False
    _ready: bool = field(default=False, repr=False)

    def describe(self) -> str:
        return f"{self.sink.describe()} ({LEDGER_TABLE})"

    async def _open(self, conn: Any) -> None:
        """Once per connection's life here: the table, unless it is missing where one was made."""
        # Several workers may create the table at once: one at a time.
        await conn.execute(LOCK, (LEDGER_TABLE,))
        cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL", (LEDGER_TABLE, MARKER_TABLE))
        table, marked = await cur.fetchone()
        if table:
            row = await (await conn.execute(OWNED_ELSEWHERE, (LEDGER_TABLE,))).fetchone()
            if row and row[0]:
                return  # the owner's tables (tether/store/db_roles.py): made, marked and granted by setup
        if not table and marked and not self.new_ledger:
            cur = await conn.execute(f"SELECT created_at FROM {MARKER_TABLE} WHERE ledger = %s", (LEDGER_TABLE,))
            row = await cur.fetchone()
            if row is not None:
                raise LedgerUnavailable(
                    f"the ledger table {LEDGER_TABLE} is missing, but one was created at "
                    f"{row[0].isoformat(timespec='seconds')}; {NEW_LEDGER_HINT}"
                )
        await conn.execute(SCHEMA)
        if not table:
            await conn.execute(f"DELETE FROM {MARKER_TABLE} WHERE ledger = %s", (LEDGER_TABLE,))
        await conn.execute(f"INSERT INTO {MARKER_TABLE} (ledger) VALUES (%s) ON CONFLICT DO NOTHING", (LEDGER_TABLE,))

    async def _generation(self, conn: Any, *, lock: bool = False) -> int:
        """The ledger's generation, checked against the witness; ``lock``: held for this
        transaction (a claim: a reader, with SELECT only, does not lock)."""
        cur = await conn.execute(f"SELECT generation FROM {GENERATION_TABLE} WHERE ledger = %s" + (" FOR UPDATE" if lock else ""),
                                 (LEDGER_TABLE,))
        row = await cur.fetchone()
        generation = row[0] if row else 0
        cur = await conn.execute(f"SELECT generation, at FROM {WITNESS_TABLE} WHERE ledger = %s", (LEDGER_TABLE,))
        seen = await cur.fetchone()
        if seen is not None and generation < seen[0]:
            if not self.new_ledger:
                raise LedgerUnavailable(_older(generation, seen[0], seen[1].isoformat(timespec="seconds")))
            generation = seen[0]
            await self._set_generation(conn, generation, witness=False)
        return generation

    async def _set_generation(self, conn: Any, generation: int, *, witness: bool = True) -> None:
        await conn.execute(
            f"INSERT INTO {GENERATION_TABLE} (ledger, generation) VALUES (%s, %s) "
            "ON CONFLICT (ledger) DO UPDATE SET generation = EXCLUDED.generation", (LEDGER_TABLE, generation))
        if witness:
            await conn.execute(
                f"INSERT INTO {WITNESS_TABLE} (ledger, generation) VALUES (%s, %s) ON CONFLICT (ledger) DO UPDATE "
                f"SET generation = GREATEST({WITNESS_TABLE}.generation, EXCLUDED.generation), at = now()",
                (LEDGER_TABLE, generation))

    async def _with_connection(self, work: Callable[[Any], Awaitable[T]], *, advance: bool = False) -> T:
        """``work(conn)`` in one transaction, the ledger checked to be the newest first.
        ``advance``: a new claim when ``work`` returns None: the generation and its witness move on."""
        async def in_transaction(conn: Any) -> T:
            async with conn.transaction():
                if not self._ready:
                    await self._open(conn)
                generation = await self._generation(conn, lock=advance)
                result = await work(conn)
                if advance and result is None:
                    await self._set_generation(conn, generation + 1)
            self._ready = True
            return result

        done: T = await self.sink.db.run(in_transaction)
        return done

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

        return await self._with_connection(work, advance=True)

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


def ledger_for(sink: Any, *, new_ledger: bool = False) -> EffectLedger:
    """The ledger that lives where the audit sink does. ``new_ledger``: begin an empty one where
    one was created and is gone (the worker's ``--new-ledger``)."""
    if on_postgres(sink):
        return PostgresEffectLedger(sink, new_ledger)
    root = getattr(sink, "root", None) or Path(os.environ.get("TETHER_AUDIT_DIR") or DEFAULT_AUDIT_DIR)
    return SqliteEffectLedger(Path(root) / LEDGER_FILE, new_ledger)


def on_postgres(sink: Any) -> bool:
    """Whether ``sink`` is the PostgreSQL audit sink (its connection, ``db``): the ledger is then a
    table beside it; else a SQLite file beside the JSON-lines sink's folders (``root``)."""
    return isinstance(getattr(sink, "db", None), Postgres)


def local_ledger_id(sink: Any, *, new_ledger: bool = False) -> str | None:
    """The id of the local (SQLite) ledger beside ``sink``, as workers name it to each other in
    their identities (``... ledger=ID``): the same file, the same id, whichever process opens it;
    None for the fleet's PostgreSQL ledger, which every worker of the fleet shares. A local
    ledger serves one queue alone: a second ledger on it would start again what the first did."""
    if on_postgres(sink):
        return None
    ledger = ledger_for(sink, new_ledger=new_ledger)
    assert isinstance(ledger, SqliteEffectLedger)
    try:
        ledger._run(lambda conn: None)  # made (and marked) now if it is not yet: its id never changes
    finally:
        ledger._close()
    try:
        created = json.loads(ledger.marker.read_text()).get("created_at", "")
    except (OSError, ValueError):
        created = ""
    return hashlib.sha256(f"{ledger.path.resolve()}|{created}".encode()).hexdigest()[:12]


async def check_ledger(sink: Any, *, new_ledger: bool = False) -> None:
    """At worker start: raise LedgerUnavailable where the ledger is missing but one was created
    (the worker refuses to start rather than refuse every write). Other errors (a database not
    reachable yet) raise as they are: the caller decides."""
    if on_postgres(sink):
        await PostgresEffectLedger(sink, new_ledger).entries(["-"])  # the sink stays open: the worker's
        return
    ledger = ledger_for(sink, new_ledger=new_ledger)
    try:
        await ledger.entries(["-"])
    finally:
        await ledger.aclose()


# The names of the undo ledger it grew from.
UndoLedger = EffectLedger
SqliteUndoLedger = SqliteEffectLedger
PostgresUndoLedger = PostgresEffectLedger


async def standing_in(ledger: EffectLedger, compensations: list[CompensationCall]) -> list[CompensationCall]:
    """A run's compensations as ``ledger`` says they stand now: done by a compensation run
    (``ok``), or started with the outcome unknown (``unknown``: it may have applied). Read by the
    recovery activity and by a client alike (the ledger knows more than a closed record)."""
    entries = await ledger.entries([c.idempotency_key for c in compensations if c.tool and c.status != "ok"])
    return [call_standing(c, entries.get(c.idempotency_key)) for c in compensations]


def call_standing(call: CompensationCall, entry: LedgerEntry | None) -> CompensationCall:
    """One compensation as the ledger says it stands."""
    if entry is None or entry.state == "released" or call.status == "ok":
        return call
    status = "ok" if entry.state == "done" else "unknown"
    return call.model_copy(update={"status": status, "undone_by": entry.by_workflow, "undone_at": entry.at})
