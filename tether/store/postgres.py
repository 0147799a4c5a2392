"""The one PostgreSQL keeper of the audit sink (``tether_audit``), the effect ledger beside it
(``tether_undo_ledger``) and the judgement log (``tether_judgements``), all in the database that
``TETHER_AUDIT_DSN`` names.

It owns what the three share: reading and checking the DSN (and redacting its password for a
person), connecting (one connection per process and store, reconnected after any error, a
``CONNECT_TIMEOUT`` to reach the server), creating a store's tables idempotently (under an
advisory lock, ``LOCK``: several workers may start at once; the effect ledger creates its own
under the same lock, once it has checked that no ledger was lost: tether/store/effect_ledger.py),
and mapping the driver's errors to :class:`PostgresUnavailable`, one line that names the error
without the DSN's secrets.

``Postgres`` is the asynchronous connection (the sink and the ledger share one per worker, their
statements one at a time); ``PostgresSync`` the blocking one (the judgement log, written from a
thread and read by the CLI).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

DSN_ENV = "TETHER_AUDIT_DSN"
# Seconds to reach the server: an outage must fail the write (the run retries it), not hang it.
CONNECT_TIMEOUT = 5
# Several workers may create a table at once: one at a time, per table name.
LOCK = "SELECT pg_advisory_xact_lock(hashtext(%s))"
# A table that exists and is owned by a role this one is not (the production stack's
# ``tether_owner``, tether/store/db_roles.py): its DDL is the owner's, never run by a service.
OWNED_ELSEWHERE = "SELECT NOT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = to_regclass(%s)"
SETUP_HINT = "create it as its owner (python -m tether.store.db_roles setup; docs/production.md)"
CAUSE_CHARS = 300

T = TypeVar("T")


class PostgresUnavailable(Exception):
    """The database could not be reached, or refused a statement: one line naming the driver's
    error (never the DSN's password); the original error is its ``__cause__``."""


def redact_dsn(dsn: str) -> str:
    """A DSN for a log line or a run's error: the password replaced by ***."""
    try:
        parts = urlsplit(dsn)
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
            return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "postgresql://(unparsable DSN)"
    return re.sub(r"password=\S+", "password=***", dsn)


def dsn_from_env(audit_dir: str | None = None, dsn: str | None = None) -> str | None:
    """The database the stores use: ``dsn``, else ``TETHER_AUDIT_DSN`` unless an explicit
    ``audit_dir`` picks the JSON-lines files; None: no database. Raises ValueError for a DSN
    that is no ``postgresql://`` URL."""
    dsn = dsn or (None if audit_dir else os.environ.get(DSN_ENV))
    if dsn and not dsn.startswith(("postgresql://", "postgres://")):
        raise ValueError(f"{DSN_ENV} must be a postgresql:// URL, not {redact_dsn(dsn)!r}")
    return dsn or None


def cause(err: BaseException) -> str:
    """An error as one bounded line for a log or a run's error: its type and message."""
    text = str(err) if isinstance(err, PostgresUnavailable) else f"{type(err).__name__}: {err}"
    return " ".join(text.split())[:CAUSE_CHARS]


def _mapped(err: Exception) -> Exception:
    """A driver error as :class:`PostgresUnavailable`; anything else (a store's own error) as it is."""
    import psycopg

    if isinstance(err, psycopg.Error):
        return PostgresUnavailable(cause(err))
    return err


def _refused(err: Exception, table: Table) -> PostgresUnavailable | None:
    """A role that may not create a missing table: what to do about it (else None)."""
    import psycopg

    if isinstance(err, psycopg.errors.InsufficientPrivilege):
        return PostgresUnavailable(f"table {table.name} is missing and this role may not create it: {SETUP_HINT} ({cause(err)})")
    return None


async def _create(statement: Awaitable[Any], table: Table) -> None:
    try:
        await statement
    except Exception as e:
        refused = _refused(e, table)
        if refused is None:
            raise
        raise refused from e


def _created(statement: Callable[[], Any], table: Table) -> None:
    try:
        statement()
    except Exception as e:
        refused = _refused(e, table)
        if refused is None:
            raise
        raise refused from e


@dataclass(frozen=True)
class Table:
    """A table a store keeps: its name (the lock's key) and its idempotent DDL (``CREATE ... IF
    NOT EXISTS``, ``CREATE OR REPLACE``), run once per connection, before any statement of it."""

    name: str
    schema: str


@dataclass
class Postgres:
    """One asynchronous connection to ``dsn``, opened on first use with ``tables`` created, its
    statements one at a time; closed and opened again after any error."""

    dsn: str
    tables: Sequence[Table] = ()
    _conn: Any = field(default=None, repr=False)
    _lock: asyncio.Lock | None = field(default=None, repr=False)

    def describe(self) -> str:
        return f"PostgreSQL {redact_dsn(self.dsn)}"

    async def _connection(self) -> Any:
        import psycopg

        if self._conn is not None and not self._conn.closed:
            return self._conn
        conn = await psycopg.AsyncConnection.connect(self.dsn, connect_timeout=CONNECT_TIMEOUT)
        try:
            for table in self.tables:
                async with conn.transaction():
                    await conn.execute(LOCK, (table.name,))
                    row = await (await conn.execute(OWNED_ELSEWHERE, (table.name,))).fetchone()
                    if not (row and row[0]):
                        await _create(conn.execute(table.schema), table)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn
        return conn

    async def run(self, work: Callable[[Any], Awaitable[T]]) -> T:
        """``work(conn)`` on the one connection. Driver errors raise :class:`PostgresUnavailable`."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            try:
                return await work(await self._connection())
            except Exception as e:
                await self.aclose()
                mapped = _mapped(e)
                if mapped is e:
                    raise
                raise mapped from e

    async def aclose(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


@dataclass
class PostgresSync:
    """:class:`Postgres` for blocking callers (threads, the CLI): one connection per process."""

    dsn: str
    tables: Sequence[Table] = ()
    _conn: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def describe(self) -> str:
        return f"PostgreSQL {redact_dsn(self.dsn)}"

    def _connection(self) -> Any:
        import psycopg

        if self._conn is not None and not self._conn.closed:
            return self._conn
        conn = psycopg.connect(self.dsn, connect_timeout=CONNECT_TIMEOUT)
        try:
            for table in self.tables:
                with conn.transaction():
                    conn.execute(LOCK, (table.name,))
                    row = conn.execute(OWNED_ELSEWHERE, (table.name,)).fetchone()
                    if not (row and row[0]):
                        _created(lambda: conn.execute(table.schema), table)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def run(self, work: Callable[[Any], T]) -> T:
        """``work(conn)`` on the one connection. Driver errors raise :class:`PostgresUnavailable`."""
        with self._lock:
            try:
                return work(self._connection())
            except Exception as e:
                self._close()
                mapped = _mapped(e)
                if mapped is e:
                    raise
                raise mapped from e

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._close()
