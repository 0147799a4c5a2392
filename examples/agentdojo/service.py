"""The tool-side service of the AgentDojo example: each run's environment, in SQLite, keyed by run.

AgentDojo's functions act on an in-memory environment object. Here that environment lives in a
service of its own, as a third-party system would: the driver stores the environment AgentDojo's
runner loaded from the suite's files (``PUT /runs/{run}``), every Tether tool call applies one
function to it (``POST /runs/{run}/calls``), and the driver reads the environment back for
AgentDojo's checks (``GET /runs/{run}/environment``). A call and the environment it leaves are
committed in one SQLite transaction, so a worker killed mid-call finds either nothing or the call
done, never half of it.

Repeats are answered as the catalog's effect says (examples/agentdojo/catalog.py):

- a write declared ``idempotent``: a repeated ``Idempotency-Key`` gets the first call's answer,
  and nothing is applied again;
- a write declared ``reconcilable``: a repeated key is refused (409 ``duplicate_key``); the
  caller looks the first call up (``GET /runs/{run}/calls?key=K``);
- a read: applied again (it changes nothing), its journal row replaced.

``GET /runs/{run}/calls`` lists the journal in order: what ran, what it returned, what it wrote;
``GET /runs/{run}`` says which suite the run's world is (the pipeline planner's tools).

Stdlib plus AgentDojo. Run with::

    python -m examples.agentdojo.service --port 8766 --db .tether/agentdojo.db
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
from contextlib import closing
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from examples.agentdojo.catalog import dump_environment, effect_of, functions, load_environment, suites

DEFAULT_PORT = 8766
HOST = "127.0.0.1"
MAX_BODY = 8 * 1024 * 1024

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run          TEXT PRIMARY KEY,
    suite        TEXT NOT NULL,
    environment  TEXT NOT NULL,
    version      INTEGER NOT NULL DEFAULT 0,
    created_at   TEXT NOT NULL
);
-- One row per call key: the UNIQUE constraint, not application code, is what keeps a write from
-- being applied twice under one key.
CREATE TABLE IF NOT EXISTS calls (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    run        TEXT NOT NULL REFERENCES runs(run),
    key        TEXT NOT NULL,
    function   TEXT NOT NULL,
    args       TEXT NOT NULL,
    output     TEXT NOT NULL,
    error      TEXT,
    created_id TEXT,
    wrote      INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    UNIQUE (run, key)
);
"""


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _call_json(row: sqlite3.Row) -> dict[str, Any]:
    found: dict[str, Any] = {
        "seq": row["seq"], "key": row["key"], "function": row["function"], "args": json.loads(row["args"]),
        "output": row["output"], "wrote": bool(row["wrote"]),
    }
    if row["error"] is not None:
        found["error"] = row["error"]
    if row["created_id"] is not None:
        found["id"] = row["created_id"]
    return found


class Worlds:
    """The runs' environments: SQLite is the record; the last environment object of each run is
    kept in memory while its version in the database matches (parsing a workspace environment
    costs more than the call). One lock: a call reads, applies and commits alone."""

    def __init__(self, db: str) -> None:
        self.db = db
        self.lock = threading.Lock()
        self.cache: dict[str, tuple[int, Any]] = {}
        with closing(self.connect()) as conn:
            conn.executescript(SCHEMA)

    def connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db, timeout=30, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _run(self, conn: sqlite3.Connection, run: str) -> sqlite3.Row:
        row = conn.execute("SELECT * FROM runs WHERE run = ?", (run,)).fetchone()
        if row is None:
            raise ApiError(404, "run_not_found", f"no environment for run '{run}'")
        return row

    def _environment(self, row: sqlite3.Row) -> Any:
        held = self.cache.get(row["run"])
        if held is not None and held[0] == row["version"]:
            return held[1]
        return load_environment(row["suite"], row["environment"])

    def put(self, run: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        suite_name = body.get("suite")
        if suite_name not in suites():
            raise ApiError(400, "unknown_suite", f"suite must be one of {sorted(suites())}")
        environment = body.get("environment")
        if not isinstance(environment, dict):
            raise ApiError(400, "bad_environment", "environment must be a JSON object")
        try:
            env = load_environment(suite_name, environment)
        except ValueError as e:
            raise ApiError(400, "bad_environment", f"not a {suite_name} environment: {e}") from None
        text = dump_environment(env)
        with self.lock, closing(self.connect()) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute("SELECT * FROM runs WHERE run = ?", (run,)).fetchone()
                if row is not None:
                    if row["suite"] == suite_name and row["environment"] == text and row["version"] == 0:
                        conn.execute("COMMIT")
                        return 200, {"run": run, "suite": suite_name, "created": False}
                    raise ApiError(409, "run_exists", f"run '{run}' already has an environment")
                conn.execute("INSERT INTO runs (run, suite, environment, version, created_at) VALUES (?, ?, ?, 0, ?)",
                             (run, suite_name, text, _now()))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        self.cache[run] = (0, env)
        return 201, {"run": run, "suite": suite_name, "created": True}

    def run(self, run: str) -> dict[str, Any]:
        """Which suite a run's world is, without the world (a planner offers the suite's tools)."""
        with closing(self.connect()) as conn:
            row = self._run(conn, run)
        return {"run": run, "suite": row["suite"], "version": row["version"]}

    def environment(self, run: str) -> dict[str, Any]:
        with closing(self.connect()) as conn:
            row = self._run(conn, run)
        return {"run": run, "suite": row["suite"], "version": row["version"],
                "environment": json.loads(row["environment"])}

    def calls(self, run: str, key: str | None) -> dict[str, Any]:
        with closing(self.connect()) as conn:
            self._run(conn, run)
            if key is None:
                rows = conn.execute("SELECT * FROM calls WHERE run = ? ORDER BY seq", (run,)).fetchall()
            else:
                rows = conn.execute("SELECT * FROM calls WHERE run = ? AND key = ?", (run, key)).fetchall()
        return {"calls": [_call_json(r) for r in rows]}

    def call(self, run: str, key: str | None, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        from agentdojo.agent_pipeline.tool_execution import tool_result_to_str
        from agentdojo.functions_runtime import FunctionsRuntime

        if not key or len(key) > 512:
            raise ApiError(400, "missing_key", "an Idempotency-Key header (at most 512 characters) is required")
        name, args = body.get("function"), body.get("args")
        if not isinstance(name, str) or not isinstance(args, dict):
            raise ApiError(400, "bad_call", "body must be {function: str, args: object}")
        with self.lock, closing(self.connect()) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._run(conn, run)
                suite = suites()[row["suite"]]
                if name not in {f.name for f in suite.tools}:
                    raise ApiError(404, "unknown_function", f"the {row['suite']} suite has no function '{name}'")
                effect = effect_of(name)
                seen = conn.execute("SELECT * FROM calls WHERE run = ? AND key = ?", (run, key)).fetchone()
                if seen is not None and effect == "idempotent":
                    conn.execute("COMMIT")
                    return 200, {**_call_json(seen), "replayed": True}
                if seen is not None and effect == "reconcilable":
                    raise ApiError(409, "duplicate_key", f"a call with key '{key}' was already applied: look it up")
                env = self._environment(row)
                before = dump_environment(env)
                runtime = FunctionsRuntime(suite.tools)
                result, error = runtime.run_function(env, name, args, raise_on_error=False)
                after = dump_environment(env)
                wrote = after != before
                created = getattr(result, "id_", None)
                output = tool_result_to_str(result) if error is None else ""
                version = row["version"] + (1 if wrote else 0)
                if wrote:
                    conn.execute("UPDATE runs SET environment = ?, version = ? WHERE run = ?", (after, version, run))
                conn.execute("DELETE FROM calls WHERE run = ? AND key = ?", (run, key))  # a read's repeat
                conn.execute(
                    "INSERT INTO calls (run, key, function, args, output, error, created_id, wrote, created_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (run, key, name, json.dumps(args, sort_keys=True), output, error,
                     None if created is None else str(created), int(wrote), _now()),
                )
                new = conn.execute("SELECT * FROM calls WHERE run = ? AND key = ?", (run, key)).fetchone()
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                self.cache.pop(run, None)  # the object may hold a change the database does not
                raise
        self.cache[run] = (version, env)
        return 201, _call_json(new)


_RUN = r"/runs/(?P<run>[^/]+)"


def dispatch(worlds: Worlds, method: str, path: str, headers: Any, raw: bytes) -> tuple[int, dict[str, Any]]:
    parts = urlsplit(path)
    query = parse_qs(parts.query)
    body: dict[str, Any] = {}
    if method in ("PUT", "POST"):
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise ApiError(400, "bad_json", f"body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "bad_json", "body must be a JSON object")
    if method == "GET" and parts.path == "/health":
        return 200, {"ok": True}
    if m := re.fullmatch(_RUN, parts.path):
        if method == "PUT":
            return worlds.put(unquote(m["run"]), body)
        if method == "GET":
            return 200, worlds.run(unquote(m["run"]))
    elif m := re.fullmatch(_RUN + "/environment", parts.path):
        if method == "GET":
            return 200, worlds.environment(unquote(m["run"]))
    elif m := re.fullmatch(_RUN + "/calls", parts.path):
        if method == "GET":
            return 200, worlds.calls(unquote(m["run"]), (query.get("key") or [None])[0])
        if method == "POST":
            return worlds.call(unquote(m["run"]), headers.get("Idempotency-Key"), body)
    else:
        raise ApiError(404, "not_found", f"no route {parts.path}")
    raise ApiError(405, "method_not_allowed", f"{method} {parts.path}")


class WorldServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], worlds: Worlds) -> None:
        self.worlds = worlds
        super().__init__(address, Handler)


class Handler(BaseHTTPRequestHandler):
    server: WorldServer
    server_version = "TetherAgentDojo/0.1"

    def do_GET(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0
        try:
            if length > MAX_BODY:
                raise ApiError(413, "too_large", f"bodies are at most {MAX_BODY} bytes")
            raw = self.rfile.read(length) if length > 0 else b""
            status, body = dispatch(self.server.worlds, self.command, self.path, self.headers, raw)
        except ApiError as e:
            status, body = e.status, {"error": e.code, "message": str(e)}
        except Exception as e:  # a bug, not a client error: still answer in JSON
            status, body = 500, {"error": "internal_error", "message": f"{type(e).__name__}: {e}"}
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_POST = do_PUT = do_GET

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the journal is the record
        pass


def make_server(port: int, db_path: str | os.PathLike[str]) -> WorldServer:
    """Create the database and bind (not yet serve) on 127.0.0.1:port (0: a free port)."""
    suites()  # load AgentDojo before the first request, not during it
    functions()
    return WorldServer((HOST, port), Worlds(os.fspath(db_path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="AgentDojo environments service (HTTP + SQLite).")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--db", default=".tether/agentdojo.db")
    args = parser.parse_args(argv)
    server = make_server(args.port, args.db)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = server.server_address[:2]
    print(f"agentdojo service listening on http://{host}:{port} (db {args.db})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
