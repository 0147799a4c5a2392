"""Delegation in tests: a child's body for a delegate step, a child planner gone wrong, the
engine driven by hand, and waiting for a child run, its cancel and its refusals (events, never
times)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from tether.planners.planning import BUILTIN_PLANNERS
from tether.tools.sdk import REGISTRY
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot
from tether.client import run_outcome
from workflows.contract import DELEGATE, ToolCatalog
from workflows.run_state import RunOutcome, RunRequest
from workflows.states import RunState, TransitionRecord
from workflows.wire import PlannerInput, Proposal, ProposedStep

CATALOG = REGISTRY.catalog()
START = datetime(2026, 1, 1, tzinfo=timezone.utc)
LOOKUP = {"tool": "get_order", "args": {"order_id": "A-1001"}}


def refund(order: str = "A-1002", cents: int = 700, reason: str = "delegation test") -> dict:
    return {"tool": "issue_refund", "args": {"order_id": order, "amount_cents": cents, "reason": reason}}


def delegate(*playbook: dict, tools: tuple[str, ...] = ("get_order",), max_steps: int = 3, goal: str = "look up the order") -> dict:
    body: dict = {"goal": goal, "tools": list(tools), "max_steps": max_steps}
    if playbook:
        body["playbook"] = list(playbook)
    return {"delegate": body}


def refunds_with(billing: Billing, reason: str) -> list:
    return [r for r in billing.get("/refunds")["refunds"] if r.get("reason") == reason]


class Overreacher:
    """A parent that delegates a lookup; as the child, it proposes a refund (a model gone wrong)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    async def propose(self, request: PlannerInput, catalog: ToolCatalog) -> Proposal:
        if request.executed:
            return Proposal(answer="done")
        if request.goal.startswith("parent:"):
            return Proposal(steps=[ProposedStep(tool=DELEGATE, args={"goal": "child: look up A-1003", "tools": ["get_order"], "max_steps": 2})])
        return Proposal(steps=[ProposedStep(tool="issue_refund", args=refund("A-1003", 300, self.reason)["args"])])


def writing_delegation() -> dict:
    """A delegation whose grant can refund and which names no write: its child's planner
    proposes one (``writing_child``), which no approval of the parent's covers."""
    body = delegate(tools=("issue_refund",), goal="child: refund A-1003")
    body["delegate"]["planner"] = "overreach"
    return body


def writing_child(reason: str) -> dict:
    return {**BUILTIN_PLANNERS, "overreach": Overreacher(reason)}


async def started_child(env: WorkflowEnvironment, child_id: str):
    """The child's handle, once the parent has started it (waits for that event, not a time)."""
    from temporalio.service import RPCError

    handle = env.client.get_workflow_handle(child_id)
    for _ in range(600):
        try:
            await handle.describe()
            return handle
        except RPCError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"the child {child_id} was never started")


async def cancel_requested(env: WorkflowEnvironment, run_id: str) -> None:
    """Wait for the run's history to hold the cancel request (an event, not a time)."""
    from temporalio.api.enums.v1 import EventType

    handle = env.client.get_workflow_handle(run_id)
    for _ in range(600):
        events = (await handle.fetch_history()).events
        if any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED for e in events):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no cancel request reached {run_id}")


async def cancelled_states(env: WorkflowEnvironment, run_ids: list[str]) -> list[RunState]:
    """Each run's state once its execution has ended cancelled (its result raises)."""
    ended = []
    for run_id in run_ids:
        handle = env.client.get_workflow_handle(run_id)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 60)
        ended.append((await snapshot(handle)).state)
    return ended


async def child_outcome(env: WorkflowEnvironment, parent: RunOutcome) -> tuple[str, RunOutcome]:
    step = next(s for s in parent.steps if s.tool == DELEGATE)
    child_id = f"{parent.run_id}.{step.tool_call_id}"
    return child_id, await run_outcome(env.client.get_workflow_handle(child_id))


async def refusals(handle, rule: str, count: int) -> list:
    """The run's refused records of ``rule``, once there are ``count`` (an event, not a time)."""
    for _ in range(600):
        found = [r for r in await handle.query("timeline", result_type=list[TransitionRecord]) if r.kind == "refused" and r.rule == rule]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {count} refusal(s) [{rule}] on {handle.id}")


def woken_twice(plan: Proposal, ended: Callable[[Any], Any]):
    """The engine (the workflow's own code), driven here with ``plan``: the first wait on its
    children (a RunChild, a RunGroup) is woken by dana's hand-off (judged: taken); as the second
    wait begins erin's arrives, and the wait answers ``ended(command)``. (engine, the waits as
    (command, child_cancel), the tools called after)."""
    import uuid as uuid_
    from datetime import timedelta

    from workflows.commands import Call, End, Probe, Readings, RunChild, RunGroup, RunTool
    from workflows.contract import HandoffRequest
    from workflows.engine import Engine
    from workflows.policy_file import TenantPolicy
    from workflows.run_model import ToolFailure
    from workflows.run_state import RunData
    from workflows.wire import CHILD_WOKEN, PolicySnapshot, Verdict

    policy = PolicySnapshot(tenant="default", policy=TenantPolicy(), policy_hash="h", source="test")
    e = Engine(RunData(catalog=CATALOG, policy=policy), RunRequest(goal="g", requested_by="alice"), workflow_id="root",
               new_request_id=lambda: uuid_.uuid4().hex, started_at=START)
    now, waits, tools = START, [], []
    e.start()
    for _ in range(200):
        now += timedelta(seconds=1)
        command = e.next(now)
        answer = None
        if isinstance(command, End):
            break
        if isinstance(command, Call):
            answer = plan if command.name == "plan" else Verdict(policy_hash="h")
        elif isinstance(command, Probe):
            answer = Readings(suggested=False, history_bytes=0, history_events=0, handlers_finished=True, notifying=0)
        elif isinstance(command, (RunChild, RunGroup)):
            waits.append((command, e.child_cancel))
            if len(waits) == 1:  # dana's hand-off wakes the wait; the children run on
                e.receive_handoff(HandoffRequest(by="dana", reason="customer called"), now)
                answer = ToolFailure(CHILD_WOKEN, "woken", False)
            else:
                e.receive_handoff(HandoffRequest(by="erin", reason="me too"), now)
                answer = ended(command)
        elif isinstance(command, RunTool):
            tools.append(command.call.tool)
        e.on(command, answer, now)
    return e, waits, tools
