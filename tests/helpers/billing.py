"""The billing example service over HTTP, as a test drives it: reads, writes, injected faults and
the refunds it recorded (the ``billing`` fixture in tests/conftest.py serves one per session)."""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any



@dataclass
class Billing:
    url: str
    db: Path

    def get(self, path: str) -> Any:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> Any:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with opener.open(req, timeout=30) as r:
            return json.loads(r.read())

    def put(self, path: str, body: dict) -> Any:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="PUT", headers={"Content-Type": "application/json"}
        )
        with opener.open(req, timeout=30) as r:
            return json.loads(r.read())

    def fail_next(self, endpoint: str, count: int, status: int = 503, when: str = "before") -> None:
        self.post("/admin/faults", {"endpoint": endpoint, "count": count, "status": status, "when": when})

    def refunds(self, key: str | None = None) -> list[dict]:
        return self.get("/refunds" + (f"?idempotency_key={key}" if key else ""))["refunds"]


def counts_in_db(billing: Billing, key_prefix: str) -> dict[str, int]:
    """Refunds, ledger entries and emails whose key starts with ``key_prefix``, read from the
    billing service's own database (not its API)."""
    with sqlite3.connect(billing.db) as db:
        like = key_prefix.replace("%", r"\%").replace("_", r"\_") + "%"
        return {
            "refunds": db.execute(r"SELECT count(*) FROM refunds WHERE idempotency_key LIKE ? ESCAPE '\'", (like,)).fetchone()[0],
            "ledger": db.execute(r"SELECT count(*) FROM ledger WHERE key LIKE ? ESCAPE '\'", (like,)).fetchone()[0],
            "emails": db.execute(r"SELECT count(*) FROM emails WHERE request_ref LIKE ? ESCAPE '\'", (like,)).fetchone()[0],
        }


def emails_to(billing: Billing, to: str) -> list[dict]:
    return billing.get(f"/emails?to={to}")["emails"]
