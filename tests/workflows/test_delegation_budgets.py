"""Delegation cannot go around the gate (issue 56), on the dev server with real workers and the
real billing service: the writes a parent's approval names for a delegation are spent once, and
a child's plan is judged on what the tree has done.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from activities.planning import BUILTIN_PLANNERS
from activities.policy_file import PolicyStore
from tests.conftest import Billing, approval_for, make_request, running_worker, start_run, timeline, wait_for_state
from tests.workflows.test_delegation import delegate, refund, refunds_with, started_child
from workflows.contract import ToolCatalog
from workflows.states import RunState
from workflows.wire import PlannerInput, Proposal, ProposedStep

S = RunState


class Repeater:
    """A child's planner gone wrong (a model: untrusted): it proposes the same write every round,
    ``rounds`` times, then answers."""

    def __init__(self, step: dict, rounds: int = 3) -> None:
        self.step, self.rounds = step, rounds

    async def propose(self, request: PlannerInput, catalog: ToolCatalog) -> Proposal:
        if len(request.executed) >= self.rounds:
            return Proposal(answer="done")
        return Proposal(steps=[ProposedStep(tool=self.step["tool"], args=self.step["args"])])


async def test_one_approval_covering_a_named_refund_makes_at_most_one_refund(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """bob approves a plan whose delegation names one 3,000-cent refund; the child's planner
    proposes it in three rounds. The first runs under bob's approval, spent; the second asks the
    child's own approval (nobody gave it: nothing more is refunded)."""
    reason = uuid.uuid4().hex
    named = refund("A-1002", 3000, reason)
    planners = {**BUILTIN_PLANNERS, "repeat": Repeater(named)}
    body = delegate(named, tools=("issue_refund",), goal="refund the named amount", max_steps=5)
    body["delegate"]["planner"] = "repeat"
    async with running_worker(dev_env.client, planners=planners) as worker:
        # The parent's own refund after it: its plan asks bob (priority of what the approver sees: its own test).
        handle = await start_run(dev_env.client, worker, make_request([body, refund("A-1001", 100, uuid.uuid4().hex)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        child = await started_child(dev_env, f"{handle.id}.{snap.plan.steps[0].tool_call_id}")
        child_snap = await wait_for_state(child, "AWAITING_APPROVAL", "COMPLETED", "FAILED", timeout=90)
        records = await timeline(child)
        await handle.cancel()
    assert child_snap.state == S.AWAITING_APPROVAL, child_snap.last_error
    assert child_snap.pending_approval is not None and child_snap.approved_by == []
    assert len(refunds_with(billing, reason)) == 1
    covered = [r for r in records if "covered by the approval of parent run" in r.reason]
    assert len(covered) == 1  # the approval was lent once, for the one refund it named
