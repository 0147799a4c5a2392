"""A decision taken on the run's roster (``PolicySnapshot.rosters``, judged by the policy activity
with the run's setup): the run takes the one approval a request asks for at once, and the plan's
first call carries the decision for its tool worker to judge again, under the current file,
before the tool. What the engine does with it is driven as the workflow drives it
(tests/helpers/scripted.py); which decisions the roster decides is a pure function, tested from
a table; the tool worker's side is ``execute_tool`` with a real key ring and policy file."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest
from pydantic import BaseModel
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from tether.store.keys import KeyRing
from activities.policy_checks import PolicyActivities, approver_rosters
from tether.policy.files import PolicyStore
from activities.tools import ToolActivities
from tether.tools.sdk import REGISTRY, ToolContext, ToolEffect, ToolRegistry, tool
from tests.helpers.scripted import Scripted
from workflows import keys as workflow_keys
from workflows import policy
from workflows.commands import Call, Command, Mint, RunTool, Wait
from workflows.contract import ApprovalDecision, json_digest
from workflows.policy_file import TenantPolicy
from workflows.run_model import ToolFailure
from workflows.run_state import PendingApproval
from workflows.states import RunState
from workflows.wire import (
    CAPABILITY_INVALID, DECISION_NOT_HELD, JUDGE_UNAVAILABLE, ApproverRoster, DecisionCheck, Proposal, ProposedStep,
    ToolCall, ToolOutcome, Verdict,
)

S = RunState
PEEKS = ToolRegistry()


class Nothing(BaseModel):
    pass


@tool(effect=ToolEffect.READ_ONLY, name="peek", registry=PEEKS)
def peek(args: Nothing, ctx: ToolContext) -> dict:
    """Reads nothing."""
    return {"peeked": True}

READ = ProposedStep(tool="get_order", args={"order_id": "A-1001"})
REFUND = ProposedStep(tool="issue_refund", args={"order_id": "A-1001", "amount_cents": 9000, "reason": "r"})
ROSTER = ApproverRoster(risk="normal", roles=["approver"], people={"bob": ["p.bob"]}, anyone=None)


def waiting(steps: list[ProposedStep], rosters: list[ApproverRoster] = [ROSTER]) -> Scripted:
    run = Scripted(proposals=[Proposal(steps=steps)])
    assert run.engine.state == S.AWAITING_APPROVAL and isinstance(run.command, Wait)
    assert run.engine.data.policy is not None
    run.engine.data.policy.rosters = list(rosters)
    return run


def approval(run: Scripted, approver: str = "bob", **fields: object) -> ApprovalDecision:
    pending = run.engine.data.pending_approval
    assert pending is not None
    return ApprovalDecision(decision_id=uuid.uuid4().hex, approver=approver, plan_hash=pending.plan_hash,
                            request_id=pending.request_id, **fields)


def first_call(command: Command) -> bool:
    return isinstance(command, RunTool)


def next_call(run: Scripted) -> None:
    """Answer the call under way (from ``run.tools``) and stop at the next one."""
    current = run.command
    run.go(until=lambda c: isinstance(c, RunTool) and c is not current)


def calls(run: Scripted) -> list[str]:
    return [c.name for c in run.commands if isinstance(c, Call)]


def ok() -> ToolOutcome:
    return ToolOutcome(observation="{}", digest="d", size=2)


def test_an_approval_on_the_roster_goes_to_the_write_with_no_activity_and_the_write_carries_it() -> None:
    run = waiting([REFUND])
    before = len(run.commands)
    decision = approval(run)
    result = run.decide("approve", decision, until=first_call)
    assert result.outcome == "transition" and result.state == S.APPROVED, result
    assert result.record is not None and result.record.refs.policies == ["p.bob"], result.record
    taken = run.commands[before:]
    assert not [c for c in taken if isinstance(c, Call)], taken  # no policy activity on the way
    mint = next(c for c in taken if isinstance(c, Mint))
    assert mint.judge is not None and mint.judge.decision.decision_id == decision.decision_id
    assert mint.judge.then is not None and mint.judge.then.approvals == ["bob"]  # the plan's re-check, bob's approval in force
    tool = run.command
    assert isinstance(tool, RunTool) and tool.call.judge == mint.judge
    run.tools.append(ok())
    run.go()
    # The decision was judged once, by the tool worker: nothing else asks again.
    assert "policy_check_decision" not in calls(run)


def test_a_decision_the_tool_worker_refuses_is_judged_again_and_refused_the_run_asks_anew() -> None:
    run = waiting([REFUND])
    decision = approval(run)
    request = run.engine.data.pending_approval.request_id  # type: ignore[union-attr]
    run.decide("approve", decision, until=first_call)
    run.refusals[decision.decision_id] = policy.Refusal(rule="role", message="bob has roles []; this plan needs one of ['approver']")
    run.tools.append(ToolFailure(code=DECISION_NOT_HELD, message="not started", permanent=True))
    run.go()
    assert calls(run)[-1:] == ["policy_check_decision"]
    assert run.engine.state == S.AWAITING_APPROVAL
    again = run.engine.data.pending_approval
    assert again is not None and again.request_id != request and again.approvals == []
    last = run.engine.data.lifecycle.timeline[-1]
    assert (last.from_state, last.to_state) == (S.EXECUTING_TOOL, S.AWAITING_APPROVAL)
    assert "approval no longer holds [role]" in last.reason, last.reason
    assert run.engine.data.tool_calls == 0  # the tool was not called
    # A new decision on the new request: the roster still decides it (nothing was adopted).
    second = approval(run, "bob")
    run.decide("approve", second, until=first_call)
    assert isinstance(run.command, RunTool) and run.command.call.judge is not None


@pytest.mark.parametrize("code", [DECISION_NOT_HELD, JUDGE_UNAVAILABLE, CAPABILITY_INVALID])
def test_a_decision_the_policy_activity_allows_on_second_judgement_goes_on_to_the_write(code: str) -> None:
    run = waiting([REFUND])
    run.decide("approve", approval(run), until=first_call)
    run.tools.append(ToolFailure(code=code, message="not started", permanent=True))
    next_call(run)
    assert calls(run)[-2:] == ["policy_check_decision", "policy_check_authority"], calls(run)
    again = run.command
    assert isinstance(again, RunTool) and again.call.judge is None and again.call.capability is None  # Scripted mints as given
    run.tools.append(ok())
    run.go()
    assert run.engine.data.tool_calls == 1 and run.engine.data.steps_ok == 1


def test_a_read_first_carries_the_decision_once() -> None:
    run = waiting([READ, REFUND])
    run.decide("approve", approval(run), until=first_call)
    read = run.command
    assert isinstance(read, RunTool) and read.call.tool == "get_order" and read.call.judge is not None
    assert not any(isinstance(c, Mint) for c in run.commands)
    # The attempt failed (its worker judged the decision, then the service said 503): the retry
    # is a plain read, and the write after it is judged as any later write, by its own re-check.
    run.tools.append(ToolFailure(code="injected_fault", message="503", permanent=False))
    next_call(run)
    if not isinstance(run.command, RunTool):  # the backoff first
        run.elapse(run.wait_ends()[0])
        run.go(until=first_call)
    retry = run.command
    assert isinstance(retry, RunTool) and retry is not read and retry.call.judge is None
    run.tools.append(ok())
    run.go(until=lambda c: isinstance(c, Mint))
    assert calls(run)[-1] == "policy_check_authority"
    assert run.command.judge is None  # type: ignore[union-attr]


def rostered(**pending: object) -> PendingApproval:
    fields: dict = dict(plan_hash="p", request_id="r", expires_at="2026-01-02T00:00:00Z", summary="s", risk="normal",
                        approvals_required=1, roles=["approver"])
    fields.update(pending)
    return PendingApproval(**fields)


ANYONE = ApproverRoster(risk="normal", roles=["approver"], people={}, anyone=["default.decide"])


@pytest.mark.parametrize(
    "rosters, pending, decision, decided",
    [
        ([ROSTER], {}, {"approver": "bob"}, ["p.bob"]),
        ([ROSTER], {}, {"approver": "mallory"}, None),  # not on it: the activity judges (and refuses)
        ([ANYONE], {}, {"approver": "mallory"}, ["default.decide"]),
        ([ANYONE], {}, {"approver": "alice"}, None),  # the requester
        ([ANYONE], {}, {"approver": "a1ice"}, None),  # looks like the requester
        ([ROSTER], {"approvals_required": 2}, {"approver": "bob"}, None),
        ([ROSTER], {"stage": 1}, {"approver": "bob"}, None),
        ([ROSTER], {"editors": ["carol"]}, {"approver": "bob"}, None),
        ([ROSTER], {"revisers": ["carol"]}, {"approver": "bob"}, None),
        ([ROSTER], {"risk": "high"}, {"approver": "bob"}, None),
        ([ROSTER], {"roles": ["admin"]}, {"approver": "bob"}, None),
        ([ROSTER], {}, {"approver": "bob", "signature": "c2ln"}, None),
        ([ROSTER], {}, {"approver": "bob", "attested_by": "sso"}, None),
        ([ROSTER], {}, {"approver": "bob", "steps": [1]}, None),
        ([], {}, {"approver": "bob"}, None),
    ],
)
def test_which_decisions_the_roster_decides(rosters: list, pending: dict, decision: dict, decided: list | None) -> None:
    made = ApprovalDecision(decision_id="d", plan_hash="p", request_id="r", **decision)
    assert policy.roster_policies(rosters, rostered(**pending), made, "alice") == decided


def test_the_roster_is_judged_again_as_the_request_opens() -> None:
    # The run's setup put bob on the roster; by the time the plan asks, the file puts carol there
    # instead: the planning-time check's attested roster is the one decisions are taken on.
    run = Scripted()
    assert run.engine.data.policy is not None
    run.engine.data.policy.rosters = [ROSTER]
    run.rosters = [ApproverRoster(risk="normal", roles=["approver"], people={"carol": ["p.carol"]})]
    run.proposals.append(Proposal(steps=[REFUND]))
    run.go()
    assert run.engine.state == S.AWAITING_APPROVAL
    asked = [c.arg for c in run.commands if isinstance(c, Call) and c.name == "policy_check_authority"]
    assert [a.roster for a in asked] == [True]
    assert run.engine.data.policy.rosters == run.rosters
    before = len(calls(run))
    run.decide("approve", approval(run, "bob"))
    assert "policy_check_decision" in calls(run)[before:]  # bob is no longer on it: the activity judges
    run = Scripted()
    run.engine.data.policy.rosters = [ROSTER]  # type: ignore[union-attr]
    run.rosters = [ApproverRoster(risk="normal", roles=["approver"], people={"carol": ["p.carol"]})]
    run.proposals.append(Proposal(steps=[REFUND]))
    run.go()
    run.decide("approve", approval(run, "carol"), until=first_call)
    assert "policy_check_decision" not in calls(run) and run.command.call.judge is not None  # type: ignore[union-attr]


def test_a_rejection_is_the_policy_activitys() -> None:
    run = waiting([REFUND])
    run.decide("reject", approval(run, reason="no"))
    assert "policy_check_decision" in calls(run)


def test_a_snapshot_replaced_by_a_re_check_has_no_roster() -> None:
    run = waiting([REFUND])
    from workflows.wire import Verdict

    run.engine.adopt(Verdict(policy_hash="h2", tenant_policy=TenantPolicy()))
    assert run.engine.data.policy is not None and run.engine.data.policy.rosters == []


# ----------------------------------------------------------------------------- the policy activity's roster


def test_the_roster_lists_who_cedar_lets_approve_and_leaves_out_the_keyed_and_the_signed(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(
        '[tenants.acme.approvers]\nbob = { roles = ["approver"] }\ncarol = { roles = ["viewer"] }\n'
        'dave = { roles = ["approver"], public_key = "' + "A" * 43 + '=" }\n'
        '[tenants.signed]\nrequire_signatures = true\n[tenants.signed.approvers]\nbob = { roles = ["approver"] }\n'
        '[tenants.open]\n'
    )
    store = PolicyStore(path)
    tenant, policies, _ = store.policies("acme")
    rosters = approver_rosters(tenant, policies, "acme", "alice")
    normal = next(r for r in rosters if r.risk == "normal")
    assert list(normal.people) == ["bob"] and normal.anyone is None  # carol lacks the role, dave has a key
    tenant, policies, _ = store.policies("signed")
    assert approver_rosters(tenant, policies, "signed", "alice") == []
    tenant, policies, _ = store.policies("open")  # no approvers listed: anyone but the requester
    open_roster = approver_rosters(tenant, policies, "open", "alice")
    # No high-risk rule: nothing is asked at that level, so no roster for it.
    assert [(r.risk, r.people, bool(r.anyone)) for r in open_roster] == [("normal", {}, True)]


# ----------------------------------------------------------------------------- the tool worker's side


def judged_write(ring: KeyRing, judge: DecisionCheck | None, *, digest_of: DecisionCheck | None) -> ToolCall:
    """A write of ``send_email`` as the run's workflow code mints it (activity id ``a1`` of
    ``wf``), its capability naming the digest of ``digest_of``, the call carrying ``judge``."""
    from datetime import datetime, timezone

    call = ToolCall(tool="send_email", args={"to": "a@b.c", "subject": "s", "body": "b"}, tool_call_id="tc-1",
                    idempotency_key="wf:tc-1", run_id="wf", tenant="default")
    cap = workflow_keys.mint(ring, call, workflow_id="wf", run_id="run", activity_id="a1", request_id="r", plan_hash="p",
                             now=datetime.now(timezone.utc), ttl_seconds=60,
                             judge_digest=json_digest(digest_of.model_dump(mode="json")) if digest_of else "")
    return call.model_copy(update={"capability": cap, "judge": judge})


def decision_check(approver: str = "bob") -> DecisionCheck:
    return DecisionCheck(tenant="default", workflow_id="wf", kind="approve", requested_by="alice", roles=["approver"],
                         already_approved=[],
                         decision=ApprovalDecision(decision_id="d1", approver=approver, plan_hash="p", request_id="r"))


def activity_env() -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id="wf", workflow_run_id="run", activity_id="a1")
    return env


async def test_the_tool_worker_refuses_a_write_whose_decision_was_stripped_or_changed() -> None:
    import examples.billing.tools  # noqa: F401  (send_email)

    ring = KeyRing.of(b"k" * 64)
    rules = PolicyActivities(PolicyStore(None), ring)
    tools = ToolActivities(REGISTRY, ring, judge=rules.judge_decision)
    env = activity_env()
    check = decision_check()
    for call in (judged_write(ring, None, digest_of=check),  # stripped by whoever completed the task
                 judged_write(ring, decision_check("mallory"), digest_of=check)):  # swapped
        with pytest.raises(ApplicationError) as refused:
            await env.run(tools.execute_tool, call)
        assert refused.value.type == CAPABILITY_INVALID and "decision check" in str(refused.value)


async def test_the_tool_worker_judges_the_decision_and_refuses_what_the_current_file_refuses() -> None:
    ring = KeyRing.of(b"k" * 64)
    rules = PolicyActivities(PolicyStore(None), ring)
    env = activity_env()
    # alice requested the run: the built-in policy's four-eyes refuses her own approval.
    refused_check = decision_check("alice")
    call = ToolCall(tool="peek", args={}, tool_call_id="tc-1", idempotency_key="k", run_id="wf",
                    tenant="default", judge=refused_check)
    with pytest.raises(ApplicationError) as refused:
        await env.run(ToolActivities(PEEKS, ring, judge=rules.judge_decision).execute_tool, call)
    assert refused.value.type == DECISION_NOT_HELD and "four_eyes" in str(refused.value)
    # A worker with no policy file to judge by says so: the run asks the policy activity.
    with pytest.raises(ApplicationError) as unable:
        await env.run(ToolActivities(PEEKS, ring).execute_tool, call.model_copy(update={"judge": decision_check()}))
    assert unable.value.type == JUDGE_UNAVAILABLE
    # A file this worker cannot judge by: the tool is not called, the policy activity judges.
    async def broken(check: DecisionCheck) -> Verdict:
        raise ApplicationError("policy.toml: cannot be read; fix the policy file", type="policy_file_invalid")

    with pytest.raises(ApplicationError) as unable:
        await env.run(ToolActivities(PEEKS, ring, judge=broken).execute_tool, call.model_copy(update={"judge": decision_check()}))
    assert unable.value.type == JUDGE_UNAVAILABLE and unable.value.non_retryable
    # bob may approve: the read runs.
    outcome = await env.run(ToolActivities(PEEKS, ring, judge=rules.judge_decision).execute_tool,
                            call.model_copy(update={"judge": decision_check()}))
    assert "peeked" in outcome.observation


def test_the_policy_worker_judges_a_roster_once_per_file_and_none_for_a_file_that_moved_on() -> None:
    rules = PolicyActivities(PolicyStore(None), KeyRing.of(b"k" * 64))
    _, _, digest = rules.store.policies("default")
    first = rules._rosters("default", "alice", digest)
    assert first and rules._rosters("default", "alice", digest) is first  # judged once, for every run
    assert rules._rosters("default", "alice", "0" * 64) == []  # not the file in force: no roster
