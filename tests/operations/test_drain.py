"""The drain procedure (docs/changing-workflows.md): a worker build replays only the runs it
started, and `tether drain` lists the open runs an older build started, exiting 1 until none is
left. An older build's run is made here the way one looks on the server: an `AgentRun` whose
first task another build's worker took and marked with its own build id."""

from __future__ import annotations

import asyncio
import json

from temporalio import workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from tests.helpers.billing import Billing
from tests.helpers.runs import make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.cli import Cli
from workflows.published import BUILD, CHANGE_VERSION_ATTRIBUTE, PREVIOUS_BUILD


@workflow.defn(name="AgentRun")
class OlderBuild:
    """Stands for an older build's AgentRun: its marker, then it waits (for a decision)."""

    @workflow.run
    async def run(self, *args: object) -> None:
        workflow.patched("tether-build-5")
        await workflow.wait_condition(lambda: False)


@workflow.defn(name="AgentRun")
class PreviousBuild:
    """Stands for the previous build's AgentRun, which this build replays: never drained."""

    @workflow.run
    async def run(self, *args: object) -> None:
        workflow.patched(PREVIOUS_BUILD)
        await workflow.wait_condition(lambda: False)


async def test_drain_lists_the_older_builds_open_runs_until_they_end(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    client = dev_env.client
    old_queue = unique("tq-old")
    async with running_worker(client) as worker:  # this build
        cli = Cli(dev_env, worker)
        ours = await start_run(client, worker, make_request([{"tool": "issue_refund", "args": {
            "order_id": "A-1002", "amount_cents": 101, "reason": "drain"}}]))
        await wait_for_state(ours, "AWAITING_APPROVAL")
        # Unsandboxed: the sandbox would re-import this test module.
        previous_queue = unique("tq-previous")
        async with Worker(client, task_queue=old_queue, workflows=[OlderBuild], workflow_runner=UnsandboxedWorkflowRunner()), \
                Worker(client, task_queue=previous_queue, workflows=[PreviousBuild], workflow_runner=UnsandboxedWorkflowRunner()):
            old = await client.start_workflow("AgentRun", make_request(), id=unique("old"), task_queue=old_queue)
            previous = await client.start_workflow("AgentRun", make_request(), id=unique("previous"), task_queue=previous_queue)
            for run in (old, previous):
                for _ in range(6000):  # until its first task has written its build's marker
                    if (await run.describe()).typed_search_attributes.get(CHANGE_VERSION_ATTRIBUTE):
                        break
                    await asyncio.sleep(0.05)
            code, out, err = await cli("drain", "--json")
            assert code == 1, (out, err)
            listed = {row["run_id"] for row in json.loads(out)}
            assert old.id in listed and ours.id not in listed
            assert previous.id not in listed  # this build replays it: no old worker needed
            await old.terminate("drained")
            await previous.terminate("test over")
        code, out, err = await cli("drain")
        assert old.id not in out and ours.id not in out, out
        assert (code == 0) == ("no open run needs an older build than " + BUILD in out), (code, out)
        await ours.terminate("test over")
