"""The pure rules behind revisions, partial approval and escalation (workflows/engine.py,
workflows/policy.py, the policy file), tested directly."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import examples.billing.tools  # noqa: F401  (registers the billing tools)
from activities.policy import PolicyFileError, check_policy_file, parse_policy
from activities.tools import REGISTRY
from workflows import policy
from workflows.engine import Engine
from workflows.run_model import IllegalState
from workflows.contract import ApprovalDecision, RevisionRequest
from workflows.policy_file import TenantPolicy, parse_duration
from workflows.wire import PolicySnapshot, Proposal, ProposedStep
from workflows.run_state import RunData, RunRequest
from workflows.revision import changed_paths, patch
from workflows.states import RunState

S = RunState
START = datetime(2026, 1, 1, tzinfo=timezone.utc)
READ = ProposedStep(tool="get_order", args={"order_id": "A-1001"})
REFUND = ProposedStep(tool="issue_refund", args={"order_id": "A-1001", "amount_cents": 9000, "reason": "r"})
EMAIL = ProposedStep(tool="send_email", args={"to": "a@b.c", "subject": "s", "body": "b"})


def engine(tenant: TenantPolicy | None = None, **limits: object) -> Engine:
    data = RunData(
        catalog=REGISTRY.catalog(),
        policy=PolicySnapshot(tenant="default", policy=tenant or TenantPolicy(), policy_hash="h", source="test"),
    )
    request = RunRequest(goal="g", requested_by="alice", limits=limits or {})
    e = Engine(data, request, workflow_id="wf", new_request_id=lambda: uuid.uuid4().hex)
    e.received(START)
    return e


def waiting(e: Engine, *steps: ProposedStep) -> None:
    e.proposal(Proposal(steps=list(steps or (READ, REFUND, EMAIL))), at=START, new_id=lambda n: uuid.uuid4().hex)
    e.after_validated(START)
    assert e.state == S.AWAITING_APPROVAL


def revise(e: Engine, steps: list[dict], editor: str = "carol") -> None:
    pending = e.data.pending_approval
    r = RevisionRequest(
        decision_id=uuid.uuid4().hex, editor=editor, plan_hash=pending.plan_hash,
        request_id=pending.request_id, steps=steps, reason="why",
    )
    assert e.screen_decision("revise", r, START)
    e.settle_decision("revise", r, None, START, new_id=lambda n: uuid.uuid4().hex)


def body(e: Engine) -> list[dict]:
    return [{"tool": s.tool, "args": dict(s.args)} for s in e.data.plan.steps]


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
    e = engine(tenant, approval_ttl_seconds=3 * 3600)
    waiting(e)
    pending = e.data.pending_approval
    assert [s.after for s in pending.escalation] == [3600, 7200], "a stage at or past the expiry never fires"
    with pytest.raises(IllegalState, match="no stage due"):
        e.escalate(START + timedelta(minutes=59))  # early
    assert e.next_escalation() == START + timedelta(hours=1)
    e.escalate(START + timedelta(hours=1))
    assert pending.roles == ["approver", "manager"] and pending.stage == 1
    e.escalate(START + timedelta(hours=2))
    assert e.next_escalation() is None
    with pytest.raises(IllegalState):
        e.escalate(START + timedelta(hours=2, minutes=1))  # none left
    e.expire(START + timedelta(hours=3))
    assert e.state == S.EXPIRED
    kinds = [(r.kind, r.state_version) for r in e.data.lifecycle.timeline[-3:]]
    assert [k for k, _ in kinds] == ["escalated", "escalated", "transition"]
    assert kinds[0][1] == kinds[1][1], "an escalation changes no state"


def test_a_revision_makes_a_new_version_with_paths_not_values() -> None:
    e = engine()
    waiting(e)
    old = e.data.plan
    steps = body(e)
    steps[1]["args"]["amount_cents"] = 1234
    steps[2]["args"]["subject"] = "new subject"
    revise(e, steps)
    record = e.data.lifecycle.timeline[-1]
    assert (record.from_state, record.to_state) == (S.AWAITING_APPROVAL, S.VALIDATED)
    assert record.refs.changed == ["replace /1/args/amount_cents", "replace /2/args/subject"]
    assert "1234" not in record.model_dump_json() and "new subject" not in record.model_dump_json()
    assert e.data.plan.version == 2 and e.data.plan.plan_hash != old.plan_hash
    assert e.data.pending_approval is None, "the old request is gone; VALIDATED asks anew"
    e.after_validated(START)
    assert e.data.pending_approval.editors == ["carol"]
    # A proposal from the planner later is the next version and has no editors.
    assert e.data.revisions[-1].previous_plan_hash == old.plan_hash


def test_partial_approval_is_a_revision_then_an_approval() -> None:
    e = engine()
    waiting(e)
    pending = e.data.pending_approval
    d = ApprovalDecision(decision_id="d1", approver="bob", plan_hash=pending.plan_hash, request_id=pending.request_id, steps=[2, 1])
    assert e.screen_decision("approve", d, START)
    e.settle_decision("approve", d, None, START, new_id=lambda n: uuid.uuid4().hex)
    assert e.state == S.APPROVED and [s.tool for s in e.data.plan.steps] == ["get_order", "issue_refund"]
    assert [(n.step, n.tool) for n in e.data.not_approved] == [(3, "send_email")]
    mine = [r for r in e.data.lifecycle.timeline if r.refs.decision_id == "d1"]
    assert [r.to_state for r in mine] == [S.VALIDATED, S.APPROVED]
    assert mine[0].refs.request_id == pending.request_id != mine[1].refs.request_id
    # The planner is told once: the list is cleared when its next proposal comes in.
    e.data.lifecycle.state = S.PLANNING  # (skip executing the steps: not this test's subject)
    e.proposal(Proposal(answer="done"), at=START, new_id=lambda n: "x")
    assert e.data.not_approved == []


def test_steps_that_are_not_in_the_plan_are_refused() -> None:
    e = engine()
    waiting(e)
    pending = e.data.pending_approval
    d = ApprovalDecision(decision_id="d1", approver="bob", plan_hash=pending.plan_hash, request_id=pending.request_id, steps=[1, 4])
    refusal = policy.decision_refusal(d, e.data, now=START)
    assert refusal is not None and refusal.rule == "invalid_steps" and "4" in refusal.message
    with pytest.raises(ValueError, match="twice"):
        ApprovalDecision(decision_id="d", approver="bob", plan_hash="h", steps=[1, 1])
    with pytest.raises(ValueError, match="start at 1"):
        ApprovalDecision(decision_id="d", approver="bob", plan_hash="h", steps=[0])
    reject = policy.decision_refusal(d.model_copy(update={"steps": [1]}), e.data, now=START, kind="reject")
    assert reject is not None and reject.rule == "invalid_steps"
    # All steps named: an ordinary approval.
    full = d.model_copy(update={"steps": [3, 2, 1]})
    assert policy.partial_steps(full, e.data.plan) is None


def test_editor_may_approve_false_and_four_eyes() -> None:
    strict = TenantPolicy(editor_may_approve=False)
    args = dict(requested_by="alice", roles=["approver"], already_approved=[], editors=["carol"])
    assert policy.approver_refusal(strict, approver="carol", kind="approve", **args).rule == "editor_approval"
    assert policy.approver_refusal(strict, approver="bob", kind="approve", **args) is None
    assert policy.approver_refusal(TenantPolicy(), approver="carol", kind="approve", **args) is None
    # The requester may revise her run; never approve it, editor or not.
    assert policy.approver_refusal(TenantPolicy(), approver="alice", kind="revise", **args) is None
    assert policy.approver_refusal(TenantPolicy(), approver="alice", kind="approve", **args).rule == "four_eyes"


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
    from activities.planning import PlaybookPlanner, build_messages
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
    e = engine(tenant, approval_ttl_seconds=180)
    waiting(e)
    assert e.next_timer() == (START + timedelta(seconds=60), "escalation stage 1")
    assert e.next_timer(escalate=False) == (START + timedelta(seconds=180), "approval expiry")
    late = START + timedelta(seconds=130)  # the worker was down past both stages
    e.timer_fired(late)
    e.timer_fired(late)
    assert e.data.pending_approval.stage == 2 and e.state == S.AWAITING_APPROVAL
    assert e.next_timer() == (START + timedelta(seconds=180), "approval expiry")
    e.timer_fired(START + timedelta(seconds=180))
    assert e.state == S.EXPIRED
    # Down past the expiry itself: the expiry, no stage after it.
    gone = engine(tenant, approval_ttl_seconds=180)
    waiting(gone)
    gone.timer_fired(START + timedelta(hours=1))
    assert gone.state == S.EXPIRED and not any(r.kind == "escalated" for r in gone.data.lifecycle.timeline)
    # Replaying a run from before escalation (escalate=False): the timer is the expiry's only.
    e2 = engine(tenant, approval_ttl_seconds=180)
    waiting(e2)
    e2.timer_fired(START + timedelta(seconds=180), escalate=False)
    assert e2.state == S.EXPIRED and not any(r.kind == "escalated" for r in e2.data.lifecycle.timeline)


def test_a_huge_revision_is_refused_like_a_huge_proposal() -> None:
    e = engine()
    waiting(e)
    before = (e.data.plan, e.data.pending_approval)
    huge = [{"tool": "send_email", "args": {"to": "a@b.c", "subject": "s", "body": "x" * 9000}}] * 40
    revise(e, huge)
    last = e.data.lifecycle.timeline[-1]
    assert last.kind == "refused" and last.rule == "invalid_revision" and "over the" in last.reason
    assert (e.data.plan, e.data.pending_approval) == before


def test_a_webhook_no_retry_reached_is_recorded_and_nothing_raises() -> None:
    """notification_done: the dead webhooks go on the record (a flood-counted record too); the
    handler never raises (it runs in a task nobody awaits: an exception there is lost)."""
    from workflows.wire import Notification, NotificationResult

    e = engine()
    note = Notification(event_id="run:e:3", event="awaiting_approval", webhooks=["ops"], run_id="run",
                        tenant="default", state="AWAITING_APPROVAL")
    before = e.data.lifecycle.records
    e.notification_done(note, NotificationResult(dead={"ops": "http_500"}), START)
    assert e.data.lifecycle.records == before + 1
    last = e.data.lifecycle.timeline[-1]
    assert last.kind == "notify_failed" and "ops (http_500)" in last.reason
    e.notification_done(note, NotificationResult(delivered=["ops"]), START)  # all reached: nothing
    assert e.data.lifecycle.records == before + 1
