"""The ``AgentRun`` workflow: a governed, durable agent run.

The planner proposes, the runtime decides. This module is the shell: the signal, Update and
query handlers, and one loop. The :class:`workflows.engine.Engine` says what to do next (call
an activity, run a tool, wait, continue as new, end); :mod:`workflows.effects` turns that into
Temporal calls; the engine takes the result and decides, through the transition table in
``workflows/states.py``. Every side effect is an activity with an idempotency key and a retry
rule derived from the tool's declared effect; approvals are bound to a plan hash, checked
against the policy by an activity, and expire on a durable timer.

Deterministic code only: time is ``workflow.now()``, ids derive from the run chain and the
decision that made them (``derived_id``), no I/O and no environment reads. No local activity:
whatever the run acts on with authority is computed by the workflow code with the fleet key
(seals, capabilities) or bears the fleet key's attestation, checked by it (workflows/keys.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from workflows import policy
    from workflows.budgets import clip
    from workflows.commands import End
    from workflows.contract import (
        STRICT,
        ApprovalDecision,
        CancelRequest,
        DecideRequest,
        DecideResult,
        ExecutedStep,
        HandoffRequest,
        ReviseDecideRequest,
        RevisionRequest,
        first_error,
    )
    from workflows.effects import CHILD_ONCE, QUEUE_CAP, Effects
    from workflows.engine import Engine
    from workflows.identity import LOOK_ALIKE
    from workflows.published import BUILD, HISTORY_IDS, PREVIOUS_BUILD, STATE_ATTRIBUTE
    from workflows.contract import derived_id
    from workflows.run_model import Decision, DecisionKind, IllegalState, RunFailed, ToolFailure
    from workflows.run_state import RunData, RunOutcome, RunRequest, RunSnapshot, RunView
    from workflows.states import IllegalTransition, RunState, TransitionRecord

S = RunState
T = TypeVar("T")
M = TypeVar("M", ApprovalDecision, CancelRequest, HandoffRequest, RevisionRequest)

DECIDE_HINT = "approve, reject, revise (signals or the decide update), handoff, the cancel update"


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
        self.engine = Engine(
            self.data,
            request,
            workflow_id=info.workflow_id,
            first_run_id=info.first_execution_run_id,
            on_record=lambda record: self.effects.on_record(record),
            # Derived from the run chain and the plan it asks about: a reset asks the same.
            new_request_id=lambda: derived_id("req", self.data.first_run_id, self.data.plan.plan_hash if self.data.plan else "",
                                              str(self.data.lifecycle.state_version)),
            started_at=info.start_time,
            # A live patch: a run that queued more than that before keeps doing so on replay.
            queue_capped=lambda: workflow.patched(QUEUE_CAP),
        )
        # The carried state bore the workers' seal (or there was none): a run failing on a
        # forged one publishes nothing of it.
        self._verified = False
        self._program_task: asyncio.Task[Any] | None = None  # the run's program (run), once started
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
        # One marker a run: this build's. Asked first, so a run this build starts writes no other.
        if workflow.patched(BUILD):
            self.effects.this_build = True
        elif workflow.patched(PREVIOUS_BUILD):
            self.effects.this_build = False
            self.effects.history_ids = workflow.patched(HISTORY_IDS)
            self.engine.this_build = False  # its decisions' and write attempts' ids as that build made them
        else:
            # Replaying a history an earlier build started: not ours to judge (the task fails,
            # the run waits for a worker of its own build).
            raise OlderBuild(
                f"older_build: this run was started by a worker build older than {PREVIOUS_BUILD}, which this "
                f"worker does not replay: run a worker of the build that started it until it ends (tether drain "
                f"lists them)"
            )
        # What a cancel request the run takes stops (the cancel Update), as a Temporal cancel does.
        self._program_task = asyncio.current_task()
        if self.engine.cancel_taken is not None and self._program_task is not None:
            self._program_task.cancel()  # taken before the program began: it stops at its first wait
        try:
            self._verify_carryover()
            self.engine.grant_problem = self.effects.grant_problem(self.request)
            # A child this build started: its ids derive from its parent's chain and step.
            self.engine.child_ids = self.request.grant is not None and self.effects.fixed(CHILD_ONCE)
            await self._drive()
        except asyncio.CancelledError:
            self._apply(lambda now: self.engine.cancelled(workflow.cancellation_reason(), now))
            if self.data.lifecycle.state == S.COMPENSATING:
                await self._drive()  # on_cancel=compensate: put the ok writes back first
            await self._drive(ending=True)
            if self.engine.cancel_taken is None or workflow.cancellation_reason() is not None:
                raise  # an operator's Temporal cancel: the execution is Canceled
            # The run's own verdict on a person's request: the execution completes, its outcome
            # CANCELLED (Temporal takes no cancel a run asks of itself).
            return self._outcome()
        except (ApplicationError, ActivityError):
            # Failing (an illegal state, a check that failed for good): every decision still gets
            # its answer.
            if self._verified:
                await self._drive(ending=True)
            raise
        await self._drive(ending=True)
        outcome = self._outcome()
        failed = self.engine.final_failure()
        if failed is not None:
            # The execution fails, non-retryable, with the outcome in the failure's details
            # (client.run_outcome reads it back).
            raise ApplicationError(failed, outcome, type=outcome.state.value, non_retryable=True)
        return outcome

    def _outcome(self) -> RunOutcome:
        return self.effects.seal_outcome(self.request, self.engine.outcome(workflow.info().workflow_id), chain=self.engine.child_ids)

    async def _drive(self, *, ending: bool = False) -> None:
        """The run's one loop: the engine says what to do next, effects carry it out, the engine
        takes the result. ``ending``: the run has ended; nothing may be left unsaid on the
        record, or unanswered."""
        engine, effects = self.engine, self.effects
        engine.start(ending=ending)
        while True:
            try:
                command = engine.next(workflow.now())
            except RunFailed as e:
                # Non-retryable: a bare exception would only fail the task and retry forever.
                raise ApplicationError(str(e), type=e.kind, non_retryable=True) from None
            if isinstance(command, End):
                return
            try:
                result = await effects.perform(command)
            except asyncio.CancelledError:
                landed = effects.take_landed()
                if landed is not None:  # the cancel met a parallel group: what each did is kept
                    self._apply(lambda now: engine.group_settled_on_cancel(landed))
                settled = effects.take_settled()
                if settled is not None:  # the cancel met a tool call: what it did is kept
                    self._apply(lambda now: engine.tool_settled_on_cancel(*settled))
                raise
            engine.on(command, result, workflow.now())

    def _verify_carryover(self) -> None:
        """Carried state only from this run's own previous run: its seal (workflow code, the
        fleet key) names the run the server says this one continued from and the next
        generation. Anything else is a forgery: the workflow task fails, the run stands."""
        if self._carry_raw is None:
            self._verified = True
            return
        generation = self.data.generation + 1
        self.effects.check_seal(self.request.carryover_seal, generation, self._carry_raw)
        self.engine.carried_over(generation)
        self._verified = True

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
            self.engine.receive("approve", decision, workflow.now())

    @workflow.signal(
        name="reject",
        description="Reject the pending plan. Data (ApprovalDecision): {\"decision_id\": unique, "
        "\"approver\": name, \"plan_hash\": the pending plan's hash, \"request_id\": the pending "
        "approval request's id, \"reason\": optional}.",
    )
    def reject(self, *args: Any) -> None:
        decision = self._decode("reject", args, ApprovalDecision)
        if decision is not None:
            self.engine.receive("reject", decision, workflow.now())

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
            self.engine.receive("revise", revision, workflow.now())

    @workflow.signal(
        name="handoff",
        description="Hand the run to a human; it ends in HANDED_OFF. Data (HandoffRequest): "
        "{\"by\": name, \"reason\": text, \"decision_id\": optional, \"signature\": where required}.",
    )
    def handoff(self, *args: Any) -> None:
        request = self._decode("handoff", args, HandoffRequest)
        if request is not None:
            self.engine.receive_handoff(request, workflow.now())

    @workflow.update(
        name="cancel",
        description="Ask the run to stop; the run's policy decides (membership of its tenant, Cedar's "
        "cancel, a signature where required) and the answer (DecideResult) is its record: the cancel "
        "(CANCELLED, or COMPENSATING with on_cancel=compensate, once a tool in flight has settled) or "
        "the refusal, with its rule. Data (CancelRequest): {\"by\": name, \"reason\": text, "
        "\"decision_id\": unique, \"signature\": where required}. A malformed payload is refused on "
        "the record too.",
    )
    async def cancel(self, *args: Any) -> DecideResult:
        request = self._decode("cancel", args, CancelRequest)
        if request is None:
            raise ApplicationError("cancel refused [malformed]: expected one CancelRequest (see the run's record)",
                                   type="malformed")
        engine = self.engine
        judge = engine.receive_cancel(request, workflow.now())
        if isinstance(judge, DecideResult):
            return judge
        verdict = await self.effects.perform(judge)
        if isinstance(verdict, ToolFailure):
            engine.cancel_unjudged(request, verdict.code, workflow.now())
        elif engine.take_cancel(request, verdict, workflow.now()) and self._program_task is not None:
            self._program_task.cancel()  # the run stops where it is, as for a Temporal cancel
        await workflow.wait_condition(lambda: engine.verdicts.get(request.decision_id) is not None)
        return engine.take_verdict(request.decision_id)

    @cancel.validator
    def _validate_cancel(self, *args: Any) -> None:
        # Before history: only an Update this execution has no room for (sent again, it counts
        # in the continued run). Everything else is judged on the run's record.
        refusal = policy.updates_refusal(self.engine.updates)
        if refusal is not None:
            raise ApplicationError(f"cancel refused [{refusal.rule}]: {refusal.message}", type=refusal.rule)

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
        engine = self.engine
        answered = engine.deciding(kind, plain, workflow.now())
        if answered is not None:
            return answered
        await workflow.wait_condition(lambda: engine.verdicts.get(plain.decision_id) is not None)
        return engine.take_verdict(plain.decision_id)

    @decide.validator
    def _validate_decide(self, *args: Any) -> None:
        # Runs before anything reaches history, so what it refuses is on no record: only what
        # cannot be attributed (a malformed payload) or cannot count at all (a decision id seen
        # before, or one this execution has no room for: sent again, it counts in the continued
        # run). Every policy refusal goes through the handler and onto the timeline.
        decision = self._decide_payload(args)
        refusal = policy.repeated_decision_refusal(decision.decision_id, self.data, in_flight=self.engine.verdicts)
        if refusal is None:
            refusal = policy.updates_refusal(self.engine.updates)  # it continues as new first
        if refusal is not None:
            # The rule is the error's type: a client maps it, never parses the message.
            raise ApplicationError(f"{decision.kind} refused [{refusal.rule}]: {refusal.message}", type=refusal.rule)

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
        return self.engine.snapshot(
            workflow.info().workflow_id, audit_waiting=len(self.effects.audit), audit_error=self.effects.audit_error
        )

    @workflow.query(
        name="view",
        description="The snapshot as the run stands now with its latest records, signed for this "
        "run by the fleet's key as its published view is (RunView): a live answer a client can "
        "check, where a keyless poller's answer would not verify.",
    )
    def view(self, *args: Any) -> RunView:
        return self.effects.live_view()

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

    # ------------------------------------------------------------------ helpers

    def _apply(self, step: Callable[[Any], T]) -> T:
        """Run one engine decision at workflow time; a move the table denies, or a state the
        engine cannot act in, fails the run."""
        try:
            return step(workflow.now())
        except (IllegalTransition, IllegalState) as e:
            # Non-retryable: a bare exception would only fail the task and retry forever.
            raise ApplicationError(str(e), type=type(e).__name__, non_retryable=True) from None


class OlderBuild(RuntimeError):
    """A history this build does not replay: fails the workflow task, never the run."""
