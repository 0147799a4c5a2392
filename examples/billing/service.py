"""A small but real external "billing" system for the example tools.

The example agent tools talk to this service over HTTP, so that side effects
(refunds, emails, ledger entries) live outside the Temporal worker and survive
retries, crashes and replays exactly like a third-party API would. Three write
endpoints deliberately differ in how safe they are to retry:

* ``POST /refunds`` is idempotent via a required ``Idempotency-Key`` header,
  enforced by a UNIQUE constraint in the database;
* ``POST /ledger`` rejects a duplicate caller key with 409, so a caller must
  look up (``GET /ledger?key=...``) before retrying;
* ``POST /emails`` has no protection at all: every call sends another email.

Two endpoints undo what the others did, each at most once:

* ``POST /refunds/{id}/void`` voids a refund (its amount is refundable again); voiding a
  voided refund is a no-op that answers with the refund as it is;
* ``POST /ledger/{id}/reverse`` posts the reversing entry (the negated amount) of an entry;
  an entry is reversed at most once (a UNIQUE index on ``reverses``): reversing it again
  answers with the reversal already posted.

Admin endpoints let tests inject failures (before the write, or after the
write is committed so the caller cannot know the outcome) and count requests.

Stdlib only. Run with::

    python -m examples.billing.service --port 8765 --db .tether/billing.db [--delay-ms N] [--gate-dir DIR]

``--gate-dir`` is for tests that need a write's response held until they say so: a write sent
with ``X-Test-Gate: NAME`` is committed, then answered only once ``DIR/NAME`` exists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import sys
import threading
import time
from collections import Counter, deque
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_PORT = 8765
DEFAULT_DB = ".tether/billing.db"
HOST = "127.0.0.1"

# --------------------------------------------------------------------------
# Database
# --------------------------------------------------------------------------

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
# Shared server state (faults and request counters live in memory)
# --------------------------------------------------------------------------

FAULT_ENDPOINTS = ("refunds", "emails", "ledger", "orders", "voids", "reversals")
FAULT_WHEN = ("before", "after_commit")


@dataclass(frozen=True)
class Fault:
    status: int
    when: str  # "before" | "after_commit"


class BillingState:
    """Per-server state. One SQLite connection per request keeps threads independent."""

    def __init__(self, db_path: str, delay_ms: int, gate_dir: str | None = None) -> None:
        self.db_path = db_path
        self.delay_ms = delay_ms
        self.gate_dir = gate_dir
        self._lock = threading.Lock()
        self._faults: dict[str, deque[Fault]] = {name: deque() for name in FAULT_ENDPOINTS}
        self._requests: Counter[str] = Counter()

    def connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves; single
        # statements outside a transaction are committed when execute() returns.
        conn = sqlite3.connect(self.db_path, timeout=10.0, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    def record_request(self, label: str) -> None:
        with self._lock:
            self._requests[label] += 1

    def request_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._requests.items()))

    def queue_faults(self, endpoint: str, fault: Fault, count: int) -> int:
        with self._lock:
            self._faults[endpoint].extend([fault] * count)
            return len(self._faults[endpoint])

    def take_fault(self, endpoint: str) -> Fault | None:
        with self._lock:
            queue = self._faults[endpoint]
            return queue.popleft() if queue else None

    def clear_faults(self) -> int:
        with self._lock:
            cleared = sum(len(q) for q in self._faults.values())
            for queue in self._faults.values():
                queue.clear()
            return cleared


# --------------------------------------------------------------------------
# Requests, responses, errors
# --------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


class ApiError(Exception):
    """Raised by handlers; rendered as {"error": code, "message": message}."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def to_response(self) -> Response:
        return error_response(self.status, self.code, self.message)


def error_response(status: int, code: str, message: str) -> Response:
    return Response(status, {"error": code, "message": message})


@dataclass
class Request:
    method: str
    path: str
    params: dict[str, str]  # from the route template, e.g. {"id": "A-1001"}
    query: dict[str, str]  # first value of each query parameter
    headers: Any  # http.client.HTTPMessage (case-insensitive .get)
    raw_body: bytes

    def header(self, name: str) -> str | None:
        value = self.headers.get(name) if self.headers is not None else None
        value = value.strip() if value else None
        return value or None

    def json_object(self) -> dict[str, Any]:
        try:
            data = json.loads(self.raw_body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ApiError(400, "bad_request", "request body must be valid JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "bad_request", "request body must be a JSON object")
        return data


def require_str(data: dict[str, Any], name: str, *, allow_empty: bool = False) -> str:
    value = data.get(name)
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        kind = "a string" if allow_empty else "a non-empty string"
        raise ApiError(400, "bad_request", f"field '{name}' must be {kind}")
    return value


def require_int(data: dict[str, Any], name: str, *, minimum: int | None = None) -> int:
    value = data.get(name)
    # bool is a subclass of int in Python; true/false are not amounts.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, "bad_request", f"field '{name}' must be an integer")
    if minimum is not None and value < minimum:
        raise ApiError(400, "bad_request", f"field '{name}' must be >= {minimum}")
    return value


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


# --------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------


def health(state: BillingState, req: Request) -> Response:
    return Response(200, {"ok": True})


def get_order(state: BillingState, req: Request) -> Response:
    order_id = req.params["id"]
    with closing(state.connect()) as conn:
        row = conn.execute("SELECT * FROM orders WHERE id = ?", (order_id,)).fetchone()
    if row is None:
        raise ApiError(404, "order_not_found", f"no order with id '{order_id}'")
    return Response(200, order_json(row))


def _find_refund_by_key(conn: sqlite3.Connection, key: str) -> sqlite3.Row | None:
    return conn.execute("SELECT * FROM refunds WHERE idempotency_key = ?", (key,)).fetchone()


def _replay(row: sqlite3.Row) -> Response:
    return Response(201, refund_json(row), {"Idempotent-Replayed": "true"})


def create_refund(state: BillingState, req: Request) -> Response:
    key = req.header("Idempotency-Key")
    if key is None:
        raise ApiError(400, "missing_idempotency_key", "header 'Idempotency-Key' is required")
    data = req.json_object()
    order_id = require_str(data, "order_id")
    amount = require_int(data, "amount_cents", minimum=1)
    reason = require_str(data, "reason", allow_empty=True)

    with closing(state.connect()) as conn:
        try:
            with write_transaction(conn):
                # A key seen before wins over everything else: the caller is
                # retrying, and must get the original answer, not a new one.
                existing = _find_refund_by_key(conn, key)
                if existing is not None:
                    return _replay(existing)
                order = conn.execute(
                    "SELECT total_cents FROM orders WHERE id = ?", (order_id,)
                ).fetchone()
                if order is None:
                    raise ApiError(404, "order_not_found", f"no order with id '{order_id}'")
                if amount > order["total_cents"]:
                    raise ApiError(
                        422,
                        "amount_exceeds_total",
                        f"amount_cents {amount} exceeds order total {order['total_cents']}",
                    )
                # Against what is left, not the order total: refunds split into small ones
                # must not add up past what the customer paid.
                refunded = conn.execute(
                    "SELECT COALESCE(SUM(amount_cents), 0) FROM refunds WHERE order_id = ? AND voided_at IS NULL",
                    (order_id,),
                ).fetchone()[0]
                if amount > order["total_cents"] - refunded:
                    raise ApiError(
                        422,
                        "amount_exceeds_refundable",
                        f"amount_cents {amount} exceeds the refundable remainder "
                        f"{order['total_cents'] - refunded} (order total {order['total_cents']}, "
                        f"refunded {refunded})",
                    )
                cur = conn.execute(
                    "INSERT INTO refunds (order_id, amount_cents, reason, idempotency_key, created_at)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (order_id, amount, reason, key, utc_now()),
                )
                row = conn.execute("SELECT * FROM refunds WHERE seq = ?", (cur.lastrowid,)).fetchone()
        except sqlite3.IntegrityError:
            # Belt and braces: the write lock above already serialises us, but
            # if the constraint ever fires, the other writer's row is the answer.
            existing = _find_refund_by_key(conn, key)
            if existing is None:
                raise
            return _replay(existing)
    return Response(201, refund_json(row))


def _seq(public_id: str, prefix: str) -> int | None:
    """``R-12`` -> 12 (None for anything else)."""
    head, _, tail = public_id.partition("-")
    return int(tail) if head == prefix and tail.isdigit() and len(tail) < 19 else None


def void_refund(state: BillingState, req: Request) -> Response:
    """Void a refund. Idempotent by the refund itself: a second void changes nothing and
    answers with the refund as voided the first time (``already_voided: true``)."""
    refund_id = req.params["id"]
    seq = _seq(refund_id, "R")
    with closing(state.connect()) as conn, write_transaction(conn):
        row = conn.execute("SELECT * FROM refunds WHERE seq = ?", (seq,)).fetchone() if seq else None
        if row is None:
            raise ApiError(404, "refund_not_found", f"no refund with id '{refund_id}'")
        if row["voided_at"] is not None:
            return Response(200, {**refund_json(row), "already_voided": True})
        conn.execute("UPDATE refunds SET voided_at = ? WHERE seq = ?", (utc_now(), seq))
        row = conn.execute("SELECT * FROM refunds WHERE seq = ?", (seq,)).fetchone()
    return Response(200, {**refund_json(row), "already_voided": False})


def list_refunds(state: BillingState, req: Request) -> Response:
    filters = {
        "order_id": req.query.get("order_id"),
        "idempotency_key": req.query.get("idempotency_key"),
    }
    with closing(state.connect()) as conn:
        rows = select_where(conn, "refunds", filters)
    return Response(200, {"refunds": [refund_json(r) for r in rows]})


def create_email(state: BillingState, req: Request) -> Response:
    # Intentionally no idempotency: this is the example of an unsafe side effect.
    data = req.json_object()
    to = require_str(data, "to")
    subject = require_str(data, "subject", allow_empty=True)
    body = require_str(data, "body", allow_empty=True)
    request_ref = req.header("X-Request-Ref")
    with closing(state.connect()) as conn:
        cur = conn.execute(
            "INSERT INTO emails (to_addr, subject, body, request_ref, created_at)"
            " VALUES (?, ?, ?, ?, ?)",
            (to, subject, body, request_ref, utc_now()),
        )
        row = conn.execute("SELECT * FROM emails WHERE seq = ?", (cur.lastrowid,)).fetchone()
    return Response(201, email_json(row))


def list_emails(state: BillingState, req: Request) -> Response:
    filters = {"to_addr": req.query.get("to"), "request_ref": req.query.get("request_ref")}
    with closing(state.connect()) as conn:
        rows = select_where(conn, "emails", filters)
    return Response(200, {"emails": [email_json(r) for r in rows]})


def create_ledger_entry(state: BillingState, req: Request) -> Response:
    data = req.json_object()
    key = require_str(data, "key")
    order_id = require_str(data, "order_id")
    amount = require_int(data, "amount_cents")
    memo = require_str(data, "memo", allow_empty=True)
    with closing(state.connect()) as conn:
        try:
            cur = conn.execute(
                "INSERT INTO ledger (key, order_id, amount_cents, memo, created_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (key, order_id, amount, memo, utc_now()),
            )
        except sqlite3.IntegrityError:
            # Not idempotent on purpose: a retrying caller must look up first.
            raise ApiError(409, "duplicate_key", f"a ledger entry with key '{key}' already exists") from None
        row = conn.execute("SELECT * FROM ledger WHERE seq = ?", (cur.lastrowid,)).fetchone()
    return Response(201, ledger_json(row))


def reverse_ledger_entry(state: BillingState, req: Request) -> Response:
    """Post the reversing entry of a ledger entry (the negated amount), at most once per entry:
    reversing it again answers with the reversal already posted (200, ``already_reversed``)."""
    entry_id = req.params["id"]
    seq = _seq(entry_id, "L")
    data = req.json_object() if req.raw_body else {}
    key = data.get("key") or f"reversal:{entry_id}"
    if not isinstance(key, str):
        raise ApiError(400, "bad_request", "field 'key' must be a string")
    with closing(state.connect()) as conn, write_transaction(conn):
        row = conn.execute("SELECT * FROM ledger WHERE seq = ?", (seq,)).fetchone() if seq else None
        if row is None:
            raise ApiError(404, "entry_not_found", f"no ledger entry with id '{entry_id}'")
        if row["reverses"] is not None:
            raise ApiError(422, "is_a_reversal", f"{entry_id} is itself a reversal of {row['reverses']}")
        done = conn.execute("SELECT * FROM ledger WHERE reverses = ?", (entry_id,)).fetchone()
        if done is not None:
            return Response(200, {**ledger_json(done), "already_reversed": True})
        try:
            cur = conn.execute(
                "INSERT INTO ledger (key, order_id, amount_cents, memo, created_at, reverses)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (key, row["order_id"], -row["amount_cents"], f"reversal of {entry_id}", utc_now(), entry_id),
            )
        except sqlite3.IntegrityError:
            raise ApiError(409, "duplicate_key", f"a ledger entry with key '{key}' already exists") from None
        done = conn.execute("SELECT * FROM ledger WHERE seq = ?", (cur.lastrowid,)).fetchone()
    return Response(201, {**ledger_json(done), "already_reversed": False})


def list_ledger(state: BillingState, req: Request) -> Response:
    with closing(state.connect()) as conn:
        rows = select_where(conn, "ledger", {"key": req.query.get("key"), "reverses": req.query.get("reverses")})
    return Response(200, {"entries": [ledger_json(r) for r in rows]})


def queue_faults(state: BillingState, req: Request) -> Response:
    data = req.json_object()
    endpoint = data.get("endpoint")
    if endpoint not in FAULT_ENDPOINTS:
        raise ApiError(400, "bad_request", f"field 'endpoint' must be one of {list(FAULT_ENDPOINTS)}")
    count = require_int(data, "count", minimum=1)
    status = require_int(data, "status") if "status" in data else 503
    if not 400 <= status <= 599:
        raise ApiError(400, "bad_request", "field 'status' must be an HTTP error status (400-599)")
    when = data.get("when", "before")
    if when not in FAULT_WHEN:
        raise ApiError(400, "bad_request", f"field 'when' must be one of {list(FAULT_WHEN)}")
    pending = state.queue_faults(endpoint, Fault(status, when), count)
    return Response(
        200, {"endpoint": endpoint, "count": count, "status": status, "when": when, "pending": pending}
    )


def clear_faults(state: BillingState, req: Request) -> Response:
    return Response(200, {"cleared": state.clear_faults()})


def put_order(state: BillingState, req: Request) -> Response:
    """Create or replace an order (tests and demos that need a fresh refundable amount)."""
    data = req.json_object()
    order_id = req.params["id"]
    email = require_str(data, "customer_email")
    total = require_int(data, "total_cents", minimum=1)
    currency = data.get("currency", "EUR")
    with closing(state.connect()) as conn, write_transaction(conn):
        conn.execute(
            "INSERT OR REPLACE INTO orders (id, customer_email, total_cents, currency, status)"
            " VALUES (?, ?, ?, ?, 'paid')",
            (order_id, email, total, currency),
        )
        # A replaced order starts with nothing refunded.
        conn.execute("DELETE FROM refunds WHERE order_id = ?", (order_id,))
    return Response(200, {"order_id": order_id, "total_cents": total})


def get_stats(state: BillingState, req: Request) -> Response:
    return Response(200, {"requests": state.request_counts()})


# --------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------

Handler = Callable[[BillingState, Request], Response]


@dataclass(frozen=True)
class Route:
    method: str
    template: str  # "/orders/{id}"; also the stats label after the method
    handler: Handler
    fault_endpoint: str | None = None  # which fault queue applies to this route
    is_write: bool = False  # business write: subject to --delay-ms

    @property
    def pattern(self) -> re.Pattern[str]:
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.template)
        return re.compile(f"^{regex}$")

    @property
    def label(self) -> str:
        return f"{self.method} {self.template}"


ROUTES: tuple[Route, ...] = (
    Route("GET", "/health", health),
    Route("GET", "/orders/{id}", get_order, fault_endpoint="orders"),
    Route("POST", "/refunds", create_refund, fault_endpoint="refunds", is_write=True),
    Route("GET", "/refunds", list_refunds),
    Route("POST", "/refunds/{id}/void", void_refund, fault_endpoint="voids", is_write=True),
    Route("POST", "/emails", create_email, fault_endpoint="emails", is_write=True),
    Route("GET", "/emails", list_emails),
    Route("POST", "/ledger", create_ledger_entry, fault_endpoint="ledger", is_write=True),
    Route("GET", "/ledger", list_ledger),
    Route("POST", "/ledger/{id}/reverse", reverse_ledger_entry, fault_endpoint="reversals", is_write=True),
    Route("PUT", "/admin/orders/{id}", put_order),
    Route("POST", "/admin/faults", queue_faults),
    Route("DELETE", "/admin/faults", clear_faults),
    Route("GET", "/admin/stats", get_stats),
)
_COMPILED = tuple((route, route.pattern) for route in ROUTES)


@dataclass
class Outcome:
    response: Response
    wrote: bool  # a business write ran (and committed, if it succeeded)


def _match(method: str, path: str) -> tuple[Route | None, dict[str, str], bool]:
    """Return (route, params, path_known). path_known distinguishes 405 from 404."""
    path_known = False
    for route, pattern in _COMPILED:
        m = pattern.match(path)
        if m is None:
            continue
        path_known = True
        if route.method == method:
            return route, {k: unquote(v) for k, v in m.groupdict().items()}, True
    return None, {}, path_known


def _stats_label(method: str, path: str) -> str:
    for route, pattern in _COMPILED:
        if pattern.match(path):
            return f"{method} {route.template}"
    return f"{method} (unmatched)"


def _injected(fault: Fault, endpoint: str) -> Response:
    return error_response(
        fault.status, "injected_fault", f"injected {fault.status} ({fault.when}) for {endpoint}"
    )


def dispatch(state: BillingState, method: str, target: str, headers: Any, raw_body: bytes) -> Outcome:
    """Route one request, applying any queued fault. Pure of HTTP plumbing."""
    split = urlsplit(target)
    path = split.path
    state.record_request(_stats_label(method, path))

    route, params, path_known = _match(method, path)
    if route is None:
        if path_known:
            return Outcome(error_response(405, "method_not_allowed", f"{method} not allowed on {path}"), False)
        return Outcome(error_response(404, "not_found", f"no route for {method} {path}"), False)

    fault = state.take_fault(route.fault_endpoint) if route.fault_endpoint else None
    if fault is not None and fault.when == "before":
        return Outcome(_injected(fault, route.fault_endpoint), False)

    query = {k: v[0] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
    req = Request(method, path, params, query, headers, raw_body)
    try:
        response = route.handler(state, req)
    except ApiError as err:
        response = err.to_response()

    if fault is not None:  # after_commit: the effect stands, the caller sees a failure
        response = _injected(fault, route.fault_endpoint)
    return Outcome(response, route.is_write)


# --------------------------------------------------------------------------
# HTTP plumbing
# --------------------------------------------------------------------------


GATE_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")
GATE_MAX_SECONDS = 120.0


class BillingServer(ThreadingHTTPServer):
    daemon_threads = True  # never let a slow (delayed) request block shutdown

    def __init__(self, address: tuple[str, int], state: BillingState) -> None:
        self.state = state
        super().__init__(address, BillingRequestHandler)


class BillingRequestHandler(BaseHTTPRequestHandler):
    server: BillingServer
    server_version = "TetherBilling/0.1"

    def do_GET(self) -> None:
        self._handle()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def _read_body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0  # treated as an empty body -> 400 on endpoints that need JSON
        return self.rfile.read(length) if length > 0 else b""

    def _handle(self) -> None:
        state = self.server.state
        try:
            outcome = dispatch(state, self.command, self.path, self.headers, self._read_body())
        except Exception as exc:  # a bug, not a client error: still answer in JSON
            outcome = Outcome(error_response(500, "internal_error", f"{type(exc).__name__}: {exc}"), False)
        if outcome.wrote and state.delay_ms > 0:
            # The write is already committed; sleeping now simulates a slow
            # network where the effect happened but the answer is late.
            time.sleep(state.delay_ms / 1000.0)
        gate = self.headers.get("X-Test-Gate")
        if outcome.wrote and gate and state.gate_dir:
            self._hold(Path(state.gate_dir), gate)
        self._send(outcome.response)

    def _hold(self, folder: Path, gate: str) -> None:
        # A test's gate: the write is committed, its answer waits for the file (or GATE_MAX_SECONDS).
        if not GATE_NAME.fullmatch(gate) or ".." in gate:
            return
        deadline = time.monotonic() + GATE_MAX_SECONDS
        while not (folder / gate).exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    def _send(self, response: Response) -> None:
        payload = json.dumps(response.body).encode("utf-8")
        self.send_response(response.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"billing: {self.command} {self.path} {format % args}\n")

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        # One compact line per request on stderr; stdout is reserved for the
        # single "listening" line that launchers wait for.
        sys.stderr.write(f"billing: {self.command} {self.path} -> {code}\n")


def make_server(
    port: int, db_path: str | os.PathLike[str], delay_ms: int = 0, gate_dir: str | None = None
) -> ThreadingHTTPServer:
    """Initialise the database and bind (not yet serve) on 127.0.0.1:port.

    port=0 picks a free port; read it back from ``server.server_address``.
    Call ``serve_forever()`` (e.g. in a thread), then ``shutdown()`` and
    ``server_close()``.
    """
    db = os.fspath(db_path)
    init_db(db)
    return BillingServer((HOST, port), BillingState(db, max(0, int(delay_ms)), gate_dir))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Example billing service (HTTP + SQLite).")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--db", default=DEFAULT_DB, help=f"SQLite file (default {DEFAULT_DB})")
    parser.add_argument(
        "--delay-ms", type=int, default=0, help="sleep this long after committing each write, before responding"
    )
    parser.add_argument(
        "--gate-dir", help="tests: a write sent with X-Test-Gate: NAME is answered once DIR/NAME exists"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = make_server(args.port, args.db, args.delay_ms, args.gate_dir)
    host, port = server.server_address[:2]

    def request_stop(signum: int, frame: Any) -> None:
        # shutdown() blocks until serve_forever() returns, so it must run on
        # another thread than the one serving (this one).
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    print(f"billing service listening on http://{host}:{port} (db {args.db})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
