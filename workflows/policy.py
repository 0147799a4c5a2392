"""Pure policy decisions: does a plan need approval, may this decision count, is budget left.

No Temporal, no I/O: the workflow calls these with the facts it holds, tests call them directly.
Each refusal is a short reason a person can act on; ``None`` means allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any
from datetime import datetime, timezone

from workflows.contract import (
    AcceptedApproval,
    ApprovalDecision,
    Limits,
    Plan,
    PlanStep,
    ToolCatalog,
    ToolEffect,
    ToolInfo,
    canonical_json,
)
from workflows.policy_file import AmountRule, TenantPolicy
from workflows.wire import ApproverRoster, PlanReview, Refusal
from workflows.run_state import PendingApproval, RunData
from workflows.budgets import UPDATES_CONTINUE_AT, clip
from workflows import wording
from workflows.display import escape_text, show_value
from workflows.identity import same_person
from workflows.contract import DELEGATE, Compensation, CompensationCall, Delegation, PlaybookStep
from workflows.wire import ToolCall
from workflows.states import RunState

SUMMARY_CHARS = 2000  # the risk summary an approver reads (and the Web UI shows)


def decision_refusal(
    decision: ApprovalDecision, data: RunData, *, now: datetime, check_duplicate: bool = True, kind: str = "approve"
) -> Refusal | None:
    """Why an approve/reject decision cannot count in the run's current state, or None.

    Who may decide is :func:`approver_refusal`'s question, asked by the policy activity.
    """
    pending = data.pending_approval
    if check_duplicate and (refusal := repeated_decision_refusal(decision.decision_id, data)):
        return refusal
    state = data.lifecycle.state
    if state != RunState.AWAITING_APPROVAL or pending is None:
        return Refusal(rule="not_awaiting_approval", message=f"run is {state.value}, not AWAITING_APPROVAL")
    if decision.plan_hash != pending.plan_hash:
        return Refusal(
            rule="stale_plan_hash",
            # Never the pending hash: a hash to paste invites approving a plan not reviewed.
            message=f"plan hash {decision.plan_hash[:12]} does not match the plan under review: "
            "read the plan with `tether status RUN` (or the inbox) and decide on what it shows",
        )
    if pending.request_id and decision.request_id != pending.request_id:
        # Bound to one request, not only to a plan hash: the same plan proposed again later is
        # a new request, and a decision prepared for the earlier one must not approve it.
        return Refusal(
            rule="stale_request",
            message=f"decision for approval request {(decision.request_id or 'none')[:36]}: the "
            f"pending request is {pending.request_id}",
        )
    if now >= pending.expires_at:
        return Refusal(rule="approval_expired", message=f"approval expired at {pending.expires_at.isoformat()}")
    if decision.steps is not None and kind != "approve":
        return Refusal(rule="invalid_steps", message=f"steps name what an approval approves: not for a {kind}")
    if decision.steps is not None and data.plan is not None:
        size = len(data.plan.steps)
        beyond = sorted(n for n in decision.steps if n > size)
        if beyond:
            return Refusal(
                rule="invalid_steps",
                message=f"step(s) {', '.join(map(str, beyond[:10]))} named: the pending plan has {size} step(s)",
            )
    return None


def partial_steps(decision: ApprovalDecision, plan: Plan) -> list[int] | None:
    """The 1-based steps a partial approval keeps, in plan order; None: it approves them all."""
    if decision.steps is None:
        return None
    kept = sorted(set(decision.steps))
    return None if kept == list(range(1, len(plan.steps) + 1)) else kept


def repeated_decision_refusal(
    decision_id: str, data: RunData, *, in_flight: Collection[str] = ()
) -> Refusal | None:
    """A decision id the run has handled (or is deciding, ``in_flight``): it cannot count again."""
    pending = data.pending_approval
    if (
        decision_id in data.decisions_seen
        or decision_id in in_flight
        or (pending is not None and any(a.decision_id == decision_id for a in pending.approvals))
    ):
        return Refusal(rule="duplicate_decision", message=f"duplicate decision_id {decision_id[:64]}: already handled")
    return None


def updates_refusal(updates: int) -> Refusal | None:
    """A decide Update past the ones an execution takes (it continues as new first: Temporal
    takes 2,000 Updates a run): refused before history, to be sent again to the continued run.
    Without it a flood that never pauses keeps an Update in flight, and the run never gets to
    continue before Temporal's limit."""
    if updates >= UPDATES_CONTINUE_AT:
        return Refusal(
            rule="continuing_as_new",
            message=f"this run has taken {updates} decide Updates and continues as new first: send it again",
        )
    return None


def budget_refusal(executed_steps: int, proposed_steps: int, limits: Limits) -> str | None:
    """The step budget: tool calls already made plus the ones proposed."""
    if executed_steps + proposed_steps > limits.max_steps:
        left = max(limits.max_steps - executed_steps, 0)
        return (
            f"step budget exhausted: {proposed_steps} step(s) proposed, {left} of "
            f"max_steps={limits.max_steps} left"
        )
    return None


def may_replan(replans_used: int, limits: Limits) -> bool:
    return replans_used < limits.max_replans


# ----------------------------------------------------------------------------- the policy file
#
# The organisation's rules, per tenant: who approves, which tools, what is auto-approved, what
# counts as high risk, approval TTLs and budgets. The file is read by an activity
# (tether/policy/files.py); these models and the decisions below are pure.


# No policy file: every write needs one approval from someone other than the requester.
DEFAULT_TENANT_POLICY = TenantPolicy()


def effective_limits(limits: Limits, tenant: TenantPolicy | None) -> Limits:
    """The stricter of the run's own limits and the tenant's budgets."""
    if tenant is None:
        return limits
    b = tenant.budgets
    return limits.model_copy(
        update={
            "max_steps": min(limits.max_steps, b.max_steps or limits.max_steps),
            "max_replans": min(limits.max_replans, b.max_replans if b.max_replans is not None else limits.max_replans),
        }
    )


# How deep delegation goes when the policy sets no max_depth (2: children and grandchildren).
DEFAULT_DEPTH = 2


def may_delegate(depth: int, max_depth: int | None) -> bool:
    """May a run at ``depth`` start a child, under the tenant's ``max_depth`` (None: not set)?"""
    return depth + 1 <= (DEFAULT_DEPTH if max_depth is None else max_depth)


def tool_refusal(tenant: TenantPolicy | None, tool: str) -> str | None:
    # A child run (DELEGATE): its tools are judged as its grant is made (max_depth, the tenant's tools).
    if tool != DELEGATE and tenant is not None and tenant.tools is not None and tool not in tenant.tools:
        return f"tool {tool!r} is not allowed for this tenant"
    return None


def spend(spent: dict[str, float], tool: str, args: dict[str, Any]) -> None:
    """Add a step that may have applied to the run's sums (per "tool.field", numeric fields)."""
    for field, value in args.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            key = f"{tool}.{field}"
            spent[key] = spent.get(key, 0) + value


def _totals(steps: list[PlanStep], spent: dict[str, float]) -> dict[str, float]:
    """What the run will have done per "tool.field" once these steps have run too."""
    totals = dict(spent)
    for step in steps:
        spend(totals, step.tool, step.args)
    return totals


def _rule_holds(rule: AmountRule, tool: str, totals: dict[str, float]) -> bool:
    """An amount rule judged on the run's sum for the field, never one call's share of it:
    four refunds of 49.99 are one refund of 199.96 as far as the limits go."""
    if tool != rule.tool:
        return False
    if rule.field is None:
        return True
    key = f"{tool}.{rule.field}"
    if key not in totals:
        return False
    return rule.matches(tool, {rule.field: totals[key]})


def _step_needs_approval(step: PlanStep | PlaybookStep, info: ToolInfo | None, tenant: TenantPolicy, totals: dict[str, float]) -> bool:
    if info is None:
        return True
    if not info.requires_approval:
        # The default rule: tools that do not write (and do not ask) run without approval,
        # unless the tenant turned read-only auto-approval off.
        return info.effect != ToolEffect.READ_ONLY or not tenant.auto_approve.read_only
    return not any(_rule_holds(rule, step.tool, totals) for rule in tenant.auto_approve.limits)


def _describe_step(tool: str, args: dict[str, Any], info: ToolInfo | None, undo: Compensation | None | bool = False) -> str:
    """One write for the approver, in plain words (workflows/wording.py): what it does to the
    world, and its declared summary fields, money as amount and currency beside the raw value.
    ``undo``: its compensation as the plan hash covers it (None: no recovery path)."""
    # Values escaped and quoted (display.show_value): a value cannot end its own field and pass
    # off what follows as another one, or move the approver's cursor.
    schema = info.args_schema if info else None
    fields = [
        f"{k}={wording.arg_words(k, args[k], schema, args) or show_value(args[k], 200)}"
        for k in (info.summary_fields if info else []) if k in args
    ]
    return f"{tool} ({wording.effect_words(info, undo)}{'; ' + ', '.join(fields) if fields else ''})"


def _destructive(info: ToolInfo | None) -> bool:
    return info is None or info.destructive  # an unknown tool is assumed the worst


def named_steps(playbook: list[PlaybookStep], *, nested: bool = False) -> list[PlaybookStep]:
    """The tool steps a playbook names, its groups' too (in order); ``nested``: its delegations'
    as well (a grandchild asks its own approval: the parent's covers no write of it)."""
    steps: list[PlaybookStep] = []
    for step in playbook:
        if step.parallel is not None:
            steps.extend(named_steps(step.parallel, nested=nested))
        elif step.delegate is not None:
            if nested:
                steps.extend(named_steps(step.delegate.playbook or [], nested=nested))
        elif step.tool:
            steps.append(step)
    return steps


def _writes(info: ToolInfo | None) -> bool:
    return info is None or info.effect != ToolEffect.READ_ONLY


def delegated(args: dict[str, Any], catalog: ToolCatalog) -> tuple[list[PlaybookStep], list[str]]:
    """What a delegate step hands on that writes: the writes its playbook names (its groups' and
    its delegations' too), and the tools of its grant that write."""
    try:
        delegation = Delegation.model_validate(args)
    except ValueError:
        return [], ["?"]  # not a delegation (validation says so): judged as the worst
    named = [s for s in named_steps(delegation.playbook or []) if _writes(catalog.get(s.tool))]
    return named, [t for t in delegation.tools if _writes(catalog.get(t))]


def _describe_delegation(args: dict[str, Any], catalog: ToolCatalog, named: list[PlaybookStep], tools: list[str]) -> str:
    """A delegate step for the approver: the child's grant, and the writes it will make under this
    approval (each as any write: its summary fields, money in words, its undo)."""
    grant = ", ".join(escape_text(t, 64) for t in tools)
    if named:
        what = "; ".join(_describe_step(s.tool, s.args, catalog.get(s.tool)) for s in named)
        return f"{DELEGATE} (a child run that may write with {grant}; under this approval it writes: {what})"
    return f"{DELEGATE} (a child run that may write with {grant}; it names no writes: each asks its own approval)"


def review_plan(
    plan: Plan, catalog: ToolCatalog, tenant: TenantPolicy | None, spent: dict[str, float] | None = None
) -> PlanReview:
    """What policy says about ``plan``, given what the run has already done (``spent``). A
    delegation is judged by what it hands on: the writes its playbook names are the plan's (its
    sums, its approvals), and one whose grant can write naming none is a write itself."""
    tenant = tenant or DEFAULT_TENANT_POLICY
    handed = {i: delegated(s.args, catalog) for i, s in enumerate(plan.steps) if s.tool == DELEGATE}
    named = [w for ws, _ in handed.values() for w in ws]
    totals = _totals(plan.steps, spent or {})
    for w in named:
        spend(totals, w.tool, w.args)
    blind = [i for i, (ws, tools) in handed.items() if tools and not ws]  # may write, names nothing
    gated: list[PlanStep | PlaybookStep] = [
        s for s in plan.steps if s.tool != DELEGATE and _step_needs_approval(s, catalog.get(s.tool), tenant, totals)
    ]
    gated += [w for w in named if _step_needs_approval(w, catalog.get(w.tool), tenant, totals)]
    gated += [plan.steps[i] for i in blind]
    actions = [(s.tool, catalog.get(s.tool)) for s in plan.steps if s.tool != DELEGATE] + [(w.tool, catalog.get(w.tool)) for w in named]
    high_risk = tenant.high_risk
    high = high_risk is not None and (
        any(_rule_holds(rule, tool, totals) for tool, _ in actions for rule in high_risk.when)
        or (high_risk.destructive and any(_destructive(info) for _, info in actions))
    )
    writes = [
        _describe_delegation(s.args, catalog, *handed[i]) if i in handed else
        _describe_step(s.tool, s.args, catalog.get(s.tool), plan.undo[i] if plan.undo is not None else False)
        for i, s in enumerate(plan.steps)
        if (handed[i][1] if i in handed else _writes(catalog.get(s.tool)))
    ]
    summary = (
        f"{len(writes)} of {len(plan.steps)} step(s) write: " + "; ".join(writes)
        if writes
        else f"{len(plan.steps)} step(s), all read-only"
    )
    summary = clip(summary, SUMMARY_CHARS)
    if not gated and not high:
        return PlanReview(needs_approval=False, risk="none", approvals_required=0, roles=[], summary=summary)
    if high and high_risk is not None:
        return PlanReview(
            needs_approval=True,
            risk="high",
            approvals_required=high_risk.approvals,
            roles=high_risk.roles,
            summary=f"HIGH RISK, {high_risk.approvals} approvals needed — {summary}",
            ttl_seconds=tenant.approval_ttl_seconds.high,
            escalation=tenant.escalation.high,
        )
    return PlanReview(
        needs_approval=True,
        risk="normal",
        approvals_required=1,
        roles=tenant.approval_roles,
        summary=summary,
        ttl_seconds=tenant.approval_ttl_seconds.normal,
        escalation=tenant.escalation.normal,
    )


# ----------------------------------------------------------------------------- recovery

# Runs `tether compensate` may undo: they ended with ok writes a person has to deal with.
# A cancelled run too: a cancel during COMPENSATING ends CANCELLED naming what is left, and
# `tether compensate` continues from there (docs/operations.md, "Recovery").
COMPENSABLE_STATES = frozenset({RunState.HANDED_OFF, RunState.EXECUTION_FAILED, RunState.CANCELLED})


def recovery_refusal(
    plan: Plan, catalog: ToolCatalog, tenant: TenantPolicy | None, spent: dict[str, float] | None = None
) -> Refusal | None:
    """``require_recovery``: at the tenant's listed risk levels, every write of the plan must
    have a recovery path; a plan with one that has none is refused at validation."""
    if tenant is None or not tenant.require_recovery or plan.undo is None:
        return None
    review = review_plan(plan, catalog, tenant, spent)
    level = "high" if review.risk == "high" else "normal"
    if level not in tenant.require_recovery:
        return None
    for i, (step, undo) in enumerate(zip(plan.steps, plan.undo, strict=True), start=1):
        info = catalog.get(step.tool)
        if undo is None and (info is None or info.effect != ToolEffect.READ_ONLY):
            return Refusal(
                rule="recovery_required",
                message=f"step {i} ({step.tool}) writes and has no recovery path; this tenant requires "
                f"one for every write of a {level}-risk plan (require_recovery)",
            )
    return None


def compensator_refusal(tenant: TenantPolicy | None, by: str) -> Refusal | None:
    """May this person start the compensations of a run (``tether compensate``)? Anyone with an
    approval role of the tenant (the normal or the high-risk roles): an undo is a write."""
    if tenant is None:
        return Refusal(rule="tenant", message="the run's tenant is not in the policy file")
    if tenant.approvers is None:
        return None
    member = tenant.approvers.get(by)
    if member is None:
        return Refusal(rule="tenant_membership", message=f"{by} is not an approver of this tenant")
    roles = set(tenant.approval_roles) | set(tenant.high_risk.roles if tenant.high_risk else [])
    if not set(member.roles) & roles:
        return Refusal(rule="role", message=f"{by} has roles {sorted(member.roles)}; compensating needs one of {sorted(roles)}")
    return None


def undo_refusal(
    tenant: TenantPolicy | None, *, undo: CompensationCall, compensator: str = "", call: ToolCall | None = None
) -> Refusal | None:
    """The re-check before an undo's attempt (the one that mints its capability), under the
    current file. Its authority is the approval (or auto-approval) of the plan hash that covered
    the undo when its write ran: that hash must be there, the tenant still exist and the undo
    tool still be the tenant's to use. The approvers are not judged again: an undo puts back
    what their approval did, and a revoked approver must not leave the write in place. A
    compensation run (``tether compensate``) adds ``compensator``, the person who asked for it,
    judged now (approval role, membership)."""
    if tenant is None:
        return Refusal(rule="tenant", message="the run's tenant was removed from the policy file")
    if undo.tool is None:
        return Refusal(rule="no_recovery_path", message=f"{undo.of} ({undo.of_tool}) has no recovery path")
    if not undo.plan_hash:
        return Refusal(rule="not_approved", message=f"the compensation of {undo.of} is covered by no plan hash")
    if call is not None and (call.tool_call_id, call.tool, call.args, call.idempotency_key) != (
        undo.tool_call_id, undo.tool, undo.args, undo.idempotency_key
    ):
        return Refusal(rule="capability_invalid", message=f"the call is not the compensation of {undo.of} its plan covered")
    if (why := tool_refusal(tenant, undo.tool)) is not None:
        return Refusal(rule="tool_withdrawn", message=why)
    if compensator:
        return compensator_refusal(tenant, compensator)
    return None


def approver_refusal(
    tenant: TenantPolicy | None,
    *,
    approver: str,
    requested_by: str,
    kind: str,
    roles: list[str],
    already_approved: list[str],
    editors: list[str] | tuple[str, ...] = (),
) -> Refusal | None:
    """May this person decide on this run's pending plan, under this tenant's policy?

    ``kind`` is approve, reject or revise; who may revise a plan is who may approve it, less
    four-eyes (the requester may correct her own run; she may still not approve it).
    ``editors``: who revised the pending plan.
    """
    if tenant is None:
        return Refusal(rule="tenant", message="the run's tenant is not in the policy file")
    # Four-eyes first: whatever roles the requester holds, she does not approve her own run.
    # Compared by skeleton (UTS #39): a name that looks like the requester's is the requester.
    if kind == "approve" and tenant.four_eyes and same_person(approver, requested_by):
        if approver == requested_by:
            return Refusal(rule="four_eyes", message=f"{approver} requested this run and may not approve it")
        return Refusal(
            rule="four_eyes",
            message=f"{approver} looks like {requested_by}, who requested this run, and may not approve it",
        )
    if kind == "approve" and not tenant.editor_may_approve and any(same_person(approver, e) for e in editors):
        return Refusal(
            rule="editor_approval",
            message=f"{approver} revised this plan and may not approve it (editor_may_approve = false)",
        )
    if tenant.approvers is not None:
        member = tenant.approvers.get(approver)
        if member is None:
            return Refusal(
                rule="tenant_membership", message=f"{approver} is not an approver of this tenant"
            )
        if not set(member.roles) & set(roles):
            return Refusal(
                rule="role",
                message=f"{approver} has roles {sorted(member.roles)}; this plan needs one of "
                f"{sorted(roles)}",
            )
    if kind == "approve" and (twin := next((a for a in already_approved if same_person(approver, a)), None)):
        who = approver if twin == approver else f"{approver} looks like {twin}, who"
        return Refusal(
            rule="distinct_approvers", message=f"{who} already approved: a different approver is needed"
        )
    return None


def handoff_member_refusal(tenant: TenantPolicy | None, by: str) -> Refusal | None:
    if tenant is not None and tenant.approvers is not None and by not in tenant.approvers:
        return Refusal(rule="tenant_membership", message=f"{by} is not a member of this tenant")
    return None


def authority_refusal(
    tenant: TenantPolicy | None,
    *,
    approvals: list[str],
    tools: list[str],
    roles: list[str],
    approvals_required: int,
    steps: list[PlanStep] | None = None,
    catalog: ToolCatalog | None = None,
    spent: dict[str, float] | None = None,
    approved: list[AcceptedApproval] | None = None,
    requested_by: str = "",
    signature_problem: Callable[[AcceptedApproval], Refusal | None] | None = None,
    escalated_roles: Collection[str] = (),
    approver_problem: Callable[[str, list[str], list[str], str], Refusal | None] | None = None,
) -> Refusal | None:
    """Do the approvals a plan got still hold, under the current policy, for these tools?

    For a plan that ran without approval (``approvals_required`` 0), ``steps`` are reviewed
    again: a policy that now wants an approval for them stops the write. For an approved plan
    each approval in force (``approved``) is judged again in full under the current file: the
    roles and number of approvals it asks for the remaining ``steps`` now, membership,
    four-eyes, and the signature rule (``signature_problem``: the activity's check of the
    approval's kept signature; an unsigned approval fails it once signatures are required).
    ``approver_problem(approver, roles, already_approved, risk)``: who judges each approval
    (the policy activity's Cedar); by default :func:`approver_refusal`.
    """
    if tenant is None:
        return Refusal(rule="tenant", message="the run's tenant was removed from the policy file")
    for tool in tools:
        if (why := tool_refusal(tenant, tool)) is not None:
            return Refusal(rule="tool_withdrawn", message=why)
    if approvals_required == 0 and steps:
        review = review_plan(Plan(steps=steps, plan_hash=""), catalog or ToolCatalog(), tenant, spent)
        if review.needs_approval:
            return Refusal(
                rule="approval_needed",
                message=f"under the current policy the remaining steps need approval ({review.summary})",
            )
        return None
    if approved and steps:
        review = review_plan(Plan(steps=steps, plan_hash=""), catalog or ToolCatalog(), tenant, spent)
        if not review.needs_approval:
            return None
        valid: list[str] = []
        lost: list[str] = []
        roles = [*review.roles, *(r for r in escalated_roles if r not in review.roles)]
        for a in approved:
            if approver_problem is not None:
                refused = approver_problem(a.approver, roles, list(valid), review.risk)
            else:
                refused = approver_refusal(
                    tenant, approver=a.approver, requested_by=requested_by, kind="approve", roles=roles,
                    already_approved=valid,
                )
            if refused is None and signature_problem is not None:
                refused = signature_problem(a)
            if refused is None:
                valid.append(a.approver)
            else:
                lost.append(f"{a.approver} ({refused.rule}: {refused.message})")
        if len(valid) < review.approvals_required:
            return Refusal(
                rule="approver_revoked",
                message=clip(
                    f"under the current policy {len(valid)} of {review.approvals_required} approval(s) hold; "
                    f"no longer holds: {'; '.join(lost) or 'none'}",
                    600,
                ),
            )
        return None
    if tenant.approvers is not None:
        valid = [
            a for a in approvals
            if a in tenant.approvers and set(tenant.approvers[a].roles) & set(roles)
        ]
        lost = [a for a in approvals if a not in valid]
        if lost and len(valid) < approvals_required:
            return Refusal(
                rule="approver_revoked",
                message=f"approval by {', '.join(lost)} no longer holds under the current policy",
            )
    return None


def request_terms(review: PlanReview, tenant: TenantPolicy | None) -> tuple[int, list[str]]:
    """What an approval request asks for: at least one approval, from roles someone can hold
    (the review's, else the tenant's approval roles): never a request nobody could satisfy."""
    roles = list(review.roles) or list((tenant or DEFAULT_TENANT_POLICY).approval_roles) or ["approver"]
    return max(review.approvals_required, 1), roles


def signature_payload(
    *,
    workflow_id: str,
    first_run_id: str,
    tenant: str,
    request_id: str,
    plan_hash: str,
    kind: str,
    decision_id: str,
    signer: str,
    steps: list[int] | None = None,
    steps_digest: str | None = None,
    attested_by: str | None = None,
) -> bytes:
    """What a person signs for a decision: the run (its id and the first run's id, so a later
    run under the same id is another run), the tenant, the approval request and its exact plan,
    the kind of decision, its id and who decides. Handoffs sign with empty request and plan.
    A partial approval adds the ``steps`` it approves; a revision the sha256 of its revised
    steps (``steps_digest``): neither key is there otherwise, so other signatures are unchanged.
    A trusted signer attesting for the person (the inbox) signs the same plus its own name."""
    fields: dict[str, object] = {
        "workflow_id": workflow_id,
        "first_run_id": first_run_id,
        "tenant": tenant,
        "request_id": request_id,
        "plan_hash": plan_hash,
        "decision": kind,
        "decision_id": decision_id,
        "signer": signer,
    }
    if steps is not None:
        fields["steps"] = sorted(set(steps))
    if steps_digest is not None:
        fields["steps_digest"] = steps_digest
    if attested_by is not None:
        fields["attested_by"] = attested_by
    return canonical_json(fields).encode()


def decision_signature_payload(
    *,
    workflow_id: str,
    first_run_id: str,
    tenant: str,
    kind: str,
    decision: ApprovalDecision,
    steps_digest: str | None = None,
) -> bytes:
    """What the approver (or editor) of ``decision`` signs (and the policy activity verifies)."""
    return signature_payload(
        workflow_id=workflow_id,
        first_run_id=first_run_id,
        tenant=tenant,
        request_id=decision.request_id or "",
        plan_hash=decision.plan_hash,
        kind=kind,
        decision_id=decision.decision_id,
        signer=decision.approver,  # normalised, as the run compares it
        steps=decision.steps,
        steps_digest=steps_digest,
        attested_by=decision.attested_by,
    )


def start_signature_payload(
    *,
    workflow_id: str,
    tenant: str,
    requested_by: str,
    request_digest: str,
    nonce: str | None = None,
    issued_at: datetime | None = None,
) -> bytes:
    """What a requester signs to start a run: its id, tenant, name and what it asks for, and
    (since issue 18) a nonce and when it was issued, so a captured start goes stale."""
    body = {
        "workflow_id": workflow_id,
        "tenant": tenant,
        "decision": "start",
        "requested_by": requested_by,
        "request_digest": request_digest,
    }
    if nonce is not None or issued_at is not None:
        when = _utc(issued_at).strftime("%Y-%m-%dT%H:%M:%S.%fZ") if issued_at else ""
        body.update({"nonce": nonce or "", "issued_at": when})
    return canonical_json(body).encode()


def _utc(moment: datetime) -> datetime:
    """A naive time is taken as UTC (never the machine's zone)."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


# How long a signed start stays good (policy ``start_signature_ttl``), and the clock skew allowed
# for one issued "in the future".
DEFAULT_START_SIGNATURE_TTL = 600.0
START_CLOCK_SKEW = 60.0


def start_freshness_refusal(issued_at: datetime | None, started_at: datetime | None, ttl: float) -> Refusal | None:
    """A signed start must say when it was issued, no longer than ``ttl`` before the run began."""
    if issued_at is None:
        return Refusal(rule="signature_stale", message="a signed start must carry issued_at and a nonce (tether start --key)")
    if started_at is None:
        return None
    age = (_utc(started_at) - _utc(issued_at)).total_seconds()
    if age > ttl:
        return Refusal(
            rule="signature_stale",
            message=f"the start was signed {age:.0f}s before the run began, over the tenant's "
            f"start_signature_ttl of {ttl:g}s: sign it again",
        )
    if age < -START_CLOCK_SKEW:
        return Refusal(rule="signature_stale", message=f"the start claims to be issued {-age:.0f}s in the future")
    return None


def roster_policies(
    rosters: list[ApproverRoster], pending: PendingApproval, decision: ApprovalDecision, requested_by: str,
) -> list[str] | None:
    """The Cedar policies that permitted this approval on the run's roster (judged with its policy
    snapshot), or None: the roster does not decide it and the policy activity judges it. Only
    the one approval a request opened as it was asks for (none given yet, no escalation stage,
    nobody revised the plan), of the whole plan, unsigned: exactly what the roster was judged on."""
    if (decision.steps is not None or decision.signature or decision.attested_by or pending.approvals
            or pending.approvals_required != 1 or pending.stage or pending.editors or pending.revisers):
        return None
    roster = next((r for r in rosters if r.risk == pending.risk and r.roles == pending.roles), None)
    if roster is None:
        return None
    if decision.approver in roster.people:
        return roster.people[decision.approver]
    if roster.anyone is not None and not same_person(decision.approver, requested_by):
        return roster.anyone
    return None
