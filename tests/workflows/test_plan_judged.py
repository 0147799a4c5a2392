"""The first plan's planning-time re-check, judged by the planner call that brought the plan with
the run's setup (workflows/plan_check.py, activities/setup.py ``plan``).

The check that call builds must be the run's own, digest for digest, for every kind of first plan
(a table, against the engine driven as the workflow drives it: tests/helpers/scripted.py); the run
takes the verdict for exactly that check and for no other, and the same verdict leads the run to
the same place whether it came that way or from ``policy_check_authority``. The activity's side
runs with a real key ring and policy store."""

from __future__ import annotations

import dataclasses
import re
import uuid

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import ActivityEnvironment

from tether.planners import planning
from tether.store.keys import KeyRing
from activities.policy_checks import PolicyActivities
from tether.policy.files import PolicyStore
from activities.setup import SetupActivities
from activities.tools import ToolActivities
from tether.tools.sdk import REGISTRY
from tests.helpers.scripted import Scripted
from workflows.commands import Call, Command, Wait
from workflows.plan_check import check_digest, first_check
from workflows.policy_file import AmountRule, AutoApprove, Budgets, TenantPolicy
from workflows.states import RunState
from workflows.wire import (
    ApproverRoster, PlanJudged, PlannerInput, PlaybookStep, Proposal, ProposedStep, Refusal, Verdict,
)

S = RunState
RUN = "run-1"  # the run chain's first run, as Scripted(first_plan=True) starts it
READ = ProposedStep(tool="get_order", args={"order_id": "A-1001"})
REFUND = ProposedStep(tool="issue_refund", args={"order_id": "A-1001", "amount_cents": 9000, "reason": "r"})
SMALL = ProposedStep(tool="issue_refund", args={"order_id": "A-1001", "amount_cents": 100, "reason": "r"})
EMAIL = ProposedStep(tool="send_email", args={"to": "c@example.com", "subject": "s", "body": "b"})
ROSTER = ApproverRoster(risk="normal", roles=["approver"], people={"bob": ["p.bob"]}, anyone=None)
SMALL_AUTO = TenantPolicy(auto_approve=AutoApprove(limits=[AmountRule(tool="issue_refund", field="amount_cents", max=500)]))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    steps: list[ProposedStep]
    tenant: TenantPolicy | None = None
    rosters: list[ApproverRoster] | None = None
    limits: dict | None = None
    tokens: int = 0
    checks: bool = True  # the run checks this plan at VALIDATED


# Every kind of first plan: where the run checks at VALIDATED, the call builds that very check;
# where it does not (nothing writes, the plan is not valid, the run ends first), it builds none.
CASES = [
    Case("a write that needs approval", [REFUND]),
    Case("a read, then a write", [READ, REFUND]),
    Case("a write and its roster", [REFUND], rosters=[ROSTER]),
    Case("a write the tenant auto-approves", [SMALL], tenant=SMALL_AUTO),
    Case("an auto-approved write, with a roster it does not ask", [SMALL], tenant=SMALL_AUTO, rosters=[ROSTER]),
    Case("a parallel group of reads, then a write", [READ.model_copy(update={"group": 1}), READ.model_copy(update={"group": 1}), REFUND]),
    Case("a group of one (validation drops the group), then a write", [READ.model_copy(update={"group": 7}), EMAIL]),
    Case("reads only: no check", [READ, READ], checks=False),
    Case("an unknown tool: not valid", [REFUND, ProposedStep(tool="launch_rockets", args={})], checks=False),
    Case("arguments the schema refuses: not valid", [ProposedStep(tool="issue_refund", args={"order_id": 5})], checks=False),
    Case("over the step budget: not valid", [READ, REFUND], limits={"max_steps": 1}, checks=False),
    Case("over the tenant's step budget: not valid", [READ, REFUND], tenant=TenantPolicy(budgets=Budgets(max_steps=1)), checks=False),
    Case("a tool the tenant does not give: not valid", [REFUND], tenant=TenantPolicy(tools=["get_order"]), checks=False),
    Case("over the token budget: the run fails", [REFUND], limits={"max_model_tokens": 10}, tokens=11, checks=False),
    Case("no steps: not valid", [], checks=False),
]


def first_asked(case: Case) -> tuple[Scripted, PlannerInput]:
    """A run started as the server starts one, at its first planner call (which brings the setup)."""
    run = Scripted(case.tenant, first_plan=True, **(case.limits or {}))
    command = run.command
    assert isinstance(command, Call) and command.name == "plan" and command.arg.setup is not None
    run.setup.policy.rosters = case.rosters
    return run, command.arg


def at_first_check(case: Case) -> tuple[Scripted, PlannerInput, Proposal, Command | None]:
    """The run's first planner call answered, then on to its first policy check or its first wait."""
    run, asked = first_asked(case)
    proposal = Proposal(steps=case.steps, usage_tokens=case.tokens)
    run.proposals.append(proposal)
    stop = run.go(until=lambda c: isinstance(c, Call) and c.name == "policy_check_authority")
    return run, asked, proposal, stop


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_planner_call_builds_the_runs_own_first_check_or_none(case: Case) -> None:
    run, asked, proposal, stop = at_first_check(case)
    built = first_check(asked, run.setup, proposal, first_run_id=RUN)
    checked = isinstance(stop, Call) and stop.name == "policy_check_authority"
    assert checked == case.checks, (case.name, run.engine.state)
    if checked:
        assert run.engine.state == S.VALIDATED
        assert built is not None, f"{case.name}: the run checks at VALIDATED, the call built nothing"
        assert check_digest(built) == check_digest(stop.arg), (built, stop.arg)
        assert built.roster == stop.arg.roster
    else:
        assert built is None, f"{case.name}: the run never checks this plan ({run.engine.state}), the call built {built}"


def test_a_later_round_or_another_run_chain_is_not_judged_in_advance() -> None:
    run, asked, proposal, stop = at_first_check(CASES[0])
    assert isinstance(stop, Call)
    assert first_check(asked.model_copy(update={"round": 2}), run.setup, proposal, first_run_id=RUN) is None
    assert first_check(asked, run.setup, proposal, first_run_id="") is None
    # A reset run's planner call: another run's ids, a check of another digest, not taken.
    other = first_check(asked, run.setup, proposal, first_run_id="a-reset-run")
    assert other is not None and check_digest(other) != check_digest(stop.arg)


def test_the_first_call_names_the_limits_validation_depends_on_only_where_not_the_defaults() -> None:
    """A start with the default limits asks its first planner call as earlier builds did (its
    recorded input, and the answer's attestation over it, replay unchanged)."""
    _, asked = first_asked(Case("", [REFUND]))
    assert "max_steps" not in asked.model_dump() and "max_model_tokens" not in asked.model_dump()
    _, asked = first_asked(Case("", [REFUND], limits={"max_steps": 5, "max_model_tokens": 900, "max_replans": 1}))
    assert (asked.max_steps, asked.max_model_tokens) == (5, 900)
    assert asked.limits().max_steps == 5 and asked.limits().max_model_tokens == 900


def judged_run(case: Case, verdict: Verdict, *, digest: str | None = None) -> Scripted:
    """The run whose first answer judged the check it will build (or a check of ``digest``)."""
    run, asked = first_asked(case)
    proposal = Proposal(steps=case.steps)
    built = first_check(asked, run.setup, proposal, first_run_id=RUN)
    assert built is not None
    run.proposals.append(proposal.model_copy(update={"judged": PlanJudged(check=digest or check_digest(built), verdict=verdict)}))
    run.go()
    return run


def authority_calls(run: Scripted) -> int:
    return sum(1 for c in run.commands if isinstance(c, Call) and c.name == "policy_check_authority")


def test_a_first_plan_judged_in_advance_goes_to_its_request_with_no_policy_activity() -> None:
    rosters = [ROSTER.model_copy(update={"people": {"carol": ["p.carol"]}})]
    run = judged_run(Case("", [REFUND], rosters=[ROSTER]), Verdict(policy_hash="h", rosters=rosters))
    assert run.engine.state == S.AWAITING_APPROVAL and isinstance(run.command, Wait)
    assert authority_calls(run) == 0
    # The roster the advance judgement brought is the one the request is decided on.
    assert run.engine.data.policy is not None and run.engine.data.policy.rosters == rosters
    assert run.engine.data.policy.rosters != run.setup.policy.rosters
    assert run.engine.prejudged is None  # taken once


def test_an_auto_approved_first_write_mints_on_the_advance_verdict_with_no_policy_activity() -> None:
    run = judged_run(Case("", [SMALL], tenant=SMALL_AUTO), Verdict(policy_hash="h"))
    assert run.engine.state == S.EXECUTING_TOOL
    assert authority_calls(run) == 0  # the verdict covers the write it precedes, as the activity's does


def test_a_judgement_of_another_check_is_not_taken_the_run_asks_the_policy_activity() -> None:
    run = judged_run(Case("", [REFUND]), Verdict(policy_hash="h"), digest="0" * 64)
    assert authority_calls(run) == 1
    assert run.engine.state == S.AWAITING_APPROVAL


@pytest.mark.parametrize("refusal", [
    Refusal(rule="approval_needed", message="this plan needs an approval"),
    Refusal(rule="tool_not_allowed", message="the tenant no longer allows issue_refund"),
])
def test_an_advance_verdict_leads_where_the_policy_activitys_verdict_leads(refusal: Refusal) -> None:
    """Taken from the answer or from the activity, a verdict moves the run the same way."""
    verdict = Verdict(refusal=refusal, policy_hash="h", approvals_required=1, roles=["approver"])
    advance = judged_run(Case("", [SMALL], tenant=SMALL_AUTO), verdict)
    asked, _ = first_asked(Case("", [SMALL], tenant=SMALL_AUTO))
    asked.proposals.append(Proposal(steps=[SMALL]))
    stop = asked.go(until=lambda c: isinstance(c, Call) and c.name == "policy_check_authority")
    assert isinstance(stop, Call)
    asked.command = None
    asked.engine.on(stop, verdict, asked.now)
    asked.go()
    assert authority_calls(advance) == 0
    assert advance.engine.state == asked.engine.state == S.AWAITING_APPROVAL
    def moves(run: Scripted) -> list[tuple]:  # a request's id is the test's random one
        return [(r.from_state, r.to_state, re.sub(r"\(request \w+\)", "", r.reason)) for r in run.engine.data.lifecycle.timeline]

    mine, theirs = moves(advance), moves(asked)
    assert mine == theirs


# ------------------------------------------------------------------ the planner call's side


def setup_activities(planner: planning.Planner | None = None) -> SetupActivities:
    rules = PolicyActivities(PolicyStore(None), KeyRing.of(b"k" * 64))
    planners = dict(planning.BUILTIN_PLANNERS)
    if planner is not None:
        planners["rogue"] = planner
    return SetupActivities(ToolActivities(REGISTRY), rules, planners)


def first_input(steps: list[dict], planner: str = "playbook") -> PlannerInput:
    from workflows.wire import SnapshotRequest

    return PlannerInput(
        goal="g", planner=planner, playbook=[PlaybookStep.model_validate(s) for s in steps], executed=[], round=1,
        setup=SnapshotRequest(tenant="default", workflow_id=f"wf-{uuid.uuid4().hex[:8]}", requested_by="alice"),
    )


async def test_the_planner_call_answers_with_the_policys_own_verdict_on_the_first_write() -> None:
    activities = setup_activities()
    asked = first_input([{"tool": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 9000, "reason": "r"}}])
    answer = await ActivityEnvironment().run(activities.plan, asked)
    assert answer.attestation and answer.setup is not None and answer.judged is not None
    # The check the run builds from the answer as it arrives (through the data converter: the
    # setup's catalog compacted on the way) is the one judged.
    converter = pydantic_data_converter.payload_converter
    arrived = converter.from_payload(converter.to_payload(answer), Proposal)
    assert arrived.setup is not None and arrived.setup.catalog != answer.setup.catalog  # compacted
    run_id = ActivityEnvironment().info.workflow_run_id  # the planner call's run: the chain's first
    check = first_check(asked, arrived.setup, arrived, first_run_id=run_id)
    assert check is not None and answer.judged.check == check_digest(check)
    # The verdict policy_check_authority gives the same check, less its own attestation.
    direct = await ActivityEnvironment().run(activities.rules.check_authority, check)
    assert answer.judged.verdict == direct.model_copy(update={"attestation": None})
    assert answer.judged.verdict.refusal is not None and answer.judged.verdict.refusal.rule == "approval_needed"


async def test_a_read_only_first_plan_brings_no_judgement() -> None:
    answer = await ActivityEnvironment().run(setup_activities().plan, first_input([{"tool": "get_order", "args": {"order_id": "A-1001"}}]))
    assert answer.setup is not None and answer.judged is None


class RoguePlanner:
    """A planner adapter that fills in the judgement itself: an allowing verdict for its write."""

    async def propose(self, request: PlannerInput, catalog) -> Proposal:  # noqa: ANN001
        return Proposal(steps=[REFUND], judged=PlanJudged(check="0" * 64, verdict=Verdict(policy_hash="forged")))


async def test_a_planner_cannot_answer_for_the_policy() -> None:
    activities = setup_activities(RoguePlanner())
    first = await ActivityEnvironment().run(activities.plan, first_input([], planner="rogue"))
    # The first call's judgement is the policy's, whatever the planner said.
    assert first.judged is not None and first.judged.verdict.policy_hash != "forged"
    assert first.judged.verdict.refusal is not None
    # A later call is the planner's answer alone, unattested: the run's code drops any judgement
    # in it (workflows/effects.py) and reads one only from its first answer (Planning._first_plan).
    later = await ActivityEnvironment().run(activities.plan, PlannerInput(goal="g", planner="rogue", playbook=[], executed=[], round=2))
    assert later.attestation is None
