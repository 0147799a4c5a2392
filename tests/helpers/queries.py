"""What a test reads of a run: its snapshot and timeline (queries), and its tool calls'
observations (from its history)."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter

from workflows.run_state import RunSnapshot
from workflows.states import TransitionRecord
from workflows.wire import ToolOutcome


async def snapshot(handle: WorkflowHandle) -> RunSnapshot:
    return await handle.query("snapshot", result_type=RunSnapshot)


async def timeline(handle: WorkflowHandle) -> list[TransitionRecord]:
    return await handle.query("timeline", result_type=list[TransitionRecord])


async def observations(handle: WorkflowHandle) -> list[str]:
    """What each tool call returned, in order, from the run's history (the result carries only
    ids and digests)."""
    history = await handle.fetch_history()
    scheduled = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }
    converter = pydantic_data_converter.payload_converter
    found = []
    for e in history.events:
        if e.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            continue
        done = e.activity_task_completed_event_attributes
        if scheduled.get(done.scheduled_event_id) == "execute_tool":
            found.append(converter.from_payloads(done.result.payloads, [ToolOutcome])[0].observation)
    return found


async def events_of(client: Client, workflow_id: str, kind: EventType.ValueType) -> list:
    return [e for e in (await client.get_workflow_handle(workflow_id).fetch_history()).events if e.event_type == kind]
