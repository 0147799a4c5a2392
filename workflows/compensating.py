"""The compensating phase: the run's on_failure / on_cancel, building the undo of each ok
write, the re-check of the next undo, running them newest first, and a compensation run
(``tether compensate``) taking the original's record.
"""

from __future__ import annotations

from datetime import datetime

from workflows import policy, recovery
from workflows.budgets import bounded_fields
from workflows.contract import CompensationCall, Plan, PlanStep, ToolEffect
from workflows.run_model import RunModel, S, require
from workflows.states import Refs
from workflows.wire import AuthorityCheck, RecoverySource, Refusal, ToolOutcome


class Compensating(RunModel):
    """Putting the run's ok writes back, newest first."""

    def _undo_check(self) -> AuthorityCheck | None:
        """COMPENSATING: the re-check of the next undo (docs/operations.md, "Recovery"). Its
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
        call.of_args = bounded_fields(step.args, info.summary_fields if info else [])
        data.compensations.append(call)
        if call.tool is not None:
            return f"; undo: {call.tool}"
        return f"; no recovery path: {call.error}"

    def compensation_ready(self, at: datetime) -> bool:
        """COMPENSATING: True when the next compensation may run; else the run ends here
        (COMPENSATED when none is left, HANDED_OFF when the next one cannot be run)."""
        require(self.state == S.COMPENSATING, "not COMPENSATING")
        undo = self.current_undo()
        unknown = [c for c in self.data.compensations if c.status == "unknown"]
        if undo is None and unknown:
            # Unknown is not failed: an unsafe undo that may have applied is never re-run blindly.
            self.move(
                S.HANDED_OFF,
                at=at,
                actor="runtime",
                reason="may have applied (outcome unknown, not re-run): "
                + ", ".join(f"{c.of} ({c.of_tool}) undo {c.tool}" for c in unknown[-20:])
                + "; check the target, then re-run only on an approver's instruction: "
                "tether compensate RUN --rerun-unknown STEP; " + self._undo_left(),
                refs=Refs(plan_hash=unknown[-1].plan_hash or None, tool_call_id=unknown[-1].of, error_code="may_have_applied"),
            )
            return False
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

    def _to_run(self, undo: CompensationCall) -> CompensationCall:
        """A compensation run's copy of an undo not done: pending, unless it may have applied
        (outcome unknown) and its tool is unsafe: then it runs again only on the requester's
        recorded instruction (``rerun_unknown``), else it stays ``unknown``, listed for a person.
        An idempotent undo runs again under its key; a reconcilable one is looked up first."""
        if undo.status == "unknown" and self._unsafe(undo):
            if undo.of in self.request.rerun_unknown or undo.tool_call_id in self.request.rerun_unknown:
                return undo.model_copy(update={"status": "pending", "rerun": True})
            return undo
        return undo.model_copy(update={"status": "pending"})

    def _unsafe(self, undo: CompensationCall) -> bool:
        info = self.catalog.get(undo.tool) if undo.tool else None
        return info is None or info.effect == ToolEffect.UNSAFE

    def _undo_plan(self, source: RecoverySource, by: str, actor: str, at: datetime) -> None:
        """A COMPLETED run kept its writes by design: undoing them is a request of its own. Its
        undos, newest first, become this run's plan, approved by the policy's roles like any
        plan (its hash binds the approval to exactly these undos); once approved, they run."""
        undos = [c for c in reversed(self.data.compensations) if c.tool is not None and c.status == "pending"]
        steps = [PlanStep(tool_call_id=c.tool_call_id, tool=c.tool, args=c.args) for c in undos if c.tool]
        self.data.plan = Plan(steps=steps, plan_hash=Plan.hash_steps(steps))
        self.move(
            S.VALIDATED,
            at=at,
            actor=actor,
            reason=f"undo of completed run {source.run_id} requested by {by}: it kept its writes, so the undos "
            f"are a plan of their own to approve: {self._undo_left(start=True)}",
            refs=Refs(plan_hash=self.data.plan.plan_hash),
        )

    def compensation_refused(self, refusal: Refusal, at: datetime) -> None:
        """A compensation run ends refused (FAILED), saying why, with the rule."""
        require(self.state == S.RECEIVED and self.request.compensate_run is not None, "not a compensation run")
        self.data.last_error = f"{refusal.rule}: {refusal.message}"
        self.move(S.FAILED, at=at, actor=self.actor(self.request.requested_by, self.data.requester_verified),
                  reason=f"compensation refused [{refusal.rule}]: {refusal.message}", refs=Refs(error_code=refusal.rule))

    def begin_compensation(self, source: RecoverySource, at: datetime) -> None:
        """A compensation run (``tether compensate``): the original run's record is in. Run the
        compensations its approvals covered, if the requester may; else fail, saying why."""
        require(self.state == S.RECEIVED and self.request.compensate_run is not None, "not a compensation run")
        by = self.request.requested_by
        actor = self.actor(by, self.data.requester_verified)
        refusal = source.refusal  # whether the requester may: judged before (compensation_refused)
        pending = [c for c in source.compensations if c.status != "ok"]
        compensable = policy.COMPENSABLE_STATES | {S.COMPLETED}  # COMPLETED: its undos approved first
        if refusal is None and source.state not in compensable:
            state = source.state.value if source.state else "unknown"
            refusal = Refusal(rule="not_compensable", message=f"run {source.run_id} ended {state}: only runs "
                              f"ended {', '.join(sorted(s.value for s in compensable))} are compensated")
        if refusal is None and not pending:
            refusal = Refusal(rule="nothing_to_compensate", message=f"run {source.run_id} has no ok write left to compensate")
        if refusal is None and any(not c.plan_hash for c in pending):
            refusal = Refusal(rule="not_approved", message="a compensation of that run is covered by no plan hash")
        if refusal is not None:
            self.compensation_refused(refusal, at)
            return
        self.data.compensations = [self._to_run(c) for c in pending]
        if source.state == S.COMPLETED:
            self._undo_plan(source, by, actor, at)
            return
        hashes = ", ".join(sorted({c.plan_hash[:12] for c in pending}))
        rerun = [c for c in self.data.compensations if c.rerun]
        instructed = (
            f"; {by} instructs to run again what may have applied: " + ", ".join(f"{c.of} ({c.tool})" for c in rerun[:20])
            if rerun else ""
        )
        self.move(
            S.COMPENSATING,
            at=at,
            actor=actor,
            reason=f"compensation of run {source.run_id} requested by {by}, covered by the approval of plan "
            f"{hashes}: {self._undo_left(start=True)}{instructed}",
            refs=Refs(plan_hash=pending[-1].plan_hash),
        )
