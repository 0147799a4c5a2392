"""The billing example service's model of a request: the server's in-memory state (injected
faults, request counters), a request, a response, an API error and the checks of a JSON body.
Stdlib only.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

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
