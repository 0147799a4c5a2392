"""Declared recovery end to end: the billing service behind the tools, a real Temporal server.

A refund and a ledger entry succeed, then an email fails: with ``on_failure="compensate"`` the
run puts both back (COMPENSATING -> COMPENSATED), each undo exactly once on the service; a
compensation that fails hands off naming it; ``tether compensate`` after a hand-off undoes the
ok writes in a governed run of its own.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tether.tools.mcp import describe_tools, format_tools
from tether.policy.files import PolicyStore
from tether.tools.sdk import REGISTRY, ToolContext, ToolRegistry, tool
from workflows import policy
from workflows.engine import Engine
from workflows.contract import Compensation, ToolEffect, CompensationCall
from workflows.policy_file import HighRisk, TenantPolicy, AmountRule, Approver
from workflows.commands import Call
from workflows.wire import PolicySnapshot, Proposal, ProposedStep, RecoverySource, Verdict
from workflows.run_state import RunData, RunRequest
from workflows.recovery import PointerError, compensation_call, resolve_pointer, result_document
from tests.helpers.invariants import check_timeline, tools_by_call
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from workflows.run_state import RunOutcome
from workflows.states import RunState, is_legal_path
from tests.helpers.recovery import EMAIL, LEDGER, PLAN, REFUND, REVERSALS, VOIDS, approved_run, requests_to

S = RunState


NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
CATALOG = REGISTRY.catalog()


# ----------------------------------------------------------------------------- the pure parts


@pytest.mark.parametrize(
    ("pointer", "expected"),
    [
        ("/result/refund_id", "R-7"),
        ("/args/order_id", "A-1001"),
        ("/result/items/1/sku", "b"),
        ("/result/a~1b", 1),  # RFC 6901 escapes: ~1 is "/", ~0 is "~"
        ("/result/c~0d", 2),
        ("/result/zero", 0),  # falsy values are values, not "missing"
        ("/result/none", None),
        ("/args", {"order_id": "A-1001"}),
    ],
)
def test_pointers_resolve_exactly(pointer: str, expected: object) -> None:
    doc = {
        "args": {"order_id": "A-1001"},
        "result": {"refund_id": "R-7", "items": [{"sku": "a"}, {"sku": "b"}], "a/b": 1, "c~d": 2, "zero": 0, "none": None},
    }
    assert resolve_pointer(doc, pointer) == expected


@pytest.mark.parametrize(
    ("pointer", "where"),
    [
        ("/result/refund", "/result/refund: no such key"),
        ("/result/items/2", "no such index"),
        ("/result/items/01", "no such index"),  # no leading zeros
        ("/result/items/-1", "no such index"),
        ("/result/refund_id/x", "str has no members"),
        ("result/refund_id", "not a JSON pointer"),
    ],
)
def test_a_missing_pointer_is_a_clear_failure_never_a_guess(pointer: str, where: str) -> None:
    doc = {"args": {}, "result": {"refund_id": "R-7", "items": [1, 2]}}
    with pytest.raises(PointerError, match=where.replace("/", "/")):
        resolve_pointer(doc, pointer)


def call_for(declared, result, problem=None) -> CompensationCall:
    return compensation_call(
        declared, of="tc-1", of_tool="issue_refund", args={"order_id": "A-1"}, result=result,
        result_problem=problem, idempotency_key="wf:tc-1", plan_hash="h", approved_by=["bob"],
    )


def test_the_undo_call_is_built_from_the_declaration_and_the_key_derives_from_the_original() -> None:
    declared = Compensation(tool="void_refund", args={"refund_id": "/result/refund_id", "order": "/args/order_id"})
    call = call_for(declared, {"refund_id": "R-9"})
    assert (call.tool, call.args, call.error) == ("void_refund", {"refund_id": "R-9", "order": "A-1"}, None)
    assert call.idempotency_key == "wf:tc-1:undo" and call.tool_call_id == "tc-1:undo"
    assert (call.plan_hash, call.approved_by, call.status) == ("h", ["bob"], "pending")
    # Deterministic: the same inputs, the same call.
    assert call_for(declared, {"refund_id": "R-9"}) == call
    missing = call_for(declared, {"id": "R-9"})
    assert missing.tool is None and missing.args == {}
    assert missing.error == "argument refund_id: pointer /result/refund_id: no such key"
    # The error names the pointer, never a value from the result.
    assert "R-9" not in missing.error
    assert call_for(None, {}).error == "no recovery path declared"
    cut = call_for(declared, None, "the result was truncated before it reached the workflow")
    assert cut.tool is None and "truncated" in cut.error
    assert result_document("{", False) == (None, "the result is not JSON")
    assert result_document('{"a": 1}', True)[1] is not None


@pytest.mark.parametrize("bad", [{"refund_id": "refund_id"}, {"refund_id": "/results/x"}, {"x": ""}])
def test_declarations_refuse_what_is_not_a_pointer_into_args_or_result(bad: dict) -> None:
    with pytest.raises(ValidationError, match="not a JSON pointer into /args or /result"):
        Compensation(tool="void_refund", args=bad)


class _A(BaseModel):
    order_id: str


class _U(BaseModel):
    refund_id: str


def test_the_sdk_refuses_a_compensation_it_cannot_build_at_worker_start() -> None:
    registry = ToolRegistry()

    @tool(effect=ToolEffect.IDEMPOTENT, registry=registry, compensate=("undo_it", {"refund_id": "/result/id"}))
    def do_it(args: _A, ctx: ToolContext) -> dict:
        return {}

    with pytest.raises(ValueError, match="compensated by 'undo_it', which is not registered"):
        registry.check()

    @tool(effect=ToolEffect.READ_ONLY, registry=registry, name="undo_it")
    def undo_read(args: _U, ctx: ToolContext) -> dict:
        return {}

    with pytest.raises(ValueError, match="read_only and undoes nothing"):
        registry.check()
    registry.tools.pop("undo_it")

    @tool(effect=ToolEffect.IDEMPOTENT, registry=registry, name="undo_it")
    def undo_it(args: _U, ctx: ToolContext) -> dict:
        return {}

    registry.check()  # now it can be built
    assert registry.catalog().get("do_it").compensate == Compensation(tool="undo_it", args={"refund_id": "/result/id"})
    do_it.compensate = Compensation(tool="undo_it", args={"nope": "/result/id"})
    with pytest.raises(ValueError, match="takes no argument 'nope'"):
        registry.check()
    do_it.compensate = Compensation(tool="undo_it", args={"refund_id": "/args/missing"})
    with pytest.raises(ValueError, match="not an argument of 'do_it'"):
        registry.check()
    with pytest.raises(ValueError, match="invalid compensate= declaration"):
        tool(effect=ToolEffect.IDEMPOTENT, registry=registry, compensate={"tool": "x", "args": {}, "extra": 1})


def test_tether_tools_shows_each_tools_undo() -> None:
    listing = format_tools(describe_tools(REGISTRY)).splitlines()
    assert listing[0].split()[:5] == ["TOOL", "SOURCE", "EFFECT", "APPROVAL", "UNDO"]
    row = {line.split()[0]: line.split() for line in listing[1:]}
    assert row["issue_refund"][4] == "void_refund"
    assert row["post_ledger_entry"][4] == "reverse_ledger_entry"
    assert row["send_email"][4] == "-"


def test_the_refund_playbook_shows_the_undo_in_its_approval() -> None:
    from tests.helpers.runs import PLAYBOOK

    engine = planned(PLAYBOOK, TenantPolicy())
    summary = engine.data.pending_approval.summary
    assert 'issue_refund (can be undone by void_refund; order_id="A-1001", amount_cents=49.99 EUR (4999))' in summary
    assert 'send_email (cannot be undone; unsafe: never re-run; subject="Your refund for order A-1001")' in summary


def test_an_undo_tool_name_from_a_server_is_shown_escaped() -> None:
    catalog = CATALOG.model_copy(deep=True)
    catalog.get("issue_refund").compensate = Compensation(tool="evil`\x1b[31m\u202e", args={})
    shown = policy.review_plan(_validated([REFUND], catalog), catalog, TenantPolicy()).summary
    assert "\x1b" not in shown and "\u202e" not in shown and "\\x1b" in shown
    assert "can be undone by evil`\\x1b[31m\\u202e;" in shown  # plain words, escaped (markdown is escaped where it is drawn)


def _validated(steps: list[dict], catalog=CATALOG):
    from workflows.contract import Limits
    from workflows.validation import validate_proposal

    result = validate_proposal(Proposal(steps=[ProposedStep(**s) for s in steps]), catalog, executed_steps=0,
                               limits=Limits(), new_id=lambda n: f"tc-{n:03d}")
    return result.plan


def planned(steps: list[dict], tenant: TenantPolicy, **request) -> Engine:
    data = RunData(catalog=CATALOG, policy=PolicySnapshot(tenant="default", policy=tenant, policy_hash="h", source="t"))
    engine = Engine(data, RunRequest(goal="g", requested_by="alice", **request), workflow_id="wf")
    engine.received(NOW)
    engine.proposal(Proposal(steps=[ProposedStep(**s) for s in steps]), at=NOW, new_id=lambda n: f"tc-{n:03d}")
    if engine.state == S.VALIDATED:
        engine.after_validated(NOW)
    return engine


HIGH = HighRisk(when=[AmountRule(tool="issue_refund", field="amount_cents", above=1000)], approvals=1)


def test_require_recovery_refuses_a_high_risk_plan_with_an_irreversible_write() -> None:
    tenant = TenantPolicy(high_risk=HIGH, require_recovery=["high"])
    engine = planned(PLAN, tenant)  # refund 1500: high risk; the email cannot be undone
    assert engine.state == S.VALIDATION_FAILED
    record = engine.data.lifecycle.timeline[-1]
    assert "[recovery_required] step 3 (send_email) writes and has no recovery path" in record.reason
    assert "high-risk" in engine.data.feedback  # the planner is told why, and may propose another plan
    # Without the irreversible write it is approvable as usual.
    assert planned([REFUND, LEDGER], tenant).state == S.AWAITING_APPROVAL
    # At a risk level the tenant does not list, the email is fine.
    assert planned([{**REFUND, "args": {**REFUND["args"], "amount_cents": 500}}, EMAIL], tenant).state == S.AWAITING_APPROVAL
    assert planned(PLAN, TenantPolicy(high_risk=HIGH, require_recovery=["normal", "high"])).state == S.VALIDATION_FAILED


def test_require_recovery_in_the_policy_file_is_checked(tmp_path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text('[tenants.default]\nrequire_recovery = ["hihg"]\n')
    with pytest.raises(Exception, match="require_recovery"):
        PolicyStore(path).tenant("default")
    path.write_text('[tenants.default]\nrequire_recovery = ["high"]\non_failure = "compensate"\n')
    tenant, _ = PolicyStore(path).tenant("default")
    assert tenant.require_recovery == ["high"] and tenant.on_failure == "compensate"


def test_on_failure_comes_from_the_request_else_the_tenant() -> None:
    assert planned([REFUND], TenantPolicy()).on_failure() == "stop"
    assert planned([REFUND], TenantPolicy(on_failure="compensate")).on_failure() == "compensate"
    assert planned([REFUND], TenantPolicy(on_failure="compensate"), on_failure="stop").on_failure() == "stop"
    with pytest.raises(ValidationError):
        RunRequest(goal="g", requested_by="a", on_failure="undo")


def source(**fields) -> RecoverySource:
    call = CompensationCall(of="tc-1", of_tool="issue_refund", tool="void_refund", args={"refund_id": "R-1"},
                            idempotency_key="orig:tc-1:undo", plan_hash="h" * 64)
    return RecoverySource(**{"run_id": "orig", "state": S.HANDED_OFF, "compensations": [call], **fields})


@pytest.mark.parametrize(
    ("by", "src", "rule"),
    [
        ("dana", source(), "role"),  # support, not an approval role
        ("mallory", source(), "tenant_membership"),
        ("carol", source(state=S.FAILED), "not_compensable"),
        ("carol", source(state=S.CANCELLED), None),  # a cancel while compensating: compensate continues
        ("carol", source(compensations=[]), "nothing_to_compensate"),
        ("carol", source(compensations=[source().compensations[0].model_copy(update={"status": "ok"})]), "nothing_to_compensate"),
        ("carol", source(compensations=[source().compensations[0].model_copy(update={"plan_hash": ""})]), "not_approved"),
        ("carol", source(refusal=policy.Refusal(rule="still_running", message="running")), "still_running"),
        ("carol", source(), None),
    ],
)
def test_who_may_start_a_compensation_run_and_of_what(by: str, src: RecoverySource, rule: str | None) -> None:
    tenant = TenantPolicy(approvers={"carol": Approver(roles=["approver"]), "dana": Approver(roles=["support"])})
    data = RunData(catalog=CATALOG, policy=PolicySnapshot(tenant="default", policy=tenant, policy_hash="h", source="t"))
    engine = Engine(data, RunRequest(goal="g", requested_by=by, compensate_run="orig"), workflow_id="orig-compensate")
    # The run's program: first whether the requester may (the policy activity, answered here by
    # the rule it judges by), then, if so, the original's record.
    engine.start()
    asked = []
    command = engine.next(NOW)
    while engine.state == S.RECEIVED:
        assert isinstance(command, Call), command
        asked.append(command.name)
        if command.name == "policy_check_person":
            assert (command.arg.action, command.arg.by) == ("compensate", by)
            result = Verdict(refusal=policy.compensator_refusal(tenant, by), policy_hash="h")
        else:
            assert command.name == "recovery_source", command
            result = src
        engine.on(command, result, NOW)
        command = engine.next(NOW)
    assert asked == (["policy_check_person"] if rule in ("role", "tenant_membership")
                     else ["policy_check_person", "recovery_source"])
    last = engine.data.lifecycle.timeline[-1]
    if rule is None:
        assert engine.state == S.COMPENSATING and last.actor == "user:carol"
        assert engine.current_undo().idempotency_key == "orig:tc-1:undo"  # the original's key
        assert engine.compensation_ready(NOW)
    else:
        assert engine.state == S.FAILED and last.refs.error_code == rule, last.reason


def test_an_unsafe_undo_that_may_have_applied_is_listed_not_run_unless_an_approver_says_so() -> None:
    """begin_compensation: an undo the ledger (or the original) says may have applied stays
    `unknown` when its tool is unsafe, and the run hands off listing it; an idempotent one runs
    again under its key; `rerun_unknown` naming the step runs the unsafe one, recorded."""
    email = CompensationCall(of="tc-2", of_tool="issue_refund", tool="send_email", status="unknown", idempotency_key="orig:tc-2:undo",
                             args={"to": "a@example.com", "subject": "s", "body": "b"}, plan_hash="h" * 64, undone_by="orig")
    void = source().compensations[0].model_copy(update={"status": "unknown"})
    tenant = TenantPolicy()
    for rerun, expected in (([], S.HANDED_OFF), (["tc-2"], S.COMPENSATING)):
        data = RunData(catalog=CATALOG, policy=PolicySnapshot(tenant="default", policy=tenant, policy_hash="h", source="t"))
        engine = Engine(data, RunRequest(goal="g", requested_by="carol", compensate_run="orig", rerun_unknown=rerun),
                        workflow_id="orig-compensate")
        engine.received(NOW)
        engine.begin_compensation(source(compensations=[void, email]), NOW)
        assert [(c.status, c.rerun) for c in engine.data.compensations] == [
            ("pending", False), ("unknown", False) if not rerun else ("pending", True)]
        engine.data.compensations[0].status = "ok"  # the void ran
        if rerun:
            assert "carol instructs to run again what may have applied: tc-2 (send_email)" in engine.data.lifecycle.timeline[-1].reason
            assert engine.compensation_ready(NOW) and engine.current_undo().rerun
            check = engine.authority_check(from_step=engine.data.next_step)
            assert check.undo.rerun  # what mints Capability.rerun_unknown
            continue
        assert engine.compensation_ready(NOW) is False
        last = engine.data.lifecycle.timeline[-1]
        assert engine.state == expected and last.refs.error_code == "may_have_applied"
        assert "may have applied" in last.reason and "--rerun-unknown" in last.reason and "tc-2" in last.reason


def test_an_undo_tool_the_tenant_may_not_use_hands_off_instead_of_running() -> None:
    tenant = TenantPolicy(tools=["issue_refund"])  # void_refund not allowed
    data = RunData(catalog=CATALOG, policy=PolicySnapshot(tenant="default", policy=tenant, policy_hash="h", source="t"))
    engine = Engine(data, RunRequest(goal="g", requested_by="carol", compensate_run="orig"), workflow_id="orig-compensate")
    engine.received(NOW)
    engine.begin_compensation(source(), NOW)
    assert engine.state == S.COMPENSATING
    assert engine.compensation_ready(NOW) is False
    last = engine.data.lifecycle.timeline[-1]
    assert engine.state == S.HANDED_OFF and "'void_refund' is not allowed for this tenant" in last.reason
    assert last.refs.error_code == "no_recovery_path" and "not compensated" in last.reason


def path(outcome: RunOutcome) -> list[str]:
    return [r.to_state.value for r in outcome.timeline if r.kind == "transition"]


def undo_state(billing: Billing, outcome: RunOutcome) -> tuple[list[dict], list[dict]]:
    """The refund the run issued, and the ledger entries of its order key (entry, reversals)."""
    refund_call = next(c for c in outcome.compensations if c.of_tool == "issue_refund")
    ledger_call = next(c for c in outcome.compensations if c.of_tool == "post_ledger_entry")
    refunds = billing.refunds(refund_call.idempotency_key.removesuffix(":undo"))
    entry_id = ledger_call.args["entry_id"]
    reversals = billing.get(f"/ledger?reverses={entry_id}")["entries"]
    return refunds, reversals


async def test_a_permanent_failure_puts_the_ok_writes_back_exactly_once(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    billing.fail_next("emails", 1, status=400)  # the email is refused: known not sent
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker, on_failure="compensate")
    assert outcome.state == S.COMPENSATED, outcome.timeline[-1].reason
    check_timeline(outcome.timeline, tools_by_call(outcome))
    assert path(outcome)[-4:] == ["COMPENSATING", "COMPENSATING", "COMPENSATING", "COMPENSATED"]
    # Newest first: the ledger entry is reversed before the refund is voided.
    undone = [r for r in outcome.timeline if r.from_state == S.COMPENSATING and r.to_state == S.COMPENSATING]
    assert ["reverse_ledger_entry" in undone[0].reason, "void_refund" in undone[1].reason] == [True, True]
    refund_call = next(c for c in outcome.compensations if c.of_tool == "issue_refund")
    assert undone[1].refs.idempotency_key == refund_call.idempotency_key
    assert refund_call.idempotency_key.endswith(":undo") and refund_call.plan_hash
    assert [c.status for c in outcome.compensations] == ["ok", "ok"]
    # The email had no recovery path and was never sent: nothing to undo.
    assert all(c.of_tool != "send_email" for c in outcome.compensations)
    refunds, reversals = undo_state(billing, outcome)
    assert len(refunds) == 1 and refunds[0]["voided_at"] is not None
    assert len(reversals) == 1 and reversals[0]["amount_cents"] == 1500


async def written_calls(env: WorkflowEnvironment, workflow_id: str) -> list:
    """Every execute_tool input the run scheduled, as the server holds it (the history)."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.contrib.pydantic import pydantic_data_converter

    from workflows.wire import ToolCall

    history = await env.client.get_workflow_handle(workflow_id).fetch_history()
    return [
        pydantic_data_converter.payload_converter.from_payloads(a.input.payloads, [ToolCall])[0]
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and (a := e.activity_task_scheduled_event_attributes).activity_type.name == "execute_tool"
    ]


async def test_each_undo_carries_a_capability_minted_under_the_plan_that_covered_it(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    billing.fail_next("emails", 1, status=400)
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker, on_failure="compensate")
        calls = await written_calls(ts_env, outcome.run_id)
    assert outcome.state == S.COMPENSATED, outcome.timeline[-1].reason
    undos = [c for c in calls if c.tool_call_id.endswith(":undo")]
    assert sorted(c.tool for c in undos) == ["reverse_ledger_entry", "void_refund"]
    by_call = {c.tool_call_id: c for c in outcome.compensations}
    for call in undos:
        # Minted for exactly this undo (its tool, derived key), under the approved plan's hash.
        cap, undo = call.capability, by_call[call.tool_call_id]
        assert cap is not None and cap.tool == undo.tool and cap.tool_call_id == call.tool_call_id
        assert cap.idempotency_key == undo.idempotency_key and cap.plan_hash == undo.plan_hash != ""
        assert cap.workflow_id == outcome.run_id and cap.mac
    # Every write the run scheduled had one (the refused email included).
    assert all(c.capability is not None for c in calls if c.tool != "get_order")


def test_the_re_check_of_an_undo() -> None:
    """policy.undo_refusal: what the pre-write re-check judges for a compensation."""
    undo = CompensationCall(of="tc-1", of_tool="issue_refund", tool="void_refund", args={"refund_id": "R-1"},
                            idempotency_key="run:tc-1:undo", plan_hash="h" * 64, approved_by=["bob"])
    tenant = TenantPolicy(
        tools=["issue_refund", "void_refund"], approval_roles=["approver"],
        approvers={"bob": Approver(roles=["approver"]), "dana": Approver(roles=["support"])},
    )
    assert policy.undo_refusal(tenant, undo=undo) is None
    # Bob losing his role does not stop the undo of what he approved.
    demoted = tenant.model_copy(update={"approvers": {"dana": Approver(roles=["support"])}})
    assert policy.undo_refusal(demoted, undo=undo) is None
    assert policy.undo_refusal(None, undo=undo).rule == "tenant"
    withdrawn = tenant.model_copy(update={"tools": ["issue_refund"]})
    assert policy.undo_refusal(withdrawn, undo=undo).rule == "tool_withdrawn"
    assert policy.undo_refusal(tenant, undo=undo.model_copy(update={"plan_hash": ""})).rule == "not_approved"
    assert policy.undo_refusal(tenant, undo=undo.model_copy(update={"tool": None})).rule == "no_recovery_path"
    # A compensation run: the person who asked is judged now.
    assert policy.undo_refusal(tenant, undo=undo, compensator="bob") is None
    assert policy.undo_refusal(tenant, undo=undo, compensator="dana").rule == "role"
    assert policy.undo_refusal(tenant, undo=undo, compensator="mallory").rule == "tenant_membership"
    # The capability is minted only for exactly that undo.
    from workflows.wire import ToolCall

    call = ToolCall(tool="void_refund", args={"refund_id": "R-1"}, tool_call_id="tc-1:undo",
                    idempotency_key="run:tc-1:undo", run_id="run", tenant="default", attempt=1)
    assert policy.undo_refusal(tenant, undo=undo, call=call) is None
    other = call.model_copy(update={"args": {"refund_id": "R-2"}})
    assert policy.undo_refusal(tenant, undo=undo, call=other).rule == "capability_invalid"


def test_a_refused_undo_hands_off_and_stays_pending() -> None:
    """The re-check just before an undo refuses: nothing starts, a person decides."""
    from workflows.wire import Refusal

    tenant = TenantPolicy(tools=["issue_refund", "void_refund"])
    data = RunData(catalog=CATALOG, policy=PolicySnapshot(tenant="default", policy=tenant, policy_hash="h", source="t"))
    engine = Engine(data, RunRequest(goal="g", requested_by="carol", compensate_run="orig"), workflow_id="orig-compensate")
    engine.received(NOW)
    engine.begin_compensation(source(), NOW)
    assert engine.state == S.COMPENSATING and engine.compensation_ready(NOW) is True
    check = engine.authority_check(from_step=engine.data.next_step)
    assert check is not None and check.undo is not None and check.plan_hash == check.undo.plan_hash
    assert check.compensator == "carol" and check.tools == [check.undo.tool]
    calls = engine.data.tool_calls
    assert engine.next_tool_call(NOW) is not None
    engine.write_refused(Refusal(rule="tool_withdrawn", message="'void_refund' is not allowed"), NOW)
    assert engine.state == S.HANDED_OFF and engine.data.tool_calls == calls
    last = engine.data.lifecycle.timeline[-1]
    assert "not started" in last.reason and "[tool_withdrawn]" in last.reason and "not compensated" in last.reason
    assert [c.status for c in engine.data.compensations if c.tool] == ["pending"] * len(
        [c for c in engine.data.compensations if c.tool]
    )


async def test_stop_is_the_default_and_keeps_the_writes(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    billing.fail_next("emails", 1, status=400)
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker)
    assert outcome.state == S.EXECUTION_FAILED
    assert "COMPENSATING" not in path(outcome)
    refunds, reversals = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is None and reversals == []
    assert [c.status for c in outcome.compensations] == ["pending", "pending"]


async def test_a_compensation_that_fails_hands_off_naming_it_and_compensate_finishes(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    billing.fail_next("emails", 1, status=400)
    billing.fail_next("voids", 1, status=400)  # the service refuses the void: not re-run
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker, on_failure="compensate")
        assert outcome.state == S.HANDED_OFF
        last = outcome.timeline[-1]
        assert last.from_state == S.COMPENSATING and "void_refund" in last.reason
        assert "not re-run" in last.reason and last.refs.error_code == "injected_fault"
        assert [c.status for c in outcome.compensations] == ["failed", "ok"]
        refunds, reversals = undo_state(billing, outcome)
        assert refunds[0]["voided_at"] is None and len(reversals) == 1
        voids = billing.get("/admin/stats")["requests"]["POST /refunds/{id}/void"]

        # A person with an approval role decides to undo the rest: a governed run of its own.
        handle = await tether_client.compensate(ts_env.client, outcome.run_id, by="carol", queue=worker.task_queue)
        undo = await tether_client.run_outcome(handle)
        calls = await written_calls(ts_env, handle.id)
        history = await handle.fetch_history()
    assert undo.state == S.COMPENSATED, undo.timeline[-1].reason
    # The undo it ran carries a capability minted in the compensation run, under the original's
    # approved plan hash; the original's record was read by an activity whose answer bears the
    # fleet key's attestation (a rogue poller that answers it is refused: test_forgery.py).
    assert [c.tool for c in calls] == ["void_refund"] and calls[0].capability is not None
    assert calls[0].capability.workflow_id == handle.id
    assert calls[0].capability.plan_hash == outcome.compensations[0].plan_hash
    scheduled = {e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                 if e.HasField("activity_task_scheduled_event_attributes")}
    assert "recovery_source" in scheduled and "execute_tool" in scheduled
    kinds = {e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
             if e.HasField("activity_task_scheduled_event_attributes")}
    source = next(e.activity_task_completed_event_attributes.result.payloads[0].data for e in history.events
                  if e.HasField("activity_task_completed_event_attributes")
                  and kinds[e.activity_task_completed_event_attributes.scheduled_event_id] == "recovery_source")
    assert b'"attestation"' in source
    first = next(r for r in undo.timeline if r.to_state == S.COMPENSATING)
    assert first.from_state == S.RECEIVED and first.actor == "user:carol"
    assert outcome.run_id in first.reason and first.refs.plan_hash == outcome.compensations[0].plan_hash
    assert [c.of_tool for c in undo.compensations] == ["issue_refund"]  # only what was left
    refunds, reversals = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is not None and len(reversals) == 1
    assert billing.get("/admin/stats")["requests"]["POST /refunds/{id}/void"] == voids + 1


async def test_compensate_after_an_unknown_outcome_hand_off(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    # The email may have been sent (503 after the commit): the run hands off as before, even
    # with on_failure=compensate; a person then asks for the undo.
    billing.fail_next("emails", 1, status=503, when="after_commit")
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker, on_failure="compensate")
        assert outcome.state == S.HANDED_OFF and "COMPENSATING" not in path(outcome)
        handle = await tether_client.compensate(ts_env.client, outcome.run_id, by="carol", queue=worker.task_queue)
        undo = await tether_client.run_outcome(handle)
        # Once every undo is done (the undo ledger says so), another request is refused before
        # anything starts, whoever sends it.
        with pytest.raises(tether_client.TetherError, match="nothing_to_compensate"):
            await tether_client.compensate(ts_env.client, outcome.run_id, by="erin", queue=worker.task_queue)
    assert undo.state == S.COMPENSATED, undo.timeline[-1].reason
    check_timeline(undo.timeline, tools_by_call(undo))
    assert [c.of_tool for c in reversed(undo.compensations)] == ["post_ledger_entry", "issue_refund"]
    refunds, reversals = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is not None and len(reversals) == 1


async def test_a_second_compensation_while_one_runs_is_refused_naming_it(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    # One compensation run at a time: Temporal refuses a second start of its id while the first
    # runs (WorkflowAlreadyStartedError), and the client says which run is compensating it.
    billing.fail_next("emails", 1, status=503, when="after_commit")
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker, on_failure="compensate")
        assert outcome.state == S.HANDED_OFF
        # Started on a queue no worker polls: it stays running (and no verdict comes: no worker).
        with pytest.raises(tether_client.TetherError, match="no worker answered"):
            await tether_client.compensate(ts_env.client, outcome.run_id, by="carol", queue=f"nobody-{uuid.uuid4().hex[:8]}")
        first = ts_env.client.get_workflow_handle(tether_client.compensation_id(outcome.run_id))
        with pytest.raises(tether_client.TetherError) as again:
            await tether_client.compensate(ts_env.client, outcome.run_id, by="erin", queue=worker.task_queue)
        assert again.value.code == tether_client.REFUSED, again.value
        assert str(again.value) == (f"run {outcome.run_id} is being compensated now by {first.id}: "
                                    f"see `tether status {first.id}`")
        assert (await first.describe()).status.name == "RUNNING"
        await first.terminate("test over")
    _, reversals = undo_state(billing, outcome)
    assert reversals == []  # nothing was undone by either


async def test_compensate_refuses_a_running_run_and_an_unknown_one(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request(PLAN))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        with pytest.raises(tether_client.TetherError, match="only an ended run"):
            await tether_client.compensate(ts_env.client, handle.id, by="carol", queue=worker.task_queue)
        # A compensation run naming a run that is not there fails, saying so (the worker reads
        # the original from the server, never from the request).
        forged = make_request([], compensate_run="no-such-run", requested_by="carol")
        undo = await start_run(ts_env.client, worker, forged)
        result = await tether_client.run_outcome(undo)
        assert result.state == S.FAILED and "unknown_run" in result.timeline[-1].reason
        # (time skipped while waiting: the untouched original has expired by now, nothing ran)
        still = await snapshot(handle)
        if still.state == S.AWAITING_APPROVAL:
            # Never leave a run open on the shared time-skipping server: its timer would fire
            # with no worker to take the task, and a task nobody takes stops time skipping for
            # every later test.
            await handle.terminate("test over")
        assert still.state in (S.AWAITING_APPROVAL, S.EXPIRED) and still.compensations == []


async def test_on_cancel_compensate_puts_the_ok_writes_back_after_a_cancel(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    # The dev server, not the time-skipping one: a cancel that meets the read's attempt as it
    # completes makes the workflow cancel an activity the test server already closed, which it
    # answers ACTIVITY_UNKNOWN to, and the run never gets another workflow task there.
    ts_env = dev_env
    from temporalio.client import WorkflowFailureError

    from tests.helpers.queries import timeline

    billing.fail_next("orders", 10, status=503)  # the read after the writes keeps retrying
    plan = [REFUND, LEDGER, {"tool": "get_order", "args": {"order_id": "A-1002"}}]
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request(plan, on_cancel="compensate"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        await wait_for_state(handle, "RETRY_WAIT")
        await handle.cancel(reason="customer called back")
        with pytest.raises(WorkflowFailureError):
            await handle.result()  # Temporal: cancelled, as asked
        records = await timeline(handle)
        snap = await snapshot(handle)
    assert snap.state == S.COMPENSATED, records[-1].reason
    entered = next(r for r in records if r.to_state == S.COMPENSATING)
    assert entered.from_state == S.RETRY_WAIT and "customer called back" in entered.reason
    assert "on_cancel=compensate" in entered.reason
    check_timeline(records, {s.tool_call_id: s.tool for s in snap.plan.steps})
    outcome = RunOutcome(run_id=handle.id, state=snap.state, answer=None, steps=[], timeline=records,
                         compensations=snap.compensations)
    refunds, reversals = undo_state(billing, outcome)
    assert len(refunds) == 1 and refunds[0]["voided_at"] is not None and len(reversals) == 1


# ----------------------------------------------------------------------------- the undo ledger


class _Undo(BaseModel):
    refund_id: str


def _undo_tools(counts: dict[str, int], fail: dict[str, int]) -> ToolRegistry:
    """An undo of each effect class, counting its calls (``fail``: how many calls answer as a
    transient failure after they acted, the outcome unknown)."""
    from tether.tools.sdk import ToolError

    registry = ToolRegistry()

    def act(name: str) -> dict:
        counts[name] = counts.get(name, 0) + 1
        if fail.get(name, 0) > 0:
            fail[name] -= 1
            raise ToolError("503 after the commit", code="unavailable")
        return {"done": name}

    @tool(effect=ToolEffect.IDEMPOTENT, registry=registry)
    def void_it(args: _Undo, ctx: ToolContext) -> dict:
        return act("void_it")

    @tool(effect=ToolEffect.UNSAFE, registry=registry)
    def apologise(args: _Undo, ctx: ToolContext) -> dict:
        return act("apologise")

    @tool(effect=ToolEffect.RECONCILABLE, registry=registry)
    def reverse_it(args: _Undo, ctx: ToolContext) -> dict:
        return act("reverse_it")

    @reverse_it.lookup
    def find_reversal(ctx: ToolContext) -> dict | None:
        counts["lookup"] = counts.get("lookup", 0) + 1
        return {"found": ctx.idempotency_key}

    return registry


async def run_undo(tools, undo: str, *, as_run: str, rerun: bool = False, attempt: int = 1):
    """execute_tool of the undo of write ``orig:tc-1`` by ``undo`` (its capability minted as the
    workflow code mints it), as an activity of workflow ``as_run``."""
    import dataclasses

    from temporalio.testing import ActivityEnvironment

    from tether.store.keys import KeyRing
    from workflows import keys
    from workflows.wire import ToolCall

    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=as_run, workflow_run_id=f"{as_run}-run", activity_id="tool.1")
    call = ToolCall(tool=undo, args={"refund_id": "R-1"}, tool_call_id="tc-1:undo", idempotency_key="orig:tc-1:undo",
                    run_id=as_run, tenant="default", attempt=attempt)
    call.capability = keys.mint(
        KeyRing.from_env(), call, workflow_id=as_run, run_id=f"{as_run}-run", activity_id="tool.1", request_id="",
        plan_hash="h" * 64, now=datetime.now(timezone.utc), ttl_seconds=30, rerun_unknown=rerun,
    )
    return await env.run(tools.execute_tool, call)


async def test_the_tool_worker_starts_each_undo_once_whichever_run_asks(tmp_path) -> None:
    """The worker's undo ledger, not the client's choice of id: an undo some run did is not
    started again by any other run (its recorded outcome is the answer); one whose outcome is
    unknown runs again only as its tool's effect allows, an unsafe one only on an approver's
    recorded instruction."""
    from temporalio.exceptions import ApplicationError

    from activities.tools import UNDO_IN_FLIGHT, UNDO_MAY_HAVE_APPLIED, ToolActivities
    from tether.store.keys import KeyRing
    from tether.store.effect_ledger import LEDGER_FILE, SqliteUndoLedger

    async def fresh(fail: dict[str, int] | None = None) -> tuple[ToolActivities, dict[str, int], SqliteUndoLedger]:
        counts: dict[str, int] = {}
        ledger = SqliteUndoLedger(tmp_path / f"{len(list(tmp_path.iterdir()))}" / LEDGER_FILE)
        return ToolActivities(_undo_tools(counts, fail or {}), KeyRing.from_env(), ledger), counts, ledger

    # Done once: three runs under three ids (and a reset run under the same id) ask; one call.
    tools, counts, ledger = await fresh()
    first = await run_undo(tools, "void_it", as_run="orig-compensate")
    for other in ("orig-compensate", "another-id", "a-third-id"):
        again = await run_undo(tools, "void_it", as_run=other)
        assert again.observation == first.observation and again.attestation is not None
    assert counts == {"void_it": 1}
    entry = (await ledger.entries(["orig:tc-1:undo"]))["orig:tc-1:undo"]
    assert (entry.state, entry.by_workflow) == ("done", "orig-compensate")

    # Unsafe, outcome unknown: refused as "may have applied" (the tool not called) until an
    # approver's instruction is in the capability.
    tools, counts, ledger = await fresh({"apologise": 1})
    with pytest.raises(ApplicationError):
        await run_undo(tools, "apologise", as_run="orig")
    for other in ("orig-compensate", "orig"):
        with pytest.raises(ApplicationError) as refused:
            await run_undo(tools, "apologise", as_run=other, attempt=2)
        assert refused.value.type == UNDO_MAY_HAVE_APPLIED and not refused.value.non_retryable
        assert "may have applied" in refused.value.message and "--rerun-unknown" in refused.value.message
    assert counts == {"apologise": 1}
    await run_undo(tools, "apologise", as_run="orig-compensate", rerun=True)
    assert counts == {"apologise": 2}
    await run_undo(tools, "apologise", as_run="yet-another", rerun=True)  # done now: never again
    assert counts == {"apologise": 2}

    # Idempotent: not started by another run while an attempt that started it may still be
    # running (its worker went quiet); once that is over, or the attempt ended with its outcome
    # unknown, run again under the same key (the target dedupes).
    tools, counts, ledger = await fresh({"void_it": 1})
    await ledger.claim("orig:tc-1:undo", tool="void_it", workflow_id="orig", run_id="orig-run")
    with pytest.raises(ApplicationError) as busy:
        await run_undo(tools, "void_it", as_run="orig-compensate")
    assert busy.value.type == UNDO_IN_FLIGHT and not busy.value.non_retryable and counts == {}
    age_claim(ledger, "orig:tc-1:undo")
    with pytest.raises(ApplicationError):
        await run_undo(tools, "void_it", as_run="orig-compensate")  # fails, outcome unknown
    await run_undo(tools, "void_it", as_run="another-id")
    assert counts == {"void_it": 2}

    # Reconcilable, outcome unknown: its effect is looked up first, by another run too.
    tools, counts, ledger = await fresh({"reverse_it": 1})
    with pytest.raises(ApplicationError):
        await run_undo(tools, "reverse_it", as_run="orig")
    found = await run_undo(tools, "reverse_it", as_run="orig-compensate")
    assert counts == {"reverse_it": 1, "lookup": 1} and "orig:tc-1:undo" in found.observation


async def test_an_undo_whose_ledger_is_unavailable_is_not_started(tmp_path) -> None:
    """No claim, no call: the attempt bounces (the run schedules it again, as for a capability)."""
    from temporalio.exceptions import ApplicationError

    from tether.store.keys import KeyRing
    from activities.tools import ToolActivities
    from tether.store.effect_ledger import SqliteUndoLedger
    from workflows.wire import LEDGER_UNAVAILABLE

    (tmp_path / "not-a-folder").write_text("")
    counts: dict[str, int] = {}
    tools = ToolActivities(_undo_tools(counts, {}), KeyRing.from_env(), SqliteUndoLedger(tmp_path / "not-a-folder" / "x"))
    with pytest.raises(ApplicationError) as refused:
        await run_undo(tools, "void_it", as_run="orig")
    assert refused.value.type == LEDGER_UNAVAILABLE and counts == {}


def age_claim(ledger, key: str) -> None:
    import sqlite3

    with sqlite3.connect(ledger.path) as conn:
        conn.execute("UPDATE tether_undo_ledger SET at = '2000-01-01T00:00:00+00:00' WHERE key = ?", (key,))


# ----------------------------------------------------------------------------- nothing uses up recovery

EXAMPLE_POLICY = Path(__file__).resolve().parents[2] / "examples/billing/policy.toml"


def shown(status) -> str:
    from tether.cli.output import format_status

    return format_status(status)


async def starter_undone_later(client, run_id: str) -> str:
    from tether.cli.runs import _undone_later

    return await _undone_later(client, run_id)


async def test_a_refused_compensation_leaves_the_original_compensable_and_status_says_where_each_write_stands(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Issue 31, rows 1 and 7: a name that may not compensate (a support role, a name not in the
    policy) is refused before anything starts; a client that skips that check gets a refused run,
    and the original stays compensable; an approver then undoes each write once, and the
    original's status says by which run."""
    from temporalio.service import RPCError

    billing.fail_next("emails", 1, status=400)
    async with running_worker(ts_env.client) as worker, running_worker(
        ts_env.client, policy=PolicyStore(EXAMPLE_POLICY)
    ) as governed:
        outcome = await approved_run(ts_env, worker)
        original = outcome.run_id
        assert outcome.state == S.EXECUTION_FAILED
        kept = shown(await tether_client.status(ts_env.client, original))
        assert "kept; undo: void_refund" in kept and "pending" not in kept and "compensate" in kept
        voids, reversals = requests_to(billing, VOIDS, REVERSALS)
        for who, rule in (("dana", "role"), ("mallory", "tenant_membership")):
            with pytest.raises(tether_client.TetherError) as refused:
                await tether_client.compensate(ts_env.client, original, by=who, queue=governed.task_queue,
                                               policy_path=EXAMPLE_POLICY)
            assert refused.value.rule == rule, refused.value
        with pytest.raises(RPCError):  # nothing started
            await ts_env.client.get_workflow_handle(tether_client.compensation_id(original)).describe()
        for who, rule in (("dana", "role"), ("mallory", "tenant_membership")):
            # A client that skips the checks, under the very id `compensate` uses: the worker refuses.
            forged = await tether_client.start_run(
                ts_env.client, make_request([], compensate_run=original, requested_by=who),
                run_id=tether_client.compensation_id(original), queue=governed.task_queue, allow_id_reuse=True,
            )
            result = await tether_client.run_outcome(forged)
            assert result.state == S.FAILED and result.timeline[-1].refs.error_code == rule
        handle = await tether_client.compensate(ts_env.client, original, by="bob", queue=governed.task_queue,
                                                policy_path=EXAMPLE_POLICY)
        undo = await tether_client.run_outcome(handle)
        assert undo.state == S.COMPENSATED, undo.timeline[-1].reason
        after = shown(await tether_client.status(ts_env.client, original))
        later = await starter_undone_later(ts_env.client, original)
        # The Web UI: the compensation run links its original and says what it undid; the
        # original lists each write (its later undos: `tether status`, which reads the ledger).
        undo_details = (await handle.query("__temporal_workflow_metadata")).current_details
        original_details = (await ts_env.client.get_workflow_handle(original).query("__temporal_workflow_metadata")).current_details
        assert f"**Compensates run** `{original}`" in undo_details and "`void_refund` · undone" in undo_details
        assert "`void_refund` · kept" in original_details and "tether status" in original_details
        with pytest.raises(tether_client.TetherError, match="nothing_to_compensate"):
            await tether_client.compensate(ts_env.client, original, by="carol", queue=governed.task_queue)
    assert requests_to(billing, VOIDS, REVERSALS) == [voids + 1, reversals + 1]
    refunds, reversed_entries = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is not None and len(reversed_entries) == 1
    # The original links the run that undid each write; nothing is called pending.
    assert after.count(f"by run {handle.id}") == 2 and "undone (void_refund" in after, after
    assert "pending" not in after and "undo them" not in after
    # `tether timeline` of the original ends with what compensation runs did since, by which run.
    assert later.count(f"by run {handle.id}") == 2 and later.startswith("later      ")


async def test_compensation_runs_under_other_ids_undo_each_write_once(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    """Issue 31, row 4: compensation runs of one original under ids a client chose, two at once
    and one after: each undo reaches the service once (the tool worker's ledger decides, not the id)."""
    billing.fail_next("emails", 1, status=400)
    async with running_worker(ts_env.client) as worker:
        outcome = await approved_run(ts_env, worker)
        before = requests_to(billing, VOIDS, REVERSALS)
        request = make_request([], compensate_run=outcome.run_id, requested_by="carol")
        together = [await start_run(ts_env.client, worker, request) for _ in range(2)]
        results = [await tether_client.run_outcome(h) for h in together]
        late = await tether_client.run_outcome(await start_run(ts_env.client, worker, request))
    assert requests_to(billing, VOIDS, REVERSALS) == [before[0] + 1, before[1] + 1]
    assert S.COMPENSATED in [r.state for r in results], [r.timeline[-1].reason for r in results]
    for r in results:
        assert r.state in (S.COMPENSATED, S.HANDED_OFF, S.FAILED), r.timeline[-1].reason
    assert late.state == S.FAILED and late.timeline[-1].refs.error_code == "nothing_to_compensate"
    refunds, reversals = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is not None and len(reversals) == 1


async def test_undoing_a_completed_run_is_a_request_its_undos_approval_governs(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Issue 31, row 6: a completed run kept its writes by design: its status says kept (never
    pending); `compensate` asks for an approval bound to exactly its undos (a plan of its own,
    approved by the policy's roles), and only then runs them; a name the policy does not let ask
    is refused before anything starts."""
    from temporalio.service import RPCError

    async with running_worker(ts_env.client) as worker, running_worker(
        ts_env.client, policy=PolicyStore(EXAMPLE_POLICY)
    ) as governed:
        handle = await start_run(ts_env.client, worker, make_request([REFUND]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        outcome = await tether_client.run_outcome(handle)
        assert outcome.state == S.COMPLETED
        text = shown(await tether_client.status(ts_env.client, handle.id))
        with pytest.raises(tether_client.TetherError) as refused:
            await tether_client.compensate(ts_env.client, handle.id, by="dana", queue=governed.task_queue,
                                           policy_path=EXAMPLE_POLICY)
        assert refused.value.rule == "role"
        with pytest.raises(RPCError):  # nothing started
            await ts_env.client.get_workflow_handle(tether_client.compensation_id(handle.id)).describe()
        before = requests_to(billing, VOIDS)[0]
        undo = await tether_client.compensate(ts_env.client, handle.id, by="carol", queue=governed.task_queue,
                                              policy_path=EXAMPLE_POLICY)
        waiting = await wait_for_state(undo, "AWAITING_APPROVAL")
        assert requests_to(billing, VOIDS)[0] == before  # nothing undone before the approval
        assert [s.tool for s in waiting.plan.steps] == ["void_refund"]
        assert waiting.plan.steps[0].args == outcome.compensations[0].args  # bound to exactly that undo
        await undo.signal("approve", approval_for(waiting, "bob"))
        done = await tether_client.run_outcome(undo)
        after = shown(await tether_client.status(ts_env.client, handle.id))
    assert "kept; undo: void_refund" in text and "pending" not in text and "need an approval first" in text
    assert done.state == S.COMPENSATED, done.timeline[-1].reason
    path = [r.to_state.value for r in done.timeline if r.kind == "transition"]
    assert path[:4] == ["VALIDATED", "AWAITING_APPROVAL", "APPROVED", "COMPENSATING"], path
    assert requests_to(billing, VOIDS)[0] == before + 1
    refunds = billing.refunds(outcome.compensations[0].idempotency_key.removesuffix(":undo"))
    assert len(refunds) == 1 and refunds[0]["voided_at"] is not None
    assert f"undone (void_refund by run {undo.id}" in after


async def until(predicate, timeout: float = 60.0) -> None:
    """Wait for an event the test cannot be told of (a request reaching the service)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "the event did not come"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("undoing", ["the run itself", "a compensation run", "a terminated compensation run"])
async def test_a_cancel_while_undoing_strands_no_write(dev_env: WorkflowEnvironment, billing: Billing, undoing: str) -> None:
    """Issue 31, rows 2 and 3: a cancel that arrives while writes are being undone (by the run's
    on_failure=compensate, or by a compensation run) ends CANCELLED naming what is left, and
    `tether compensate` of the original continues from there: each undo reaches the service once.
    A compensation run terminated mid-undo strands nothing either."""
    billing.fail_next("emails", 1, status=400)
    billing.fail_next("voids", 2, status=503)  # the void (undone last) is in its backoff when the cancel comes
    own = undoing == "the run itself"
    async with running_worker(dev_env.client) as worker:
        outcome = None if own else await approved_run(dev_env, worker)
        before = requests_to(billing, VOIDS, REVERSALS)
        if own:
            handle = await start_run(dev_env.client, worker, make_request(PLAN, on_failure="compensate"))
            snap = await wait_for_state(handle, "AWAITING_APPROVAL")
            await handle.signal("approve", approval_for(snap, "bob"))
            original = handle.id
        else:
            original = outcome.run_id
            handle = await tether_client.compensate(dev_env.client, original, by="carol", queue=worker.task_queue)
        await until(lambda: requests_to(billing, VOIDS)[0] > before[0])
        if undoing == "a terminated compensation run":
            await handle.terminate("test: an operator terminates it mid-undo")
        else:
            await handle.cancel()
            cancelled = await tether_client.run_outcome(handle)
            assert cancelled.state == S.CANCELLED, cancelled.timeline[-1].reason
            assert "not compensated" in cancelled.timeline[-1].reason and "void_refund" in cancelled.timeline[-1].reason
        again = await tether_client.compensate(dev_env.client, original, by="erin", queue=worker.task_queue)
        finished = await tether_client.run_outcome(again)
        status = shown(await tether_client.status(dev_env.client, original))
        kept = (await snapshot(dev_env.client.get_workflow_handle(original))).compensations
    assert finished.state == S.COMPENSATED, finished.timeline[-1].reason
    assert [c.of_tool for c in finished.compensations] == ["issue_refund"]  # the reversal was done
    voids, reversals = requests_to(billing, VOIDS, REVERSALS)
    assert reversals == before[1] + 1 and voids <= before[0] + 3  # 2 refused by the service, 1 applied
    outcome = RunOutcome(run_id=original, state=S.CANCELLED, answer=None, steps=[], timeline=[], compensations=kept)
    refunds, reversed_entries = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is not None and len(reversed_entries) == 1
    assert f"by run {again.id}" in status and "pending" not in status


# ----------------------------------------------------------------------------- unknown is not failed

class _Booking(BaseModel):
    to: str


BOOKINGS = ToolRegistry()


@tool(effect=ToolEffect.IDEMPOTENT, registry=BOOKINGS, compensate=("send_cancellation", {"to": "/args/to"}))
def book_slot(args: _Booking, ctx: ToolContext) -> dict:
    """A write whose undo is an email: unsafe (the service does not dedupe emails)."""
    return {"slot": "S-1", "to": args.to}


@tool(effect=ToolEffect.UNSAFE, registry=BOOKINGS)
def send_cancellation(args: _Booking, ctx: ToolContext) -> dict:
    from examples.billing.tools import call

    return call("POST", "/emails", {"to": args.to, "subject": "Your booking is cancelled", "body": "cancelled"},
                headers={"X-Request-Ref": ctx.idempotency_key}, timeout=ctx.seconds_left())


@tool(effect=ToolEffect.IDEMPOTENT, registry=BOOKINGS)
def confirm_slot(args: _Booking, ctx: ToolContext) -> dict:
    from tether.tools.sdk import ToolError

    raise ToolError("the slot is gone", code="slot_gone", permanent=True)


async def test_an_unsafe_undo_that_may_have_applied_runs_again_only_on_an_approvers_instruction(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Issue 31, row 5: the undo (an email) was committed but answered 503: the run hands off.
    `tether compensate` lists it as "may have applied" and sends nothing; only an approver's
    recorded `--rerun-unknown STEP` sends it again (once)."""
    to = f"{uuid.uuid4().hex[:8]}@example.com"
    sent = lambda: len(billing.get(f"/emails?to={to}")["emails"])  # noqa: E731
    billing.fail_next("emails", 1, status=503, when="after_commit")
    steps = [{"tool": "book_slot", "args": {"to": to}}, {"tool": "confirm_slot", "args": {"to": to}}]
    async with running_worker(ts_env.client, registry=BOOKINGS) as worker:
        handle = await start_run(ts_env.client, worker, make_request(steps, on_failure="compensate"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        outcome = await tether_client.run_outcome(handle)
        assert outcome.state == S.HANDED_OFF and [c.status for c in outcome.compensations] == ["unknown"]
        assert sent() == 1
        step = outcome.compensations[0].of
        listed = await tether_client.run_outcome(
            await tether_client.compensate(ts_env.client, handle.id, by="carol", queue=worker.task_queue))
        assert listed.state == S.HANDED_OFF and listed.timeline[-1].refs.error_code == "may_have_applied"
        assert "--rerun-unknown" in listed.timeline[-1].reason and sent() == 1
        status = shown(await tether_client.status(ts_env.client, handle.id))
        assert "may have applied: undo send_cancellation started" in status and "--rerun-unknown" in status
        rerun = await tether_client.compensate(ts_env.client, handle.id, by="carol", queue=worker.task_queue,
                                               rerun_unknown=[step])
        done = await tether_client.run_outcome(rerun)
        first = next(r for r in done.timeline if r.to_state == S.COMPENSATING)
        assert done.state == S.COMPENSATED and sent() == 2, done.timeline[-1].reason
        assert first.actor == "user:carol" and f"carol instructs to run again what may have applied: {step}" in first.reason
        with pytest.raises(tether_client.TetherError, match="nothing_to_compensate"):
            await tether_client.compensate(ts_env.client, handle.id, by="carol", queue=worker.task_queue,
                                           rerun_unknown=[step])
    assert sent() == 2


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_the_undo_ledger_holds_one_claim_per_undo_on_either_sink(backend: str, tmp_path, request) -> None:
    """The ledger's contract, the same beside either audit sink: one claim per key; a done
    entry keeps its outcome and who did it; a released one may be claimed again."""
    from tether.audit.sink import JsonlAuditSink, PostgresAuditSink
    from tether.store.effect_ledger import ledger_for

    sink = PostgresAuditSink(request.getfixturevalue("postgres")) if backend == "postgres" else JsonlAuditSink(tmp_path)
    ledger = ledger_for(sink)
    key = f"orig-{uuid.uuid4().hex[:8]}:tc-1:undo"
    try:
        assert await ledger.claim(key, tool="void_refund", workflow_id="a", run_id="a1") is None
        held = await ledger.claim(key, tool="void_refund", workflow_id="b", run_id="b1")
        assert held is not None and (held.state, held.by_workflow) == ("claimed", "a")
        await ledger.unknown(key)
        assert (await ledger.entries([key]))[key].state == "unknown"
        await ledger.reclaim(key, workflow_id="b", run_id="b1")
        await ledger.done(key, '{"observation": "{}"}', workflow_id="b", run_id="b1")
        done = await ledger.claim(key, tool="void_refund", workflow_id="c", run_id="c1")
        assert (done.state, done.by_workflow, done.outcome) == ("done", "b", '{"observation": "{}"}')
        other = key.replace("tc-1", "tc-2")
        assert await ledger.claim(other, tool="void_refund", workflow_id="a", run_id="a1") is None
        await ledger.release(other)  # the target refused it: known not applied
        assert await ledger.claim(other, tool="void_refund", workflow_id="c", run_id="c1") is None
        assert set(await ledger.entries([key, other, "nothing"])) == {key, other}
    finally:
        await ledger.aclose()


async def test_a_reset_compensation_run_undoes_nothing_twice(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """A compensation run reset to just after it read the original (before its undos): the reset
    run schedules the same undos again, and the tool worker answers them from its ledger — no
    second request reaches the service."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import EventType
    from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest

    billing.fail_next("emails", 1, status=400)
    async with running_worker(dev_env.client) as worker:
        outcome = await approved_run(dev_env, worker)
        handle = await tether_client.compensate(dev_env.client, outcome.run_id, by="carol", queue=worker.task_queue)
        assert (await tether_client.run_outcome(handle)).state == S.COMPENSATED
        done = requests_to(billing, VOIDS, REVERSALS)
        events = (await handle.fetch_history()).events
        scheduled = {e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name for e in events
                     if e.HasField("activity_task_scheduled_event_attributes")}
        read = next(e.event_id for e in events if e.HasField("activity_task_completed_event_attributes")
                    and scheduled[e.activity_task_completed_event_attributes.scheduled_event_id] == "recovery_source")
        point = min(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id > read)
        reset = await dev_env.client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
            namespace=dev_env.client.namespace, workflow_execution=WorkflowExecution(workflow_id=handle.id),
            reason="test: redo the undos", workflow_task_finish_event_id=point, request_id=uuid.uuid4().hex,
        ))
        again = await tether_client.run_outcome(dev_env.client.get_workflow_handle(handle.id, run_id=reset.run_id))
    assert again.state == S.COMPENSATED, again.timeline[-1].reason
    assert requests_to(billing, VOIDS, REVERSALS) == done  # the ledger answered both
    refunds, reversals = undo_state(billing, outcome)
    assert refunds[0]["voided_at"] is not None and len(reversals) == 1


# ----------------------------------------------------------------------------- exactly once, as a property

_OUTCOMES = ["ok", "lost", "refused", "down", "crash"]  # applied?: yes, yes, no, no, yes


def _scripted_undo(effect: ToolEffect, script: list[str], applied: list[int], calls: list[int]) -> ToolRegistry:
    """One undo tool of ``effect`` whose calls answer as ``script`` says, counting its calls and
    the ones that applied."""
    from tether.tools.sdk import ToolError

    registry = ToolRegistry()

    @tool(effect=effect, registry=registry, name="undo_it")
    def undo_it(args: _Undo, ctx: ToolContext) -> dict:
        outcome = script[len(calls)] if len(calls) < len(script) else "ok"
        calls.append(1)
        if outcome in ("ok", "lost", "crash"):
            applied.append(1)
        if outcome == "lost":
            raise ToolError("answered 503 after the commit", code="unavailable")
        if outcome == "refused":
            raise ToolError("refused", code="bad_request", permanent=True)
        if outcome == "down":
            raise ToolError("503 before the commit", code="unavailable")
        if outcome == "crash":
            raise RuntimeError("the worker died mid-call")  # its claim is never settled
        return {"undone": True}

    return registry


def test_every_undo_is_applied_at_most_once_whatever_runs_ask_in_whatever_order() -> None:
    """A property over the real tool worker and ledger: any sequence of runs (the original, its
    compensation runs under any ids, reset runs) asking for one undo, whatever each call comes to.
    Once an undo is done its tool is never called again; an unsafe undo never applies twice without
    an approver's instruction; a claim that may still be running is never raced by another run."""
    import asyncio
    import tempfile

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tether.store.keys import KeyRing
    from activities.tools import ToolActivities
    from tether.store.effect_ledger import LEDGER_FILE, SqliteUndoLedger

    @settings(max_examples=60, deadline=None)
    @given(
        effect=st.sampled_from([ToolEffect.IDEMPOTENT, ToolEffect.UNSAFE, ToolEffect.RECONCILABLE]),
        script=st.lists(st.sampled_from(_OUTCOMES), max_size=6),
        runs=st.lists(st.sampled_from(["orig", "orig-compensate", "other-id", "orig-compensate"]), min_size=1, max_size=8),
    )
    def check(effect: ToolEffect, script: list[str], runs: list[str]) -> None:
        applied: list[int] = []
        calls: list[int] = []
        registry = _scripted_undo(effect, script, applied, calls)
        if effect == ToolEffect.RECONCILABLE:
            # Its lookup finds the effect once one applied.
            registry.get("undo_it").lookup(lambda ctx: {"found": True} if applied else None)
        with tempfile.TemporaryDirectory() as folder:
            tools = ToolActivities(registry, KeyRing.from_env(), SqliteUndoLedger(Path(folder) / LEDGER_FILE))
            done_at = None
            for i, run in enumerate(runs):
                before = len(calls)
                try:
                    asyncio.run(run_undo(tools, "undo_it", as_run=run, attempt=i + 1))
                except Exception:  # noqa: BLE001 (refused, failed, or the simulated crash)
                    pass
                else:
                    done_at = i if done_at is None else done_at
                if done_at is not None and done_at < i:
                    assert len(calls) == before, "a done undo was started again"
            if effect == ToolEffect.UNSAFE:
                assert len(applied) <= 1, f"an unsafe undo applied {len(applied)} times: {script} by {runs}"

    check()
