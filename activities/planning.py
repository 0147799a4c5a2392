"""The planner activity and its back-ends.

A planner proposes; it never decides. Whatever it returns is validated by the workflow against
the run's tool catalog snapshot. Back-ends share one interface (:class:`Planner`) and are chosen
by ``RunRequest.planner``.
"""

from __future__ import annotations

from typing import Protocol

from temporalio import activity
from temporalio.exceptions import ApplicationError

from workflows.models import PlannerInput, Proposal, ProposedStep


class Planner(Protocol):
    async def propose(self, request: PlannerInput) -> Proposal: ...


class PlannerError(Exception):
    """A planner failure that retrying cannot fix (bad configuration, unusable request)."""


class PlaybookPlanner:
    """Plans from the steps the request carries: proposes every step not yet executed as one
    plan, and finishes with a summary once all have run."""

    async def propose(self, request: PlannerInput) -> Proposal:
        if not request.playbook:
            raise PlannerError(
                "the playbook has no steps: pass --playbook PATH with a JSON list of "
                '{"tool": ..., "args": {...}} steps'
            )
        done = sum(1 for step in request.executed if step.status == "ok")
        remaining = request.playbook[done:]
        if not remaining:
            tools = ", ".join(step.tool for step in request.executed)
            return Proposal(answer=f"Done: {request.goal} ({done} step(s): {tools})")
        return Proposal(steps=[ProposedStep(tool=s.tool, args=s.args) for s in remaining])


PLANNERS: dict[str, Planner] = {"playbook": PlaybookPlanner()}


@activity.defn(name="plan")
async def plan(request: PlannerInput) -> Proposal:
    planner = PLANNERS.get(request.planner)
    if planner is None:
        raise ApplicationError(
            f"unknown planner {request.planner!r}; available: {', '.join(sorted(PLANNERS))}",
            type="unknown_planner",
            non_retryable=True,
        )
    try:
        return await planner.propose(request)
    except PlannerError as e:
        raise ApplicationError(str(e), type="planner_error", non_retryable=True) from None
