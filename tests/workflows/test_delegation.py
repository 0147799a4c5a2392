"""Delegation: a plan step that hands a sub-task to a child run, on the dev server with real
workers and the real billing service. A child never holds more than its parent: a tool outside
its grant, a grandchild past the depth limit and a grant its parent's workflow code did not seal
for it are refused, with nothing written.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from tether.store.keys import KeyRing
from tether.planners.planning import BUILTIN_PLANNERS
from tether.policy.files import PolicyStore
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot, timeline
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from tests.helpers import held_tools
from tests.helpers.cli import Cli
from tests.helpers.invariants import check_timeline
from worker import create_replayer
from workflows.contract import DELEGATE, Grant
from workflows.run_state import RunOutcome, RunRequest
from workflows.states import RunState
from workflows.wire import Proposal, ProposedStep
from tests.helpers.delegation import LOOKUP, Overreacher, cancel_requested, cancelled_states, child_outcome, delegate, refund, refunds_with, refusals, started_child, woken_twice, writing_child, writing_delegation

S = RunState


async def test_a_parent_delegates_a_lookup_then_refunds_with_approval(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(dev_env.client) as worker:
        reason = uuid.uuid4().hex
        handle = await start_run(dev_env.client, worker, make_request([delegate(LOOKUP), refund(reason=reason)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert snap.plan.steps[0].tool == DELEGATE and snap.plan.steps[0].args["playbook"] == [LOOKUP]
        await handle.signal("approve", approval_for(snap, "bob"))
        parent = await asyncio.wait_for(run_outcome(handle), 90)
        child_id, child = await child_outcome(dev_env, parent)
    assert parent.state == S.COMPLETED, parent.timeline[-1].reason
    assert child_id == f"{handle.id}.{parent.steps[0].tool_call_id}"  # derived from the parent's chain and step
    assert child.state == S.COMPLETED and [s.tool for s in child.steps] == ["get_order"]
    assert parent.steps[0].digest  # the child's outcome is the step's result
    assert len(refunds_with(billing, reason)) == 1
    check_timeline(parent.timeline, {s.tool_call_id: s.tool for s in parent.steps}, read_only=("get_order", DELEGATE))
    # The child's start input names its grant: what it narrowed, sealed.
    history = await dev_env.client.get_workflow_handle(child_id).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    grant = Grant.model_validate(json.loads(started.input.payloads[0].data)["grant"])
    assert (grant.parent, grant.root, grant.depth, grant.tools, grant.max_steps) == (handle.id, handle.id, 1, ["get_order"], 3)
    assert grant.seal and grant.requested_by == "alice"


async def test_a_delegation_that_gives_what_it_does_not_name_is_refused(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    reason = uuid.uuid4().hex
    async with running_worker(dev_env.client) as worker:
        request = make_request([delegate(refund("A-1003", 300, reason), tools=("get_order",))], limits={"max_replans": 0})
        outcome = await asyncio.wait_for(run_outcome(await start_run(dev_env.client, worker, request)), 60)
    assert outcome.state == S.FAILED
    assert any("calls 'issue_refund', outside the tools it gives" in r.reason for r in outcome.timeline)
    assert refunds_with(billing, reason) == []


async def test_a_child_that_proposes_a_tool_its_grant_lacks_is_refused(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    reason = uuid.uuid4().hex
    planners = {**BUILTIN_PLANNERS, "overreach": Overreacher(reason)}
    async with running_worker(dev_env.client, planners=planners) as worker:
        request = RunRequest(goal="parent: look into A-1003", requested_by="alice", planner="overreach",
                             limits={"max_replans": 0})
        parent = await asyncio.wait_for(run_outcome(await start_run(dev_env.client, worker, request)), 60)
        _, child = await child_outcome(dev_env, parent)
    assert child.state == S.FAILED
    assert any("tool 'issue_refund' is outside this run's grant" in r.reason for r in child.timeline)
    assert parent.state == S.EXECUTION_FAILED and parent.timeline[-1].refs.error_code == "child_failed"
    assert refunds_with(billing, reason) == []


async def test_a_grandchild_beyond_the_depth_limit_is_refused(dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("[tenants.default]\n[tenants.default.budgets]\nmax_depth = 1\n")
    inner = delegate(LOOKUP, goal="the grandchild")
    async with running_worker(dev_env.client, policy=PolicyStore(policy)) as worker:
        request = make_request([delegate(inner, tools=("get_order",), max_steps=4)], limits={"max_replans": 0})
        parent = await asyncio.wait_for(run_outcome(await start_run(dev_env.client, worker, request)), 60)
        child_id, child = await child_outcome(dev_env, parent)
    assert child.state == S.FAILED
    assert any("beyond the depth limit: this run is at depth 1, max_depth is 1" in r.reason for r in child.timeline)
    assert parent.state == S.EXECUTION_FAILED and parent.timeline[-1].refs.error_code == "child_failed"


async def test_a_delegation_of_a_tool_the_tenant_does_not_allow_is_refused(dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path) -> None:
    # The tenant's tools list narrows the run; a delegation cannot hand on what the run lacks.
    policy = tmp_path / "policy.toml"
    policy.write_text('[tenants.default]\ntools = ["get_order"]\n')
    reason = uuid.uuid4().hex
    async with running_worker(dev_env.client, policy=PolicyStore(policy)) as worker:
        request = make_request([delegate(refund("A-1003", 300, reason), tools=("get_order", "issue_refund"))], limits={"max_replans": 0})
        outcome = await asyncio.wait_for(run_outcome(await start_run(dev_env.client, worker, request)), 60)
    assert outcome.state == S.FAILED
    assert any("delegation names a tool it cannot give: tool 'issue_refund' is not allowed for this tenant" in r.reason
               for r in outcome.timeline), [r.reason for r in outcome.timeline]
    assert not any(s.tool == DELEGATE for s in outcome.steps)  # no child was started
    assert refunds_with(billing, reason) == []


@pytest.mark.parametrize("how", ["made_up", "copied_to_another_id", "copied_to_the_same_id"])
async def test_a_forged_grant_in_a_start_input_is_refused(dev_env: WorkflowEnvironment, billing: Billing, how: str) -> None:
    reason = uuid.uuid4().hex
    async with running_worker(dev_env.client) as worker:
        run_id = f"forged-{uuid.uuid4().hex[:8]}"
        grant = Grant(root="r", parent="p", parent_run="x", child=run_id, depth=1, tenant="default",
                      tools=["issue_refund"], effects=["idempotent"], max_steps=3, requested_by="alice",
                      seal=f"{KeyRing.from_env().newest}:" + "0" * 64)  # the fleet's key id, a made-up MAC
        if how != "made_up":
            # A real child's grant, read from its start input (whoever can read history can).
            parent = await start_run(dev_env.client, worker, make_request([delegate(LOOKUP)]))
            done = await asyncio.wait_for(run_outcome(parent), 60)
            child_id, _ = await child_outcome(dev_env, done)
            history = await dev_env.client.get_workflow_handle(child_id).fetch_history()
            raw = json.loads(history.events[0].workflow_execution_started_event_attributes.input.payloads[0].data)
            grant = Grant.model_validate(raw["grant"])
            if how == "copied_to_the_same_id":
                run_id = child_id  # the child has ended: its id may be used again
        request = make_request([refund("A-1002", 300, reason)]).model_copy(update={"grant": grant})
        handle = await start_run(dev_env.client, worker, request, run_id=run_id) if how != "copied_to_the_same_id" else \
            await _start_again(dev_env, worker, request, run_id)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 60)
        snap = await snapshot(handle)
    assert snap.state == S.FAILED and snap.last_error.startswith("grant_invalid: ")
    assert refunds_with(billing, reason) == []


async def _start_again(env: WorkflowEnvironment, worker, request: RunRequest, run_id: str):
    from tether.client import start_run as tether_start

    return await tether_start(env.client, request, run_id=run_id, queue=worker.task_queue, allow_id_reuse=True)


async def test_a_cancel_of_the_parent_reaches_its_running_child(dev_env: WorkflowEnvironment) -> None:
    tag = uuid.uuid4().hex[:8]
    playbook = [delegate({"tool": "held_read", "args": {"tag": tag, "n": 1}}, tools=("held_read",)), {"tool": "after_read", "args": {"tag": tag}}]
    async with running_worker(dev_env.client, registry=held_tools.REGISTRY) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        await held_tools.started(tag, 1)  # the child's step is running
        await handle.cancel()
        held_tools.GATES[tag].set()
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 60)
        parent = await snapshot(handle)
        child = dev_env.client.get_workflow_handle(f"{handle.id}.{parent.plan.steps[0].tool_call_id}")
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(child.result(), 60)
        child_snap = await snapshot(child)
    assert parent.state == S.CANCELLED and child_snap.state == S.CANCELLED
    assert held_tools.IN_FLIGHT[tag] == 0 and "after" not in held_tools.ORDER[tag]


async def test_the_parents_approval_covers_the_writes_its_plan_named(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    named, own = uuid.uuid4().hex, uuid.uuid4().hex
    playbook = [delegate(refund("A-1002", 300, named), tools=("issue_refund",), goal="refund the named amount"),
                refund("A-1002", 200, own)]
    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        parent = await asyncio.wait_for(run_outcome(handle), 90)
        _, child = await child_outcome(dev_env, parent)
    assert parent.state == S.COMPLETED and child.state == S.COMPLETED, (parent.timeline[-1].reason, child.timeline[-1].reason)
    assert not any(r.to_state == S.AWAITING_APPROVAL for r in child.timeline)  # it asked nobody
    assert any(f"covered by the approval of parent run {handle.id}" in r.reason for r in child.timeline)
    assert len(refunds_with(billing, named)) == 1 and len(refunds_with(billing, own)) == 1


async def test_a_child_that_claims_its_parents_approval_for_other_arguments_asks_its_own(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    named, claimed = uuid.uuid4().hex, uuid.uuid4().hex
    planners = {**BUILTIN_PLANNERS, "overreach": Overreacher(claimed)}  # the child proposes A-1003, not A-1002
    body = delegate(refund("A-1002", 300, named), tools=("issue_refund",), goal="child: refund")
    body["delegate"]["planner"] = "overreach"
    async with running_worker(dev_env.client, planners=planners) as worker:
        handle = await start_run(dev_env.client, worker, make_request([body, refund("A-1002", 200, uuid.uuid4().hex)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        child = await started_child(dev_env, f"{handle.id}.{snap.plan.steps[0].tool_call_id}")
        child_snap = await wait_for_state(child, "AWAITING_APPROVAL", timeout=60)
        await handle.cancel()
    assert child_snap.pending_approval is not None and child_snap.approved_by == []
    assert refunds_with(billing, claimed) == [] and refunds_with(billing, named) == []


async def test_the_documented_example_delegates_a_read_only_lookup_then_refunds(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """docs/contract.md's worked example (examples/billing/delegate.playbook.json): a child
    looks up three orders at once, read-only; the parent then refunds, with bob's approval."""
    playbook = json.loads((Path(__file__).resolve().parents[2] / "examples/billing/delegate.playbook.json").read_text())
    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook, goal="Refund A-1001 for the late delivery"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert [s.tool for s in snap.plan.steps] == [DELEGATE, "issue_refund"]
        await handle.signal("approve", approval_for(snap, "bob"))
        parent = await asyncio.wait_for(run_outcome(handle), 90)
        _, child = await child_outcome(dev_env, parent)
    assert parent.state == S.COMPLETED and child.state == S.COMPLETED
    assert sorted(s.args.get("order_id", "") for s in child.steps) in (["A-1001", "A-1002", "A-1003"], ["", "", ""])
    assert [s.tool for s in child.steps] == ["get_order"] * 3
    assert any(r.reason == "parallel group 1: all 3 steps succeeded" for r in child.timeline)
    grant = (await dev_env.client.get_workflow_handle(child.run_id).fetch_history()).events[0]
    assert json.loads(grant.workflow_execution_started_event_attributes.input.payloads[0].data)["grant"]["tools"] == ["get_order"]


async def test_status_shows_the_tree(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """`tether status` of a parent names its children; of a child, its parent, the parent's
    goal and what its grant gives it; `tether timeline --all` of the parent has the child's
    records, each marked."""
    from tether.cli.output import format_status
    from tether.client import status

    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request([delegate(LOOKUP)], goal="Refund A-1001 (tree)"))
        parent = await asyncio.wait_for(run_outcome(handle), 60)
        child_id, _ = await child_outcome(dev_env, parent)
        shown_parent = format_status(await status(dev_env.client, handle.id, live=True))
        shown_child = format_status(await status(dev_env.client, child_id, live=True))
        code, out, err = await Cli(dev_env, worker)("timeline", handle.id, "--all")
    assert code in (0, 1), err  # 1: the audit collector may not have every record yet
    assert f"[child {child_id}] == run " in out and f"[child {child_id}]" in out.splitlines()[-1]
    assert "(get_order) succeeded" in "\n".join(line for line in out.splitlines() if line.startswith(f"[child {child_id}]"))
    assert f"child      {child_id}" in shown_parent
    assert f"child of   {handle.id} (depth 1): Refund A-1001 (tree)" in shown_child
    assert "grant      tools get_order" in shown_child


async def test_a_keyless_poller_that_starts_a_child_with_a_forged_grant_gets_it_refused(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Whoever polls the queue can answer the parent's task with a child start of its own, the
    parent the server records as the grant says: without the fleet key its grant's seal cannot be
    made, and the child refuses it before anything runs."""
    from tests.helpers.rogue import rogue_answer, start_child
    from tests.helpers.runs import unique

    reason = uuid.uuid4().hex
    queue = unique("tq")
    parent = await dev_env.client.start_workflow("AgentRun", make_request([LOOKUP]).model_dump(mode="json"),
                                                 id=unique("run"), task_queue=queue)
    child_id = f"{parent.id}.forged"
    grant = Grant(root=parent.id, parent=parent.id, parent_run=parent.result_run_id, child=child_id, depth=1,
                  tenant="default", tools=["issue_refund"], effects=["idempotent"], max_steps=3, requested_by="alice",
                  seal=f"{KeyRing.from_env().newest}:" + "1" * 64)
    forged = make_request([refund("A-1002", 300, reason)]).model_copy(update={"grant": grant})
    await rogue_answer(dev_env.client, queue, parent.id, [start_child(queue, dev_env.client.namespace, child_id, forged)])
    async with running_worker(dev_env.client, task_queue=queue):
        child = await started_child(dev_env, child_id)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(child.result(), 60)
        snap = await snapshot(child)
    await parent.terminate("test over")
    assert snap.state == S.FAILED and snap.last_error.startswith("grant_invalid: the grant does not bear the fleet key's seal")
    assert refunds_with(billing, reason) == []


async def test_a_cancel_of_the_root_during_a_grandchilds_parallel_group_leaves_nothing_stranded(dev_env: WorkflowEnvironment) -> None:
    """The root delegates to a child, which delegates to a grandchild running a parallel group:
    the root's cancel reaches both, every attempt in flight settles, nothing runs after."""
    tag = uuid.uuid4().hex[:8]
    held = [{"tool": "held_read", "args": {"tag": tag, "n": n}} for n in (1, 2, 3)]
    grandchild = delegate({"parallel": held}, tools=("held_read",), goal="the grandchild", max_steps=3)
    child = delegate(grandchild, {"tool": "after_read", "args": {"tag": tag}}, tools=("held_read", "after_read"), max_steps=5)
    async with running_worker(dev_env.client, registry=held_tools.REGISTRY) as worker:
        root = await start_run(dev_env.client, worker, make_request([child, {"tool": "after_read", "args": {"tag": tag}}]))
        await held_tools.started(tag, 3)  # the grandchild's group is running, all three at once
        ids = [root.id]
        for _ in range(2):  # the child, then the grandchild: each the first step of its parent's plan
            ids.append(f"{ids[-1]}.{(await snapshot(dev_env.client.get_workflow_handle(ids[-1]))).plan.steps[0].tool_call_id}")
        await root.cancel()
        await cancel_requested(dev_env, ids[-1])  # the cancel has reached the grandchild: then its attempts end
        held_tools.GATES[tag].set()
        ended = await cancelled_states(dev_env, ids)
    assert ended == [S.CANCELLED] * 3
    assert held_tools.IN_FLIGHT[tag] == 0 and "after" not in held_tools.ORDER[tag]


async def test_a_childs_own_request_is_in_the_inbox_and_the_list_linked_to_its_parent(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """A child's write its parent's approval does not cover asks its own approval: the inbox
    offers it to bob, saying whose child it is and the parent's goal; `tether list` says so too."""
    import httpx
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from tether.client import list_runs
    from tether.cli.output import format_list
    from tether.inbox.app import InboxConfig, create_app
    from tests.helpers.runs import unique
    from tests.helpers.inbox_stack import AUDIENCE, ISSUER, POLICY, Sso, _serve, raw_public
    from tests.helpers.ports import free_port

    keys = {n: ed25519.Ed25519PrivateKey.generate() for n in ("alice", "bob", "inbox")}
    tenant = unique("tree")
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.format(inbox=raw_public(keys["inbox"]), alice=raw_public(keys["alice"]),
                                    bob=raw_public(keys["bob"]), tenant=tenant, signed=unique("tree-signed")))
    reason = uuid.uuid4().hex
    async with running_worker(dev_env.client, policy=PolicyStore(policy), planners=writing_child(reason)) as worker:
        request = make_request([writing_delegation()], goal="Parent: refund A-1002 via a child", tenant=tenant)
        root = await start_run(dev_env.client, worker, request)
        snap = await wait_for_state(root, "AWAITING_APPROVAL")  # a delegation that may write: bob approves
        await root.signal("approve", approval_for(snap, "bob"))
        child = await started_child(dev_env, f"{root.id}.{snap.plan.steps[0].tool_call_id}")
        await wait_for_state(child, "AWAITING_APPROVAL", timeout=60)
        # The list reads visibility, which catches up with the run a moment later: wait for it.
        for _ in range(600):
            listed = format_list(await list_runs(dev_env.client, tenant=tenant))
            if f"  child of {root.id}" in listed:
                break
            await asyncio.sleep(0.1)
        sso = Sso()
        (tmp_path / "jwks.json").write_text(json.dumps(sso.jwks()))
        app = create_app(InboxConfig(policy=policy, jwks=str(tmp_path / "jwks.json"), issuer=ISSUER, audience=AUDIENCE,
                                     key=tmp_path / "inbox.pem", poll_ms=300), temporal=dev_env.client)
        port = free_port()
        server, task = await _serve(app, port)
        try:
            auth = {"Authorization": f"Bearer {sso.token('bob')}"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=auth, timeout=30) as http:
                for _ in range(600):
                    waiting = (await http.get("/api/approvals")).json()["approvals"]
                    if child.id in [a["run_id"] for a in waiting]:
                        break
                    await asyncio.sleep(0.1)
                page = await http.get(f"/runs/{child.id}")
        finally:
            server.should_exit = True
            await task
        await root.cancel()
    assert child.id in [a["run_id"] for a in waiting]
    assert page.status_code == 200 and 'id="parent"' in page.text and root.id in page.text
    assert "Parent: refund A-1002 via a child" in page.text
    assert f"  child of {root.id}" in listed
    assert refunds_with(billing, reason) == []


async def test_a_parents_compensation_undoes_its_childs_writes(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """on_failure=compensate: a step after the delegation fails, and the parent undoes the
    writes its child made (from the child's closed record, attested), newest first."""
    by_child, failing = uuid.uuid4().hex, uuid.uuid4().hex
    playbook = [delegate(refund("A-1002", 300, by_child), tools=("issue_refund",), goal="refund in a child"),
                refund("A-1003", 999_999, failing)]  # over the order's total: refused, nothing applied
    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook, on_failure="compensate"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        parent = await asyncio.wait_for(run_outcome(handle), 90)
    assert parent.state == S.COMPENSATED, parent.timeline[-1].reason
    (made,) = refunds_with(billing, by_child)
    assert made["voided_at"] is not None  # the child's refund, undone by the parent
    assert refunds_with(billing, failing) == []
    assert [c.status for c in parent.compensations] == ["ok"]


async def test_a_run_whose_id_leaves_no_room_for_a_childs_is_refused_not_wedged(dev_env: WorkflowEnvironment) -> None:
    """A child's id is its parent's and its step's: a parent id near Temporal's limit cannot name
    one. Validation says so on the record; the run ends, its workflow tasks never fail."""
    async with running_worker(dev_env.client) as worker:
        run_id = "long-" + "x" * 985
        request = make_request([delegate(LOOKUP)], limits={"max_replans": 0})
        outcome = await asyncio.wait_for(run_outcome(await start_run(dev_env.client, worker, request, run_id=run_id)), 60)
    assert outcome.state == S.FAILED
    assert any("too long to name a child run by" in r.reason for r in outcome.timeline)


async def test_a_handoff_of_the_parent_while_its_child_runs_cancels_the_child_first(dev_env: WorkflowEnvironment) -> None:
    """The parent waits on a child whose tool is held running: a hand-off of the parent wakes the
    wait, cancels the child (its attempt settles, on its record), then the parent is HANDED_OFF
    with the child's end on its record; nothing runs after, nothing is written twice."""
    from workflows.contract import HandoffRequest

    tag = uuid.uuid4().hex[:8]
    playbook = [delegate({"tool": "held_read", "args": {"tag": tag, "n": 1}}, tools=("held_read",)),
                {"tool": "after_read", "args": {"tag": tag}}]
    async with running_worker(dev_env.client, registry=held_tools.REGISTRY) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        await held_tools.started(tag, 1)  # the child's step is running
        child_id = f"{handle.id}.{(await snapshot(handle)).plan.steps[0].tool_call_id}"
        await asyncio.gather(handle.signal("handoff", HandoffRequest(by="dana", reason="customer called")),
                             handle.signal("handoff", HandoffRequest(by="erin", reason="me too")))
        await cancel_requested(dev_env, child_id)  # the hand-off reached the child: then its attempt ends
        held_tools.GATES[tag].set()
        parent = await asyncio.wait_for(run_outcome(handle), 60)
        child = dev_env.client.get_workflow_handle(child_id)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(child.result(), 60)
        child_snap = await snapshot(child)
        child_records = await timeline(child)
        histories = [await handle.fetch_history(), await child.fetch_history()]
    for history in histories:  # the wake, the judging and the cancel replay as they ran
        assert (await create_replayer().replay_workflow(history, raise_on_replay_failure=False)).replay_failure is None
    assert parent.state == S.HANDED_OFF, parent.timeline[-1].reason
    taken = next(r for r in parent.timeline if r.to_state == S.HANDED_OFF)
    assert taken.actor in ("operator:dana", "operator:erin") and f"child run {child_id} cancelled first" in taken.reason
    other = [r for r in parent.timeline if r.kind == "refused" and r.rule in ("handoff_pending", "run_ended")]
    assert len(other) == 1 and other[0].actor != taken.actor  # the second is refused, never taken too
    assert taken.refs.error_code == "child_cancelled" and taken.refs.outcome == "failed"  # a read-only child wrote nothing
    assert [r.to_state for r in parent.timeline if r.kind == "transition"].count(S.HANDED_OFF) == 1
    assert child_snap.state == S.CANCELLED and child_records[-1].actor == taken.actor.replace("operator:", "user:")
    assert "(held_read)" in child_records[-1].reason  # the child's attempt settled, on its record
    assert held_tools.IN_FLIGHT[tag] == 0 and held_tools.ATTEMPTS[f"{tag}/1"] == 1 and "after" not in held_tools.ORDER[tag]
    assert [s.tool for s in parent.steps] == [DELEGATE]
    check_timeline(parent.timeline, {s.tool_call_id: s.tool for s in parent.steps}, read_only=("after_read", DELEGATE))


async def test_a_handoff_of_a_parent_from_the_wrong_person_cancels_no_child(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Refused as for any run: a non-member on arrival; a member whose key the policy lists,
    unsigned, by the policy check (the wait woke for it). The child runs on and completes."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from tests.helpers.inbox_stack import raw_public
    from workflows.contract import HandoffRequest

    policy = tmp_path / "policy.toml"
    key = raw_public(ed25519.Ed25519PrivateKey.generate())
    policy.write_text(f'[tenants.default.approvers]\nalice = {{ roles = ["approver"] }}\nbob = {{ roles = ["approver"], public_key = "{key}" }}\n')
    tag = uuid.uuid4().hex[:8]
    playbook = [delegate({"tool": "held_read", "args": {"tag": tag, "n": 1}}, tools=("held_read",)),
                {"tool": "after_read", "args": {"tag": tag}}]
    async with running_worker(dev_env.client, registry=held_tools.REGISTRY, policy=PolicyStore(policy)) as worker:
        handle = await start_run(dev_env.client, worker, make_request(playbook))
        await held_tools.started(tag, 1)
        child_id = f"{handle.id}.{(await snapshot(handle)).plan.steps[0].tool_call_id}"
        await handle.signal("handoff", HandoffRequest(by="mallory", reason="let me"))
        await refusals(handle, "tenant_membership", 1)
        await handle.signal("handoff", HandoffRequest(by="bob", reason="unsigned"))
        await refusals(handle, "signature_required", 1)
        held_tools.GATES[tag].set()
        parent = await asyncio.wait_for(run_outcome(handle), 60)
        child = await run_outcome(dev_env.client.get_workflow_handle(child_id))
    assert parent.state == S.COMPLETED, parent.timeline[-1].reason
    assert child.state == S.COMPLETED and not any(r.to_state == S.CANCELLED for r in child.timeline)
    assert held_tools.ORDER[tag][-1] == "after"


def signed_tenant(tmp_path: Path) -> tuple[str, Path, Path]:
    """A tenant that requires signed starts; alice's key signs hers. (tenant, policy file, key)"""
    from tether.client.signing import keygen
    from tests.helpers.runs import unique

    key, tenant, policy = tmp_path / "alice.pem", unique("signed"), tmp_path / "policy.toml"
    public = keygen(key)
    policy.write_text(f'[tenants.{tenant}]\nrequire_signatures = true\n[tenants.{tenant}.approvers]\n'
                      f'alice = {{ roles = ["approver"], public_key = "{public}" }}\nbob = {{ roles = ["approver"] }}\n')
    return tenant, policy, key


async def signed_root(env: WorkflowEnvironment, worker, tenant: str, key: Path, playbook: list):
    from tether.client.signing import sign_request
    from tests.helpers.runs import unique

    run_id = unique("run")
    return await start_run(env.client, worker, sign_request(make_request(playbook, tenant=tenant), run_id, key), run_id=run_id)


async def test_in_a_tenant_that_requires_signed_starts_a_root_delegates_and_its_child_runs(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """The child's start carries its grant, not alice's signature: the grant is its authority."""
    tenant, policy, key = signed_tenant(tmp_path)
    async with running_worker(dev_env.client, policy=PolicyStore(policy)) as worker:
        unsigned = await start_run(dev_env.client, worker, make_request([LOOKUP], tenant=tenant, limits={"max_replans": 0}))
        refused = await asyncio.wait_for(run_outcome(unsigned), 60)  # the tenant does require them
        handle = await signed_root(dev_env, worker, tenant, key, [delegate(LOOKUP)])
        parent = await asyncio.wait_for(run_outcome(handle), 60)
        child_id, child = await child_outcome(dev_env, parent)
    assert refused.state == S.FAILED and refused.timeline[-1].rule is None and "[signature_required]" in refused.timeline[-1].reason
    assert parent.state == S.COMPLETED, parent.timeline[-1].reason
    assert child.state == S.COMPLETED, child.timeline[-1].reason
    assert [s.tool for s in child.steps] == ["get_order"]


@pytest.mark.parametrize("where", ["another_id", "the_childs_id"])
async def test_in_a_signed_start_tenant_a_copied_grant_without_its_parent_is_refused(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, where: str
) -> None:
    """A client starts a workflow with a real child's grant (read from history), no server
    parent: refused before anything runs, nothing written."""
    from tests.helpers.runs import unique

    tenant, policy, key = signed_tenant(tmp_path)
    reason = uuid.uuid4().hex
    async with running_worker(dev_env.client, policy=PolicyStore(policy)) as worker:
        done = await asyncio.wait_for(run_outcome(await signed_root(dev_env, worker, tenant, key, [delegate(LOOKUP)])), 60)
        child_id, _ = await child_outcome(dev_env, done)
        history = await dev_env.client.get_workflow_handle(child_id).fetch_history()
        grant = Grant.model_validate(json.loads(history.events[0].workflow_execution_started_event_attributes.input.payloads[0].data)["grant"])
        request = make_request([refund("A-1002", 300, reason)], tenant=tenant).model_copy(update={"grant": grant})
        if where == "the_childs_id":  # the child has ended: its id may be used again
            handle = await _start_again(dev_env, worker, request, child_id)
        else:
            handle = await start_run(dev_env.client, worker, request, run_id=unique("copied"))
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 60)
        snap, steps = await snapshot(handle), await handle.query("steps")
    assert snap.state == S.FAILED and snap.last_error.startswith("grant_invalid: ")
    assert steps == [] and refunds_with(billing, reason) == []


def test_a_grant_is_a_starts_authority_only_when_sealed_for_this_run_tenant_and_requester() -> None:
    """The policy's start check (tether/policy/signatures.py, granted_start) with the fleet's ring."""
    from tether.policy.signatures import granted_start
    from workflows import keys
    from workflows.wire import SnapshotRequest

    ring = KeyRing.from_env()
    grant = Grant(root="p", parent="p", parent_run="r", child="p.tc-1", depth=1, tenant="t", tools=["get_order"],
                  effects=["read_only"], max_steps=2, requested_by="alice")
    grant.seal = keys.seal_grant(ring, grant.sealed_digest())
    ask = SnapshotRequest(tenant="t", workflow_id="p.tc-1", requested_by="alice", grant=grant)
    assert granted_start(ring, ask)
    hostile = {
        "another run": ask.model_copy(update={"workflow_id": "p.tc-2"}),
        "another tenant": ask.model_copy(update={"tenant": "u"}),
        "another requester": ask.model_copy(update={"requested_by": "mallory"}),
        "widened after sealing": ask.model_copy(update={"grant": grant.model_copy(update={"tools": ["issue_refund"]})}),
        "made-up seal": ask.model_copy(update={"grant": grant.model_copy(update={"seal": f"{ring.newest}:" + "0" * 64})}),
        "a key nobody holds": ask.model_copy(update={"grant": grant.model_copy(update={"seal": "k-unknown:" + "0" * 64})}),
        "no seal": ask.model_copy(update={"grant": grant.model_copy(update={"seal": ""})}),
        "no grant": ask.model_copy(update={"grant": None}),
    }
    assert [name for name, request in hostile.items() if granted_start(ring, request)] == []
    assert not granted_start(None, ask)  # a worker with no ring takes no grant as authority


def test_a_handoff_taken_as_the_child_ends_on_its_own_is_taken_at_the_next_point() -> None:
    """The hand-off is judged and taken, but the child completes before the cancel reaches it.
    Its end counts as any; the hand-off is taken before the next step runs, and one that arrived
    meanwhile is refused, not lost."""
    plan = Proposal(steps=[ProposedStep(tool=DELEGATE, args=delegate(LOOKUP)["delegate"]), ProposedStep(**LOOKUP)])
    e, waits, tools = woken_twice(plan, lambda command: RunOutcome(run_id=command.child_id, state=S.COMPLETED, answer="found it"))
    outcome, records, steps = e.outcome("root"), e.data.lifecycle.timeline, e.steps()
    assert len(waits) == 2 and waits[0][1] is None and waits[1][1].startswith("by dana: parent run root handed off")
    assert outcome.state == S.HANDED_OFF and records[-1].actor == "operator:dana"
    assert "not started" in records[-1].reason and tools == []  # taken before the next step ran
    assert [s.tool for s in steps] == [DELEGATE] and steps[0].status == "ok"  # the child's end counted
    refused = [r for r in records if r.kind == "refused"]
    assert [(r.actor, r.rule) for r in refused] == [("operator:erin", "handoff_pending")]


async def test_a_handoff_of_the_parent_while_its_writing_child_awaits_approval(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """A child that may write (its grant gives a refund) waits for its own approval: the hand-off
    of the parent cancels it (nothing refunded) and the delegate step's outcome is unknown, its
    record the child's to read."""
    from workflows.contract import HandoffRequest

    reason = uuid.uuid4().hex
    async with running_worker(dev_env.client, planners=writing_child(reason)) as worker:
        handle = await start_run(dev_env.client, worker, make_request([writing_delegation()]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")  # a delegation that may write: bob approves
        await handle.signal("approve", approval_for(snap, "bob"))
        child = await started_child(dev_env, f"{handle.id}.{snap.plan.steps[0].tool_call_id}")
        await wait_for_state(child, "AWAITING_APPROVAL", timeout=60)
        await handle.signal("handoff", HandoffRequest(by="dana", reason="the customer called"))
        parent = await asyncio.wait_for(run_outcome(handle), 60)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(child.result(), 60)
        child_snap = await snapshot(child)
    assert parent.state == S.HANDED_OFF and parent.timeline[-1].refs.outcome == "unknown"
    assert child_snap.state == S.CANCELLED and child_snap.pending_approval is None
    assert refunds_with(billing, reason) == []
