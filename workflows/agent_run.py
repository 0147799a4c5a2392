"""The ``AgentRun`` workflow: a governed, durable agent run.

The planner proposes, this workflow decides. This module is the shell: it awaits activities,
timers and signals, and hands each outcome to the pure :class:`workflows.engine.Engine`, which
decides the next state through the transition table in ``workflows/states.py``. Every side
effect is an activity with an idempotency key and a retry rule derived from the tool's declared
effect; approvals are bound to a plan hash, checked against the policy by an activity, and
expire on a durable timer.

Deterministic code only: time is ``workflow.now()``, ids come from ``workflow.uuid4()``, no
I/O and no environment reads.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.workflow import ActivityCancellationType
from temporalio.common import (
    RawValue,
    RetryPolicy,
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
)
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from workflows import metrics as run_metrics
    from workflows import policy
    from workflows.budgets import CARRY_BUDGET, CARRY_CONTINUE_AT, DETAILS_CHARS, REQUEST_BUDGET, clip
    from workflows.display import markdown_code
    from workflows.engine import DecisionKind, Engine, IllegalState, ToolFailure
    from workflows.models import (
        ATTEMPT_STILL_RUNNING,
        STRICT,
        ApprovalDecision,
        AuditAck,
        AuditBatch,
        CatalogRequest,
        DecideRequest,
        DecideResult,
        DecisionCheck,
        ExecutedStep,
        HandoffCheck,
        HandoffRequest,
        PlannerInput,
        PolicySnapshot,
        Proposal,
        RecoveryRequest,
        RecoverySource,
        Refusal,
        RunData,
        RunOutcome,
        RunRequest,
        RunSnapshot,
        SealRequest,
        SnapshotRequest,
        ToolCatalog,
        ToolOutcome,
        Verdict,
        canonical_json,
        first_error,
    )
    from workflows.states import IllegalTransition, Refs, RunState, TransitionRecord

S = RunState
T = TypeVar("T")
M = TypeVar("M", ApprovalDecision, HandoffRequest)

# Public: the Web UI and `temporal workflow list --query` filter on these.
STATE_ATTRIBUTE = SearchAttributeKey.for_keyword("AgentRunState")
TENANT_ATTRIBUTE = SearchAttributeKey.for_keyword("AgentTenant")
SEARCH_ATTRIBUTES = (STATE_ATTRIBUTE, TENANT_ATTRIBUTE)

PLANNER_TIMEOUT = timedelta(minutes=2)
PLANNER_RETRY = RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=1))
SETUP_TIMEOUT = timedelta(seconds=30)
# Tools run exactly as scheduled: the workflow owns their retries, so each one is a
# EXECUTING_TOOL -> RETRY_WAIT -> EXECUTING_TOOL hop on the timeline and an unsafe tool is never
# re-run behind our back.
TOOL_RETRY = RetryPolicy(maximum_attempts=1)
# workflow.patched id: a run's cancel is passed on to the tool in flight (through its heartbeat).
# Runs recorded before did not send that cancel command; on replay they still do not.
CANCEL_REACHES_TOOL = "cancel-reaches-tool"
# Observations handed back to the planner, newest first, in all (older ones keep only their
# digest), so planner inputs in history do not grow with the size of tool results.
PLANNER_CONTEXT_CHARS = 16_000
# Records per audit_append call: each call's input stays far below the payload limit.
AUDIT_BATCH = 200
# New commands since the first release (audit sink, carried-state seal, handoff re-screening,
# auto-approved re-checks) run only where this patch is set: histories written by the previous
# version replay without them (docs/changing-workflows.md).
PATCH_V2 = "tether-v2"
# Declared recovery: plan hashes cover compensations, ok writes get their undo, on_failure and
# compensation runs. Runs recorded before keep their hashes and never compensate.
PATCH_RECOVERY = "tether-recovery"
DECIDE_HINT = "approve, reject (signals or the decide update), handoff"


@workflow.defn(name="AgentRun")
class AgentRun:
    # The start input arrives undecoded (*args): a missing, extra, malformed or forged input fails
    # the run at once with a clear reason, never a workflow task that retries forever.
    @workflow.init
    def __init__(self, *args: Any) -> None:
        info = workflow.info()
        self._start_error: str | None = None
        self._carry_raw: Any = None
        request = self._decode_start(args, continued=info.continued_run_id is not None)
        self.request = request
        self.data: RunData = request.carryover or RunData()
        self.data.first_run_id = self.data.first_run_id or info.first_execution_run_id
        self.engine = Engine(
            self.data,
            request,
            workflow_id=info.workflow_id,
            on_record=self._on_record,
            # Runs from before request ids (replayed histories) keep plan-hash-only requests.
            new_request_id=lambda: str(workflow.uuid4()) if self._v2 else "",
        )
        # Decisions that passed the cheap checks on arrival, in arrival order; the main loop
        # checks each against the policy (an activity) and acts on it.
        self._inbox: list[tuple[DecisionKind, ApprovalDecision]] = []
        self._handoff: HandoffRequest | None = None
        # Records on their way to the audit sink, and the decide updates waiting for a verdict.
        self._audit: list[TransitionRecord] = []
        self._verdicts: dict[str, DecideResult | None] = {}
        self._v2 = True
        self._loops = 0
        start_attributes = info.typed_search_attributes
        self._published: str | None = start_attributes.get(STATE_ATTRIBUTE)
        # start_run sets the tenant and continue-as-new carries it: upsert it only when missing.
        self._tenant_published = start_attributes.get(TENANT_ATTRIBUTE) == request.tenant

    def _decode_start(self, args: Sequence[Any], *, continued: bool) -> RunRequest:
        placeholder = RunRequest(goal="(invalid start input)", requested_by="unknown")
        if len(args) != 1 or not isinstance(args[0], dict):
            self._start_error = f"the start input must be one RunRequest object, got {len(args)} argument(s)"
            return placeholder
        raw = args[0]
        if raw.get("carryover") is not None and not continued:
            # Carried state is trusted only from this run's own previous run (and its seal).
            self._start_error = (
                "a start input may not carry state (carryover): only a run continuing as new "
                "carries state; start runs with a plain RunRequest"
            )
            return placeholder
        try:
            # Strict for what a client wrote; tolerant of a newer worker's fields when continued.
            request = RunRequest.model_validate(raw, context=None if continued else STRICT)
        except ValidationError as e:
            self._start_error = f"invalid start input (RunRequest): {first_error(e)}"
            return placeholder
        self._carry_raw = raw.get("carryover")
        return request

    # ------------------------------------------------------------------ main loop

    @workflow.run
    async def run(self, *args: Any) -> RunOutcome:
        if self._start_error is not None:
            raise ApplicationError(self._start_error, type="invalid_start_input", non_retryable=True)
        self._v2 = workflow.patched(PATCH_V2)
        self.engine.recovery = workflow.patched(PATCH_RECOVERY)
        try:
            await self._verify_carryover()
            await self._drive()
        except asyncio.CancelledError:
            self._decide(lambda now: self.engine.cancelled(workflow.cancellation_reason(), now))
            if self.data.lifecycle.state == S.COMPENSATING:
                await self._drive()  # on_cancel=compensate: put the ok writes back first
            await self._finish()
            raise
        await self._finish()
        return RunOutcome(
            run_id=workflow.info().workflow_id,
            state=self.data.lifecycle.state,
            answer=self.data.answer,
            # Ids, outcomes and digests: observations stay out of the result (its budget).
            steps=[s.model_copy(update={"observation": "", "args": {}}) for s in self.data.executed],
            timeline=self.data.lifecycle.timeline,
            compensations=self.data.compensations,
        )

    async def _finish(self) -> None:
        """The run has ended: nothing may be left unsaid on the record, or unanswered."""
        if self._handoff is not None:
            self.engine.handoff_unhonoured(self._handoff, workflow.now())
            self._handoff = None
        if self._inbox:
            self._flush_inbox()
        await self._checkpoint()
        await workflow.wait_condition(workflow.all_handlers_finished)

    async def _verify_carryover(self) -> None:
        if self._carry_raw is None or not self._v2:
            return
        digest = hashlib.sha256(canonical_json(self._carry_raw).encode()).hexdigest()
        valid = await self._activity(
            "carryover_verify",
            SealRequest(workflow_id=workflow.info().workflow_id, digest=digest, seal=self.request.carryover_seal),
            bool,
            "verify carried state",
            local=True,
        )
        if not valid:
            raise ApplicationError(
                "the carried state does not bear this worker's seal: it was not written by this "
                "run's previous run (or the workers do not share TETHER_STATE_KEY_FILE)",
                type="carryover_unsealed",
                non_retryable=True,
            )

    async def _drive(self) -> None:
        data = self.data
        if data.catalog is None:
            # One snapshot per run: validation must not change under a run's feet.
            data.catalog = await self._activity(
                "tool_catalog", CatalogRequest(tenant=self.request.tenant), ToolCatalog, "tool catalog snapshot",
                local=True,
            )
        if data.policy is None:
            request = self.request
            data.policy = await self._activity(
                "policy_snapshot",
                SnapshotRequest(
                    tenant=request.tenant,
                    workflow_id=workflow.info().workflow_id,
                    requested_by=request.requested_by,
                    request_digest=request.request_digest(),
                    requester_signature=request.requester_signature,
                ),
                PolicySnapshot,
                "policy snapshot",
                local=True,
            )
        if data.lifecycle.state == S.RECEIVED:
            self._decide(self.engine.received)
        if data.lifecycle.state == S.RECEIVED and self.request.compensate_run is not None:
            # A compensation run: the original's closed record says what its approvals covered.
            source = await self._activity(
                "recovery_source",
                RecoveryRequest(run_id=self.request.compensate_run, tenant=self.request.tenant),
                RecoverySource,
                f"recovery source · {self.request.compensate_run}",
            )
            self._decide(lambda now: self.engine.begin_compensation(source, now))

        while not data.lifecycle.terminal:
            await self._maybe_continue_as_new()
            state = data.lifecycle.state
            if state == S.PLANNING:
                await self._plan()
            elif state == S.VALIDATION_FAILED:
                self._decide(self.engine.after_validation_failed)
            elif state == S.VALIDATED:
                refusal = None
                if self._v2 and not self.engine.review().needs_approval:
                    # Auto-approved by the run's snapshot: the current file must agree.
                    refusal = await self._authority_refusal(from_step=0)
                self._decide(lambda now: self.engine.after_validated(now, refusal))
            elif state == S.AWAITING_APPROVAL:
                await self._await_decision()
            elif state == S.APPROVED:
                refusal = await self._authority_refusal(from_step=data.next_step)
                self._decide(lambda now: self.engine.after_approved(refusal, now))
            elif state == S.EXECUTING_TOOL:
                await self._execute_step()
            elif state == S.COMPENSATING:
                # The same step path as the plan's steps: one way to call a tool.
                if self._decide(self.engine.compensation_ready):
                    await self._execute_step()
            elif state == S.OBSERVING_RESULT:
                refusal = None
                if self.engine.current_step() is not None and (self._v2 or data.approval is not None):
                    refusal = await self._authority_refusal(from_step=data.next_step)
                self._decide(lambda now: self.engine.after_observation(refusal, now))
            else:
                raise ApplicationError(
                    f"no handler for working state {state.value}", type="IllegalState", non_retryable=True
                )
            if data.lifecycle.state != S.AWAITING_APPROVAL and self._inbox:
                self._flush_inbox()

    # ------------------------------------------------------------------ states

    async def _plan(self) -> None:
        data = self.data
        if await self._take_handoff():
            return
        budget = self.engine.token_budget_refusal()
        if budget is not None:
            self._decide(
                lambda now: self.engine.move(
                    S.FAILED, at=now, actor="runtime", reason=budget, refs=Refs(error_code="model_token_budget")
                )
            )
            return
        data.planning_rounds += 1
        try:
            proposal = await self._activity(
                "plan",
                PlannerInput(
                    goal=self.request.goal,
                    planner=self.request.planner,
                    playbook=self.request.playbook,
                    executed=_bounded_context(data.executed),
                    feedback=data.feedback,
                    round=data.planning_rounds,
                    steps_done=sum(1 for s in data.executed if s.status == "ok"),
                ),
                Proposal,
                f"plan · {self.request.planner} · round {data.planning_rounds}",
                timeout=PLANNER_TIMEOUT,
                retry=PLANNER_RETRY,
            )
        except ActivityError as err:
            failure = _failure(err)
            self._decide(lambda now: self.engine.planner_failed(failure, now))
            return
        if await self._take_handoff():
            return
        self._decide(
            lambda now: self.engine.proposal(
                proposal, at=now, new_id=lambda n: f"tc-{n:03d}-{workflow.uuid4().hex[:8]}"
            )
        )

    async def _await_decision(self) -> None:
        pending = self.data.pending_approval
        if pending is None:
            raise ApplicationError(
                "AWAITING_APPROVAL without a pending approval", type="IllegalState", non_retryable=True
            )
        remaining = (pending.expires_at - workflow.now()).total_seconds()
        if remaining > 0 and not self._inbox and self._handoff is None:
            await self._checkpoint()
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
        if await self._take_handoff():
            return
        if self._inbox:
            kind, decision = self._inbox.pop(0)
            verdict = await self._activity(
                "policy_check_decision",
                DecisionCheck(
                    tenant=self.request.tenant,
                    workflow_id=workflow.info().workflow_id,
                    kind=kind,
                    decision=decision,
                    requested_by=self.request.requested_by,
                    roles=pending.roles,
                    already_approved=[a.approver for a in pending.approvals],
                    first_run_id=self.data.first_run_id,
                    requester_verified=self.data.requester_verified,
                ),
                Verdict,
                f"policy check · {kind}",
                local=True,
            )
            self._decide(
                lambda now: self.engine.settle_decision(kind, decision, verdict.refusal, now, verdict.verified)
            )
            self._answer(decision.decision_id)
            return
        if workflow.now() >= pending.expires_at:
            self._decide(self.engine.expire)
        # Otherwise woken to continue as new: the loop does that and comes back here.

    async def _authority_refusal(self, *, from_step: int) -> Refusal | None:
        """Re-check, through the policy activity, the approvals of the plan's remaining writes."""
        check = self.engine.authority_check(from_step=from_step)
        if check is None:
            return None
        verdict = await self._activity(
            "policy_check_authority", check, Verdict, "policy re-check before writes", local=True
        )
        return verdict.refusal

    async def _execute_step(self) -> None:
        step = self.engine.current_step()
        info = self.engine.tool_info(step) if step else None
        if step is None or info is None:
            raise ApplicationError("no executable plan step", type="IllegalState", non_retryable=True)
        detail, refs = self.engine.handoff_point()
        if await self._take_handoff(detail=detail, refs=refs):
            self.engine.step_handed_off()
            return
        call = self._decide(self.engine.next_tool_call)
        if call is None:
            return
        data_state = self.data.lifecycle.state
        await self._checkpoint()
        timeouts = policy.tool_timeouts(info.timeout_seconds)
        handle = workflow.start_activity(
            "execute_tool",
            call,
            result_type=ToolOutcome,
            # The tool's deadline is its declared timeout; the grace period on top lets the
            # activity report a tool that overran instead of leaving the attempt in doubt.
            start_to_close_timeout=timedelta(seconds=timeouts.start_to_close),
            # A dead worker is noticed within seconds, and a cancel reaches the tool.
            heartbeat_timeout=timedelta(seconds=timeouts.heartbeat),
            # A cancel waits until the attempt has ended, so its outcome is known.
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            retry_policy=TOOL_RETRY,
            summary=f"{step.tool} · {info.effect.value} · "
            + (f"compensation {step.tool_call_id}" if data_state == S.COMPENSATING else f"step {self.data.next_step + 1}"),
        )
        outcome: ToolOutcome | None = None
        try:
            try:
                # Shielded: the run's cancellation is handled below, not by losing the handle.
                outcome = await asyncio.shield(handle)
            except asyncio.CancelledError:
                failure: ToolFailure | None = None
                if workflow.patched(CANCEL_REACHES_TOOL):
                    # The attempt may have ended in the very workflow task the cancel came in:
                    # let its handle take that result first (the SDK drops the result of a
                    # handle cancelled after its result arrived).
                    await asyncio.sleep(0)
                    if not handle.done():
                        handle.cancel()
                try:
                    outcome = await handle
                except ActivityError as err:
                    failure = _failure(err)
                    self._log_failure(call.tool_call_id, failure)
                except asyncio.CancelledError:
                    # Its result was dropped after all: what the attempt did is not known.
                    failure = ToolFailure("cancelled", "the attempt's result was lost to the cancel", False)
                self._decide(lambda now: self.engine.tool_settled_on_cancel(outcome, failure))
                raise
        except ActivityError as err:
            failure = _failure(err)
            self._log_failure(call.tool_call_id, failure)
            delay = self._decide(lambda now: self.engine.tool_failed(failure, now))
            if delay is None:
                return
            await self._checkpoint()
            try:
                await workflow.wait_condition(
                    lambda: self._handoff is not None,
                    timeout=timedelta(seconds=delay),
                    timeout_summary="retry backoff",
                )
            except asyncio.TimeoutError:
                pass
            self._decide(self.engine.retry)
            return
        self._decide(lambda now: self.engine.tool_succeeded(outcome, now))

    def _log_failure(self, tool_call_id: str, failure: ToolFailure) -> None:
        # The error's text stays in the worker log: it may quote arguments, so the timeline and
        # last_error only name its code.
        workflow.logger.warning("tool call %s failed [%s]: %s", tool_call_id, failure.code, failure.message)

    # ------------------------------------------------------------------ signals and queries
    #
    # Every handler takes its arguments undecoded (*args) and validates them itself: none,
    # several, null, a list or a huge string is refused on the timeline (malformed_signal),
    # never a failed workflow task that would wedge the run.

    @workflow.signal(
        name="approve",
        description="Approve the pending plan. Data (ApprovalDecision): {\"decision_id\": unique, "
        "\"approver\": name, \"plan_hash\": the pending plan's hash, \"request_id\": the pending "
        "approval request's id, \"comment\": optional, \"signature\": where required}. Counts only "
        "for the pending request, before it expires. The decide update answers at once.",
    )
    def approve(self, *args: Any) -> None:
        decision = self._decode("approve", args, ApprovalDecision)
        if decision is not None:
            self._screen("approve", decision)

    @workflow.signal(
        name="reject",
        description="Reject the pending plan. Data (ApprovalDecision): {\"decision_id\": unique, "
        "\"approver\": name, \"plan_hash\": the pending plan's hash, \"request_id\": the pending "
        "approval request's id, \"reason\": optional}.",
    )
    def reject(self, *args: Any) -> None:
        decision = self._decode("reject", args, ApprovalDecision)
        if decision is not None:
            self._screen("reject", decision)

    @workflow.signal(
        name="handoff",
        description="Hand the run to a human; it ends in HANDED_OFF. Data (HandoffRequest): "
        "{\"by\": name, \"reason\": text, \"decision_id\": optional, \"signature\": where required}.",
    )
    def handoff(self, *args: Any) -> None:
        request = self._decode("handoff", args, HandoffRequest)
        if request is None:
            return
        if self._handoff is not None:
            self.engine.refuse_handoff(
                request,
                Refusal(rule="handoff_pending", message="a handoff is already pending"),
                workflow.now(),
            )
        elif self.engine.screen_handoff(request, workflow.now()):
            self._handoff = request

    @workflow.signal(dynamic=True)
    def unknown_signal(self, name: str, args: Sequence[RawValue]) -> None:
        # Signal names are the sender's choice: one this run does not take is recorded, not dropped.
        self.engine.refuse(
            at=workflow.now(),
            actor="unknown",
            reason=f"signal {clip(name, 64)!r} refused: not a signal this run takes ({DECIDE_HINT})",
            rule="unknown_signal",
        )

    @workflow.update(
        name="decide",
        description="Approve or reject the pending plan and get the verdict at once. Data "
        "(DecideRequest): the ApprovalDecision fields plus \"kind\": \"approve\" | \"reject\". "
        "Malformed, stale, duplicate and not-awaiting decisions are refused before they reach "
        "history; the answer (DecideResult) is the record the run wrote for the decision.",
    )
    async def decide(self, *args: Any) -> DecideResult:
        decision = self._decide_payload(args)
        kind: DecisionKind = decision.kind
        plain = ApprovalDecision.model_validate(decision.model_dump(exclude={"kind"}))
        if plain.decision_id in self._verdicts:
            # The same decision twice at once (both passed the validator before either arrived):
            # one verdict per decision id, so the later one is a duplicate.
            return DecideResult(
                decision_id=plain.decision_id,
                outcome="refused",
                state=self.data.lifecycle.state,
                reason=f"decide refused: decision_id {plain.decision_id[:64]} is already being decided",
                rule="duplicate_decision",
            )
        self._verdicts[plain.decision_id] = None
        if self.engine.screen_decision(kind, plain, workflow.now()):
            self._inbox.append((kind, plain))
        else:
            self._answer(plain.decision_id)  # refused on arrival: the state moved since validation
        await workflow.wait_condition(lambda: self._verdicts.get(plain.decision_id) is not None)
        result = self._verdicts.pop(plain.decision_id, None)
        return result if result is not None else DecideResult(
            decision_id=plain.decision_id, outcome="refused", state=self.data.lifecycle.state, reason="no verdict"
        )

    @decide.validator
    def _validate_decide(self, *args: Any) -> None:
        # Runs before anything reaches history: what cannot count is refused to the sender only.
        decision = self._decide_payload(args)
        data = self.data
        refusal = policy.decision_refusal(decision, data, now=workflow.now(), check_duplicate=True)
        pending = data.pending_approval
        if refusal is None and pending is not None:
            refusal = policy.approver_refusal(
                self.engine.tenant,
                approver=decision.approver,
                requested_by=self.request.requested_by,
                kind=decision.kind,
                roles=pending.roles,
                already_approved=[a.approver for a in pending.approvals],
            )
        if refusal is not None:
            raise ValueError(f"{decision.kind} refused [{refusal.rule}]: {refusal.message}")

    def _decide_payload(self, args: Sequence[Any]) -> DecideRequest:
        if len(args) != 1:
            raise ApplicationError(
                f"decide refused [malformed]: expected one DecideRequest, got {len(args)} argument(s)",
                type="malformed",
            )
        try:
            return DecideRequest.model_validate(args[0], context=STRICT)
        except ValidationError as e:
            raise ApplicationError(
                f"decide refused [malformed]: expected DecideRequest ({first_error(e)})", type="malformed"
            ) from None

    @workflow.query(
        name="snapshot",
        description="Current state, plan and plan hash, pending approval (with its request_id and "
        "expiry), steps, retries, last error and refusal counts (RunSnapshot).",
    )
    def snapshot(self, *args: Any) -> RunSnapshot:
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
            requested_by=self.request.requested_by,
            requester_verified=data.requester_verified,
            first_run_id=data.first_run_id,
            refusals=data.lifecycle.refusals,
            timeline_records=data.lifecycle.records,
            compensations=data.compensations,
        )

    @workflow.query(
        name="timeline",
        description="Audit timeline: the first and the latest transitions and refused decisions, "
        "with actor, reason and refs (list of TransitionRecord, bounded; `tether timeline --all` "
        "adds the audit sink's full record).",
    )
    def timeline(self, *args: Any) -> list[TransitionRecord]:
        return self.data.lifecycle.timeline

    def _decode(self, signal: str, args: Sequence[Any], model: type[M]) -> M | None:
        problem = None
        if len(args) != 1:
            problem = f"expected one {model.__name__}, got {len(args)} argument(s)"
        else:
            try:
                return model.model_validate(args[0], context=STRICT)
            except ValidationError as err:
                problem = f"expected {model.__name__} ({first_error(err)})"
        self.engine.refuse(
            at=workflow.now(),
            actor="unknown",
            reason=f"{signal} refused: malformed payload, {problem}",
            rule="malformed_signal",
        )
        return None

    def _screen(self, kind: DecisionKind, decision: ApprovalDecision) -> None:
        """Cheap, state-only checks now; the policy check follows in the main loop."""
        if self.engine.screen_decision(kind, decision, workflow.now()):
            self._inbox.append((kind, decision))

    def _answer(self, decision_id: str) -> None:
        """Give a waiting decide update its verdict, from the record the run wrote for it."""
        if decision_id not in self._verdicts:
            return
        record = next(
            (r for r in reversed(self.data.lifecycle.timeline) if r.refs.decision_id == decision_id), None
        )
        if record is None:  # a refusal counted in a flood, not recorded
            self._verdicts[decision_id] = DecideResult(
                decision_id=decision_id, outcome="refused", state=self.data.lifecycle.state,
                reason="refused (counted, not recorded: see snapshot.refusals)", rule="flood",
            )
            return
        self._verdicts[decision_id] = DecideResult(
            decision_id=decision_id, outcome=record.kind, state=record.to_state, reason=record.reason, rule=record.rule
        )

    # ------------------------------------------------------------------ helpers

    def _decide(self, step: Callable[[Any], T]) -> T:
        """Run one engine decision at workflow time; a move the table denies, or a state the
        engine cannot act in, fails the run."""
        try:
            return step(workflow.now())
        except (IllegalTransition, IllegalState) as e:
            # Non-retryable: a bare exception would only fail the task and retry forever.
            raise ApplicationError(str(e), type=type(e).__name__, non_retryable=True) from None

    def _on_record(self, record: TransitionRecord) -> None:
        self._audit.append(record)
        if record.kind == "refused":
            run_metrics.on_refusal(record)
        elif record.kind == "transition":
            run_metrics.on_transition(self.data.lifecycle, record)

    async def _activity(
        self,
        name: str,
        arg: Any,
        result_type: type[T],
        summary: str,
        *,
        timeout: timedelta = SETUP_TIMEOUT,
        retry: RetryPolicy | None = None,
        local: bool = False,
        checkpoint: bool = True,
    ) -> T:
        if checkpoint:
            await self._checkpoint()
        # Local for the snapshots, policy checks and the audit sink: in-process work that runs
        # inside the current workflow task and leaves one marker event, instead of an activity
        # task plus another workflow task (six events and two server round trips; bench/).
        execute = workflow.execute_local_activity if local else workflow.execute_activity
        try:
            return await execute(
                name,
                arg,
                result_type=result_type,
                start_to_close_timeout=timeout,
                retry_policy=retry,
                summary=summary,
            )
        except ActivityError as err:
            # An activity the run's own cancellation cancelled: the run is being cancelled, not
            # failing (this surfaces as ActivityError when the activity had not started yet).
            if isinstance(err.cause, CancelledError):
                raise asyncio.CancelledError() from err
            raise

    async def _take_handoff(self, detail: str | None = None, refs: Refs | None = None) -> bool:
        """Honour a pending handoff where the table allows, once the current policy file (and the
        sender's signature, where required) says it may. ``refs``: the step it ends."""
        request = self._handoff
        if request is None or not self.engine.can_take_handoff():
            return False
        verdict = None
        if self._v2:
            verdict = await self._activity(
                "policy_check_handoff",
                HandoffCheck(
                    tenant=self.request.tenant,
                    workflow_id=workflow.info().workflow_id,
                    first_run_id=self.data.first_run_id,
                    handoff=request,
                ),
                Verdict,
                "policy check · handoff",
                local=True,
            )
        self._handoff = None
        refusal, verified = (verdict.refusal, verdict.verified) if verdict else (None, False)
        return self._decide(lambda now: self.engine.take_handoff(request, now, detail, refusal, verified, refs=refs))

    def _flush_inbox(self) -> None:
        """The run left AWAITING_APPROVAL: decisions still queued can no longer count."""
        for kind, decision in self._inbox:
            self.engine.refuse_unsettled(kind, decision, workflow.now())
            self._answer(decision.decision_id)
        self._inbox.clear()

    async def _flush_audit(self) -> None:
        """Every record written so far, to the audit sink, in order (keyed by seq: a retry
        never writes one twice)."""
        if not self._v2:
            self._audit.clear()
            return
        while self._audit:
            batch, self._audit = self._audit[:AUDIT_BATCH], self._audit[AUDIT_BATCH:]
            await self._activity(
                "audit_append",
                AuditBatch(workflow_id=workflow.info().workflow_id, first_run_id=self.data.first_run_id, records=batch),
                AuditAck,
                f"audit · {len(batch)} record(s)",
                local=True,
                checkpoint=False,
            )

    async def _checkpoint(self) -> None:
        """Before the run waits: the audit sink has every record, and the state is visible."""
        await self._flush_audit()
        self._publish()

    async def _maybe_continue_as_new(self) -> None:
        data = self.data
        self._loops += 1
        suggested = workflow.info().is_continue_as_new_suggested()
        if not suggested and self._loops % 16:
            return
        # Only between steps: no tool in flight and nothing accepted but not yet acted on.
        if data.lifecycle.state not in (S.PLANNING, S.AWAITING_APPROVAL, S.OBSERVING_RESULT):
            return
        if self._inbox or self._handoff is not None or not workflow.all_handlers_finished():
            return
        # The carried state is measured only here (it costs a serialisation), not every loop.
        size = len(data.model_dump_json())
        if not suggested and size < CARRY_CONTINUE_AT:
            return
        size += len(self.request.model_dump_json(exclude={"carryover"}))
        if size > CARRY_BUDGET + REQUEST_BUDGET:
            # Cleanly, with the reason: a payload over the limit would fail every workflow task.
            raise ApplicationError(
                f"carried state and request are {size} bytes, over their "
                f"{CARRY_BUDGET + REQUEST_BUDGET}-byte budget",
                type="carry_budget",
                non_retryable=True,
            )
        seal = None
        if self._v2:
            digest = hashlib.sha256(canonical_json(data.model_dump(mode="json")).encode()).hexdigest()
            sealed = await self._activity(
                "carryover_seal",
                SealRequest(workflow_id=workflow.info().workflow_id, digest=digest),
                SealRequest,
                "seal carried state",
                local=True,
            )
            seal = sealed.seal
        await self._checkpoint()
        if self._inbox or self._handoff is not None or not workflow.all_handlers_finished():
            return  # a decision or handoff came in while sealing: act on it first, continue later
        workflow.continue_as_new(
            self.request.model_copy(update={"carryover": data, "carryover_seal": seal}),
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(STATE_ATTRIBUTE, data.lifecycle.state.value),
                    SearchAttributePair(TENANT_ATTRIBUTE, self.request.tenant),
                ]
            ),
        )

    def _publish(self) -> None:
        """Make the state visible before the workflow waits.

        Called before every await rather than on every move: states the run passes through
        inside one workflow task are never observable, and each upsert costs a history event.
        """
        state = self.data.lifecycle.state.value
        if state != self._published:
            updates = [STATE_ATTRIBUTE.value_set(state)]
            if not self._tenant_published:
                updates.append(TENANT_ATTRIBUTE.value_set(self.request.tenant))
                self._tenant_published = True
            workflow.upsert_search_attributes(updates)
            self._published = state
        workflow.set_current_details(clip(self._details(), DETAILS_CHARS))

    def _details(self) -> str:
        # The Web UI's "Current Details" (markdown). Names, effects, ids and the plan hash only:
        # never tool arguments or results, which may hold personal data.
        from datetime import datetime, timezone

        def utc(moment: datetime) -> str:
            return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

        data = self.data
        lc = data.lifecycle
        requester = f"`{self.request.requested_by}`" + (" (signed)" if data.requester_verified else " (claimed)")
        lines = [
            f"**State:** `{lc.state.value}` (version {lc.state_version})",
            "",
            f"**Tenant** `{self.request.tenant}` · **requested by** {requester} · "
            f"{len(data.executed)} step(s) executed · {data.retries} retries",
        ]
        if workflow.info().continued_run_id:
            # A continued run has no static summary of its own (continue-as-new cannot set one).
            lines += ["", f"**Goal:** {clip(self.request.goal, 300)}"]
        if data.approved_by:
            lines += ["", "**Approved by** " + ", ".join(f"`{a}`" for a in data.approved_by)]
        if data.last_error:
            lines += ["", f"**Last error:** {data.last_error[:200]}"]
        if lc.refusals:
            lines += ["", f"**Refused events:** {sum(lc.refusals.values())} (see snapshot.refusals)"]
        plan, catalog = data.plan, data.catalog or ToolCatalog()
        if plan is not None and not lc.terminal:
            lines += ["", f"**Plan** `{plan.plan_hash}`", ""]
            for i, step in enumerate(plan.steps[:30], start=1):
                info = catalog.get(step.tool)
                effect = info.effect.value if info else "?"
                mark = " ✓ done" if i <= data.next_step else ""
                undo = ""
                if plan.undo is not None and info is not None and info.effect.value != "read_only":
                    comp = plan.undo[i - 1]
                    undo = f" · undo {markdown_code(comp.tool, 64)}" if comp else " · no recovery path"
                lines.append(f"{i}. `{step.tool}` · {effect}{undo}{mark}")
            if len(plan.steps) > 30:
                lines.append(f"… and {len(plan.steps) - 30} more step(s)")
        if data.compensations and lc.state == S.COMPENSATING:
            lines += ["", "**Putting things back** (newest first):", ""]
            for c in list(reversed(data.compensations))[:30]:
                lines.append(f"- `{c.of}` {markdown_code(c.of_tool, 64)} → "
                             + (f"{markdown_code(c.tool, 64)} · {c.status}" if c.tool else "no recovery path"))
        pending = data.pending_approval
        if pending is not None and lc.state == S.AWAITING_APPROVAL:
            wf_id = workflow.info().workflow_id
            signal_input = (
                f"{{\"decision_id\": \"<unique id>\", \"approver\": \"NAME\", "
                f"\"plan_hash\": \"{pending.plan_hash}\", \"request_id\": \"{pending.request_id}\"}}"
            )
            lines += [
                "",
                f"**Waiting for approval** (request `{pending.request_id}`) until "
                f"**{utc(pending.expires_at)}** — {clip(pending.summary, 1000)}",
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
                f"`.venv/bin/tether approve {wf_id} --by NAME` (add `--key PATH` where approvals are signed)",
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


def _bounded_context(executed: list[ExecutedStep]) -> list[ExecutedStep]:
    """Observations newest first up to PLANNER_CONTEXT_CHARS; older ones keep only the digest."""
    context, room = [], PLANNER_CONTEXT_CHARS
    for done in reversed(executed):
        fits = len(done.observation) <= room
        room = room - len(done.observation) if fits else 0
        context.append(done if fits else done.model_copy(update={"observation": ""}))
    return list(reversed(context))


def _first_error(err: Exception) -> str:
    if isinstance(err, ValidationError):
        return first_error(err)
    return str(err).splitlines()[0][:200] if str(err) else type(err).__name__


def _failure(err: ActivityError) -> ToolFailure:
    """What a failed activity tells the engine: code, message, permanent?, suggested delay,
    and whether the attempt is known to be over."""
    cause = err.cause
    if isinstance(cause, ApplicationError):
        delay = cause.next_retry_delay.total_seconds() if cause.next_retry_delay else None
        code = cause.type or "error"
        return ToolFailure(
            code, cause.message, cause.non_retryable, delay, still_running=code == ATTEMPT_STILL_RUNNING
        )
    if isinstance(cause, TimeoutError):
        # start_to_close: the deadline plus the grace period passed; heartbeat: the worker is
        # gone. Either way the attempt is over, its outcome unknown.
        code = f"timeout_{cause.type.name.lower()}" if cause.type else "timeout"
        return ToolFailure(code, "no result in time (timeout or worker crash): outcome unknown", False)
    if isinstance(cause, CancelledError):
        # The server cancels an attempt no worker had started; a started one reports how its
        # tool ended (activities/tools.py), so a cancel of a started one is not expected.
        started = bool(err.started_event_id)
        return ToolFailure("cancelled", "activity cancelled", False, started=started)
    return ToolFailure(type(cause).__name__ if cause else "error", str(cause or err), False)
