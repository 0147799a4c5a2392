"""Resetting a run as an operator does (`temporal workflow reset`) and how the reset run ends."""

from __future__ import annotations

import asyncio
import uuid

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle

from tests.helpers.queries import snapshot
from tests.helpers.runs import approval_for
from tether.client import run_outcome
from workflows.run_state import RunOutcome


async def reset_before_signal(client: Client, handle: WorkflowHandle, signal: str, *, reapply: bool = True) -> str:
    """Reset the run to just before it acted on the first ``signal``: the workflow task that
    took it is done again (what an operator does with `temporal workflow reset --event-id`;
    the signal itself stays in the history, later ones are reapplied). Returns the new run's id."""
    events = (await handle.fetch_history()).events
    at = next(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
              and e.workflow_execution_signaled_event_attributes.signal_name == signal)
    point = min(e.event_id for e in events
                if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id > at)
    reset = await client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=handle.id),
            reason=f"test: reset to before {signal}",
            workflow_task_finish_event_id=point,
            request_id=uuid.uuid4().hex,
            reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_SIGNAL if reapply else ResetReapplyType.RESET_REAPPLY_TYPE_NONE,
        )
    )
    return reset.run_id


async def outcome_of(client: Client, workflow_id: str, run_id: str) -> RunOutcome:
    handle = client.get_workflow_handle(workflow_id, run_id=run_id, result_type=RunOutcome)
    try:
        return await asyncio.wait_for(run_outcome(handle), 120)
    except asyncio.TimeoutError:
        events = (await handle.fetch_history()).events
        failed = [e.workflow_task_failed_event_attributes.failure.message for e in events
                  if e.HasField("workflow_task_failed_event_attributes")]
        records = [f"{r['kind']} {r['to_state']} {r.get('rule')} {r['reason'][:200]}" for r in (await handle.query("timeline"))[-4:]]
        raise AssertionError(f"the reset run did not end: task failures {failed[:2]}, "
                             f"last events {[EventType.Name(e.event_type) for e in events[-6:]]}, records {records}") from None


async def reset_run_outcome(client: Client, workflow_id: str, run_id: str) -> tuple[RunOutcome, bool]:
    """How a reset run ends; where it waits for an approval again (the reapplied one came before
    the run asked for it, and was refused), bob approves again, as an operator's approver would."""
    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    approved = False
    while (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
        snap = await snapshot(handle)
        if snap.state.value == "AWAITING_APPROVAL" and not approved:
            await handle.signal("approve", approval_for(snap, "bob"))
            approved = True
        await asyncio.sleep(0.05)
    return await outcome_of(client, workflow_id, run_id), approved
