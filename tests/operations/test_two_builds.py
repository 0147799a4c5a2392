"""A fleet with workers of two builds on one unversioned task queue (issue 46): what `tether`
reads and sends does not hinge on which build's worker answers. A newer build's worker does not
replay an older build's run (older_build): a query it takes fails. `tether approve` reads the
run's published view and decides through the Update, which the run's own build judges."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tether.client import TetherError
from tests.helpers.build_worker import start_build_worker
from tests.helpers.billing import Billing
from tests.helpers.runs import make_request, running_worker, start_run, unique
from tests.helpers.waiting import task_failure, wait_for_state
from tests.helpers.cli import Cli
from tests.helpers.waiting import wait_published
from tests.helpers.builds import other_build

REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 250, "reason": "two builds"}}]


async def test_an_older_builds_run_is_approved_while_a_newer_builds_worker_polls(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    client = dev_env.client
    queue = unique("two-builds")
    older = other_build(-2)
    old = await start_build_worker(dev_env, queue, older)
    try:
        run = await start_run(client, SimpleNamespace(task_queue=queue), make_request(REFUND))  # type: ignore[arg-type]
        await wait_for_state(run, "AWAITING_APPROVAL")
        await wait_published(dev_env, run.id, "AWAITING_APPROVAL")
        await old.stop()  # its cache goes with it: the run's next task goes to whoever polls the queue
        async with running_worker(client, task_queue=queue):  # this build, the newer one
            # The hazard: a query lands on the newer build, which does not replay the run.
            with pytest.raises(TetherError, match="older_build"):
                await tether_client.snapshot(client, run.id)
            cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
            approving = asyncio.create_task(cli("approve", run.id, "--by", "bob", "--unreviewed",
                                                env={"TETHER_VERDICT_TIMEOUT": "600"}))
            # The decision reached the run: the newer build took the task carrying it, and failed it.
            failed = asyncio.create_task(task_failure(client, run.id, "older_build"))
            done, _ = await asyncio.wait({approving, failed}, return_when=asyncio.FIRST_COMPLETED)
            assert failed in done, await approving  # approve must not give up on the newer build's answer
            old = await start_build_worker(dev_env, queue, older)
            code, out, err = await approving
            assert code == 0, (code, out, err)
            result = await run.result()
            assert result.state.value == "COMPLETED", result
    finally:
        await old.kill()


async def test_drain_compares_builds_by_their_order(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    client = dev_env.client
    queue = unique("drain-order")
    runs = {}
    for step in (-2, 1):
        worker = await start_build_worker(dev_env, queue, other_build(step))
        try:
            runs[step] = await start_run(client, SimpleNamespace(task_queue=queue), make_request(REFUND))  # type: ignore[arg-type]
            await wait_published(dev_env, runs[step].id, "AWAITING_APPROVAL")
        finally:
            await worker.stop()
    cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
    code, out, err = await cli("drain", "--json")
    listed = {row["run_id"] for row in json.loads(out)}
    assert code == 1 and runs[-2].id in listed and runs[1].id not in listed, (code, out, err)
    for handle in runs.values():
        await handle.terminate("test over")


async def test_no_worker_of_the_runs_build_left_approve_says_so_and_sends_nothing(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    client = dev_env.client
    queue = unique("gone-build")
    old = await start_build_worker(dev_env, queue, other_build(-2))
    try:
        run = await start_run(client, SimpleNamespace(task_queue=queue), make_request(REFUND))  # type: ignore[arg-type]
        await wait_published(dev_env, run.id, "AWAITING_APPROVAL")
    finally:
        await old.stop()
    async with running_worker(client, task_queue=queue):  # only the newer build polls
        cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
        code, out, err = await cli("approve", run.id, "--by", "bob", "--unreviewed", env={"TETHER_VERDICT_TIMEOUT": "3"})
        assert code == 2 and "keeps failing" in err and "own build" in err, (code, out, err)
        assert len(err.strip().splitlines()) == 1, err
        await task_failure(client, run.id, "older_build")
        # Nothing reached the run's record: its view still waits for the same request.
        code, out, err = await cli("status", run.id)
        assert code == 0 and "AWAITING_APPROVAL" in out and "stuck" in out, (code, out, err)
