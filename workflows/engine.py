"""The run's decision logic as pure functions over its state: what happens on each event.

``AgentRun`` (workflows/agent_run.py) is the shell around this: it awaits activities, timers
and signals, and hands each outcome to the :class:`Engine`, which decides the next state
through the transition table. No Temporal, no I/O: time and ids are passed in. The property
tests drive this same code with random event sequences.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from workflows import policy, recovery
from workflows import revision as revisions
from workflows.display import approve_command
from workflows.identity import normalize_name, same_person
from workflows.budgets import (
    ANSWER_CHARS,
    CARRY_TIMELINE_TAIL,
    DECISIONS_WINDOW,
    EXECUTED_OBSERVATION_CHARS,
    EXECUTED_WINDOW,
    PROPOSAL_BYTES,
    REASON_CHARS,
    REVISIONS_KEPT,
    clip,
)
from workflows.contract import (
    AcceptedApproval,
    ApprovalDecision,
    CompensationCall,
    ExecutedStep,
    HandoffRequest,
    Limits,
    NotApproved,
    Plan,
    PlanStep,
    Revision,
    RevisionRequest,
    ToolCatalog,
    ToolEffect,
    ToolInfo,
)
from workflows.policy_file import EscalationStage, TenantPolicy
from workflows.wire import (
    AuthorityCheck,
    Notification,
    NotificationResult,
    PlanReview,
    Proposal,
    ProposedStep,
    Refusal,
    SnapshotRequest,
    ToolCall,
    ToolOutcome,
    RecoverySource,
    Verdict,
)
from workflows.run_state import PendingApproval, RunData, RunOutcome, RunRequest
from workflows.states import EffectOutcome, Refs, RunState, TransitionRecord
from workflows.validation import Validation, validate_proposal

S = RunState
DecisionKind = Literal["approve", "reject", "revise"]
# What waits in the run's inbox: an approve / reject decision, or a revision.
Decision = ApprovalDecision | RevisionRequest


class IllegalState(Exception):
    """The run is in no shape for this decision (a bug, or carried-over state that does not fit).

    The workflow fails the run on it, non-retryably: a bare exception would only fail the
    workflow task and retry it forever.
    """


def _require(condition: object, what: str) -> None:
    if not condition:
        raise IllegalState(what)


@dataclass(frozen=True)
class ToolFailure:
    """How a tool call failed, as the workflow saw it."""

    code: str
    message: str  # for the worker log only: it may quote arguments, so never on the timeline
    permanent: bool  # the tool said a retry cannot help (bad input, 4xx)
    suggested_delay: float | None = None  # e.g. from Retry-After
    still_running: bool = False  # the attempt had not ended when it was reported (not over)
    started: bool = True  # False: cancelled before any worker picked the attempt up


class Engine:
    """One run's decisions. Every state change goes through ``data.lifecycle.move``."""

    def __init__(
        self,
        data: RunData,
        request: RunRequest,
        *,
        workflow_id: str,
        on_record: Callable[[TransitionRecord], None] = lambda record: None,
        new_request_id: Callable[[], str] = lambda: "",
    ) -> None:
        self.data = data
        self.request = request
        self.workflow_id = workflow_id
        self._on_record = on_record  # metrics, the audit sink; called for every record written
        self.new_request_id = new_request_id  # one id per approval request (derived: a reset asks the same)
        # Records someone is to be told about, with webhooks named besides the subscribers (an
        # escalation stage's notify); the workflow takes them before it waits.
        self.outbox: list[tuple[TransitionRecord, list[str]]] = []
        # Decision refusals counted but not recorded (a flood), until their sender is answered.
        self.unrecorded_refusals: dict[str, Refusal] = {}
        # Where the current plan writes (step indexes), worked out once per plan and catalog:
        # every step asks whether writes remain (authority_check).
        self._writes: tuple[tuple[Any, ...], list[int]] = ((), [])

    def on_record(self, record: TransitionRecord | None) -> None:
        if record is not None:  # None: a refusal in a flood, counted but not recorded
            self._on_record(record)
            if notify_event(record) is not None:
                self.outbox.append((record, []))

    # ------------------------------------------------------------------ facts

    @property
    def state(self) -> RunState:
        return self.data.lifecycle.state

    @property
    def tenant(self) -> TenantPolicy | None:
        return self.data.policy.policy if self.data.policy else None

    @property
    def limits(self) -> Limits:
        """The run's limits, tightened by the tenant's budgets."""
        return policy.effective_limits(self.request.limits, self.tenant)

    @property
    def catalog(self) -> ToolCatalog:
        return self.data.catalog or ToolCatalog()

    def current_step(self) -> PlanStep | None:
        """The plan's next step; while COMPENSATING, the next compensation as a step."""
        if self.state == S.COMPENSATING:
            undo = self.current_undo()
            if undo is None or undo.tool is None:
                return None
            return PlanStep(tool_call_id=undo.tool_call_id, tool=undo.tool, args=undo.args)
        plan = self.data.plan
        if plan is None or self.data.next_step >= len(plan.steps):
            return None
        return plan.steps[self.data.next_step]

    def tool_info(self, step: PlanStep) -> ToolInfo | None:
        return self.catalog.get(step.tool)

    def step_refs(self, step: PlanStep) -> Refs:
        undo = next((c for c in self.data.compensations if c.tool_call_id == step.tool_call_id), None)
        if undo is not None:
            # Bound to the plan (and approval) that covered it; its key derives from the original's.
            return Refs(plan_hash=undo.plan_hash, tool_call_id=step.tool_call_id, idempotency_key=undo.idempotency_key)
        return Refs(
            plan_hash=self.data.plan.plan_hash if self.data.plan else None,
            tool_call_id=step.tool_call_id,
            # The run's workflow id, not its run id: stable across continue-as-new.
            idempotency_key=f"{self.workflow_id}:{step.tool_call_id}",
        )

    def review(self) -> PlanReview:
        _require(self.data.plan is not None, "no validated plan to review")
        return policy.review_plan(self.data.plan, self.catalog, self.tenant, self.data.spent)

    def actor(self, name: str, verified: bool = False, via: str | None = None) -> str:
        """How a person shows on the timeline: verified identities say how (their own
        signature, or a trusted signer's attestation: ``user:bob via inbox``)."""
        if verified and via:
            return f"user:{name} via {via}"
        return f"user:{name} (signed)" if verified else f"user:{name}"

    # ------------------------------------------------------------------ records

    def move(self, to: RunState, *, at: datetime, actor: str, reason: str, refs: Refs | None = None) -> None:
        """Raises IllegalTransition for a move the table denies (the workflow makes that a
        non-retryable failure)."""
        record = self.data.lifecycle.move(to, at=at, actor=actor, reason=reason, refs=refs)
        self.data.updated_at = record.at
        self.on_record(record)

    def refuse(self, *, at: datetime, actor: str, reason: str, rule: str, refs: Refs | None = None) -> None:
        self.on_record(self.data.lifecycle.refuse(at=at, actor=actor, reason=reason, refs=refs, rule=rule))

    # ------------------------------------------------------------------ start and planning

    def received(self, at: datetime) -> None:
        """The catalog and the policy snapshot are in: start planning, or fail."""
        data = self.data
        if data.created_at is None:
            data.created_at = at
        _require(data.policy is not None, "no policy snapshot")
        # The policy's content hash goes on the timeline: a run's decisions stay explainable.
        refs = Refs(policy_hash=data.policy.policy_hash)
        data.requester_verified = data.policy.requester_verified
        if data.policy.requester_refusal is not None:
            refusal = data.policy.requester_refusal
            data.last_error = f"{refusal.rule}: {refusal.message}"
            self.move(
                S.FAILED,
                at=at,
                actor=self.actor(self.request.requested_by),
                reason=f"run request refused [{refusal.rule}]: {refusal.message}",
                refs=refs.model_copy(update={"error_code": refusal.rule}),
            )
        elif data.policy.policy is None:
            self.move(
                S.FAILED,
                at=at,
                actor="runtime",
                reason=f"tenant {self.request.tenant!r} is not in the policy file "
                f"{data.policy.source}: add it under [tenants.{self.request.tenant}]",
                refs=refs,
            )
        elif self.request.compensate_run is None:
            self.move(S.PLANNING, at=at, actor="runtime", reason=f"run received; policy {data.policy.source}", refs=refs)
        # A compensation run stays RECEIVED until the original's record is in (begin_compensation).

    def token_budget_refusal(self) -> str | None:
        max_tokens = self.request.limits.max_model_tokens
        if max_tokens is not None and self.data.model_tokens >= max_tokens:
            return f"model token budget used up: {self.data.model_tokens} of max_model_tokens={max_tokens} used"
        return None

    def planner_failed(self, failure: ToolFailure, at: datetime) -> None:
        self.data.last_error = f"{failure.code}: {failure.message}"
        self.move(
            S.FAILED,
            at=at,
            actor="planner",
            reason=f"planner failed: {failure.message}",
            refs=Refs(error_code=failure.code),
        )

    def proposal(self, proposal: Proposal, *, at: datetime, new_id: Callable[[int], str]) -> None:
        """The planner answered: finish, validate the plan, or record why it is not valid."""
        data = self.data
        data.model_tokens += proposal.usage_tokens
        data.not_approved = []  # the planner has been told
        max_tokens = self.request.limits.max_model_tokens
        if max_tokens is not None and data.model_tokens > max_tokens:
            data.last_error = f"model_token_budget: {data.model_tokens} > {max_tokens}"
            self.move(
                S.FAILED,
                at=at,
                actor="runtime",
                reason=f"model token budget exceeded: {data.model_tokens} of "
                f"max_model_tokens={max_tokens} used; the proposal was discarded",
                refs=Refs(error_code="model_token_budget"),
            )
            return
        if proposal.answer is not None and not proposal.steps and proposal.oversized_bytes is None:
            data.answer = clip(proposal.answer, ANSWER_CHARS)
            self.move(S.COMPLETED, at=at, actor="planner", reason="planner finished with an answer")
            return
        result = self.validate(proposal, new_id)
        if result.plan is None:
            data.feedback = result.reason  # bounded: the first problems, paths and rules only
            self.move(S.VALIDATION_FAILED, at=at, actor="runtime", reason=result.reason)
            return
        data.plan_editors, data.plan_revisers = [], []
        self._adopt(result.plan)
        data.feedback = None
        self.move(
            S.VALIDATED,
            at=at,
            actor="runtime",
            reason=f"plan of {len(result.plan.steps)} step(s) validated",
            refs=Refs(plan_hash=result.plan.plan_hash),
        )

    def validate(self, proposal: Proposal, new_id: Callable[[int], str]) -> Validation:
        """The one validation a plan gets, proposed or revised: the catalog snapshot, the
        tools' schemas, the tenant's tools and the step budget (with what the run already did)."""
        result = validate_proposal(
            proposal,
            self.catalog,
            executed_steps=self.data.steps_executed,
            limits=self.limits,
            new_id=new_id,
            tool_refusal=lambda tool: policy.tool_refusal(self.tenant, tool),
        )
        if result.plan is not None:
            # The tenant's require_recovery: a write with no recovery path never reaches approval.
            refusal = policy.recovery_refusal(result.plan, self.catalog, self.tenant, self.data.spent)
            if refusal is not None:
                result = Validation(plan=None, problems=[f"[{refusal.rule}] {refusal.message}"])
        return result

    def _adopt(self, plan: Plan) -> None:
        """``plan`` becomes the run's current plan, the next version; nothing of it has run."""
        data = self.data
        data.plans = max(data.plans, data.plan.version if data.plan else 0) + 1
        plan.version = data.plans
        data.plan, data.next_step, data.step_retries = plan, 0, 0
        data.pending_approval = data.approval = None
        data.approved_by = []

    def after_validation_failed(self, at: datetime) -> None:
        self._replan_or_end(
            S.FAILED,
            at=at,
            actor="runtime",
            why="validation failed",
            end_reason=f"validation failed and the replan budget is used up "
            f"(max_replans={self.limits.max_replans})",
        )

    def _replan_or_end(
        self, end: RunState, *, at: datetime, actor: str, why: str, end_reason: str, refs: Refs | None = None
    ) -> None:
        """Back to PLANNING while the replan budget lasts, else end in ``end``."""
        limits = self.limits
        if not policy.may_replan(self.data.replans, limits):
            self.move(end, at=at, actor=actor, reason=end_reason, refs=refs)
            return
        self.data.replans += 1
        self.move(
            S.PLANNING,
            at=at,
            actor=actor,
            reason=f"{why}: replan {self.data.replans}/{limits.max_replans}",
            refs=refs,
        )

    def after_validated(self, at: datetime, refusal: Refusal | None = None, ask: Verdict | None = None) -> None:
        """``refusal``: the current policy file's word on a plan the snapshot would auto-approve."""
        review = self.review()
        if not review.needs_approval and refusal is None:
            self.enter_step(at=at, reason=f"policy needs no approval: {review.summary}")
            return
        why = f"policy changed [{refusal.rule}]: {refusal.message}; " if refusal else ""
        self.request_approval(at=at, reason=f"{why}approval needed: {review.summary}", ask=ask if refusal else None)

    # ------------------------------------------------------------------ approvals

    def request_approval(self, *, at: datetime, reason: str, ask: Verdict | None = None) -> None:
        """Open a fresh approval request for the current plan (no approvals carried over).

        ``ask``: a re-check's verdict under the current file, whose terms (approvals, roles) the
        request takes. Either way it asks for at least one approval from roles someone can hold.
        """
        data = self.data
        _require(data.plan is not None, "no validated plan")
        self.adopt(ask)
        review = self.review()
        ttl = self.request.limits.approval_ttl_seconds
        if review.ttl_seconds is not None:
            ttl = min(ttl, review.ttl_seconds)  # the stricter of the run's and the policy's
        required, roles = policy.request_terms(review, self.tenant)
        data.pending_approval = PendingApproval(
            plan_hash=data.plan.plan_hash,
            request_id=self.new_request_id(),
            expires_at=at + timedelta(seconds=ttl),
            summary=review.summary,
            risk="high" if review.risk == "high" else "normal",
            approvals_required=required,
            roles=roles,
            editors=list(data.plan_editors),
            revisers=list(data.plan_revisers),
            opened_at=at,
            # Expiry stays the last word: a stage at or past it never fires.
            escalation=[stage for stage in review.escalation if stage.after < ttl],
        )
        data.approval = None
        data.approved_by = []
        version = f"plan v{data.plan.version}, " if data.plan.version > 1 else ""
        self.move(
            S.AWAITING_APPROVAL,
            at=at,
            actor="runtime",
            reason=f"{reason} ({version}request {data.pending_approval.request_id})",
            refs=Refs(plan_hash=data.plan.plan_hash, request_id=data.pending_approval.request_id or None),
        )

    def adopt(self, ask: Verdict | None) -> None:
        """A re-check under the current policy file refused: from now on the run judges by that
        file (its snapshot is replaced), so the next request asks for what can be given."""
        data = self.data
        if ask is None or ask.tenant_policy is None or data.policy is None:
            return
        data.policy = data.policy.model_copy(update={"policy": ask.tenant_policy, "policy_hash": ask.policy_hash})

    def screen_decision(self, kind: DecisionKind, decision: Decision, at: datetime) -> bool:
        """The cheap, state-only checks a decision passes on arrival (signal handler).

        Returns True when it may go on to the policy check; otherwise it is recorded as refused.
        """
        plain = _plain(decision)
        refusal = policy.decision_refusal(plain, self.data, now=at, check_duplicate=True, kind=kind)
        self._remember_decision(plain.decision_id)
        if refusal is not None:
            self._refuse_decision(kind, plain, refusal, at)
            return False
        return True

    def decision_check(self, kind: DecisionKind, decision: Decision) -> dict:
        """What the policy activity needs to judge ``decision`` (DecisionCheck's fields, less
        the run's ids): who decides on which request, and what a revision's signature covers."""
        pending = self.data.pending_approval
        _require(pending is not None, "no pending approval")
        return {
            "kind": kind,
            "decision": _plain(decision),
            "roles": pending.roles,
            "already_approved": [a.approver for a in pending.approvals],
            "editors": pending.editors,
            "steps_digest": decision.revised_hash() if isinstance(decision, RevisionRequest) else None,
        }

    def _remember_decision(self, decision_id: str) -> None:
        """A bounded window of ids, a count and a running digest of every id seen."""
        data = self.data
        if decision_id in data.decisions_seen:
            return
        data.decisions_seen.append(decision_id)
        del data.decisions_seen[:-DECISIONS_WINDOW]
        data.decisions_count += 1
        data.decisions_digest = hashlib.sha256(f"{data.decisions_digest}\n{decision_id}".encode()).hexdigest()

    def settle_decision(
        self,
        kind: DecisionKind,
        decision: Decision,
        verdict: Refusal | None,
        at: datetime,
        verified: bool = False,
        *,
        new_id: Callable[[int], str] | None = None,
    ) -> None:
        """Apply a decision the policy activity has judged (``verdict`` None: the approver may).

        ``new_id``: tool call ids for a revised plan (a revision, a partial approval)."""
        data = self.data
        plain = _plain(decision)
        # The run may have moved on (expiry, handoff) while the policy was consulted.
        refusal = verdict or policy.decision_refusal(plain, data, now=at, check_duplicate=False, kind=kind)
        if refusal is not None:
            self._refuse_decision(kind, plain, refusal, at)
            return
        pending = data.pending_approval
        _require(pending is not None and data.plan is not None, "no pending approval")
        actor = self.actor(plain.approver, verified, plain.attested_by)
        if isinstance(decision, RevisionRequest):
            _require(new_id is not None, "a revision needs tool call ids")
            body = decision.model_dump_json(include={"steps"})
            if len(body) > PROPOSAL_BYTES:  # the proposal's budget: the plan is carried and hashed
                proposal = Proposal(oversized_bytes=len(body), oversized_digest=hashlib.sha256(body.encode()).hexdigest())
            else:
                proposal = Proposal(steps=[ProposedStep(tool=s.tool, args=s.args) for s in decision.steps])
            self._revise(proposal, plain, actor, at, new_id, why=f"plan revised by {plain.approver}: {decision.reason}")
            return
        refs = Refs(plan_hash=plain.plan_hash, decision_id=plain.decision_id, request_id=pending.request_id or None)
        if kind == "reject":
            data.pending_approval = None
            self.move(S.REJECTED, at=at, actor=actor, reason=plain.reason or "rejected", refs=refs)
            return
        kept = policy.partial_steps(plain, data.plan)
        if kept is not None:
            _require(new_id is not None, "a partial approval needs tool call ids")
            self._approve_part(plain, kept, actor, at, new_id, verified)
            return
        self._approve(plain, actor, at, refs)

    def _revise(
        self,
        proposal: Proposal,
        decision: ApprovalDecision,
        actor: str,
        at: datetime,
        new_id: Callable[[int], str],
        *,
        why: str,
        partial: bool = False,
    ) -> bool:
        """Replace the pending plan by a revised one, validated like a proposal: a new plan
        version, back to VALIDATED (the run then asks for a new approval). Refused
        (``invalid_revision``, nothing changed) when it does not validate or changes nothing."""
        data = self.data
        old, pending = data.plan, data.pending_approval
        _require(old is not None and pending is not None, "no pending plan to revise")
        kind: DecisionKind = "approve" if partial else "revise"
        result = self.validate(proposal, new_id)
        problem = result.reason if result.plan is None else None
        if result.plan is not None and result.plan.plan_hash == old.plan_hash:
            problem = "the revised plan is the pending plan: nothing to revise"
        if data.next_step:  # (not reached today: a plan waits for approval before any step runs)
            problem = f"{data.next_step} step(s) of the pending plan have run: plan the rest anew"
        if problem is not None or result.plan is None:
            self._refuse_decision(kind, decision, Refusal(rule="invalid_revision", message=f"invalid revision: {problem}"), at)
            return False
        changed = revisions.changed_paths(revisions.patch(old.steps, result.plan.steps))
        if decision.approver not in data.plan_editors:
            data.plan_editors.append(decision.approver)
        if not partial and decision.approver not in data.plan_revisers:
            data.plan_revisers.append(decision.approver)
        self._adopt(result.plan)
        plan = result.plan
        data.revisions.append(
            Revision(
                version=plan.version,
                editor=decision.approver,
                at=at,
                previous_plan_hash=old.plan_hash,
                plan_hash=plan.plan_hash,
                changed=changed,
                partial=partial,
            )
        )
        del data.revisions[:-REVISIONS_KEPT]
        summary = f"; changed {', '.join(changed)}" if changed else ""
        self.move(
            S.VALIDATED,
            at=at,
            actor=actor,
            reason=clip(
                f"{why} — plan v{plan.version} ({len(plan.steps)} step(s)) replaces v{old.version} "
                f"{old.plan_hash[:12]}{summary}",
                REASON_CHARS,
            ),
            refs=Refs(
                plan_hash=plan.plan_hash,
                decision_id=decision.decision_id,
                request_id=pending.request_id or None,
                previous_plan_hash=old.plan_hash,
                changed=changed,
            ),
        )
        return True

    def _approve_part(
        self,
        decision: ApprovalDecision,
        kept: list[int],
        actor: str,
        at: datetime,
        new_id: Callable[[int], str],
        verified: bool,
    ) -> None:
        """A partial approval: a revision to the kept steps, then this approval of the result
        (it counts for the new request like any approval; others needed approve the subset)."""
        data = self.data
        old, before = data.plan, data.pending_approval
        _require(old is not None and before is not None, "no pending plan")
        left_out = [n for n in range(1, len(old.steps) + 1) if n not in kept]
        dropped = [NotApproved(step=n, tool=old.steps[n - 1].tool, args=old.steps[n - 1].args, by=decision.approver) for n in left_out]
        proposal = Proposal(steps=[ProposedStep(tool=old.steps[n - 1].tool, args=old.steps[n - 1].args) for n in kept])
        why = (
            f"partial approval by {decision.approver}: step(s) {', '.join(map(str, kept))} of "
            f"{len(old.steps)} approved, not approved: "
            + ", ".join(f"{d.step} ({d.tool})" for d in dropped)
        )
        # Judged before anything changes (a refused decision changes nothing): as the subset's
        # request will ask, with the roles the current request's escalation stages have added,
        # and the approver among the plan's editors (a partial approval revises the plan).
        escalated = [r for stage in before.escalation[: before.stage] for r in stage.roles]
        subset = self.validate(proposal, new_id).plan
        if subset is not None:
            _, roles = policy.request_terms(policy.review_plan(subset, self.catalog, self.tenant, data.spent), self.tenant)
            refusal = policy.approver_refusal(
                self.tenant,
                approver=decision.approver,
                requested_by=self.request.requested_by,
                kind="approve",
                roles=sorted({*(roles or before.roles), *escalated}),
                already_approved=[],
                editors=[*data.plan_editors, decision.approver],
            )
            if refusal is not None:
                self._refuse_decision("approve", decision, refusal, at)
                return
        if not self._revise(proposal, decision, actor, at, new_id, why=why, partial=True):
            return
        data.not_approved = dropped
        review = self.review()
        self.request_approval(at=at, reason=f"approval of the approved part: {review.summary}")
        pending = data.pending_approval
        _require(pending is not None, "no pending approval")
        if escalated:
            # The subset's request stands where the request it narrows had escalated to.
            pending.roles = sorted({*pending.roles, *escalated})
            pending.stage = min(before.stage, len(pending.escalation))
        # Checked by the policy activity for the request it was sent for; the subset's request
        # may ask for other roles: the run's snapshot says whether this approver holds one.
        refusal = policy.approver_refusal(
            self.tenant,
            approver=decision.approver,
            requested_by=self.request.requested_by,
            kind="approve",
            roles=pending.roles or before.roles,  # a subset needing nobody: the roles it was sent to
            already_approved=[],
            editors=pending.editors,
        )
        refs = Refs(plan_hash=pending.plan_hash, decision_id=decision.decision_id, request_id=pending.request_id or None)
        if refusal is not None:
            self._refuse_decision("approve", decision.model_copy(update={"plan_hash": pending.plan_hash}), refusal, at)
            return
        self._approve(decision, actor, at, refs)

    def _approve(self, decision: ApprovalDecision, actor: str, at: datetime, refs: Refs) -> None:
        data = self.data
        pending = data.pending_approval
        _require(pending is not None, "no pending approval")
        pending.approvals.append(
            AcceptedApproval(
                approver=decision.approver,
                decision_id=decision.decision_id,
                at=at,
                # Kept: the re-check before every write verifies it again under the current file.
                signature=decision.signature,
                request_id=decision.request_id or "",
                plan_hash=decision.plan_hash,
                attested_by=decision.attested_by,
                steps=decision.steps,
            )
        )
        data.approved_by = [a.approver for a in pending.approvals]
        unreviewed = " (unreviewed: not bound to a plan the approver was shown)" if decision.unreviewed else ""
        # Whoever changed the plan's steps is not its only approver, unless the tenant allows it.
        by_revisers = bool(pending.revisers) and all(
            any(same_person(a.approver, r) for r in pending.revisers) for a in pending.approvals
        )
        alone = by_revisers and len(pending.approvals) >= pending.approvals_required
        if alone and self.tenant is not None and self.tenant.reviser_may_approve_alone:
            unreviewed += " (approved by its own reviser alone: reviser_may_approve_alone = true)"
        elif alone:
            self.on_record(
                data.lifecycle.accept(
                    at=at,
                    actor=actor,
                    reason=f"approval {len(pending.approvals)} of {pending.approvals_required} accepted{unreviewed}; "
                    f"{', '.join(pending.revisers)} revised this plan: an approval from someone who did not revise "
                    f"it is still needed (reviser_may_approve_alone = false)",
                    refs=refs,
                )
            )
            return
        if len(pending.approvals) < pending.approvals_required:
            self.on_record(
                data.lifecycle.accept(
                    at=at,
                    actor=actor,
                    reason=f"approval {len(pending.approvals)} of {pending.approvals_required} accepted{unreviewed}"
                    + (f": {decision.comment}" if decision.comment else ""),
                    refs=refs,
                )
            )
            return
        # The approval is now in force for this plan; nothing is pending any more.
        data.approval, data.pending_approval = pending, None
        self.move(S.APPROVED, at=at, actor=actor, reason=(decision.comment or "approved") + unreviewed, refs=refs)

    def refuse_unsettled(self, kind: DecisionKind, decision: Decision, at: datetime, *, ended: bool = False) -> None:
        """A decision still queued when the run left AWAITING_APPROVAL; ``ended``: the run is
        over (completed, cancelled, failed, handed off, expired), rule ``run_ended``."""
        if ended:
            refusal = Refusal(rule="run_ended", message=f"the run ended before this decision was settled (state {self.state.value})")
        else:
            refusal = Refusal(rule="not_awaiting_approval", message=f"run is {self.state.value}, not AWAITING_APPROVAL")
        self._refuse_decision(kind, _plain(decision), refusal, at)

    def _refuse_decision(self, kind: DecisionKind, decision: ApprovalDecision, refusal: Refusal, at: datetime) -> None:
        record = self.data.lifecycle.refuse(
            at=at,
            actor=f"user:{decision.approver}",
            reason=f"{kind} refused: {refusal.message}",
            rule=refusal.rule,
            refs=Refs(plan_hash=decision.plan_hash, decision_id=decision.decision_id, request_id=decision.request_id),
        )
        if record is None:  # counted in a flood, not recorded: its sender still gets the rule
            self.unrecorded_refusals[decision.decision_id] = refusal
        self.on_record(record)

    def next_escalation(self) -> datetime | None:
        """When the pending request's next escalation stage is due (None: no stage left)."""
        pending = self.data.pending_approval
        if pending is None or pending.opened_at is None or pending.stage >= len(pending.escalation):
            return None
        return pending.opened_at + timedelta(seconds=pending.escalation[pending.stage].after)

    def next_timer(self, escalate: bool = True) -> tuple[datetime, str]:
        """When the waiting plan's timer fires next, and what for: an escalation stage (where
        ``escalate``: the policy sets stages) inside the window, else the expiry."""
        pending = self.data.pending_approval
        _require(pending is not None, "no pending approval")
        due = self.next_escalation() if escalate else None
        if due is not None and due < pending.expires_at:
            return due, f"escalation stage {pending.stage + 1}"
        return pending.expires_at, "approval expiry"

    def timer_fired(self, at: datetime, escalate: bool = True) -> None:
        """The timer ``next_timer`` named fired: escalate, or expire. A run that was away past
        several stages takes them one by one; past the expiry, the expiry is the last word."""
        wake, _ = self.next_timer(escalate)
        pending = self.data.pending_approval
        if wake < pending.expires_at and at < pending.expires_at:
            self.escalate(at)
        else:
            self.expire(at)

    def escalate(self, at: datetime) -> EscalationStage:
        """The next escalation stage's timer fired: record it and widen the roles that may
        approve. Returns the stage (the workflow tells its webhooks)."""
        pending = self.data.pending_approval
        due = self.next_escalation()
        _require(
            pending is not None and self.state == S.AWAITING_APPROVAL and due is not None and due <= at < pending.expires_at,
            "an escalation timer fired with no stage due",
        )
        stage = pending.escalation[pending.stage]
        pending.stage += 1
        added = [r for r in stage.roles if r not in pending.roles]
        pending.roles = pending.roles + added
        widened = f"; roles {', '.join(pending.roles)} may approve" if added else ""
        told = f"; notifying {', '.join(stage.notify)}" if stage.notify else ""
        self.on_record(
            self.data.lifecycle.escalate(
                at=at,
                reason=f"escalation stage {pending.stage}/{len(pending.escalation)}: waiting "
                f"{_duration(stage.after)} for approval{widened}{told}; expires {pending.expires_at.isoformat()}",
                refs=Refs(plan_hash=pending.plan_hash, request_id=pending.request_id or None),
            )
        )
        if self.outbox:
            self.outbox[-1][1].extend(stage.notify)
        return stage

    # ------------------------------------------------------------------ notifications

    def take_notifications(self, namespace: str = "default") -> list[Notification]:
        """The events to post now, each to the webhooks that take it (the policy snapshot's
        subscriptions, and an escalation stage's own), built from ids and the risk summary.
        An approval request already decided by the time the run waits is not announced."""
        outbox, self.outbox = self.outbox, []
        hooks = self.data.policy.webhooks if self.data.policy else {}
        pending = self.data.pending_approval
        out: list[Notification] = []
        for record, named in outbox:
            event = notify_event(record)
            if event is None:
                continue
            if event == "awaiting_approval" and (pending is None or pending.request_id != (record.refs.request_id or "")):
                continue  # decided in the same step (a partial approval): nothing waits
            names = [n for n, events in hooks.items() if event in events]
            names += [n for n in named if n not in names]
            if not names:
                continue
            waiting = pending if pending is not None and pending.request_id == (record.refs.request_id or "") else None
            out.append(
                Notification(
                    event_id=f"{self.workflow_id}:{self.data.first_run_id}:{record.seq}",
                    event=event,
                    webhooks=names,
                    run_id=self.workflow_id,
                    namespace=namespace,
                    tenant=self.request.tenant,
                    state=record.to_state.value,
                    plan_hash=record.refs.plan_hash,
                    request_id=record.refs.request_id,
                    summary=waiting.summary if waiting else "",
                    expires_at=waiting.expires_at if waiting else None,
                    approve_command=approve_command(self.workflow_id, waiting.plan_hash) if waiting else None,
                    reason=record.reason,
                )
            )
        return out

    def notification_done(self, note: Notification, result: NotificationResult, at: datetime) -> None:
        """Webhooks no retry reached are on the record (the run did not wait for them)."""
        if not result.dead:
            return
        dead = ", ".join(f"{name} ({why})" for name, why in sorted(result.dead.items()))
        self.on_record(
            self.data.lifecycle.notify_failed(
                at=at,
                reason=f"notification {note.event} (event {note.event_id.rsplit(':', 1)[-1]}) not delivered to: {dead}",
                event=note.event,
                refs=Refs(plan_hash=note.plan_hash, request_id=note.request_id),
            )
        )

    def expire(self, at: datetime) -> None:
        """The approval timer fired."""
        data = self.data
        pending = data.pending_approval
        _require(pending is not None and at >= pending.expires_at, "the approval timer fired with nothing pending, or before expiry")
        expired = f"approval expired at {pending.expires_at.isoformat()}"
        refs = Refs(plan_hash=pending.plan_hash)
        if self.limits.on_expiry == "replan":
            self._replan_or_end(S.EXPIRED, at=at, actor="timer", why=expired, end_reason=expired, refs=refs)
        else:
            self.move(S.EXPIRED, at=at, actor="timer", reason=expired, refs=refs)
        data.pending_approval = None

    def _write_steps(self) -> list[int]:
        """The indexes of the plan's steps that write (or call a tool the catalog lacks)."""
        plan, catalog = self.data.plan, self.data.catalog
        assert plan is not None
        key = (plan.plan_hash, plan.version, len(plan.steps), len(catalog.tools) if catalog else 0)
        if self._writes[0] != key:
            found = self.catalog
            self._writes = (key, [
                i for i, s in enumerate(plan.steps)
                if (info := found.get(s.tool)) is None or info.effect != ToolEffect.READ_ONLY
            ])
        return self._writes[1]

    def authority_check(self, *, from_step: int) -> AuthorityCheck | None:
        """What to re-check against the current policy file before the plan's remaining writes
        run, approved or auto-approved (None: nothing left writes)."""
        data = self.data
        if self.state == S.COMPENSATING:
            return self._undo_check()
        if data.plan is None:
            return None
        remaining = data.plan.steps[from_step:]
        writes = [data.plan.steps[i] for i in self._write_steps() if i >= from_step]
        if not writes:
            return None
        tools = [s.tool for s in writes]
        approval = data.approval
        # The remaining steps, their catalog entries and what the run has done: the current
        # file judges them (auto-approval, or the roles and count an approval needs now).
        context = dict(
            tenant=self.request.tenant,
            tools=tools,
            steps=remaining,
            catalog=ToolCatalog(tools=[i for s in remaining if (i := self.catalog.get(s.tool))]),
            spent=data.spent,
            workflow_id=self.workflow_id,
            first_run_id=data.first_run_id,
            requested_by=self.request.requested_by,
            plan_hash=data.plan.plan_hash,
        )
        if approval is None:
            # Ran without approval: the current policy must still say so, for what is left.
            return AuthorityCheck(approvals=[], roles=[], approvals_required=0, **context)
        return AuthorityCheck(
            approvals=[a.approver for a in approval.approvals],
            roles=approval.roles,
            approvals_required=approval.approvals_required,
            approved=approval.approvals,
            escalated_roles=[r for stage in approval.escalation[: approval.stage] for r in stage.roles],
            request_id=approval.request_id,
            **context,
        )

    def _undo_check(self) -> AuthorityCheck | None:
        """COMPENSATING: the re-check of the next undo (docs/architecture.md, "Recovery"). Its
        authority is the approval (or auto-approval) of the plan hash that covered it, named in
        the capability; a compensation run adds the person who asked for it, judged now."""
        undo = self.current_undo()
        if undo is None or undo.tool is None:
            return None
        return AuthorityCheck(
            tenant=self.request.tenant,
            approvals=list(undo.approved_by),
            tools=[undo.tool],
            roles=[],
            approvals_required=0,
            workflow_id=self.workflow_id,
            first_run_id=self.data.first_run_id,
            requested_by=self.request.requested_by,
            plan_hash=undo.plan_hash,
            undo=undo,
            compensator=self.request.requested_by if self.request.compensate_run is not None else "",
        )

    def after_approved(self, refusal: Refusal | None, at: datetime, ask: Verdict | None = None) -> None:
        """Just before an approved plan's writes run: do its approvals still hold?"""
        if refusal is not None:
            self.request_approval(
                at=at,
                reason=f"approval no longer holds [{refusal.rule}]: {refusal.message}; a new approval is needed",
                ask=ask,
            )
            return
        self.enter_step(at=at, reason="approved plan: executing")

    def after_observation(self, refusal: Refusal | None, at: datetime, ask: Verdict | None = None) -> None:
        """A step's result is in: the next step of the plan, or plan again."""
        data = self.data
        if self.current_step() is None:
            data.approval = None
            self.move(S.PLANNING, at=at, actor="runtime", reason="plan executed: planning what is next")
            return
        if refusal is not None:
            # The rest of the plan needs a new plan and a new approval, under the current file.
            self.adopt(ask)
            held = "approval no longer holds" if data.approval is not None else "policy changed"
            data.approval = None
            self.move(
                S.PLANNING,
                at=at,
                actor="runtime",
                reason=f"{held} [{refusal.rule}]: {refusal.message}; replanning the remaining steps",
            )
            return
        self.enter_step(at=at, reason="next step of the plan")

    # ------------------------------------------------------------------ handoff and cancel

    def screen_handoff(self, request: HandoffRequest, at: datetime) -> bool:
        """May this handoff be honoured (at the next point the table allows)? Else refused.

        A cheap first look; the policy activity screens it again when the run takes it.
        """
        refusal: Refusal | None = None
        if self.data.lifecycle.terminal:
            refusal = Refusal(rule="run_ended", message=f"run already ended in {self.state.value}")
        else:
            # Membership against the run's snapshot, when it has one already.
            refusal = policy.handoff_member_refusal(self.tenant, request.by)
        if refusal is not None:
            self.refuse_handoff(request, refusal, at)
            return False
        return True

    def refuse_handoff(self, request: HandoffRequest, refusal: Refusal, at: datetime) -> None:
        self.refuse(
            at=at,
            actor=f"operator:{request.by}",
            reason=f"handoff refused: {refusal.message}",
            rule=refusal.rule,
            refs=Refs(decision_id=request.decision_id),
        )

    def can_take_handoff(self) -> bool:
        return self.data.lifecycle.can_move(S.HANDED_OFF)

    def take_handoff(
        self,
        request: HandoffRequest | None,
        at: datetime,
        detail: str | None = None,
        verdict: Refusal | None = None,
        verified: bool = False,
        *,
        refs: Refs | None = None,
    ) -> bool:
        """Honour a pending handoff if the current state allows it and the policy check
        (``verdict``, from the current file) passed; a refused one is recorded. ``refs``: the
        step it ends."""
        if request is None or not self.can_take_handoff():
            return False
        if verdict is not None:
            self.refuse_handoff(request, verdict, at)
            return False
        reason = f"handed off by {request.by}: {request.reason}"
        self.move(
            S.HANDED_OFF,
            at=at,
            actor=f"operator:{request.by}" + (" (signed)" if verified else ""),
            reason=f"{reason} ({detail})" if detail else reason,
            refs=(refs or Refs()).model_copy(update={"decision_id": request.decision_id}),
        )
        self.data.pending_approval = None
        return True

    def handoff_unhonoured(self, request: HandoffRequest, at: datetime) -> None:
        """The run ended before it could take an accepted handoff: say so on the record."""
        self.refuse_handoff(
            request,
            Refusal(rule="run_ended", message=f"the run ended in {self.state.value} before the handoff could be honoured"),
            at,
        )

    def cancelled(self, reason: str | None, at: datetime) -> None:
        self.data.pending_approval = None
        actor, reason = cancel_actor(reason)
        why = f"cancellation requested: {reason or 'no reason'}"
        ended = self._step_ended_by("cancelled")
        refs, detail = ended if ended is not None else (None, None)
        why = f"{why}; {detail}" if detail else why
        if self.state != S.COMPENSATING and self.on_cancel() == "compensate" and self.current_undo() is not None:
            # The person asked to stop; the run was told to put things back when stopped.
            self._settled = None
            self.data.step_retries, self.data.step_outcome = 0, None
            self.move(S.COMPENSATING, at=at, actor=actor,
                      reason=f"{why}; on_cancel=compensate: {self._undo_left(start=True)}", refs=refs)
            return
        self.move(S.CANCELLED, at=at, actor=actor, reason=why, refs=refs)

    # ------------------------------------------------------------------ tools

    def enter_step(self, *, at: datetime, reason: str) -> None:
        """Enter EXECUTING_TOOL for the plan's next step."""
        step = self.current_step()
        _require(step is not None, "no plan step to execute")
        self.data.step_retries = 0
        self.data.step_outcome = None
        self.move(S.EXECUTING_TOOL, at=at, actor="runtime", reason=reason, refs=self.step_refs(step))

    def next_tool_call(self, at: datetime) -> ToolCall | None:
        """The call to schedule now, or None when the step may not run (the run has moved)."""
        data = self.data
        step = self.current_step()
        _require(
            step is not None and self.state in (S.EXECUTING_TOOL, S.COMPENSATING),
            "no plan step to execute, or not in EXECUTING_TOOL",
        )
        max_calls = self.tenant.budgets.max_tool_calls if self.tenant else None
        # Compensations are not held to the budget: an undo must not be stopped by the calls
        # that made it necessary (they are bounded by the ok writes and their retry rules).
        if max_calls is not None and data.tool_calls >= max_calls and self.state != S.COMPENSATING:
            self._not_started(
                step, "tool_call_budget", f"tool call budget exhausted: {data.tool_calls} of max_tool_calls={max_calls} used", at
            )
            return None
        data.tool_calls += 1  # every call the workflow schedules, retries included
        refs = self.step_refs(step)
        return ToolCall(
            tool=step.tool,
            args=step.args,
            tool_call_id=step.tool_call_id,
            idempotency_key=refs.idempotency_key or "",
            run_id=self.workflow_id,
            tenant=self.request.tenant,
            attempt=data.step_retries + 1,
        )

    def write_refused(self, refusal: Refusal, at: datetime) -> None:
        """The re-check just before a write attempt (the one that mints its capability) refused:
        the attempt does not start. An earlier attempt may have applied: then a human decides."""
        step = self.current_step()
        _require(step is not None and self.state in (S.EXECUTING_TOOL, S.COMPENSATING), "no write attempt to refuse")
        self.data.tool_calls -= 1  # not scheduled after all
        if self.state == S.COMPENSATING:
            # An undo the current file refuses is not run, nor its later ones: a person decides
            # (the undo stays pending: `tether compensate` can run it once the policy allows).
            undo = self.current_undo()
            outcome = self.data.step_outcome or "failed"
            if outcome == "unknown":  # an earlier attempt may have applied: on the record as such
                self._end_step(step, outcome, refusal.rule)
            else:  # never started: it stays pending
                self.data.last_error = self._error_line(step, outcome, refusal.rule)
            self.data.step_retries, self.data.step_outcome = 0, None
            self.move(
                S.HANDED_OFF,
                at=at,
                actor="runtime",
                reason=clip(
                    f"compensation {step.tool_call_id} ({step.tool}) of {undo.of if undo else '?'} not started: the "
                    f"current policy refuses it [{refusal.rule}]: {refusal.message}; needs a human; {self._undo_left()}",
                    REASON_CHARS,
                ),
                refs=self._end_refs(step, outcome, refusal.rule),
            )
            return
        self._not_started(
            step, refusal.rule, f"write not started: the current policy refuses it [{refusal.rule}]: {refusal.message}", at
        )

    def _not_started(self, step: PlanStep, code: str, why: str, at: datetime) -> None:
        """The step's (next) attempt is not started: the step ends. An earlier attempt may
        still have applied: then a human decides (HANDED_OFF), else EXECUTION_FAILED."""
        outcome = self.data.step_outcome or "failed"
        self._end_step(step, outcome, code)
        self.move(
            S.HANDED_OFF if outcome == "unknown" else S.EXECUTION_FAILED,
            at=at,
            actor="runtime",
            reason=f"{why}; {self._describe(step, outcome, started=False)}",
            refs=self._end_refs(step, outcome, code),
        )

    def capability_bounced(self, failure: ToolFailure) -> None:
        """The attempt reached a worker that could not check its capability (key id missing, or
        it waited past its expiry): the tool was not called; the run schedules it again with a
        fresh capability. ``last_error`` (the Web UI details) names why (the key id)."""
        step = self.current_step()
        _require(step is not None and self.state in (S.EXECUTING_TOOL, S.COMPENSATING), "no write attempt")
        self.data.tool_calls -= 1  # never reached the tool
        self.data.last_error = clip(
            f"{failure.code}: tool call {step.tool_call_id} ({step.tool}) not started, scheduled again: "
            f"{failure.message}",
            300,
        )

    def tool_succeeded(self, outcome: ToolOutcome, at: datetime) -> None:
        step = self.current_step()
        _require(step is not None, "no plan step to execute")
        refs = self.step_refs(step).model_copy(update={"outcome": "ok"})
        if self.state == S.COMPENSATING:
            undo = self.current_undo()
            self._record_step(step, "ok", outcome)
            self.data.last_error, self.data.step_retries, self.data.step_outcome = None, 0, None
            self.move(
                S.COMPENSATING,
                at=at,
                actor="runtime",
                reason=f"compensation {step.tool_call_id} ({step.tool}) of {undo.of} ({undo.of_tool}) succeeded",
                refs=refs,
            )
            return
        self._record_step(step, "ok", outcome)
        undo = self._note_compensation(step, outcome)
        self.data.last_error = None
        self.data.next_step += 1
        self.move(
            S.OBSERVING_RESULT,
            at=at,
            actor="runtime",
            reason=f"tool call {step.tool_call_id} ({step.tool}) succeeded" + undo,
            refs=refs,
        )

    def tool_failed(self, failure: ToolFailure, at: datetime) -> float | None:
        """Apply the retry rule. Returns the backoff in seconds when the call is to be retried.

        Records and ``last_error`` name the error code, tool, call and outcome, never the
        error's text (it may quote arguments); the workflow logs the text.
        """
        data = self.data
        step = self.current_step()
        _require(step is not None, "no plan step to execute")
        info = self.tool_info(step)
        effect = info.effect if info else ToolEffect.UNSAFE
        outcome = policy.failure_outcome(effect, permanent=failure.permanent, started=failure.started)
        data.step_outcome = outcome
        next_state, why = policy.after_tool_failure(
            effect,
            permanent=failure.permanent,
            retries_done=data.step_retries,
            max_retries=info.max_retries if info else 0,
            attempt_over=not failure.still_running,
        )
        refs = self._end_refs(step, outcome, failure.code)
        compensating = self.state == S.COMPENSATING
        what = f"{'compensation' if compensating else 'tool call'} {step.tool_call_id} ({step.tool}) failed [{failure.code}], outcome {outcome}"
        if next_state != S.RETRY_WAIT:
            self._end_step(step, outcome, failure.code)
            if compensating:
                # Never a blind re-run of an undo: a person takes it from here.
                self.move(
                    S.HANDED_OFF, at=at, actor="runtime",
                    reason=f"{what} — {why}; the compensation is not re-run, needs a human; {self._undo_left()}",
                    refs=refs,
                )
            elif next_state == S.EXECUTION_FAILED and outcome == "failed" and self.compensates():
                self.data.step_retries, self.data.step_outcome = 0, None
                self.move(
                    S.COMPENSATING, at=at, actor="runtime",
                    reason=f"{what} — {why}; on_failure=compensate: {self._undo_left(start=True)}",
                    refs=refs,
                )
            else:
                self.move(next_state, at=at, actor="runtime", reason=f"{what} — {why}", refs=refs)
            return None
        data.last_error = self._error_line(step, outcome, failure.code)
        # Unknown: whatever the attempt sent must have landed before a retry (or lookup) runs.
        settle = policy.settle_seconds(policy.tool_timeouts(info.timeout_seconds), failure.code) if info and outcome == "unknown" else 0.0
        delay = policy.retry_delay_seconds(data.step_retries, failure.suggested_delay, settle)
        data.step_retries += 1
        data.retries += 1
        # A compensation waits out its backoff in COMPENSATING: the retry is on the record.
        self.move(S.COMPENSATING if compensating else S.RETRY_WAIT, at=at, actor="runtime", reason=f"{what}: {why} in {delay:g}s", refs=refs)
        return delay

    def retry(self, at: datetime) -> None:
        step = self.current_step()
        _require(step is not None, "no plan step to execute")
        if self.state == S.COMPENSATING:
            return  # recorded when the retry was decided; the next attempt follows
        self.move(S.EXECUTING_TOOL, at=at, actor="runtime", reason=f"retry {self.data.step_retries}", refs=self.step_refs(step))

    def handoff_point(self) -> tuple[str, Refs | None]:
        """What a handoff taken before the current step's (next) attempt says: the detail for
        its reason, and refs naming the outcome of an earlier attempt if one failed."""
        step = self.current_step()
        _require(step is not None, "no plan step to execute")
        outcome = self.data.step_outcome
        if outcome is None:
            return f"tool call {step.tool_call_id} not started", None
        return self._describe(step, outcome, started=False), self._end_refs(step, outcome, "handed_off")

    def step_handed_off(self) -> None:
        """That handoff was taken: an earlier attempt's outcome ends the step."""
        if self.data.lifecycle.previous_state == S.COMPENSATING:
            undo = self.current_undo()
            if undo is not None and self.data.step_outcome is not None:
                undo.status = self.data.step_outcome  # an earlier attempt of the undo failed
            return
        step = self.current_step()
        if step is not None and self.data.step_outcome is not None:
            self._end_step(step, self.data.step_outcome, "handed_off")

    def tool_settled_on_cancel(self, outcome: ToolOutcome | None, failure: ToolFailure | None = None) -> None:
        """A cancellation reached the tool in flight and waited for it: keep what it did.
        ``cancelled()`` then ends the run naming the step and its outcome."""
        step = self.current_step()
        _require(step is not None, "no plan step to execute")
        if outcome is not None:
            compensating = self.state == S.COMPENSATING
            self._record_step(step, "ok", outcome)
            if not compensating:
                self._note_compensation(step, outcome)
                self.data.next_step += 1
            self.data.last_error = self._error_line(step, "ok", "cancelled")
            self._settled = (step, "ok", None)
            return
        info = self.tool_info(step)
        effect = info.effect if info else ToolEffect.UNSAFE
        settled: EffectOutcome = "failed"
        if failure is not None:
            settled = policy.failure_outcome(effect, permanent=failure.permanent, started=failure.started)
        if settled == "failed" and self.data.step_outcome == "unknown":
            settled = "unknown"  # this attempt did nothing, an earlier one may have
        code = failure.code if failure else "cancelled"
        self._end_step(step, settled, code)
        self._settled = (step, settled, code)

    # The step a cancel waited for, as tool_settled_on_cancel recorded it: (step, outcome, code).
    _settled: tuple[PlanStep, EffectOutcome, str | None] | None = None

    def _step_ended_by(self, code: str) -> tuple[Refs, str] | None:
        """Refs and a description for a record that ends the run mid-step (a cancel), after
        recording the step; None when no step was under way."""
        if self._settled is not None:
            step, outcome, settled_code = self._settled
            return self._end_refs(step, outcome, settled_code), self._describe(step, outcome)
        step = self.current_step()
        outcome = self.data.step_outcome
        if step is None or outcome is None or self.state not in (S.EXECUTING_TOOL, S.RETRY_WAIT, S.COMPENSATING):
            return None
        self._end_step(step, outcome, code)
        return self._end_refs(step, outcome, code), self._describe(step, outcome)

    def _describe(self, step: PlanStep, outcome: EffectOutcome, *, started: bool = True) -> str:
        if not started:
            if outcome == "failed" and self.data.step_outcome is None:
                return f"tool call {step.tool_call_id} ({step.tool}) not started"
            return f"retry of tool call {step.tool_call_id} ({step.tool}) not started, outcome {outcome}"
        return f"tool call {step.tool_call_id} ({step.tool}): outcome {outcome}"

    def _end_refs(self, step: PlanStep, outcome: EffectOutcome, code: str | None) -> Refs:
        return self.step_refs(step).model_copy(update={"outcome": outcome, "error_code": code})

    def _error_line(self, step: PlanStep, outcome: EffectOutcome, code: str) -> str:
        return f"{code}: tool call {step.tool_call_id} ({step.tool}), outcome {outcome}"

    def _end_step(self, step: PlanStep, outcome: EffectOutcome, code: str) -> None:
        """The step ends without success: record it and say so in ``last_error``."""
        self._record_step(step, outcome, None)
        self.data.last_error = self._error_line(step, outcome, code)

    def _record_step(self, step: PlanStep, outcome: EffectOutcome, result: ToolOutcome | None) -> None:
        compensating = self.state == S.COMPENSATING
        if compensating:
            undo = self.current_undo()
            _require(undo is not None and undo.tool_call_id == step.tool_call_id, "no compensation under way")
            undo.status = outcome
        self.data.executed.append(
            ExecutedStep(
                tool_call_id=step.tool_call_id,
                tool=step.tool,
                args=step.args,
                status="ok" if outcome == "ok" else "failed",
                outcome=outcome,
                observation=result.observation if result else "",
                digest=result.digest if result else "",
            )
        )
        if outcome != "failed" and not compensating:  # it may have applied: it counts against the run's amount limits
            policy.spend(self.data.spent, step.tool, step.args)
        self._trim_executed()

    def outcome(self, run_id: str) -> RunOutcome:
        """The run's result: bounded, without the steps and the timeline (the queries and the
        audit sink have them), with their counts."""
        data = self.data
        return RunOutcome(
            run_id=run_id,
            state=data.lifecycle.state,
            answer=data.answer,
            records=data.lifecycle.records,
            steps_executed=data.steps_executed,
            steps_before=data.executed_before,
            steps_digest=data.executed_digest,
            compensations=data.compensations,
        )

    def steps(self) -> list[ExecutedStep]:
        """The executed steps: ids, outcomes and digests, no arguments or observations."""
        return [s.model_copy(update={"observation": "", "args": {}}) for s in self.data.executed]

    def snapshot_request(self, workflow_id: str, started_at: datetime) -> SnapshotRequest:
        """What the run's policy snapshot asks for: the tenant and the start's signature."""
        request = self.request
        return SnapshotRequest(
            tenant=request.tenant,
            workflow_id=workflow_id,
            requested_by=request.requested_by,
            request_digest=request.request_digest(),
            requester_signature=request.requester_signature,
            nonce=request.nonce,
            issued_at=request.issued_at,
            started_at=started_at,
        )

    def fold_for_carry(self) -> None:
        """Before continue-as-new: the next run gets the latest EXECUTED_WINDOW steps (older
        ones as a count and a running digest) and the timeline's head and latest records (the
        audit sink has every one): the carried state stops growing with the run."""
        _fold(self.data)

    def carried_bytes(self) -> int:
        """What continue-as-new would write now (the folded state and the request), without
        folding the run's own state: the live timeline keeps its window until the run goes."""
        folded = self.data.model_copy(deep=True)
        _fold(folded)
        return len(folded.model_dump_json()) + len(self.request.model_dump_json(exclude={"carryover"}))

    def _trim_executed(self) -> None:
        """Older steps keep only id, tool, status and digest: the carried state stays bounded."""
        room = EXECUTED_OBSERVATION_CHARS
        for i, done in enumerate(reversed(self.data.executed)):
            if i >= EXECUTED_WINDOW and not done.args and not done.observation:
                break  # trimmed already, and so is every step before it (each call trims them)
            room -= len(done.observation)
            if i >= EXECUTED_WINDOW or room < 0:
                done.args, done.observation = {}, ""

    # ------------------------------------------------------------------ recovery

    def on_failure(self) -> str:
        """The run's on_failure: its request's, else the tenant's default."""
        if self.request.on_failure is not None:
            return self.request.on_failure
        return self.tenant.on_failure if self.tenant else "stop"

    def on_cancel(self) -> str:
        """The run's on_cancel: its request's, else the tenant's default."""
        if self.request.on_cancel is not None:
            return self.request.on_cancel
        return self.tenant.on_cancel if self.tenant else "stop"

    def compensates(self) -> bool:
        """Does a step failing with its outcome known put the run's ok writes back?"""
        return self.on_failure() == "compensate" and self.current_undo() is not None

    def current_undo(self) -> CompensationCall | None:
        """The next compensation to run: the newest ok write not yet compensated."""
        return next((c for c in reversed(self.data.compensations) if c.status == "pending"), None)

    def _note_compensation(self, step: PlanStep, outcome: ToolOutcome) -> str:
        """An ok write: build its undo now, from the declaration its plan hash covers (plans
        hashed before recovery existed have none), and say on the record what it came to."""
        data, plan = self.data, self.data.plan
        info = self.tool_info(step)
        if plan is None or plan.undo is None or (info is not None and info.effect == ToolEffect.READ_ONLY):
            return ""
        index = next((i for i, s in enumerate(plan.steps) if s.tool_call_id == step.tool_call_id), None)
        declared = plan.undo[index] if index is not None else None
        result, problem = recovery.result_document(outcome.observation, outcome.truncated)
        call = recovery.compensation_call(
            declared,
            of=step.tool_call_id,
            of_tool=step.tool,
            args=step.args,
            result=result,
            result_problem=problem,
            idempotency_key=self.step_refs(step).idempotency_key or "",
            plan_hash=plan.plan_hash,
            approved_by=[a.approver for a in data.approval.approvals] if data.approval else [],
        )
        data.compensations.append(call)
        if call.tool is not None:
            return f"; undo: {call.tool}"
        return f"; no recovery path: {call.error}"

    def _undo_left(self, *, start: bool = False) -> str:
        pending = [c for c in reversed(self.data.compensations) if c.status == "pending"]
        done = [c for c in self.data.compensations if c.status == "ok"]
        names = ", ".join(f"{c.of} ({c.of_tool}) by {c.tool or 'nothing: no recovery path'}" for c in pending[:20])
        if start:
            return f"undoing {len(pending)} ok write(s), newest first: {names}"
        return f"compensated {len(done)}; not compensated: {names or 'none'}"

    def compensation_ready(self, at: datetime) -> bool:
        """COMPENSATING: True when the next compensation may run; else the run ends here
        (COMPENSATED when none is left, HANDED_OFF when the next one cannot be run)."""
        _require(self.state == S.COMPENSATING, "not COMPENSATING")
        undo = self.current_undo()
        if undo is None:
            done = [c for c in self.data.compensations if c.status == "ok"]
            self.move(
                S.COMPENSATED,
                at=at,
                actor="runtime",
                reason=f"all {len(done)} compensation(s) done: "
                + ", ".join(f"{c.of} ({c.of_tool}) undone by {c.tool}" for c in done[-20:]),
            )
            return False
        problem = None
        if undo.tool is None:
            problem = f"tool call {undo.of} ({undo.of_tool}) cannot be undone: {undo.error}"
        elif self.catalog.get(undo.tool) is None:
            problem = f"compensating tool {undo.tool!r} of {undo.of} is not in the run's catalog"
        elif (refused := policy.tool_refusal(self.tenant, undo.tool)) is not None:
            problem = f"the compensation of {undo.of}: {refused}"
        elif not undo.plan_hash:
            problem = f"the compensation of {undo.of} was covered by no approved plan hash"
        if problem is not None:
            self.move(
                S.HANDED_OFF,
                at=at,
                actor="runtime",
                reason=f"{problem}; needs a human; {self._undo_left()}",
                refs=Refs(plan_hash=undo.plan_hash or None, tool_call_id=undo.of, error_code="no_recovery_path"),
            )
            return False
        return True

    def begin_compensation(self, source: RecoverySource, at: datetime) -> None:
        """A compensation run (``tether compensate``): the original run's record is in. Run the
        compensations its approvals covered, if the requester may; else fail, saying why."""
        _require(self.state == S.RECEIVED and self.request.compensate_run is not None, "not a compensation run")
        by = self.request.requested_by
        actor = self.actor(by, self.data.requester_verified)
        refusal = source.refusal or policy.compensator_refusal(self.tenant, by)
        pending = [c for c in source.compensations if c.status != "ok"]
        if refusal is None and source.state not in policy.COMPENSABLE_STATES:
            state = source.state.value if source.state else "unknown"
            refusal = Refusal(rule="not_compensable", message=f"run {source.run_id} ended {state}: only runs "
                              f"ended {', '.join(sorted(s.value for s in policy.COMPENSABLE_STATES))} are compensated")
        if refusal is None and not pending:
            refusal = Refusal(rule="nothing_to_compensate", message=f"run {source.run_id} has no ok write left to compensate")
        if refusal is None and any(not c.plan_hash for c in pending):
            refusal = Refusal(rule="not_approved", message="a compensation of that run is covered by no plan hash")
        if refusal is not None:
            self.data.last_error = f"{refusal.rule}: {refusal.message}"
            self.move(S.FAILED, at=at, actor=actor, reason=f"compensation refused [{refusal.rule}]: {refusal.message}",
                      refs=Refs(error_code=refusal.rule))
            return
        self.data.compensations = [c.model_copy(update={"status": "pending"}) for c in source.compensations if c.status != "ok"]
        hashes = ", ".join(sorted({c.plan_hash[:12] for c in pending}))
        self.move(
            S.COMPENSATING,
            at=at,
            actor=actor,
            reason=f"compensation of run {source.run_id} requested by {by}, covered by the approval of plan "
            f"{hashes}: {self._undo_left(start=True)}",
            refs=Refs(plan_hash=pending[-1].plan_hash),
        )


def _plain(decision: Decision) -> ApprovalDecision:
    """The fields every decision has (a revision's editor as its approver)."""
    return decision.as_decision() if isinstance(decision, RevisionRequest) else decision


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def notify_event(record: TransitionRecord) -> str | None:
    """The event a record is, for webhooks (``[notify.webhooks.NAME] events``), or None."""
    if record.kind == "escalated":
        return "escalated"
    if record.kind != "transition":
        return None
    to, came = record.to_state, record.from_state
    if to == S.AWAITING_APPROVAL:
        return "awaiting_approval"
    if came == S.AWAITING_APPROVAL and to == S.VALIDATED:
        return "revised"
    if to == S.EXPIRED or (came == S.AWAITING_APPROVAL and to == S.PLANNING and record.actor == "timer"):
        return "expired"
    if to == S.HANDED_OFF:
        return "handed_off"
    if to in (S.FAILED, S.EXECUTION_FAILED):
        return "failed"
    return None


def _fold(data: RunData) -> None:
    """Engine.fold_for_carry, on any state."""
    old = data.executed[: max(len(data.executed) - EXECUTED_WINDOW, 0)]
    digest = data.executed_digest
    for done in old:
        digest = hashlib.sha256(f"{digest}|{done.tool_call_id}|{done.outcome}|{done.digest}".encode()).hexdigest()
    data.executed_digest = digest
    data.executed_before += len(old)
    data.executed_ok_before += sum(1 for done in old if done.status == "ok")
    del data.executed[: len(old)]
    data.lifecycle.fold(CARRY_TIMELINE_TAIL)


def cancel_actor(reason: str | None) -> tuple[str, str | None]:
    """Who asked for a cancel: `tether cancel RUN --by NAME --reason R` sends "by NAME: R" as
    Temporal's cancellation reason (a claim, like any unsigned name). Anything else: the
    runtime, with the reason as given."""
    text = reason or ""
    name, sep, rest = text[3:].partition(": ") if text.startswith("by ") else ("", "", "")
    try:
        name = normalize_name(name) if sep else ""
    except ValueError:
        name = ""
    if not name:
        return "runtime", reason
    return f"user:{name}", rest or None
