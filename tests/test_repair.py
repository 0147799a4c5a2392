"""Stuck runs are found and healed (issue 34): a build that records a history today's code cannot
replay and then fails every workflow task leaves a run stuck; `tether list --stuck` and `tether
status` show it with the error; `tether repair` resets it to the last workflow task that replays,
signals applied again, and today's worker brings it to completion with every write once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from temporalio.testing import WorkflowEnvironment

import client as tether_client
import worker as worker_module
from client import run_outcome
from tests.conftest import Billing, audit_collected, approval_for, make_request, running_worker, start_run, unique, wait_for_state
from tests.tampered import BROKEN, TamperedAgentRun
from tests.test_dev_server import Cli
from workflows.run_state import RunOutcome

REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1003", "amount_cents": 777, "reason": "repair"}}]


async def wait_stuck(env: WorkflowEnvironment, run_id: str) -> tether_client.StuckTask:
    """Until the run's workflow task has failed and is being tried again."""
    for _ in range(600):
        stuck = await tether_client.stuck_task(env.client, await env.client.get_workflow_handle(run_id).describe())
        if stuck is not None:
            return stuck
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id} never got stuck")


async def test_a_stuck_run_is_listed_with_its_error_and_repair_brings_it_to_completion_writing_once(
    dev_env: WorkflowEnvironment, billing: Billing, monkeypatch
) -> None:
    queue = unique("repair")
    with monkeypatch.context() as m:
        m.setattr(worker_module, "AgentRun", TamperedAgentRun)
        broken = worker_module.create_worker(dev_env.client, task_queue=queue)
    async with broken:
        handle = await start_run(dev_env.client, broken, make_request(REFUND))
        await handle.signal("approve", approval_for(await wait_for_state(handle, "AWAITING_APPROVAL"), "bob"))
        stuck = await wait_stuck(dev_env, handle.id)
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
