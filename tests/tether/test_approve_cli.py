"""What you approve is what you saw, through the installed `tether` against a real dev server
and billing service: a decision binds to the plan the person reviewed (``--plan-hash``, or the
plan a terminal showed and they confirmed), a script that names none is refused, and what is
shown is every step, argument, effect in words and amount with its currency."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.paths import BIN, ROOT
from tests.helpers.queries import timeline
from tests.helpers.runs import running_worker, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.round_trips import counting_proxy
from tests.helpers.cli import POLICY, one_line
from tests.helpers.cli import Cli
from tests.helpers.terminal import in_terminal
from workflows.run_state import RunOutcome

# A-1002 (120.00 EUR; refunds up to 50.00 need nobody): the refund's undo is void_refund; the email cannot be unsent.
PLAN = [
    {"tool": "get_order", "args": {"order_id": "A-1002"}},
    {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 7000, "reason": "late"}},
    {"tool": "send_email", "args": {"to": "ada@example.com", "subject": "Refund", "body": "Refunded 70.00 EUR."}},
]


async def start(cli: Cli, tmp_path: Path, steps: list[dict], requested_by: str = "alice") -> str:
    playbook = tmp_path / f"{unique('plan')}.json"
    playbook.write_text(json.dumps(steps))
    run = unique("cli-bind")
    code, out, err = await cli("start", "--goal", "g", "--playbook", str(playbook), "--requested-by", requested_by,
                               "--id", run, "--wait")
    assert code == 0 and "AWAITING_APPROVAL" in out, (out, err)
    return run


async def test_bobs_approval_after_the_requester_swapped_the_plan_does_not_run_it(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)
        run = await start(cli, tmp_path, PLAN)
        # bob reviews: every argument, money in EUR, effects in words, the hash to bind to.
        code, out, _ = await cli("status", run)
        assert code == 0
        reviewed = (await dev_env.client.get_workflow_handle(run).query("snapshot")).get("plan")["plan_hash"]
        assert f"plan       v1 {reviewed}" in out
        assert "amount_cents: 70.00 EUR (7000)" in out and '"Refunded 70.00 EUR."' in out
        assert "1. get_order: read-only" in out and "2. issue_refund: can be undone by void_refund" in out
        assert "3. send_email: cannot be undone" in out and "`" not in out
        assert f"--plan-hash {reviewed[:12]}" in out
        assert "1 more needed from someone with role approver" in out

        # alice revises her own run: 490.00 EUR, the email to mallory.
        code, out, err = await cli("revise", run, "--by", "alice", "--reason", "correction",
                                   "--step", "2", "amount_cents=49000", "--step", "3", "to=mallory@evil.example")
        assert code == 0 and "VALIDATED" in out, (out, err)

        # bob's approval names the plan he reviewed: refused as stale, nothing runs.
        code, out, err = await cli("approve", run, "--by", "bob", "--plan-hash", reviewed[:12])
        assert code == 1 and "[rule: stale_plan_hash]" in one_line(err), (out, err)
        # Without a hash, a script is told what to do (2), before anything is sent.
        code, out, err = await cli("approve", run, "--by", "bob")
        assert code == 2 and "--plan-hash" in one_line(err) and "--unreviewed" in err, (out, err)
        snap = await wait_for_state(dev_env.client.get_workflow_handle(run), "AWAITING_APPROVAL")
        assert snap.approved_by == [] and snap.plan.plan_hash != reviewed and snap.plan.version == 2
        records = await timeline(dev_env.client.get_workflow_handle(run))
        assert [r.rule for r in records if r.kind == "refused"] == ["stale_plan_hash"]
        assert not [r for r in billing.refunds() if r["order_id"] == "A-1002"]
        await cli("cancel", run, "--reason", "test over")


async def test_a_hash_prefix_binds_short_ones_are_usage_errors_and_unreviewed_is_on_the_record(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)
        run = await start(cli, tmp_path, PLAN[:2])
        handle = dev_env.client.get_workflow_handle(run, result_type=RunOutcome)
        pending = (await handle.query("snapshot"))["pending_approval"]
        for bad in (pending["plan_hash"][:11], "not-a-hash-at-all"):
            code, _, err = await cli("approve", run, "--by", "bob", "--plan-hash", bad)
            assert code == 2 and "--plan-hash" in one_line(err) and "12" in err, (bad, err)
        code, _, err = await cli("approve", run, "--by", "bob", "--plan-hash", pending["plan_hash"][:12], "--unreviewed")
        assert code == 2 and "exclude each other" in one_line(err)
        # The 12-character form tether prints is the pending plan: approved, and said so.
        code, out, err = await cli("approve", run, "--by", "bob", "--plan-hash", pending["plan_hash"][:12])
        assert code == 0 and "APPROVED" in out, (out, err)
        assert f"request {pending['request_id']}" in out and "amount_cents: 70.00 EUR (7000)" in out
        assert "the plan that runs is the one shown" in out
        assert (await run_outcome(handle)).state.value == "COMPLETED"

        other = await start(cli, tmp_path, PLAN[:2])
        code, out, err = await cli("approve", other, "--by", "bob", "--unreviewed")
        assert code == 0 and "APPROVED" in out and "unreviewed" in out, (out, err)
        records = await timeline(dev_env.client.get_workflow_handle(other))
        [approved] = [r for r in records if r.to_state.value == "APPROVED" and r.kind == "transition"]
        assert "unreviewed" in approved.reason and approved.actor == "user:bob"
        await run_outcome(dev_env.client.get_workflow_handle(other, result_type=RunOutcome))


async def test_on_a_terminal_the_plan_is_shown_and_confirmed_and_steps_show_the_plan_that_runs(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)
        run = await start(cli, tmp_path, PLAN)
        handle = dev_env.client.get_workflow_handle(run, result_type=RunOutcome)
        before = await timeline(handle)
        argv = [str(BIN / "tether"), "approve", run, "--by", "bob"]
        # No: nothing is sent, and the run's record is as it was.
        code, shown = await asyncio.to_thread(in_terminal, argv, cli.env, "n")
        assert code == 1 and "[y/N]" in shown and "not sent" in shown, shown
        assert "3. send_email: cannot be undone" in shown and "to: \"ada@example.com\"" in shown
        assert await timeline(handle) == before

        # --steps: the plan shown is v1, the confirmation shows v2, the plan that runs.
        argv = [str(BIN / "tether"), "approve", run, "--by", "bob", "--steps", "1,2"]
        code, shown = await asyncio.to_thread(in_terminal, argv, cli.env, "y")
        assert code == 0 and "APPROVED" in shown, shown
        assert "only step(s) 1, 2; dropped from the plan: 3" in shown
        plan_to_run = shown.split("the plan that runs: ", 1)[1]
        assert plan_to_run.startswith("v2 ") and "2. issue_refund" in plan_to_run and "send_email" not in plan_to_run
        outcome = await run_outcome(handle)
    assert outcome.state.value == "COMPLETED" and [s.tool for s in outcome.steps] == ["get_order", "issue_refund"]


async def test_status_says_how_many_approvals_are_still_needed_and_from_whom(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    # Above 500.00: two approvals from finance.
    huge = [{"tool": "issue_refund", "args": {"order_id": "A-1003", "amount_cents": 60000, "reason": "cli"}}]
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)
        run = await start(cli, tmp_path, huge)
        code, out, _ = await cli("status", run)
        assert "amount_cents: 600.00 EUR (60000)" in out
        assert "pending    high risk approval until " in out
        assert "0 of 2 approval(s); 2 more needed from someone with role finance" in out
        pending = (await dev_env.client.get_workflow_handle(run).query("snapshot"))["pending_approval"]
        code, out, err = await cli("approve", run, "--by", "carol", "--plan-hash", pending["plan_hash"])
        assert code == 0 and "approval 1 of 2 accepted" in out, (out, err)
        code, out, _ = await cli("status", run)
        assert "1 of 2 approval(s) (by carol); 1 more needed from someone with role finance, other than carol" in out
        assert "approved   by" not in out  # not approved yet: one of two
        await cli("cancel", run, "--reason", "test over")


async def test_approve_asks_the_server_at_most_seven_times_and_prints_the_runs_own_record(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """Every gRPC call the `tether approve` process makes, counted on the wire by a proxy in front
    of the dev server: one connection, one read of the run with its worker probe, the Update and
    its answer. What it prints is the record the Update answered with (no timeline query, no
    second snapshot)."""
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)
        run = await start(cli, tmp_path, PLAN[:2])
        handle = dev_env.client.get_workflow_handle(run, result_type=RunOutcome)
        pending = (await handle.query("snapshot"))["pending_approval"]
        async with counting_proxy(cli.env["TEMPORAL_ADDRESS"]) as (address, counter):
            code, out, err = await cli("approve", run, "--by", "bob", "--plan-hash", pending["plan_hash"][:12],
                                       "--decision-id", "counted", env={"TEMPORAL_ADDRESS": address})
        assert code == 0, (out, err)
        # GetSystemInfo; DescribeWorkflowExecution, DescribeTaskQueue, ListWorkers; QueryWorkflow
        # (snapshot); UpdateWorkflowExecution, PollWorkflowExecutionUpdate. Fewer than 5: not counted.
        assert 5 <= counter.calls <= 7, (counter.calls, out, err)
        [approved] = [r for r in await timeline(handle) if r.refs.decision_id == "counted"]
        assert f"APPROVED: {approved.reason} (decision counted)" in out and approved.actor == "user:bob"
        assert f"the plan that runs is the one shown ({pending['plan_hash'][:12]})" in out
        assert (await run_outcome(handle)).state.value == "COMPLETED"


async def test_a_refused_decision_exits_1_with_the_rule_the_run_typed(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """The validator's refusal (a decision id already counted) comes back as the failure's type,
    the run's own verdict (four-eyes) as the answer's rule: exit 1 with the rule either way."""
    huge = [{"tool": "issue_refund", "args": {"order_id": "A-1003", "amount_cents": 60000, "reason": "cli"}}]
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)
        run = await start(cli, tmp_path, huge)  # two approvals from finance: it still waits after one
        plan_hash = (await dev_env.client.get_workflow_handle(run).query("snapshot"))["pending_approval"]["plan_hash"]
        code, out, err = await cli("approve", run, "--by", "carol", "--plan-hash", plan_hash, "--decision-id", "once")
        assert code == 0 and "approval 1 of 2 accepted" in out, (out, err)
        for by in ("carol", "erin"):  # the same id again, whoever sends it: counted once
            code, out, err = await cli("approve", run, "--by", by, "--plan-hash", plan_hash, "--decision-id", "once")
            assert code == 1 and one_line(err).endswith("[rule: duplicate_decision]"), (by, out, err)
            assert "approve refused: duplicate decision_id once" in one_line(err) and "[duplicate_decision]" not in err
        code, out, err = await cli("approve", run, "--by", "alice", "--plan-hash", plan_hash)
        assert code == 1 and "[rule: four_eyes]" in one_line(err), (out, err)
        code, out, _ = await cli("status", run)
        assert "1 of 2 approval(s) (by carol)" in out
        await cli("cancel", run, "--by", "alice", "--reason", "test over")


def test_an_update_refusal_is_read_by_its_type_never_from_its_message() -> None:
    """The rule is the ApplicationError's type; an older build's validator raised a plain
    ValueError (typed by its class): no rule then, and its message as it is."""
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.exceptions import ApplicationError

    from tether.client import REFUSED
    from tether.client.errors import _refused_update

    typed = _refused_update(WorkflowUpdateFailedError(
        ApplicationError("approve refused [duplicate_decision]: decision_id d is already being decided", type="duplicate_decision")
    ), "approve")
    assert (typed.code, typed.rule) == (REFUSED, "duplicate_decision")
    assert str(typed) == "approve refused: decision_id d is already being decided [rule: duplicate_decision]"
    # A message that names a rule its type does not: the type decides.
    forged = _refused_update(WorkflowUpdateFailedError(ApplicationError("approve refused [four_eyes]: x", type="continuing_as_new")), "approve")
    assert forged.rule == "continuing_as_new"
    older = _refused_update(WorkflowUpdateFailedError(
        ApplicationError("approve refused [duplicate_decision]: decision_id d is already being decided", type="ValueError")
    ), "approve")
    assert (older.code, older.rule) == (REFUSED, None)
    assert str(older) == "approve refused [duplicate_decision]: decision_id d is already being decided"


def test_the_plan_an_approval_lets_run_is_read_from_its_record_only_when_the_steps_hash_to_it() -> None:
    """`tether approve` prints the plan that runs from the Update's record, with no query: the
    plan decided, or for --steps its kept steps as the next version, only when they hash to the
    plan hash the run recorded; anything else (a record naming another plan) is asked for."""
    from tether.client import Verdict, plan_to_run
    from workflows.contract import Compensation, Plan, PlanStep
    from workflows.states import Refs, RunState, TransitionRecord

    steps = [PlanStep(tool_call_id=f"c{n}", tool=tool, args={"order_id": "A-1"}) for n, tool in
             enumerate(("get_order", "issue_refund", "send_email"), start=1)]
    undo = [None, Compensation(tool="void_refund", args={"refund_id": "/result/refund_id"}), None]
    plan = Plan(steps=steps, undo=undo, plan_hash=Plan.hash_steps(steps, undo), version=3)

    def verdict(plan_hash: str | None) -> Verdict:
        record = TransitionRecord(from_state=RunState.AWAITING_APPROVAL, to_state=RunState.APPROVED, at="2026-01-01T00:00:00Z",
                                  actor="user:bob", reason="approved", state_version=5, refs=Refs(plan_hash=plan_hash))
        return Verdict(run_id="r", decision_id="d", record=record, plan=plan)

    assert plan_to_run(verdict(plan.plan_hash)) is plan
    kept = Plan.hash_steps([steps[0], steps[1]], undo[:2])
    narrowed = plan_to_run(verdict(kept), [2, 1, 2])
    assert narrowed is not None and (narrowed.version, narrowed.plan_hash) == (4, kept)
    assert [s.tool for s in narrowed.steps] == ["get_order", "issue_refund"] and narrowed.hashes_to_itself()
    for named, chosen in ((kept, [1, 3]), (kept, None), (kept, [0, 1]), (kept, [1, 4]), ("0" * 64, [1, 2]), (None, [1, 2])):
        assert plan_to_run(verdict(named), chosen) is None, (named, chosen)


def test_money_comes_only_from_the_schema_and_effects_read_as_words() -> None:
    from workflows.wording import effect_words, money
    from workflows.contract import Compensation, ToolEffect, ToolInfo

    eur = {"type": "integer", "x-money": {"currency": "EUR", "minor_units": 2}}
    assert money(60000, eur, {}) == "600.00 EUR" and money(-4999, eur, {}) == "-49.99 EUR" and money(5, eur, {}) == "0.05 EUR"
    yen = {"x-money": {"currency_arg": "currency", "minor_units": 0}}
    assert money(1200, yen, {"currency": "JPY"}) == "1200 JPY"
    assert money(1200, yen, {}) is None  # no currency in the call: shown as the raw value only
    for value in (True, 12.5, "60000", None):
        assert money(value, eur, {}) is None
    assert money(60000, {"type": "integer"}, {}) is None and money(60000, None, {}) is None
    assert money(1, {"x-money": {"currency": "EUR", "minor_units": 40}}, {}) is None
    assert money(1, {"x-money": {"currency": "\x1b[31mEUR"}}, {}) == "0.01 \\x1b[31…"

    def info(effect: ToolEffect, **fields) -> ToolInfo:
        return ToolInfo(name="t", effect=effect, requires_approval=False, args_schema={}, timeout_seconds=5, max_retries=0, **fields)

    undo = Compensation(tool="void_refund", args={"refund_id": "/result/refund_id"})
    assert effect_words(info(ToolEffect.READ_ONLY)) == "read-only"
    assert effect_words(info(ToolEffect.IDEMPOTENT), undo) == "can be undone by void_refund"
    assert effect_words(info(ToolEffect.IDEMPOTENT, compensate=undo), None) == "cannot be undone"  # not in the hash
    assert effect_words(info(ToolEffect.UNSAFE, destructive=True), None) == "cannot be undone; unsafe: never re-run; may destroy data"
    assert effect_words(info(ToolEffect.RECONCILABLE, compensate=undo)) == "can be undone by void_refund"  # older plan
    assert effect_words(None).startswith("unknown tool")
