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

The parts: the database (examples/billing/db.py), a request's model and the server's in-memory
state (examples/billing/model.py), the routes (examples/billing/routes.py); here, the HTTP
plumbing and the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from examples.billing.db import init_db
from examples.billing.model import BillingState, Response, error_response
from examples.billing.routes import Outcome, dispatch

DEFAULT_PORT = 8765
DEFAULT_DB = ".tether/billing.db"
HOST = "127.0.0.1"

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
