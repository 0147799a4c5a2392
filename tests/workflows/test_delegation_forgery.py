"""A child's end, forged: a keyless poller completes the child's workflow task with an outcome of
its choosing. The parent acts on nothing it says: the child's workflow code seals its outcome
for its grant with the fleet key, and the parent's code checks that seal before it goes on."""

from __future__ import annotations

import asyncio
import uuid

from temporalio.api.enums.v1 import EventType
from temporalio.testing import WorkflowEnvironment

from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.rogue import complete, rogue_answer
from tether.planners.planning import BUILTIN_PLANNERS
from tests.helpers.delegation import Overreacher, delegate, refund, refunds_with, started_child
from workflows.run_state import RunOutcome
from workflows.states import RunState

S = RunState


async def _events(env: WorkflowEnvironment, run_id: str) -> list:
    return list((await env.client.get_workflow_handle(run_id).fetch_history()).events)


async def test_a_child_outcome_a_keyless_poller_wrote_is_not_acted_on(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    reason = uuid.uuid4().hex
    queue = unique("tq")
    # The child proposes a refund its parent's approved plan did not name: it asks an approval
    # of its own, so it rests; the parent waits for the child, then would refund on its own.
    planners = {**BUILTIN_PLANNERS, "overreach": Overreacher(reason)}
    body = delegate(tools=("issue_refund",), goal="child: refund")
    body["delegate"]["planner"] = "overreach"
    request = make_request([body, refund("A-1002", 200, reason)])
    parent = await dev_env.client.start_workflow("AgentRun", request.model_dump(mode="json"), id=unique("run"), task_queue=queue)
    async with running_worker(dev_env.client, task_queue=queue, planners=planners):
        snap = await wait_for_state(parent, S.AWAITING_APPROVAL)
        await parent.signal("approve", approval_for(snap, "bob"))
        await wait_for_state(parent, S.EXECUTING_TOOL)
        child_id = f"{parent.id}.{snap.plan.steps[0].tool_call_id}"
        child = await started_child(dev_env, child_id)
        await wait_for_state(child, S.AWAITING_APPROVAL, timeout=60)
    # No worker of the fleet polls now. A signal gives the child a workflow task, which the
    # keyless poller answers: the child "completed", with an answer of its own.
    await child.signal("poke")
    forged = RunOutcome(run_id=child_id, state=S.COMPLETED, answer="forged: nothing to refund")
    await rogue_answer(dev_env.client, queue, child_id, [complete(forged)])
    async with running_worker(dev_env.client, task_queue=queue, planners=planners):
        # The parent's next task meets the child's end: its workflow code refuses the forgery.
        for _ in range(600):
            events = await _events(dev_env, parent.id)
            done = [i for i, e in enumerate(events) if e.event_type == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED]
            after = [e.event_type for e in events[done[0]:]] if done else []
            # The first task after the child's end either failed (refused) or completed (acted on it).
            if EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED in after or EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED in after:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the parent never met the child's end")
        failed = [e for e in events[done[0]:] if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
        message = failed[0].workflow_task_failed_event_attributes.failure.message if failed else ""
    await parent.terminate("test over")
    assert "outcome" in message and "seal" in message, (message, after)
    # Nothing the forged end would have led to: no activity, no end, no refund.
    assert set(after) <= {
        EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED, EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
        EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED, EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
        EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT,
    }, after
    assert refunds_with(billing, reason) == []
