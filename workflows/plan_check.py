"""A plan's planning-time re-check as data: what the run asks the policy before a plan's writes
(``AuthorityCheck``), built from the plan and the run's setup alone.

The run builds it (workflows/steps.py), and so does the run's first planner call, which brings
the run's setup with the plan (activities/setup.py): that call has the check judged as the
planner answers, and the run takes the verdict for exactly the check it would send (its digest),
one activity less for every run whose first plan writes. Pure, so both build the same check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workflows import policy
from workflows.contract import DELEGATE, Limits, Plan, ToolCatalog, ToolEffect, derived_digest, json_digest, run_catalog
from workflows.policy_file import TenantPolicy
from workflows.validation import Validation, validate_proposal
from workflows.wire import AuthorityCheck, PlannerInput, Proposal, RunSetup


def tool_call_ids(first_run_id: str, basis: str) -> Callable[[int], str]:
    """Tool call ids (and so idempotency keys) from the run chain and the decision that made the
    plan: a reset or a replay makes the same ones, another run never does."""
    return lambda n: f"tc-{n:03d}-{derived_digest('tc', first_run_id, basis, str(n))[:12]}"


def proposal_basis(round: int, proposal: Proposal) -> str:
    """What a proposal's tool call ids derive from: its planning round and its own content."""
    return f"plan:{round}:{json_digest(proposal.model_dump(mode='json', exclude={'setup', 'attestation', 'judged'}))}"


def validated(
    proposal: Proposal,
    catalog: ToolCatalog,
    tenant: TenantPolicy | None,
    *,
    limits: Limits,
    spent: dict[str, float],
    executed_steps: int,
    new_id: Callable[[int], str],
    tool_refusal: Callable[[str], str | None],
    delegation_problem: Callable[[dict[str, Any]], str | None],
) -> Validation:
    """The one validation a plan gets, proposed or revised: the catalog snapshot, the tools'
    schemas, the tenant's tools and the step budget (with what the run already did), and the
    tenant's require_recovery (a write with no recovery path never reaches approval)."""
    result = validate_proposal(
        proposal, catalog, executed_steps=executed_steps, limits=limits, new_id=new_id,
        tool_refusal=tool_refusal, delegation_problem=delegation_problem,
    )
    if result.plan is not None:
        refusal = policy.recovery_refusal(result.plan, catalog, tenant, spent)
        if refusal is not None:
            result = Validation(plan=None, problems=[f"[{refusal.rule}] {refusal.message}"])
    return result


def writes(catalog: ToolCatalog, tool: str) -> bool:
    """Does a call of ``tool`` write (or is it a tool the catalog lacks)?"""
    info = catalog.get(tool)
    return info is None or info.effect != ToolEffect.READ_ONLY


def write_steps(plan: Plan, catalog: ToolCatalog) -> list[int]:
    """The indexes of the plan's steps that write."""
    return [i for i, s in enumerate(plan.steps) if writes(catalog, s.tool)]


def proposes_writes(proposal: Proposal, catalog: ToolCatalog) -> bool:
    return any(writes(catalog, s.tool) for s in proposal.steps)


def check_context(
    plan: Plan, writes: list[int], catalog: ToolCatalog, *, from_step: int, tenant: str, spent: dict[str, float],
    workflow_id: str, first_run_id: str, requested_by: str,
) -> dict[str, Any] | None:
    """The remaining steps, their catalog entries and what the run has done: what the current
    file judges a plan's remaining writes by (None: nothing left writes)."""
    remaining = plan.steps[from_step:]
    tools = [plan.steps[i].tool for i in writes if i >= from_step]
    if not tools:
        return None
    return dict(
        tenant=tenant,
        tools=tools,
        steps=remaining,
        # Each tool's entry once, in the order the steps first name it.
        catalog=ToolCatalog(tools=list({s.tool: i for s in remaining if (i := catalog.get(s.tool))}.values())),
        spent=spent,
        workflow_id=workflow_id,
        first_run_id=first_run_id,
        requested_by=requested_by,
        plan_hash=plan.plan_hash,
    )


def unapproved(context: dict[str, Any]) -> AuthorityCheck:
    """A plan's check with no approval in force: the current file must let its writes run alone,
    or say what a request asks for."""
    return AuthorityCheck(approvals=[], roles=[], approvals_required=0, **context)


def check_digest(check: AuthorityCheck) -> str:
    return json_digest(check.model_dump(mode="json"))


def first_check(request: PlannerInput, setup: RunSetup, proposal: Proposal, *, first_run_id: str) -> AuthorityCheck | None:
    """The check a run sends for its first plan at VALIDATED, built as the run builds it, where
    the run's own code would reach it with nothing but this answer: a plan that validates and
    writes, in a run with no grant. None otherwise (the run then checks through the activity).
    ``first_run_id``: the run chain's first run (the planner call's run: a reset run's is another,
    whose check the run does not take)."""
    asked, snapshot = request.setup, setup.policy
    tenant = snapshot.policy
    if asked is None or asked.grant is not None or not first_run_id:
        return None
    if tenant is None or snapshot.requester_refusal is not None or request.round != 1:
        return None
    limits = request.limits()
    max_tokens = limits.max_model_tokens
    if (max_tokens is not None and proposal.usage_tokens > max_tokens) or not proposal.steps:
        return None  # the run fails on its token budget, or ends with an answer
    if any(s.tool == DELEGATE for s in proposal.steps):
        return None  # a delegation's own checks need the run
    catalog = run_catalog(setup.catalog)
    if not proposes_writes(proposal, catalog):
        return None  # the common case, said before validating anything
    result = validated(
        proposal, catalog, tenant, limits=policy.effective_limits(limits, tenant), spent={}, executed_steps=0,
        new_id=tool_call_ids(first_run_id, proposal_basis(1, proposal)),
        tool_refusal=lambda tool: policy.tool_refusal(tenant, tool),
        delegation_problem=lambda args: "not judged in advance",
    )
    if result.plan is None:
        return None
    context = check_context(
        result.plan, write_steps(result.plan, catalog), catalog, from_step=0, tenant=asked.tenant, spent={},
        workflow_id=asked.workflow_id, first_run_id=first_run_id, requested_by=asked.requested_by,
    )
    if context is None:
        return None
    review = policy.review_plan(result.plan, catalog, tenant, {})
    return unapproved(context).model_copy(update={"roster": bool(snapshot.rosters) and review.needs_approval})
