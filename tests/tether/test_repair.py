"""Stuck runs are found and healed (issue 34): a build that records a history today's code cannot
replay and then fails every workflow task leaves a run stuck; `tether list --stuck` and `tether
status` show it with the error; `tether repair` resets it to the last workflow task that replays,
signals applied again, and today's worker brings it to completion with every write once."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
import tether.repair as tether_repair
import worker as worker_module
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.paths import ROOT
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import audit_collected, wait_for_state
from tests.helpers.tampered import BROKEN, STUCK_AFTER_WRITE, StuckAfterFirstWrite, TamperedAgentRun
from tests.helpers.cli import Cli
from workflows.contract import DecideRequest, DecideResult
from workflows.run_state import RunOutcome
from tests.helpers.waiting import wait_stuck

REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1003", "amount_cents": 777, "reason": "repair"}}]


async def approved_on(env: WorkflowEnvironment, queue: str, build: type, steps: list[dict], monkeypatch,
                      how: str = "signal") -> tuple:
    """A run of ``steps`` approved by bob (a signal, or the decide Update) on a bad ``build`` of
    AgentRun, once it is stuck."""
    with monkeypatch.context() as m:
        m.setattr(worker_module, "AgentRun", build)
        broken = worker_module.create_worker(env.client, task_queue=queue)
    async with broken:
        handle = await start_run(env.client, broken, make_request(steps))
        decision = approval_for(await wait_for_state(handle, "AWAITING_APPROVAL"), "bob")
        if how == "signal":
            await handle.signal("approve", decision)
        else:
            await handle.execute_update("decide", DecideRequest(**decision.model_dump(), kind="approve"), result_type=DecideResult)
        return handle, await wait_stuck(env, handle.id)


# "update": bob is on the run's roster, so his decide Update took the approval and scheduled the
# refund in one workflow task: the reset goes back to before the Update, and applies it again.
@pytest.mark.parametrize("how", ["signal", "update"])
async def test_a_stuck_run_is_listed_with_its_error_and_repair_brings_it_to_completion_writing_once(
    dev_env: WorkflowEnvironment, billing: Billing, monkeypatch, how: str
) -> None:
    queue = unique("repair")
    handle, stuck = await approved_on(dev_env, queue, TamperedAgentRun, REFUND, monkeypatch, how)
    assert BROKEN in stuck.error and stuck.cause == "WORKFLOW_WORKER_UNHANDLED_FAILURE", stuck
    def written() -> list[str]:
        return [r["idempotency_key"] for r in billing.get("/refunds")["refunds"] if r["idempotency_key"].startswith(handle.id)]

    [key] = written()  # the write happened before it stuck

    cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
    code, out, err = await cli("list", "--stuck", "--limit", "500")
    assert code == 0 and handle.id in out and "stuck: workflow task attempt" in out and BROKEN in out, (out, err)
    code, out, err = await cli("status", handle.id, "--live")  # nobody serves it: refused, not hung
    assert code == 2, (out, err)
    # Today's build cannot replay what the broken one recorded: the run stays stuck under it too.
    async with running_worker(dev_env.client, task_queue=queue):
        code, out, err = await cli("repair", handle.id)
        assert code == 0, (out, err)
        assert "was stuck" in out and BROKEN in out and "later completed tasks that do not replay" in out, out
        assert "signals and Updates applied again: " in out and "reset run " in out, out
        code, again, err = await cli("repair", handle.id)
        assert code == 1 and ("is not stuck" in err or "only a running run" in err), (again, err)
        latest = dev_env.client.get_workflow_handle(handle.id, result_type=RunOutcome)
        outcome = await asyncio.wait_for(run_outcome(latest), 120)
    assert outcome.state.value == "COMPLETED", outcome.timeline[-3:]
    # Every write once: the new run ran the refund again under its own key, and the billing
    # service took it as the same refund.
    assert {r.refs.idempotency_key for r in outcome.timeline if r.refs.idempotency_key} == {key}
    assert written() == [key]
    trail = await audit_collected(dev_env.client, handle.id)
    assert [b.origin for b in trail.branches] == ["first", "reset"] and "tether repair" in (trail.branches[1].reason or "")


def emails(billing: Billing, to: str) -> list[dict]:
    return billing.get(f"/emails?to={to}")["emails"]


async def stuck_after_refund(env: WorkflowEnvironment, queue: str, to: str, monkeypatch) -> tuple[str, tether_client.StuckTask]:
    """A run [refund, email] approved on a bad build that fails every task from the refund's
    result on: stuck before the email, its refund written."""
    steps = [{"tool": "issue_refund", "args": {"order_id": "A-1003", "amount_cents": 555, "reason": "repair"}},
             {"tool": "send_email", "args": {"to": to, "subject": "Refund", "body": "Refunded 5.55."}}]
    handle, stuck = await approved_on(env, queue, StuckAfterFirstWrite, steps, monkeypatch)
    assert STUCK_AFTER_WRITE in stuck.error, stuck
    return handle.id, stuck


async def test_two_repairs_at_once_one_slowed_make_one_reset_and_one_email(
    dev_env: WorkflowEnvironment, billing: Billing, monkeypatch, tmp_path: Path
) -> None:
    """Issue 46: two `tether repair RUN` at once, the second slowed between judging the run and
    resetting it. The first resets it and its new run sends the approved email; the second then
    finds the run moved on (exit 1) instead of resetting the same base run again (before: a
    second reset, a second email)."""
    queue, to = unique("repair-cas"), f"{uuid.uuid4().hex[:10]}@example.com"
    run_id, _ = await stuck_after_refund(dev_env, queue, to, monkeypatch)
    base = (await dev_env.client.get_workflow_handle(run_id).describe()).run_id
    cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
    gate = tmp_path / "gate"
    # Today's worker comes only after the first repair: the stuck run's task would otherwise be
    # retried on it, which replays this history and completes the run before either repair.
    slow = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.helpers.slow_repair", str(gate), "repair", run_id, "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli.env, cwd=ROOT,
    )
    try:
        while not gate.with_suffix(".waiting").exists():  # the slow one has judged the run
            assert slow.returncode is None
            await asyncio.sleep(0.05)
        code, out, err = await cli("repair", run_id, "--json")
        assert code == 0, (out, err)
        first = tether_client.RepairResult.model_validate_json(out)
        assert first.from_run_id == base
        async with running_worker(dev_env.client, task_queue=queue):
            outcome = await asyncio.wait_for(
                run_outcome(dev_env.client.get_workflow_handle(run_id, result_type=RunOutcome)), 120
            )
        assert outcome.state.value == "COMPLETED" and len(emails(billing, to)) == 1
    finally:
        gate.touch()
        out_b, err_b = await slow.communicate()
    assert slow.returncode == 1, (out_b, err_b)
    assert f"the run moved on: run {first.to_run_id} is current (COMPLETED), not run {base}" in err_b.decode()
    # A repair naming an execution that is no longer current is refused before it judges.
    try:
        await tether_repair.repair(dev_env.client, run_id, base_run_id=base)
        raise AssertionError("a repair of an execution no longer current went through")
    except tether_client.TetherError as e:
        assert e.code == 1 and f"the run moved on: run {first.to_run_id} is current" in str(e), e
    latest = await dev_env.client.get_workflow_handle(run_id).describe()
    assert latest.run_id == first.to_run_id and latest.status.name == "COMPLETED"
    assert len(emails(billing, to)) == 1


async def test_two_resets_of_one_judgement_at_once_make_one_reset(
    dev_env: WorkflowEnvironment, billing: Billing, monkeypatch
) -> None:
    """Two resets of the same execution past the check together (Temporal's reset has no
    precondition, and does not dedupe a reset by its request id): the claim the server starts
    once lets one through; the other is refused, the run moved on. One email."""
    queue, to = unique("repair-race"), f"{uuid.uuid4().hex[:10]}@example.com"
    run_id, stuck = await stuck_after_refund(dev_env, queue, to, monkeypatch)
    base = (await dev_env.client.get_workflow_handle(run_id).describe()).run_id
    history = await dev_env.client.get_workflow_handle(run_id, run_id=base).fetch_history()
    point = max(e.event_id for e in history.events if e.HasField("workflow_task_completed_event_attributes")
                and e.event_id < stuck.event_id)
    # Both look (the real describe) before either resets: each waits for the other's look.
    look, together, looked = tether_repair.describe, asyncio.Barrier(2), []

    async def both_look_first(client, workflow_id: str):  # noqa: ANN001, ANN202
        description = await look(client, workflow_id)
        looked.append(description.run_id)
        if len(looked) <= 2:
            await together.wait()
        return description

    monkeypatch.setattr(tether_repair, "describe", both_look_first)
    # Today's worker comes after the resets (its retry of the stuck task would complete the run).
    results = await asyncio.gather(
        *(tether_repair.reset_judged(dev_env.client, run_id, base, point, f"race {n}") for n in range(2)),
        return_exceptions=True,
    )
    assert looked[:2] == [base, base]  # both judged the base run current
    [made] = [r for r in results if isinstance(r, str)]
    [refused] = [r for r in results if not isinstance(r, str)]
    assert isinstance(refused, tether_client.TetherError) and refused.code == 1, refused
    assert f"the run moved on: another repair or hand-off has reset run {base}" in str(refused), refused
    async with running_worker(dev_env.client, task_queue=queue):
        outcome = await asyncio.wait_for(
            run_outcome(dev_env.client.get_workflow_handle(run_id, result_type=RunOutcome)), 120
        )
        latest = await dev_env.client.get_workflow_handle(run_id).describe()
    assert outcome.state.value == "COMPLETED" and latest.run_id == made
    assert len(emails(billing, to)) == 1
