"""A worker without keys, as a hostile test plays one: it polls a run's workflow task and answers it
with any commands (schedule any activity with any input, continue as new with any state, start
a child run with any input, end the run with any result)."""

from __future__ import annotations

import asyncio
from typing import Any

from google.protobuf.duration_pb2 import Duration
from temporalio.api.command.v1 import (
    Command,
    CompleteWorkflowExecutionCommandAttributes,
    ContinueAsNewWorkflowExecutionCommandAttributes,
    ScheduleActivityTaskCommandAttributes,
    StartChildWorkflowExecutionCommandAttributes,
)
from temporalio.api.common.v1 import ActivityType, Payloads, RetryPolicy, WorkflowType
from temporalio.api.enums.v1 import CommandType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import PollWorkflowTaskQueueRequest, RespondWorkflowTaskCompletedRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from workflows.wire import ToolCall

CONVERTER = pydantic_data_converter.payload_converter


async def rogue_answer(client: Client, queue: str, workflow_id: str, commands: list[Command], timeout: float = 120) -> list[HistoryEvent]:
    """Poll one workflow task of ``workflow_id`` as a worker without keys would, and complete it
    with ``commands``. Returns the history the task came with."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        task = await client.workflow_service.poll_workflow_task_queue(
            PollWorkflowTaskQueueRequest(namespace=client.namespace, task_queue=TaskQueue(name=queue), identity="rogue")
        )
        if not task.task_token:
            continue
        assert task.workflow_execution.workflow_id == workflow_id
        await client.workflow_service.respond_workflow_task_completed(
            RespondWorkflowTaskCompletedRequest(
                namespace=client.namespace, task_token=task.task_token, commands=commands, identity="rogue"
            )
        )
        return list(task.history.events)
    raise AssertionError("the rogue poller got no workflow task")


def schedule(queue: str, activity: str, arg: Any, activity_id: str) -> Command:
    """A ScheduleActivityTask command as a keyless poller writes it: any activity, any input."""
    return Command(
        command_type=CommandType.COMMAND_TYPE_SCHEDULE_ACTIVITY_TASK,
        schedule_activity_task_command_attributes=ScheduleActivityTaskCommandAttributes(
            activity_id=activity_id,
            activity_type=ActivityType(name=activity),
            task_queue=TaskQueue(name=queue),
            input=Payloads(payloads=[CONVERTER.to_payload(arg)]),
            start_to_close_timeout=Duration(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=1),
        ),
    )


def schedule_tool(queue: str, call: ToolCall, activity_id: str = "rogue-1") -> Command:
    return schedule(queue, "execute_tool", call, activity_id)


def continue_as_new(queue: str, payloads: Payloads) -> Command:
    return Command(
        command_type=CommandType.COMMAND_TYPE_CONTINUE_AS_NEW_WORKFLOW_EXECUTION,
        continue_as_new_workflow_execution_command_attributes=ContinueAsNewWorkflowExecutionCommandAttributes(
            workflow_type=WorkflowType(name="AgentRun"), task_queue=TaskQueue(name=queue), input=payloads
        ),
    )


def start_child(queue: str, namespace: str, workflow_id: str, arg: Any) -> Command:
    """A StartChildWorkflowExecution command as a keyless poller writes it: the run it answers for
    becomes the child's parent, as the server records it; the input is whatever it likes."""
    return Command(
        command_type=CommandType.COMMAND_TYPE_START_CHILD_WORKFLOW_EXECUTION,
        start_child_workflow_execution_command_attributes=StartChildWorkflowExecutionCommandAttributes(
            namespace=namespace, workflow_id=workflow_id, workflow_type=WorkflowType(name="AgentRun"),
            task_queue=TaskQueue(name=queue), input=Payloads(payloads=[CONVERTER.to_payload(arg)]),
        ),
    )


def complete(result: Any) -> Command:
    """A CompleteWorkflowExecution command as a keyless poller writes it: the run ends with any result."""
    return Command(
        command_type=CommandType.COMMAND_TYPE_COMPLETE_WORKFLOW_EXECUTION,
        complete_workflow_execution_command_attributes=CompleteWorkflowExecutionCommandAttributes(
            result=Payloads(payloads=[CONVERTER.to_payload(result)]),
        ),
    )
