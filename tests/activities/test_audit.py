"""The audit record is complete whatever happens to a run: a reset is its own stream, ids of any
length or script, a sink that cannot write stops writes and says so, every decision attempt is
on the record and answered. Real dev server, real billing service, the real `temporal` and
`tether` commands."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from activities.audit import AuditActivities
from tether.audit.sink import JsonlAuditSink, PostgresAuditSink, audit_path, bounded_name
from activities.policy_checks import PolicyActivities
from tether.policy.files import PolicyStore
from tether.store.keys import KeyRing
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.paths import BIN, ROOT
from tests.helpers.postgres import Postgres
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import audit_collected, wait_for_state
from tests.helpers.cli import Cli
from workflows.contract import DecideRequest, DecideResult
from workflows.wire import DecisionCheck, PolicySnapshot, SnapshotRequest, Verdict
from workflows.run_state import RunOutcome, RunSnapshot
from workflows.states import RunState as S

POLICY = PolicyStore(ROOT / "examples/billing/policy.toml")
# A refund over the policy's auto-approval limit: one approval (bob or carol) is needed.
REFUND = [
    {"tool": "get_order", "args": {"order_id": "A-1002"}},
    {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 6000, "reason": "audit test"}},
]


async def temporal_cli(env: WorkflowEnvironment, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "temporal"), *args, "--address", env.client.service_client.config.target_host,
        "--namespace", env.client.namespace,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, (args, out.decode(), err.decode())
    return out.decode()


async def assert_replays(handle: WorkflowHandle) -> None:
    """The run's own history replays on the current code (the new paths are deterministic)."""
    from temporalio.contrib.pydantic import pydantic_data_converter
    from worker import create_replayer

    from workflows.agent_run import AgentRun

    replayer = create_replayer()
    result = await replayer.replay_workflow(await handle.fetch_history(), raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure


async def wait_for_audit_error(env: WorkflowEnvironment, handle: WorkflowHandle, timeout: float = 10) -> RunSnapshot:
    """Until the run shows that it cannot write to its audit sink ("within seconds")."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    began = loop.time()
    while (snap := await tether_client.snapshot(env.client, handle.id)).audit_error is None:
        assert loop.time() < deadline, "the sink error never showed on the run"
        await asyncio.sleep(0.2)
    print(f"\nthe sink error showed on the run after {loop.time() - began:.2f}s")
    return snap


async def approve(handle: WorkflowHandle, approver: str) -> None:
    snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    await handle.signal("approve", approval_for(snap, approver))


def approvals(records: list) -> list[str]:
    return [r.actor for r in records if r.kind == "transition" and r.to_state == S.APPROVED]


async def reset_scenario_with(
    env: WorkflowEnvironment, sink: JsonlAuditSink | PostgresAuditSink, *, cli_env: dict, audit_dir: str | None = None,
    dsn: str | None = None,
) -> tuple:
    """bob approves, the run completes; `temporal workflow reset --type FirstWorkflowTask`
    without bob's signal applied again (a reset run that gets it takes it: test_effect_ledger);
    carol approves the reset run. Returns the trail, both run ids and the CLI's output."""
    async with running_worker(env.client, policy=POLICY, audit=AuditActivities(sink=sink)) as worker:
        handle = await start_run(env.client, worker, make_request(REFUND))
        await approve(handle, "bob")
        first = await asyncio.wait_for(run_outcome(handle), 30)
        assert first.state == S.COMPLETED
        original = (await handle.describe()).run_id
        await temporal_cli(
            env, "workflow", "reset", "--workflow-id", handle.id, "--type", "FirstWorkflowTask",
            "--reason", "operator re-runs the refund", "--reapply-exclude", "Signal",
        )
        reset = env.client.get_workflow_handle(handle.id, result_type=RunOutcome)
        assert (await reset.describe()).run_id != original
        await approve(reset, "carol")
        assert (await asyncio.wait_for(reset.result(), 30)).state == S.COMPLETED
        await assert_replays(reset)
        trail = await audit_collected(env.client, handle.id, audit_dir, dsn=dsn)
        code, out, err = await Cli(env, worker)("timeline", handle.id, "--all", env=cli_env)
    return trail, original, (await reset.describe()).run_id, (code, out, err)


def assert_two_branches(trail: tether_client.AuditTrail, original: str, new: str, cli: tuple) -> None:
    assert [b.run_id for b in trail.branches] == [original, new]
    first, second = trail.branches
    assert first.origin == "first" and second.origin == "reset" and second.parent_run_id == original
    assert second.at_seq == 0  # FirstWorkflowTask: the new run wrote every record again
    assert second.reason.endswith("operator re-runs the refund") and second.identity  # as Temporal says
    assert approvals(first.records) == ["user:bob"] and approvals(second.records) == ["user:carol"]
    for branch in trail.branches:  # every record once, in each stream
        seqs = [r.seq for r in branch.records]
        assert seqs == list(range(1, len(seqs) + 1)), seqs
        assert branch.records[-1].to_state == S.COMPLETED and not branch.from_window
    assert trail.missing == [] and trail.line() == second.records
    code, out, err = cli
    assert code == 0, (out, err)
    assert f"== run {original} (first run)" in out
    assert f"operator re-runs the refund, by {second.identity}) of run {original}" in out and f"of run {original}: run {new}" in out
    assert out.count("user:bob") >= 1 and out.count("user:carol") >= 1


async def test_a_reset_is_its_own_stream_and_timeline_all_shows_both_branches(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    audit_dir = tmp_path / "audit"
    trail, original, new, cli = await reset_scenario_with(
        dev_env, JsonlAuditSink(audit_dir), cli_env={"TETHER_AUDIT_DIR": str(audit_dir)}, audit_dir=str(audit_dir)
    )
    assert_two_branches(trail, original, new, cli)
    # Two refunds went out; the record shows both approvals (each stream in a file of its own).
    assert sorted(p.name for p in audit_path(audit_dir, trail.workflow_id, original).parent.glob("*.jsonl")) == sorted(
        [f"{original}.jsonl", f"{new}.jsonl"]
    )


def test_sink_names_are_bounded_readable_and_distinct() -> None:
    japanese = "払い戻し注文番号エー千一の監査記録テスト用"  # 20+ characters, 3 bytes each
    long_ascii = "refund-" + "x" * 213
    names = {bounded_name(i) for i in (japanese, long_ascii, long_ascii + "y", "a/../b", "..", "")}
    assert len(names) == 6
    assert all(len(n) <= 73 and "/" not in n and n not in (".", "..") for n in names)
    assert bounded_name("refund-A-1001").startswith("refund-A-1001-")


@pytest.mark.parametrize("run_id", ["監査" * 12, "refund-" + "x" * 213], ids=["japanese-24", "ascii-220"])
async def test_a_long_or_non_ascii_workflow_id_completes_with_every_record_in_the_sink(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, run_id: str
) -> None:
    audit_dir = tmp_path / "audit"
    assert len(run_id) in (24, 220)
    async with running_worker(dev_env.client, audit=AuditActivities(sink=JsonlAuditSink(audit_dir))) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND[:1]), run_id=run_id)
        outcome = await asyncio.wait_for(run_outcome(handle), 30)
        trail = await audit_collected(dev_env.client, run_id, str(audit_dir))
    assert outcome.state == S.COMPLETED
    assert trail.missing == [] and [r.seq for r in trail.line()] == list(range(1, trail.written + 1))
    assert (audit_path(audit_dir, run_id, trail.current_run_id).parent / "workflow_id").read_text() == run_id + "\n"


async def test_the_end_records_reach_the_sink_where_the_server_cannot_list_runs(
    ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """The time-skipping test server lists no runs: the audit collector looks at each run that
    named itself instead (a describe each), and the end's records reach the sink all the same."""
    audit_dir = tmp_path / "audit"
    async with running_worker(ts_env.client, audit=AuditActivities(sink=JsonlAuditSink(audit_dir))) as worker:
        handles = [await start_run(ts_env.client, worker, make_request(REFUND[:1])) for _ in range(3)]
        for handle in handles:
            assert (await run_outcome(handle)).state == S.COMPLETED
        trails = [await audit_collected(ts_env.client, h.id, str(audit_dir)) for h in handles]
    for trail in trails:
        assert trail.missing == [] and [r.seq for r in trail.branches[0].records] == list(range(1, trail.written + 1))


async def test_a_view_the_collector_cannot_read_is_logged_and_the_others_are_written(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run closed with a view no worker of ours wrote (a poller without the code, another
    build): the collector says so and goes on; the run beside it gets its records."""
    from tether.audit.collector import AuditCollector

    async with running_worker(dev_env.client, audit=AuditActivities(sink=JsonlAuditSink(tmp_path / "first"))) as worker:
        good = await start_run(dev_env.client, worker, make_request(REFUND[:1]))
        assert (await run_outcome(good)).state == S.COMPLETED
        queue = worker.task_queue
    # No worker polls the queue now: this run closes with the memo its starter gave it.
    bad = await dev_env.client.start_workflow(
        "AgentRun", make_request(REFUND[:1]), id=unique("forged-view"), task_queue=queue, memo={"tether": b"not a view"},
    )
    await bad.terminate("closed with a view no worker wrote")
    root = tmp_path / "second"
    collector = AuditCollector(dev_env.client, JsonlAuditSink(root), publics=KeyRing.from_env().public_keys())
    collector.task_queue = queue
    collector._loop = asyncio.get_running_loop()
    task = asyncio.create_task(collector.collect())
    try:
        collector.named(bad.id, bad.result_run_id)
        collector.named(good.id, (await good.describe()).run_id)
        trail = await audit_collected(dev_env.client, good.id, str(root))
    finally:
        task.cancel()
    assert trail.missing == [] and [r.seq for r in trail.branches[0].records] == list(range(1, trail.written + 1))
    logged = [r.getMessage() for r in caplog.records if r.name == "tether.audit"]
    assert any(bad.id in m and "cannot read" in m for m in logged), logged


async def test_a_sink_that_cannot_write_stops_the_write_shows_on_the_run_and_catches_up(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    from temporalio.contrib.pydantic import pydantic_data_converter

    from tether.metrics import prometheus_runtime
    from tests.helpers.metrics import scrape, value
    from tests.helpers.ports import free_port

    root = tmp_path / "audit"
    root.mkdir()
    port = free_port()
    metered = await tether_client.connect(
        target_host=dev_env.client.service_client.config.target_host, namespace=dev_env.client.namespace,
        runtime=prometheus_runtime(f"127.0.0.1:{port}"), data_converter=pydantic_data_converter,
    )
    async with running_worker(metered, policy=POLICY, audit=AuditActivities(sink=JsonlAuditSink(root))) as worker:
        cli = Cli(dev_env, worker)
        handle = await start_run(dev_env.client, worker, make_request(REFUND))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        while snap.audit_waiting:  # the records of its rest are in: the sink fails for the write's
            await asyncio.sleep(0.02)
            snap = await tether_client.snapshot(dev_env.client, handle.id)
        key = f"{handle.id}:{snap.plan.steps[1].tool_call_id}"
        # The sink's folder becomes a file: no folder can be created under it.
        shutil.move(root, tmp_path / "aside")
        root.write_text("not a folder")
        await handle.signal("approve", approval_for(snap, "bob"))
        snap = await wait_for_audit_error(dev_env, handle)
        assert "audit sink failing" in snap.audit_error and "NotADirectoryError" in snap.audit_error
        # The records reach the sink where the run rests: here, just before the write.
        assert snap.state == S.EXECUTING_TOOL and snap.audit_waiting >= 1
        code, out, err = await cli("status", handle.id)
        assert code == 0 and "audit      audit sink failing" in out, (out, err)
        details = (await handle.query("__temporal_workflow_metadata")).current_details
        assert "**Audit sink:** audit sink failing" in details  # the Web UI's details say it too
        code, out, err = await cli("timeline", handle.id, "--all", env={"TETHER_AUDIT_DIR": str(tmp_path / "aside")})
        assert code == 1 and "cannot write to its audit sink" in err, (out, err)
        await asyncio.sleep(1)
        assert billing.refunds(key) == []  # no write starts while records before it are not in the sink
        assert value(scrape(port), "tether_audit_sink_failures", sink="JsonlAuditSink") >= 3
        root.unlink()
        shutil.move(tmp_path / "aside", root)
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
        trail = await audit_collected(dev_env.client, handle.id, str(root))
    await assert_replays(handle)  # the failed attempts, the retry timers and the patch replay
    assert outcome.state == S.COMPLETED and len(billing.refunds(key)) == 1
    assert trail.missing == [] and trail.audit_error is None
    stream = trail.branches[0].records
    assert [r.seq for r in stream] == list(range(1, trail.written + 1)) and not trail.branches[0].from_window


async def test_timeline_all_warns_and_exits_1_when_the_sink_lacks_records(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    async with running_worker(dev_env.client, audit=AuditActivities(sink=JsonlAuditSink(tmp_path / "real"))) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND[:1]))
        await asyncio.wait_for(handle.result(), 30)
        cli = Cli(dev_env, worker)
        code, out, err = await cli("timeline", handle.id, "--all", env={"TETHER_AUDIT_DIR": str(tmp_path / "typo")})
        assert code == 1 and "warning: the audit sink (JSON lines under" in err and "holds 0 of the" in err, (out, err)
        assert "COMPLETED" in out  # the run's own window is still shown
        code, out, err = await cli("timeline", handle.id, "--all", "--json", env={"TETHER_AUDIT_DIR": str(tmp_path / "real")})
        assert code == 0 and err == "", err
        assert json.loads(out)["missing"] == []


@pytest.mark.parametrize("sink", ["jsonl", "postgres"])
async def test_timeline_all_has_every_record_once_after_a_kill_during_the_sink_write(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, request: pytest.FixtureRequest, sink: str
) -> None:
    """A worker SIGKILLed in the middle of a sink write (half a line on disk; an uncommitted
    transaction holding some of the batch): the next worker writes the batch again, once."""
    import signal
    import subprocess
    import sys
    from datetime import timedelta

    dsn = request.getfixturevalue("postgres") if sink == "postgres" else None
    audit_dir, marker, queue = tmp_path / "audit", tmp_path / "torn", unique("audit-kill")
    env = {**os.environ, "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.audit_kill_worker", queue, dsn or str(audit_dir), str(marker)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        steps = [{"tool": "get_order", "args": {"order_id": "A-1001"}}] * 3
        # A short workflow task timeout: the killed worker's task is retried by the next one sooner.
        handle = await dev_env.client.start_workflow(
            "AgentRun", make_request(steps), id=unique("run"), task_queue=queue,
            task_timeout=timedelta(seconds=2), result_type=RunOutcome,
        )
        for _ in range(600):
            if marker.exists():
                break
            await asyncio.sleep(0.05)
        assert marker.exists(), "the worker never reached the sink write"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    sink_now = PostgresAuditSink(dsn) if dsn else JsonlAuditSink(audit_dir)
    async with running_worker(dev_env.client, task_queue=queue, audit=AuditActivities(sink=sink_now)):
        outcome = await asyncio.wait_for(run_outcome(handle), 90)
        trail = await audit_collected(dev_env.client, handle.id, None if dsn else str(audit_dir), dsn=dsn)
    assert outcome.state == S.COMPLETED, [r.reason for r in outcome.timeline]
    assert trail.missing == [] and len(trail.branches) == 1
    stream = trail.branches[0]
    seqs = [r.seq for r in stream.records]
    assert seqs == list(range(1, trail.written + 1)), seqs  # every record once, from the sink alone
    assert not stream.from_window and stream.run_id == trail.first_run_id
    if dsn:
        await sink_now.aclose()


async def test_a_reset_with_the_postgres_sink_keeps_both_branches_and_the_table_is_append_only(
    dev_env: WorkflowEnvironment, billing: Billing, postgres: str
) -> None:
    import psycopg

    trail, original, new, cli = await reset_scenario_with(
        dev_env, PostgresAuditSink(postgres), cli_env={"TETHER_AUDIT_DSN": postgres}, dsn=postgres
    )
    assert_two_branches(trail, original, new, cli)
    async with await psycopg.AsyncConnection.connect(postgres, autocommit=True) as conn:
        rows = await (await conn.execute(
            "SELECT run_id, count(*), count(DISTINCT seq) FROM tether_audit WHERE workflow_id = %s GROUP BY run_id",
            (trail.workflow_id,),
        )).fetchall()
        assert sorted(rows) == sorted((b.run_id, len(b.records), len(b.records)) for b in trail.branches)
        for statement in ("UPDATE tether_audit SET seq = seq + 1000", "DELETE FROM tether_audit"):
            with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
                await conn.execute(statement)


class SlowRules(PolicyActivities):
    """The policy activities, with a decision check that takes ``delay`` seconds (a policy file
    on a slow share, a signature service far away)."""

    def __init__(self, delay: float) -> None:
        super().__init__(POLICY)
        self.delay = delay
        self.started = asyncio.Event()

    async def policy_snapshot(self, request: SnapshotRequest) -> PolicySnapshot:
        # No roster (as a snapshot of a build before rosters): every decision is this check's.
        return (await super().policy_snapshot(request)).model_copy(update={"rosters": []})

    @activity.defn(name="policy_check_decision")
    async def check_decision(self, check: DecisionCheck) -> Verdict:
        self.started.set()
        await asyncio.sleep(self.delay)
        return await super().check_decision(check)


async def test_alices_self_approval_and_a_stale_hash_through_tether_approve_are_on_the_record(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)
        handle = await start_run(dev_env.client, worker, make_request(REFUND, requested_by="alice"))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        (code, out, err), (code2, out2, err2) = [
            await cli("approve", handle.id, "--by", "alice", "--unreviewed", "--decision-id", "self"),
            await cli("approve", handle.id, "--by", "bob", "--plan-hash", "0" * 64, "--decision-id", "stale"),
        ]
        assert code == 1 and "[rule: four_eyes]" in err, (out, err)
        assert code2 == 1 and "[rule: stale_plan_hash]" in err2, (out2, err2)
        code, out, err = await cli("timeline", handle.id)
        assert code == 0
        refused = {r.refs.decision_id: r for r in await tether_client.timeline(dev_env.client, handle.id) if r.kind == "refused"}
        assert (refused["self"].rule, refused["self"].actor) == ("four_eyes", "user:alice")
        assert (refused["stale"].rule, refused["stale"].actor) == ("stale_plan_hash", "user:bob")
        assert "[four_eyes]" in out and "[stale_plan_hash]" in out
        snap = await tether_client.snapshot(dev_env.client, handle.id)
        assert snap.refusals == {"four_eyes user:alice": 1, "stale_plan_hash user:bob": 1}
        code, out, err = await cli("status", handle.id)
        assert "decision   stale by user:bob: refused" in out and "[rule: stale_plan_hash]" in out, out
        await handle.cancel()


async def test_a_cancel_during_a_slow_policy_check_answers_the_decision_and_ends_canceled(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    from datetime import timedelta

    rules = SlowRules(delay=30)
    async with running_worker(dev_env.client, policy=POLICY, rules=rules) as worker:
        # The check runs inside a workflow task, which takes in the cancel when it heartbeats (at
        # 80% of the task timeout): a short one, so the test does not wait 8 s for it.
        handle = await dev_env.client.start_workflow(
            "AgentRun", make_request(REFUND), id=unique("run"), task_queue=worker.task_queue,
            task_timeout=timedelta(seconds=2), result_type=RunOutcome,
        )
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        decision = DecideRequest(kind="approve", **approval_for(snap, "bob", "slow-one").model_dump())
        update = asyncio.create_task(handle.execute_update("decide", decision, result_type=DecideResult))
        await asyncio.wait_for(rules.started.wait(), 10)
        await handle.cancel(reason="withdrawn")
        verdict = await asyncio.wait_for(update, 15)  # answered, not left open for good
        assert (verdict.outcome, verdict.rule, verdict.state) == ("refused", "run_ended", S.CANCELLED), verdict
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 15)
        assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
        snap = await tether_client.snapshot(dev_env.client, handle.id)
        records = await tether_client.timeline(dev_env.client, handle.id)
    await assert_replays(handle)
    assert snap.state == S.CANCELLED
    assert [r.rule for r in records if r.refs.decision_id == "slow-one"] == ["run_ended"]


class FailingRules(SlowRules):
    """A decision check that fails for good (a broken signature service): the run fails."""

    @activity.defn(name="policy_check_decision")
    async def check_decision(self, check: DecisionCheck) -> Verdict:
        self.started.set()
        await asyncio.sleep(self.delay)
        raise ApplicationError("signature service gone", type="policy_unavailable", non_retryable=True)


async def test_a_run_that_fails_during_a_policy_check_answers_the_decision(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(dev_env.client, policy=POLICY, rules=FailingRules(delay=0.5)) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        decision = DecideRequest(kind="approve", **approval_for(snap, "bob", "doomed").model_dump())
        verdict = await asyncio.wait_for(handle.execute_update("decide", decision, result_type=DecideResult), 15)
        assert (verdict.outcome, verdict.rule) == ("refused", "run_ended"), verdict
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 15)
        assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED


async def test_a_slow_verdict_is_accepted_verdict_pending_exit_3_and_status_shows_it_later(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    rules = SlowRules(delay=2.5)
    async with running_worker(dev_env.client, policy=POLICY, rules=rules) as worker:
        cli = Cli(dev_env, worker)
        handle = await start_run(dev_env.client, worker, make_request(REFUND))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        code, out, err = await cli("approve", handle.id, "--by", "bob", "--unreviewed", "--decision-id", "slow", env={"TETHER_VERDICT_TIMEOUT": "1"})
        assert code == 3, (out, err)
        assert "decision slow accepted, verdict pending" in out and err == "", (out, err)
        outcome = await asyncio.wait_for(run_outcome(handle), 30)
        assert outcome.state == S.COMPLETED
        code, out, err = await cli("status", handle.id)
    assert code == 0 and "decision   slow by user:bob: APPROVED" in out, (out, err)


async def _both_branches_collected(client, run_id: str, audit_dir: str):  # type: ignore[no-untyped-def]
    while True:
        trail = await audit_collected(client, run_id, audit_dir)
        first = trail.branches[0]
        if len(trail.branches) == 2 and first.records and first.records[-1].to_state == S.COMPLETED:
            return trail
        await asyncio.sleep(0.05)


async def test_a_reset_to_a_later_point_shares_the_records_before_it(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    audit_dir = tmp_path / "audit"
    async with running_worker(dev_env.client, policy=POLICY, audit=AuditActivities(sink=JsonlAuditSink(audit_dir))) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND))
        await approve(handle, "bob")
        assert (await asyncio.wait_for(handle.result(), 30)).state == S.COMPLETED
        # To the task that asked the planner for the last time: the new run plans again and ends.
        events = (await handle.fetch_history()).events
        last_plan = max(e.event_id for e in events if e.HasField("activity_task_scheduled_event_attributes")
                        and e.activity_task_scheduled_event_attributes.activity_type.name == "plan")
        point = max(e.event_id for e in events if e.HasField("workflow_task_completed_event_attributes") and e.event_id < last_plan)
        await temporal_cli(
            dev_env, "workflow", "reset", "--workflow-id", handle.id, "--event-id", str(point),
            "--reason", "re-run the last step",
        )
        reset = dev_env.client.get_workflow_handle(handle.id, result_type=RunOutcome)
        assert (await asyncio.wait_for(reset.result(), 30)).state == S.COMPLETED
        # The first run's end records reach the sink from its end view, by the collector, on their
        # own time: wait for them too, not only for the current run's.
        trail = await asyncio.wait_for(_both_branches_collected(dev_env.client, handle.id, str(audit_dir)), 60)
    first, second = trail.branches
    assert second.origin == "reset" and second.parent_run_id == first.run_id
    n = second.at_seq
    assert n is not None and 0 < n < len(first.records), (n, len(first.records))
    assert second.records[0].seq == n + 1 and second.records[-1].to_state == S.COMPLETED
    line = trail.line()
    assert [r.seq for r in line] == list(range(1, trail.written + 1)) and trail.missing == []
    assert line[:n] == first.records[:n]  # shared up to the reset point, the new run's after it




async def test_a_sink_folder_that_cannot_be_created_keeps_the_end_records_in_the_view_until_fixed(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only run rests only at its end: it closes and leaves its records with its end
    view; the worker's audit collector cannot write them, says so (log, metric) and retries
    until the sink is fixed. Meanwhile the records are on the run's view, and timeline --all
    names them missing."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the sink's parent folder should be")
    root = blocker / "audit"
    async with running_worker(dev_env.client, audit=AuditActivities(sink=JsonlAuditSink(root))) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND[:1]))
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
        assert outcome.state == S.COMPLETED
        while not (logged := [r.getMessage() for r in caplog.records if r.name == "tether.audit"]):
            await asyncio.sleep(0.05)
        assert f"for workflow {handle.id}" in logged[0] and "NotADirectoryError" in logged[0], logged
        assert "left at its end" in logged[0] and "tries again" in logged[0], logged
        view = await tether_client.published_view(await handle.describe())
        assert view.snapshot.audit_waiting == view.snapshot.timeline_records == outcome.records
        assert [r.seq for r in view.timeline] == list(range(1, outcome.records + 1))
        blocker.unlink()
        trail = await audit_collected(dev_env.client, handle.id, str(root))
    assert trail.missing == []
    assert [r.seq for r in trail.branches[0].records] == list(range(1, trail.written + 1))


async def test_a_postgres_outage_shows_on_the_run_and_the_run_completes_once_it_is_back(
    dev_env: WorkflowEnvironment, billing: Billing, postgres_server: Postgres
) -> None:
    sink = PostgresAuditSink(postgres_server.dsn)
    async with running_worker(dev_env.client, policy=POLICY, audit=AuditActivities(sink=sink)) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        while snap.audit_waiting:  # the records of its rest are in: the sink fails for the write's
            await asyncio.sleep(0.02)
            snap = await tether_client.snapshot(dev_env.client, handle.id)
        key = f"{handle.id}:{snap.plan.steps[1].tool_call_id}"
        postgres_server.stop()
        try:
            await handle.signal("approve", approval_for(snap, "bob"))
            snap = await wait_for_audit_error(dev_env, handle)
            assert "PostgreSQL postgresql://tether@127.0.0.1" in snap.audit_error, snap.audit_error
            assert billing.refunds(key) == []  # the refund waits for the record of its approval
        finally:
            postgres_server.start()
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
        trail = await audit_collected(dev_env.client, handle.id, dsn=postgres_server.dsn)
    await sink.aclose()
    assert outcome.state == S.COMPLETED and len(billing.refunds(key)) == 1
    assert trail.missing == [] and [r.seq for r in trail.branches[0].records] == list(range(1, trail.written + 1))


def test_the_sink_is_chosen_from_the_environment_and_a_dsn_never_shows_its_password(monkeypatch) -> None:
    from tether.audit.sink import sink_from_env
    from tether.store.postgres import redact_dsn

    assert redact_dsn("postgresql://tether:s3cret@db:5432/audit") == "postgresql://tether:***@db:5432/audit"
    assert "s3cret" not in redact_dsn("host=db password=s3cret dbname=audit")
    monkeypatch.setenv("TETHER_AUDIT_DSN", "postgresql://tether:s3cret@db/audit")
    sink = sink_from_env()
    assert isinstance(sink, PostgresAuditSink) and "s3cret" not in sink.describe()
    assert isinstance(sink_from_env("/some/dir"), JsonlAuditSink)  # --audit-dir picks the files
    monkeypatch.setenv("TETHER_AUDIT_DSN", "mysql://x:s3cret@db/audit")
    with pytest.raises(ValueError, match="postgresql://") as bad:
        sink_from_env()
    assert "s3cret" not in str(bad.value)



def signed(workflow_id: str, run_id: str, records: list) -> None:
    """Sign records as the workflow code does (the fleet's ring): for a sink written by hand."""
    from workflows import keys as ring_math
    from workflows.states import record_link

    ring = KeyRing.from_env()
    for r in records:
        r.sig = ring.sign_statement(ring_math.record_statement(workflow_id, run_id, r.seq, record_link(r)))


async def test_timeline_all_of_a_run_temporal_no_longer_has_shows_the_sink(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    # Past Temporal's retention the audit sink is the record: shown, with a warning that it could
    # not be checked against the run; a gap in it still fails.
    from datetime import datetime, timezone

    from workflows.wire import AuditBatch
    from workflows.states import Lifecycle

    lifecycle = Lifecycle()
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for state in (S.PLANNING, S.VALIDATED, S.EXECUTING_TOOL):
        lifecycle.move(state, at=at, actor="runtime", reason="then")
    gone, sink = unique("gone"), JsonlAuditSink(tmp_path)
    signed(gone, "r-1", lifecycle.timeline)  # what the fleet's workers wrote
    await sink.append(AuditBatch(workflow_id=gone, first_run_id="r-1", run_id="r-1", records=lifecycle.timeline))
    trail = await tether_client.audit_trail(dev_env.client, gone, str(tmp_path))
    assert trail.unchecked and "no run" in trail.unchecked and trail.missing == []
    assert [r.seq for r in trail.line()] == [1, 2, 3] and trail.current_run_id == "r-1"
    async with running_worker(dev_env.client) as worker:
        cli = Cli(dev_env, worker)
        code, out, err = await cli("timeline", gone, "--all", "--audit-dir", str(tmp_path))
        assert code == 0 and "EXECUTING_TOOL" in out and "was not checked" in err, (out, err)
        code, out, err = await cli("timeline", unique("never"), "--all", "--audit-dir", str(tmp_path))
        assert code == 2 and "neither Temporal nor the audit sink" in err, (out, err)
    lifecycle.move(S.OBSERVING_RESULT, at=at, actor="runtime", reason="a record the sink lost")
    lifecycle.move(S.COMPLETED, at=at, actor="runtime", reason="done")
    signed(gone, "r-1", lifecycle.timeline[-1:])
    await sink.append(AuditBatch(workflow_id=gone, first_run_id="r-1", run_id="r-1", records=[lifecycle.timeline[-1]]))
    trail = await tether_client.audit_trail(dev_env.client, gone, str(tmp_path))
    assert trail.missing == [4]


async def test_a_killed_workers_runs_reach_the_sink_through_another_workers_sweep(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any worker of the fleet collects (issue 46): a worker SIGKILLed before it wrote the end
    records of the runs whose last task it ran. The other worker of the queue, running since
    before those runs closed (its start-up catch-up cannot see them), sweeps them into the sink
    while it runs; every record of every run, once."""
    import signal
    import subprocess
    import sys

    from temporalio.api.enums.v1 import EventType

    root, marker, queue = tmp_path / "audit", tmp_path / "held", unique("sweep")
    marker.touch()
    monkeypatch.setenv("TETHER_AUDIT_SWEEP_SECONDS", "1")  # the default is 30 s; the same sweep
    env = {**os.environ, "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.audit_kill_worker", queue, str(tmp_path / "never"), str(marker), "held"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )

    async def last_task_by(handle: WorkflowHandle) -> str:
        events = (await handle.fetch_history()).events
        done = [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED]
        return done[-1].workflow_task_completed_event_attributes.identity

    handles: list[WorkflowHandle] = []
    try:
        assert proc.stdout is not None and (await asyncio.to_thread(proc.stdout.readline)).strip() == b"worker ready"
        async with running_worker(dev_env.client, task_queue=queue, audit=AuditActivities(sink=JsonlAuditSink(root))) as worker:
            held: set[str] = set()
            while not held:  # rounds of six runs until the doomed worker ended some of them
                batch = [await start_run(dev_env.client, worker, make_request(REFUND[:1])) for _ in range(6)]
                for handle in batch:  # its result only: a query would replay the run here
                    assert RunOutcome.model_validate(await handle.result()).state == S.COMPLETED
                handles += batch
                held = {h.id for h in batch if (await last_task_by(h)).startswith(f"{proc.pid}@")}
            # Its collector has taken them (and holds them, writing nothing) before it is killed.
            while not held <= set(marker.read_text().split()):
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            # The sink and the runs' published views only: a query would replay a run's end on
            # this worker, and that names the run to its collector.
            sink = JsonlAuditSink(root)
            for handle in handles:
                description = await handle.describe()
                view = await tether_client.published_view(description)
                assert view is not None and view.snapshot.audit_waiting > 0  # left for a collector
                while [r.seq for r in (await sink.read(handle.id)).get(description.run_id, [])] != list(
                    range(1, view.snapshot.timeline_records + 1)
                ):
                    await asyncio.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
