"""The ``AgentRun`` workflow: a governed, durable agent run.

The planner proposes, this workflow decides. Every state change goes through the transition
table in ``workflows/states.py``; every side effect is an activity with an idempotency key and
a retry rule derived from the tool's declared effect; approvals are bound to a plan hash and
expire on a durable timer.

Deterministic code only: time is ``workflow.now()``, ids come from ``workflow.uuid4()``, no
I/O and no environment reads.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Literal

from temporalio import workflow
from temporalio.common import (
    RetryPolicy,
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
)
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from workflows import metrics as run_metrics
    from workflows import policy
    from workflows.models import (
        AcceptedApproval,
        ApprovalDecision,
        AuthorityCheck,
        CatalogRequest,
        DecisionCheck,
        ExecutedStep,
        HandoffRequest,
        Limits,
        PendingApproval,
        PlannerInput,
        PlanReview,
        PlanStep,
        PolicySnapshot,
        Proposal,
        Refusal,
        RunData,
        RunOutcome,
        RunRequest,
        RunSnapshot,
        SnapshotRequest,
        TenantPolicy,
        ToolCall,
        ToolCatalog,
        ToolOutcome,
        Verdict,
    )
    from workflows.states import IllegalTransition, Refs, RunState, TransitionRecord
    from workflows.validation import validate_proposal

S = RunState

# Public: the Web UI and `temporal workflow list --query` filter on these.
STATE_ATTRIBUTE = SearchAttributeKey.for_keyword("AgentRunState")
TENANT_ATTRIBUTE = SearchAttributeKey.for_keyword("AgentTenant")
SEARCH_ATTRIBUTES = (STATE_ATTRIBUTE, TENANT_ATTRIBUTE)

PLANNER_TIMEOUT = timedelta(minutes=2)
PLANNER_RETRY = RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=1))
CATALOG_TIMEOUT = timedelta(seconds=30)
# Tools run exactly as scheduled: the workflow owns their retries, so each one is a
# EXECUTING_TOOL -> RETRY_WAIT -> EXECUTING_TOOL hop on the timeline and an unsafe tool is never
# re-run behind our back.
TOOL_RETRY = RetryPolicy(maximum_attempts=1)

DecisionKind = Literal["approve", "reject"]


@workflow.defn(name="AgentRun")
class AgentRun:
    @workflow.init
    def __init__(self, request: RunRequest) -> None:
        self.request = request
        self.data: RunData = request.carryover or RunData()
        # Decisions that passed the cheap checks in the signal handler, in arrival order; the
        # main loop checks each against the policy (an activity) and acts on it.
        self._inbox: list[tuple[DecisionKind, ApprovalDecision]] = []
        self._handoff: HandoffRequest | None = None
        self._published: str | None = workflow.info().typed_search_attributes.get(
            STATE_ATTRIBUTE
        )

    # ------------------------------------------------------------------ main loop

    @workflow.run
    async def run(self, request: RunRequest) -> RunOutcome:
        try:
            await self._drive()
        except asyncio.CancelledError:
            self._move(
                S.CANCELLED,
                actor="runtime",
                reason=f"cancellation requested: {workflow.cancellation_reason() or 'no reason'}",
            )
            self._publish()
            raise
        self._publish()
        return RunOutcome(
            run_id=workflow.info().workflow_id,
            state=self.data.lifecycle.state,
            answer=self.data.answer,
            steps=self.data.executed,
            timeline=self.data.lifecycle.timeline,
        )

    async def _drive(self) -> None:
        data = self.data
        if data.created_at is None:
            data.created_at = data.updated_at = workflow.now()
        if data.catalog is None:
            # One snapshot per run: validation must not change under a run's feet.
            self._publish()
            data.catalog = await workflow.execute_activity(
                "tool_catalog",
                CatalogRequest(tenant=self.request.tenant),
                result_type=ToolCatalog,
                start_to_close_timeout=CATALOG_TIMEOUT,
                summary="tool catalog snapshot",
            )
        if data.policy is None:
            self._publish()
            data.policy = await workflow.execute_activity(
                "policy_snapshot",
                SnapshotRequest(tenant=self.request.tenant),
                result_type=PolicySnapshot,
                start_to_close_timeout=CATALOG_TIMEOUT,
                summary="policy snapshot",
            )
        if data.lifecycle.state == S.RECEIVED:
            # The policy's content hash goes on the timeline: a run's decisions stay explainable.
            refs = Refs(policy_hash=data.policy.policy_hash)
            if data.policy.policy is None:
                self._move(
                    S.FAILED,
                    actor="runtime",
                    reason=f"tenant {self.request.tenant!r} is not in the policy file "
                    f"{data.policy.source}: add it under [tenants.{self.request.tenant}]",
                    refs=refs,
                )
            else:
                self._move(
                    S.PLANNING, actor="runtime", reason=f"run received; policy {data.policy.source}", refs=refs
                )

        while not data.lifecycle.terminal:
            self._maybe_continue_as_new()
            state = data.lifecycle.state
            if state == S.PLANNING:
                await self._plan()
            elif state == S.VALIDATION_FAILED:
                self._after_validation_failed()
            elif state == S.VALIDATED:
                self._after_validated()
            elif state == S.AWAITING_APPROVAL:
                await self._await_decision()
            elif state == S.APPROVED:
                await self._after_approved()
            elif state == S.EXECUTING_TOOL:
                await self._execute_step()
            elif state == S.OBSERVING_RESULT:
                await self._after_observation()
            else:
                raise ApplicationError(
                    f"no handler for working state {state.value}",
                    type="IllegalState",
                    non_retryable=True,
                )

    # ------------------------------------------------------------------ states

    async def _plan(self) -> None:
        data = self.data
        if self._take_handoff():
            return
        max_tokens = self.limits.max_model_tokens
        if max_tokens is not None and data.model_tokens >= max_tokens:
            self._move(
                S.FAILED,
                actor="runtime",
                reason=f"model token budget used up: {data.model_tokens} of "
                f"max_model_tokens={max_tokens} used",
                refs=Refs(error_code="model_token_budget"),
            )
            return
        data.planning_rounds += 1
        # The planner's input carries tool results newest first up to 16,000 characters in all
        # (older ones keep only their digest; activities/planning.py MODEL_CONTEXT_CHARS), so
        # history does not grow with the size of tool results however long the run.
        context, room = [], 16_000
        for done in reversed(data.executed):
            fits = len(done.observation) <= room
            room = room - len(done.observation) if fits else 0
            context.append(done if fits else done.model_copy(update={"observation": ""}))
        context.reverse()
        self._publish()
        try:
            proposal = await workflow.execute_activity(
                "plan",
                PlannerInput(
                    goal=self.request.goal,
                    planner=self.request.planner,
                    playbook=self.request.playbook,
                    executed=context,
                    feedback=data.feedback,
                    round=data.planning_rounds,
                ),
                result_type=Proposal,
                start_to_close_timeout=PLANNER_TIMEOUT,
                retry_policy=PLANNER_RETRY,
                summary=f"plan · {self.request.planner} · round {data.planning_rounds}",
            )
        except ActivityError as err:
            code, message, _ = _failure_details(err)
            data.last_error = f"{code}: {message}"
            self._move(
                S.FAILED,
                actor="planner",
                reason=f"planner failed: {message}",
                refs=Refs(error_code=code),
            )
            return
        data.model_tokens += proposal.usage_tokens
        if max_tokens is not None and data.model_tokens > max_tokens:
            data.last_error = f"model_token_budget: {data.model_tokens} > {max_tokens}"
            self._move(
                S.FAILED,
                actor="runtime",
                reason=f"model token budget exceeded: {data.model_tokens} of "
                f"max_model_tokens={max_tokens} used; the proposal was discarded",
                refs=Refs(error_code="model_token_budget"),
            )
            return
        if self._take_handoff():
            return
        if proposal.answer is not None and not proposal.steps:
            data.answer = proposal.answer
            self._move(S.COMPLETED, actor="planner", reason="planner finished with an answer")
            return
        result = validate_proposal(
            proposal,
            data.catalog or ToolCatalog(),
            executed_steps=len(data.executed),
            limits=self.limits,
            new_id=lambda n: f"tc-{n:03d}-{workflow.uuid4().hex[:8]}",
            tool_refusal=lambda tool: policy.tool_refusal(self.tenant_policy, tool),
        )
        if result.plan is None:
            data.feedback = result.reason
            self._move(S.VALIDATION_FAILED, actor="runtime", reason=result.reason)
            return
        data.plan, data.next_step, data.feedback = result.plan, 0, None
        self._move(
            S.VALIDATED,
            actor="runtime",
            reason=f"plan of {len(result.plan.steps)} step(s) validated",
            refs=Refs(plan_hash=result.plan.plan_hash),
        )

    def _after_validation_failed(self) -> None:
        limits = self.limits
        if policy.may_replan(self.data.replans, limits):
            self.data.replans += 1
            self._move(
                S.PLANNING,
                actor="runtime",
                reason=f"replan {self.data.replans}/{limits.max_replans} with validation feedback",
            )
        else:
            self._move(
                S.FAILED,
                actor="runtime",
                reason=f"validation failed and the replan budget is used up "
                f"(max_replans={limits.max_replans})",
            )

    def _after_validated(self) -> None:
        data = self.data
        assert data.plan is not None
        review = self._review()
        if not review.needs_approval:
            self._move_to_step(reason=f"policy needs no approval: {review.summary}")
            return
        self._request_approval(S.AWAITING_APPROVAL, reason=f"approval needed: {review.summary}")

    def _review(self) -> PlanReview:
        assert self.data.plan is not None
        return policy.review_plan(self.data.plan, self.data.catalog or ToolCatalog(), self.tenant_policy)

    def _request_approval(self, to: RunState, *, reason: str) -> None:
        """Open a fresh approval request for the current plan (no approvals carried over)."""
        data = self.data
        assert data.plan is not None
        review = self._review()
        ttl = self.request.limits.approval_ttl_seconds
        if review.ttl_seconds is not None:
            ttl = min(ttl, review.ttl_seconds)  # the stricter of the run's and the policy's
        data.pending_approval = PendingApproval(
            plan_hash=data.plan.plan_hash,
            expires_at=workflow.now() + timedelta(seconds=ttl),
            summary=review.summary,
            risk="high" if review.risk == "high" else "normal",
            approvals_required=review.approvals_required,
            roles=review.roles,
        )
        data.approved_by = []
        self._move(to, actor="runtime", reason=reason, refs=Refs(plan_hash=data.plan.plan_hash))

    async def _await_decision(self) -> None:
        data = self.data
        pending = data.pending_approval
        if pending is None:
            raise ApplicationError(
                "AWAITING_APPROVAL without a pending approval", type="IllegalState", non_retryable=True
            )
        remaining = (pending.expires_at - workflow.now()).total_seconds()
        if remaining > 0 and not self._inbox and self._handoff is None:
            self._publish()
            try:
                await workflow.wait_condition(
                    lambda: bool(self._inbox)
                    or self._handoff is not None
                    or workflow.info().is_continue_as_new_suggested(),
                    timeout=timedelta(seconds=remaining),
                    timeout_summary="approval expiry",
                )
            except asyncio.TimeoutError:
                pass
        if self._take_handoff():
            self._leave_approval()
            return
        if self._inbox:
            await self._settle_decision(*self._inbox.pop(0))
            return
        if workflow.now() < pending.expires_at:
            return  # woken to continue as new; the loop does that and comes back here
        refs = Refs(plan_hash=pending.plan_hash)
        limits = self.limits
        if limits.on_expiry == "replan" and policy.may_replan(data.replans, limits):
            data.replans += 1
            self._move(
                S.PLANNING,
                actor="timer",
                reason=f"approval expired at {pending.expires_at.isoformat()}: replanning "
                f"({data.replans}/{limits.max_replans})",
                refs=refs,
            )
        else:
            self._move(
                S.EXPIRED,
                actor="timer",
                reason=f"approval expired at {pending.expires_at.isoformat()}",
                refs=refs,
            )
        self._leave_approval()

    async def _settle_decision(self, kind: DecisionKind, decision: ApprovalDecision) -> None:
        """Check a decision against the current policy (tenant, role, four-eyes, signature)."""
        data = self.data
        pending = data.pending_approval
        assert pending is not None
        refs = Refs(plan_hash=decision.plan_hash, decision_id=decision.decision_id)
        actor = f"user:{decision.approver}"
        already = [a.approver for a in pending.approvals]
        verdict = await workflow.execute_activity(
            "policy_check_decision",
            DecisionCheck(
                tenant=self.request.tenant,
                workflow_id=workflow.info().workflow_id,
                kind=kind,
                decision=decision,
                requested_by=self.request.requested_by,
                roles=pending.roles,
                already_approved=already,
            ),
            result_type=Verdict,
            start_to_close_timeout=CATALOG_TIMEOUT,
            summary=f"policy check · {kind} by {decision.approver}",
        )
        # The run may have moved on (expiry, handoff) while the policy was consulted.
        refusal = verdict.refusal or policy.decision_refusal(
            decision, data, now=workflow.now(), check_duplicate=False
        )
        if refusal is not None:
            self._refuse(actor, f"{kind} refused: {refusal.message}", refusal.rule, refs)
            return
        if kind == "reject":
            self._move(S.REJECTED, actor=actor, reason=decision.reason or "rejected", refs=refs)
            self._leave_approval()
            return
        pending.approvals.append(
            AcceptedApproval(approver=decision.approver, decision_id=decision.decision_id, at=workflow.now())
        )
        data.approved_by = [a.approver for a in pending.approvals]
        if len(pending.approvals) < pending.approvals_required:
            data.lifecycle.accept(
                at=workflow.now(),
                actor=actor,
                reason=f"approval {len(pending.approvals)}/{pending.approvals_required} accepted: "
                f"{decision.comment or 'approved'}",
                refs=refs,
            )
            return
        self._move(S.APPROVED, actor=actor, reason=decision.comment or "approved", refs=refs)
        self._leave_approval()

    def _leave_approval(self) -> None:
        """The run left AWAITING_APPROVAL: decisions still queued can no longer count."""
        for kind, decision in self._inbox:
            self._refuse(
                f"user:{decision.approver}",
                f"{kind} refused: run is {self.data.lifecycle.state.value}, not AWAITING_APPROVAL",
                "not_awaiting_approval",
                Refs(plan_hash=decision.plan_hash, decision_id=decision.decision_id),
            )
        self._inbox.clear()

    async def _after_approved(self) -> None:
        """Just before an approved plan's writes run: do its approvals still hold?"""
        refusal = await self._authority_refusal(from_step=self.data.next_step)
        if refusal is not None:
            self._request_approval(
                S.AWAITING_APPROVAL,
                reason=f"approval no longer holds [{refusal.rule}]: {refusal.message}; "
                f"a new approval is needed",
            )
            return
        self._move_to_step(reason="approved plan: executing")

    async def _authority_refusal(self, *, from_step: int) -> Refusal | None:
        """Re-check, through the policy activity, the approvals of the plan's remaining writes."""
        data = self.data
        pending = data.pending_approval
        if data.plan is None or pending is None:
            return None
        catalog = data.catalog or ToolCatalog()
        tools = [
            s.tool
            for s in data.plan.steps[from_step:]
            if (info := catalog.get(s.tool)) is None or info.effect.value != "read_only"
        ]
        if not tools:
            return None
        verdict = await workflow.execute_activity(
            "policy_check_authority",
            AuthorityCheck(
                tenant=self.request.tenant,
                approvals=[a.approver for a in pending.approvals],
                tools=tools,
                roles=pending.roles,
                approvals_required=pending.approvals_required,
            ),
            result_type=Verdict,
            start_to_close_timeout=CATALOG_TIMEOUT,
            summary="policy re-check before writes",
        )
        return verdict.refusal

    def _move_to_step(self, *, reason: str) -> None:
        """Enter EXECUTING_TOOL for the plan's next step."""
        step = self._current_step()
        self._move(S.EXECUTING_TOOL, actor="runtime", reason=reason, refs=self._step_refs(step))

    async def _execute_step(self) -> None:
        data = self.data
        step = self._current_step()
        info = (data.catalog or ToolCatalog()).get(step.tool)
        if info is None:
            raise ApplicationError(
                f"tool {step.tool} left the catalog snapshot", type="IllegalState", non_retryable=True
            )
        refs = self._step_refs(step)
        retries_done = 0
        while True:
            if self._take_handoff(detail=f"tool call {step.tool_call_id} not started"):
                return
            max_calls = self.tenant_policy.budgets.max_tool_calls if self.tenant_policy else None
            if max_calls is not None and data.tool_calls >= max_calls:
                self._record_step(step, "failed", None)
                self._move(
                    S.EXECUTION_FAILED,
                    actor="runtime",
                    reason=f"tool call budget exhausted: {data.tool_calls} of max_tool_calls="
                    f"{max_calls} used; tool call {step.tool_call_id} ({step.tool}) not started",
                    refs=refs.model_copy(update={"error_code": "tool_call_budget"}),
                )
                return
            self._publish()
            data.tool_calls += 1  # every call the workflow schedules, retries included
            handle = workflow.start_activity(
                "execute_tool",
                ToolCall(
                    tool=step.tool,
                    args=step.args,
                    tool_call_id=step.tool_call_id,
                    idempotency_key=refs.idempotency_key or "",
                    run_id=workflow.info().workflow_id,
                    tenant=self.request.tenant,
                    attempt=retries_done + 1,
                ),
                result_type=ToolOutcome,
                start_to_close_timeout=timedelta(seconds=info.timeout_seconds),
                retry_policy=TOOL_RETRY,
                summary=f"{step.tool} · {info.effect.value} · step {data.next_step + 1}",
            )
            cancelled = False
            try:
                try:
                    # Shielded: a cancellation waits for the tool to settle, so its outcome is
                    # known and recorded before the run ends.
                    outcome = await asyncio.shield(handle)
                except asyncio.CancelledError:
                    cancelled = True
                    outcome = await handle
            except ActivityError as err:
                code, message, suggested = _failure_details(err)
                permanent = _is_permanent(err)
                data.last_error = f"{code}: {message}"
                next_state, why = policy.after_tool_failure(
                    info.effect,
                    permanent=permanent,
                    retries_done=retries_done,
                    max_retries=info.max_retries,
                )
                failed_refs = refs.model_copy(update={"error_code": code})
                if cancelled or next_state != S.RETRY_WAIT:
                    self._record_step(step, "failed", None)
                if cancelled:
                    raise asyncio.CancelledError() from None
                if next_state != S.RETRY_WAIT:
                    actor = "runtime"
                    self._move(
                        next_state,
                        actor=actor,
                        reason=f"tool call {step.tool_call_id} ({step.tool}) failed: {message} — {why}",
                        refs=failed_refs,
                    )
                    return
                delay = policy.retry_delay_seconds(retries_done, suggested)
                retries_done += 1
                data.retries += 1
                self._move(S.RETRY_WAIT, actor="runtime", reason=f"{why} in {delay:g}s: {message}", refs=failed_refs)
                self._publish()
                try:
                    await workflow.wait_condition(
                        lambda: self._handoff is not None,
                        timeout=timedelta(seconds=delay),
                        timeout_summary="retry backoff",
                    )
                except asyncio.TimeoutError:
                    pass
                self._move(S.EXECUTING_TOOL, actor="runtime", reason=f"retry {retries_done}", refs=refs)
                continue
            self._record_step(step, "ok", outcome)
            data.last_error = None
            if cancelled:
                raise asyncio.CancelledError()
            self._move(
                S.OBSERVING_RESULT,
                actor="runtime",
                reason=f"tool call {step.tool_call_id} ({step.tool}) succeeded",
                refs=refs,
            )
            data.next_step += 1
            return

    async def _after_observation(self) -> None:
        data = self.data
        if data.plan is None or data.next_step >= len(data.plan.steps):
            data.pending_approval = None
            self._move(S.PLANNING, actor="runtime", reason="plan executed: planning what is next")
            return
        refusal = await self._authority_refusal(from_step=data.next_step)
        if refusal is not None:
            # The rest of the plan needs a new plan and a new approval.
            data.pending_approval = None
            self._move(
                S.PLANNING,
                actor="runtime",
                reason=f"approval no longer holds [{refusal.rule}]: {refusal.message}; "
                f"replanning the remaining steps",
            )
            return
        self._move_to_step(reason="next step of the approved plan")

    # ------------------------------------------------------------------ signals and queries

    @workflow.signal(
        name="approve",
        description="Approve the pending plan. Data (ApprovalDecision): {\"decision_id\": unique, "
        "\"approver\": name, \"plan_hash\": the pending plan's hash, \"comment\": optional}. "
        "Counts only for the pending plan hash, before the approval expires.",
    )
    def approve(self, decision: ApprovalDecision) -> None:
        self._decide("approve", decision)

    @workflow.signal(
        name="reject",
        description="Reject the pending plan. Data (ApprovalDecision): {\"decision_id\": unique, "
        "\"approver\": name, \"plan_hash\": the pending plan's hash, \"reason\": optional}.",
    )
    def reject(self, decision: ApprovalDecision) -> None:
        self._decide("reject", decision)

    @workflow.signal(
        name="handoff",
        description="Hand the run to a human; it ends in HANDED_OFF. Data (HandoffRequest): "
        "{\"by\": name, \"reason\": text}.",
    )
    def handoff(self, request: HandoffRequest) -> None:
        refusal = policy.handoff_refusal(self.data)
        rule = "run_ended"
        if refusal is None and self._handoff is not None:
            refusal, rule = "a handoff is already pending", "handoff_pending"
        if refusal is None:
            # Membership is checked against the policy snapshot the run took at start.
            member = policy.handoff_member_refusal(self.tenant_policy, request.by)
            if member is not None:
                refusal, rule = member.message, member.rule
        if refusal is not None:
            self._refuse(f"operator:{request.by}", f"handoff refused: {refusal}", rule, Refs())
            return
        self._handoff = request

    @workflow.query(
        name="snapshot",
        description="Current state, plan and plan hash, pending approval with its expiry, steps, "
        "retries and last error (RunSnapshot).",
    )
    def snapshot(self) -> RunSnapshot:
        data = self.data
        return RunSnapshot(
            run_id=workflow.info().workflow_id,
            tenant=self.request.tenant,
            state=data.lifecycle.state,
            previous_state=data.lifecycle.previous_state,
            state_version=data.lifecycle.state_version,
            plan=data.plan,
            pending_approval=data.pending_approval,
            step=len(data.executed),
            retries=data.retries,
            last_error=data.last_error,
            approved_by=data.approved_by,
            answer=data.answer,
            created_at=data.created_at,
            updated_at=data.updated_at,
            model_tokens=data.model_tokens,
        )

    @workflow.query(
        name="timeline",
        description="Audit timeline: every transition and refused decision with actor, reason and "
        "refs (list of TransitionRecord).",
    )
    def timeline(self) -> list[TransitionRecord]:
        return self.data.lifecycle.timeline

    def _decide(self, kind: DecisionKind, decision: ApprovalDecision) -> None:
        """Cheap, state-only checks now; the policy checks follow in the main loop."""
        refusal = policy.decision_refusal(decision, self.data, now=workflow.now(), check_duplicate=True)
        if decision.decision_id not in self.data.decisions_seen:
            self.data.decisions_seen.append(decision.decision_id)
        if refusal is not None:
            self._refuse(
                f"user:{decision.approver}",
                f"{kind} refused: {refusal.message}",
                refusal.rule,
                Refs(plan_hash=decision.plan_hash, decision_id=decision.decision_id),
            )
            return
        self._inbox.append((kind, decision))

    # ------------------------------------------------------------------ helpers

    def _move(self, to: RunState, *, actor: str, reason: str, refs: Refs | None = None) -> None:
        try:
            record = self.data.lifecycle.move(
                to, at=workflow.now(), actor=actor, reason=reason, refs=refs
            )
        except IllegalTransition as e:
            # Non-retryable: a bare exception would only fail the task and retry forever.
            raise ApplicationError(str(e), type="IllegalTransition", non_retryable=True) from None
        self.data.updated_at = record.at
        run_metrics.on_transition(self.data.lifecycle, record)

    def _refuse(self, actor: str, reason: str, rule: str, refs: Refs) -> None:
        record = self.data.lifecycle.refuse(at=workflow.now(), actor=actor, reason=reason, refs=refs, rule=rule)
        run_metrics.on_refusal(record)

    @property
    def tenant_policy(self) -> TenantPolicy | None:
        return self.data.policy.policy if self.data.policy else None

    @property
    def limits(self) -> Limits:
        """The run's limits, tightened by the tenant's budgets."""
        return policy.effective_limits(self.request.limits, self.tenant_policy)

    def _take_handoff(self, detail: str | None = None) -> bool:
        """Honour a pending handoff if the current state allows it."""
        request = self._handoff
        if request is None or not self.data.lifecycle.can_move(S.HANDED_OFF):
            return False
        self._handoff = None
        reason = f"handed off by {request.by}: {request.reason}"
        self._move(
            S.HANDED_OFF,
            actor=f"operator:{request.by}",
            reason=f"{reason} ({detail})" if detail else reason,
        )
        return True

    def _current_step(self) -> PlanStep:
        plan = self.data.plan
        if plan is None or self.data.next_step >= len(plan.steps):
            raise ApplicationError(
                "no plan step to execute", type="IllegalState", non_retryable=True
            )
        return plan.steps[self.data.next_step]

    def _step_refs(self, step: PlanStep) -> Refs:
        plan_hash = self.data.plan.plan_hash if self.data.plan else None
        return Refs(
            plan_hash=plan_hash,
            tool_call_id=step.tool_call_id,
            # The run's workflow id, not its run id: stable across continue-as-new.
            idempotency_key=f"{workflow.info().workflow_id}:{step.tool_call_id}",
        )

    def _record_step(self, step: PlanStep, status: Literal["ok", "failed"], outcome: ToolOutcome | None) -> None:
        self.data.executed.append(
            ExecutedStep(
                tool_call_id=step.tool_call_id,
                tool=step.tool,
                args=step.args,
                status=status,
                observation=outcome.observation if outcome else "",
                digest=outcome.digest if outcome else "",
            )
        )

    def _maybe_continue_as_new(self) -> None:
        data = self.data
        if not workflow.info().is_continue_as_new_suggested():
            return
        # Only between steps: no tool in flight and nothing accepted but not yet acted on.
        if data.lifecycle.state not in (S.PLANNING, S.AWAITING_APPROVAL):
            return
        if self._inbox or self._handoff is not None:
            return
        self._publish()
        workflow.continue_as_new(
            self.request.model_copy(update={"carryover": data}),
            search_attributes=self._search_attributes(),
        )

    def _search_attributes(self) -> TypedSearchAttributes:
        return TypedSearchAttributes(
            [
                SearchAttributePair(STATE_ATTRIBUTE, self.data.lifecycle.state.value),
                SearchAttributePair(TENANT_ATTRIBUTE, self.request.tenant),
            ]
        )

    def _publish(self) -> None:
        """Make the state visible before the workflow waits.

        Called before every await rather than on every move: states the run passes through
        inside one workflow task are never observable, and each upsert costs a history event.
        """
        state = self.data.lifecycle.state.value
        if state != self._published:
            workflow.upsert_search_attributes(
                [STATE_ATTRIBUTE.value_set(state), TENANT_ATTRIBUTE.value_set(self.request.tenant)]
            )
            self._published = state
        workflow.set_current_details(self._details())

    def _details(self) -> str:
        # The Web UI's "Current Details" (markdown). Names, effects, ids and the plan hash only:
        # never tool arguments or results, which may hold personal data.
        from datetime import datetime, timezone

        def utc(moment: datetime) -> str:
            return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

        data = self.data
        lc = data.lifecycle
        lines = [
            f"**State:** `{lc.state.value}` (version {lc.state_version})",
            "",
            f"**Tenant** `{self.request.tenant}` · **requested by** `{self.request.requested_by}` · "
            f"{len(data.executed)} step(s) executed · {data.retries} retries",
        ]
        if data.approved_by:
            lines += ["", "**Approved by** " + ", ".join(f"`{a}`" for a in data.approved_by)]
        if data.last_error:
            lines += ["", f"**Last error:** {data.last_error[:200]}"]
        plan, catalog = data.plan, data.catalog or ToolCatalog()
        if plan is not None and not lc.terminal:
            lines += ["", f"**Plan** `{plan.plan_hash}`", ""]
            for i, step in enumerate(plan.steps, start=1):
                info = catalog.get(step.tool)
                effect = info.effect.value if info else "?"
                mark = " ✓ done" if i <= data.next_step else ""
                lines.append(f"{i}. `{step.tool}` · {effect}{mark}")
        pending = data.pending_approval
        if pending is not None and lc.state == S.AWAITING_APPROVAL:
            wf_id = workflow.info().workflow_id
            signal_input = (
                f"{{\"decision_id\": \"<unique id>\", \"approver\": \"NAME\", "
                f"\"plan_hash\": \"{pending.plan_hash}\"}}"
            )
            lines += [
                "",
                f"**Waiting for approval** until **{utc(pending.expires_at)}** — {pending.summary}",
                "",
                f"**Approvals:** {len(pending.approvals)} of {pending.approvals_required}"
                + (f" · risk **{pending.risk}**" if pending.risk != "normal" else "")
                + (f" · roles {', '.join(f'`{r}`' for r in pending.roles)}" if pending.roles else "")
                + (
                    " · so far " + ", ".join(f"`{a.approver}`" for a in pending.approvals)
                    if pending.approvals
                    else ""
                ),
                "",
                "**Approve with:**",
                "",
                f"`python starter.py approve {wf_id} --by NAME --plan-hash {pending.plan_hash}`",
                "",
                "or:",
                "",
                f"`temporal workflow signal --workflow-id {wf_id} --name approve --input "
                f"'{signal_input}'`",
                "",
                "or here: **More Actions → Send a Signal → approve**, with the `--input` JSON as data.",
            ]
        if data.answer and lc.terminal:
            lines += ["", f"**Answer:** {data.answer[:500]}"]
        return "\n".join(lines)


def _failure_details(err: ActivityError) -> tuple[str, str, float | None]:
    """(error code, message, suggested retry delay) of a failed activity."""
    cause = err.cause
    if isinstance(cause, ApplicationError):
        delay = cause.next_retry_delay.total_seconds() if cause.next_retry_delay else None
        return cause.type or "error", cause.message, delay
    if isinstance(cause, TimeoutError):
        return (
            f"timeout_{cause.type.name.lower()}" if cause.type else "timeout",
            "no result in time (timeout or worker crash): outcome unknown",
            None,
        )
    return type(cause).__name__ if cause else "error", str(cause or err), None


def _is_permanent(err: ActivityError) -> bool:
    cause = err.cause
    return isinstance(cause, ApplicationError) and cause.non_retryable
