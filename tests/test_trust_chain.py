"""Nothing without the keys can write (issue 18), tried as a hostile worker would: a rogue poller
on the task queue that holds no key answers workflow tasks over raw gRPC with commands of its
own. Real dev servers, the real billing service (its email endpoint counts every email)."""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.command.v1 import (
    Command,
    ContinueAsNewWorkflowExecutionCommandAttributes,
    ScheduleActivityTaskCommandAttributes,
)
from temporalio.api.common.v1 import ActivityType, Payloads, RetryPolicy, WorkflowType
from temporalio.api.enums.v1 import CommandType, EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import PollWorkflowTaskQueueRequest, RespondWorkflowTaskCompletedRequest
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from google.protobuf.duration_pb2 import Duration

import client as tether_client
from activities.keys import KeyRing, genkey
from activities.policy import PolicyStore
from tests.conftest import Billing, approval_for, make_request, running_worker, snapshot, unique, wait_for_state
from workflows.models import Capability, RunSnapshot, ToolCall, args_digest

CONVERTER = pydantic_data_converter.payload_converter


def email_step(to: str) -> dict:
    return {"tool": "send_email", "args": {"to": to, "subject": "hello", "body": "forged?"}}


def emails(billing: Billing, to: str) -> list[dict]:
    return billing.get(f"/emails?to={to}")["emails"]


async def rogue_answer(client: Client, queue: str, workflow_id: str, commands: list[Command], timeout: float = 30) -> list[HistoryEvent]:
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


def schedule_tool(queue: str, call: ToolCall, activity_id: str = "rogue-1") -> Command:
    return Command(
        command_type=CommandType.COMMAND_TYPE_SCHEDULE_ACTIVITY_TASK,
        schedule_activity_task_command_attributes=ScheduleActivityTaskCommandAttributes(
            activity_id=activity_id,
            activity_type=ActivityType(name="execute_tool"),
            task_queue=TaskQueue(name=queue),
            input=Payloads(payloads=[CONVERTER.to_payload(call)]),
            start_to_close_timeout=Duration(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=1),
        ),
    )


async def tool_failures(client: Client, workflow_id: str, run_id: str | None = None) -> list[str]:
    history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    return [
        f"{e.activity_task_failed_event_attributes.failure.application_failure_info.type}: "
        f"{e.activity_task_failed_event_attributes.failure.message}"
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
    ]


async def wait_tool_failure(client: Client, workflow_id: str) -> list[str]:
    for _ in range(300):
        failures = await tool_failures(client, workflow_id)
        if failures:
            return failures
        await asyncio.sleep(0.05)
    raise AssertionError("the forged execute_tool attempt never ended")


async def test_a_rogue_poller_cannot_make_a_tool_write(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    client = dev_env.client
    to = f"{uuid.uuid4().hex[:10]}@example.com"
    queue = unique("tq")
    # A legitimate run sends one email, approved by bob: its capability is in its history.
    async with running_worker(client, task_queue=queue) as worker:
        legit = await tether_client.start_run(client, make_request([email_step(to)]), run_id=unique("legit"), queue=queue)
        snap = await wait_for_state(legit, "AWAITING_APPROVAL")
        await legit.signal("approve", approval_for(snap, "bob"))
        assert (await legit.result()).state.value == "COMPLETED"
    assert len(emails(billing, to)) == 1
    history = await legit.fetch_history()
    scheduled = [
        e.activity_task_scheduled_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"
    ]
    captured = CONVERTER.from_payloads(scheduled[0].input.payloads, [ToolCall])[0]
    assert captured.capability is not None and captured.capability.tool == "send_email"

    # The victim run's first workflow task goes to the rogue (no real worker polls yet).
    victim_queue = unique("tq")
    victim = await client.start_workflow(
        "AgentRun", make_request([{"tool": "get_order", "args": {"order_id": "A-1001"}}]), id=unique("victim"),
        task_queue=victim_queue,
    )
    # Right run, right attempt, a mac made up without the key.
    forged_cap = captured.capability.model_copy(
        update={"workflow_id": victim.id, "run_id": victim.result_run_id, "activity_id": "rogue-2", "mac": "0" * 64}
    )
    calls = [
        ToolCall(tool="send_email", args=email_step(to)["args"], tool_call_id="tc-rogue", idempotency_key="k",
                 run_id=victim.id, tenant="default"),  # no capability at all
        captured.model_copy(update={"run_id": victim.id}),  # another run's real capability
        captured.model_copy(update={"capability": forged_cap}),  # a made-up mac
    ]
    await rogue_answer(client, victim_queue, victim.id, [schedule_tool(victim_queue, c, f"rogue-{i}") for i, c in enumerate(calls)])
    async with running_worker(client, task_queue=victim_queue):
        for _ in range(300):
            failures = await tool_failures(client, victim.id)
            if len(failures) == len(calls):
                break
            await asyncio.sleep(0.05)
    await victim.terminate("test over")
    assert len(failures) == len(calls), failures
    assert all(f.startswith("capability_invalid: write refused") for f in failures), failures
    assert sorted(f.split(": ", 2)[2][:14] for f in failures) == ["no capability ", "the capability", "the capability"], failures
    assert any("another call" in f for f in failures) and any("does not verify" in f for f in failures), failures
    assert len(emails(billing, to)) == 1  # only the approved one


async def test_an_older_seal_or_a_captured_continue_as_new_input_is_refused(
    small_history_env: WorkflowEnvironment, billing: Billing
) -> None:
    env = small_history_env
    client = env.client
    to = f"{uuid.uuid4().hex[:10]}@example.com"
    queue = unique("tq")
    async with running_worker(client, task_queue=queue) as worker:
        handle = await tether_client.start_run(client, make_request([email_step(to)]), run_id=unique("chain"), queue=queue)
        first = await wait_for_state(handle, "AWAITING_APPROVAL")
        # Refused decisions grow the history until the server suggests continuing as new.
        for i in range(40):
            await handle.signal("approve", approval_for(first.pending_approval.plan_hash, "bob"))
            if (await client.get_workflow_handle(handle.id).describe()).run_id != handle.result_run_id:
                break
        latest = client.get_workflow_handle(handle.id)
        second_run = (await latest.describe()).run_id
        assert second_run != handle.result_run_id, "the run never continued as new"
        await wait_for_state(latest, "AWAITING_APPROVAL")
    # The second run's own start input: the first run's carried state and seal.
    history = await client.get_workflow_handle(handle.id, run_id=second_run).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    assert started.continued_execution_run_id == handle.result_run_id
    captured = started.input

    # 1. A rogue takes a workflow task of the second run and continues it as new with that older
    #    sealed state (the seal is by the first run, the server says the new run continues the
    #    second).
    await latest.signal("approve", approval_for(first.pending_approval.plan_hash, "bob"))  # a workflow task
    await rogue_answer(client, queue, handle.id, [continue_as_new(queue, captured)])
    # 2. The captured continue-as-new input, continued into the same id from another workflow.
    other = await client.start_workflow("Forger", {"x": 1}, id=unique("replayed"), task_queue=queue)
    await rogue_answer(client, queue, other.id, [continue_as_new(queue, captured)])
    async with running_worker(client, task_queue=queue):
        for target in (handle.id, other.id):
            with pytest.raises(WorkflowFailureError) as failure:
                await asyncio.wait_for(client.get_workflow_handle(target).result(follow_runs=False), 30)
            assert "carryover_unsealed" in repr(failure.value.cause) or "seal" in str(failure.value.cause)
    assert emails(billing, to) == []


def continue_as_new(queue: str, payloads: Payloads) -> Command:
    return Command(
        command_type=CommandType.COMMAND_TYPE_CONTINUE_AS_NEW_WORKFLOW_EXECUTION,
        continue_as_new_workflow_execution_command_attributes=ContinueAsNewWorkflowExecutionCommandAttributes(
            workflow_type=WorkflowType(name="AgentRun"), task_queue=TaskQueue(name=queue), input=payloads
        ),
    )
