"""Pure validation and policy: a proposal is untrusted input."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from tether.tools.sdk import REGISTRY
from workflows import policy, retries
from workflows.contract import ApprovalDecision, Limits, Plan, PlanStep, ToolEffect
from workflows.wire import Proposal, ProposedStep
from workflows.run_state import PendingApproval, RunData
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
    rule = retries.after_tool_failure
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
    assert retries.retry_delay_seconds(0) == 1 and retries.retry_delay_seconds(10) == retries.RETRY_MAX_SECONDS
    assert retries.retry_delay_seconds(0, suggested=7) == 7
    assert retries.retry_delay_seconds(0, settle=4.5) == 4.5 and retries.retry_delay_seconds(4, settle=4.5) == 16


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
    assert review.summary == "1 of 2 step(s) write: send_email (cannot be undone; unsafe: never re-run; subject=\"Hi\")"


# ----------------------------------------------------------------------------- bounded-cost patterns

import time  # noqa: E402

from workflows.contract import ToolCatalog, ToolInfo  # noqa: E402
from workflows.validation import pattern_search, schema_problem  # noqa: E402

NESTED = r"^(\w+\s?)+$"


def catalog_with(schema: dict) -> ToolCatalog:
    return ToolCatalog(tools=[ToolInfo(name="echo", description="", effect=ToolEffect.READ_ONLY,
                                       requires_approval=False, args_schema=schema, timeout_seconds=5, max_retries=0)])


def validate_echo(schema: dict, args: dict):
    return validate_proposal(Proposal(steps=[ProposedStep(tool="echo", args=args)]), catalog_with(schema),
                             executed_steps=0, limits=Limits(), new_id=ids)


def test_a_nested_quantifier_on_a_10_kb_argument_is_decided_in_linear_time() -> None:
    schema = {"type": "object", "properties": {"text": {"type": "string", "pattern": NESTED}}}
    started = time.perf_counter()
    refused = validate_echo(schema, {"text": "a " * 5000 + "!"})  # Python's re: minutes at 32 chars
    accepted = validate_echo(schema, {"text": "a " * 5000 + "a"})
    assert time.perf_counter() - started < 0.5
    assert refused.plan is None and "text: does not match the required pattern" in refused.reason
    assert accepted.plan is not None


def test_patterns_keep_json_schema_search_semantics() -> None:
    # Unanchored search, like ECMA 262 and jsonschema's re.search.
    assert pattern_search("b", "abc") and not pattern_search("^b", "abc") and pattern_search(r"\d{3}-\d{4}", "x555-1234")
    schema = {"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": False}
    assert validate_echo(schema, {"x-a": 1}).plan is not None
    assert "x-a: has the wrong type" in validate_echo(schema, {"x-a": "one"}).reason
    assert "argument(s) the tool does not take" in validate_echo(schema, {"y": 1}).reason
    names = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}
    assert validate_echo(names, {"abc": 1}).plan is not None and validate_echo(names, {"ABC": 1}).plan is None


def test_a_pattern_no_linear_engine_takes_is_refused_with_where_and_why() -> None:
    for pattern, why in [(r"(a)\1", "invalid escape sequence"), ("(?=x)x", "invalid perl operator"),
                         ("a{2,5000}", "invalid repetition size"), ("x" * 1001, "longer than 1000")]:
        schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
        problem = schema_problem(schema)
        assert problem is not None and "/properties/s/pattern" in problem and why in problem, problem
        # A snapshot that still carries one (an old catalog) fails the step; re never runs.
        assert "the tool's schema cannot be checked" in validate_echo(schema, {"s": "x"}).reason
    assert "/patternProperties" in (schema_problem({"patternProperties": {"(?<=a)b": {}}}) or "")
    assert "unevaluatedProperties" in (schema_problem({"patternProperties": {"a": {}}, "unevaluatedProperties": False}) or "")
    # Data is not a schema: a "pattern" inside enum/const/default/examples is not compiled.
    assert schema_problem({"enum": [{"pattern": "(?=x)"}], "default": {"pattern": "(a)\\1"}}) is None
    assert schema_problem({"type": "object", "properties": {"pattern": {"type": "string"}}}) is None


from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from tether.tools.sdk import ToolContext  # noqa: E402


class LookaroundArgs(BaseModel):
    # pydantic's own engine refuses lookaround; a tool author can still ask for Python's re.
    model_config = ConfigDict(regex_engine="python-re")
    word: str = Field(pattern=r"^(?!admin).*$")


class NestedArgs(BaseModel):
    word: str = Field(pattern=NESTED)


def test_a_python_tool_whose_pattern_cannot_run_in_linear_time_is_left_out_with_why() -> None:
    from tether.tools.mcp import describe_tools, format_tools
    from tether.tools.sdk import ToolRegistry, tool

    registry = ToolRegistry()

    @tool(effect="read_only", registry=registry)
    def lookaround(args: LookaroundArgs, ctx: ToolContext) -> str:
        return args.word

    @tool(effect="read_only", registry=registry)
    def nested(args: NestedArgs, ctx: ToolContext) -> str:
        return args.word

    assert list(registry.tools) == ["nested"] and [t.name for t in registry.catalog().tools] == ["nested"]
    assert "invalid perl operator" in registry.refused["lookaround"]
    shown = format_tools(describe_tools(registry))
    assert "lookaround  python  left out" in shown and "cannot run in linear time" in shown


def test_a_hash_that_matches_no_plan_is_refused_without_handing_over_the_pending_one() -> None:
    """A mistyped or stale hash is refused on the record in words that send the person to the
    plan under review, never with the pending hash to paste into an approval."""
    pending = "9f2c4e1d7a6b5c3e8f0a1b2c3d4e5f60"
    refusal = policy.decision_refusal(decision(plan_hash="0a0a0a0a0a0a"), _awaiting(pending), now=NOW)
    assert refusal is not None and refusal.rule == "stale_plan_hash"
    assert "does not match the plan under review" in refusal.message and "tether status" in refusal.message
    assert pending[:8] not in refusal.message, refusal.message
