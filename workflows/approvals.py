"""The approvals phase: opening an approval request, screening and settling decisions
(approve, reject, revise, partial approval); its timers (escalation, expiry) are
``workflows/timers.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from workflows import policy
from workflows import revision as revisions
from workflows.budgets import DECISIONS_WINDOW, PROPOSAL_BYTES, QUEUED_PER_SENDER, REASON_CHARS, REVISIONS_KEPT, clip
from workflows.commands import Call, Checkpoint, Wait
from workflows.contract import DELEGATE, AcceptedApproval, ApprovalDecision, DecideResult, NotApproved, Plan, Revision, RevisionRequest
from workflows.identity import same_person
from workflows.plan_check import proposal_basis
from workflows.run_model import Decision, DecisionKind, IllegalState, Program, RunFailed, RunModel, S, require
from workflows.run_state import PendingApproval
from workflows.states import Refs
from workflows.wire import AuthorityCheck, DecisionCheck, Proposal, ProposedStep, Refusal, Verdict


class Approvals(RunModel):
    """A validated plan waiting for people: requests and decisions."""

    def request_approval(self, *, at: datetime, reason: str, ask: Verdict | None = None) -> None:
        """Open a fresh approval request for the current plan (no approvals carried over).

        ``ask``: a re-check's verdict under the current file, whose terms (approvals, roles) the
        request takes. Either way it asks for at least one approval from roles someone can hold.
        """
        data = self.data
        plan = require(data.plan, "no validated plan")
        self.adopt(ask)
        review = self.review()
        ttl = self.request.limits.approval_ttl_seconds
        if review.ttl_seconds is not None:
            ttl = min(ttl, review.ttl_seconds)  # the stricter of the run's and the policy's
        required, roles = policy.request_terms(review, self.tenant)
        data.pending_approval = pending = PendingApproval(
            plan_hash=plan.plan_hash,
            request_id=self.new_request_id(),
            expires_at=at + timedelta(seconds=ttl),
            summary=review.summary,
            risk="high" if review.risk == "high" else "normal",
            approvals_required=required,
            roles=roles,
            editors=list(data.plan_editors),
            revisers=list(data.plan_revisers),
            opened_at=at,
            # Expiry stays the last word: a stage at or past it never fires.
            escalation=[stage for stage in review.escalation if stage.after < ttl],
        )
        data.approval = None
        data.approved_by = []
        version = f"plan v{plan.version}, " if plan.version > 1 else ""
        self.move(
            S.AWAITING_APPROVAL,
            at=at,
            actor="runtime",
            reason=f"{reason} ({version}request {pending.request_id})",
            refs=Refs(plan_hash=plan.plan_hash, request_id=pending.request_id or None),
        )
        # Decisions that came before the run asked are judged now, like any other.
        held, self.early = self.early, []
        for kind, decision in held:
            self.receive(kind, decision, at)

    def adopt(self, ask: Verdict | None) -> None:
        """A re-check under the current policy file refused: from now on the run judges by that
        file (its snapshot is replaced), so the next request asks for what can be given."""
        data = self.data
        if ask is None or ask.tenant_policy is None or data.policy is None:
            return
        # Its roster was judged under the snapshot's file: decisions are judged by the activity now.
        data.policy = data.policy.model_copy(update={"policy": ask.tenant_policy, "policy_hash": ask.policy_hash, "rosters": []})

    def screen_decision(self, kind: DecisionKind, decision: Decision, at: datetime) -> bool:
        """The cheap, state-only checks a decision passes on arrival (signal handler).

        Returns True when it may go on to the policy check; otherwise it is recorded as refused.
        """
        plain = _plain(decision)
        refusal = policy.decision_refusal(plain, self.data, now=at, check_duplicate=True, kind=kind)
        self._remember_decision(plain.decision_id)
        if refusal is not None:
            self._refuse_decision(kind, plain, refusal, at)
            return False
        return True

    def decision_check(self, kind: DecisionKind, decision: Decision) -> dict[str, Any]:
        """What the policy activity needs to judge ``decision`` (DecisionCheck's fields, less
        the run's ids): who decides on which request, and what a revision's signature covers."""
        pending = require(self.data.pending_approval, "no pending approval")
        return {
            "kind": kind,
            "decision": _plain(decision),
            "roles": pending.roles,
            "already_approved": [a.approver for a in pending.approvals],
            "editors": pending.editors,
            "steps_digest": decision.revised_hash() if isinstance(decision, RevisionRequest) else None,
            "risk": pending.risk,
            "stage": pending.stage,
        }

    def _remember_decision(self, decision_id: str) -> None:
        """A bounded window of ids, a count and a running digest of every id seen."""
        data = self.data
        if decision_id in data.decisions_seen:
            return
        data.decisions_seen.append(decision_id)
        del data.decisions_seen[:-DECISIONS_WINDOW]
        data.decisions_count += 1
        data.decisions_digest = hashlib.sha256(f"{data.decisions_digest}\n{decision_id}".encode()).hexdigest()

    def settle_decision(
        self,
        kind: DecisionKind,
        decision: Decision,
        verdict: Refusal | None,
        at: datetime,
        verified: bool = False,
        *,
        new_id: Callable[[int], str] | None = None,
    ) -> None:
        """Apply a decision the policy activity has judged (``verdict`` None: the approver may).

        ``new_id``: tool call ids for a revised plan (a revision, a partial approval)."""
        data = self.data
        plain = _plain(decision)
        # The run may have moved on (expiry, handoff) while the policy was consulted.
        refusal = verdict or policy.decision_refusal(plain, data, now=at, check_duplicate=False, kind=kind)
        if refusal is not None:
            self._refuse_decision(kind, plain, refusal, at)
            return
        pending = require(data.pending_approval, "no pending approval")
        plan = require(data.plan, "no pending approval")
        actor = self.actor(plain.approver, verified, plain.attested_by)
        if isinstance(decision, RevisionRequest):
            ids = require(new_id, "a revision needs tool call ids")
            body = decision.model_dump_json(include={"steps"})
            if len(body) > PROPOSAL_BYTES:  # the proposal's budget: the plan is carried and hashed
                proposal = Proposal(oversized_bytes=len(body), oversized_digest=hashlib.sha256(body.encode()).hexdigest())
            else:
                proposal = Proposal(steps=[ProposedStep(tool=s.tool, args=s.args) for s in decision.steps])
            if self.this_build:
                # The plan it revises and the revised steps: the same revision made again (a
                # reset run, decided again under another decision id) asks with the same ids.
                ids = self.ids(f"revision:{plan.plan_hash}:{proposal_basis(plan.version, proposal)}")
            self._revise(proposal, plain, actor, at, ids, why=f"plan revised by {plain.approver}: {decision.reason}")
            return
        refs = self._decided(Refs(plan_hash=plain.plan_hash, decision_id=plain.decision_id,
                                  request_id=pending.request_id or None))
        if kind == "reject":
            data.pending_approval = None
            self.move(S.REJECTED, at=at, actor=actor, reason=plain.reason or "rejected", refs=refs)
            return
        kept = policy.partial_steps(plain, plan)
        if kept is not None:
            ids = require(new_id, "a partial approval needs tool call ids")
            if self.this_build:
                ids = kept_ids(plan, kept, self.data.steps_executed)
            self._approve_part(plain, kept, actor, at, ids, verified)
            return
        self._approve(plain, actor, at, refs)

    def _revise(
        self,
        proposal: Proposal,
        decision: ApprovalDecision,
        actor: str,
        at: datetime,
        new_id: Callable[[int], str],
        *,
        why: str,
        partial: bool = False,
    ) -> bool:
        """Replace the pending plan by a revised one, validated like a proposal: a new plan
        version, back to VALIDATED (the run then asks for a new approval). Refused
        (``invalid_revision``, nothing changed) when it does not validate or changes nothing."""
        data = self.data
        old = require(data.plan, "no pending plan to revise")
        pending = require(data.pending_approval, "no pending plan to revise")
        kind: DecisionKind = "approve" if partial else "revise"
        result = self.validate(proposal, new_id)
        problem = result.reason if result.plan is None else None
        if result.plan is not None and result.plan.plan_hash == old.plan_hash:
            problem = "the revised plan is the pending plan: nothing to revise"
        if data.next_step:  # (not reached today: a plan waits for approval before any step runs)
            problem = f"{data.next_step} step(s) of the pending plan have run: plan the rest anew"
        if problem is not None or result.plan is None:
            self._refuse_decision(kind, decision, Refusal(rule="invalid_revision", message=f"invalid revision: {problem}"), at)
            return False
        changed = revisions.changed_paths(revisions.patch(old.steps, result.plan.steps))
        if decision.approver not in data.plan_editors:
            data.plan_editors.append(decision.approver)
        if not partial and decision.approver not in data.plan_revisers:
            data.plan_revisers.append(decision.approver)
        self._adopt(result.plan)
        plan = result.plan
        data.revisions.append(
            Revision(
                version=plan.version,
                editor=decision.approver,
                at=at,
                previous_plan_hash=old.plan_hash,
                plan_hash=plan.plan_hash,
                changed=changed,
                partial=partial,
            )
        )
        del data.revisions[:-REVISIONS_KEPT]
        summary = f"; changed {', '.join(changed)}" if changed else ""
        self.move(
            S.VALIDATED,
            at=at,
            actor=actor,
            reason=clip(
                f"{why} — plan v{plan.version} ({len(plan.steps)} step(s)) replaces v{old.version} "
                f"{old.plan_hash[:12]}{summary}",
                REASON_CHARS,
            ),
            refs=Refs(
                plan_hash=plan.plan_hash,
                decision_id=decision.decision_id,
                request_id=pending.request_id or None,
                previous_plan_hash=old.plan_hash,
                changed=changed,
            ),
        )
        return True

    def _approve_part(
        self,
        decision: ApprovalDecision,
        kept: list[int],
        actor: str,
        at: datetime,
        new_id: Callable[[int], str],
        verified: bool,
    ) -> None:
        """A partial approval: a revision to the kept steps, then this approval of the result
        (it counts for the new request like any approval; others needed approve the subset)."""
        data = self.data
        old = require(data.plan, "no pending plan")
        before = require(data.pending_approval, "no pending plan")
        left_out = [n for n in range(1, len(old.steps) + 1) if n not in kept]
        dropped = [NotApproved(step=n, tool=old.steps[n - 1].tool, args=old.steps[n - 1].args, by=decision.approver) for n in left_out]
        proposal = Proposal(steps=[ProposedStep(tool=old.steps[n - 1].tool, args=old.steps[n - 1].args) for n in kept])
        why = (
            f"partial approval by {decision.approver}: step(s) {', '.join(map(str, kept))} of "
            f"{len(old.steps)} approved, not approved: "
            + ", ".join(f"{d.step} ({d.tool})" for d in dropped)
        )
        # Judged before anything changes (a refused decision changes nothing): as the subset's
        # request will ask, with the roles the current request's escalation stages have added,
        # and the approver among the plan's editors (a partial approval revises the plan).
        escalated = [r for stage in before.escalation[: before.stage] for r in stage.roles]
        subset = self.validate(proposal, new_id).plan
        if subset is not None:
            _, roles = policy.request_terms(policy.review_plan(subset, self.catalog, self.tenant, self.totals()), self.tenant)
            refusal = policy.approver_refusal(
                self.tenant,
                approver=decision.approver,
                requested_by=self.request.requested_by,
                kind="approve",
                roles=sorted({*(roles or before.roles), *escalated}),
                already_approved=[],
                editors=[*data.plan_editors, decision.approver],
            )
            if refusal is not None:
                self._refuse_decision("approve", decision, refusal, at)
                return
        if not self._revise(proposal, decision, actor, at, new_id, why=why, partial=True):
            return
        data.not_approved = dropped
        review = self.review()
        self.request_approval(at=at, reason=f"approval of the approved part: {review.summary}")
        pending = require(data.pending_approval, "no pending approval")
        if escalated:
            # The subset's request stands where the request it narrows had escalated to.
            pending.roles = sorted({*pending.roles, *escalated})
            pending.stage = min(before.stage, len(pending.escalation))
        # Checked by the policy activity for the request it was sent for; the subset's request
        # may ask for other roles: the run's snapshot says whether this approver holds one.
        refusal = policy.approver_refusal(
            self.tenant,
            approver=decision.approver,
            requested_by=self.request.requested_by,
            kind="approve",
            roles=pending.roles or before.roles,  # a subset needing nobody: the roles it was sent to
            already_approved=[],
            editors=pending.editors,
        )
        refs = self._decided(Refs(plan_hash=pending.plan_hash, decision_id=decision.decision_id,
                                  request_id=pending.request_id or None))
        if refusal is not None:
            self._refuse_decision("approve", decision.model_copy(update={"plan_hash": pending.plan_hash}), refusal, at)
            return
        self._approve(decision, actor, at, refs)

    def authority_if_approved(self, kind: DecisionKind, decision: Decision) -> AuthorityCheck | None:
        """The re-check of the plan's remaining writes under the approval ``decision`` would put
        in force, for the policy activity to judge with the decision (one activity between a
        decision and its write). None: it would not put the plan in force (an approval more is
        needed, a partial approval, a revision, a rejection), or nothing left writes."""
        data = self.data
        pending = data.pending_approval
        if kind != "approve" or isinstance(decision, RevisionRequest) or pending is None or data.plan is None:
            return None
        if policy.partial_steps(decision, data.plan) is not None:
            return None
        approvals = [*pending.approvals, _accepted(decision, self.workflow_time)]
        if len(approvals) < pending.approvals_required or self._reviser_alone(pending, approvals):
            return None
        return self.authority_check(from_step=data.next_step, approval=pending.model_copy(update={"approvals": approvals}))

    def on_roster(self, kind: DecisionKind, decision: Decision, check: DecisionCheck) -> Verdict | None:
        """The verdict of the run's roster (attested with its policy snapshot) on an approval that
        puts the plan in force, when the plan's next step is one tool call: the run takes it at
        once, and that call's tool worker judges the decision and the plan's re-check again under
        the current file before the tool (``ToolCall.judge``). None: the policy activity judges it."""
        data, snapshot = self.data, self.data.policy
        pending, plan = data.pending_approval, data.plan
        # A compensation run's undos are judged as undos (Recovery): the activity judges its approval.
        if (kind != "approve" or isinstance(decision, RevisionRequest) or check.then is None or snapshot is None
                or not snapshot.rosters or pending is None or plan is None or data.next_step >= len(plan.steps)
                or self.request.compensate_run is not None):
            return None
        step = plan.steps[data.next_step]
        if step.group is not None or step.tool == DELEGATE:
            return None
        policies = policy.roster_policies(snapshot.rosters, pending, decision, self.request.requested_by)
        if policies is None:
            return None
        return Verdict(policy_hash=snapshot.policy_hash, policies=policies,
                       then=Verdict(policy_hash=snapshot.policy_hash))

    def asks_roster(self) -> bool:
        """Does the plan about to be judged at planning time ask for approval, with a roster in the
        run's snapshot (the tenant's people can be judged so)? Then that check brings it again."""
        snapshot = self.data.policy
        return snapshot is not None and bool(snapshot.rosters) and self.review().needs_approval

    def take_rosters(self, verdict: Verdict | None) -> None:
        """The roster judged with the planning-time check (attested), for the request just opened:
        a decision is taken on what the file said as the request opened, not as the run began."""
        snapshot = self.data.policy
        if verdict is None or verdict.rosters is None or snapshot is None or self.state != S.AWAITING_APPROVAL:
            return
        self.data.policy = snapshot.model_copy(update={"rosters": verdict.rosters})

    def approval_lapsed(self, refusal: Refusal, at: datetime, ask: Verdict | None) -> None:
        """A decision taken on the roster, judged again before the plan's first tool under the
        current file (the policy activity's attested verdict), no longer holds: the tool was not
        called, and the run asks for a new approval on what the file asks now."""
        require(self.state == S.EXECUTING_TOOL and self.data.approval is not None, "no approved plan's first call")
        self.request_approval(
            at=at, reason=f"approval no longer holds [{refusal.rule}]: {refusal.message}; a new approval is needed", ask=ask
        )

    def _reviser_alone(self, pending: PendingApproval, approvals: list[AcceptedApproval]) -> bool:
        """Only the plan's revisers approved it, which the tenant does not allow alone."""
        allowed = self.tenant is not None and self.tenant.reviser_may_approve_alone
        return not allowed and _by_revisers(pending, approvals) and len(approvals) >= pending.approvals_required

    def _approve(self, decision: ApprovalDecision, actor: str, at: datetime, refs: Refs) -> None:
        data = self.data
        pending = require(data.pending_approval, "no pending approval")
        # Kept: the re-check before every write verifies it again under the current file.
        pending.approvals.append(_accepted(decision, at))
        data.approved_by = [a.approver for a in pending.approvals]
        unreviewed = " (unreviewed: not bound to a plan the approver was shown)" if decision.unreviewed else ""
        # Whoever changed the plan's steps is not its only approver, unless the tenant allows it.
        alone = _by_revisers(pending, pending.approvals) and len(pending.approvals) >= pending.approvals_required
        if alone and self.tenant is not None and self.tenant.reviser_may_approve_alone:
            unreviewed += " (approved by its own reviser alone: reviser_may_approve_alone = true)"
        elif alone:
            self.on_record(
                data.lifecycle.accept(
                    at=at,
                    actor=actor,
                    reason=f"approval {len(pending.approvals)} of {pending.approvals_required} accepted{unreviewed}; "
                    f"{', '.join(pending.revisers)} revised this plan: an approval from someone who did not revise "
                    f"it is still needed (reviser_may_approve_alone = false)",
                    refs=refs,
                )
            )
            return
        if len(pending.approvals) < pending.approvals_required:
            self.on_record(
                data.lifecycle.accept(
                    at=at,
                    actor=actor,
                    reason=f"approval {len(pending.approvals)} of {pending.approvals_required} accepted{unreviewed}"
                    + (f": {decision.comment}" if decision.comment else ""),
                    refs=refs,
                )
            )
            return
        # The approval is now in force for this plan; nothing is pending any more.
        data.approval, data.pending_approval = pending, None
        self.move(S.APPROVED, at=at, actor=actor, reason=(decision.comment or "approved") + unreviewed, refs=refs)

    def refuse_unsettled(self, kind: DecisionKind, decision: Decision, at: datetime, *, ended: bool = False) -> None:
        """A decision still queued when the run left AWAITING_APPROVAL; ``ended``: the run is
        over (completed, cancelled, failed, handed off, expired), rule ``run_ended``."""
        if ended:
            refusal = Refusal(rule="run_ended", message=f"the run ended before this decision was settled (state {self.state.value})")
        else:
            refusal = Refusal(rule="not_awaiting_approval", message=f"run is {self.state.value}, not AWAITING_APPROVAL")
        self._refuse_decision(kind, _plain(decision), refusal, at)

    def _refuse_decision(self, kind: DecisionKind, decision: ApprovalDecision, refusal: Refusal, at: datetime) -> None:
        record = self.data.lifecycle.refuse(
            at=at,
            actor=f"user:{decision.approver}",
            reason=f"{kind} refused: {refusal.message}",
            rule=refusal.rule,
            refs=self._decided(Refs(plan_hash=decision.plan_hash, decision_id=decision.decision_id,
                                    request_id=decision.request_id)),
        )
        if record is None:  # counted in a flood, not recorded: its sender still gets the rule
            self.unrecorded_refusals[decision.decision_id] = refusal
        self.on_record(record)

    def after_approved(self, refusal: Refusal | None, at: datetime, ask: Verdict | None = None) -> None:
        """Just before an approved plan's writes run: do its approvals still hold?"""
        if refusal is not None:
            self.request_approval(
                at=at,
                reason=f"approval no longer holds [{refusal.rule}]: {refusal.message}; a new approval is needed",
                ask=ask,
            )
            return
        self.enter_step(at=at, reason="approved plan: executing")


def _accepted(decision: ApprovalDecision, at: datetime) -> AcceptedApproval:
    return AcceptedApproval(
        approver=decision.approver,
        decision_id=decision.decision_id,
        at=at,
        signature=decision.signature,
        request_id=decision.request_id or "",
        plan_hash=decision.plan_hash,
        attested_by=decision.attested_by,
        steps=decision.steps,
    )


def _by_revisers(pending: PendingApproval, approvals: list[AcceptedApproval]) -> bool:
    return bool(pending.revisers) and all(any(same_person(a.approver, r) for r in pending.revisers) for a in approvals)


def kept_ids(plan: Plan, kept: list[int], executed: int) -> Callable[[int], str]:
    """The tool call ids of a partial approval's plan: each kept step keeps its own (validation
    numbers the subset's steps after the ``executed`` ones), so a reset run approving the same
    part again, under any decision id, writes under the same idempotency keys."""
    ids = [plan.steps[n - 1].tool_call_id for n in kept]
    return lambda n: ids[n - executed - 1]


def _plain(decision: Decision) -> ApprovalDecision:
    """The fields every decision has (a revision's editor as its approver)."""
    return decision.as_decision() if isinstance(decision, RevisionRequest) else decision


# Where a run has not asked for an approval yet but may (a reset run early in its copied history).
BEFORE_ASKING = frozenset({S.RECEIVED, S.PLANNING, S.VALIDATED, S.VALIDATION_FAILED})
EARLY_DECISIONS = 8  # held at most; more are refused at once, as before


class Decisions(RunModel):
    """Decisions as they arrive and as the run answers them; a waiting plan's wait."""

    def receive(self, kind: DecisionKind, decision: Decision, at: datetime) -> None:
        """Cheap, state-only checks now; the policy check follows in the run's program."""
        if self.hold_early(kind, decision):
            return
        if self.screen_decision(kind, decision, at) and not self._queue_full(kind, decision, at):
            self.inbox.append((kind, decision))
        else:
            self.answer(decision.decision_id)  # nobody waits on a signal; forget its refusal

    def _queue_full(self, kind: DecisionKind, decision: Decision, at: datetime) -> bool:
        """Its sender has QUEUED_PER_SENDER decisions waiting for the policy check already: this
        one is refused unjudged (rule ``queue_full``), on the record as any refusal."""
        plain = _plain(decision)
        queued = sum(1 for _, waiting in self.inbox if same_person(_plain(waiting).approver, plain.approver))
        if queued < QUEUED_PER_SENDER or not self.queue_capped():
            return False
        refusal = Refusal(
            rule="queue_full",
            message=f"{queued} decisions from this sender are waiting for the policy check already: "
            f"this one was not judged; send it again, under a new decision id, once they are settled",
        )
        self._refuse_decision(kind, plain, refusal, at)
        return True

    def deciding(self, kind: DecisionKind, decision: Decision, at: datetime) -> DecideResult | None:
        """A decide Update arrives (counted: Temporal limits them per run). Answered at once when
        the same decision id is being decided already; else received as a signal's decision is,
        its verdict to come (``take_verdict``)."""
        self.updates += 1
        if decision.decision_id in self.verdicts:
            # The same decision twice at once (both passed the validator before either arrived):
            # one verdict per decision id, so the later one is a duplicate.
            return DecideResult(
                decision_id=decision.decision_id,
                outcome="refused",
                state=self.data.lifecycle.state,
                reason=f"decide refused: decision_id {decision.decision_id[:64]} is already being decided",
                rule="duplicate_decision",
            )
        self.verdicts[decision.decision_id] = None
        # Refused on arrival (the state moved since validation) or in the inbox, as a signal's.
        self.receive(kind, decision, at)
        return None

    def take_verdict(self, decision_id: str) -> DecideResult:
        result = self.verdicts.pop(decision_id, None)
        return result if result is not None else DecideResult(
            decision_id=decision_id, outcome="refused", state=self.data.lifecycle.state, reason="no verdict"
        )

    def answer(self, decision_id: str) -> None:
        """Give a waiting decide update its verdict, from the record the run wrote for it."""
        unrecorded = self.unrecorded_refusals.pop(decision_id, None)
        if decision_id not in self.verdicts:
            return
        record = next(
            (r for r in reversed(self.data.lifecycle.timeline) if r.refs.decision_id == decision_id), None
        )
        if record is None:  # a refusal counted in a flood, not recorded
            self.verdicts[decision_id] = DecideResult(
                decision_id=decision_id, outcome="refused", state=self.data.lifecycle.state,
                reason=f"refused: {unrecorded.message} (counted, not recorded: see snapshot.refusals)"
                if unrecorded else "refused (counted, not recorded: see snapshot.refusals)",
                rule=unrecorded.rule if unrecorded else "flood",
            )
            return
        outcome = record.kind
        # What a record naming a decision is: a transition, an accepted approval or a refusal.
        if outcome not in ("transition", "accepted", "refused"):
            raise IllegalState(f"a {outcome} record names decision {decision_id[:64]}")
        self.verdicts[decision_id] = DecideResult(
            decision_id=decision_id, outcome=outcome, state=record.to_state, reason=record.reason, rule=record.rule,
            record=record.model_copy(update={"prev": ""}),  # its link is the sink's business
        )

    def hold_early(self, kind: DecisionKind, decision: Decision) -> bool:
        """A decision naming a request while the run has not asked for one yet is held (at most
        EARLY_DECISIONS), and judged in full once the run asks (``request_approval``): a reset
        run gets again the decisions the execution it copied got, possibly before it asks
        again. A decision for another request is refused then as stale; one the run never asks
        for is refused on its record when the run ends or continues as new."""
        plain = _plain(decision)
        if self.state not in BEFORE_ASKING or not plain.request_id or len(self.early) >= EARLY_DECISIONS:
            return False
        if policy.repeated_decision_refusal(plain.decision_id, self.data) is not None or any(
            _plain(d).decision_id == plain.decision_id for _, d in self.early
        ):
            return False
        self.early.append((kind, decision))
        return True

    def refuse_early(self, at: datetime, *, ended: bool = False) -> None:
        """Held decisions the run did not ask for: refused on the record, their Updates answered."""
        held, self.early = self.early, []
        for kind, decision in held:
            self._remember_decision(_plain(decision).decision_id)
            self.refuse_unsettled(kind, decision, at, ended=ended)
            self.answer(decision.decision_id)

    def _flush_inbox(self, *, ended: bool = False) -> None:
        """The run left AWAITING_APPROVAL (``ended``: the run is over): decisions still queued
        can no longer count."""
        ended = ended or self.data.lifecycle.terminal
        if ended and self.early:
            self.refuse_early(self.workflow_time, ended=True)
        for kind, decision in self.inbox:
            self.refuse_unsettled(kind, decision, self.workflow_time, ended=ended)
            self.answer(decision.decision_id)
        self.inbox.clear()

    def _await_decision(self) -> Program[None]:
        pending = self.data.pending_approval
        if pending is None:
            raise RunFailed("AWAITING_APPROVAL without a pending approval", "IllegalState")
        # The expiry, or the next escalation stage where the policy sets stages.
        wake, summary = self.next_timer(bool(pending.escalation))
        remaining = (wake - self.workflow_time).total_seconds()
        if remaining > 0 and not self.inbox and self.pending_handoff is None:
            yield Checkpoint()
            # A refusal recorded while waiting goes to the sink now, not at the next step.
            yield Wait(remaining, summary, until=("inbox", "handoff", "continue", "audit", "updates"))
        # A forced hand-off naming the plan's next call: the execution it ended had taken an
        # approval and scheduled that call in one task (a decision on the roster), and the reset
        # went back to before both; the call may have applied, on the record as in flight.
        if (yield from self._in_flight_handoff()):
            return
        if (yield from self._take_handoff()):
            return
        if self.inbox:
            # Left in the inbox while the policy is consulted: whatever ends the run meanwhile
            # (a cancel, a failure) still answers it (the run's ending).
            kind, decision = self.inbox[0]
            then = self.authority_if_approved(kind, decision)
            check = DecisionCheck(
                tenant=self.request.tenant,
                workflow_id=self.workflow_id,
                requested_by=self.request.requested_by,
                first_run_id=self.data.first_run_id,
                requester_verified=self.data.requester_verified,
                then=then,
                **self.decision_check(kind, decision),
            )
            verdict = self.on_roster(kind, decision, check)
            on_roster = verdict is not None
            if verdict is None:
                verdict = yield Call("policy_check_decision", check, Verdict, f"policy check · {kind}")
            self.inbox.pop(0)
            ids = self.ids(f"decision:{decision.decision_id}")
            self.apply(
                lambda now: self.settle_decision(kind, decision, verdict.refusal, now, verdict.verified, new_id=ids),
                policies=verdict.policies,
            )
            # The approved plan's re-check came with the verdict: the run enters the plan on it.
            self.remember_check(then, verdict.then)
            if on_roster and self.state == S.APPROVED:
                # Taken on the roster: the tool worker of the plan's first call judges it again.
                self.judge_at_tool = check
            self.answer(decision.decision_id)
            return
        if self.workflow_time >= wake:
            self.apply(lambda now: self.timer_fired(now, bool(pending.escalation)))
        # Otherwise woken to continue as new (or to write refusals to the sink): the loop does
        # that and comes back here.
