"""The run model: the one place that writes a run's state (``RunData``) and records it, and
the helpers every phase of the engine shares (the run's facts, the current step and its
refs, how a step ends on the record). The phases (planning, approvals, steps, handoff,
compensating, outbox, carry, views) derive from :class:`RunModel`; ``workflows/engine.py``
joins them into the :class:`~workflows.engine.Engine`. No Temporal, no I/O: time and ids
are passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol, TypeVar, overload

from workflows import policy
from workflows.commands import Call, Command, Landed, RunChild, RunGroup
from workflows.budgets import EXECUTED_OBSERVATION_CHARS, EXECUTED_WINDOW
from workflows.contract import (
    ReadFound,
    ApprovalDecision,
    CancelRequest,
    CompensationCall,
    DecideResult,
    ExecutedStep,
    HandoffRequest,
    Limits,
    Plan,
    PlanStep,
    RevisionRequest,
    ToolCatalog,
    run_catalog,
    ToolInfo,
)
from workflows.plan_check import tool_call_ids
from workflows.policy_file import TenantPolicy
from workflows.run_state import PendingApproval, RunData, RunOutcome, RunRequest, found_steps
from workflows.states import EffectOutcome, IllegalTransition, Refs, RunState, TransitionRecord
from workflows.validation import Validation
from workflows.wire import (
    AuthorityCheck,
    PlanJudged,
    DecisionCheck,
    PlanReview,
    Proposal,
    RecoverySource,
    Refusal,
    SnapshotRequest,
    ToolOutcome,
    Verdict,
)


S = RunState
T = TypeVar("T")
# A piece of the run's program: it yields commands, is sent each one's result, and returns T.
Program = Generator[Command, Any, T]
DecisionKind = Literal["approve", "reject", "revise"]
# What waits in the run's inbox: an approve / reject decision, or a revision.
Decision = ApprovalDecision | RevisionRequest


class IllegalState(Exception):
    """The run is in no shape for this decision (a bug, or carried-over state that does not fit).

    The workflow fails the run on it, non-retryably: a bare exception would only fail the
    workflow task and retry it forever.
    """


class RunFailed(Exception):
    """The run fails, non-retryably: the workflow raises it as an ApplicationError of type
    ``kind`` (a bare exception would only fail the workflow task and retry it forever)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def require(condition: T | None, what: str) -> T:
    """Fails the run (:class:`IllegalState`) unless ``condition`` holds, and returns it: given a
    value the run's state guarantees here (``pending = require(data.pending_approval, "...")``),
    the value, which the type checker then knows is there."""
    if not condition:
        raise IllegalState(what)
    return condition


@dataclass(frozen=True)
class ToolFailure:
    """How a tool call failed, as the workflow saw it."""

    code: str
    message: str  # for the worker log only: it may quote arguments, so never on the timeline
    permanent: bool  # the tool said a retry cannot help (bad input, 4xx)
    suggested_delay: float | None = None  # e.g. from Retry-After
    still_running: bool = False  # the attempt had not ended when it was reported (not over)
    started: bool = True  # False: cancelled before any worker picked the attempt up


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


class Phases(Protocol):
    """What each phase of the engine offers the others (and the run's program, ``drive.py``).

    The phases are mixins of one class (:class:`~workflows.engine.Engine`) and call one another
    through ``self``; this is where those calls are declared, so the type checker sees them: a
    phase method renamed, removed or given another signature fails the check (``Engine(...)``
    cannot be made with a method left abstract here), not a run. A method one phase alone calls
    does not belong here. Grouped by the phase that implements it.
    """

    # planning.Planning
    def received(self, at: datetime) -> None: ...
    def planner_failed(self, failure: ToolFailure, at: datetime) -> None: ...
    def validate(self, proposal: Proposal, new_id: Callable[[int], str]) -> Validation: ...
    def _adopt(self, plan: Plan) -> None: ...
    def after_validation_failed(self, at: datetime) -> None: ...
    def _replan_or_end(
        self, end: RunState, *, at: datetime, actor: str, why: str, end_reason: str, refs: Refs | None = None
    ) -> None: ...
    def after_validated(self, at: datetime, refusal: Refusal | None = None, ask: Verdict | None = None) -> None: ...
    def snapshot_request(self, workflow_id: str, started_at: datetime | None) -> SnapshotRequest: ...
    def _first_plan(self) -> Program[tuple[Proposal | None, ToolFailure | None]]: ...
    def _plan(self) -> Program[None]: ...
    def _planned(self, proposal: Proposal) -> Program[None]: ...

    # approvals.Approvals
    def request_approval(self, *, at: datetime, reason: str, ask: Verdict | None = None) -> None: ...
    def adopt(self, ask: Verdict | None) -> None: ...
    def screen_decision(self, kind: DecisionKind, decision: Decision, at: datetime) -> bool: ...
    def decision_check(self, kind: DecisionKind, decision: Decision) -> dict[str, Any]: ...
    def _remember_decision(self, decision_id: str) -> None: ...
    def settle_decision(
        self,
        kind: DecisionKind,
        decision: Decision,
        verdict: Refusal | None,
        at: datetime,
        verified: bool = False,
        *,
        new_id: Callable[[int], str] | None = None,
    ) -> None: ...
    def authority_if_approved(self, kind: DecisionKind, decision: Decision) -> AuthorityCheck | None: ...
    def on_roster(self, kind: DecisionKind, decision: Decision, check: DecisionCheck) -> Verdict | None: ...
    def approval_lapsed(self, refusal: Refusal, at: datetime, ask: Verdict | None) -> None: ...
    def asks_roster(self) -> bool: ...
    def take_rosters(self, verdict: Verdict | None) -> None: ...
    def refuse_unsettled(self, kind: DecisionKind, decision: Decision, at: datetime, *, ended: bool = False) -> None: ...
    def _refuse_decision(self, kind: DecisionKind, decision: ApprovalDecision, refusal: Refusal, at: datetime) -> None: ...
    def after_approved(self, refusal: Refusal | None, at: datetime, ask: Verdict | None = None) -> None: ...

    # timers.Timers
    def next_timer(self, escalate: bool = True) -> tuple[datetime, str]: ...
    def timer_fired(self, at: datetime, escalate: bool = True) -> None: ...

    # approvals.Decisions
    def receive(self, kind: DecisionKind, decision: Decision, at: datetime) -> None: ...
    def take_verdict(self, decision_id: str) -> DecideResult: ...
    def answer(self, decision_id: str) -> None: ...
    def refuse_early(self, at: datetime, *, ended: bool = False) -> None: ...
    def _flush_inbox(self, *, ended: bool = False) -> None: ...
    def _await_decision(self) -> Program[None]: ...

    # steps.Steps
    def authority_check(self, *, from_step: int, approval: PendingApproval | None = None) -> AuthorityCheck | None: ...
    def after_observation(self, refusal: Refusal | None, at: datetime, ask: Verdict | None = None) -> None: ...
    def enter_step(self, *, at: datetime, reason: str) -> None: ...
    def _step_ended_by(self, code: str) -> tuple[Refs, str] | None: ...
    def _authority(self, *, from_step: int, roster: bool = False) -> Program[Verdict | None]: ...
    def remember_check(self, check: AuthorityCheck | None, verdict: Verdict | None) -> None: ...
    def _execute_step(self) -> Program[None]: ...
    def _in_flight_handoff(self) -> Program[bool]: ...

    # delegation.Delegating
    def cannot_give(self, tool: str) -> str | None: ...
    def depth(self) -> int: ...
    def max_depth(self) -> int | None: ...
    def grant_refusal(self, tool: str) -> str | None: ...
    def covered_by_parent(self, from_step: int = 0) -> bool: ...
    def spend_cover(self, step: PlanStep) -> None: ...
    def cover_key(self, step: PlanStep) -> str | None: ...
    def lent_approval(self) -> bool: ...
    def lend_approval(self, at: datetime) -> None: ...
    def delegation_problem(self, args: dict[str, Any]) -> str | None: ...
    def grant_refused(self, at: datetime) -> None: ...
    def _delegate_step(self) -> Program[None]: ...
    def child_run(self, step: PlanStep) -> RunChild: ...
    def child_answer(self, step: PlanStep, result: RunOutcome | ToolFailure) -> ToolOutcome | ToolFailure: ...
    def child_undos(self, child: str, result: RunOutcome | ToolFailure) -> Program[None]: ...
    def child_id(self, step_id: str) -> str: ...
    def _adopt_child(self, child: str, step: PlanStep) -> Program[RunOutcome | ToolFailure]: ...
    def _await_children(self, command: RunChild | RunGroup) -> Program[tuple[Any, tuple[HandoffRequest, Verdict] | None]]: ...
    def cancelled_outcome(self, step: PlanStep) -> Literal["unknown", "failed"]: ...
    def handed_off_with_children(
        self, request: HandoffRequest, verdict: Verdict, steps: list[PlanStep], at: datetime, *, ended: bool = False,
        also: str | None = None,
    ) -> None: ...
    def handoff_later(self, request: HandoffRequest, at: datetime) -> None: ...

    # groups.Groups
    def in_group(self) -> bool: ...
    def _execute_group(self) -> Program[None]: ...
    def group_settled_on_cancel(self, landed: list[Landed]) -> None: ...

    # steps.Steps (the step a handoff or a cancel meets)
    def handoff_point(self) -> tuple[str, Refs | None]: ...
    def step_handed_off(self) -> None: ...
    def tool_succeeded(self, outcome: ToolOutcome, at: datetime) -> None: ...
    def tool_failed(self, failure: ToolFailure, at: datetime) -> float | None: ...
    def checked_verdict(self, check: AuthorityCheck, *, take: bool = False) -> Verdict | None: ...

    # handoff.Handoff
    def handoff_unhonoured(self, request: HandoffRequest, at: datetime) -> None: ...
    def person_check(
        self, action: Literal["cancel", "compensate"], by: str, *, decision_id: str = "", signature: str | None = None, catch: bool = False
    ) -> Call: ...
    def _take_handoff(self, detail: str | None = None, refs: Refs | None = None) -> Program[bool]: ...
    def _judge_handoff(self) -> Program[tuple[HandoffRequest, Verdict]]: ...
    def take_handoff(self, request: HandoffRequest | None, at: datetime, detail: str | None = None,
                     verdict: Refusal | None = None, verified: bool = False, *, refs: Refs | None = None) -> bool: ...
    def refuse_handoff(self, request: HandoffRequest, refusal: Refusal, at: datetime) -> None: ...

    # compensating.Compensating
    def _undo_check(self) -> AuthorityCheck | None: ...
    def on_cancel(self) -> str: ...
    def compensates(self) -> bool: ...
    def _note_compensation(self, step: PlanStep, outcome: ToolOutcome) -> str: ...
    def compensation_ready(self, at: datetime) -> bool: ...
    def compensation_refused(self, refusal: Refusal, at: datetime) -> None: ...
    def begin_compensation(self, source: RecoverySource, at: datetime) -> None: ...

    # carry.Carry
    def _maybe_continue_as_new(self) -> Program[None]: ...


class RunModel(Phases):
    """One run's state and the records of its changes. Every state change goes through
    ``data.lifecycle.move`` (:meth:`move`)."""

    def __init__(
        self,
        data: RunData,
        request: RunRequest,
        *,
        workflow_id: str,
        on_record: Callable[[TransitionRecord], None] = lambda record: None,
        new_request_id: Callable[[], str] = lambda: "",
        started_at: datetime | None = None,
        first_run_id: str = "",
        queue_capped: Callable[[], bool] = lambda: True,
    ) -> None:
        # The run chain's first run (a continued run carries it).
        data.first_run_id = data.first_run_id or first_run_id
        self.data = data
        self.request = request
        self.workflow_id = workflow_id
        self.started_at = started_at  # when the run began (workflow time)
        self.at = started_at  # workflow time: what the last Engine.next or on was given
        self._on_record = on_record  # metrics, the audit sink; called for every record written
        self.new_request_id = new_request_id  # one id per approval request (derived: a reset asks the same)
        # Whether a sender's decisions past QUEUED_PER_SENDER are refused unjudged (asked only
        # when one is: the workflow's live patch, so a run that queued more before keeps doing so).
        self.queue_capped = queue_capped
        # Records someone is to be told about, with webhooks named besides the subscribers (an
        # escalation stage's notify); the workflow takes them before it waits.
        self.outbox: list[tuple[TransitionRecord, list[str]]] = []
        # Decision refusals counted but not recorded (a flood), until their sender is answered.
        self.unrecorded_refusals: dict[str, Refusal] = {}
        # While a decision is settled: the Cedar policies that decided it (its records name them).
        self.deciding_policies: list[str] | None = None
        # Where the current plan writes (step indexes), worked out once per plan and catalog:
        # every step asks whether writes remain (authority_check).
        self._writes: tuple[tuple[Any, ...], list[int]] = ((), [])
        # This execution's own, never carried: decisions that passed the cheap checks on arrival,
        # in arrival order (the policy check and the decision follow in the run's program); a
        # handoff accepted but not yet taken; the decide Updates waiting for a verdict, and how
        # many this execution took; writes scheduled again for a capability; loops of the
        # program, and the history bytes at which a deferred continue-as-new is due.
        self.inbox: list[tuple[DecisionKind, Decision]] = []
        # Decisions for a request the run has not asked yet (approvals.Decisions.hold_early).
        self.early: list[tuple[DecisionKind, Decision]] = []
        self.pending_handoff: HandoffRequest | None = None
        # A cancel request being judged (the policy activity), and the one the run took (with
        # whether its signature verified): the workflow stops its program for it.
        self.pending_cancel: CancelRequest | None = None
        self.cancel_taken: tuple[CancelRequest, bool] | None = None
        self.cancelling = False  # a cancel (the run's or Temporal's) is being carried out
        # Tool calls a forced hand-off named as in flight in the execution its reset replaced:
        # never scheduled again, whether that hand-off is honoured or refused.
        self.ended_in_flight: list[str] = []
        self.verdicts: dict[str, DecideResult | None] = {}
        self.updates = 0
        self.bounces = 0
        self.loops = 0
        self.continue_at: int | None = None
        # The re-check the run last had allowed in this execution, with nothing awaited since
        # (Drive.next forgets it at the next wait): the write it covers mints on it, no second
        # check (Steps.checked_verdict).
        self.checked: tuple[AuthorityCheck, Verdict] | None = None
        # A decision the run took on its roster: the plan's first call carries it, for its tool
        # worker to judge again before the tool (Steps._execute_step).
        self.judge_at_tool: DecisionCheck | None = None
        # The first plan's re-check, judged by the planner call that brought it (attested with
        # the run's setup): taken only for a check of its digest (Steps._authority).
        self.prejudged: PlanJudged | None = None

    def carried_over(self, generation: int) -> None:
        """The carried state's seal held: this run is that generation of the run chain."""
        self.data.generation = generation

    def apply(self, step: Callable[[datetime], T], *, policies: Sequence[str] | None = None) -> T:
        """Apply one engine step (``step``, a decision of the engine's) at the current workflow
        time; a move the table denies, or a state the engine cannot act in, fails the run.
        ``policies``: the Cedar policies that decided the policy check it follows, named on the
        records it writes (``refs.policies``)."""
        before = self.deciding_policies
        if policies:
            self.deciding_policies = list(policies)
        try:
            return step(self.workflow_time)
        except (IllegalTransition, IllegalState) as e:
            raise RunFailed(str(e), type(e).__name__) from None
        finally:
            self.deciding_policies = before

    def ids(self, basis: str) -> Callable[[int], str]:
        """Tool call ids (and so idempotency keys) from the run chain and the decision that made
        the plan: a reset or a replay makes the same ones, another run never does."""
        return tool_call_ids(self.id_chain(), basis)

    def id_chain(self) -> str:
        """What a run's ids derive from: its chain's first run; a child's (started by this build,
        ``child_ids``), its workflow id, which is its parent's and the parent's step: a start of it
        again (its parent reset or repaired) makes the same ids, and the effect ledger knows them."""
        grant = self.request.grant
        if self.child_ids and grant is not None and grant.child == self.workflow_id:
            return f"child:{grant.child}"
        return self.data.first_run_id

    def on_record(self, record: TransitionRecord | None) -> None:
        if record is not None:  # None: a refusal in a flood, counted but not recorded
            self._on_record(record)
            if notify_event(record) is not None:
                self.outbox.append((record, []))

    @property
    def workflow_time(self) -> datetime:
        """``at``, which ``Engine.next`` and ``on`` set before the run's program goes on: every
        decision of the program has it."""
        return require(self.at, "no workflow time: the run's program runs from Engine.next and on")

    @property
    def state(self) -> RunState:
        return self.data.lifecycle.state

    @property
    def tenant(self) -> TenantPolicy | None:
        return self.data.policy.policy if self.data.policy else None

    @property
    def limits(self) -> Limits:
        """The run's limits, tightened by the tenant's budgets (and a child's by its grant)."""
        limits = policy.effective_limits(self.request.limits, self.tenant)
        if self.request.grant is not None and self.request.grant.max_steps < limits.max_steps:
            limits = limits.model_copy(update={"max_steps": self.request.grant.max_steps})
        return limits

    @property
    def catalog(self) -> ToolCatalog:
        if self._catalog[0] is not self.data.catalog:  # the snapshot and the delegate step, once
            self._catalog = (self.data.catalog, run_catalog(self.data.catalog))
        return self._catalog[1]

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

    def reads_found(self) -> list[ReadFound]:
        """What the run's latest ok read steps found (run_state.found_steps): what the plan an
        approver decides depends on."""
        return found_steps(self.data.executed, self.catalog if self.data.catalog is not None else None)

    def step_refs(self, step: PlanStep) -> Refs:
        undo = next((c for c in self.data.compensations if c.tool_call_id == step.tool_call_id), None)
        if undo is not None:
            # Bound to the plan (and approval) that covered it; its key derives from the original's.
            return Refs(plan_hash=undo.plan_hash, tool_call_id=step.tool_call_id, idempotency_key=undo.idempotency_key)
        return Refs(
            plan_hash=self.data.plan.plan_hash if self.data.plan else None,
            tool_call_id=step.tool_call_id,
            # The run's workflow id, not its run id: stable across continue-as-new. A write under
            # a parent's lent approval: the named write's own (``cover_key``).
            idempotency_key=self.cover_key(step) or f"{self.workflow_id}:{step.tool_call_id}",
        )

    def totals(self) -> dict[str, float]:
        """What the tree this run is part of has done (and had in flight) that the run knows of,
        per "tool.field": its own writes and its children's, charged back as they end, and a
        child's grant's sums (the tree's when its parent started it). Amount rules judge these."""
        grant = self.request.grant
        if grant is None or not grant.spent:
            return self.data.spent
        totals = dict(grant.spent)
        for key, value in self.data.spent.items():
            totals[key] = totals.get(key, 0) + value
        return totals

    def review(self) -> PlanReview:
        plan = require(self.data.plan, "no validated plan to review")
        tenant, grant = self.tenant, self.request.grant
        if grant is not None and grant.sums_unknown:
            # The tree's sums are not known here (a sibling may write amounts nobody named): no
            # amount rule auto-approves, each write asks.
            base = tenant or policy.DEFAULT_TENANT_POLICY
            tenant = base.model_copy(update={"auto_approve": base.auto_approve.model_copy(update={"limits": []})})
        return policy.review_plan(plan, self.catalog, tenant, self.totals())

    def actor(self, name: str, verified: bool = False, via: str | None = None) -> str:
        """How a person shows on the timeline: verified identities say how (their own
        signature, or a trusted signer's attestation: ``user:bob via inbox``)."""
        if verified and via:
            return f"user:{name} via {via}"
        return f"user:{name} (signed)" if verified else f"user:{name}"

    def move(self, to: RunState, *, at: datetime, actor: str, reason: str, refs: Refs | None = None) -> None:
        """Raises IllegalTransition for a move the table denies (the workflow makes that a
        non-retryable failure)."""
        record = self.data.lifecycle.move(to, at=at, actor=actor, reason=reason, refs=self._decided(refs))
        self.data.updated_at = record.at
        self.on_record(record)

    def refuse(self, *, at: datetime, actor: str, reason: str, rule: str, refs: Refs | None = None) -> None:
        self.on_record(self.data.lifecycle.refuse(at=at, actor=actor, reason=reason, refs=self._decided(refs), rule=rule))

    @overload
    def _decided(self, refs: Refs) -> Refs: ...
    @overload
    def _decided(self, refs: Refs | None) -> Refs | None: ...
    def _decided(self, refs: Refs | None) -> Refs | None:
        """A record written while a policy check's outcome is applied names its Cedar policies."""
        if not self.deciding_policies or (refs is not None and refs.policies is not None):
            return refs
        return (refs or Refs()).model_copy(update={"policies": list(self.deciding_policies)})

    # Why the run's grant was refused at its start (the workflow checks its seal), or None.
    grant_problem: str | None = None
    # A child run's ids derive from its parent's chain and step (set by the workflow for runs this
    # build started; a recorded history of an earlier build replays its own).
    child_ids: bool = False
    # This build started the run (False only for a run of the previous build, which replays as it
    # ran; the workflow sets it). Its rules: a decision's new plan version takes its tool call ids
    # from the plans, never from the decision's id (a reset run decided again under another id
    # would write again): a partial approval's steps keep theirs, a revision's derive from the
    # plan it revises and its steps; a write attempt's activity id says its attestation leaves
    # the request's clock readings out (keys.clockless).
    this_build: bool = True
    # Plan indexes of the steps the running RunGroup carries, in its order (for a cancel, and
    # the tree's children under way).
    group_running: list[int] | None = None
    # The catalog the run plans with, made from the snapshot it was made from.
    _catalog: tuple[ToolCatalog | None, ToolCatalog] = (None, run_catalog(None))

    # The step a cancel waited for, as tool_settled_on_cancel recorded it: (step, outcome, code).
    _settled: tuple[PlanStep, EffectOutcome, str | None] | None = None

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
            undo = require(self.current_undo(), "no compensation under way")
            require(undo.tool_call_id == step.tool_call_id, "no compensation under way")
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

    def _trim_executed(self) -> None:
        """Older steps keep only id, tool, status and digest: the carried state stays bounded."""
        room = EXECUTED_OBSERVATION_CHARS
        for i, done in enumerate(reversed(self.data.executed)):
            if i >= EXECUTED_WINDOW and not done.args and not done.observation:
                break  # trimmed already, and so is every step before it (each call trims them)
            room -= len(done.observation)
            if i >= EXECUTED_WINDOW or room < 0:
                done.args, done.observation = {}, ""

    def current_undo(self) -> CompensationCall | None:
        """The next compensation to run: the newest ok write not yet compensated."""
        return next((c for c in reversed(self.data.compensations) if c.status == "pending"), None)

    def _undo_left(self, *, start: bool = False) -> str:
        pending = [c for c in reversed(self.data.compensations) if c.status == "pending"]
        done = [c for c in self.data.compensations if c.status == "ok"]
        names = ", ".join(f"{c.of} ({c.of_tool}) by {c.tool or 'nothing: no recovery path'}" for c in pending[:20])
        if start:
            return f"undoing {len(pending)} ok write(s), newest first: {names}"
        # An undo that failed or whose outcome is unknown is not compensated either: say so.
        left = [c for c in reversed(self.data.compensations) if c.status != "ok"]
        names = ", ".join(
            f"{c.of} ({c.of_tool}) by {c.tool or 'nothing: no recovery path'}"
            + ("" if c.status == "pending" else f" ({'may have applied' if c.status == 'unknown' else c.status})")
            for c in left[:20]
        )
        return f"compensated {len(done)}; not compensated: {names or 'none'}"
