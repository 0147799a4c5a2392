"""A run whose tool no worker serves waits (issue 58: a worker restarted with other tools took
the approved email run's write, answered `unknown_tool`, and the run ended EXECUTION_FAILED with
bob's approval spent). The tool was never called: the run says which tool it waits for, keeps
the approval, and the write runs once (one email) when a worker that serves the tool polls."""

from __future__ import annotations

import asyncio
import uuid

from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

import examples.billing.tools  # noqa: F401 (registers the billing tools)
import tether.client as tether_client
from tether.tools.sdk import REGISTRY, ToolRegistry
from tests.helpers.billing import counts_in_db
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state


async def test_an_approved_write_whose_tool_no_worker_serves_waits_then_runs_once(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    client = dev_env.client
    queue = unique("missing-tool")
    email = [{"tool": "send_email", "args": {"to": f"{uuid.uuid4().hex[:8]}@example.com", "subject": "s", "body": "b"}}]
    async with running_worker(client, task_queue=queue) as worker:
        handle = await start_run(client, worker, make_request(email))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    # The worker comes back with other tools (the user's own module, without send_email).
    others = ToolRegistry()
    for name, spec in REGISTRY.tools.items():
        if name != "send_email":
            others.register(spec)
    async with running_worker(client, task_queue=queue, registry=others):
        await handle.signal("approve", approval_for(snap, "bob"))
        while True:  # the write reached a worker without the tool: the run says so, and waits
            shown = await tether_client.status(client, handle.id)
            if shown.last_error and shown.last_error.startswith("unknown_tool: "):
                break
            assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING, shown
            await asyncio.sleep(0.1)
        assert "(send_email)" in shown.last_error and "--tools" in shown.last_error, shown.last_error
        assert shown.state.value == "EXECUTING_TOOL", shown
        assert counts_in_db(billing, handle.id)["emails"] == 0
    # A worker that serves it: the write runs, once, on the approval given.
    async with running_worker(client, task_queue=queue):
        outcome = await tether_client.run_outcome(handle)
    assert outcome.state.value == "COMPLETED", outcome
    assert counts_in_db(billing, handle.id)["emails"] == 1
