"""Pure validation and policy: a proposal is untrusted input."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from activities.tools import REGISTRY
from workflows import policy
from workflows.models import (
    ApprovalDecision,
    Limits,
    PendingApproval,
    Plan,
    PlanStep,
    Proposal,
    ProposedStep,
    RunData,
    ToolEffect,
)
from workflows.states import Lifecycle, RunState
from workflows.validation import validate_proposal

import examples.billing.tools  # noqa: F401

CATALOG = REGISTRY.catalog()
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def ids(n: int) -> str:
    return f"tc-{n:03d}"


def validate(*steps: ProposedStep, executed: int = 0, limits: Limits | None = None):
    return validate_proposal(
        Proposal(steps=list(steps)), CATALOG, executed_steps=executed, limits=limits or Limits(), new_id=ids
    )


def test_valid_plan_gets_ids_and_a_hash_of_tools_and_args() -> None:
    result = validate(
        ProposedStep(tool="get_order", args={"order_id": "A-1001"}),
        ProposedStep(tool="issue_refund", args='{"order_id": "A-1001", "amount_cents": 100, "reason": "x"}'),
    )
    assert result.problems == []
    assert [s.tool_call_id for s in result.plan.steps] == ["tc-001", "tc-002"]
    assert result.plan.steps[1].args == {"order_id": "A-1001", "amount_cents": 100, "reason": "x"}
    # Same tools and arguments, other ids: same hash. Other arguments: other hash.
    same = [s.model_copy(update={"tool_call_id": "other"}) for s in result.plan.steps]
    assert Plan.hash_steps(same, result.plan.undo) == result.plan.plan_hash
    changed = [same[0], same[1].model_copy(update={"args": {**same[1].args, "amount_cents": 99999}})]
    assert Plan.hash_steps(changed, result.plan.undo) != result.plan.plan_hash


def test_the_plan_hash_covers_each_steps_compensation() -> None:
    """An approval of the hash approves the undo too: another undo is another hash; a plan
    without any declared undo hashes as it did before recovery existed (old runs keep theirs)."""
    steps = (
        ProposedStep(tool="get_order", args={"order_id": "A-1001"}),
        ProposedStep(tool="issue_refund", args={"order_id": "A-1001", "amount_cents": 100, "reason": "x"}),
    )
    result = validate(*steps)
    assert result.plan.undo[0] is None
    assert result.plan.undo[1].tool == "void_refund"
    assert result.plan.undo[1].args == {"refund_id": "/result/refund_id"}
    plan_steps = result.plan.steps
    assert Plan.hash_steps(plan_steps) != result.plan.plan_hash  # without its undo: not this plan
    other_undo = [None, result.plan.undo[1].model_copy(update={"args": {"refund_id": "/args/order_id"}})]
    assert Plan.hash_steps(plan_steps, other_undo) != result.plan.plan_hash
    # recovery off (runs recorded before it): no undo carried, the old hash.
    old = validate_proposal(Proposal(steps=list(steps)), CATALOG, executed_steps=0, limits=Limits(),
                            new_id=lambda n: f"tc-{n:03d}", recovery=False)
    assert old.plan.undo is None
    assert old.plan.plan_hash == Plan.hash_steps(old.plan.steps)
    assert Plan.hash_steps(plan_steps, [None, None]) == Plan.hash_steps(plan_steps)


def test_unknown_tool() -> None:
    result = validate(ProposedStep(tool="wire_money", args={}))
    assert result.plan is None
    assert "unknown tool 'wire_money'" in result.reason


def test_invalid_arguments() -> None:
    result = validate(ProposedStep(tool="issue_refund", args={"order_id": "A-1001", "amount_cents": -5, "reason": "x"}))
    assert result.plan is None
    assert "invalid arguments at amount_cents" in result.reason


def test_malformed_json_arguments() -> None:
    result = validate(ProposedStep(tool="get_order", args='{"order_id": '))
    assert result.plan is None
    assert "not valid JSON" in result.reason


def test_step_budget() -> None:
    step = ProposedStep(tool="get_order", args={"order_id": "A-1001"})
    assert validate(step, step, executed=3, limits=Limits(max_steps=5)).plan is not None
    result = validate(step, step, step, executed=3, limits=Limits(max_steps=5))
    assert result.plan is None
    assert "step budget exhausted" in result.reason


def test_empty_proposal() -> None:
    assert "no steps" in validate().reason


def _awaiting(plan_hash: str = "h1") -> RunData:
    return RunData(
        lifecycle=Lifecycle(state=RunState.AWAITING_APPROVAL, state_version=3),
        pending_approval=PendingApproval(plan_hash=plan_hash, expires_at=NOW + timedelta(hours=1), summary="s"),
    )


def decision(**kw) -> ApprovalDecision:
    return ApprovalDecision(**{"decision_id": "d1", "approver": "bob", "plan_hash": "h1", **kw})


def test_decision_rules() -> None:
    data = _awaiting()
    refusal = lambda d, **kw: policy.decision_refusal(d, data, now=kw.get("now", NOW))  # noqa: E731
    assert refusal(decision()) is None
    assert refusal(decision(plan_hash="h0")).rule == "stale_plan_hash"
    assert refusal(decision(), now=NOW + timedelta(hours=2)).rule == "approval_expired"
    data.decisions_seen.append("d1")
    assert refusal(decision()).rule == "duplicate_decision"
    assert policy.decision_refusal(decision(), data, now=NOW, check_duplicate=False) is None
    planning = RunData(lifecycle=Lifecycle(state=RunState.PLANNING))
    assert policy.decision_refusal(decision(), planning, now=NOW).rule == "not_awaiting_approval"


def test_retry_rule_follows_the_effect() -> None:
    rule = policy.after_tool_failure
    for effect in (ToolEffect.READ_ONLY, ToolEffect.IDEMPOTENT, ToolEffect.RECONCILABLE):
        assert rule(effect, permanent=False, retries_done=0, max_retries=3)[0] == RunState.RETRY_WAIT
        assert rule(effect, permanent=True, retries_done=0, max_retries=3)[0] == RunState.EXECUTION_FAILED
    # Retries used up: a read failed (nothing applied); a write's outcome is unknown, a human decides.
    assert rule(ToolEffect.READ_ONLY, permanent=False, retries_done=3, max_retries=3)[0] == RunState.EXECUTION_FAILED
    for effect in (ToolEffect.IDEMPOTENT, ToolEffect.RECONCILABLE):
        state, why = rule(effect, permanent=False, retries_done=3, max_retries=3)
        assert state == RunState.HANDED_OFF and "outcome unknown" in why
        # An attempt not known to be over is never retried: the retry (or lookup) could race it.
        state, why = rule(effect, permanent=False, retries_done=0, max_retries=3, attempt_over=False)
        assert state == RunState.HANDED_OFF and "still be running" in why
    assert rule(ToolEffect.READ_ONLY, permanent=False, retries_done=0, max_retries=3, attempt_over=False)[0] == RunState.RETRY_WAIT
    assert rule(ToolEffect.UNSAFE, permanent=False, retries_done=0, max_retries=3)[0] == RunState.HANDED_OFF
    assert rule(ToolEffect.UNSAFE, permanent=True, retries_done=0, max_retries=3)[0] == RunState.EXECUTION_FAILED
    assert policy.retry_delay_seconds(0) == 1 and policy.retry_delay_seconds(10) == policy.RETRY_MAX_SECONDS
    assert policy.retry_delay_seconds(0, suggested=7) == 7
    assert policy.retry_delay_seconds(0, settle=4.5) == 4.5 and policy.retry_delay_seconds(4, settle=4.5) == 16


def test_approval_needed_for_writes_only_by_default() -> None:
    read = Plan(steps=[PlanStep(tool_call_id="a", tool="get_order", args={"order_id": "A-1001"})], plan_hash="x")
    write = Plan(
        steps=read.steps + [PlanStep(tool_call_id="b", tool="send_email", args={"to": "a@b.c", "subject": "Hi"})],
        plan_hash="y",
    )
    assert not policy.review_plan(read, CATALOG, None).needs_approval
    review = policy.review_plan(write, CATALOG, None)
    assert (review.needs_approval, review.risk, review.approvals_required) == (True, "normal", 1)
    # The risk summary names what writes and the declared fields, never personal data.
    assert review.summary == "1 of 2 step(s) write: send_email (unsafe, subject=Hi)"
