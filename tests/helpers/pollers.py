"""What a worker that died a moment ago leaves on a task queue, for the tests of decisions sent
with no worker to take them."""

from __future__ import annotations

from datetime import timedelta

from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import PollWorkflowTaskQueueRequest
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client


async def a_poller_seen_just_now(env: WorkflowEnvironment, queue: str) -> None:
    """What a worker that died a moment ago leaves: a poller Temporal saw seconds ago, so the
    worker probe counts the queue served; nobody takes its tasks."""
    client = env.client
    try:
        await client.workflow_service.poll_workflow_task_queue(
            PollWorkflowTaskQueueRequest(namespace=client.namespace, task_queue=TaskQueue(name=queue), identity="gone"),
            timeout=timedelta(seconds=3),
        )
    except RPCError:
        pass  # no task to take (the run waits for a person): the poll ran out, as a dying worker's does
    assert await tether_client.worker_serving(client, queue) is True
