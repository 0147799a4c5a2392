"""Least privilege in the shipped stack, on a real PostgreSQL: the compose file's own db-keygen
and db-setup commands run against the tests' server, then each service's role tries what a
hostile holder of its DSN would (issue 58: with the cli's DSN, DISABLE TRIGGER, delete audit
rows, ENABLE TRIGGER, and `tether audit verify` passed)."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from tether.audit.sink import PostgresAuditSink
from tether.store.effect_ledger import ledger_for
from tether.policy.judgements import PostgresJudgementLog
from workflows.states import RunState, TransitionRecord
from workflows.wire import AuditBatch

yaml = pytest.importorskip("yaml", reason="PyYAML is in the dev extra")
psycopg = pytest.importorskip("psycopg")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]


def _mounts(service: str) -> dict[str, str]:
    return {v.split(":")[1]: v.split(":")[0] for v in SERVICES[service].get("volumes", [])}


def _as(dsn: str, *, user: str, dbname: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, user=user, dbname=dbname)


def _env_dsn(service: str) -> tuple[str, str]:
    """(role, database) of a service's TETHER_AUDIT_DSN in the compose file."""
    dsn = SERVICES[service]["environment"]["TETHER_AUDIT_DSN"]
    m = re.fullmatch(r"postgresql://(\w+)@postgresql:5432/(\w+)\?passfile=(/keys/[\w-]+/pgpass)", dsn)
    assert m, dsn
    # The passfile it names is in a volume it mounts.
    assert m.group(3).rsplit("/", 1)[0] in _mounts(service), (service, dsn)
    return m.group(1), m.group(2)


def _record(seq: int) -> TransitionRecord:
    return TransitionRecord(from_state=RunState.PLANNING, to_state=RunState.PLANNING, at=datetime.now(timezone.utc),
                            actor="test", reason="test", state_version=seq, seq=seq)


@pytest.fixture
def stack_database(postgres: str, tmp_path: Path) -> tuple[str, str]:
    """The compose file's db-keygen then db-setup, as written (volumes -> folders here, the
    superuser's DSN -> the tests' server, a database of this test's own), twice: idempotent."""
    volumes = {target: tmp_path / source for service in ("db-keygen", "db-setup") for target, source in _mounts(service).items()}

    def local(word: str) -> str:
        for target, folder in volumes.items():
            word = word.replace(target, str(folder))
        return word

    database = f"stack_{uuid.uuid4().hex[:10]}"
    for _ in range(2):
        for job in ("db-keygen", "db-setup"):
            argv = [local(w) for w in SERVICES[job]["command"]]
            assert argv[:3] == ["python", "-m", "tether.store.db_roles"]
            if job == "db-setup":
                argv[argv.index("--database") + 1] = database
                argv += ["--admin-dsn", postgres]
            done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
    # Passfiles for Tether's services only their owner may read (libpq ignores others).
    for name in ("db-worker", "db-cli", "db-inbox"):
        assert (volumes[f"/keys/{name}"] / "pgpass").stat().st_mode & 0o077 == 0
    return postgres, database


def _refused(conninfo: str, statement: str, params: tuple = ()) -> str:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
            conn.execute(statement, params)
    return str(refused.value)


async def test_the_cli_can_neither_disable_the_trigger_nor_delete_a_record(stack_database: tuple[str, str]) -> None:
    server, database = stack_database
    worker_role, db = _env_dsn("worker")
    assert db == "tether_audit" == SERVICES["db-setup"]["command"][SERVICES["db-setup"]["command"].index("--database") + 1]
    worker = _as(server, user=worker_role, dbname=database)

    # The worker writes through the stores as they run in the fleet: records, judgements, the ledger.
    sink = PostgresAuditSink(worker)
    await sink.append(AuditBatch(workflow_id="wf", run_id="r1", first_run_id="r1", records=[_record(i) for i in (1, 2, 3)]))
    ledger = ledger_for(sink)
    assert await ledger.claim("wf:c1", tool="send_email", workflow_id="wf", run_id="r1") is None
    await ledger.done("wf:c1", "sent", workflow_id="wf", run_id="r1")
    log = PostgresJudgementLog(worker)
    line = {"workflow_id": "wf", "run_id": "r1", "activity_id": "1", "index": 0, "tenant": "default",
            "at": datetime.now(timezone.utc).isoformat(), "action": "approve", "allowed": True, "request": {},
            "entities": [], "policies": []}
    log.write([line])
    log.write([{**line, "allowed": False}])  # a retried attempt: the row stands as written
    assert [e["allowed"] for e in log.read(workflow_id="wf")] == [True]
    await sink.aclose()
    log.db.close()

    # Each reader reads it all, through the same stores.
    for service in ("cli", "inbox"):
        role, _ = _env_dsn(service)
        reader = PostgresAuditSink(_as(server, user=role, dbname=database))
        assert [r.seq for r in (await reader.read("wf"))["r1"]] == [1, 2, 3]
        assert (await ledger_for(reader).entries(["wf:c1"]))["wf:c1"].state == "done"
        await reader.aclose()
        judged = PostgresJudgementLog(_as(server, user=role, dbname=database))
        assert len(judged.read(workflow_id="wf")) == 1
        judged.db.close()

        # The finding: as the cli, the trigger cannot be turned off, nor a record deleted or changed.
        as_reader = _as(server, user=role, dbname=database)
        assert "must be owner" in _refused(as_reader, "ALTER TABLE tether_audit DISABLE TRIGGER tether_audit_append_only")
        for statement in ("DELETE FROM tether_audit WHERE workflow_id = 'wf'", "UPDATE tether_audit SET seq = seq + 10",
                          "TRUNCATE tether_audit", "DELETE FROM tether_undo_ledger", "UPDATE tether_undo_ledger SET state = 'released'",
                          "INSERT INTO tether_audit (workflow_id, run_id, seq, first_run_id, record) VALUES ('x', 'x', 1, 'x', '{}')",
                          "DELETE FROM tether_judgements", "DROP TABLE tether_audit", "CREATE TABLE mine (x int)"):
            _refused(as_reader, statement)

    # A worker appends and keeps the ledger; it never rewrites or removes a record or a judgement.
    for statement in ("DELETE FROM tether_audit", "UPDATE tether_audit SET record = '{}'", "TRUNCATE tether_audit",
                      "DELETE FROM tether_judgements", "UPDATE tether_judgements SET line = '{}'",
                      "DELETE FROM tether_undo_ledger", "DELETE FROM tether_ledger_created", "DELETE FROM tether_ledger_witness",
                      "ALTER TABLE tether_audit DISABLE TRIGGER tether_audit_append_only",
                      "DROP TRIGGER tether_audit_append_only ON tether_audit", "CREATE TABLE mine (x int)"):
        _refused(worker, statement)
    with psycopg.connect(_as(server, user="tether", dbname=database)) as admin:
        owners = dict(admin.execute("SELECT tablename, tableowner FROM pg_tables WHERE schemaname = 'public'").fetchall())
        assert owners == dict.fromkeys(("tether_audit", "tether_judgements", "tether_undo_ledger", "tether_ledger_created",
                                      "tether_ledger_generation", "tether_ledger_witness"), "tether_owner")
        # No service can be the owner: it cannot log in, and no login role of the stack is a member of it.
        can_login, = admin.execute("SELECT rolcanlogin FROM pg_roles WHERE rolname = 'tether_owner'").fetchone()
        assert can_login is False
        members = {r for (r,) in admin.execute(
            "SELECT m.rolname FROM pg_auth_members a JOIN pg_roles o ON o.oid = a.roleid JOIN pg_roles m ON m.oid = a.member "
            "WHERE o.rolname IN ('tether_owner', 'temporal')").fetchall()}
        assert not members & {"tether_worker", "tether_cli", "tether_inbox"}, members
        # Every login role has its password set from its secret; none is a superuser or may create roles.
        rows = admin.execute("SELECT rolname, rolsuper, rolcreaterole, rolpassword IS NOT NULL FROM pg_authid "
                             "WHERE rolname IN ('tether_worker', 'tether_cli', 'tether_inbox', 'temporal')").fetchall()
        assert sorted(rows) == [(r, False, False, True) for r in ("temporal", "tether_cli", "tether_inbox", "tether_worker")]
        # Every record is still there, in order.
        assert admin.execute("SELECT count(*) FROM tether_audit").fetchone() == (3,)


def test_temporals_role_is_its_own(stack_database: tuple[str, str]) -> None:
    """Temporal's role owns what it creates; a Tether role reads none of it, and Temporal's
    role reads none of Tether's tables."""
    server, database = stack_database
    assert SERVICES["temporal-schema"]["environment"]["SQL_USER"] == SERVICES["temporal"]["environment"]["POSTGRES_USER"] == "temporal"
    temporal_db = f"temporal_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_as(server, user="temporal", dbname="postgres"), autocommit=True) as temporal:
        temporal.execute(f"CREATE DATABASE {temporal_db}")  # as temporal-sql-tool create-database does
    with psycopg.connect(_as(server, user="temporal", dbname=temporal_db), autocommit=True) as temporal:
        temporal.execute("CREATE TABLE executions (id text)")
        temporal.execute("INSERT INTO executions VALUES ('history')")
    for role in ("tether_worker", "tether_cli", "tether_inbox"):
        _refused(_as(server, user=role, dbname=temporal_db), "SELECT * FROM executions")
        _refused(_as(server, user=role, dbname=temporal_db), "DELETE FROM executions")
    with pytest.raises(psycopg.OperationalError, match="permission denied"):
        psycopg.connect(_as(server, user="temporal", dbname=database))
    # No Tether service is given Temporal's password, nor the superuser's.
    for name, service in SERVICES.items():
        if name in ("temporal", "temporal-schema", "db-setup", "db-keygen"):
            continue
        assert "/keys/db-temporal" not in _mounts(name), name
        assert "/keys/db-admin" not in _mounts(name) or name == "postgresql", name
