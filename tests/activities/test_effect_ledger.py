"""The effect ledger (issue 39): every write is claimed by its idempotency key in the tool worker
before the tool runs, so a repeated key (a retry, a reset run, a repair, a replayed capability)
never reaches an unsafe tool again. The ledger is a witness: a lost one is an error, never an
empty answer (issue 46). Real dev server, real billing service (its database counts the
effects), real SQLite ledgers."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

import examples.billing.tools  # noqa: F401 (registers the billing tools)
from tether.store.effect_ledger import LEDGER_FILE, LedgerUnavailable, SqliteEffectLedger
from tether.store.keys import KeyRing
from activities.tools import IN_FLIGHT, MAY_HAVE_APPLIED, ToolActivities
from tether.tools.sdk import REGISTRY
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from workflows import keys
from workflows.wire import LEDGER_UNAVAILABLE, ToolCall, ToolOutcome
from tests.helpers.resets import reset_run_outcome
from tests.helpers.billing import counts_in_db, emails_to


def write_call(tool: str, args: dict, key: str, *, workflow_id: str = "wf", run_id: str = "wf-run",
               activity_id: str = "tc-1.1.0", attempt: int = 1) -> ToolCall:
    """A write as the run's workflow code schedules it: its capability minted with the fleet key
    for exactly this call, run and activity id."""
    call = ToolCall(tool=tool, args=args, tool_call_id=key.rsplit(":", 1)[-1], idempotency_key=key,
                    run_id=workflow_id, tenant="default", attempt=attempt)
    call.capability = keys.mint(
        KeyRing.from_env(), call, workflow_id=workflow_id, run_id=run_id, activity_id=activity_id, request_id="",
        plan_hash="h" * 64, now=datetime.now(timezone.utc), ttl_seconds=60,
    )
    return call


async def execute(tools: ToolActivities, call: ToolCall, *, workflow_id: str = "wf", run_id: str = "wf-run",
                  activity_id: str = "tc-1.1.0") -> ToolOutcome:
    """``execute_tool`` as the tool worker runs it for that activity (the server's activity info)."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=workflow_id, workflow_run_id=run_id, activity_id=activity_id)
    return await env.run(tools.execute_tool, call)


def email_args() -> dict:
    return {"to": f"{uuid.uuid4().hex[:8]}@example.com", "subject": "s", "body": "b"}


@pytest.fixture
def ledger(tmp_path: Path) -> SqliteEffectLedger:
    return SqliteEffectLedger(tmp_path / "audit" / LEDGER_FILE)


async def test_a_replayed_capability_sends_one_email_in_turn_or_at_once(billing: Billing, ledger: SqliteEffectLedger) -> None:
    """The documented remainder: a captured capability replayed under the same run and activity
    id is the same call. One after the other: the recorded outcome, attested for this call, no
    second email. Both at once: one email; the other is refused, the tool not called."""
    tools = ToolActivities(REGISTRY, KeyRing.from_env(), ledger)
    key = f"{unique('wf')}:tc-1"
    call = write_call("send_email", email_args(), key)
    first = await execute(tools, call)
    for _ in range(3):
        again = await execute(tools, call)
        assert again.observation == first.observation and again.attestation is not None
    assert counts_in_db(billing, key)["emails"] == 1

    key = f"{unique('wf')}:tc-1"
    call = write_call("send_email", email_args(), key)
    answers = await asyncio.gather(*(execute(tools, call) for _ in range(4)), return_exceptions=True)
    sent = [a for a in answers if isinstance(a, ToolOutcome)]
    refused = [a for a in answers if isinstance(a, ApplicationError)]
    assert counts_in_db(billing, key)["emails"] == 1, answers
    # Whoever came while the first was running was refused as "may have applied" (an unsafe tool
    # is never started twice); whoever came after it finished got its outcome.
    assert len(sent) + len(refused) == 4 and sent and all(e.type == MAY_HAVE_APPLIED for e in refused), answers
    assert all(not e.non_retryable for e in refused)  # the run takes it as an unknown outcome


async def test_an_unsafe_write_that_may_have_applied_is_never_started_again(billing: Billing, ledger: SqliteEffectLedger) -> None:
    """The service took the email, then its answer was lost (a 503 after the write): a second call
    under the key, from any run, any attempt number, is may_have_applied, never a second email."""
    tools = ToolActivities(REGISTRY, KeyRing.from_env(), ledger)
    key = f"{unique('wf')}:tc-1"
    billing.fail_next("emails", 1, status=503, when="after_commit")
    with pytest.raises(ApplicationError):
        await execute(tools, write_call("send_email", email_args(), key))
    assert (await ledger.entries([key]))[key].state == "unknown"
    for attempt, run in ((1, "wf-reset-run"), (2, "wf-run"), (1, "wf-repair-run")):
        with pytest.raises(ApplicationError) as refused:
            await execute(tools, write_call("send_email", email_args(), key, run_id=run, attempt=attempt), run_id=run)
        assert refused.value.type == MAY_HAVE_APPLIED and not refused.value.non_retryable
        assert "may have applied" in refused.value.message
    assert counts_in_db(billing, key)["emails"] == 1


async def test_a_reconcilable_write_looks_up_first_on_a_repeated_key_whatever_the_attempt(
    billing: Billing, ledger: SqliteEffectLedger
) -> None:
    """The ledger post applied and its answer was lost. A reset run calls it again as its first
    attempt: the key is in the ledger, so it is looked up, found, and not posted twice (before:
    409 duplicate_key, the step failed, the entry left without its undo)."""
    tools = ToolActivities(REGISTRY, KeyRing.from_env(), ledger)
    key = f"{unique('wf')}:tc-2"
    args = {"order_id": "A-1002", "amount_cents": -100, "memo": "ledger test"}
    billing.fail_next("ledger", 1, status=503, when="after_commit")
    with pytest.raises(ApplicationError):
        await execute(tools, write_call("post_ledger_entry", args, key))
    found = await execute(tools, write_call("post_ledger_entry", args, key, run_id="wf-reset-run", attempt=1), run_id="wf-reset-run")
    assert key in found.observation and counts_in_db(billing, key)["ledger"] == 1
    entry = (await ledger.entries([key]))[key]
    assert (entry.state, entry.by_run) == ("done", "wf-reset-run")
    # Done now: the recorded outcome, whoever asks, no look-up and no post.
    billing.fail_next("ledger", 5, status=500)  # a call reaching the service would fail
    again = await execute(tools, write_call("post_ledger_entry", args, key, run_id="wf-other", attempt=1), run_id="wf-other")
    assert again.observation == found.observation


async def test_an_idempotent_write_runs_again_under_its_key_but_not_beside_a_live_attempt(
    billing: Billing, ledger: SqliteEffectLedger
) -> None:
    """A refund whose attempt may still be running (claimed, within its time) is not started
    beside it; once that is over (outcome unknown) it runs again under the same key, and the
    service dedupes."""
    tools = ToolActivities(REGISTRY, KeyRing.from_env(), ledger)
    key = f"{unique('wf')}:tc-1"
    args = {"order_id": "A-1002", "amount_cents": 150, "reason": "ledger test"}
    await ledger.claim(key, tool="issue_refund", workflow_id="wf", run_id="wf-old-run")
    with pytest.raises(ApplicationError) as busy:
        await execute(tools, write_call("issue_refund", args, key, run_id="wf-reset-run"), run_id="wf-reset-run")
    assert busy.value.type == IN_FLIGHT and not busy.value.non_retryable
    assert counts_in_db(billing, key)["refunds"] == 0
    await ledger.unknown(key)  # that attempt is over, its outcome unknown
    billing.fail_next("refunds", 1, status=503, when="after_commit")
    with pytest.raises(ApplicationError):
        await execute(tools, write_call("issue_refund", args, key, run_id="wf-reset-run"), run_id="wf-reset-run")
    done = await execute(tools, write_call("issue_refund", args, key, run_id="wf-reset-run", attempt=2), run_id="wf-reset-run")
    assert counts_in_db(billing, key)["refunds"] == 1 and (await ledger.entries([key]))[key].state == "done"
    assert "refund_id" in done.observation


async def test_a_lost_ledger_is_an_error_not_an_empty_ledger(billing: Billing, tmp_path: Path) -> None:
    """Issue 46: the ledger file deleted (or unreadable) starts no write and no undo and reads as
    an error, never as "nothing claimed"; an empty one begins only on the operator's word."""
    path = tmp_path / "audit" / LEDGER_FILE
    ledger = SqliteEffectLedger(path)
    tools = ToolActivities(REGISTRY, KeyRing.from_env(), ledger)
    key = f"{unique('wf')}:tc-1"
    call = write_call("send_email", email_args(), key)
    await execute(tools, call)
    assert (await ledger.entries([key]))[key].state == "done"

    path.unlink()  # under a worker that holds it open, and for one that starts now
    for holder in (ledger, SqliteEffectLedger(path)):
        with pytest.raises(LedgerUnavailable, match="--new-ledger"):
            await holder.entries([key])
        with pytest.raises(ApplicationError) as refused:
            await execute(ToolActivities(REGISTRY, KeyRing.from_env(), holder), call)
        assert refused.value.type == LEDGER_UNAVAILABLE and "missing" in refused.value.message
    assert not path.exists() and counts_in_db(billing, key)["emails"] == 1

    # A file that is not a ledger: unreadable, the same refusal.
    garbage = tmp_path / "garbage" / LEDGER_FILE
    garbage.parent.mkdir()
    garbage.write_bytes(b"not a database" * 100)
    with pytest.raises(ApplicationError) as refused:
        await execute(ToolActivities(REGISTRY, KeyRing.from_env(), SqliteEffectLedger(garbage)), call)
    assert refused.value.type == LEDGER_UNAVAILABLE and "DatabaseError" in refused.value.message

    # The operator's word (--new-ledger): an empty ledger; what the old one recorded is gone.
    fresh = SqliteEffectLedger(path, new_ledger=True)
    other = f"{unique('wf')}:tc-1"
    await execute(ToolActivities(REGISTRY, KeyRing.from_env(), fresh), write_call("send_email", email_args(), other))
    assert (await SqliteEffectLedger(path).entries([other]))[other].state == "done"

    # A folder where no ledger was ever created reads as empty (nothing was claimed there).
    assert await SqliteEffectLedger(tmp_path / "never" / LEDGER_FILE).entries([key]) == {}


# ----------------------------------------------------------------------------- plain resets


def three_writes(to: str) -> list[dict]:
    """A refund (idempotent), a ledger entry (reconcilable), an email (unsafe)."""
    return [
        {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 700, "reason": "reset everywhere"}},
        {"tool": "post_ledger_entry", "args": {"order_id": "A-1002", "amount_cents": -700, "memo": "reset everywhere"}},
        {"tool": "send_email", "args": {"to": to, "subject": "your refund", "body": "sent once"}},
    ]


async def test_a_plain_reset_to_every_completed_workflow_task_repeats_no_write(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Issue 39: an approved 3-write run, reset (`temporal workflow reset --event-id`, what the
    Web UI's Reset button does) to each of its completed workflow tasks in turn: one refund, one
    ledger entry, one email in the billing database, and every reset run COMPLETED."""
    client = dev_env.client
    to = f"{uuid.uuid4().hex[:10]}@example.com"
    async with running_worker(client) as worker:
        handle = await start_run(client, worker, make_request(three_writes(to)))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        first = await run_outcome(handle)
        assert first.state.value == "COMPLETED"
        assert counts_in_db(billing, handle.id) == {"refunds": 1, "ledger": 1, "emails": 1}
        events = (await handle.fetch_history()).events
        points = [e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED]
        # At least: the start, the planner's answer (the setup and the plan's re-check with it),
        # the rest, the approval, each of the three writes' results, the last plan: each a point.
        assert len(points) >= 8, points
        ended = {}
        for point in points:
            reset = await client.workflow_service.reset_workflow_execution(
                ResetWorkflowExecutionRequest(
                    namespace=client.namespace,
                    workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=handle.result_run_id),
                    reason=f"test: reset to workflow task {point}",
                    workflow_task_finish_event_id=point,
                    request_id=uuid.uuid4().hex,
                    reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_SIGNAL,
                )
            )
            again, approved_again = await reset_run_outcome(client, handle.id, reset.run_id)
            ended[point] = again.state.value + (" (approved again)" if approved_again else "")
            assert [s.tool_call_id for s in again.steps] == [s.tool_call_id for s in first.steps], point
    assert {state.split()[0] for state in ended.values()} == {"COMPLETED"}, ended
    # A reset before the approval was taken gets it again (reapplied: held while the run does not
    # ask yet, judged once it asks), or bob approves again where the run waits; the later ones need
    # no one.
    assert ended[points[-1]] == "COMPLETED", ended
    assert counts_in_db(billing, handle.id) == {"refunds": 1, "ledger": 1, "emails": 1}


# ----------------------------------------------------------------------------- a lost ledger, end to end


async def test_a_deleted_ledger_repeats_no_undo_and_status_says_unknown(
    ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: a write undone by a compensation run, then the ledger file deleted. `tether
    status` says unknown (never pending) and names the ledger's error; `tether compensate` is
    refused; a compensation run started anyway undoes nothing (before: the void was sent again)."""
    import tether.client as tether_client
    from tether.cli.output import format_status
    from tests.helpers.recovery import VOIDS, approved_run, requests_to

    monkeypatch.setenv("TETHER_AUDIT_DIR", str(tmp_path / "audit"))  # this test's sink and ledger only
    billing.fail_next("emails", 1, status=400)
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker)
        assert outcome.state.value == "EXECUTION_FAILED"
        undo = await tether_client.run_outcome(await tether_client.compensate(
            ts_env.client, outcome.run_id, by="bob", queue=worker.task_queue))
        assert undo.state.value == "COMPENSATED"
        voids = requests_to(billing, VOIDS)
        undone = format_status(await tether_client.status(ts_env.client, outcome.run_id))
        assert "undone (void_refund" in undone

        (tmp_path / "audit" / LEDGER_FILE).unlink()
        status = await tether_client.status(ts_env.client, outcome.run_id)
        shown = format_status(status)
        assert status.ledger_error and "missing" in status.ledger_error and "--new-ledger" in status.ledger_error
        assert {c.status for c in status.compensations if c.tool} == {"unknown"}, status.compensations
        assert "pending" not in shown and "unknown (the ledger cannot be read)" in shown and "ledger     " in shown, shown
        with pytest.raises(tether_client.TetherError) as refused:
            await tether_client.compensate(ts_env.client, outcome.run_id, by="carol", queue=worker.task_queue)
        assert refused.value.rule == "ledger_unavailable" and refused.value.code == 2
        # A client that skips the check: the worker reads its ledger for what is left, cannot,
        # and undoes nothing; the compensation run says why (last_error, status), and the
        # original stays compensable once the ledger is back.
        forced = await tether_client.run_outcome(await start_run(ts_env.client, worker, make_request(
            [], compensate_run=outcome.run_id, requested_by="carol")))
        assert forced.state.value == "FAILED" and forced.timeline[-1].refs.error_code == "ledger_unavailable"
        refused_run = await tether_client.status(ts_env.client, forced.run_id)
        assert refused_run.last_error.startswith("ledger_unavailable: ") and "missing" in refused_run.last_error
        assert refused_run.end_rule == "ledger_unavailable" and "nothing was undone" in format_status(refused_run)
    assert requests_to(billing, VOIDS) == voids


async def test_a_ledger_restored_from_an_earlier_copy_is_refused_and_no_email_repeats(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 58: the ledger restored from a consistent copy taken before an approved unsafe email
    (as a restored volume or machine would be), a worker started without --new-ledger, a plain
    reset to before the email: before, the email went out again (1 -> 2). The ledger's generation
    is below the one the fleet witnessed: refused at worker start and on the claim, like a
    missing ledger; the email is not sent again."""
    from tether.audit.sink import JsonlAuditSink
    from tether.store.effect_ledger import WITNESS_FILE, check_ledger

    import tether.client as tether_client

    audit = tmp_path / "audit"
    monkeypatch.setenv("TETHER_AUDIT_DIR", str(audit))  # this test's sink and ledger only
    client = dev_env.client
    queue = unique("restored")
    to = f"{uuid.uuid4().hex[:10]}@example.com"
    email = [{"tool": "send_email", "args": {"to": to, "subject": "your refund", "body": "sent once"}}]
    async with running_worker(client, task_queue=queue) as worker:
        # The ledger holds an earlier write when the copy is taken.
        earlier = await start_run(client, worker, make_request(
            [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 100, "reason": "before the copy"}}]))
        await earlier.signal("approve", approval_for(await wait_for_state(earlier, "AWAITING_APPROVAL"), "bob"))
        assert (await run_outcome(earlier)).state.value == "COMPLETED"
        handle = await start_run(client, worker, make_request(email))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        copy = tmp_path / "backup.sqlite3"
        with sqlite3.connect(audit / LEDGER_FILE) as live, sqlite3.connect(copy) as backup:
            live.backup(backup)  # a consistent copy, before the email
        await handle.signal("approve", approval_for(snap, "bob"))
        first = await run_outcome(handle)
        assert first.state.value == "COMPLETED" and counts_in_db(billing, handle.id)["emails"] == 1
    # Restored, the workers stopped (as a restore is done): the copy is the ledger now.
    (audit / LEDGER_FILE).unlink()
    for extra in ("-wal", "-shm"):
        (audit / (LEDGER_FILE + extra)).unlink(missing_ok=True)
    with sqlite3.connect(copy) as backup, sqlite3.connect(audit / LEDGER_FILE) as restored:
        backup.backup(restored)
    assert (audit / WITNESS_FILE).exists()
    # A worker starting on it is refused (worker.py calls this before it serves) ...
    with pytest.raises(LedgerUnavailable, match="older than the fleet's.*--new-ledger"):
        await check_ledger(JsonlAuditSink(audit))
    # ... and one that serves anyway (built without that check) starts no write on it: a plain
    # reset to the workflow task that scheduled the email.
    async with running_worker(client, task_queue=queue):
        events = (await handle.fetch_history()).events
        scheduled = next(e for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                         and e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool")
        point = scheduled.activity_task_scheduled_event_attributes.workflow_task_completed_event_id
        reset = await client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
            namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=handle.result_run_id),
            reason="test: reset after the ledger was restored", workflow_task_finish_event_id=point,
            request_id=uuid.uuid4().hex, reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_SIGNAL))
        reset_handle = client.get_workflow_handle(handle.id, run_id=reset.run_id)
        # The write bounced on the ledger's refusal, each attempt, and the run ended on it.
        while (await reset_handle.describe()).status == WorkflowExecutionStatus.RUNNING:
            await asyncio.sleep(0.1)
        shown = await tether_client.status(client, handle.id)
        assert shown.state.value == "EXECUTION_FAILED" and shown.last_error.startswith("ledger_unavailable: "), shown
    assert counts_in_db(billing, handle.id)["emails"] == 1
    # The operator's word begins anew from the copy: what it lacks may be started again.
    await check_ledger(JsonlAuditSink(audit), new_ledger=True)
    await check_ledger(JsonlAuditSink(audit))


async def test_a_dropped_postgres_ledger_is_an_error_until_the_operator_begins_a_new_one(postgres: str) -> None:
    """The fleet's ledger (PostgreSQL, beside the audit sink): its table dropped, every worker's
    claim and every client's read is LedgerUnavailable, not an empty ledger; --new-ledger begins
    an empty one. A database of its own (the session's is shared)."""
    import psycopg

    from tether.audit.sink import PostgresAuditSink
    from tether.store.effect_ledger import LEDGER_TABLE, ledger_for

    name = f"ledger_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    dsn = postgres.rsplit("/", 1)[0] + f"/{name}"
    key = f"wf-{uuid.uuid4().hex[:8]}:tc-1"
    first = ledger_for(PostgresAuditSink(dsn))
    try:
        assert await first.claim(key, tool="send_email", workflow_id="wf", run_id="r1") is None
        await first.done(key, "{}", workflow_id="wf", run_id="r1")
    finally:
        await first.aclose()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {LEDGER_TABLE}")
    for _ in range(2):  # a worker starting now, a client reading
        ledger = ledger_for(PostgresAuditSink(dsn))
        try:
            with pytest.raises(LedgerUnavailable, match="--new-ledger"):
                await ledger.claim(key, tool="send_email", workflow_id="wf", run_id="r2")
            with pytest.raises(LedgerUnavailable):
                await ledger.entries([key])
        finally:
            await ledger.aclose()
    fresh = ledger_for(PostgresAuditSink(dsn), new_ledger=True)
    try:
        assert await fresh.entries([key]) == {}
        assert await fresh.claim(key, tool="send_email", workflow_id="wf", run_id="r3") is None
    finally:
        await fresh.aclose()
    again = ledger_for(PostgresAuditSink(dsn))  # the new one is marked: used as it is
    try:
        assert (await again.entries([key]))[key].by_run == "r3"
    finally:
        await again.aclose()


async def test_a_postgres_ledger_restored_from_an_earlier_copy_is_refused_until_the_operator_accepts_it(postgres: str) -> None:
    """The fleet's ledger restored from a copy taken before a write (its tables, as a
    table-level restore puts them back): the witness beside the audit table holds the generation
    the fleet reached, so every worker's claim and every client's read is refused, not answered
    "never started"; --new-ledger accepts it."""
    import psycopg

    from tether.audit.sink import PostgresAuditSink
    from tether.store.effect_ledger import GENERATION_TABLE, LEDGER_TABLE, ledger_for

    name = f"restored_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    dsn = postgres.rsplit("/", 1)[0] + f"/{name}"
    before, email = f"wf-{uuid.uuid4().hex[:8]}:tc-1", f"wf-{uuid.uuid4().hex[:8]}:tc-2"
    live = ledger_for(PostgresAuditSink(dsn))
    try:
        assert await live.claim(before, tool="issue_refund", workflow_id="wf", run_id="r1") is None
        await live.done(before, "{}", workflow_id="wf", run_id="r1")
        with psycopg.connect(dsn, autocommit=True) as conn:  # the copy
            for table in (LEDGER_TABLE, GENERATION_TABLE):
                conn.execute(f"CREATE TABLE copy_{table} AS TABLE {table}")
        assert await live.claim(email, tool="send_email", workflow_id="wf", run_id="r1") is None
        await live.done(email, "{}", workflow_id="wf", run_id="r1")
    finally:
        await live.aclose()
    with psycopg.connect(dsn, autocommit=True) as conn:  # the restore
        for table in (LEDGER_TABLE, GENERATION_TABLE):
            conn.execute(f"DELETE FROM {table}")
            conn.execute(f"INSERT INTO {table} SELECT * FROM copy_{table}")
    ledger = ledger_for(PostgresAuditSink(dsn))
    try:
        with pytest.raises(LedgerUnavailable, match="older than the fleet's.*--new-ledger"):
            await ledger.claim(email, tool="send_email", workflow_id="wf", run_id="r2")
        with pytest.raises(LedgerUnavailable, match="older"):
            await ledger.entries([before])
    finally:
        await ledger.aclose()
    accepted = ledger_for(PostgresAuditSink(dsn), new_ledger=True)
    try:
        assert set(await accepted.entries([before, email])) == {before}
    finally:
        await accepted.aclose()
    again = ledger_for(PostgresAuditSink(dsn))  # accepted: used as it is from now on
    try:
        assert set(await again.entries([before, email])) == {before}
    finally:
        await again.aclose()


async def test_a_capability_replayed_by_a_rogue_poller_under_the_same_activity_id_sends_one_email(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """The documented remainder, as a hostile worker does it: a run sent its approved email and
    waits to retry its next step; a keyless poller takes the run's next workflow task and
    schedules the captured `execute_tool` input again under the email's own activity id (so the
    capability matches the run, the attempt and the call). The tool worker answers from its
    ledger: one email, not two."""
    from tests.helpers.rogue import rogue_answer, schedule_tool
    client = dev_env.client
    to = f"{uuid.uuid4().hex[:10]}@example.com"
    queue = unique("tq")
    plan = [
        {"tool": "send_email", "args": {"to": to, "subject": "once", "body": "only once"}},
        {"tool": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 100, "reason": "replay"}},
    ]
    billing.fail_next("refunds", 20, status=503)  # the run waits between retries of its refund
    async with running_worker(client, task_queue=queue) as worker:
        handle = await start_run(client, worker, make_request(plan))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        await wait_for_state(handle, "RETRY_WAIT")
    # No worker of the run's queue now: its next workflow task goes to whoever polls.
    assert len(emails_to(billing, to)) == 1
    scheduled = next(
        e.activity_task_scheduled_event_attributes for e in (await handle.fetch_history()).events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"
    )
    captured = pydantic_data_converter.payload_converter.from_payloads(scheduled.input.payloads, [ToolCall])[0]
    assert captured.tool == "send_email" and captured.capability is not None
    replay_queue = unique("tq")
    await rogue_answer(client, queue, handle.id, [schedule_tool(replay_queue, captured, scheduled.activity_id)])
    async with running_worker(client, task_queue=replay_queue):
        last = None
        for _ in range(600):
            events = (await handle.fetch_history()).events
            replays = [e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                       and e.activity_task_scheduled_event_attributes.task_queue.name == replay_queue]
            ended = [e for e in events if replays and (
                e.activity_task_completed_event_attributes.scheduled_event_id == replays[0]
                or e.activity_task_failed_event_attributes.scheduled_event_id == replays[0])]
            if ended:
                last = ended[0]
                break
            await asyncio.sleep(0.05)
    await handle.terminate("test over")
    assert last is not None and last.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED, last  # answered, not refused
    answer = pydantic_data_converter.payload_converter.from_payloads(
        last.activity_task_completed_event_attributes.result.payloads, [ToolOutcome])[0]
    assert to in answer.observation and answer.attestation is not None
    assert len(emails_to(billing, to)) == 1


async def test_a_worker_refuses_to_start_on_a_lost_ledger_unless_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a ledger was created and is gone, `python worker.py` exits naming --new-ledger
    (before it reaches Temporal); a folder that never had one starts as always."""
    import worker

    folder = tmp_path / "audit"
    monkeypatch.setenv("TETHER_AUDIT_DIR", str(folder))
    ledger = SqliteEffectLedger(folder / LEDGER_FILE)
    await ledger.claim("wf:tc-1", tool="send_email", workflow_id="wf", run_id="r")
    await ledger.aclose()
    (folder / LEDGER_FILE).unlink()
    with pytest.raises(SystemExit) as refused:
        await worker.serve(["examples.billing.tools"], unique("tq"))
    assert "effect ledger" in str(refused.value.code) and "--new-ledger" in str(refused.value.code)
    # With the operator's word the check passes; the new ledger begins with the first write.
    from tether.audit.sink import JsonlAuditSink
    from tether.store.effect_ledger import check_ledger

    await check_ledger(JsonlAuditSink(folder), new_ledger=True)
    await check_ledger(JsonlAuditSink(tmp_path / "never"))
