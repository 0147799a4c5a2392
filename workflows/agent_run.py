"""The ``AgentRun`` workflow: a governed, durable agent run.

The planner proposes, this workflow decides. This module is the shell: it awaits activities,
timers and signals, and hands each outcome to the pure :class:`workflows.engine.Engine`, which
decides the next state through the transition table in ``workflows/states.py``. Every side
effect is an activity with an idempotency key and a retry rule derived from the tool's declared
effect; approvals are bound to a plan hash, checked against the policy by an activity, and
expire on a durable timer.

Deterministic code only: time is ``workflow.now()``, ids derive from the run chain and the
decision that made them (``derived_id``), no I/O and no environment reads. No local activity:
whatever the run acts on with authority is computed here with the fleet key (seals,
capabilities) or bears the fleet key's attestation, checked here (workflows/keys.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from workflows import policy
    from workflows.budgets import (
        CARRY_AMORTIZE,
        CARRY_BUDGET,
        CARRY_CONTINUE_AT,
        REQUEST_BUDGET,
        UPDATES_CONTINUE_AT,
        clip,
        continue_due,
        continue_wanted,
    )
    from workflows.effects import Effects, activity_failure, log_failure
    from workflows.engine import Engine
    from workflows.run_model import Decision, DecisionKind, IllegalState, ToolFailure
    from workflows.identity import LOOK_ALIKE
    from workflows.contract import (
        STRICT,
        ApprovalDecision,
        DecideRequest,
        DecideResult,
        ExecutedStep,
        HandoffRequest,
        ReviseDecideRequest,
        RevisionRequest,
        ToolEffect,
        ToolInfo,
        first_error,
        json_digest,
    )
    from workflows.wire import (
        CAPABILITY_EXPIRED,
        CAPABILITY_KEY_MISSING,
        DecisionCheck,
        HandoffCheck,
        PlannerInput,
        Proposal,
        RecoveryRequest,
        RecoverySource,
        Refusal,
        RunSetup,
        SnapshotRequest,
        Verdict,
    )
    from workflows.run_state import RunData, RunOutcome, RunRequest, RunSnapshot
    from workflows.published import BUILD, STATE_ATTRIBUTE
    from workflows.states import TEMPORAL_STATUS, IllegalTransition, Refs, RunState, TransitionRecord

S = RunState
T = TypeVar("T")
M = TypeVar("M", ApprovalDecision, HandoffRequest, RevisionRequest)

PLANNER_TIMEOUT = timedelta(minutes=2)
PLANNER_RETRY = RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=1))
# Observations handed back to the planner, newest first, in all (older ones keep only their
# digest), so planner inputs in history do not grow with the size of tool results.
PLANNER_CONTEXT_CHARS = 16_000
# A write that reached workers lacking its capability's key this many times in a row fails.
MAX_BOUNCES = 50
DECIDE_HINT = "approve, reject, revise (signals or the decide update), handoff"


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
            on_record=lambda record: self.effects.on_record(record),
            # Derived from the run chain and the plan it asks about: a reset asks the same.
            new_request_id=lambda: derived_id("req", self.data.first_run_id, self.data.plan.plan_hash if self.data.plan else "",
                                              str(self.data.lifecycle.state_version)),
        )
        # Decisions that passed the cheap checks on arrival, in arrival order; the main loop
        # checks each against the policy (an activity) and acts on it.
        self._inbox: list[tuple[DecisionKind, Decision]] = []
        self._handoff: HandoffRequest | None = None
        # The decide updates waiting for a verdict.
        self._verdicts: dict[str, DecideResult | None] = {}
        self._updates = 0  # decide Updates this execution took
        self._bounces = 0
        self._first_failure: ToolFailure | None = None  # how the first planner call failed
        # The carried state bore the workers' seal (or there was none): a run failing on a
        # forged one publishes nothing of it.
        self._verified = False
        self._loops = 0
        # History bytes at which a deferred continue-as-new is due (None: none deferred).
        self._continue_at: int | None = None
        # The Temporal side: activities, the audit sink, notifications, what the run publishes.
        self.effects = Effects(self.engine, snapshot=self.snapshot)

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
            if self.effects.published is not None:
                # Listed as it ends (the start said it would plan), like every other failure.
                workflow.upsert_search_attributes([STATE_ATTRIBUTE.value_set(S.FAILED.value)])
            raise ApplicationError(self._start_error, type="invalid_start_input", non_retryable=True)
        if not workflow.patched(BUILD):
            # Replaying a history an earlier build started: not ours to judge (the task fails,
            # the run waits for a worker of its own build).
            raise OlderBuild(
                f"older_build: this run was started by a worker build older than {BUILD}, which this worker "
                f"does not replay: run a worker of the build that started it until it ends (tether drain lists them)"
            )
        try:
            self._verify_carryover()
            await self._drive()
        except asyncio.CancelledError:
            self._decide(lambda now: self.engine.cancelled(workflow.cancellation_reason(), now))
            if self.data.lifecycle.state == S.COMPENSATING:
                await self._drive()  # on_cancel=compensate: put the ok writes back first
            await self._finish()
            raise
        except (ApplicationError, ActivityError):
            # Failing (an illegal state, a check that failed for good): every decision still gets
            # its answer.
            if self._verified:
                await self._finish()
            raise
        await self._finish()
        outcome = self.engine.outcome(workflow.info().workflow_id)
        if TEMPORAL_STATUS[outcome.state] == "Failed":
            # The execution fails, non-retryable, with the outcome in the failure's details
            # (client.run_outcome reads it back).
            timeline = self.data.lifecycle.timeline
            final = next((r.reason for r in reversed(timeline) if r.kind == "transition"), "")
            raise ApplicationError(
                f"run ended {outcome.state.value}: {clip(final, 300)}",
                outcome,
                type=outcome.state.value,
                non_retryable=True,
            )
        return outcome

    async def _finish(self) -> None:
        """The run has ended (completed, cancelled, failed, handed off, expired): nothing may be
        left unsaid on the record, or unanswered. Every decision in the inbox, the one being
        checked included, is refused (``run_ended``) and its decide Update answered."""
        if self._handoff is not None:
            self.engine.handoff_unhonoured(self._handoff, workflow.now())
            self._handoff = None
        if self._inbox:
            self._flush_inbox(ended=True)
        self.effects.notify()
        await self.effects.notified()
        await self.effects.checkpoint()
        await workflow.wait_condition(workflow.all_handlers_finished)

    def _verify_carryover(self) -> None:
        """Carried state only from this run's own previous run: its seal (workflow code, the
        fleet key) names the run the server says this one continued from and the next
        generation. Anything else is a forgery: the workflow task fails, the run stands."""
        if self._carry_raw is None:
            self._verified = True
            return
        generation = self.data.generation + 1
        self.effects.check_seal(self.request.carryover_seal, generation, self._carry_raw)
        self.data.generation = generation
        self._verified = True

    async def _drive(self) -> None:
        data = self.data
        first: Proposal | None = None
        if data.catalog is None or data.policy is None:
            # One snapshot per run: validation must not change under a run's feet. A run that
            # plans takes it with its first planner call.
            first = await self._first_plan() if self.request.compensate_run is None else None
            setup = first.setup if first is not None else None
            if setup is None:
                setup = await self.effects.activity("run_setup", self._snapshot_request(), RunSetup, "run setup", show=False)
            data.catalog, data.policy = setup.catalog, setup.policy
        if data.lifecycle.state == S.RECEIVED:
            self._decide(self.engine.received)
        if data.lifecycle.state == S.PLANNING and self.request.compensate_run is None and data.planning_rounds == 0:
            data.planning_rounds = 1  # the first planner call: its proposal, or how it failed
            failure = self._first_failure
            if first is not None:
                await self._planned(first)
            elif failure is not None:
                self._decide(lambda now: self.engine.planner_failed(failure, now))
        if data.lifecycle.state == S.RECEIVED and self.request.compensate_run is not None:
            # A compensation run: the original's closed record says what its approvals covered
            # (attested by the fleet key: a keyless poller cannot say what gets undone).
            source = await self.effects.activity(
                "recovery_source",
                RecoveryRequest(run_id=self.request.compensate_run, tenant=self.request.tenant),
                RecoverySource,
                f"recovery source · {self.request.compensate_run}",
                show=False,
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
                verdict = None
                if not self.engine.review().needs_approval:
                    # Auto-approved by the run's snapshot: the current file must agree.
                    verdict = await self._authority(from_step=0)
                self._decide(lambda now: self.engine.after_validated(now, _refusal(verdict), verdict))
            elif state == S.AWAITING_APPROVAL:
                await self._await_decision()
            elif state == S.APPROVED:
                verdict = await self._authority(from_step=data.next_step)
                self._decide(lambda now: self.engine.after_approved(_refusal(verdict), now, verdict))
            elif state == S.EXECUTING_TOOL:
                await self._execute_step()
            elif state == S.COMPENSATING:
                # The same step path as the plan's steps: one way to call a tool.
                if self._decide(self.engine.compensation_ready):
                    await self._execute_step()
            elif state == S.OBSERVING_RESULT:
                verdict = None
                if self.engine.current_step() is not None:
                    verdict = await self._authority(from_step=data.next_step)
                self._decide(lambda now: self.engine.after_observation(_refusal(verdict), now, verdict))
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
            proposal = await self._ask_planner(data.planning_rounds)
        except ActivityError as err:
            failure = activity_failure(err)
            self._decide(lambda now: self.engine.planner_failed(failure, now))
            return
        await self._planned(proposal)

    async def _first_plan(self) -> Proposal | None:
        """The first planner call, which also brings the run's setup (attested). None: the
        planner failed; the run then takes its setup alone and records the failure."""
        self.effects.publish(listed_as=S.PLANNING)  # corrects a start that listed the run otherwise
        try:
            return await self._ask_planner(1, setup=self._snapshot_request())
        except ActivityError as err:
            self._first_failure = activity_failure(err)
            return None

    async def _ask_planner(self, round: int, *, setup: SnapshotRequest | None = None) -> Proposal:
        data = self.data
        return await self.effects.activity(
            "plan",
            PlannerInput(
                goal=self.request.goal,
                planner=self.request.planner,
                playbook=self.request.playbook,
                executed=_bounded_context(data.executed),
                feedback=data.feedback,
                round=round,
                steps_done=data.steps_ok,
                not_approved=data.not_approved,
                setup=setup,
            ),
            Proposal,
            f"plan · {self.request.planner} · round {round}",
            timeout=PLANNER_TIMEOUT,
            retry=PLANNER_RETRY,
            # A proposal is untrusted input whoever wrote it; the setup that comes with the
            # first one is not, so that answer is attested.
            attested=setup is not None,
            show=setup is None,
        )

    async def _planned(self, proposal: Proposal) -> None:
        """The planner answered (PLANNING): a handoff that came meanwhile first, then the proposal."""
        data = self.data
        if await self._take_handoff():
            return
        ids = self._ids(f"plan:{data.planning_rounds}:{json_digest(proposal.model_dump(mode='json', exclude={'setup', 'attestation'}))}")
        self._decide(lambda now: self.engine.proposal(proposal, at=now, new_id=ids))

    async def _await_decision(self) -> None:
        pending = self.data.pending_approval
        if pending is None:
            raise ApplicationError(
                "AWAITING_APPROVAL without a pending approval", type="IllegalState", non_retryable=True
            )
        # The expiry, or the next escalation stage where the policy sets stages.
        wake, summary = self.engine.next_timer(bool(pending.escalation))
        remaining = (wake - workflow.now()).total_seconds()
        if remaining > 0 and not self._inbox and self._handoff is None:
            await self.effects.checkpoint()
            try:
                await workflow.wait_condition(
                    lambda: bool(self._inbox)
                    or self._handoff is not None
                    or self._continue_wanted()
                    # A refusal recorded while waiting goes to the sink now, not at the next step.
                    or bool(self.effects.audit)
                    or self._updates_exhausted(),
                    timeout=timedelta(seconds=remaining),
                    timeout_summary=summary,
                )
            except asyncio.TimeoutError:
                pass
        if await self._take_handoff():
            return
        if self._inbox:
            # Left in the inbox while the policy is consulted: whatever ends the run meanwhile
            # (a cancel, a failure) still answers it (_finish).
            kind, decision = self._inbox[0]
            verdict = await self.effects.activity(
                "policy_check_decision",
                DecisionCheck(
                    tenant=self.request.tenant,
                    workflow_id=workflow.info().workflow_id,
                    requested_by=self.request.requested_by,
                    first_run_id=self.data.first_run_id,
                    requester_verified=self.data.requester_verified,
                    **self.engine.decision_check(kind, decision),
                ),
                Verdict,
                f"policy check · {kind}",
            )
            self._inbox.pop(0)
            ids = self._ids(f"decision:{decision.decision_id}")
            self._decide(
                lambda now: self.engine.settle_decision(kind, decision, verdict.refusal, now, verdict.verified, new_id=ids)
            )
            self._answer(decision.decision_id)
            return
        if workflow.now() >= wake:
            self._decide(lambda now: self.engine.timer_fired(now, bool(pending.escalation)))
        # Otherwise woken to continue as new (or to write refusals to the sink): the loop does
        # that and comes back here.

    async def _authority(self, *, from_step: int) -> Verdict | None:
        """Re-check, through the policy activity, the approvals of the plan's remaining writes
        under the current file."""
        check = self.engine.authority_check(from_step=from_step)
        if check is None:
            return None
        return await self.effects.activity("policy_check_authority", check, Verdict, "policy re-check before writes")

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
        timeouts = policy.tool_timeouts(info.timeout_seconds)
        writes = info.effect != ToolEffect.READ_ONLY
        activity_id = None
        if writes:
            # Every write attempt carries a capability for exactly this call: the keyed re-check
            # under the current file allows it, then the run's own code mints it with the fleet
            # key. Nothing else can make a tool write.
            activity_id = f"{call.tool_call_id}.{self.data.tool_calls}.{self._bounces}"
            check = self.engine.authority_check(from_step=self.data.next_step)
            verdict = None
            if check is not None:
                verdict = await self.effects.activity(
                    "policy_check_authority", check.model_copy(update={"call": call}), Verdict,
                    "policy re-check before this write",
                )
            if verdict is None or verdict.refusal is not None:
                refusal = _refusal(verdict) or Refusal(rule="capability_invalid", message="no re-check for this write")
                self._decide(lambda now: self.engine.write_refused(refusal, now))
                return
            call = self.effects.mint(call, activity_id, check, ttl_seconds=timeouts.start_to_close)
            await self.effects.checkpoint(rest=False)  # the record of the approval is in the sink before a write
        else:
            self.effects.show()  # a read is no place the run rests: the sink gets its records later
        try:
            outcome = await self.effects.tool(
                call,
                activity_id=activity_id,
                start_to_close=timeouts.start_to_close,
                heartbeat=timeouts.heartbeat,
                # The Web UI's line for the call: a write names its effect class, a read only itself.
                summary=f"{step.tool} · " + ("" if not writes else f"{info.effect.value} · ")
                + (f"compensation {step.tool_call_id}" if data_state == S.COMPENSATING else f"step {self.data.next_step + 1}"),
                settled=lambda outcome, failure: self._decide(lambda now: self.engine.tool_settled_on_cancel(outcome, failure)),
            )
        except ActivityError as err:
            failure = activity_failure(err)
            log_failure(call.tool_call_id, failure)
            if activity_id and failure.code in (CAPABILITY_KEY_MISSING, CAPABILITY_EXPIRED) and self._bounces < MAX_BOUNCES:
                # The tool was not called: schedule the attempt again, fresh capability, soon.
                self._bounces += 1
                self.engine.capability_bounced(failure)
                await self.effects.checkpoint()
                await workflow.sleep(timedelta(seconds=1), summary="write scheduled again (capability)")
                return
            delay = self._decide(lambda now: self.engine.tool_failed(failure, now))
            if delay is None:
                return
            await self.effects.checkpoint()
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
        self._bounces = 0
        self._decide(lambda now: self.engine.tool_succeeded(outcome, now))

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
        name="revise",
        description="Revise the pending plan: a new plan version, validated like a proposal, then a "
        "new approval request. Data (RevisionRequest): {\"decision_id\": unique, \"editor\": name, "
        "\"plan_hash\" and \"request_id\": the pending ones, \"steps\": the whole revised list of "
        "{\"tool\", \"args\"}, \"reason\": text, \"signature\": where required}.",
    )
    def revise(self, *args: Any) -> None:
        revision = self._decode("revise", args, RevisionRequest)
        if revision is not None:
            self._screen("revise", revision)

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
        "(DecideRequest): the ApprovalDecision fields plus \"kind\": \"approve\" | \"reject\"; or the "
        "RevisionRequest fields plus \"kind\": \"revise\". "
        "Only a malformed payload, a repeated decision_id or an Update past the 1,500 an execution "
        "takes (continuing_as_new: send it again) is refused before history; every other "
        "refusal (stale, expired, four-eyes, role, invalid revision, ...) is on the run's record, and "
        "the answer (DecideResult) is the record the run wrote for the decision.",
    )
    async def decide(self, *args: Any) -> DecideResult:
        decision = self._decide_payload(args)
        kind: DecisionKind = decision.kind
        plain: Decision = (
            RevisionRequest if isinstance(decision, ReviseDecideRequest) else ApprovalDecision
        ).model_validate(decision.model_dump(exclude={"kind"}))
        self._updates += 1
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
        # Runs before anything reaches history, so what it refuses is on no record: only what
        # cannot be attributed (a malformed payload) or cannot count at all (a decision id seen
        # before, or one this execution has no room for: sent again, it counts in the continued
        # run). Every policy refusal goes through the handler and onto the timeline.
        decision = self._decide_payload(args)
        refusal = policy.repeated_decision_refusal(decision.decision_id, self.data, in_flight=self._verdicts)
        if refusal is None:
            refusal = policy.updates_refusal(self._updates)  # it continues as new first
        if refusal is not None:
            raise ValueError(f"{decision.kind} refused [{refusal.rule}]: {refusal.message}")

    def _decide_payload(self, args: Sequence[Any]) -> DecideRequest | ReviseDecideRequest:
        if len(args) != 1:
            raise ApplicationError(
                f"decide refused [malformed]: expected one DecideRequest, got {len(args)} argument(s)",
                type="malformed",
            )
        model = ReviseDecideRequest if isinstance(args[0], dict) and args[0].get("kind") == "revise" else DecideRequest
        try:
            return model.model_validate(args[0], context=STRICT)
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
            step=data.steps_executed,
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
            audit_waiting=len(self.effects.audit),
            audit_error=self.effects.audit_error,
            updates=self._updates,
            tools=self._plan_tools(),
            revisions=data.revisions,
        )

    def _plan_tools(self) -> list[ToolInfo]:
        data = self.data
        if data.plan is None or data.catalog is None:
            return []
        names = dict.fromkeys(s.tool for s in data.plan.steps)
        return [info for name in names if (info := data.catalog.get(name)) is not None]

    @workflow.query(
        name="timeline",
        description="Audit timeline: the first and the latest transitions and refused decisions, "
        "with actor, reason and refs (list of TransitionRecord, bounded; `tether timeline --all` "
        "adds the audit sink's full record).",
    )
    def timeline(self, *args: Any) -> list[TransitionRecord]:
        return self.data.lifecycle.timeline

    @workflow.query(
        name="steps",
        description="The steps executed: ids, tools, outcomes and digests, no arguments or "
        "observations (list of ExecutedStep; a run that continued as new: its latest 20).",
    )
    def steps(self, *args: Any) -> list[ExecutedStep]:
        return self.engine.steps()

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
            rule="look_alike_name" if LOOK_ALIKE in problem else "malformed_signal",
        )
        return None

    def _screen(self, kind: DecisionKind, decision: Decision) -> None:
        """Cheap, state-only checks now; the policy check follows in the main loop."""
        if self.engine.screen_decision(kind, decision, workflow.now()):
            self._inbox.append((kind, decision))
        else:
            self._answer(decision.decision_id)  # nobody waits on a signal; forget its refusal

    def _answer(self, decision_id: str) -> None:
        """Give a waiting decide update its verdict, from the record the run wrote for it."""
        unrecorded = self.engine.unrecorded_refusals.pop(decision_id, None)
        if decision_id not in self._verdicts:
            return
        record = next(
            (r for r in reversed(self.data.lifecycle.timeline) if r.refs.decision_id == decision_id), None
        )
        if record is None:  # a refusal counted in a flood, not recorded
            self._verdicts[decision_id] = DecideResult(
                decision_id=decision_id, outcome="refused", state=self.data.lifecycle.state,
                reason=f"refused: {unrecorded.message} (counted, not recorded: see snapshot.refusals)"
                if unrecorded else "refused (counted, not recorded: see snapshot.refusals)",
                rule=unrecorded.rule if unrecorded else "flood",
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

    def _ids(self, basis: str) -> Callable[[int], str]:
        """Tool call ids (and so idempotency keys) from the run chain and the decision that made
        the plan: a reset or a replay makes the same ones, another run never does."""
        first = self.data.first_run_id
        return lambda n: f"tc-{n:03d}-{derived_digest('tc', first, basis, str(n))[:12]}"

    def _snapshot_request(self) -> SnapshotRequest:
        return self.engine.snapshot_request(workflow.info().workflow_id, workflow.info().start_time)

    async def _take_handoff(self, detail: str | None = None, refs: Refs | None = None) -> bool:
        """Honour a pending handoff where the table allows, once the current policy file (and the
        sender's signature, where required) says it may. ``refs``: the step it ends."""
        request = self._handoff
        if request is None or not self.engine.can_take_handoff():
            return False
        verdict = await self.effects.activity(
            "policy_check_handoff",
            HandoffCheck(
                tenant=self.request.tenant,
                workflow_id=workflow.info().workflow_id,
                first_run_id=self.data.first_run_id,
                handoff=request,
            ),
            Verdict,
            "policy check · handoff",
        )
        self._handoff = None
        return self._decide(
            lambda now: self.engine.take_handoff(request, now, detail, verdict.refusal, verdict.verified, refs=refs)
        )

    def _flush_inbox(self, *, ended: bool = False) -> None:
        """The run left AWAITING_APPROVAL (``ended``: the run is over): decisions still queued
        can no longer count."""
        ended = ended or self.data.lifecycle.terminal
        for kind, decision in self._inbox:
            self.engine.refuse_unsettled(kind, decision, workflow.now(), ended=ended)
            self._answer(decision.decision_id)
        self._inbox.clear()

    def _updates_exhausted(self) -> bool:
        """Near Temporal's per-run Update limit, with no Update in flight: time to continue."""
        return self._updates >= UPDATES_CONTINUE_AT and workflow.all_handlers_finished()

    def _quiet(self) -> bool:
        """Nothing accepted but not yet acted on, and nothing in flight that continuing would lose."""
        return not self._inbox and self._handoff is None and not self.effects.notifying and workflow.all_handlers_finished()

    async def _maybe_continue_as_new(self) -> None:
        data = self.data
        self._loops += 1
        suggested = self._continue_wanted() or self._updates_exhausted()
        if not suggested and self._loops % 16:
            return
        # Only between steps: no tool in flight and nothing accepted but not yet acted on.
        if data.lifecycle.state not in (S.PLANNING, S.AWAITING_APPROVAL, S.OBSERVING_RESULT) or not self._quiet():
            return
        # The carried state is measured only here (it costs a serialisation), not every loop.
        size = len(data.model_dump_json())
        if not suggested and size < CARRY_CONTINUE_AT:
            return
        carried = None  # what continuing writes (the folded state and the request), once measured
        if suggested and size < CARRY_CONTINUE_AT and not self._updates_exhausted():
            info = workflow.info()
            carried = self.engine.carried_bytes()
            history = info.get_current_history_size()
            if not continue_due(history_bytes=history, history_events=info.get_current_history_length(), carry_bytes=carried):
                self._continue_at = CARRY_AMORTIZE * carried  # asked again once history is there
                return
        # Every record to the sink and the view published first; then nothing is awaited until
        # the run continues, so the state sealed is the state carried (signals that come in
        # meanwhile wait for the next loop).
        await self.effects.checkpoint()
        if not self._quiet():
            return  # a decision or handoff came in meanwhile: act on it first
        self.engine.fold_for_carry()  # the next run gets the latest steps and records
        size = carried if carried is not None else (
            len(data.model_dump_json()) + len(self.request.model_dump_json(exclude={"carryover"}))
        )
        if size > CARRY_BUDGET + REQUEST_BUDGET:
            # Cleanly, with the reason: a payload over the limit would fail every workflow task.
            raise ApplicationError(
                f"carried state and request are {size} bytes, over their "
                f"{CARRY_BUDGET + REQUEST_BUDGET}-byte budget",
                type="carry_budget",
                non_retryable=True,
            )
        self.effects.continue_as_new()

    def _continue_wanted(self) -> bool:
        """The server suggests continue-as-new, and the run has not put it off (or its history
        has got where it put it off to)."""
        info = workflow.info()
        return info.is_continue_as_new_suggested() and continue_wanted(
            history_bytes=info.get_current_history_size(),
            history_events=info.get_current_history_length(),
            deferred_to=self._continue_at,
        )


class OlderBuild(RuntimeError):
    """A history this build does not replay: fails the workflow task, never the run."""


def derived_digest(kind: str, *parts: str) -> str:
    """What an id is made of: the run chain, the decision, the plan; never the run's random
    stream, so a reset run makes the same ids and another run never does."""
    return hashlib.sha256("\x1f".join((kind, *parts)).encode()).hexdigest()


def derived_id(kind: str, *parts: str) -> str:
    return f"{kind}-{derived_digest(kind, *parts)[:24]}"


def _refusal(verdict: Verdict | None) -> Refusal | None:
    return verdict.refusal if verdict is not None else None


def _bounded_context(executed: list[ExecutedStep]) -> list[ExecutedStep]:
    """Observations newest first up to PLANNER_CONTEXT_CHARS; older ones keep only the digest."""
    context, room = [], PLANNER_CONTEXT_CHARS
    for done in reversed(executed):
        fits = len(done.observation) <= room
        room = room - len(done.observation) if fits else 0
        context.append(done if fits else done.model_copy(update={"observation": ""}))
    return list(reversed(context))
