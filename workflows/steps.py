"""The steps phase: the authority re-check before writes, entering a step, the tool call to
schedule, its outcome (success, failure and the retry rule, a capability that bounced) and a
cancel or handoff that meets a step under way.
"""

from __future__ import annotations

from datetime import datetime
from workflows import retries
from workflows.budgets import REASON_CHARS, clip
from workflows.commands import Call, Checkpoint, Mint, RunTool, Show, Sleep, Wait
from workflows.contract import PlanStep, ToolEffect
from workflows.plan_check import check_context, check_digest, unapproved, write_steps
from workflows.run_model import Program, RunFailed, RunModel, S, ToolFailure, require
from workflows.run_state import PendingApproval
from workflows.states import EffectOutcome, Refs
from workflows.wire import (
    CAPABILITY_EXPIRED,
    CAPABILITY_INVALID,
    CAPABILITY_KEY_MISSING,
    DECISION_NOT_HELD,
    JUDGE_UNAVAILABLE,
    LEDGER_UNAVAILABLE,
    RECORDS_NOT_WRITTEN,
    UNKNOWN_TOOL,
    AuthorityCheck,
    DecisionCheck,
    Refusal,
    ToolCall,
    ToolOutcome,
    Verdict,
)

# The first call after a roster's decision did not start: the decision did not hold, its worker
# cannot judge, or (a worker of an older build) does not know the capability's judge.
JUDGED_NOT_STARTED = (DECISION_NOT_HELD, JUDGE_UNAVAILABLE, CAPABILITY_INVALID)
# A write that reached workers lacking its capability's key this many times in a row fails.
MAX_BOUNCES = 50
# A write no worker serves the tool of waits for one, this long at most between tries.
TOOL_WAIT_SECONDS = 60
# The failure a forced hand-off's in-flight attempt counts as when the hand-off is refused.


class Steps(RunModel):
    """An approved plan's steps: re-check, schedule, outcome, retry."""

    def _write_steps(self) -> list[int]:
        """The indexes of the plan's steps that write (or call a tool the catalog lacks)."""
        plan, catalog = self.data.plan, self.data.catalog
        assert plan is not None
        key = (plan.plan_hash, plan.version, len(plan.steps), len(catalog.tools) if catalog else 0)
        if self._writes[0] != key:
            self._writes = (key, write_steps(plan, self.catalog))
        return self._writes[1]

    def authority_check(self, *, from_step: int, approval: PendingApproval | None = None) -> AuthorityCheck | None:
        """What to re-check against the current policy file before the plan's remaining writes
        run, approved or auto-approved (None: nothing left writes). ``approval``: judge under
        this approval instead of the one in force (one a decision would put in force)."""
        data = self.data
        if self.state == S.COMPENSATING:
            return self._undo_check()
        if data.plan is None:
            return None
        # The remaining steps, their catalog entries and what the run has done: the current
        # file judges them (auto-approval, or the roles and count an approval needs now).
        context = check_context(
            data.plan, self._write_steps(), self.catalog, from_step=from_step, tenant=self.request.tenant,
            spent=self.totals(), workflow_id=self.workflow_id, first_run_id=data.first_run_id,
            requested_by=self.request.requested_by,
        )
        if context is None:
            return None
        approval = approval or data.approval
        grant = self.request.grant
        if approval is None and grant is not None and self.covered_by_parent(from_step):
            # A child run: its parent's approval, judged again for these steps under the current
            # file (the signatures name the parent's run).
            return AuthorityCheck(
                approvals=[a.approver for a in grant.approved], roles=grant.approved_roles,
                approvals_required=grant.approvals_required, approved=grant.approved, request_id=grant.approved_request,
                approved_in=grant.parent, approved_in_run=grant.parent_first_run, **context,
            )
        if approval is None:
            # Ran without approval: the current policy must still say so, for what is left.
            return unapproved(context)
        if grant is not None and approval is self.data.approval and self.lent_approval():
            context.update(approved_in=grant.parent, approved_in_run=grant.parent_first_run)
        return AuthorityCheck(
            approvals=[a.approver for a in approval.approvals],
            roles=approval.roles,
            approvals_required=approval.approvals_required,
            approved=approval.approvals,
            escalated_roles=[r for stage in approval.escalation[: approval.stage] for r in stage.roles],
            request_id=approval.request_id,
            **context,
        )

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

    def enter_step(self, *, at: datetime, reason: str) -> None:
        """Enter EXECUTING_TOOL for the plan's next step; in a compensation run (the undo plan of
        a COMPLETED run, approved) COMPENSATING: its undos run as every undo does."""
        if self.request.compensate_run is not None:
            self.move(S.COMPENSATING, at=at, actor="runtime", reason=f"{reason}; {self._undo_left(start=True)}",
                      refs=Refs(plan_hash=self.data.plan.plan_hash if self.data.plan else None))
            return
        step = require(self.current_step(), "no plan step to execute")
        self.data.step_retries = 0
        self.data.step_outcome = None
        self.move(S.EXECUTING_TOOL, at=at, actor="runtime", reason=reason, refs=self.step_refs(step))

    def next_tool_call(self, at: datetime) -> ToolCall | None:
        """The call to schedule now, or None when the step may not run (the run has moved)."""
        data = self.data
        why = "no plan step to execute, or not in EXECUTING_TOOL"
        require(self.state in (S.EXECUTING_TOOL, S.COMPENSATING), why)
        step = require(self.current_step(), why)
        max_calls = self.tenant.budgets.max_tool_calls if self.tenant else None
        # Compensations are not held to the budget: an undo must not be stopped by the calls
        # that made it necessary (they are bounded by the ok writes and their retry rules).
        if max_calls is not None and data.tool_calls >= max_calls and self.state != S.COMPENSATING:
            self._not_started(
                step, "tool_call_budget", f"tool call budget exhausted: {data.tool_calls} of max_tool_calls={max_calls} used", at
            )
            return None
        data.tool_calls += 1  # every call the workflow schedules, retries included
        if self.state == S.EXECUTING_TOOL:
            self.spend_cover(step)
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
        require(self.state in (S.EXECUTING_TOOL, S.COMPENSATING), "no write attempt to refuse")
        step = require(self.current_step(), "no write attempt to refuse")
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
        it waited past its expiry) or claim its undo (the undo ledger unavailable): the tool was
        not called; the run schedules it again with a
        fresh capability. ``last_error`` (the Web UI details) names why (the key id)."""
        require(self.state in (S.EXECUTING_TOOL, S.COMPENSATING), "no write attempt")
        step = require(self.current_step(), "no write attempt")
        self.data.tool_calls -= 1  # never reached the tool
        self.data.last_error = clip(
            f"{failure.code}: tool call {step.tool_call_id} ({step.tool}) not started, scheduled again: "
            f"{failure.message}",
            300,
        )

    def tool_succeeded(self, outcome: ToolOutcome, at: datetime) -> None:
        step = require(self.current_step(), "no plan step to execute")
        refs = self.step_refs(step).model_copy(update={"outcome": "ok"})
        if self.state == S.COMPENSATING:
            undo = require(self.current_undo(), "no compensation under way")
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
        noted = self._note_compensation(step, outcome)
        self.data.last_error = None
        self.data.next_step += 1
        self.move(
            S.OBSERVING_RESULT,
            at=at,
            actor="runtime",
            reason=f"tool call {step.tool_call_id} ({step.tool}) succeeded" + noted,
            refs=refs,
        )

    def tool_failed(self, failure: ToolFailure, at: datetime) -> float | None:
        """Apply the retry rule. Returns the backoff in seconds when the call is to be retried.

        Records and ``last_error`` name the error code, tool, call and outcome, never the
        error's text (it may quote arguments); the workflow logs the text.
        """
        data = self.data
        step = require(self.current_step(), "no plan step to execute")
        info = self.tool_info(step)
        effect = info.effect if info else ToolEffect.UNSAFE
        outcome = retries.failure_outcome(effect, permanent=failure.permanent, started=failure.started)
        data.step_outcome = outcome
        next_state, why = retries.after_tool_failure(
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
        settle = retries.settle_seconds(retries.tool_timeouts(info.timeout_seconds), failure.code) if info and outcome == "unknown" else 0.0
        delay = retries.retry_delay_seconds(data.step_retries, failure.suggested_delay, settle)
        data.step_retries += 1
        data.retries += 1
        # A compensation waits out its backoff in COMPENSATING: the retry is on the record.
        self.move(S.COMPENSATING if compensating else S.RETRY_WAIT, at=at, actor="runtime", reason=f"{what}: {why} in {delay:g}s", refs=refs)
        return delay

    def retry(self, at: datetime) -> None:
        step = require(self.current_step(), "no plan step to execute")
        if self.state == S.COMPENSATING:
            return  # recorded when the retry was decided; the next attempt follows
        self.move(S.EXECUTING_TOOL, at=at, actor="runtime", reason=f"retry {self.data.step_retries}", refs=self.step_refs(step))

    def handoff_point(self) -> tuple[str, Refs | None]:
        """What a handoff taken before the current step's (next) attempt says: the detail for
        its reason, and refs naming the outcome of an earlier attempt if one failed."""
        step = require(self.current_step(), "no plan step to execute")
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
        step = require(self.current_step(), "no plan step to execute")
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
            settled = retries.failure_outcome(effect, permanent=failure.permanent, started=failure.started)
        if settled == "failed" and self.data.step_outcome == "unknown":
            settled = "unknown"  # this attempt did nothing, an earlier one may have
        code = failure.code if failure else "cancelled"
        self._end_step(step, settled, code)
        self._settled = (step, settled, code)

    def _step_ended_by(self, code: str) -> tuple[Refs, str] | None:
        """Refs and a description for a record that ends the run mid-step (a cancel), after
        recording the step; None when no step was under way."""
        if self._settled is not None:
            settled_step, settled, settled_code = self._settled
            return self._end_refs(settled_step, settled, settled_code), self._describe(settled_step, settled)
        step = self.current_step()
        outcome = self.data.step_outcome
        if step is None or outcome is None or self.state not in (S.EXECUTING_TOOL, S.RETRY_WAIT, S.COMPENSATING):
            return None
        self._end_step(step, outcome, code)
        return self._end_refs(step, outcome, code), self._describe(step, outcome)

    # ------------------------------------------------------------------ the program

    def _authority(self, *, from_step: int, roster: bool = False) -> Program[Verdict | None]:
        """Re-check, through the policy activity, the approvals of the plan's remaining writes
        under the current file; none when this execution has just had exactly this check allowed
        (a decision's activity judged it with the decision). An allowed verdict also covers the
        write at ``from_step`` if it comes next: one check a write. ``roster``: the verdict brings
        the run's roster again (a plan about to ask for approval)."""
        check = self.authority_check(from_step=from_step)
        if check is None:
            return None
        if roster:
            check = check.model_copy(update={"roster": True})
        verdict = self.checked_verdict(check) or self._prejudged(check)
        if verdict is None:
            verdict = yield Call("policy_check_authority", check, Verdict, "policy re-check before writes")
            self.remember_check(check, verdict)
        return verdict

    def _prejudged(self, check: AuthorityCheck) -> Verdict | None:
        """The verdict the first planner call brought on exactly ``check`` (its setup's answer,
        attested), taken once: it stands as the activity's would (it covers the write it
        precedes). Any other check, or a later one, goes to the policy activity."""
        judged, self.prejudged = self.prejudged, None
        if judged is None or judged.check != check_digest(check):
            return None
        self.remember_check(check, judged.verdict)
        return judged.verdict

    def remember_check(self, check: AuthorityCheck | None, verdict: Verdict | None) -> None:
        """A re-check's verdict stands for the same check until the run next waits: an allowed
        one covers the write it precedes, a refusal is not asked for again."""
        self.checked = (check, verdict) if check is not None and verdict is not None else None

    def checked_verdict(self, check: AuthorityCheck, *, take: bool = False) -> Verdict | None:
        """The verdict this execution already has on exactly ``check`` (the approvals' times
        aside: a decision's activity judged them before they were accepted), with nothing awaited
        since; ``take``: it is used up (a write mints on it)."""
        if self.checked is None or not _same_check(self.checked[0], check):
            return None
        verdict = self.checked[1]
        if take:
            self.checked = None
        return verdict

    def _execute_step(self) -> Program[None]:
        step = self.current_step()
        info = self.tool_info(step) if step else None
        if step is None or info is None:
            raise RunFailed("no executable plan step", "IllegalState")
        if (yield from self._in_flight_handoff()):
            return
        detail, refs = self.handoff_point()
        if (yield from self._take_handoff(detail=detail, refs=refs)):
            self.step_handed_off()
            return
        call = self.apply(self.next_tool_call)
        if call is None:
            return
        data_state = self.data.lifecycle.state
        timeouts = retries.tool_timeouts(info.timeout_seconds)
        writes = info.effect != ToolEffect.READ_ONLY
        activity_id = judge = None
        if writes:
            # Every write attempt carries a capability for exactly this call: the keyed re-check
            # under the current file allows it, then the run's own code mints it with the fleet
            # key. Nothing else can make a tool write.
            sep = ":" if self.this_build else "."  # keys.clockless: this build's ids say so
            activity_id = f"{call.tool_call_id}{sep}{self.data.tool_calls}{sep}{self.bounces}"
            check = self.authority_check(from_step=self.data.next_step)
            verdict = None
            if check is not None:
                # The re-check that let the run enter this step covers its first attempt; a retry,
                # an undo, or a step entered after a wait is checked here.
                verdict = self.checked_verdict(check, take=True)
                # A decision taken on the roster: its re-check is the tool worker's, before the tool.
                judge = self.judge_at_tool if verdict is not None else None
                if verdict is None:
                    verdict = yield Call(
                        "policy_check_authority", check.model_copy(update={"call": call}), Verdict,
                        "policy re-check before this write",
                    )
            if check is None or verdict is None or verdict.refusal is not None:  # no check: no verdict
                refusal = (verdict.refusal if verdict else None) or Refusal(
                    rule="capability_invalid", message="no re-check for this write"
                )
                self.apply(lambda now: self.write_refused(refusal, now), policies=verdict.policies if verdict else None)
                return
            call = yield Mint(call, activity_id, check, timeouts.start_to_close, judge)
        elif self.judge_at_tool is not None:
            judge = self.judge_at_tool
            call = call.model_copy(update={"judge": judge})
        # A read is no place the run rests: the sink gets its records later. A write takes them
        # along: its tool worker appends them before it calls the tool.
        yield Show()
        answer = yield RunTool(
            call,
            activity_id,
            timeouts.start_to_close,
            timeouts.heartbeat,
            records=writes,
            # The Web UI's line for the call: a write names its effect class, a read only itself.
            summary=f"{step.tool} · " + ("" if not writes else f"{info.effect.value} · ")
            + (f"compensation {step.tool_call_id}" if data_state == S.COMPENSATING else f"step {self.data.next_step + 1}"),
        )
        # The decision went with this attempt, once: a retry is a new attempt (a write's has a
        # re-check of its own; after a read, the re-check before the plan's next write judges the
        # approvals in force again).
        self.judge_at_tool = None
        if isinstance(answer, ToolFailure):
            failure = answer
            if judge is not None and failure.code in JUDGED_NOT_STARTED:
                yield from self._judge_again(judge, failure)
                return
            if activity_id and failure.code in RECORDS_NOT_WRITTEN:
                # The records before the write did not reach the sink, so the tool was not called:
                # the run writes them itself, on the sink's backoff, and schedules the write again.
                self.capability_bounced(failure)
                yield Checkpoint()
                return
            if activity_id and failure.code == UNKNOWN_TOOL:
                # No worker of the queue serves the tool (one started with other tools): it was
                # not called, and the approval stands; the run says which tool it waits for and
                # schedules the write again, backing off, until a worker that serves it takes it.
                self.bounces += 1
                self.capability_bounced(failure)
                yield Checkpoint()
                yield Sleep(min(TOOL_WAIT_SECONDS, 2 ** min(self.bounces, 6)), "waiting for a worker that serves the tool")
                return
            bounced = (CAPABILITY_KEY_MISSING, CAPABILITY_EXPIRED, LEDGER_UNAVAILABLE)
            if activity_id and failure.code in bounced and self.bounces < MAX_BOUNCES:
                # The tool was not called: schedule the attempt again, fresh capability, soon.
                self.bounces += 1
                self.capability_bounced(failure)
                yield Checkpoint()
                yield Sleep(1, "write scheduled again (capability)")
                return
            yield from self._attempt_failed(failure)
            return
        self.bounces = 0
        if judge is not None and writes:  # the outcome is attested: what the worker's file is, as a verdict says
            self.data.policy_problem = answer.policy_problem
        self.apply(lambda now: self.tool_succeeded(answer, now))

    def _judge_again(self, judge: DecisionCheck, failure: ToolFailure) -> Program[None]:
        """The tool worker did not start the first call after a decision the run took on its
        roster: the decision did not hold under the current file, or that worker cannot judge.
        The policy activity judges it again (attested): refused, the run asks for a new approval;
        allowed, the call is scheduled again on that verdict."""
        self.capability_bounced(failure)
        verdict = yield Call("policy_check_decision", judge, Verdict, "policy check · approve, judged again")
        then = verdict.then
        refusal = verdict.refusal or (then.refusal if then is not None else None)
        if refusal is not None:
            ask = then if then is not None and then.refusal is not None else None
            self.apply(lambda now: self.approval_lapsed(refusal, now, ask), policies=(ask or verdict).policies)
            return
        self.remember_check(judge.then, then)

    def _attempt_failed(self, failure: ToolFailure) -> Program[None]:
        """The retry rule for a failed attempt: the step ends, or the run waits out the backoff
        (a handoff cuts it short) and tries again."""
        delay = self.apply(lambda now: self.tool_failed(failure, now))
        if delay is None:
            return
        yield Checkpoint()
        yield Wait(delay, "retry backoff", until=("handoff",))
        self.apply(self.retry)

    def _in_flight_handoff(self) -> Program[bool]:
        """A forced hand-off (`tether handoff RUN --force`) named this step's call: its attempt was
        in flight in the execution the operator ended, and may have applied. The run takes the
        pending hand-off with the step's outcome unknown. With none to take (refused on arrival
        or by the policy check: a name anyone who may signal can send) the step goes on as any
        other, and the effect ledger says what its call already did. False for any other step."""
        step = self.current_step()
        if step is None or step.tool_call_id not in self.ended_in_flight:
            return False
        self.ended_in_flight.remove(step.tool_call_id)
        self.data.step_outcome = "unknown"
        detail = (f"tool call {step.tool_call_id} ({step.tool}) was in flight when its run was ended: "
                  f"it may have applied, outcome unknown; not run again")
        if (yield from self._take_handoff(detail=detail, refs=self._end_refs(step, "unknown", "handed_off"))):
            self.step_handed_off()
            return True
        # No hand-off taken (refused on arrival or by the policy check): the names it carried
        # change nothing, whoever sent them. The step goes on, and the tool worker's effect
        # ledger answers its call: the recorded outcome, or may_have_applied for an unsafe write.
        self.data.step_outcome = None
        self.ended_in_flight.clear()
        return False


def _same_check(a: AuthorityCheck, b: AuthorityCheck) -> bool:
    """The same re-check, whenever its approvals were accepted (and whatever call it names)."""
    return _untimed(a) == _untimed(b)


def _untimed(check: AuthorityCheck) -> AuthorityCheck:
    return check.model_copy(update={"call": None, "approved": [a.model_copy(update={"at": None}) for a in check.approved]})
