"""The baseline: the agent loop a user would write on bare Temporal.

Planner activity, tool activities, repeat: no state machine, no approvals, no audit timeline,
no search attributes. It calls the SAME ``plan`` and ``execute_tool`` activities as ``AgentRun``
with the same inputs, so the difference between the two is what governance costs.

``wait_for_approval``: the same loop with a person in it, as a user would write it on bare
Temporal: before its first tool it lists itself as waiting (the search attributes ``AgentRun``
publishes) and waits for the ``approve`` signal, then lists itself as executing. Its reaction
to the signal (signal -> tool scheduled, one workflow task) is the baseline of the governed
approval path's, measured at the same clock points under the same burst of approvals.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from workflows.contract import ExecutedStep
    from workflows.published import STATE_ATTRIBUTE, TENANT_ATTRIBUTE
    from workflows.states import RunState
    from workflows.wire import PlannerInput, Proposal, ToolCall, ToolOutcome
    from workflows.run_state import RunRequest

PLANNER_TIMEOUT = timedelta(minutes=2)
PLANNER_RETRY = RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=1))
TOOL_TIMEOUT = timedelta(seconds=30)
TOOL_RETRY = RetryPolicy(maximum_attempts=3)


@workflow.defn(name="BareAgentLoop")
class BareAgentLoop:
    def __init__(self) -> None:
        self.approved = False

    @workflow.signal
    def approve(self) -> None:
        self.approved = True

    @workflow.run
    async def run(self, request: RunRequest, wait_for_approval: bool = False) -> str:
        run_id = workflow.info().workflow_id
        executed: list[ExecutedStep] = []
        rounds = 0
        while True:
            rounds += 1
            proposal = await workflow.execute_activity(
                "plan",
                PlannerInput(
                    goal=request.goal,
                    planner=request.planner,
                    playbook=request.playbook,
                    executed=executed,
                    round=rounds,
                ),
                result_type=Proposal,
                start_to_close_timeout=PLANNER_TIMEOUT,
                retry_policy=PLANNER_RETRY,
            )
            if proposal.answer is not None and not proposal.steps:
                return proposal.answer
            for step in proposal.steps:
                if wait_for_approval and not self.approved:
                    workflow.upsert_search_attributes([
                        TENANT_ATTRIBUTE.value_set(request.tenant),
                        STATE_ATTRIBUTE.value_set(RunState.AWAITING_APPROVAL.value),
                    ])
                    await workflow.wait_condition(lambda: self.approved)
                    workflow.upsert_search_attributes([STATE_ATTRIBUTE.value_set(RunState.EXECUTING_TOOL.value)])
                tool_call_id = f"tc-{len(executed) + 1:03d}"
                args = step.args if isinstance(step.args, dict) else {}
                outcome = await workflow.execute_activity(
                    "execute_tool",
                    ToolCall(
                        tool=step.tool,
                        args=args,
                        tool_call_id=tool_call_id,
                        idempotency_key=f"{run_id}:{tool_call_id}",
                        run_id=run_id,
                        tenant=request.tenant,
                    ),
                    result_type=ToolOutcome,
                    start_to_close_timeout=TOOL_TIMEOUT,
                    retry_policy=TOOL_RETRY,
                )
                executed.append(
                    ExecutedStep(
                        tool_call_id=tool_call_id,
                        tool=step.tool,
                        args=args,
                        status="ok",
                        observation=outcome.observation,
                        digest=outcome.digest,
                    )
                )
