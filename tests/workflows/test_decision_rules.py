"""The rules behind revisions, partial approval and escalation (workflows/approvals.py,
workflows/policy.py, the policy file). What a run does with them is driven as the workflow drives
the engine (``Engine.next`` / ``Engine.on``, decisions through the decide Update, timers by time
passing: tests/helpers/scripted.py); the policy file's and the signatures' rules are pure
functions, tested directly."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from tether.policy.files import check_policy_file, parse_policy, PolicyFileError
from tether.tools.sdk import REGISTRY
from tests.helpers.scripted import START, Scripted
from workflows import policy
from workflows.commands import Call, Command, Wait
from workflows.contract import ApprovalDecision, RevisionRequest
from workflows.policy_file import TenantPolicy, parse_duration
from workflows.revision import changed_paths, patch
from workflows.run_state import PendingApproval
from workflows.states import RunState, TransitionRecord
from workflows.wire import Proposal, ProposedStep, ToolOutcome

S = RunState
READ = ProposedStep(tool="get_order", args={"order_id": "A-1001"})
REFUND = ProposedStep(tool="issue_refund", args={"order_id": "A-1001", "amount_cents": 9000, "reason": "r"})
EMAIL = ProposedStep(tool="send_email", args={"to": "a@b.c", "subject": "s", "body": "b"})


def waiting(tenant: TenantPolicy | None = None, **limits: object) -> Scripted:
    """A run whose planner proposed a read, a refund and an email: it waits for approval."""
    run = Scripted(tenant, proposals=[Proposal(steps=[READ, REFUND, EMAIL])], **limits)
    assert run.engine.state == S.AWAITING_APPROVAL and isinstance(run.command, Wait)
    return run


def pending(run: Scripted) -> PendingApproval:
    assert run.engine.data.pending_approval is not None, "nothing pending"
    return run.engine.data.pending_approval


def approval(run: Scripted, approver: str = "bob", **fields: object) -> ApprovalDecision:
    p = pending(run)
    return ApprovalDecision(decision_id=uuid.uuid4().hex, approver=approver, plan_hash=p.plan_hash,
                            request_id=p.request_id, **fields)


def revision(run: Scripted, steps: list[dict], editor: str = "carol") -> RevisionRequest:
    p = pending(run)
    return RevisionRequest(decision_id=uuid.uuid4().hex, editor=editor, plan_hash=p.plan_hash,
                           request_id=p.request_id, steps=steps, reason="why")


def state_is(run: Scripted, state: RunState) -> Callable[[Command], bool]:
    """Stop the run at its first command once it is in ``state``."""
    return lambda command: run.engine.state == state


def body(run: Scripted) -> list[dict]:
    plan = run.engine.data.plan
    assert plan is not None
    return [{"tool": s.tool, "args": dict(s.args)} for s in plan.steps]


def escalations(run: Scripted) -> list[TransitionRecord]:
    return [r for r in run.engine.data.lifecycle.timeline if r.kind == "escalated"]


def ok(observation: str = '{"refund_id": "R-1"}') -> ToolOutcome:
    return ToolOutcome(observation=observation, digest="d", size=len(observation))


def test_durations_take_seconds_or_units() -> None:
    assert [parse_duration(v) for v in ("30s", "20m", "2h", "1d", "1.5h", 90)] == [30, 1200, 7200, 86400, 5400, 90]
    for bad in ("2x", "h", "-1h", "2 hours", ""):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)


def test_escalation_in_the_policy_file(tmp_path: Path) -> None:
    doc = parse_policy(
        '[tenants.default.escalation]\nnormal = [{ after = "2h", notify = ["ops"] }, { after = 21600, roles = ["m"] }]\n'
        '[notify.webhooks.ops]\nurl = "http://127.0.0.1:1/x"\nevents = ["escalated"]\n'
    )
    assert [s.after for s in doc.tenants["default"].escalation.normal] == [7200, 21600]
    with pytest.raises(PolicyFileError, match="line 2, key tenants.default.escalation.normal.*in order"):
        parse_policy('[tenants.default.escalation]\nnormal = [{ after = "6h" }, { after = "2h" }]\n')
    with pytest.raises(PolicyFileError, match="key tenants.default.escalation.high.0.after"):
        parse_policy('[tenants.default.escalation]\nhigh = [{ after = "soon" }]\n')
    with pytest.raises(PolicyFileError, match="key notify.webhooks.ops.events.0"):
        parse_policy('[notify.webhooks.ops]\nurl = "http://x"\nevents = ["everything"]\n')
    path = tmp_path / "p.toml"
    path.write_text(
        '[tenants.default]\ntools = ["get_order"]\n[tenants.default.approvers]\nbob = { roles = ["approver"] }\n'
        '[tenants.default.escalation]\nnormal = [{ after = "2h", roles = ["cfo"], notify = ["pager"] }]\n'
        '[notify.webhooks.ops]\nurl = "http://127.0.0.1:1/x"\nsecret_file = "missing.secret"\n'
    )
    problems = check_policy_file(path, REGISTRY.tools)
    assert any("notify.webhooks.ops.secret_file: no such file" in p for p in problems), problems
    assert any("stage 1 notifies 'pager'" in p for p in problems), problems
    assert any("role 'cfo' is held by no approver" in p for p in problems), problems


def test_stages_inside_the_window_fire_in_order_and_expiry_stays_last() -> None:
    tenant = TenantPolicy.model_validate(
        {"escalation": {"normal": [{"after": "1h", "roles": ["manager"]}, {"after": "2h"}, {"after": "1d"}]}}
    )
    run = waiting(tenant, approval_ttl_seconds=3 * 3600)
    assert [s.after for s in pending(run).escalation] == [3600, 7200], "a stage at or past the expiry never fires"
    # The run's timer is the first stage's: nothing escalates before it is due.
    assert run.wait_ends() == (START + timedelta(hours=1), "escalation stage 1")
    assert pending(run).stage == 0 and pending(run).roles == ["approver"]
    run.elapse(START + timedelta(hours=1))
    assert pending(run).roles == ["approver", "manager"] and pending(run).stage == 1
    assert run.wait_ends() == (START + timedelta(hours=2), "escalation stage 2")
    run.elapse(START + timedelta(hours=2))
    # None left: the next timer is the expiry's, not a third stage.
    assert run.wait_ends() == (START + timedelta(hours=3), "approval expiry")
    assert pending(run).stage == 2 and len(escalations(run)) == 2
    run.elapse(START + timedelta(hours=3))
    assert run.engine.state == S.EXPIRED and run.ended
    kinds = [(r.kind, r.state_version) for r in run.engine.data.lifecycle.timeline[-3:]]
    assert [k for k, _ in kinds] == ["escalated", "escalated", "transition"]
    assert kinds[0][1] == kinds[1][1], "an escalation changes no state"


def test_a_revision_makes_a_new_version_with_paths_not_values() -> None:
    run = waiting()
    old = run.engine.data.plan
    steps = body(run)
    steps[1]["args"]["amount_cents"] = 1234
    steps[2]["args"]["subject"] = "new subject"
    # Stopped where the revision is settled, before the run asks anew.
    verdict = run.decide("revise", revision(run, steps), until=state_is(run, S.VALIDATED))
    record = run.engine.data.lifecycle.timeline[-1]
    assert verdict.outcome == "transition" and verdict.record == record.model_copy(update={"prev": ""})
    assert (record.from_state, record.to_state) == (S.AWAITING_APPROVAL, S.VALIDATED)
    assert record.refs.changed == ["replace /1/args/amount_cents", "replace /2/args/subject"]
    assert "1234" not in record.model_dump_json() and "new subject" not in record.model_dump_json()
    plan = run.engine.data.plan
    assert plan.version == 2 and plan.plan_hash != old.plan_hash
    assert run.engine.data.pending_approval is None, "the old request is gone; VALIDATED asks anew"
    run.go()
    assert run.engine.state == S.AWAITING_APPROVAL and pending(run).editors == ["carol"]
    assert pending(run).plan_hash == plan.plan_hash
    # A proposal from the planner later is the next version and has no editors.
    assert run.engine.data.revisions[-1].previous_plan_hash == old.plan_hash


def test_partial_approval_is_a_revision_then_an_approval() -> None:
    run = waiting()
    before = pending(run)
    d = approval(run, steps=[2, 1])
    verdict = run.decide("approve", d, until=state_is(run, S.APPROVED))
    data = run.engine.data
    assert verdict.outcome == "transition" and verdict.state == S.APPROVED
    assert [s.tool for s in data.plan.steps] == ["get_order", "issue_refund"]
    assert [(n.step, n.tool) for n in data.not_approved] == [(3, "send_email")]
    mine = [r for r in data.lifecycle.timeline if r.refs.decision_id == d.decision_id]
    assert [r.to_state for r in mine] == [S.VALIDATED, S.APPROVED]
    assert mine[0].refs.request_id == before.request_id != mine[1].refs.request_id
    # The approved steps run; the planner is told once, with its next call, which steps were not
    # approved (the list is cleared when its next proposal comes in).
    run.tools += [ok('{"order_id": "A-1001"}'), ok()]
    asked = run.go()
    assert isinstance(asked, Call) and asked.name == "plan", asked
    assert [(n.step, n.tool, n.by) for n in asked.arg.not_approved] == [(3, "send_email", "bob")]
    assert data.steps_ok == 2 and not run.tools
    run.proposals.append(Proposal(answer="done"))
    run.go()
    assert data.not_approved == [] and run.engine.state == S.COMPLETED


def test_a_part_approved_again_under_another_decision_id_writes_under_the_same_keys() -> None:
    """A reset run approved again (its first decision id taken, or a new one sent): the steps a
    partial approval keeps, and a revision's steps, keep the tool call ids (idempotency keys)
    the first execution wrote under, whatever the decision's id."""
    def partly_approved() -> list[str]:
        run = waiting()
        original = {s.tool: s.tool_call_id for s in run.engine.data.plan.steps}
        run.decide("approve", approval(run, steps=[2, 1]), until=state_is(run, S.APPROVED))
        ids = [s.tool_call_id for s in run.engine.data.plan.steps]
        assert ids == [original["get_order"], original["issue_refund"]]
        return ids

    assert partly_approved() == partly_approved()

    steps = [{"tool": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 100, "reason": "r"}}]

    def revise(run: Scripted) -> list[str]:
        version = run.engine.data.plan.version
        run.decide("revise", revision(run, steps),
                   until=lambda _: run.engine.data.plan.version > version and run.engine.state == S.AWAITING_APPROVAL)
        return [s.tool_call_id for s in run.engine.data.plan.steps]

    first, again = revise(waiting()), revise(waiting())
    assert first == again and len(first) == 1


def test_steps_that_are_not_in_the_plan_are_refused() -> None:
    run = waiting()
    plan = run.engine.data.plan
    refused = run.decide("approve", approval(run, steps=[1, 4]))
    assert refused.outcome == "refused" and refused.rule == "invalid_steps" and "4" in refused.reason
    with pytest.raises(ValueError, match="twice"):
        ApprovalDecision(decision_id="d", approver="bob", plan_hash="h", steps=[1, 1])
    with pytest.raises(ValueError, match="start at 1"):
        ApprovalDecision(decision_id="d", approver="bob", plan_hash="h", steps=[0])
    reject = run.decide("reject", approval(run, steps=[1]))
    assert reject.outcome == "refused" and reject.rule == "invalid_steps"
    assert run.engine.state == S.AWAITING_APPROVAL and run.engine.data.plan == plan, "a refusal changes nothing"
    # All steps named: an ordinary approval (the plan as it was, no revision, nothing left out).
    full = run.decide("approve", approval(run, steps=[3, 2, 1]), until=state_is(run, S.APPROVED))
    assert full.outcome == "transition" and full.state == S.APPROVED
    data = run.engine.data
    assert data.plan.plan_hash == plan.plan_hash and data.revisions == [] and data.not_approved == []


def test_editor_may_approve_false_and_four_eyes() -> None:
    def revised_by_carol(tenant: TenantPolicy) -> Scripted:
        run = waiting(tenant)
        steps = body(run)
        steps[1]["args"]["amount_cents"] = 8000
        assert run.decide("revise", revision(run, steps)).outcome == "transition"
        assert run.engine.state == S.AWAITING_APPROVAL and pending(run).editors == ["carol"]
        return run

    strict = revised_by_carol(TenantPolicy(editor_may_approve=False))
    assert strict.decide("approve", approval(strict, "carol")).rule == "editor_approval"
    assert strict.decide("approve", approval(strict, "bob"), until=state_is(strict, S.APPROVED)).state == S.APPROVED
    default = revised_by_carol(TenantPolicy())
    # Her approval counts (someone who did not revise the plan must still approve: not this rule).
    counted = default.decide("approve", approval(default, "carol"))
    assert counted.outcome == "accepted" and counted.rule is None and pending(default).approvals[0].approver == "carol"
    # The requester may revise her run; never approve it, editor or not.
    run = waiting()
    steps = body(run)
    steps[2]["args"]["subject"] = "by alice"
    assert run.decide("revise", revision(run, steps, editor="alice")).outcome == "transition"
    assert pending(run).editors == ["alice"]
    assert run.decide("approve", approval(run, "alice")).rule == "four_eyes"
    assert run.engine.state == S.AWAITING_APPROVAL


def test_revision_signature_covers_the_revised_steps() -> None:
    base = dict(workflow_id="wf", first_run_id="r", tenant="t", request_id="q", plan_hash="h", decision_id="d", signer="bob")
    plain = policy.signature_payload(kind="approve", **base)
    assert b"steps" not in plain, "signatures of whole-plan decisions are unchanged"
    assert policy.signature_payload(kind="approve", steps=[2, 1], **base) != plain
    one = policy.signature_payload(kind="revise", steps_digest="a" * 64, **base)
    assert one != policy.signature_payload(kind="revise", steps_digest="b" * 64, **base)


def test_patch_paths() -> None:
    old = [READ, REFUND]
    new = [READ, REFUND.model_copy(update={"args": {**REFUND.args, "amount_cents": 1}}), EMAIL]
    ops = patch(old, new)
    assert changed_paths(ops) == ["replace /1/args/amount_cents", "add /2"]
    assert ops[0]["value"] == 1, "the values are there for a person to see, not for the record"


async def test_planners_hear_which_steps_were_not_approved() -> None:
    from tether.planners.planning import PlaybookPlanner, build_messages
    from workflows.contract import ExecutedStep, NotApproved, PlaybookStep
    from workflows.contract import ToolCatalog
    from workflows.wire import PlannerInput

    playbook = [PlaybookStep(tool=s.tool, args=s.args) for s in (READ, REFUND, EMAIL)]
    done = [ExecutedStep(tool_call_id=f"tc-{i}", tool=s.tool, args=s.args, status="ok", outcome="ok") for i, s in enumerate(playbook[:2])]
    left_out = NotApproved(step=3, tool="send_email", args=EMAIL.args, by="bob")
    request = PlannerInput(goal="g", planner="model", playbook=playbook, executed=done, steps_done=2, not_approved=[left_out])
    said = [m["content"] for m in build_messages(request) if m["role"] == "user"]
    assert any("not approved" in text and "step 3: send_email" in text and "needs a new approval" in text for text in said)
    # The playbook planner does not propose the step again unchanged: it finishes, saying so.
    answer = await PlaybookPlanner().propose(request, ToolCatalog())
    assert answer.steps == [] and "not approved: send_email" in (answer.answer or "")
    # Without the note it would propose it (again a new plan, needing a new approval).
    again = await PlaybookPlanner().propose(request.model_copy(update={"not_approved": []}), ToolCatalog())
    assert [s.tool for s in again.steps] == ["send_email"]


def test_a_run_away_past_several_stages_takes_them_in_order_then_expires() -> None:
    tenant = TenantPolicy.model_validate({"escalation": {"high": [], "normal": [{"after": 60}, {"after": 120}]}})
    run = waiting(tenant, approval_ttl_seconds=180)
    assert run.wait_ends() == (START + timedelta(seconds=60), "escalation stage 1")
    run.elapse(START + timedelta(seconds=130))  # the worker was down past both stages
    assert pending(run).stage == 2 and run.engine.state == S.AWAITING_APPROVAL
    assert [r.reason.split(":")[0] for r in escalations(run)] == ["escalation stage 1/2", "escalation stage 2/2"]
    assert run.wait_ends() == (START + timedelta(seconds=180), "approval expiry")
    run.elapse(START + timedelta(seconds=180))
    assert run.engine.state == S.EXPIRED
    # Down past the expiry itself: the expiry, no stage after it.
    gone = waiting(tenant, approval_ttl_seconds=180)
    gone.elapse(START + timedelta(hours=1))
    assert gone.engine.state == S.EXPIRED and not escalations(gone)
    # A request an older build opened, with no stages on it, under a file that now sets them
    # (a run carried from before escalation): its timer is the expiry's only.
    older = Scripted(tenant, approval_ttl_seconds=180)  # stopped at the planner's call
    older.proposals.append(Proposal(steps=[READ, REFUND, EMAIL]))
    older.go(until=state_is(older, S.AWAITING_APPROVAL))  # asked, before its timer is set
    pending(older).escalation = []
    older.go()
    assert older.wait_ends() == (START + timedelta(seconds=180), "approval expiry")
    older.elapse(START + timedelta(seconds=180))
    assert older.engine.state == S.EXPIRED and not escalations(older)


def test_a_huge_revision_is_refused_like_a_huge_proposal() -> None:
    run = waiting()
    before = (run.engine.data.plan, pending(run).model_copy())
    huge = [{"tool": "send_email", "args": {"to": "a@b.c", "subject": "s", "body": "x" * 9000}}] * 40
    verdict = run.decide("revise", revision(run, huge))
    last = [r for r in run.engine.data.lifecycle.timeline if r.kind == "refused"][-1]
    assert verdict.outcome == "refused" and verdict.rule == "invalid_revision"
    assert last.kind == "refused" and last.rule == "invalid_revision" and "over the" in last.reason
    assert (run.engine.data.plan, pending(run)) == before and run.engine.state == S.AWAITING_APPROVAL


def test_a_webhook_no_retry_reached_is_recorded_and_nothing_raises() -> None:
    """notification_done: the dead webhooks go on the record (a flood-counted record too); the
    handler never raises (it runs in a task nobody awaits: an exception there is lost)."""
    from workflows.wire import NotificationResult

    run = waiting(None, webhooks={"ops": ["awaiting_approval", "revised"]})
    assert [(n.event, n.webhooks) for n in run.notes] == [("awaiting_approval", ["ops"])]
    before = run.engine.data.lifecycle.records
    note = run.deliver(NotificationResult(dead={"ops": "http_500"}))
    assert run.engine.data.lifecycle.records == before + 1
    last = run.engine.data.lifecycle.timeline[-1]
    assert last.kind == "notify_failed" and "ops (http_500)" in last.reason and note.event in last.reason
    assert run.engine.state == S.AWAITING_APPROVAL and isinstance(run.command, Wait), "the run waits on"
    # A revision is the next event; all reached: nothing on the record.
    steps = body(run)
    steps[1]["args"]["amount_cents"] = 100
    run.decide("revise", revision(run, steps))
    assert [n.event for n in run.notes] == ["revised", "awaiting_approval"]
    records = run.engine.data.lifecycle.records
    run.deliver(NotificationResult(delivered=["ops"]))
    run.deliver(NotificationResult(delivered=["ops"]))
    assert run.engine.data.lifecycle.records == records

def test_a_sender_floods_past_its_queue_and_the_rest_are_refused_unjudged() -> None:
    """A sender's decisions past QUEUED_PER_SENDER, while the policy check has not taken its
    queued ones, are refused on arrival (rule queue_full) with no policy activity each; another
    approver's decision still queues and settles the plan. A run whose history queued more before
    the fix (its patch not asked there) keeps queueing them all."""
    from workflows.budgets import QUEUED_PER_SENDER

    for capped in (True, False):
        run = waiting()
        run.engine.queue_capped = lambda: capped
        own = [approval(run, "alice") for _ in range(QUEUED_PER_SENDER + 3)]
        for decision in own:
            run.engine.receive("approve", decision, run.now)  # all at once: the run judges none yet
        bob = approval(run, "bob")
        run.engine.receive("approve", bob, run.now)
        queued = [d.decision_id for _, d in run.engine.inbox]
        refused = [r for r in run.engine.data.lifecycle.timeline if r.kind == "refused"]
        if capped:
            assert queued == [d.decision_id for d in own[:QUEUED_PER_SENDER]] + [bob.decision_id]
            assert [r.rule for r in refused][:3] == ["queue_full"] * 3 and all(r.actor == "user:alice" for r in refused)
        else:
            assert queued == [d.decision_id for d in [*own, bob]] and not refused
        checks_before = sum(1 for c in run.commands if isinstance(c, Call) and c.name == "policy_check_decision")
        run.go()
        checks = sum(1 for c in run.commands if isinstance(c, Call) and c.name == "policy_check_decision") - checks_before
        # alice may not approve her own run (four eyes): each queued one is judged and refused;
        # bob's approves the plan, whose first call is under way.
        assert checks == len(queued) and run.engine.state == S.EXECUTING_TOOL
