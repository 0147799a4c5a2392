"""The run as it shows itself: its bounded result, its executed steps, its snapshot.
"""

from __future__ import annotations

from typing import Any

from workflows.budgets import clip
from workflows.contract import DELEGATE, ExecutedStep, ToolInfo
from workflows.run_model import RunModel, S
from workflows.run_state import RunOutcome, RunSnapshot
from workflows.states import TEMPORAL_STATUS


class Views(RunModel):
    """The run's result and steps as its queries show them."""

    def outcome(self, run_id: str) -> RunOutcome:
        """The run's result: bounded, without the steps and the timeline (the queries and the
        audit sink have them), with their counts."""
        data = self.data
        return RunOutcome(
            run_id=run_id,
            state=data.lifecycle.state,
            answer=data.answer,
            records=data.lifecycle.records,
            steps_executed=data.steps_executed,
            steps_before=data.executed_before,
            steps_digest=data.executed_digest,
            compensations=data.compensations,
            # A child's (this build's) sums, charged back to its parent; a root's result is as it was.
            spent=dict(data.spent) if self.child_ids else {},
        )

    def steps(self) -> list[ExecutedStep]:
        """The executed steps: ids, outcomes and digests, no arguments or observations."""
        return [s.model_copy(update={"observation": "", "args": {}}) for s in self.data.executed]

    def snapshot(self, run_id: str, *, audit_waiting: int, audit_error: str | None) -> RunSnapshot:
        """The ``snapshot`` query's answer (and the published view's)."""
        data = self.data
        return RunSnapshot(
            run_id=run_id,
            tenant=self.request.tenant,
            state=data.lifecycle.state,
            previous_state=data.lifecycle.previous_state,
            state_version=data.lifecycle.state_version,
            plan=data.plan,
            pending_approval=data.pending_approval,
            step=data.steps_executed,
            retries=data.retries,
            last_error=data.last_error,
            approved_by=data.approved_by,
            answer=data.answer,
            created_at=data.created_at,
            updated_at=data.updated_at,
            model_tokens=data.model_tokens,
            requested_by=self.request.requested_by,
            requester_verified=data.requester_verified,
            first_run_id=data.first_run_id,
            refusals=data.lifecycle.refusals,
            timeline_records=data.lifecycle.records,
            compensations=data.compensations,
            audit_waiting=audit_waiting,
            audit_error=audit_error,
            policy_problem=data.policy_problem,
            updates=self.updates,
            tools=self._plan_tools(),
            found=self.reads_found(),
            compensates=self.request.compensate_run,
            revisions=data.revisions,
            **self._tree(),
        )

    def _tree(self) -> dict[str, Any]:
        """Where the run stands in a delegation tree: its parent and grant, its children."""
        grant = self.request.grant
        tree: dict[str, Any] = {}
        if grant is not None:
            tree.update(parent=grant.parent, parent_goal=grant.parent_goal, depth=grant.depth, grant_tools=grant.tools,
                        covered=len(grant.covered), covered_spent=len(self.data.cover_spent), tree_spent=dict(grant.spent))
            if not self.child_ids:  # a child an earlier build started: its view reads as it was
                tree.update(covered=0, covered_spent=0, tree_spent={})
        plan = self.data.plan
        if plan is not None:
            delegated = {s.tool_call_id for s in self.data.executed if s.tool == DELEGATE}
            if self.state == S.EXECUTING_TOOL and (step := self.current_step()) is not None and step.tool == DELEGATE:
                delegated.add(step.tool_call_id)  # the child under way
            # A group's children under way.
            delegated |= {plan.steps[i].tool_call_id for i in self.group_running or [] if plan.steps[i].tool == DELEGATE}
            tree["children"] = [f"{self.workflow_id}.{s.tool_call_id}" for s in plan.steps if s.tool_call_id in delegated]
        if self.child_ids:  # a child this build started (a recorded view reads as it was)
            tree["spent"] = dict(self.data.spent)
        return tree

    def _plan_tools(self) -> list[ToolInfo]:
        data = self.data
        if data.plan is None or data.catalog is None:
            return []
        names = dict.fromkeys(s.tool for s in data.plan.steps)
        if self.request.compensate_run is not None:  # and the writes it puts back (their money)
            names.update(dict.fromkeys(c.of_tool for c in data.compensations))
        return [info for name in names if (info := self.catalog.get(name)) is not None]

    def final_failure(self) -> str | None:
        """A run that ended FAILED or EXECUTION_FAILED fails its execution (Temporal's status
        tells the outcome): the failure's message, naming the final reason. None: it does not."""
        state = self.data.lifecycle.state
        if TEMPORAL_STATUS[state] != "Failed":
            return None
        timeline = self.data.lifecycle.timeline
        final = next((r.reason for r in reversed(timeline) if r.kind == "transition"), "")
        return f"run ended {state.value}: {clip(final, 300)}"


