"""Hostile input: malformed signals sent with the ``temporal`` CLI, run requests that break the
contract, CLI calls for unknown and finished runs, and a Temporal server that is down. The run
stays correct, the worker stays up, the user gets a clear one-line error, nothing is lost."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.paths import BIN, ROOT
from tests.helpers.queries import snapshot, timeline
from tests.helpers.runs import make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from tests.helpers.invariants import check_timeline, tools_by_call
from tests.helpers.cli import Cli
from workflows.run_state import RunOutcome
from workflows.states import RunState

S = RunState
REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 250, "reason": "hostile"}}]


async def temporal(env: WorkflowEnvironment, *args: str) -> tuple[int, str]:
    """The ``temporal`` CLI against the test dev server; returns (exit code, stdout+stderr)."""
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "temporal"), *args,
        "--address", env.client.service_client.config.target_host, "--namespace", env.client.namespace,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return proc.returncode, out.decode(errors="replace")


async def signal(env: WorkflowEnvironment, handle: WorkflowHandle, name: str, *input_args: str) -> tuple[int, str]:
    return await temporal(env, "workflow", "signal", "--workflow-id", handle.id, "--name", name, *input_args)


async def task_failures(handle: WorkflowHandle) -> list[str]:
    history = await handle.fetch_history()
    return [
        e.workflow_task_failed_event_attributes.failure.message
        for e in history.events
        if e.HasField("workflow_task_failed_event_attributes")
    ]


async def test_malformed_signals_change_nothing_and_the_worker_stays_up(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND))
        before = await wait_for_state(handle, "AWAITING_APPROVAL")
        plan_hash = before.plan.plan_hash
        huge = tmp_path / "huge.json"
        huge.write_text(json.dumps({"decision_id": "big", "approver": "eve", "plan_hash": plan_hash, "comment": "x" * 10_000_000}))
        sent = {
            "wrong type": await signal(dev_env, handle, "approve", "--input", '"yes, approved"'),
            "wrong field type": await signal(dev_env, handle, "approve", "--input", json.dumps(
                {"decision_id": 7, "approver": ["eve"], "plan_hash": plan_hash})),
            "missing fields": await signal(dev_env, handle, "approve", "--input", '{"approver": "eve"}'),
            "handoff wrong type": await signal(dev_env, handle, "handoff", "--input", '{"by": 5}'),
            "extra fields": await signal(dev_env, handle, "approve", "--input", json.dumps(
                {"decision_id": "extra", "approver": "eve", "plan_hash": "0" * 64, "approve_all": True})),
            "stale hash": await signal(dev_env, handle, "approve", "--input", json.dumps(
                {"decision_id": "stale", "approver": "eve", "plan_hash": "0" * 64})),
            "no input": await signal(dev_env, handle, "approve"),
            "reject, no input": await signal(dev_env, handle, "reject"),
            "handoff, no input": await signal(dev_env, handle, "handoff"),
            "null": await signal(dev_env, handle, "approve", "--input", "null"),
            "a list": await signal(dev_env, handle, "approve", "--input", "[1, 2]"),
            "two arguments": await signal(dev_env, handle, "approve", "--input", "{}", "--input", "{}"),
            "invisible name": await signal(dev_env, handle, "approve", "--input", json.dumps(
                {"decision_id": "zw", "approver": "bob\u200b", "plan_hash": plan_hash})),
            "unknown name": await signal(dev_env, handle, "approve_everything", "--input", "{}"),
            "unknown name, no input": await signal(dev_env, handle, "approve_everything"),
            "10 MB": await signal(dev_env, handle, "approve", "--input-file", str(huge)),
        }
        # The server takes every signal but the 10 MB one, which it refuses to the sender.
        assert all(code == 0 for name, (code, _) in sent.items() if name != "10 MB"), sent
        code, out = sent["10 MB"]
        assert code != 0 and ("size" in out.lower() or "limit" in out.lower() or "large" in out.lower()), out
        # A marker signal after them all: once it is on the timeline, the run has seen the rest.
        code, out = await signal(dev_env, handle, "approve", "--input", json.dumps(
            {"decision_id": "marker", "approver": "eve", "plan_hash": "f" * 64}))
        assert code == 0, out
        for _ in range(100):
            if any(r.refs.decision_id == "marker" for r in await timeline(handle)):
                break
            await asyncio.sleep(0.05)
        after = await snapshot(handle)
        assert (after.state, after.state_version) == (S.AWAITING_APPROVAL, before.state_version)
        assert after.pending_approval == before.pending_approval and after.step == 0
        records = await timeline(handle)
        # Malformed payloads are refused on the record (nothing else changes): the first few in
        # full, the rest counted; decodable but stale ones are refused as stale.
        refused = {r.refs.decision_id for r in records if r.kind == "refused" and r.refs.decision_id}
        assert refused == {"stale", "marker"}
        malformed = [r for r in records if r.rule == "malformed_signal"]
        assert len(malformed) == 4, [r.reason for r in malformed]  # three, then "counted, not recorded"
        assert "counted, not recorded" in malformed[-1].reason
        assert after.refusals["malformed_signal unknown"] == 12, after.refusals
        assert after.refusals["unknown_signal unknown"] == 2
        assert any("decision_id" in r.reason for r in malformed)
        assert all(r.kind == "refused" and r.state_version == before.state_version for r in malformed)
        assert await task_failures(handle) == [], "a hostile signal failed a workflow task"
        # Queries answer whatever they are sent.
        code, out = await temporal(dev_env, "workflow", "query", "--workflow-id", handle.id, "--name", "snapshot",
                                   "--input", '"junk"')
        assert code == 0 and "AWAITING_APPROVAL" in out, out

        # The run still works: a valid approval through the same CLI.
        code, out = await signal(dev_env, handle, "approve", "--input", json.dumps(
            {"decision_id": "good", "approver": "bob", "plan_hash": plan_hash, "request_id": before.pending_approval.request_id}))
        assert code == 0, out
        outcome = await asyncio.wait_for(run_outcome(handle), 30)
        assert outcome.state == S.COMPLETED
        check_timeline(outcome.timeline, tools_by_call(outcome))
        key = next(r.refs.idempotency_key for r in outcome.timeline if r.refs.idempotency_key)
        assert len(billing.refunds(key)) == 1
        assert await task_failures(handle) == []
        # The same worker serves a new run: it stayed up.
        again = await start_run(dev_env.client, worker, make_request([{"tool": "get_order", "args": {"order_id": "A-1001"}}]))
        assert (await asyncio.wait_for(run_outcome(again), 30)).state == S.COMPLETED


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"limits": {"max_steps": -1}}, "max_steps"),
        ({"limits": {"max_replans": -5}}, "max_replans"),
        ({"limits": {"approval_ttl_seconds": -60}}, "approval_ttl_seconds"),
        ({"goal": "g" * 1_000_000}, "goal"),
        ({"goal": ""}, "goal"),
        ({"limits": {"max_steps": 3, "surprise": 1}}, "surprise"),
    ],
    ids=["negative-steps", "negative-replans", "negative-ttl", "1MB-goal", "empty-goal", "unknown-limit"],
)
def test_run_requests_that_break_the_contract_are_refused_before_starting(fields: dict, error: str) -> None:
    with pytest.raises(ValidationError) as e:
        make_request(REFUND, **fields)
    assert error in str(e.value)


async def test_empty_playbook_and_unknown_tool_fail_the_run_with_a_reason(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(dev_env.client) as worker:
        empty = await start_run(dev_env.client, worker, make_request([]))
        unknown = await start_run(
            dev_env.client, worker, make_request([{"tool": "", "args": {}}, {"tool": "wire_money", "args": {}}],
                                                 limits={"max_replans": 0}),
        )
        outcomes = [await asyncio.wait_for(run_outcome(h), 30) for h in (empty, unknown)]
    for outcome in outcomes:
        assert outcome.state == S.FAILED and outcome.steps == []
        check_timeline(outcome.timeline, tools_by_call(outcome))
    assert "playbook has no steps" in outcomes[0].timeline[-1].reason
    failed = next(r for r in outcomes[1].timeline if r.to_state == S.VALIDATION_FAILED)
    assert "unknown tool" in failed.reason


@pytest.mark.parametrize(
    "raw",
    [
        {"goal": "g", "requested_by": "alice", "playbook": REFUND, "limits": {"max_steps": -1}},
        {"goal": "g" * 1_000_000, "requested_by": "alice", "playbook": REFUND},
        {"requested_by": "alice"},
        "not an object",
    ],
    ids=["negative-limits", "1MB-goal", "missing-goal", "wrong-type"],
)
async def test_raw_starts_that_bypass_the_model_do_not_wedge_the_worker(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, raw: object
) -> None:
    """``temporal workflow start --input`` skips the client's pydantic check: the worker must
    end such a run (failed, with the validation error) instead of retrying its first task
    forever, and keep serving other runs."""
    async with running_worker(dev_env.client) as worker:
        run_id = f"raw-{uuid.uuid4().hex[:8]}"
        payload = tmp_path / "input.json"
        payload.write_text(json.dumps(raw))
        code, out = await temporal(
            dev_env, "workflow", "start", "--type", "AgentRun", "--task-queue", worker.task_queue,
            "--workflow-id", run_id, "--input-file", str(payload),
        )
        handle = dev_env.client.get_workflow_handle(run_id)
        assert code == 0, out
        for _ in range(100):
            description = await handle.describe()
            if description.status.name != "RUNNING" or await task_failures(handle):
                break
            await asyncio.sleep(0.1)
        # The worker is up and serves other runs either way.
        ok = await start_run(dev_env.client, worker, make_request([{"tool": "get_order", "args": {"order_id": "A-1001"}}]))
        assert (await asyncio.wait_for(run_outcome(ok), 30)).state == S.COMPLETED
        failures = await task_failures(handle)
        description = await handle.describe()
        if description.status.name == "RUNNING":
            await handle.terminate(reason="test cleanup: wedged run")
    assert description.status.name == "FAILED", f"run {description.status.name}; workflow task failures: {failures}"


async def test_cli_on_unknown_and_finished_runs_gives_one_line_errors(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(dev_env.client) as worker:
        cli = Cli(dev_env, worker)
        done = await start_run(dev_env.client, worker, make_request([{"tool": "get_order", "args": {"order_id": "A-1001"}}]))
        outcome: RunOutcome = await run_outcome(done)
        unknown = f"no-such-run-{uuid.uuid4().hex[:6]}"
        calls = {
            "status": ["status", "{run}"],
            "timeline": ["timeline", "{run}"],
            "approve": ["approve", "{run}", "--by", "bob", "--unreviewed"],
            "reject": ["reject", "{run}", "--by", "bob", "--reason", "no", "--unreviewed"],
            "handoff": ["handoff", "{run}", "--by", "dana", "--reason", "r"],
            "cancel": ["cancel", "{run}", "--by", "dana", "--reason", "r"],
        }
        # The calls are independent: run them side by side (each `tether` is a new process).
        results = await asyncio.gather(
            *(cli(*[a.format(run=run) for a in argv]) for run in (unknown, done.id) for argv in calls.values())
        )
        for verb, (code, out, err) in zip(calls, results[: len(calls)]):
            assert code == 2, (verb, code, out, err)
            assert len(err.strip().splitlines()) == 1 and f"unknown run '{unknown}'" in err, (verb, err)
        for verb, (code, out, err) in zip(calls, results[len(calls):]):
            if verb in ("status", "timeline"):
                assert code == 0 and "COMPLETED" in out, (verb, out, err)
            else:
                assert code == 1, (verb, code, out, err)
                assert len(err.strip().splitlines()) == 1, (verb, err)
                assert "already finished" in err or "not awaiting approval" in err, (verb, err)
        final = await snapshot(done)
        records = await timeline(done)
    assert final.state == S.COMPLETED and final.state_version == outcome.timeline[-1].state_version
    assert records == outcome.timeline  # the refused calls never reached the finished run
    check_timeline(records, tools_by_call(outcome))


async def test_temporal_down_gives_one_line_errors(dev_env: WorkflowEnvironment, tmp_path: Path) -> None:
    playbook = tmp_path / "p.json"
    playbook.write_text(json.dumps(REFUND))
    down = {"TEMPORAL_ADDRESS": "127.0.0.1:1"}
    async with running_worker(dev_env.client) as worker:
        cli = Cli(dev_env, worker)
        for argv in (
            ["start", "--goal", "g", "--playbook", str(playbook), "--requested-by", "alice"],
            ["approve", "some-run", "--by", "bob", "--unreviewed"],
            ["handoff", "some-run", "--by", "dana", "--reason", "r"],
            ["timeline", "some-run"],
            ["list"],
        ):
            code, _, err = await cli(*argv, env=down)
            assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)
            assert "cannot reach Temporal at 127.0.0.1:1" in err, (argv, err)
    # The worker refuses to start, with one line saying why (no traceback).
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "worker.py"), "--task-queue", "nowhere",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**os.environ, **down},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode != 0
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert "cannot reach Temporal" in lines[-1] and "Traceback" not in err.decode(), err.decode()[-2000:]
