"""Tests for the example billing service (examples/billing/: service.py and the db, model and routes it serves)."""

from __future__ import annotations

import json
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import closing
from pathlib import Path

import pytest

from examples.billing.service import make_server
from tests.helpers.ports import free_port

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Never route 127.0.0.1 through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Client:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def request(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with _OPENER.open(req, timeout=10) as resp:
                return resp.status, resp.headers, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            with err:
                assert err.headers["Content-Type"] == "application/json"
                return err.code, err.headers, json.loads(err.read())

    def get(self, path: str):
        return self.request("GET", path)

    def post(self, path: str, body=None, headers=None, raw: bytes | None = None):
        return self.request("POST", path, body, headers, raw)

    def refund(self, key: str | None, order_id="A-1001", amount=1000, reason="damaged"):
        headers = {"Idempotency-Key": key} if key else {}
        return self.post(
            "/refunds", {"order_id": order_id, "amount_cents": amount, "reason": reason}, headers
        )


@pytest.fixture
def start_billing(tmp_path):
    servers = []

    def start(delay_ms: int = 0) -> Client:
        server = make_server(0, tmp_path / f"b{len(servers)}.db", delay_ms=delay_ms)
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        thread.start()
        servers.append((server, thread))
        return Client(f"http://127.0.0.1:{server.server_address[1]}")

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def billing(start_billing) -> Client:
    return start_billing()


# -- orders -------------------------------------------------------------------


def test_health_and_unknown_path(billing):
    status, headers, body = billing.get("/health")
    assert (status, body) == (200, {"ok": True})
    assert headers["Content-Type"] == "application/json"
    status, _, body = billing.get("/nope")
    assert status == 404 and body["error"] == "not_found" and body["message"]


def test_seed_order_lookup_and_404(billing):
    status, _, body = billing.get("/orders/A-1002")
    assert status == 200
    assert body == {
        "id": "A-1002",
        "customer_email": "grace@example.com",
        "total_cents": 12000,
        "currency": "EUR",
        "status": "paid",
    }
    status, _, body = billing.get("/orders/A-9999")
    assert status == 404 and body["error"] == "order_not_found"


def test_seeding_is_idempotent(tmp_path):
    db = tmp_path / "again.db"
    make_server(0, db).server_close()
    server = make_server(0, db)  # second start on the same file must not fail or duplicate
    server.server_close()
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 3
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# -- refunds ------------------------------------------------------------------


def test_refund_created_and_replayed(billing):
    status, headers, first = billing.refund("k-1")
    assert status == 201
    assert headers["Idempotent-Replayed"] is None
    assert first["refund_id"].startswith("R-")
    assert {k: first[k] for k in ("order_id", "amount_cents", "reason", "idempotency_key")} == {
        "order_id": "A-1001",
        "amount_cents": 1000,
        "reason": "damaged",
        "idempotency_key": "k-1",
    }
    assert first["created_at"]

    status, headers, again = billing.refund("k-1")
    assert status == 201
    assert headers["Idempotent-Replayed"] == "true"
    assert again == first

    _, _, listing = billing.get("/refunds?order_id=A-1001")
    assert listing["refunds"] == [first]


def test_refund_errors(billing):
    status, _, body = billing.refund(None)
    assert status == 400 and body["error"] == "missing_idempotency_key"

    status, _, body = billing.refund("k-big", order_id="A-1003", amount=900)
    assert status == 422 and body["error"] == "amount_exceeds_total"
    assert billing.refund("k-exact", order_id="A-1003", amount=899)[0] == 201

    status, _, body = billing.refund("k-missing", order_id="A-0000")
    assert status == 404 and body["error"] == "order_not_found"

    for bad in ({"order_id": "A-1001", "amount_cents": 0, "reason": "x"},
                {"order_id": "A-1001", "amount_cents": "5", "reason": "x"},
                {"order_id": "A-1001", "amount_cents": True, "reason": "x"},
                {"amount_cents": 5, "reason": "x"}):
        status, _, body = billing.post("/refunds", bad, {"Idempotency-Key": "k-bad"})
        assert status == 400 and body["error"] == "bad_request", bad
    status, _, body = billing.post("/refunds", raw=b"{not json", headers={"Idempotency-Key": "k"})
    assert status == 400 and body["error"] == "bad_request"

    # Only the exact-total refund was written; failures leave no rows and keys stay free.
    _, _, listing = billing.get("/refunds")
    assert [r["idempotency_key"] for r in listing["refunds"]] == ["k-exact"]


def test_split_refunds_cannot_add_up_past_the_order_total(billing):
    # 4 x 249 = 996 > 899: the fourth refund is refused against what is left, not the total.
    assert [billing.refund(f"s{i}", order_id="A-1003", amount=249)[0] for i in range(3)] == [201] * 3
    status, _, body = billing.refund("s3", order_id="A-1003", amount=249)
    assert status == 422 and body["error"] == "amount_exceeds_refundable"
    assert "152" in body["message"]  # 899 - 747 left
    assert billing.refund("s4", order_id="A-1003", amount=152)[0] == 201
    # A replay of an earlier key still answers with the original refund.
    assert billing.refund("s0", order_id="A-1003", amount=249)[0] == 201


def test_replacing_an_order_starts_it_afresh(billing):
    assert billing.refund("r1", order_id="A-1003", amount=899)[0] == 201
    status, _, _ = billing.request("PUT", "/admin/orders/A-1003", {"customer_email": "l@x", "total_cents": 500})
    assert status == 200
    assert billing.refund("r2", order_id="A-1003", amount=500)[0] == 201
    assert billing.refund("r3", order_id="A-1003", amount=1)[0] == 422


def test_concurrent_same_key_creates_one_row(billing):
    n = 8
    barrier = threading.Barrier(n)
    results = []

    def worker():
        barrier.wait()
        results.append(billing.refund("same-key", amount=250))

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)

    assert len(results) == n
    assert all(status == 201 for status, _, _ in results)
    bodies = {json.dumps(body, sort_keys=True) for _, _, body in results}
    assert len(bodies) == 1
    replayed = [h["Idempotent-Replayed"] for _, h, _ in results]
    assert replayed.count("true") == n - 1
    _, _, listing = billing.get("/refunds?idempotency_key=same-key")
    assert len(listing["refunds"]) == 1


# -- emails -------------------------------------------------------------------


def test_emails_create_a_row_every_time(billing):
    msg = {"to": "ada@example.com", "subject": "Refund", "body": "Done."}
    ids = []
    for _ in range(3):
        status, _, body = billing.post("/emails", msg, {"X-Request-Ref": "call-1"})
        assert status == 201
        assert body["to"] == "ada@example.com" and body["request_ref"] == "call-1"
        ids.append(body["email_id"])
    assert len(set(ids)) == 3 and all(i.startswith("E-") for i in ids)
    billing.post("/emails", {**msg, "to": "grace@example.com"})

    assert len(billing.get("/emails?to=ada@example.com")[2]["emails"]) == 3
    assert len(billing.get("/emails?request_ref=call-1")[2]["emails"]) == 3
    no_ref = billing.get("/emails?to=grace@example.com")[2]["emails"]
    assert len(no_ref) == 1 and no_ref[0]["request_ref"] is None
    assert len(billing.get("/emails")[2]["emails"]) == 4
    assert billing.post("/emails", {"subject": "x", "body": "y"})[0] == 400


# -- ledger -------------------------------------------------------------------


def test_ledger_duplicate_key_and_lookup(billing):
    entry = {"key": "refund:R-1", "order_id": "A-1001", "amount_cents": -1000, "memo": "refund"}
    status, _, body = billing.get("/ledger?key=refund:R-1")
    assert (status, body) == (200, {"entries": []})

    status, _, created = billing.post("/ledger", entry)
    assert status == 201 and created["entry_id"].startswith("L-")
    assert created["key"] == "refund:R-1" and created["amount_cents"] == -1000

    status, _, body = billing.post("/ledger", entry)
    assert status == 409 and body["error"] == "duplicate_key"

    _, _, found = billing.get("/ledger?key=refund:R-1")
    assert found["entries"] == [created]
    assert len(billing.get("/ledger")[2]["entries"]) == 1


# -- undo: voids and reversals -----------------------------------------------


def test_void_refund_is_idempotent_and_frees_the_amount(billing):
    _, _, refund = billing.refund("k-void", amount=4999)  # all of A-1001
    assert refund["voided_at"] is None
    assert billing.refund("k-more", amount=1)[0] == 422  # nothing left to refund
    status, _, voided = billing.post(f"/refunds/{refund['refund_id']}/void", {})
    assert status == 200 and voided["already_voided"] is False and voided["voided_at"]
    # A second void (a retry, a second compensation) changes nothing and says so.
    status, _, again = billing.post(f"/refunds/{refund['refund_id']}/void", {})
    assert status == 200 and again["already_voided"] is True and again["voided_at"] == voided["voided_at"]
    # Voided, the amount is refundable again; the refund row stays (the record of what happened).
    assert billing.refund("k-more", amount=4999)[0] == 201
    assert len(billing.get("/refunds?order_id=A-1001")[2]["refunds"]) == 2
    # Replaying the original key still answers with the original refund, voided.
    _, headers, replay = billing.refund("k-void", amount=4999)
    assert headers["Idempotent-Replayed"] == "true" and replay["voided_at"] == voided["voided_at"]


@pytest.mark.parametrize("refund_id", ["R-999", "R-", "X-1", "R-1x", "R-" + "9" * 30, "..%2F"])
def test_void_of_no_refund_is_404(billing, refund_id):
    status, _, body = billing.post(f"/refunds/{refund_id}/void", {})
    assert status == 404 and body["error"] == "refund_not_found"


def test_concurrent_voids_void_once(billing):
    _, _, refund = billing.refund("k-race", amount=100)
    barrier, results = threading.Barrier(6), []

    def void():
        barrier.wait()
        results.append(billing.post(f"/refunds/{refund['refund_id']}/void", {})[2])

    threads = [threading.Thread(target=void) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert [r["already_voided"] for r in results].count(False) == 1
    assert len({r["voided_at"] for r in results}) == 1


def test_a_ledger_entry_is_reversed_exactly_once(billing):
    _, _, entry = billing.post("/ledger", {"key": "e1", "order_id": "A-1001", "amount_cents": -4999, "memo": "refund"})
    status, _, reversal = billing.post(f"/ledger/{entry['entry_id']}/reverse", {"key": "e1:undo"})
    assert status == 201 and reversal["already_reversed"] is False
    assert (reversal["amount_cents"], reversal["reverses"], reversal["key"]) == (4999, entry["entry_id"], "e1:undo")
    # Again, under any key: the one reversal, not a second.
    for key in ("e1:undo", "other"):
        status, _, again = billing.post(f"/ledger/{entry['entry_id']}/reverse", {"key": key})
        assert status == 200 and again["already_reversed"] is True and again["entry_id"] == reversal["entry_id"]
    assert billing.get(f"/ledger?reverses={entry['entry_id']}")[2]["entries"] == [
        {k: v for k, v in reversal.items() if k != "already_reversed"}
    ]
    # A reversal is not reversed in turn; an unknown entry is 404; the ledger sums to zero.
    assert billing.post(f"/ledger/{reversal['entry_id']}/reverse", {})[2]["error"] == "is_a_reversal"
    assert billing.post("/ledger/L-999/reverse", {})[0] == 404
    entries = billing.get("/ledger")[2]["entries"]
    assert sum(e["amount_cents"] for e in entries) == 0 and len(entries) == 2


def test_a_database_from_before_undo_is_migrated(tmp_path):
    db = tmp_path / "old.db"
    with closing(sqlite3.connect(db)) as conn:
        conn.executescript(
            "CREATE TABLE refunds (seq INTEGER PRIMARY KEY AUTOINCREMENT, order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL,"
            " reason TEXT NOT NULL, idempotency_key TEXT NOT NULL UNIQUE, created_at TEXT NOT NULL);"
            "CREATE TABLE ledger (seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL UNIQUE, order_id TEXT NOT NULL,"
            " amount_cents INTEGER NOT NULL, memo TEXT NOT NULL, created_at TEXT NOT NULL);"
            "INSERT INTO refunds (order_id, amount_cents, reason, idempotency_key, created_at) VALUES ('A-1001', 5, 'r', 'old', 'now');"
        )
    for _ in range(2):  # and a second start changes nothing
        make_server(0, db).server_close()
    with closing(sqlite3.connect(db)) as conn:
        assert {r[1] for r in conn.execute("PRAGMA table_info(refunds)")} >= {"voided_at"}
        assert {r[1] for r in conn.execute("PRAGMA table_info(ledger)")} >= {"reverses"}
        assert conn.execute("SELECT voided_at FROM refunds").fetchone() == (None,)


# -- fault injection and stats ------------------------------------------------


def test_fault_before_writes_nothing(billing):
    status, _, body = billing.post("/admin/faults", {"endpoint": "refunds", "count": 1, "status": 503})
    assert status == 200 and body["pending"] == 1 and body["when"] == "before"

    status, _, body = billing.refund("k-f")
    assert status == 503 and body["error"] == "injected_fault"
    assert billing.get("/refunds")[2]["refunds"] == []

    status, headers, _ = billing.refund("k-f")  # fault consumed: the retry really refunds
    assert status == 201 and headers["Idempotent-Replayed"] is None


def test_fault_after_commit_writes_then_fails(billing):
    billing.post("/admin/faults", {"endpoint": "refunds", "count": 1, "status": 503, "when": "after_commit"})
    status, _, body = billing.refund("k-ac")
    assert status == 503 and body["error"] == "injected_fault"
    rows = billing.get("/refunds?idempotency_key=k-ac")[2]["refunds"]
    assert len(rows) == 1  # the effect happened although the caller saw a failure

    status, headers, body = billing.refund("k-ac")  # a safe retry is answered from the stored row
    assert status == 201 and headers["Idempotent-Replayed"] == "true" and body == rows[0]

    # The unsafe endpoint: an after_commit failure plus a naive retry = two emails.
    billing.post("/admin/faults", {"endpoint": "emails", "count": 1, "when": "after_commit"})
    msg = {"to": "x@example.com", "subject": "s", "body": "b"}
    assert billing.post("/emails", msg)[0] == 503
    assert billing.post("/emails", msg)[0] == 201
    assert len(billing.get("/emails?to=x@example.com")[2]["emails"]) == 2


def test_fault_on_orders_and_clear(billing):
    billing.post("/admin/faults", {"endpoint": "orders", "count": 2, "status": 500})
    assert billing.get("/orders/A-1001")[0] == 500
    status, _, body = billing.request("DELETE", "/admin/faults")
    assert status == 200 and body == {"cleared": 1}
    assert billing.get("/orders/A-1001")[0] == 200

    status, _, body = billing.post("/admin/faults", {"endpoint": "nope", "count": 1})
    assert status == 400 and body["error"] == "bad_request"


def test_stats_count_requests_per_route(billing):
    billing.get("/orders/A-1001")
    billing.get("/orders/A-1002")
    billing.refund("s-1")
    billing.refund("s-1")
    _, _, body = billing.get("/admin/stats")
    counts = body["requests"]
    assert counts["GET /orders/{id}"] == 2
    assert counts["POST /refunds"] == 2
    assert counts["GET /admin/stats"] == 1


# -- delay after commit -------------------------------------------------------


def test_delay_happens_after_commit(start_billing):
    billing = start_billing(delay_ms=1000)
    result = {}

    def slow_post():
        started = time.monotonic()
        result["response"] = billing.refund("k-slow")
        result["elapsed"] = time.monotonic() - started

    poster = threading.Thread(target=slow_post)
    poster.start()

    deadline = time.monotonic() + 0.8
    rows = []
    while not rows and time.monotonic() < deadline:
        rows = billing.get("/refunds?idempotency_key=k-slow")[2]["refunds"]  # reads are not delayed
        if not rows:
            time.sleep(0.02)
    assert len(rows) == 1, "the refund should be committed before the delayed response"
    assert poster.is_alive(), "the POST response should still be pending"

    poster.join(timeout=5)
    status, _, body = result["response"]
    assert status == 201 and body == rows[0]
    assert result["elapsed"] >= 0.95


# -- as a process ---------------------------------------------------------------


def test_cli_runs_and_exits_cleanly_on_sigterm(tmp_path):
    port = free_port()
    db = tmp_path / "nested" / "cli.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.billing.service", "--port", str(port), "--db", str(db)],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        assert ready, "service did not print its listening line"
        line = proc.stdout.readline().strip()
        assert line == f"billing service listening on http://127.0.0.1:{port} (db {db})"
        assert db.exists()

        status, _, body = Client(f"http://127.0.0.1:{port}").get("/health")
        assert (status, body) == (200, {"ok": True})

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
