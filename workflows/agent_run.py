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
from collections.abc import Callable
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
    from workflows.engine import DecisionKind, Engine, IllegalState, ToolFailure
    from workflows.models import (
        ATTEMPT_STILL_RUNNING,
        ApprovalDecision,
        CatalogRequest,
        DecisionCheck,
        ExecutedStep,
        HandoffRequest,
        PlannerInput,
        PolicySnapshot,
        Proposal,
        Refusal,
        RunData,
        RunOutcome,
        RunRequest,
        RunSnapshot,
        SnapshotRequest,
        ToolCatalog,
        ToolOutcome,
        Verdict,
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


# A start input that does not validate as a RunRequest (say, from `temporal workflow start
# --input`) fails the run with pydantic's message; otherwise its first task would retry forever.
@workflow.defn(name="AgentRun", failure_exception_types=[ValidationError])
class AgentRun:
    @workflow.init
    def __init__(self, request: RunRequest) -> None:
        self.request = request
        self.data: RunData = request.carryover or RunData()
        self.engine = Engine(
            self.data, request, workflow_id=workflow.info().workflow_id, on_record=self._on_record
        )
        # Decisions that passed the cheap checks in the signal handler, in arrival order; the
        # main loop checks each against the policy (an activity) and acts on it.
        self._inbox: list[tuple[DecisionKind, ApprovalDecision]] = []
        self._handoff: HandoffRequest | None = None
        start_attributes = workflow.info().typed_search_attributes
        self._published: str | None = start_attributes.get(STATE_ATTRIBUTE)
        # start_run sets the tenant and continue-as-new carries it: upsert it only when missing.
        self._tenant_published = start_attributes.get(TENANT_ATTRIBUTE) == request.tenant

    # ------------------------------------------------------------------ main loop

    @workflow.run
    async def run(self, request: RunRequest) -> RunOutcome:
        try:
            await self._drive()
        except asyncio.CancelledError:
            self._decide(lambda now: self.engine.cancelled(workflow.cancellation_reason(), now))
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
        if data.catalog is None:
            # One snapshot per run: validation must not change under a run's feet.
            data.catalog = await self._activity(
                "tool_catalog", CatalogRequest(tenant=self.request.tenant), ToolCatalog, "tool catalog snapshot",
                local=True,
            )
        if data.policy is None:
            data.policy = await self._activity(
                "policy_snapshot", SnapshotRequest(tenant=self.request.tenant), PolicySnapshot, "policy snapshot",
                local=True,
            )
        if data.lifecycle.state == S.RECEIVED:
            self._decide(self.engine.received)

        while not data.lifecycle.terminal:
            self._maybe_continue_as_new()
            state = data.lifecycle.state
            if state == S.PLANNING:
                await self._plan()
            elif state == S.VALIDATION_FAILED:
                self._decide(self.engine.after_validation_failed)
            elif state == S.VALIDATED:
                self._decide(self.engine.after_validated)
            elif state == S.AWAITING_APPROVAL:
                await self._await_decision()
            elif state == S.APPROVED:
                refusal = await self._authority_refusal(from_step=data.next_step)
                self._decide(lambda now: self.engine.after_approved(refusal, now))
            elif state == S.EXECUTING_TOOL:
                await self._execute_step()
            elif state == S.OBSERVING_RESULT:
                refusal = None
                if self.engine.current_step() is not None:
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
        if self._take_handoff():
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
        if self._take_handoff():
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
                ),
                Verdict,
                f"policy check · {kind}",
                local=True,
            )
            self._decide(lambda now: self.engine.settle_decision(kind, decision, verdict.refusal, now))
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
        if self._take_handoff(detail=detail, refs=refs):
            self.engine.step_handed_off()
            return
        call = self._decide(self.engine.next_tool_call)
        if call is None:
            return
        self._publish()
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
            summary=f"{step.tool} · {info.effect.value} · step {self.data.next_step + 1}",
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
            self._publish()
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

    @workflow.signal(
        name="approve",
        description="Approve the pending plan. Data (ApprovalDecision): {\"decision_id\": unique, "
        "\"approver\": name, \"plan_hash\": the pending plan's hash, \"comment\": optional}. "
        "Counts only for the pending plan hash, before the approval expires.",
    )
    def approve(self, payload: RawValue) -> None:
        # Raw, then validated here: a malformed decision is refused on the timeline instead of
        # being dropped by the SDK with only a worker log line. The payload is ApprovalDecision.
        decision = self._decode("approve", payload, ApprovalDecision)
        if decision is not None:
            self._screen("approve", decision)

    @workflow.signal(
        name="reject",
        description="Reject the pending plan. Data (ApprovalDecision): {\"decision_id\": unique, "
        "\"approver\": name, \"plan_hash\": the pending plan's hash, \"reason\": optional}.",
    )
    def reject(self, payload: RawValue) -> None:
        decision = self._decode("reject", payload, ApprovalDecision)
        if decision is not None:
            self._screen("reject", decision)

    @workflow.signal(
        name="handoff",
        description="Hand the run to a human; it ends in HANDED_OFF. Data (HandoffRequest): "
        "{\"by\": name, \"reason\": text}.",
    )
    def handoff(self, payload: RawValue) -> None:
        request = self._decode("handoff", payload, HandoffRequest)
        if request is None:
            return
        if self._handoff is not None:
            self.engine.refuse(
                at=workflow.now(),
                actor=f"operator:{request.by}",
                reason="handoff refused: a handoff is already pending",
                rule="handoff_pending",
                refs=Refs(decision_id=request.decision_id),
            )
        elif self.engine.screen_handoff(request, workflow.now()):
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

    def _decode(self, signal: str, payload: RawValue, model: type[M]) -> M | None:
        try:
            return workflow.payload_converter().from_payload(payload.payload, model)
        except Exception as err:  # anything a sender can get wrong: type, fields, JSON
            self.engine.refuse(
                at=workflow.now(),
                actor="unknown",
                reason=f"{signal} refused: malformed payload, expected {model.__name__} "
                f"({_first_error(err)})",
                rule="malformed_signal",
            )
            return None

    def _screen(self, kind: DecisionKind, decision: ApprovalDecision) -> None:
        """Cheap, state-only checks now; the policy check follows in the main loop."""
        if self.engine.screen_decision(kind, decision, workflow.now()):
            self._inbox.append((kind, decision))

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
    ) -> T:
        self._publish()
        # Local for the snapshots and policy checks: in-process reads that run inside the
        # current workflow task and leave one marker event, instead of an activity task plus
        # another workflow task (six events and two more server round trips; bench/overhead.py).
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

    def _take_handoff(self, detail: str | None = None, refs: Refs | None = None) -> bool:
        request = self._handoff
        taken = self._decide(lambda now: self.engine.take_handoff(request, now, detail, refs=refs))
        if taken:
            self._handoff = None
        return taken

    def _flush_inbox(self) -> None:
        """The run left AWAITING_APPROVAL: decisions still queued can no longer count."""
        for kind, decision in self._inbox:
            self.engine.refuse_unsettled(kind, decision, workflow.now())
        self._inbox.clear()

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
