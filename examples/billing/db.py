"""The billing example service's database: the SQLite schema, the seed orders, the migrations of
older files, the write transaction, and how a stored row is rendered in a response.

The constraints, not application code, keep the promises the service makes (examples/billing/
service.py): one refund per idempotency key, one ledger entry per caller key, one reversal per
entry. Stdlib only.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id             TEXT PRIMARY KEY,
    customer_email TEXT NOT NULL,
    total_cents    INTEGER NOT NULL,
    currency       TEXT NOT NULL DEFAULT 'EUR',
    status         TEXT NOT NULL
);
-- AUTOINCREMENT so public ids (R-<seq>) are never reused after a delete.
CREATE TABLE IF NOT EXISTS refunds (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id        TEXT NOT NULL REFERENCES orders(id),
    amount_cents    INTEGER NOT NULL CHECK (amount_cents > 0),
    reason          TEXT NOT NULL,
    -- The UNIQUE constraint, not application code, is what guarantees that
    -- two concurrent requests with the same key cannot both create a refund.
    idempotency_key TEXT NOT NULL UNIQUE,
    created_at      TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS emails (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    to_addr     TEXT NOT NULL,
    subject     TEXT NOT NULL,
    body        TEXT NOT NULL,
    request_ref TEXT,
    created_at  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    key          TEXT NOT NULL UNIQUE,
    order_id     TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    memo         TEXT NOT NULL,
    created_at   TEXT NOT NULL
);
"""

SEED_ORDERS = (
    ("A-1001", "ada@example.com", 4999, "EUR", "paid"),
    ("A-1002", "grace@example.com", 12000, "EUR", "paid"),
    ("A-1003", "linus@example.com", 899, "EUR", "paid"),
)


# Columns added after the first release, for databases created before them.
MIGRATIONS = (
    ("refunds", "voided_at", "ALTER TABLE refunds ADD COLUMN voided_at TEXT"),
    ("ledger", "reverses", "ALTER TABLE ledger ADD COLUMN reverses TEXT"),
)


def init_db(db_path: str) -> None:
    """Create the schema and seed orders; safe to run on every start."""
    Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(db_path, isolation_level=None)) as conn:
        # WAL lets readers (GET) proceed while a writer holds the write lock,
        # and the setting persists in the database file.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(SCHEMA)
        for table, column, ddl in MIGRATIONS:
            if column not in {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}:
                conn.execute(ddl)
        # The constraint, not application code, makes an entry reversed at most once.
        conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS ledger_reverses ON ledger(reverses)")
        conn.executemany(
            "INSERT OR IGNORE INTO orders (id, customer_email, total_cents, currency, status)"
            " VALUES (?, ?, ?, ?, ?)",
            SEED_ORDERS,
        )


@contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception.

    IMMEDIATE takes the write lock up front (waiting up to the busy timeout),
    so a check-then-insert sequence is serialised. A deferred transaction
    would instead fail with SQLITE_BUSY when it tries to upgrade its read
    snapshot after another writer committed.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------
# Row rendering. Replays re-render the stored row, which is immutable, so a
# replayed refund body is byte-for-byte the body of the original response.
# --------------------------------------------------------------------------


def order_json(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "customer_email": row["customer_email"],
        "total_cents": row["total_cents"],
        "currency": row["currency"],
        "status": row["status"],
    }


def refund_json(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "refund_id": f"R-{row['seq']}",
        "order_id": row["order_id"],
        "amount_cents": row["amount_cents"],
        "reason": row["reason"],
        "idempotency_key": row["idempotency_key"],
        "created_at": row["created_at"],
        "voided_at": row["voided_at"],
    }


def email_json(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "email_id": f"E-{row['seq']}",
        "to": row["to_addr"],
        "subject": row["subject"],
        "body": row["body"],
        "request_ref": row["request_ref"],
        "created_at": row["created_at"],
    }


def ledger_json(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "entry_id": f"L-{row['seq']}",
        "key": row["key"],
        "order_id": row["order_id"],
        "amount_cents": row["amount_cents"],
        "memo": row["memo"],
        "created_at": row["created_at"],
        "reverses": row["reverses"],
    }


def select_where(
    conn: sqlite3.Connection, table: str, filters: dict[str, str | None]
) -> list[sqlite3.Row]:
    """SELECT * with AND-ed equality filters; None values are ignored.

    Table and column names come from our own code, never from the request.
    """
    active = {col: val for col, val in filters.items() if val is not None}
    where = " AND ".join(f"{col} = ?" for col in active)
    sql = f"SELECT * FROM {table}" + (f" WHERE {where}" if where else "") + " ORDER BY seq"
    return conn.execute(sql, tuple(active.values())).fetchall()
