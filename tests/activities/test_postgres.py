"""The one PostgreSQL keeper (tether/store/postgres.py) under the audit sink, the effect ledger and
the judgement log, against a real server: tables made once however many workers start at once,
an outage and a bad statement as one typed error without the password, the connection back after."""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest

from tether.audit.sink import PostgresAuditSink
from tether.store.effect_ledger import ledger_for
from tether.policy.judgements import PostgresJudgementLog
from tether.store.postgres import Postgres, PostgresSync, PostgresUnavailable, Table, dsn_from_env
from tests.helpers.postgres import Postgres as Server
from workflows.states import RunState, TransitionRecord
from workflows.wire import AuditBatch

TABLES = {"tether_audit", "tether_undo_ledger", "tether_ledger_created", "tether_judgements"}


def fresh_database(dsn: str) -> str:
    """A database of its own on the test server (no table of the stores in it yet)."""
    import psycopg

    name = f"keeper_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return dsn.rsplit("/", 1)[0] + f"/{name}"


def tables(dsn: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT table_name, count(*) FROM information_schema.tables WHERE table_schema = 'public' GROUP BY table_name"
        ).fetchall()
    return dict(rows)


def batch(workflow_id: str, n: int = 1) -> AuditBatch:
    now = datetime.now(timezone.utc)
    records = [TransitionRecord(from_state=RunState.PLANNING, to_state=RunState.PLANNING, at=now, actor="test", reason="test",
                                state_version=i, seq=i) for i in range(1, n + 1)]
    return AuditBatch(workflow_id=workflow_id, run_id="r1", first_run_id="r1", records=records)


def judgement(workflow_id: str, index: int) -> dict[str, Any]:
    # Shaped as tether/policy/judgements.entries writes one (a line of another shape is skipped on read).
    return {"workflow_id": workflow_id, "run_id": "r1", "activity_id": "1", "index": index, "tenant": "default",
            "at": datetime.now(timezone.utc).isoformat(), "action": "approve", "allowed": True, "request": {},
            "entities": [], "policies": []}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once it is closed


async def test_many_workers_starting_at_once_make_each_table_once(postgres: str) -> None:
    """Eight workers' sinks, ledgers and judgement logs, all first used at the same moment on an
    empty database: every write lands, each table exists once, and a second start finds them."""
    dsn = fresh_database(postgres)
    sinks = [PostgresAuditSink(dsn) for _ in range(8)]
    ledgers = [ledger_for(sink) for sink in sinks]
    logs = [PostgresJudgementLog(dsn) for _ in range(8)]
    errors: list[BaseException] = []

    def write_log(i: int) -> None:
        try:
            logs[i].write([judgement(f"wf-{i}", 0)])
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=write_log, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        await asyncio.gather(
            *(sink.append(batch(f"wf-{i}", 3)) for i, sink in enumerate(sinks)),
            *(ledger.claim(f"wf-{i}:call", tool="refund", workflow_id=f"wf-{i}", run_id="r1") for i, ledger in enumerate(ledgers)),
        )
    finally:
        for t in threads:
            t.join()
    assert not errors, errors
    assert TABLES <= set(tables(dsn)) and all(tables(dsn)[t] == 1 for t in TABLES)
    again = PostgresAuditSink(dsn)
    try:
        assert sorted(await again.workflow_ids()) == sorted(f"wf-{i}" for i in range(8))
        assert [r.seq for r in (await again.read("wf-3"))["r1"]] == [1, 2, 3]
        assert sorted(e["workflow_id"] for e in PostgresJudgementLog(dsn).read()) == sorted(f"wf-{i}" for i in range(8))
        assert (await ledger_for(again).entries(["wf-5:call"]))["wf-5:call"].state == "claimed"
    finally:
        await again.aclose()
        for sink in sinks:
            await sink.aclose()
        for log in logs:
            log.db.close()


async def test_an_unreachable_database_is_one_typed_line_without_the_password() -> None:
    """Nothing listens at the DSN's port: each store raises PostgresUnavailable, whose line names
    the driver's error and never the password; the driver's error is its cause."""
    import psycopg

    dsn = f"postgresql://tether:s3cret-pw@127.0.0.1:{closed_port()}/audit"
    sink = PostgresAuditSink(dsn)
    assert "s3cret" not in sink.describe() and "***" in sink.describe()
    with pytest.raises(PostgresUnavailable) as raised:
        await sink.append(batch("wf"))
    assert "s3cret" not in str(raised.value) and str(raised.value).startswith("OperationalError: ")
    assert isinstance(raised.value.__cause__, psycopg.OperationalError)
    with pytest.raises(PostgresUnavailable):
        await ledger_for(sink).entries(["k"])
    log = PostgresJudgementLog(dsn)
    assert "s3cret" not in log.describe()
    with pytest.raises(PostgresUnavailable) as sync_raised:
        log.write([judgement("wf", 0)])
    assert "s3cret" not in str(sync_raised.value)


def test_a_dsn_that_is_no_postgres_url_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_AUDIT_DSN", "mysql://root:hunter2@db/audit")
    with pytest.raises(ValueError, match="TETHER_AUDIT_DSN must be a postgresql:// URL") as raised:
        dsn_from_env()
    assert "hunter2" not in str(raised.value)
    assert dsn_from_env(audit_dir="/somewhere") is None  # an explicit folder picks the files
    monkeypatch.delenv("TETHER_AUDIT_DSN")
    assert dsn_from_env() is None


async def test_a_refused_statement_is_mapped_and_the_next_use_opens_a_new_connection(postgres: str) -> None:
    """A statement the server refuses (here: the append-only trigger) raises PostgresUnavailable;
    the broken connection is dropped and the next use works, tables made again idempotently."""
    dsn = fresh_database(postgres)
    sink = PostgresAuditSink(dsn)
    try:
        await sink.append(batch("wf", 2))
        first = sink.db._conn
        with pytest.raises(PostgresUnavailable, match="append-only"):
            await sink.db.run(lambda conn: conn.execute("DELETE FROM tether_audit"))
        assert sink.db._conn is None
        await sink.append(batch("wf", 3))  # seqs 1-2 again (no duplicate) and 3
        assert sink.db._conn is not first
        assert [r.seq for r in (await sink.read("wf"))["r1"]] == [1, 2, 3]
    finally:
        await sink.aclose()


async def test_a_store_error_is_not_a_database_error(postgres: str) -> None:
    """What a store raises on its own (not the driver) reaches the caller as it is."""
    keeper = Postgres(fresh_database(postgres), [Table("t_own", "CREATE TABLE IF NOT EXISTS t_own (x int)")])

    async def refuse(conn: Any) -> None:
        raise LookupError("the store's own refusal")

    try:
        with pytest.raises(LookupError, match="own refusal"):
            await keeper.run(refuse)
    finally:
        await keeper.aclose()


async def test_a_server_restart_fails_one_use_and_the_next_reconnects(postgres_server: Server) -> None:
    """The server stops under an open connection (both kinds): the use then fails typed, and once
    it is back the same keepers work again without being made anew."""
    dsn = fresh_database(postgres_server.dsn)
    table = Table("t_restart", "CREATE TABLE IF NOT EXISTS t_restart (x int)")
    keeper, blocking = Postgres(dsn, [table]), PostgresSync(dsn, [table])

    async def count(conn: Any) -> int:
        return (await (await conn.execute("SELECT count(*) FROM t_restart")).fetchone())[0]

    try:
        assert await keeper.run(count) == 0
        assert blocking.run(lambda conn: conn.execute("SELECT count(*) FROM t_restart").fetchone()[0]) == 0
        postgres_server.stop()
        try:
            with pytest.raises(PostgresUnavailable):
                await keeper.run(count)
            with pytest.raises(PostgresUnavailable):
                blocking.run(lambda conn: conn.execute("SELECT 1").fetchone())
        finally:
            postgres_server.start()
        assert await keeper.run(count) == 0
        assert blocking.run(lambda conn: conn.execute("SELECT count(*) FROM t_restart").fetchone()[0]) == 0
    finally:
        await keeper.aclose()
        blocking.close()
