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
        ApprovalDecision,
        CatalogRequest,
        ExecutedStep,
        HandoffRequest,
        PendingApproval,
        PlannerInput,
        PlanStep,
        Proposal,
        RunData,
        RunOutcome,
        RunRequest,
        RunSnapshot,
        ToolCall,
        ToolCatalog,
        ToolOutcome,
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
        # Accepted by a signal handler, acted on by the main loop.
        self._decision: tuple[DecisionKind, ApprovalDecision] | None = None
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
        if data.lifecycle.state == S.RECEIVED:
            self._move(S.PLANNING, actor="runtime", reason="run received")

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
                self._move_to_step(reason="approved plan: executing")
            elif state == S.EXECUTING_TOOL:
                await self._execute_step()
            elif state == S.OBSERVING_RESULT:
                self._after_observation()
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
        max_tokens = self.request.limits.max_model_tokens
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
            executed_steps=data.tool_calls,
            limits=self.request.limits,
            new_id=lambda n: f"tc-{n:03d}-{workflow.uuid4().hex[:8]}",
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
        limits = self.request.limits
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
        assert data.plan is not None and data.catalog is not None
        if not policy.needs_approval(data.plan, data.catalog):
            self._move_to_step(reason="read-only plan: policy needs no approval")
            return
        ttl = timedelta(seconds=self.request.limits.approval_ttl_seconds)
        data.pending_approval = PendingApproval(
            plan_hash=data.plan.plan_hash,
            expires_at=workflow.now() + ttl,
            summary=policy.risk_summary(data.plan, data.catalog),
        )
        data.approved_by = []
        self._move(
            S.AWAITING_APPROVAL,
            actor="runtime",
            reason="plan writes: "
            + ", ".join(policy.steps_needing_approval(data.plan, data.catalog))
            + " need approval",
            refs=Refs(plan_hash=data.plan.plan_hash),
        )

    async def _await_decision(self) -> None:
        data = self.data
        pending = data.pending_approval
        if pending is None:
            raise ApplicationError(
                "AWAITING_APPROVAL without a pending approval", type="IllegalState", non_retryable=True
            )
        remaining = (pending.expires_at - workflow.now()).total_seconds()
        if remaining > 0 and self._decision is None and self._handoff is None:
            self._publish()
            try:
                await workflow.wait_condition(
                    lambda: self._decision is not None
                    or self._handoff is not None
                    or workflow.info().is_continue_as_new_suggested(),
                    timeout=timedelta(seconds=remaining),
                    timeout_summary="approval expiry",
                )
            except asyncio.TimeoutError:
                pass
        if self._take_handoff():
            data.pending_approval = None
            return
        if self._decision is not None:
            kind, decision = self._decision
            self._decision = None
            data.pending_approval = None
            refs = Refs(plan_hash=decision.plan_hash, decision_id=decision.decision_id)
            actor = f"user:{decision.approver}"
            if kind == "approve":
                data.approved_by.append(decision.approver)
                self._move(S.APPROVED, actor=actor, reason=decision.comment or "approved", refs=refs)
            else:
                self._move(S.REJECTED, actor=actor, reason=decision.reason or "rejected", refs=refs)
            return
        if workflow.now() < pending.expires_at:
            return  # woken to continue as new; the loop does that and comes back here
        data.pending_approval = None
        refs = Refs(plan_hash=pending.plan_hash)
        limits = self.request.limits
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
            self._publish()
            data.tool_calls += 1 if retries_done == 0 else 0
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

    def _after_observation(self) -> None:
        data = self.data
        if data.plan is not None and data.next_step < len(data.plan.steps):
            self._move_to_step(reason="next step of the approved plan")
        else:
            self._move(S.PLANNING, actor="runtime", reason="plan executed: planning what is next")

    # ------------------------------------------------------------------ signals and queries

    @workflow.signal(name="approve", description="Approve the pending plan (ApprovalDecision).")
    def approve(self, decision: ApprovalDecision) -> None:
        self._decide("approve", decision)

    @workflow.signal(name="reject", description="Reject the pending plan (ApprovalDecision).")
    def reject(self, decision: ApprovalDecision) -> None:
        self._decide("reject", decision)

    @workflow.signal(name="handoff", description="Hand the run to a human (HandoffRequest).")
    def handoff(self, request: HandoffRequest) -> None:
        refusal = policy.handoff_refusal(self.data)
        if refusal is None and self._handoff is not None:
            refusal = "a handoff is already pending"
        if refusal is not None:
            run_metrics.on_refusal(
                self.data.lifecycle.refuse(
                    at=workflow.now(), actor=f"operator:{request.by}", reason=f"handoff refused: {refusal}"
                )
            )
            return
        self._handoff = request

    @workflow.query(name="snapshot", description="The run's current state (RunSnapshot).")
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

    @workflow.query(name="timeline", description="The audit timeline (list of TransitionRecord).")
    def timeline(self) -> list[TransitionRecord]:
        return self.data.lifecycle.timeline

    def _decide(self, kind: DecisionKind, decision: ApprovalDecision) -> None:
        data = self.data
        refusal = policy.decision_refusal(
            decision, data, requested_by=self.request.requested_by, now=workflow.now()
        )
        if refusal is None and (self._decision is not None or self._handoff is not None):
            refusal = "another decision for this plan was accepted first"
        if decision.decision_id not in data.decisions_seen:
            data.decisions_seen.append(decision.decision_id)
        if refusal is not None:
            run_metrics.on_refusal(
                data.lifecycle.refuse(
                    at=workflow.now(),
                    actor=f"user:{decision.approver}",
                    reason=f"{kind} refused: {refusal}",
                    refs=Refs(plan_hash=decision.plan_hash, decision_id=decision.decision_id),
                )
            )
            return
        self._decision = (kind, decision)

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
        if self._decision is not None or self._handoff is not None:
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
        data = self.data
        lc = data.lifecycle
        lines = [
            f"**State:** `{lc.state.value}` (version {lc.state_version}) · tenant "
            f"`{self.request.tenant}` · requested by `{self.request.requested_by}`",
            f"**Steps executed:** {len(data.executed)} · retries {data.retries}",
        ]
        if data.last_error:
            lines.append(f"**Last error:** {data.last_error[:200]}")
        plan, catalog = data.plan, data.catalog or ToolCatalog()
        if plan is not None and not lc.terminal:
            lines.append("")
            lines.append(f"**Plan** `{plan.plan_hash}`")
            for i, step in enumerate(plan.steps, start=1):
                info = catalog.get(step.tool)
                effect = info.effect.value if info else "?"
                mark = " ✓" if i <= data.next_step else ""
                lines.append(f"{i}. `{step.tool}` · {effect}{mark}")
        pending = data.pending_approval
        if pending is not None and lc.state == S.AWAITING_APPROVAL:
            wf_id = workflow.info().workflow_id
            lines += [
                "",
                f"**Waiting for approval** until {pending.expires_at.isoformat()} — {pending.summary}",
                "",
                "Approve with:",
                f"`python starter.py approve {wf_id} --by NAME --plan-hash {pending.plan_hash}`",
                "",
                "or:",
                f"`temporal workflow signal --workflow-id {wf_id} --name approve --input "
                f"'{{\"decision_id\": \"<unique id>\", \"approver\": \"NAME\", "
                f"\"plan_hash\": \"{pending.plan_hash}\"}}'`",
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
