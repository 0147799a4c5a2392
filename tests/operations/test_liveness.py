"""Worker liveness that tells the truth (issue 41), with real worker processes.

A worker restarted in place (the same identity, as a container's PID 1 on the same host name)
has said it stopped, and its new process sends its first heartbeat only a minute later: it
serves from its first poll all the same. A worker SIGKILLed says nothing; its pollers and its
last heartbeat look alive for a minute: `tether status` still answers at once from what the run
published, and never waits on a query the dead worker would hold.
"""

from __future__ import annotations

import asyncio
from datetime import timezone
from types import SimpleNamespace

from temporalio.api.enums.v1 import TaskQueueKind, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tether.client.workers import _gone_workers
from tests.helpers.build_worker import start_build_worker
from tests.helpers.billing import Billing
from tests.helpers.runs import make_request, start_run, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.cli import Cli
from tests.helpers.waiting import wait_published
from workflows.published import BUILD
from tests.helpers.waiting import until

REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 250, "reason": "liveness"}}]
READ_ONLY = [{"tool": "get_order", "args": {"order_id": "A-1002"}}]  # runs with no approval


async def test_a_worker_restarted_in_place_serves_at_once(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    client = dev_env.client
    queue = unique("in-place")
    identity = f"1@{unique('host')}"  # PID 1 in a container, restarted on the same host name
    first = await start_build_worker(dev_env, queue, BUILD, identity=identity)
    try:
        run = await start_run(client, SimpleNamespace(task_queue=queue), make_request(REFUND))  # type: ignore[arg-type]
        await wait_for_state(run, "AWAITING_APPROVAL")
        await first.stop()
        # Its shutdown heartbeat has reached the server: with nobody polling, it is gone.
        await until(lambda: _is(tether_client.worker_serving(client, queue), False), "the stopped worker still serves")
        gone = await _gone_workers(client, queue, _now())  # noqa: SLF001
        assert gone is not None
        # As the server has it: the identity given, then the tools it serves (tether/pollers.py).
        [shown] = [i for i in gone if i.split(" ", 1)[0] == identity]
        stopped_at = gone[shown]
        assert stopped_at is not None

        second = await start_build_worker(dev_env, queue, BUILD, identity=identity)
        # Its first poll has reached the server (no heartbeat of its own yet: that comes a minute on).
        async def polled_since() -> bool:
            pollers = (await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                namespace=client.namespace, task_queue=TaskQueue(name=queue, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            ))).pollers
            return any(p.identity == shown and p.last_access_time.ToDatetime(timezone.utc) > stopped_at for p in pollers)

        await until(polled_since, "the restarted worker never polled")
        try:
            assert await tether_client.worker_serving(client, queue) is True
            cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
            code, out, err = await cli("approve", run.id, "--by", "bob", "--unreviewed")
            assert code == 0, (code, out, err)
            assert (await tether_client.run_outcome(run)).state.value == "COMPLETED"
        finally:
            await second.stop()
    finally:
        await first.kill()


async def test_status_answers_from_the_view_with_a_dead_worker(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    client = dev_env.client
    queue = unique("dead")
    worker = await start_build_worker(dev_env, queue, BUILD)
    try:
        run = await start_run(client, SimpleNamespace(task_queue=queue), make_request(REFUND))  # type: ignore[arg-type]
        await wait_for_state(run, "AWAITING_APPROVAL")
        await wait_published(dev_env, run.id, "AWAITING_APPROVAL")
    finally:
        await worker.kill()
    cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
    # Its pollers and its last heartbeat look alive; a query would wait on it and fail: status
    # answers from the published view, asking nothing of the run.
    code, out, err = await cli("status", run.id)
    assert code == 0 and "state      AWAITING_APPROVAL" in out and "view       as published at " in out, (code, out, err)


def _now():  # noqa: ANN202
    from datetime import datetime

    return datetime.now(timezone.utc)


async def _is(value, expected) -> bool:  # noqa: ANN001
    return (await value) is expected


async def test_status_of_a_run_that_published_nothing_does_not_wait_on_its_dead_worker(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    client = dev_env.client
    queue = unique("dead-unpublished")
    # The billing service as the run's read-only step finds it: it takes the call and never
    # answers, so the step is in flight when the worker dies (before any place the run rests).
    called = asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        called.set()
        await reader.read()  # until the caller goes away

    silent = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    worker = await start_build_worker(dev_env, queue, BUILD, environ={"BILLING_URL": f"http://127.0.0.1:{port}"})
    try:
        run = await start_run(client, SimpleNamespace(task_queue=queue), make_request(READ_ONLY))  # type: ignore[arg-type]
        await asyncio.wait_for(called.wait(), 120)  # an event (bounded only against a hang): the call is out
    finally:
        await worker.kill()
        silent.close()
    assert await tether_client.published_view(await run.describe()) is None
    cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
    # The dead worker holds the run: a query would wait on it until Temporal gives up, and fail.
    # status asks nothing of a run that published nothing (its answer would be unsigned): it says
    # so, with what Temporal lists as a claim.
    code, out, err = await cli("status", run.id)
    assert code == 0, (code, out, err)
    assert f"run        {run.id}" in out and "state      not published yet" in out and "a claim" in out, out
    # --live waits for an answer, and gets none.
    code, out, err = await cli("status", "--live", run.id)
    assert code == 2 and not out, (code, out, err)
