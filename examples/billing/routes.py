"""The billing example service's routes: a handler per endpoint, the route table, and the one
dispatch that applies an injected fault before or after a handler's write. Pure of HTTP plumbing
(examples/billing/service.py serves them). Stdlib only.
"""

from __future__ import annotations

import re
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from examples.billing.db import (
    email_json,
    ledger_json,
    order_json,
    refund_json,
    select_where,
    utc_now,
    write_transaction,
)
from examples.billing.model import (
    FAULT_ENDPOINTS,
    FAULT_WHEN,
    ApiError,
    BillingState,
    Fault,
    Request,
    Response,
    error_response,
    require_int,
    require_str,
)

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
