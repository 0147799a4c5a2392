"""Parallel step groups, on the dev server with real workers: a playbook's ``{"parallel": [...]}``
runs its steps at once, behind one barrier, each result on the record as it lands.

The tools are held on events the test releases, so "every step of the group was running at
once" is a fact the test waits for, not a timing; the limit is checked by the most attempts
that were ever in flight together, counted by the tools themselves.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.testing import WorkflowEnvironment

from activities.policy_checks import PolicyActivities
from tether.policy.files import PolicyStore
from tether.store.keys import KeyRing
from tether.client import run_outcome
from tests.helpers.held_tools import ATTEMPTS, GATES, IN_FLIGHT, MOST, ORDER, READ_ONLY, REGISTRY, started
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from tests.helpers.invariants import check_timeline
from worker import create_replayer
from workflows.contract import ExecutedStep, PlaybookStep, ToolCatalog, ToolInfo, Limits
from workflows.contract import STRICT, ToolEffect
from workflows.states import RunState
from workflows.validation import validate_proposal
from workflows.wire import Proposal, ProposedStep

S = RunState
def group(*steps: dict) -> dict:
    return {"parallel": list(steps)}


def step(tool_name: str, tag: str, n: int = 0) -> dict:
    return {"tool": tool_name, "args": {"tag": tag, "n": n}}


def policy_with(tmp_path: Path, budgets: str = "") -> PolicyActivities:
    file = tmp_path / "policy.toml"
    file.write_text('[tenants.default]\nfour_eyes = true\n' + (f"[tenants.default.budgets]\n{budgets}\n" if budgets else ""))
    return PolicyActivities(PolicyStore(file), keys=KeyRing.from_env())


# ----------------------------------------------------------------------------- the playbook and the validator


def test_a_playbook_group_is_a_list_of_tool_steps() -> None:
    item = PlaybookStep.model_validate(group(step("held_read", "t", 1), step("held_read", "t", 2)), context=STRICT)
    assert [s.tool for s in item.parallel or []] == ["held_read", "held_read"]
    assert "parallel" not in PlaybookStep(tool="get_order").model_dump()  # a tool step reads as before
    for bad in (
        {"parallel": []},
        {"parallel": [group(step("held_read", "t"))]},  # a group in a group
        {"tool": "held_read", "parallel": [step("held_read", "t")]},
        {"delegate": {"goal": "g", "tools": ["held_read"]}, "parallel": [step("held_read", "t")]},
    ):
        with pytest.raises(ValidationError):
            PlaybookStep.model_validate(bad, context=STRICT)


def _catalog(*effects: ToolEffect) -> ToolCatalog:
    schema = {"type": "object", "properties": {"tag": {"type": "string"}, "n": {"type": "integer"}}}
    return ToolCatalog(tools=[
        ToolInfo(name=f"t_{e.value}", effect=e, requires_approval=e != ToolEffect.READ_ONLY, args_schema=schema)
        for e in effects
    ])


def _validate(*steps: tuple[str, int | None]):
    proposal = Proposal(steps=[ProposedStep(tool=t, args={"tag": "x", "n": i}, group=g) for i, (t, g) in enumerate(steps)])
    catalog = _catalog(*ToolEffect)
    return validate_proposal(proposal, catalog, executed_steps=0, limits=Limits(), new_id=lambda n: f"tc-{n}")


@pytest.mark.parametrize("effect", [ToolEffect.UNSAFE, ToolEffect.RECONCILABLE])
def test_an_unsafe_or_reconcilable_step_never_runs_in_parallel(effect: ToolEffect) -> None:
    result = _validate(("t_read_only", 1), (f"t_{effect.value}", 1))
    assert result.plan is None
    assert f"step 2 (t_{effect.value}): a {effect.value} step never runs in parallel" in result.reason


def test_read_only_and_idempotent_steps_may_share_a_group_and_the_hash_covers_it() -> None:
    grouped = _validate(("t_read_only", 1), ("t_idempotent", 1), ("t_unsafe", None))
    assert grouped.plan is not None and [s.group for s in grouped.plan.steps] == [1, 1, None]
    alone = _validate(("t_read_only", None), ("t_idempotent", None), ("t_unsafe", None))
    assert alone.plan is not None and alone.plan.plan_hash != grouped.plan.plan_hash  # what runs at once is approved
    single = _validate(("t_read_only", 3), ("t_unsafe", None))  # a group of one runs on its own
    assert single.plan is not None and single.plan.steps[0].group is None


def test_a_group_split_by_another_step_is_refused() -> None:
    result = _validate(("t_read_only", 1), ("t_read_only", None), ("t_read_only", 1))
    assert result.plan is None and "parallel group 1 is split by other steps" in result.reason


# ----------------------------------------------------------------------------- on the dev server


async def test_a_group_runs_at_once_behind_a_barrier(dev_env: WorkflowEnvironment) -> None:
    tag = uuid.uuid4().hex[:8]
    playbook = [group(*(step("held_read", tag, n) for n in range(1, 4))), step("after_read", tag)]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        await started(tag, 3)  # all three are running: none waited for another
        assert "after" not in ORDER[tag]
        GATES[tag].set()
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
    assert outcome.state == S.COMPLETED, outcome.timeline[-1].reason
    assert MOST[tag] == 3
    # The barrier: the step after the group began once every step of it had ended.
    assert ORDER[tag].index("after") > max(i for i, e in enumerate(ORDER[tag]) if e.startswith("end"))
    assert [s.tool for s in outcome.steps] == ["held_read"] * 3 + ["after_read"]
    landed = [r for r in outcome.timeline if r.from_state == S.EXECUTING_TOOL and r.to_state == S.EXECUTING_TOOL]
    assert len(landed) == 3 and all("succeeded (parallel group 1:" in r.reason for r in landed)
    assert any(r.reason == "parallel group 1: all 3 steps succeeded" for r in outcome.timeline)
    check_timeline(outcome.timeline, {s.tool_call_id: s.tool for s in outcome.steps}, read_only=READ_ONLY)


async def test_the_policy_sets_how_many_run_at_once(dev_env: WorkflowEnvironment, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    playbook = [group(*(step("held_read", tag, n) for n in range(1, 6)))]
    async with running_worker(dev_env.client, registry=REGISTRY, rules=policy_with(tmp_path, "max_parallel = 2")) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        await started(tag, 2)
        GATES[tag].set()
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
    assert outcome.state == S.COMPLETED, outcome.timeline[-1].reason
    assert MOST[tag] <= 2 and sum(ATTEMPTS[f"{tag}/{n}"] for n in range(1, 6)) == 5


async def test_a_failed_step_retries_alone_and_cancels_no_sibling(dev_env: WorkflowEnvironment) -> None:
    tag = uuid.uuid4().hex[:8]
    playbook = [group(step("flaky_read", tag, 1), step("held_read", tag, 2), step("held_read", tag, 3))]
    GATES[tag].set()
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
    assert outcome.state == S.COMPLETED, outcome.timeline[-1].reason
    assert (ATTEMPTS[f"{tag}/1"], ATTEMPTS[f"{tag}/2"], ATTEMPTS[f"{tag}/3"]) == (2, 1, 1)
    assert any("failed [busy]" in r.reason and "its siblings go on" in r.reason for r in outcome.timeline)


async def test_a_step_that_fails_ends_the_run_after_its_siblings(dev_env: WorkflowEnvironment) -> None:
    tag = uuid.uuid4().hex[:8]
    playbook = [group(step("refused_read", tag, 1), step("held_read", tag, 2)), step("after_read", tag)]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        await started(tag, 1)
        GATES[tag].set()  # the sibling ends after the failure: it was not cancelled
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
    assert outcome.state == S.EXECUTION_FAILED
    # In the order they landed, which neither step decides.
    assert sorted((s.tool, s.outcome) for s in outcome.steps) == [("held_read", "ok"), ("refused_read", "failed")]
    assert "after" not in ORDER[tag]
    assert "parallel group 1: 1 of 2 steps did not succeed" in outcome.timeline[-1].reason
    check_timeline(outcome.timeline, {s.tool_call_id: s.tool for s in outcome.steps}, read_only=READ_ONLY)


async def test_approved_writes_in_a_group_each_run_once(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    tag = uuid.uuid4().hex[:8]
    playbook = [group(step("group_refund", tag, 1), step("group_refund", tag, 2), step("flaky_read", tag, 3))]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert [s.group for s in snap.plan.steps] == [1, 1, 1]
        await handle.signal("approve", approval_for(snap, "bob"))
        outcome = await asyncio.wait_for(run_outcome(handle), 60)
    assert outcome.state == S.COMPLETED, outcome.timeline[-1].reason
    assert (ATTEMPTS[f"{tag}/1"], ATTEMPTS[f"{tag}/2"]) == (1, 1)
    for s in outcome.steps[:2]:
        assert len(billing.get(f"/refunds?idempotency_key={handle.id}:{s.tool_call_id}")["refunds"]) == 1


async def test_a_cancel_during_a_group_leaves_nothing_stranded(dev_env: WorkflowEnvironment) -> None:
    tag = uuid.uuid4().hex[:8]
    playbook = [group(*(step("held_read", tag, n) for n in range(1, 4))), step("after_read", tag)]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        await started(tag, 3)
        await handle.cancel()
        GATES[tag].set()  # the attempts end; the run has waited for each
        with pytest.raises(Exception):
            await asyncio.wait_for(handle.result(), 60)
        snap = await snapshot(handle)
        steps = await handle.query("steps")
    assert snap.state == S.CANCELLED
    assert IN_FLIGHT[tag] == 0 and "after" not in ORDER[tag]
    assert len(steps) == 3  # what each attempt did is on the record


# ----------------------------------------------------------------------------- child runs in a group


def child(tag: str, n: int, max_steps: int = 2) -> dict:
    """A delegation whose child runs one held read."""
    return {"delegate": {"goal": f"read {n}", "tools": ["held_read"], "max_steps": max_steps, "playbook": [step("held_read", tag, n)]}}


def two_children(tag: str) -> list[dict]:
    """A group of two children (each runs one held read) and the parent's own held read; a read after."""
    return [group(child(tag, 1), child(tag, 2), step("held_read", tag, 3)), step("after_read", tag)]


async def all_running(client, worker, playbook: list[dict], tag: str, count: int = 3) -> tuple:
    """The run started, ``count`` of its held reads running at once: (its handle, its group's children's ids)."""
    handle = await start_run(client, worker, make_request(playbook))
    await started(tag, count)
    return handle, [f"{handle.id}.{s.tool_call_id}" for s in (await snapshot(handle)).plan.steps[:2]]


async def released(client, handle, tag: str, ids: list[str]) -> tuple:
    """The held reads released: (the run's outcome, its children's); its history replays as it ran."""
    GATES[tag].set()
    outcome = await asyncio.wait_for(run_outcome(handle), 60)
    children = [await run_outcome(client.get_workflow_handle(child_id)) for child_id in ids]
    history = await handle.fetch_history()
    assert (await create_replayer().replay_workflow(history, raise_on_replay_failure=False)).replay_failure is None
    return outcome, children


def test_a_delegation_may_share_a_group() -> None:
    item = PlaybookStep.model_validate(group(child("t", 1), step("held_read", "t", 2)), context=STRICT)
    assert [s.delegate is not None for s in item.parallel or []] == [True, False]


async def test_two_children_and_a_read_run_at_once_behind_the_barrier(dev_env: WorkflowEnvironment) -> None:
    """Each child a child workflow, started with the read; each outcome on the record as it
    lands; the step after the group runs once all three have ended."""
    tag = uuid.uuid4().hex[:8]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        # Both children's reads and the parent's own are running at once.
        handle, ids = await all_running(dev_env.client, worker, two_children(tag), tag)
        assert "after" not in ORDER[tag]
        assert (await snapshot(handle)).children == ids  # the tree lists both children while they run
        outcome, children = await released(dev_env.client, handle, tag, ids)
    assert outcome.state == S.COMPLETED, outcome.timeline[-1].reason
    assert MOST[tag] == 3 and len(children) == 2 and all(c.state == S.COMPLETED for c in children)
    assert ORDER[tag].index("after") > max(i for i, e in enumerate(ORDER[tag]) if e.startswith("end"))
    landed = [r for r in outcome.timeline if r.from_state == S.EXECUTING_TOOL and r.to_state == S.EXECUTING_TOOL]
    assert len(landed) == 3 and all("succeeded (parallel group 1:" in r.reason for r in landed)
    assert any(r.reason == "parallel group 1: all 3 steps succeeded" for r in outcome.timeline)
    check_timeline(outcome.timeline, {s.tool_call_id: s.tool for s in outcome.steps}, read_only=(*READ_ONLY, "tether.delegate"))


async def test_a_group_whose_children_ask_more_steps_than_the_run_has_is_refused(dev_env: WorkflowEnvironment) -> None:
    tag = uuid.uuid4().hex[:8]
    playbook = [group(child(tag, 1, max_steps=3), child(tag, 2, max_steps=3))]  # 6 together, each within the 5
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        request = make_request(playbook, limits={"max_steps": 5, "max_replans": 0})
        outcome = await asyncio.wait_for(run_outcome(await start_run(dev_env.client, worker, request)), 60)
    assert outcome.state == S.FAILED
    assert any("parallel group 1: its delegations ask 6 steps together, over the 5 this run has left (the step budget)" in r.reason
               for r in outcome.timeline)
    assert ATTEMPTS[f"{tag}/1"] == ATTEMPTS[f"{tag}/2"] == 0 and outcome.steps == []


@pytest.mark.parametrize("handed_off", [False, True])
async def test_a_cancel_during_a_group_with_children_leaves_nothing_stranded(dev_env: WorkflowEnvironment, handed_off: bool) -> None:
    """``handed_off``: the cancel comes while a hand-off of the run is being taken (the children's
    cancel requested, the parent's read still held): it reaches every attempt all the same."""
    from tests.helpers.delegation import cancel_requested, cancelled_states
    from workflows.contract import HandoffRequest

    tag = uuid.uuid4().hex[:8]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle, ids = await all_running(dev_env.client, worker, two_children(tag), tag)
        if handed_off:
            await handle.signal("handoff", HandoffRequest(by="dana", reason="customer called"))
            for child_id in ids:
                await cancel_requested(dev_env, child_id)
        await handle.cancel()
        for child_id in ids:
            await cancel_requested(dev_env, child_id)  # the cancel has reached each child: then the attempts end
        GATES[tag].set()
        ended = await cancelled_states(dev_env, [handle.id, *ids])
        steps = await handle.query("steps", result_type=list[ExecutedStep])
        history = await handle.fetch_history()
    assert (await create_replayer().replay_workflow(history, raise_on_replay_failure=False)).replay_failure is None
    assert ended == [S.CANCELLED] * 3
    # The cancel reached the children beside the parent's own attempt, not after it: that attempt
    # ended as released (not timed out while the children's cancel waited for it).
    assert [(s.tool, s.status) for s in steps if s.tool == "held_read"] == [("held_read", "ok")]
    assert IN_FLIGHT[tag] == 0 and "after" not in ORDER[tag]
    assert sorted(e for e in ORDER[tag] if e.startswith("start")) == ["start 1", "start 2", "start 3"]  # none ran twice


# ----------------------------------------------------------------------------- a hand-off of the parent during a group


def writer(tag: str, n: int) -> dict:
    """A delegation whose child writes (an idempotent refund its planner proposes, which the
    delegation does not name): it waits for its own approval."""
    return {"delegate": {"goal": f"refund {n}", "tools": ["group_refund"], "max_steps": 2, "planner": "group-refunder"}}


class GroupRefunder:
    """The writer child's planner: the refund ``step("group_refund", tag, n)`` would make, once."""

    def __init__(self, tag: str, n: int) -> None:
        self.step = step("group_refund", tag, n)

    async def propose(self, request, catalog):
        if request.executed:
            return Proposal(answer="done")
        return Proposal(steps=[ProposedStep(tool=self.step["tool"], args=self.step["args"])])


async def test_a_handoff_during_a_group_cancels_its_open_children_and_waits_for_its_read(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """One child awaits its own approval (it would wait for its TTL), one runs a held read, the
    parent runs a held read: a hand-off of the parent cancels both children at once, the held
    read is waited for (not cancelled) and on the record, then the parent is HANDED_OFF."""
    from tests.helpers.delegation import cancel_requested, cancelled_states, started_child
    from workflows.contract import HandoffRequest

    tag = uuid.uuid4().hex[:8]
    playbook = [group(writer(tag, 1), child(tag, 2), step("held_read", tag, 3)), step("after_read", tag)]
    from tether.planners.planning import BUILTIN_PLANNERS

    planners = {**BUILTIN_PLANNERS, "group-refunder": GroupRefunder(tag, 1)}
    async with running_worker(dev_env.client, registry=REGISTRY, planners=planners) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        # A delegation that may write is the plan's write: bob approves the parent's plan.
        await handle.signal("approve", approval_for(await wait_for_state(handle, "AWAITING_APPROVAL"), "bob"))
        # The second child's read and the parent's own are running.
        await started(tag, 2)
        ids = [f"{handle.id}.{s.tool_call_id}" for s in (await snapshot(handle)).plan.steps[:2]]
        await wait_for_state(await started_child(dev_env, ids[0]), "AWAITING_APPROVAL", timeout=60)
        await handle.signal("handoff", HandoffRequest(by="dana", reason="the customer called"))
        for child_id in ids:
            await cancel_requested(dev_env, child_id)  # the hand-off reached both children at once
        assert (await snapshot(handle)).state == S.EXECUTING_TOOL  # the parent's read is still held
        GATES[tag].set()
        parent = await asyncio.wait_for(run_outcome(handle), 60)
        ended = await cancelled_states(dev_env, ids)
        history = await handle.fetch_history()
    assert (await create_replayer().replay_workflow(history, raise_on_replay_failure=False)).replay_failure is None
    assert parent.state == S.HANDED_OFF, parent.timeline[-1].reason
    assert ended == [S.CANCELLED, S.CANCELLED]
    taken = parent.timeline[-1]
    assert taken.actor == "operator:dana" and f"child runs {ids[0]}, {ids[1]} cancelled first" in taken.reason
    assert taken.refs.error_code == "child_cancelled" and taken.refs.outcome == "unknown"  # one child could write
    landed = [r for r in parent.timeline if r.from_state == S.EXECUTING_TOOL and r.to_state == S.EXECUTING_TOOL]
    assert sorted(r.refs.error_code or "ok" for r in landed) == ["child_cancelled", "child_cancelled", "ok"]
    assert [(s.tool, s.status) for s in parent.steps if s.tool == "held_read"] == [("held_read", "ok")]  # waited for
    assert [s.outcome for s in parent.steps if s.tool == "tether.delegate"] in (["unknown", "failed"], ["failed", "unknown"])
    assert [r.to_state for r in parent.timeline if r.kind == "transition"].count(S.HANDED_OFF) == 1
    assert ATTEMPTS[f"{tag}/1"] == 0 and "after" not in ORDER[tag] and IN_FLIGHT[tag] == 0
    assert [r for r in billing.get("/refunds")["refunds"] if r.get("reason") == f"{tag}-1"] == []  # nothing refunded
    check_timeline(parent.timeline, {s.tool_call_id: s.tool for s in parent.steps}, read_only=(*READ_ONLY, "tether.delegate"))


async def test_a_handoff_during_a_group_from_someone_the_policy_refuses_cancels_nothing(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Bob's key is on file and his hand-off is unsigned: the wait wakes, the policy refuses it,
    and the group goes on untouched: both children complete, the barrier, the step after."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from tests.helpers.inbox_stack import raw_public
    from tests.helpers.delegation import refusals
    from workflows.contract import HandoffRequest

    policy = tmp_path / "policy.toml"
    key = raw_public(ed25519.Ed25519PrivateKey.generate())
    policy.write_text(f'[tenants.default.approvers]\nalice = {{ roles = ["approver"] }}\nbob = {{ roles = ["approver"], public_key = "{key}" }}\n')
    tag = uuid.uuid4().hex[:8]
    async with running_worker(dev_env.client, registry=REGISTRY, policy=PolicyStore(policy)) as worker:
        handle, ids = await all_running(dev_env.client, worker, two_children(tag), tag)
        await handle.signal("handoff", HandoffRequest(by="bob", reason="unsigned"))
        await refusals(handle, "signature_required", 1)
        outcome, children = await released(dev_env.client, handle, tag, ids)
    assert outcome.state == S.COMPLETED, outcome.timeline[-1].reason
    assert len(children) == 2 and all(c.state == S.COMPLETED for c in children)
    assert not any(r.to_state == S.CANCELLED for c in children for r in c.timeline)
    assert any(r.reason == "parallel group 1: all 3 steps succeeded" for r in outcome.timeline)
    assert ORDER[tag][-1] == "after" and sorted(e for e in ORDER[tag] if e.startswith("start")) == ["start 1", "start 2", "start 3"]
    check_timeline(outcome.timeline, {s.tool_call_id: s.tool for s in outcome.steps}, read_only=(*READ_ONLY, "tether.delegate"))


async def test_two_handoffs_at_once_during_a_group_one_is_taken(dev_env: WorkflowEnvironment) -> None:
    from tests.helpers.delegation import cancel_requested
    from workflows.contract import HandoffRequest

    tag = uuid.uuid4().hex[:8]
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle, ids = await all_running(dev_env.client, worker, two_children(tag), tag)
        await asyncio.gather(handle.signal("handoff", HandoffRequest(by="dana", reason="customer called")),
                             handle.signal("handoff", HandoffRequest(by="erin", reason="me too")))
        for child_id in ids:
            await cancel_requested(dev_env, child_id)
        GATES[tag].set()
        parent = await asyncio.wait_for(run_outcome(handle), 60)
        history = await handle.fetch_history()
    assert (await create_replayer().replay_workflow(history, raise_on_replay_failure=False)).replay_failure is None
    assert parent.state == S.HANDED_OFF, parent.timeline[-1].reason
    taken = parent.timeline[-1]
    assert taken.actor in ("operator:dana", "operator:erin") and taken.refs.outcome == "failed"  # read-only children
    refused = [r for r in parent.timeline if r.kind == "refused"]
    assert [r.rule for r in refused] == ["handoff_pending"] and refused[0].actor != taken.actor
    assert [r.to_state for r in parent.timeline if r.kind == "transition"].count(S.HANDED_OFF) == 1
    assert "after" not in ORDER[tag] and IN_FLIGHT[tag] == 0
    check_timeline(parent.timeline, {s.tool_call_id: s.tool for s in parent.steps}, read_only=(*READ_ONLY, "tether.delegate"))


@pytest.mark.parametrize("second", ["ended_on_its_own", "not_started"])
def test_a_handoff_taken_during_a_group_whose_children_cancel_nothing(second: str) -> None:
    """The engine (the workflow's own code), driven here: the hand-off is judged and taken while
    a child of the group runs, but no open child is cancelled by it. ``ended_on_its_own``: every
    child completed before the cancel reached it: the group ends as any, and the hand-off is taken
    at the next point, before the next step runs (one that arrived meanwhile refused). ``not_started``:
    the second child was kept from starting: the run is handed off once the group has ended."""
    from tests.helpers.delegation import LOOKUP, delegate, woken_twice
    from tests.helpers.delegation import START
    from workflows.commands import Landed
    from workflows.contract import DELEGATE
    from workflows.run_model import ToolFailure
    from workflows.run_state import RunOutcome
    from workflows.wire import HANDOFF_NOT_STARTED, ToolOutcome

    args = delegate(LOOKUP)["delegate"]
    plan = Proposal(steps=[ProposedStep(tool=DELEGATE, args=args, group=1), ProposedStep(tool=DELEGATE, args=args, group=1),
                           ProposedStep(group=1, **LOOKUP), ProposedStep(**LOOKUP)])
    done = RunOutcome(run_id="c", state=RunState.COMPLETED, answer="found it")
    held = ToolFailure(HANDOFF_NOT_STARTED, "not started", True, started=False)
    read = ToolOutcome(observation="{}", digest="d", size=2)
    e, groups, tools = woken_twice(plan, lambda command: [  # the group ends without a child the cancel reached
        Landed(0, done, START), Landed(1, done if second == "ended_on_its_own" else held, START), Landed(2, read, START)])
    records = e.data.lifecycle.timeline
    assert len(groups) == 2 and groups[0][0] is groups[1][0]  # the same group waited for again
    assert groups[0][1] is None and groups[1][1].startswith("by dana: parent run root handed off")
    assert e.state == RunState.HANDED_OFF and records[-1].actor == "operator:dana" and tools == []  # nothing after the group
    refused = [(r.actor, r.rule) for r in records if r.kind == "refused"]
    assert refused == [("operator:erin", "handoff_pending")]
    if second == "ended_on_its_own":
        assert any(r.reason == "parallel group 1: all 3 steps succeeded" for r in records)
        assert [s.status for s in e.steps()] == ["ok", "ok", "ok"]
    else:
        assert "parallel group 1: 1 step(s) not started" in records[-1].reason
        assert [(s.tool, s.status) for s in e.steps()] == [(DELEGATE, "ok"), (DELEGATE, "failed"), ("get_order", "ok")]

