"""Pure policy decisions: does a plan need approval, may this decision count, is budget left.

No Temporal, no I/O: the workflow calls these with the facts it holds, tests call them directly.
Each refusal is a short reason a person can act on; ``None`` means allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from workflows.models import (
    AmountRule,
    ApprovalDecision,
    Limits,
    Plan,
    PlanReview,
    PlanStep,
    Refusal,
    RunData,
    TenantPolicy,
    ToolCatalog,
    ToolEffect,
    ToolInfo,
    canonical_json,
)
from workflows.budgets import clip
from workflows.display import markdown_code
from workflows.models import Compensation
from workflows.states import EffectOutcome, RunState

SUMMARY_CHARS = 2000  # the risk summary an approver reads (and the Web UI shows)


def decision_refusal(
    decision: ApprovalDecision, data: RunData, *, now: datetime, check_duplicate: bool = True
) -> Refusal | None:
    """Why an approve/reject decision cannot count in the run's current state, or None.

    Who may decide is :func:`approver_refusal`'s question, asked by the policy activity.
    """
    pending = data.pending_approval
    if check_duplicate and (
        decision.decision_id in data.decisions_seen
        or (pending is not None and any(a.decision_id == decision.decision_id for a in pending.approvals))
    ):
        return Refusal(
            rule="duplicate_decision",
            message=f"duplicate decision_id {decision.decision_id[:64]}: already handled",
        )
    state = data.lifecycle.state
    if state != RunState.AWAITING_APPROVAL or pending is None:
        return Refusal(rule="not_awaiting_approval", message=f"run is {state.value}, not AWAITING_APPROVAL")
    if decision.plan_hash != pending.plan_hash:
        return Refusal(
            rule="stale_plan_hash",
            message=f"stale plan hash {decision.plan_hash[:12]}: the pending plan is {pending.plan_hash[:12]}",
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


# ----------------------------------------------------------------------------- tool failures

RETRY_BASE_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0


@dataclass(frozen=True)
class ToolTimeouts:
    """The clock of one tool attempt, all derived from the tool's declared timeout.

    The tool runs until ``run`` seconds after the attempt started (``ToolContext.deadline``).
    The activity waits for it ``grace / 2`` longer and then reports it as still running; the
    server gives the attempt ``run + grace`` (start_to_close) and declares its worker gone when
    no heartbeat came for ``heartbeat`` seconds.
    """

    run: float
    grace: float
    heartbeat: float

    @property
    def start_to_close(self) -> float:
        return self.run + self.grace


def tool_timeouts(timeout_seconds: float) -> ToolTimeouts:
    # Heartbeats go out every 0.8 x heartbeat (the SDK's throttle): at least 2 s, so a busy
    # machine does not miss one and a live attempt is not taken for a dead worker.
    return ToolTimeouts(
        run=timeout_seconds,
        grace=min(max(timeout_seconds * 0.5, 1.0), 30.0),
        heartbeat=min(max(timeout_seconds / 2, 2.0), 30.0),
    )


def failure_outcome(effect: ToolEffect, *, permanent: bool, started: bool = True) -> EffectOutcome:
    """What a failed attempt says about its effect: ``failed`` when it cannot have applied (a
    read, a call refused as permanent, a call that never started), else ``unknown``."""
    if effect == ToolEffect.READ_ONLY or permanent or not started:
        return "failed"
    return "unknown"


def after_tool_failure(
    effect: ToolEffect, *, permanent: bool, retries_done: int, max_retries: int, attempt_over: bool = True
) -> tuple[RunState, str]:
    """The retry rule, from what the tool declares about itself.

    Returns the next state (RETRY_WAIT, EXECUTION_FAILED or HANDED_OFF) and why. A write whose
    outcome stays unknown ends in HANDED_OFF: EXECUTION_FAILED means "failed, nothing applied".
    """
    if permanent:
        return RunState.EXECUTION_FAILED, "permanent error: not retried"
    if effect == ToolEffect.UNSAFE:
        # Not idempotent and nothing to look up: a second call could repeat the effect.
        return RunState.HANDED_OFF, "unsafe tool, outcome unknown: not re-run, needs a human"
    if not attempt_over and effect != ToolEffect.READ_ONLY:
        # A retry (or a lookup) now could race the attempt that is still running.
        return RunState.HANDED_OFF, "outcome unknown, the attempt may still be running: not retried, needs a human"
    if retries_done >= max_retries:
        if effect == ToolEffect.READ_ONLY:
            return RunState.EXECUTION_FAILED, f"retries exhausted ({retries_done}/{max_retries})"
        return RunState.HANDED_OFF, f"retries exhausted ({retries_done}/{max_retries}), outcome unknown: needs a human"
    return RunState.RETRY_WAIT, f"retry {retries_done + 1}/{max_retries}"


def settle_seconds(timeouts: ToolTimeouts, code: str) -> float:
    """How long after a write attempt whose outcome is unknown ended the next one may start.

    A request it sent may still be landing at the target: give it the grace period. After a
    heartbeat timeout the worker may only be cut off from Temporal, its tool still running
    until its deadline: wait as long as a whole attempt may last, which ends past that
    deadline plus the grace period.
    """
    if code == "timeout_heartbeat":
        return timeouts.start_to_close
    return timeouts.grace


def retry_delay_seconds(retries_done: int, suggested: float | None = None, settle: float = 0.0) -> float:
    """Exponential backoff, unless the tool suggested a delay (e.g. from Retry-After); never
    less than ``settle`` (the previous attempt must be over before the next starts)."""
    if suggested is not None and suggested > 0:
        delay = min(suggested, RETRY_MAX_SECONDS * 10)
    else:
        delay = min(RETRY_BASE_SECONDS * 2**retries_done, RETRY_MAX_SECONDS)
    return max(delay, settle)


# ----------------------------------------------------------------------------- the policy file
#
# The organisation's rules, per tenant: who approves, which tools, what is auto-approved, what
# counts as high risk, approval TTLs and budgets. The file is read by an activity
# (activities/policy.py); these models and the decisions below are pure.


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


def tool_refusal(tenant: TenantPolicy | None, tool: str) -> str | None:
    if tenant is not None and tenant.tools is not None and tool not in tenant.tools:
        return f"tool {tool!r} is not allowed for this tenant"
    return None


def spend(spent: dict[str, float], tool: str, args: dict) -> None:
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


def _step_needs_approval(step: PlanStep, info: ToolInfo | None, tenant: TenantPolicy, totals: dict[str, float]) -> bool:
    if info is None:
        return True
    if not info.requires_approval:
        # The default rule: tools that do not write (and do not ask) run without approval,
        # unless the tenant turned read-only auto-approval off.
        return info.effect != ToolEffect.READ_ONLY or not tenant.auto_approve.read_only
    return not any(_rule_holds(rule, step.tool, totals) for rule in tenant.auto_approve.limits)


def _describe_step(tool: str, args: dict, info: ToolInfo | None, undo: Compensation | None | bool = False) -> str:
    """One write for the approver. ``undo``: its compensation as the plan hash covers it (None:
    no recovery path; False: a plan from before recovery, which says nothing about undo)."""
    effect = info.effect.value if info else "?"
    if info is not None and info.destructive:
        effect += ", DESTRUCTIVE"
    fields = [f"{k}={args[k]}" for k in (info.summary_fields if info else []) if k in args]
    if undo is not False:
        # The compensating tool's name may come from an MCP server: shown escaped, as code.
        fields.append(f"undo: {markdown_code(undo.tool, 64)}" if isinstance(undo, Compensation) else "no recovery path")
    return f"{tool} ({effect}{', ' + ', '.join(fields) if fields else ''})"


def _destructive(info: ToolInfo | None) -> bool:
    return info is None or info.destructive  # an unknown tool is assumed the worst


def review_plan(
    plan: Plan, catalog: ToolCatalog, tenant: TenantPolicy | None, spent: dict[str, float] | None = None
) -> PlanReview:
    """What policy says about ``plan``, given what the run has already done (``spent``)."""
    tenant = tenant or DEFAULT_TENANT_POLICY
    totals = _totals(plan.steps, spent or {})
    gated = [s for s in plan.steps if _step_needs_approval(s, catalog.get(s.tool), tenant, totals)]
    high_risk = tenant.high_risk
    high = high_risk is not None and (
        any(_rule_holds(rule, s.tool, totals) for s in plan.steps for rule in high_risk.when)
        or (high_risk.destructive and any(_destructive(catalog.get(s.tool)) for s in plan.steps))
    )
    writes = [
        _describe_step(s.tool, s.args, catalog.get(s.tool), plan.undo[i] if plan.undo is not None else False)
        for i, s in enumerate(plan.steps)
        if (info := catalog.get(s.tool)) is None or info.effect != ToolEffect.READ_ONLY
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
        )
    return PlanReview(
        needs_approval=True,
        risk="normal",
        approvals_required=1,
        roles=tenant.approval_roles,
        summary=summary,
        ttl_seconds=tenant.approval_ttl_seconds.normal,
    )


# ----------------------------------------------------------------------------- recovery

# Runs `tether compensate` may undo: they ended with ok writes a person has to deal with.
COMPENSABLE_STATES = frozenset({RunState.HANDED_OFF, RunState.EXECUTION_FAILED})


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


def approver_refusal(
    tenant: TenantPolicy | None,
    *,
    approver: str,
    requested_by: str,
    kind: str,
    roles: list[str],
    already_approved: list[str],
) -> Refusal | None:
    """May this person decide on this run's pending plan, under this tenant's policy?"""
    if tenant is None:
        return Refusal(rule="tenant", message="the run's tenant is not in the policy file")
    # Four-eyes first: whatever roles the requester holds, she does not approve her own run.
    if kind == "approve" and tenant.four_eyes and approver == requested_by:
        return Refusal(rule="four_eyes", message=f"{approver} requested this run and may not approve it")
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
    if kind == "approve" and approver in already_approved:
        return Refusal(
            rule="distinct_approvers", message=f"{approver} already approved: a different approver is needed"
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
) -> Refusal | None:
    """Do the approvals a plan got still hold, under the current policy, for these tools?

    For a plan that ran without approval (``approvals_required`` 0), ``steps`` are reviewed
    again: a policy that now wants an approval for them stops the write.
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
) -> bytes:
    """What a person signs for a decision: the run (its id and the first run's id, so a later
    run under the same id is another run), the tenant, the approval request and its exact plan,
    the kind of decision, its id and who decides. Handoffs sign with empty request and plan."""
    return canonical_json(
        {
            "workflow_id": workflow_id,
            "first_run_id": first_run_id,
            "tenant": tenant,
            "request_id": request_id,
            "plan_hash": plan_hash,
            "decision": kind,
            "decision_id": decision_id,
            "signer": signer,
        }
    ).encode()


def decision_signature_payload(
    *, workflow_id: str, first_run_id: str, tenant: str, kind: str, decision: ApprovalDecision
) -> bytes:
    """What the approver of ``decision`` signs (and the policy activity verifies)."""
    return signature_payload(
        workflow_id=workflow_id,
        first_run_id=first_run_id,
        tenant=tenant,
        request_id=decision.request_id or "",
        plan_hash=decision.plan_hash,
        kind=kind,
        decision_id=decision.decision_id,
        signer=decision.approver,  # normalised, as the run compares it
    )


def start_signature_payload(*, workflow_id: str, tenant: str, requested_by: str, request_digest: str) -> bytes:
    """What a requester signs to start a run: its id, tenant, name and what it asks for."""
    return canonical_json(
        {
            "workflow_id": workflow_id,
            "tenant": tenant,
            "decision": "start",
            "requested_by": requested_by,
            "request_digest": request_digest,
        }
    ).encode()
