"""Handoff and cancel: screening a handoff, taking it where the table allows; judging a
person's cancel request (the ``cancel`` Update) under the run's policy; and a cancel (which
undoes the run's ok writes first where the run asks for it).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from workflows import policy
from workflows.commands import Call
from workflows.contract import CancelRequest, DecideResult, HandoffRequest
from workflows.identity import normalize_name
from workflows.run_model import Program, RunModel, S, require
from workflows.states import Refs
from workflows.wire import HandoffCheck, PersonCheck, Refusal, Verdict


class Handoff(RunModel):
    """A person takes the run over (handoff) or stops it (cancel)."""

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
        """The run's program was stopped: by a cancel request the run took (``cancel_taken``),
        else by a Temporal cancel (an operator's, ``reason`` as Temporal carried it)."""
        self.data.pending_approval = None
        self.cancelling = True
        taken = self.cancel_taken
        if taken is not None:
            request, verified = taken
            actor, reason = self.actor(request.by, verified), request.reason
        else:
            actor, reason = cancel_actor(reason)
        why = f"cancellation requested: {reason or 'no reason'}"
        ended = self._step_ended_by("cancelled")
        refs, detail = ended if ended is not None else (None, None)
        if taken is not None:
            refs = (refs or Refs()).model_copy(update={"decision_id": taken[0].decision_id})
        why = f"{why}; {detail}" if detail else why
        if self.state != S.COMPENSATING and self.on_cancel() == "compensate" and self.current_undo() is not None:
            # The person asked to stop; the run was told to put things back when stopped.
            self._settled = None
            self.data.step_retries, self.data.step_outcome = 0, None
            self.move(S.COMPENSATING, at=at, actor=actor,
                      reason=f"{why}; on_cancel=compensate: {self._undo_left(start=True)}", refs=refs)
        else:
            if self.state == S.COMPENSATING:
                # Stopped as asked, from where `tether compensate` continues (CANCELLED is compensable).
                why = f"{why}; {self._undo_left()}; continue: tether compensate RUN"
            self.move(S.CANCELLED, at=at, actor=actor, reason=why, refs=refs)
        if taken is not None:
            self.answer(taken[0].decision_id)

    def person_check(
        self, action: Literal["cancel", "compensate"], by: str, *, decision_id: str = "", signature: str | None = None, catch: bool = False
    ) -> Call:
        """The policy activity's judgement of a person's request (``cancel``, ``compensate``);
        ``catch``: its failure is the answer (a ToolFailure), not the run's end."""
        check = PersonCheck(
            tenant=self.request.tenant, workflow_id=self.workflow_id, first_run_id=self.data.first_run_id,
            action=action, by=by, decision_id=decision_id, signature=signature, requested_by=self.request.requested_by,
        )
        return Call("policy_check_person", check, Verdict, f"policy check · {action}", show=False, catch=catch)

    def receive_cancel(self, request: CancelRequest, at: datetime) -> DecideResult | Call:
        """A cancel Update arrives (counted, as a decide Update is). Answered at once where it
        cannot be taken: its decision id is being decided (duplicate), or on the record: the
        run has ended or is being cancelled, another cancel is being judged. Else the policy
        check to run for it (its verdict: ``take_cancel``)."""
        self.updates += 1
        if request.decision_id in self.verdicts:
            return DecideResult(
                decision_id=request.decision_id, outcome="refused", state=self.state, rule="duplicate_decision",
                reason=f"cancel refused: decision_id {request.decision_id[:64]} is already being decided",
            )
        self.verdicts[request.decision_id] = None
        refusal = self.cancel_refusal()
        if refusal is not None:
            self.refuse_cancel(request, refusal, at)
            return self.take_verdict(request.decision_id)
        self.pending_cancel = request
        return self.person_check("cancel", request.by, decision_id=request.decision_id, signature=request.signature,
                                 catch=True)

    def cancel_refusal(self) -> Refusal | None:
        """Why no cancel request can be taken now, whoever sends it."""
        if self.data.lifecycle.terminal:
            return Refusal(rule="run_ended", message=f"run already ended in {self.state.value}")
        if self.cancelling or self.cancel_taken is not None:
            return Refusal(rule="cancel_pending", message="the run is being cancelled already")
        if self.pending_cancel is not None:
            return Refusal(rule="cancel_pending", message="another cancel is being judged")
        return None

    def refuse_cancel(self, request: CancelRequest, refusal: Refusal, at: datetime) -> None:
        self.refuse(at=at, actor=self.actor(request.by), reason=f"cancel refused: {refusal.message}", rule=refusal.rule,
                    refs=Refs(decision_id=request.decision_id))
        self.answer(request.decision_id)

    def take_cancel(self, request: CancelRequest, verdict: Verdict, at: datetime) -> bool:
        """The policy's verdict on a cancel request, at ``at``: refused on the record (the run
        goes on untouched), or taken (True): the workflow stops the run's program as a Temporal
        cancel does, and ``cancelled`` records who asked and why."""
        self.pending_cancel = None
        self.at = at
        refusal = verdict.refusal or self.cancel_refusal()  # the run may have ended while judged

        def judged(now: datetime) -> bool:
            if refusal is not None:
                self.refuse_cancel(request, refusal, now)
                return False
            self.cancel_taken = (request, verdict.verified)
            return True

        return self.apply(judged, policies=verdict.policies)

    def cancel_unjudged(self, request: CancelRequest, why: str, at: datetime) -> None:
        """The policy check of a cancel request failed for good: refused, saying why."""
        self.pending_cancel = None
        self.refuse_cancel(request, Refusal(rule="policy_check_failed", message=f"the policy check failed: {why}"), at)

    def receive_handoff(self, request: HandoffRequest, at: datetime) -> None:
        """A handoff arrives: one at a time, screened now, taken where the table allows. The
        calls a forced one names as in flight (its reset dropped them: they may have applied)
        end their step with the hand-off, if it is taken (steps._in_flight_handoff)."""
        self.ended_in_flight.extend(c for c in request.in_flight if c not in self.ended_in_flight)
        if self.pending_handoff is not None:
            self.refuse_handoff(request, Refusal(rule="handoff_pending", message="a handoff is already pending"), at)
        elif self.screen_handoff(request, at):
            self.pending_handoff = request

    def _take_handoff(self, detail: str | None = None, refs: Refs | None = None) -> Program[bool]:
        """Honour a pending handoff where the table allows, once the current policy file (and the
        sender's signature, where required) says it may. ``refs``: the step it ends."""
        if self.pending_handoff is None or not self.can_take_handoff():
            return False
        request, verdict = yield from self._judge_handoff()
        return self.apply(
            lambda now: self.take_handoff(request, now, detail, verdict.refusal, verdict.verified, refs=refs),
            policies=verdict.policies,
        )

    def _judge_handoff(self) -> Program[tuple[HandoffRequest, Verdict]]:
        """The pending handoff, judged under the current policy file (and the sender's signature,
        where required); no longer pending."""
        request = require(self.pending_handoff, "no pending handoff")
        verdict = yield Call(
            "policy_check_handoff",
            HandoffCheck(
                tenant=self.request.tenant,
                workflow_id=self.workflow_id,
                first_run_id=self.data.first_run_id,
                handoff=request,
                requested_by=self.request.requested_by,
            ),
            Verdict,
            "policy check · handoff",
        )
        self.pending_handoff = None
        return request, verdict


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
