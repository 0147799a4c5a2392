"""Delegation cannot go around the gate (issue 56), on the dev server with real workers and the
real billing service: the writes a parent's approval names for a delegation are spent once, and
a child's plan is judged on what the tree has done.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from tether.planners.planning import BUILTIN_PLANNERS
from tether.cli.output import format_status
from tether.client import status
from tether.repair import HandoffReset, repair, repair_tree
from tether.policy.files import PolicyStore
from tests.helpers.billing import Billing
from tests.helpers.queries import timeline
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from tests.helpers.delegation import delegate, refund, refunds_with, started_child
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
        handle = await start_run(dev_env.client, worker, make_request([body]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")  # the delegated refund is the plan's write
        assert "under this approval it writes: issue_refund" in snap.pending_approval.summary
        await handle.signal("approve", approval_for(snap, "bob"))
        child = await started_child(dev_env, f"{handle.id}.{snap.plan.steps[0].tool_call_id}")
        child_snap = await wait_for_state(child, "AWAITING_APPROVAL", "COMPLETED", "FAILED", timeout=90)
        records = await timeline(child)
        shown = format_status(await status(dev_env.client, child.id, live=True))
        root = await status(dev_env.client, handle.id)  # the root's signed view, and its tree's
        await handle.cancel()
    assert child_snap.state == S.AWAITING_APPROVAL, child_snap.last_error
    assert child_snap.pending_approval is not None and child_snap.approved_by == []
    assert len(refunds_with(billing, reason)) == 1
    covered = [r for r in records if "covered by the approval of parent run" in r.reason]
    assert len(covered) == 1  # the approval was lent once, for the one refund it named
    # `tether status` of the child: what it spent of the approval and of the budgets.
    assert "approval   the parent's approval named 1 write(s): 1 spent, 0 left" in shown, shown
    assert "spent      issue_refund.amount_cents 3000" in shown, shown
    # `tether status` of the root: each child's spend, read from the child's own signed view.
    assert [(c.run_id, c.covered, c.covered_spent, c.spent) for c in root.tree] == [
        (child.id, 1, 1, {"issue_refund.amount_cents": 3000})], root.tree
    shown_root = format_status(root)
    assert (f"child      {child.id}  AWAITING_APPROVAL; approval 1 of 1 named write(s) spent; "
            "spent issue_refund.amount_cents 3000") in shown_root, shown_root


AUTO_5000 = """
[tenants.default.auto_approve]
limits = [{ tool = "issue_refund", field = "amount_cents", max = 5000 }]
"""


class Refunder:
    """Each child's planner: one refund of ``cents`` (the reason its goal names), then done."""

    def __init__(self, cents: int) -> None:
        self.cents = cents

    async def propose(self, request: PlannerInput, catalog: ToolCatalog) -> Proposal:
        if request.executed:
            return Proposal(answer="done")
        return Proposal(steps=[ProposedStep(tool="issue_refund", args=refund("A-1002", self.cents, request.goal.split()[-1])["args"])])


async def test_three_delegations_under_a_5000_cent_sum_wait_for_an_approver(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """The tenant auto-approves refunds while the run's sum stays within 5,000 cents. Three
    delegations each refund 4,000: the first child's runs alone; the second's is judged on the
    tree's sum (8,000: the first child's charged back to the parent) and waits for an approver."""
    policy = tmp_path / "policy.toml"
    policy.write_text(AUTO_5000)
    reasons = [uuid.uuid4().hex for _ in range(3)]
    planners = {**BUILTIN_PLANNERS, "refunder": Refunder(4000)}
    bodies = []
    for reason in reasons:
        body = delegate(tools=("issue_refund",), goal=f"refund 4,000 cents for {reason}", max_steps=2)
        body["delegate"]["planner"] = "refunder"
        bodies.append(body)
    async with running_worker(dev_env.client, planners=planners, policy=PolicyStore(policy)) as worker:
        handle = await start_run(dev_env.client, worker, make_request(bodies, limits={"max_steps": 10}))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL", "EXECUTING_TOOL")
        if snap.state == S.AWAITING_APPROVAL:  # the parent's plan may ask first: bob approves it
            await handle.signal("approve", approval_for(snap, "bob"))
        waiting = None
        for step in snap.plan.steps:
            child = await started_child(dev_env, f"{handle.id}.{step.tool_call_id}")
            child_snap = await wait_for_state(child, "AWAITING_APPROVAL", "COMPLETED", "FAILED", timeout=90)
            if child_snap.state != S.COMPLETED:
                waiting = child_snap
                break
        await handle.cancel()
    refunded = [len(refunds_with(billing, reason)) for reason in reasons]
    assert sum(refunded) <= 1, refunded  # at most 4,000 cents without a person
    assert waiting is not None and waiting.state == S.AWAITING_APPROVAL, waiting and waiting.last_error
    assert waiting.tree_spent["issue_refund.amount_cents"] == 4000  # the first child's, charged back


async def _approve_tree(env: WorkflowEnvironment, handle, *child_ids: str) -> None:
    """bob approves whatever of the tree asks (the parent's plan, or the child's own), until the
    parent's execution ends."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    from tests.helpers.queries import snapshot

    approved: set[str] = set()
    while (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
        for run in (handle, *(env.client.get_workflow_handle(c) for c in child_ids)):
            try:
                snap = await snapshot(run)
            except RPCError:
                continue  # not started yet
            if snap.state == S.AWAITING_APPROVAL and snap.pending_approval.request_id not in approved:
                approved.add(snap.pending_approval.request_id)
                await run.signal("approve", approval_for(snap, "bob"))
        await asyncio.sleep(0.05)


async def _reset_to_each(client, handle, points: list[int]) -> dict:
    """Reset the run (its first execution, as the Web UI's Reset does) to each of ``points`` in
    turn; how each reset run ended: {point: (state, its last record's reason)}."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import ResetReapplyType
    from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest

    from tests.helpers.resets import reset_run_outcome

    ended = {}
    for point in points:
        reset = await client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=handle.result_run_id),
                reason=f"test: reset to workflow task {point}", workflow_task_finish_event_id=point,
                request_id=uuid.uuid4().hex, reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_SIGNAL,
            )
        )
        again, _ = await asyncio.wait_for(reset_run_outcome(client, handle.id, reset.run_id), 120)
        ended[point] = (again.state, again.timeline[-1].reason)
    return ended


async def test_a_reset_of_the_parent_to_every_workflow_task_runs_its_child_once(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """A parent whose child made an approved refund and email, reset (the Web UI's Reset) to each
    of its completed workflow tasks in turn: the reset parent never starts the child again (it
    adopts the closed one: its end, its undos), one refund and one email in the billing database,
    and no reset parent ends as if the child's writes were not applied."""
    from temporalio.api.enums.v1 import EventType

    from tests.helpers.billing import counts_in_db
    from tether.client import run_outcome

    client = dev_env.client
    to = f"{uuid.uuid4().hex[:10]}@example.com"
    writes = (refund("A-1002", 700, "reset the parent"),
              {"tool": "send_email", "args": {"to": to, "subject": "your refund", "body": "sent once"}})
    async with running_worker(client) as worker:
        handle = await start_run(client, worker, make_request([delegate(*writes, tools=("issue_refund", "send_email"), goal="refund and tell")]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL", "EXECUTING_TOOL")
        child_id = f"{handle.id}.{snap.plan.steps[0].tool_call_id}"
        await asyncio.wait_for(_approve_tree(dev_env, handle, child_id), 120)
        first = await run_outcome(handle)
        assert first.state == S.COMPLETED, first.timeline[-1].reason
        assert counts_in_db(billing, handle.id) == {"refunds": 1, "ledger": 0, "emails": 1}
        events = (await handle.fetch_history()).events
        points = [e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED]
        # Before the child's start, the task that started it, while it ran, after its end.
        started = next(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED)
        closed = next(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED)
        assert min(points) < started < closed < max(points), (points, started, closed)
        ended = await _reset_to_each(client, handle, points)
        child_runs = [e async for e in client.list_workflows(f"WorkflowId = '{child_id}'")]
    assert len(child_runs) == 1, [c.run_id for c in child_runs]  # started once, whatever the resets
    assert counts_in_db(billing, handle.id) == {"refunds": 1, "ledger": 0, "emails": 1}
    assert {state for state, _ in ended.values()} == {S.COMPLETED}, ended


async def test_a_reset_of_the_parent_of_a_group_of_children_runs_each_once(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Two delegations in one parallel group, each a named refund under bob's approval of the
    parent's plan; the parent reset to each of its workflow tasks: each child runs once, two
    refunds in the billing database, every reset parent COMPLETED (it adopts the closed children)."""
    from temporalio.api.enums.v1 import EventType

    from tests.helpers.billing import counts_in_db
    from tether.client import run_outcome

    client = dev_env.client
    bodies = [delegate(refund("A-1002", cents, "reset a group"), tools=("issue_refund",), goal=f"refund {cents}")
              for cents in (600, 800)]
    async with running_worker(client) as worker:
        handle = await start_run(client, worker, make_request([{"parallel": bodies}]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        child_ids = [f"{handle.id}.{s.tool_call_id}" for s in snap.plan.steps]
        await asyncio.wait_for(_approve_tree(dev_env, handle, *child_ids), 120)
        first = await run_outcome(handle)
        assert first.state == S.COMPLETED, first.timeline[-1].reason
        assert counts_in_db(billing, handle.id)["refunds"] == 2
        events = (await handle.fetch_history()).events
        points = [e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED]
        ended = await _reset_to_each(client, handle, points)
        runs = [len([e async for e in client.list_workflows(f"WorkflowId = '{c}'")]) for c in child_ids]
    assert runs == [1, 1]
    assert counts_in_db(billing, handle.id)["refunds"] == 2
    assert {state for state, _ in ended.values()} == {S.COMPLETED}, ended


def test_the_approver_sees_what_a_delegation_will_write() -> None:
    """The parent's risk summary lists the writes a delegation names (tool, summary fields, money
    in words, undo) and the child's grant; they count for the approval and the sums. A delegation
    whose grant can write and names no playbook is a write; a read-only one is not."""
    from tests.helpers.delegation import CATALOG
    from workflows import policy
    from workflows.contract import DELEGATE, Plan, PlanStep
    from workflows.policy_file import AmountRule, AutoApprove, TenantPolicy

    def plan(*steps: dict) -> Plan:
        return Plan(plan_hash="h", steps=[PlanStep(tool_call_id=f"tc-{i}", tool=DELEGATE if "delegate" in s else s["tool"],
                                                    args=s["delegate"] if "delegate" in s else s["args"]) for i, s in enumerate(steps)])

    named = plan(delegate(refund("A-1002", 3000, "late"), tools=("issue_refund",)))
    review = policy.review_plan(named, CATALOG, None)
    assert review.needs_approval
    assert review.summary.startswith("1 of 1 step(s) write: tether.delegate (a child run that may write with issue_refund; "
                                     "under this approval it writes: issue_refund (can be undone by void_refund"), review.summary
    assert "30.00 EUR (3000)" in review.summary, review.summary

    blind = policy.review_plan(plan(delegate(tools=("issue_refund", "get_order"))), CATALOG, None)
    assert blind.needs_approval and "it names no writes: each asks its own approval" in blind.summary
    reads = policy.review_plan(plan(delegate({"tool": "get_order", "args": {"order_id": "A-1001"}})), CATALOG, None)
    assert not reads.needs_approval and reads.summary == "1 step(s), all read-only"

    # Named writes count in the plan's sums: three delegations of 4,000 under a 5,000 auto-approval.
    auto = TenantPolicy(auto_approve=AutoApprove(limits=[AmountRule(tool="issue_refund", field="amount_cents", max=5000)]))
    one = plan(delegate(refund("A-1002", 4000, "a"), tools=("issue_refund",)))
    three = plan(*(delegate(refund("A-1002", 4000, r), tools=("issue_refund",)) for r in "abc"))
    assert not policy.review_plan(one, CATALOG, auto).needs_approval
    assert policy.review_plan(three, CATALOG, auto).needs_approval


async def test_a_reset_of_the_parent_while_its_child_runs_never_says_not_applied(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """The child waits for its own approval (it may write); the parent is reset to before it
    started the child. The reset parent meets the child (never a second one) and cannot adopt a
    running one: the delegate step ends ``unknown`` and the parent is HANDED_OFF naming the child,
    never EXECUTION_FAILED as if nothing had applied. Approved, the child refunds once."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import EventType, ResetReapplyType
    from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest

    from tests.helpers.billing import counts_in_db
    from tests.helpers.resets import outcome_of
    from tests.helpers.delegation import writing_child, writing_delegation

    client = dev_env.client
    reason = uuid.uuid4().hex
    async with running_worker(client, planners=writing_child(reason)) as worker:
        handle = await start_run(client, worker, make_request([writing_delegation()], on_failure="compensate"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        child_id = f"{handle.id}.{snap.plan.steps[0].tool_call_id}"
        child = await started_child(dev_env, child_id)
        await wait_for_state(child, "AWAITING_APPROVAL", timeout=60)
        events = (await handle.fetch_history()).events
        started = next(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED)
        point = max(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id < started)
        reset = await client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=handle.id),
                reason="test: reset before the child's start", workflow_task_finish_event_id=point,
                request_id=uuid.uuid4().hex, reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_SIGNAL,
            )
        )
        parent = await outcome_of(client, handle.id, reset.run_id)
        child_snap = await wait_for_state(child, "AWAITING_APPROVAL", "CANCELLED", timeout=60)
        if child_snap.state == S.AWAITING_APPROVAL:  # still running: bob approves its refund
            await child.signal("approve", approval_for(child_snap, "bob"))
            await wait_for_state(child, "COMPLETED", timeout=60)
        child_runs = [e async for e in client.list_workflows(f"WorkflowId = '{child_id}'")]
    assert parent.state == S.HANDED_OFF, parent.timeline[-1].reason
    assert parent.timeline[-1].refs.outcome == "unknown" and child_id in parent.timeline[-1].reason
    assert len(child_runs) == 1
    assert counts_in_db(billing, child_id)["refunds"] <= 1


async def test_three_delegations_at_once_under_a_5000_cent_sum_wait_for_an_approver(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """The same three 4,000-cent refunds as delegations of one parallel group, each child's planner
    proposing its own (nobody named the amounts): no child knows what its siblings spend, so no
    amount rule auto-approves any of them; each waits for an approver, nothing is refunded."""
    policy = tmp_path / "policy.toml"
    policy.write_text(AUTO_5000)
    reasons = [uuid.uuid4().hex for _ in range(3)]
    planners = {**BUILTIN_PLANNERS, "refunder": Refunder(4000)}
    bodies = []
    for reason in reasons:
        body = delegate(tools=("issue_refund",), goal=f"refund 4,000 cents for {reason}", max_steps=2)
        body["delegate"]["planner"] = "refunder"
        bodies.append(body)
    async with running_worker(dev_env.client, planners=planners, policy=PolicyStore(policy)) as worker:
        handle = await start_run(dev_env.client, worker, make_request([{"parallel": bodies}], limits={"max_steps": 10}))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")  # delegations that may write: bob approves the plan
        await handle.signal("approve", approval_for(snap, "bob"))
        children = [await started_child(dev_env, f"{handle.id}.{step.tool_call_id}") for step in snap.plan.steps]
        ended = [await wait_for_state(child, "AWAITING_APPROVAL", "COMPLETED", "FAILED", timeout=90) for child in children]
        await handle.cancel()
    assert [s.state for s in ended] == [S.AWAITING_APPROVAL] * 3, [s.last_error for s in ended]
    assert [len(refunds_with(billing, reason)) for reason in reasons] == [0, 0, 0]


async def _handed_off_on_its_running_child(dev_env: WorkflowEnvironment, worker):
    """A parent reset to before it started its child while the child waits for its own approval
    (it may write): the reset parent ends HANDED_OFF on it (it cannot adopt a running child) and
    the child runs on, its parent ended. Returns the parent's handle and the child's."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import EventType, ResetReapplyType
    from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest

    from tests.helpers.resets import outcome_of
    from tests.helpers.delegation import writing_delegation

    client = dev_env.client
    handle = await start_run(client, worker, make_request([writing_delegation()]))
    snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    await handle.signal("approve", approval_for(snap, "bob"))
    child = await started_child(dev_env, f"{handle.id}.{snap.plan.steps[0].tool_call_id}")
    await wait_for_state(child, "AWAITING_APPROVAL", timeout=60)
    events = (await handle.fetch_history()).events
    started = next(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED)
    point = max(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id < started)
    reset = await client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=handle.id),
            reason="test: reset before the child's start", workflow_task_finish_event_id=point,
            request_id=uuid.uuid4().hex, reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_SIGNAL,
        )
    )
    parent = await outcome_of(client, handle.id, reset.run_id)
    assert parent.state == S.HANDED_OFF, parent.timeline[-1].reason
    return handle, child


async def test_compensate_of_a_root_undoes_the_writes_of_its_children_it_did_not_take(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """A parent handed off on a child it could not adopt; approved, the child refunds and
    completes. The parent holds no undo of that refund (its step is ``unknown``): `tether
    compensate PARENT` acts on its tree and undoes the child's refund, by a compensation run of
    the child's (refused while the child may still write); `tether status PARENT` shows the
    child's spend."""
    from tether import client as tether_client
    from tests.helpers.delegation import writing_child

    client = dev_env.client
    reason = uuid.uuid4().hex
    async with running_worker(client, planners=writing_child(reason)) as worker:
        handle, child = await _handed_off_on_its_running_child(dev_env, worker)
        child_id = child.id
        # The child still runs: the tree is not compensated while it may write.
        try:
            await tether_client.compensate_tree(client, handle.id, by="carol", queue=worker.task_queue)
        except tether_client.TetherError as e:
            assert e.rule == "tree_open" and child_id in str(e), e
        else:
            raise AssertionError("a tree with an open child was compensated")
        child_snap = await wait_for_state(child, "AWAITING_APPROVAL", timeout=60)
        await child.signal("approve", approval_for(child_snap, "bob"))
        await wait_for_state(child, "COMPLETED", timeout=60)
        assert len(refunds_with(billing, reason)) == 1
        # The parent's status reads the tree from what each run published: the child's end is
        # published once the audit sink has its records, after its query says COMPLETED.
        for _ in range(3000):  # bounded only against a hang
            root = await status(client, handle.id)
            if root.tree and root.tree[0].state == S.COMPLETED:
                break
            await asyncio.sleep(0.1)
        started_undo = await tether_client.compensate_tree(client, handle.id, by="carol", queue=worker.task_queue)
        undos = [await wait_for_state(h, "COMPENSATED", "AWAITING_APPROVAL", "HANDED_OFF", "FAILED", timeout=60)
                 for h in started_undo]
        for h, undo in zip(started_undo, undos):
            if undo.state == S.AWAITING_APPROVAL:  # the child's refund had its own approval: the undo asks one
                await h.signal("approve", approval_for(undo, "bob"))
        ended = [await wait_for_state(h, "COMPENSATED", "HANDED_OFF", "FAILED", timeout=60) for h in started_undo]
    assert [c.run_id for c in root.tree] == [child_id] and root.tree[0].state == S.COMPLETED
    assert root.tree[0].spent == {"issue_refund.amount_cents": 300}, root.tree
    # The parent wrote nothing of its own: the one compensation run is the child's.
    assert [h.id for h in started_undo] == [f"{child_id}-compensate"]
    assert [e.state for e in ended] == [S.COMPENSATED], [e.timeline[-1].reason for e in ended]
    refunds = refunds_with(billing, reason)
    assert len(refunds) == 1 and refunds[0]["voided_at"] is not None, refunds


async def test_cancel_of_a_root_reaches_a_child_its_ended_parent_cannot(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """The parent ended (HANDED_OFF on its running child): `tether cancel PARENT` of the ended
    parent alone would say "already finished" and leave the child waiting to write. Acting on
    the tree, it cancels the child itself, judged by the child's policy: CANCELLED, nothing
    refunded."""
    from tether import client as tether_client
    from tests.helpers.delegation import writing_child

    reason = uuid.uuid4().hex
    async with running_worker(dev_env.client, planners=writing_child(reason)) as worker:
        handle, child = await _handed_off_on_its_running_child(dev_env, worker)
        try:
            await tether_client.cancel(dev_env.client, handle.id, reason="stop the tree", by="bob")
        except tether_client.TetherError as e:
            assert e.rule == "run_ended"
        else:
            raise AssertionError("an ended run took a cancel")
        done = await tether_client.cancel_tree(dev_env.client, handle.id, reason="stop the tree", by="bob")
        await wait_for_state(child, "CANCELLED", timeout=60)
        records = await timeline(child)
    assert [(run, result.state) for run, result in done] == [(child.id, S.CANCELLED)], done
    assert records[-1].to_state == S.CANCELLED and records[-1].actor == "user:bob", records[-1]
    assert refunds_with(billing, reason) == []


async def test_repair_of_a_root_repairs_the_stuck_child_it_waits_on(
    dev_env: WorkflowEnvironment, billing: Billing, monkeypatch
) -> None:
    """A bad build leaves the child stuck after its approved refund; its parent waits on it, not
    stuck itself, so `tether repair PARENT` of the run alone says "not stuck" and the tree would
    wait for ever. Acting on the tree, it repairs the child; today's worker then completes the
    child and the parent: one refund."""
    import worker as worker_module
    from tether import client as tether_client
    from tests.helpers.runs import unique
    from tests.helpers.tampered import StuckAfterFirstWrite
    from tests.helpers.waiting import wait_stuck

    client, queue, reason = dev_env.client, unique("tree-repair"), uuid.uuid4().hex
    body = delegate(refund("A-1002", 500, reason), tools=("issue_refund",), goal="refund the named amount", max_steps=3)
    with monkeypatch.context() as m:
        m.setattr(worker_module, "AgentRun", StuckAfterFirstWrite)
        broken = worker_module.create_worker(client, task_queue=queue)
    async with broken:
        handle = await start_run(client, broken, make_request([body]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        child_id = f"{handle.id}.{snap.plan.steps[0].tool_call_id}"
        await started_child(dev_env, child_id)
        await wait_stuck(dev_env, child_id)
    assert len(refunds_with(billing, reason)) == 1  # the write happened before it stuck
    with pytest.raises(tether_client.TetherError, match="is not stuck"):
        await repair(client, handle.id)
    done = await repair_tree(client, handle.id)
    assert [d.run_id for d in done] == [child_id], done
    # Today's worker comes after the repair (its retry of the stuck task would heal it alone).
    async with running_worker(client, task_queue=queue):
        outcome = await asyncio.wait_for(run_outcome_of(client, handle.id), 120)
    assert outcome.state == S.COMPLETED, outcome.timeline[-1].reason
    assert len(refunds_with(billing, reason)) == 1


async def run_outcome_of(client, run_id: str):
    from tether.client import run_outcome
    from workflows.run_state import RunOutcome

    return await run_outcome(client.get_workflow_handle(run_id, result_type=RunOutcome))


async def test_forced_handoff_of_a_root_ends_its_stuck_child_on_the_record(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """The child of a parent is wedged: a keyless client completes its email's activity with a
    forged answer while the honest worker is inside the call (the email is out), and every task of
    the child fails from then on. The parent waits on it, not stuck itself: `tether handoff
    PARENT --force` of the run alone says "not stuck", and a plain hand-off would wait for ever on
    a child that takes no cancel. Acting on the tree, the child is handed off by force and then
    the parent: both HANDED_OFF, one email (the effect ledger holds its key)."""
    import threading

    from temporalio.api.enums.v1 import EventType
    from temporalio.client import Client
    from temporalio.contrib.pydantic import pydantic_data_converter as CONVERTER_CLIENT

    from tether import client as tether_client
    from tests.helpers.billing import emails_to
    from tests.helpers.queries import events_of
    from tests.helpers.wedged import HELD, RELEASED, WEDGED_POLICY
    from tests.helpers.runs import unique
    from tests.helpers.waiting import task_failure, wait_stuck
    from tests.helpers.resets import outcome_of
    from workflows.wire import ToolOutcome

    client = dev_env.client
    queue, to = unique("wedged-tree"), f"{uuid.uuid4().hex[:10]}@example.com"
    email = {"tool": "held_email", "args": {"to": to, "subject": "Refund", "body": "Your refund is on its way."}}
    body = delegate(email, tools=("held_email",), goal="tell the customer", max_steps=2)
    forger = await Client.connect(
        client.service_client.config.target_host, namespace=client.namespace, data_converter=CONVERTER_CLIENT,
    )
    (tmp_path / "policy.toml").write_text(WEDGED_POLICY)
    async with running_worker(client, task_queue=queue, registry=HELD, policy=PolicyStore(tmp_path / "policy.toml")) as worker:
        try:
            handle = await start_run(client, worker, make_request([body]))
            snap = await wait_for_state(handle, "AWAITING_APPROVAL")
            await handle.signal("approve", approval_for(snap, "bob"))
            child_id = f"{handle.id}.{snap.plan.steps[0].tool_call_id}"
            await started_child(dev_env, child_id)
            while len(emails_to(billing, to)) < 1:  # the honest worker is inside the call: the email is out
                await asyncio.sleep(0.05)
            base = (await client.get_workflow_handle(child_id).describe()).run_id
            [scheduled] = [e.activity_task_scheduled_event_attributes
                           for e in await events_of(client, child_id, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
                           if e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"]
            await forger.get_async_activity_handle(workflow_id=child_id, run_id=base, activity_id=scheduled.activity_id).complete(
                ToolOutcome(observation='{"sent": false}', digest="0" * 64, size=15)
            )
            await task_failure(client, child_id, "forgery")
            # Stuck as `tether status` says it: its task is being tried again (the failed one's
            # retry is not always scheduled by the time its failure is in history).
            await wait_stuck(dev_env, child_id)
        finally:
            RELEASED.setdefault(to, threading.Event()).set()  # the honest answer comes too late
        try:
            await tether_client.handoff(client, handle.id, by="dana", reason="wedged child", force=True,
                                        forced=HandoffReset())
        except tether_client.TetherError as e:
            assert "is not stuck" in str(e), e
        else:
            raise AssertionError("a forced hand-off of a run that is not stuck went through")
        done = await tether_client.handoff_tree(client, handle.id, by="dana", reason="wedged child", force=True,
                                                forced=HandoffReset())
        child_out = await outcome_of(client, child_id, None)
        parent_out = await outcome_of(client, handle.id, None)
    assert [run for run, _ in done][:1] == [child_id], done
    assert child_out.state == S.HANDED_OFF and child_out.timeline[-1].actor == "operator:dana", child_out.timeline[-1]
    assert parent_out.state == S.HANDED_OFF, parent_out.timeline[-1].reason
    assert len(emails_to(billing, to)) == 1


class Rephraser:
    """A child's planner (a model: untrusted) that proposes the named refund alone the first time
    it is asked, and after a lookup the next (a reset of the child to before its planning asks
    it again): the same named write, in another plan."""

    def __init__(self, step: dict) -> None:
        self.step, self.asked = step, 0

    async def propose(self, request: PlannerInput, catalog: ToolCatalog) -> Proposal:
        if request.executed:
            return Proposal(answer="done")
        self.asked += 1
        steps = [ProposedStep(tool=self.step["tool"], args=self.step["args"])]
        if self.asked > 1:
            steps.insert(0, ProposedStep(tool="get_order", args={"order_id": "A-1002"}))
        return Proposal(steps=steps)


async def test_a_reset_of_a_child_to_before_its_planning_spends_the_lent_approval_once(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """The child spent the parent's approval on the named refund and completed. Reset to its
    first workflow task, it plans again, and its planner proposes the same refund after a lookup
    (another plan: other tool call ids, other idempotency keys). The approval named one refund:
    at most one is made: the write's idempotency key is the named write's (``cover_key``), which
    the effect ledger already holds."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import EventType, ResetReapplyType
    from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest

    from tests.helpers.resets import outcome_of

    client, reason = dev_env.client, uuid.uuid4().hex
    named = refund("A-1002", 3000, reason)
    planners = {**BUILTIN_PLANNERS, "rephrase": Rephraser(named)}
    body = delegate(named, tools=("issue_refund", "get_order"), goal="refund the named amount", max_steps=5)
    body["delegate"]["planner"] = "rephrase"
    async with running_worker(client, planners=planners) as worker:
        handle = await start_run(client, worker, make_request([body]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        child_id = f"{handle.id}.{snap.plan.steps[0].tool_call_id}"
        await started_child(dev_env, child_id)
        await outcome_of(client, handle.id, None)
        assert len(refunds_with(billing, reason)) == 1
        events = (await client.get_workflow_handle(child_id).fetch_history()).events
        first = min(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)
        reset = await client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=child_id),
                reason="test: reset the child to its first task", workflow_task_finish_event_id=first,
                request_id=uuid.uuid4().hex, reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_SIGNAL,
            )
        )
        again = await asyncio.wait_for(
            wait_for_state(client.get_workflow_handle(child_id, run_id=reset.run_id), "AWAITING_APPROVAL", "COMPLETED",
                           "FAILED", "HANDED_OFF", timeout=90), 120)
    assert [s.tool for s in again.plan.steps] == ["get_order", "issue_refund"]  # another plan: other tool call ids
    assert again.state == S.COMPLETED, again.last_error
    assert len(refunds_with(billing, reason)) == 1
