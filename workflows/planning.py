"""The planning phase: the run is received, the planner answers, its proposal is validated
(or fails validation), and the run replans while its budget lasts.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from workflows import policy
from workflows.budgets import ANSWER_CHARS, clip
from workflows.commands import Call, Publish
from workflows.contract import ExecutedStep, Limits, Plan
from workflows.run_model import Program, RunModel, S, ToolFailure, require
from workflows.states import Refs, RunState
from workflows.plan_check import proposal_basis, validated
from workflows.validation import Validation
from workflows.wire import PlannerInput, Proposal, Refusal, SnapshotRequest, Verdict

# Observations handed back to the planner, newest first, in all (older ones keep only their
# digest), so planner inputs in history do not grow with the size of tool results.
PLANNER_CONTEXT_CHARS = 16_000


class Planning(RunModel):
    """From the received run to a validated plan, or the end of planning."""

    def received(self, at: datetime) -> None:
        """The catalog and the policy snapshot are in: start planning, or fail."""
        data = self.data
        if data.created_at is None:
            data.created_at = at
        snapshot = require(data.policy, "no policy snapshot")
        # The policy's content hash goes on the timeline: a run's decisions stay explainable.
        refs = Refs(policy_hash=snapshot.policy_hash)
        data.requester_verified = snapshot.requester_verified
        if snapshot.requester_refusal is not None:
            refusal = snapshot.requester_refusal
            data.last_error = f"{refusal.rule}: {refusal.message}"
            self.move(
                S.FAILED,
                at=at,
                actor=self.actor(self.request.requested_by),
                reason=f"run request refused [{refusal.rule}]: {refusal.message}",
                refs=refs.model_copy(update={"error_code": refusal.rule}),
            )
        elif snapshot.policy is None:
            self.move(
                S.FAILED,
                at=at,
                actor="runtime",
                reason=f"tenant {self.request.tenant!r} is not in the policy file "
                f"{snapshot.source}: add it under [tenants.{self.request.tenant}]",
                refs=refs,
            )
        elif self.request.compensate_run is None:
            self.move(S.PLANNING, at=at, actor="runtime", reason=f"run received; policy {snapshot.source}", refs=refs)

    def token_budget_refusal(self) -> str | None:
        max_tokens = self.request.limits.max_model_tokens
        if max_tokens is not None and self.data.model_tokens >= max_tokens:
            return f"model token budget used up: {self.data.model_tokens} of max_model_tokens={max_tokens} used"
        return None

    def planner_failed(self, failure: ToolFailure, at: datetime) -> None:
        self.data.last_error = f"{failure.code}: {failure.message}"
        self.move(
            S.FAILED,
            at=at,
            actor="planner",
            reason=f"planner failed: {failure.message}",
            refs=Refs(error_code=failure.code),
        )

    def proposal(self, proposal: Proposal, *, at: datetime, new_id: Callable[[int], str]) -> None:
        """The planner answered: finish, validate the plan, or record why it is not valid."""
        data = self.data
        data.model_tokens += proposal.usage_tokens
        data.not_approved = []  # the planner has been told
        max_tokens = self.request.limits.max_model_tokens
        if max_tokens is not None and data.model_tokens > max_tokens:
            data.last_error = f"model_token_budget: {data.model_tokens} > {max_tokens}"
            self.move(
                S.FAILED,
                at=at,
                actor="runtime",
                reason=f"model token budget exceeded: {data.model_tokens} of "
                f"max_model_tokens={max_tokens} used; the proposal was discarded",
                refs=Refs(error_code="model_token_budget"),
            )
            return
        if proposal.answer is not None and not proposal.steps and proposal.oversized_bytes is None:
            data.answer = clip(proposal.answer, ANSWER_CHARS)
            self.move(S.COMPLETED, at=at, actor="planner", reason="planner finished with an answer")
            return
        result = self.validate(proposal, new_id)
        if result.plan is None:
            data.feedback = result.reason  # bounded: the first problems, paths and rules only
            self.move(S.VALIDATION_FAILED, at=at, actor="runtime", reason=result.reason)
            return
        data.plan_editors, data.plan_revisers = [], []
        self._adopt(result.plan)
        data.feedback = None
        self.move(
            S.VALIDATED,
            at=at,
            actor="runtime",
            reason=f"plan of {len(result.plan.steps)} step(s) validated",
            refs=Refs(plan_hash=result.plan.plan_hash),
        )

    def validate(self, proposal: Proposal, new_id: Callable[[int], str]) -> Validation:
        """The one validation a plan gets, proposed or revised: the catalog snapshot, the
        tools' schemas, the tenant's tools and the step budget (with what the run already did)."""
        return validated(
            proposal,
            self.catalog,
            self.tenant,
            limits=self.limits,
            spent=self.totals(),
            executed_steps=self.data.steps_executed,
            new_id=new_id,
            tool_refusal=self.cannot_give,
            delegation_problem=self.delegation_problem,
        )

    def _adopt(self, plan: Plan) -> None:
        """``plan`` becomes the run's current plan, the next version; nothing of it has run."""
        data = self.data
        data.plans = max(data.plans, data.plan.version if data.plan else 0) + 1
        plan.version = data.plans
        data.plan, data.next_step, data.step_retries = plan, 0, 0
        data.pending_approval = data.approval = None
        data.approved_by = []

    def after_validation_failed(self, at: datetime) -> None:
        self._replan_or_end(
            S.FAILED,
            at=at,
            actor="runtime",
            why="validation failed",
            end_reason=f"validation failed and the replan budget is used up "
            f"(max_replans={self.limits.max_replans})",
        )

    def _replan_or_end(
        self, end: RunState, *, at: datetime, actor: str, why: str, end_reason: str, refs: Refs | None = None
    ) -> None:
        """Back to PLANNING while the replan budget lasts, else end in ``end``."""
        limits = self.limits
        if not policy.may_replan(self.data.replans, limits):
            self.move(end, at=at, actor=actor, reason=end_reason, refs=refs)
            return
        self.data.replans += 1
        self.move(
            S.PLANNING,
            at=at,
            actor=actor,
            reason=f"{why}: replan {self.data.replans}/{limits.max_replans}",
            refs=refs,
        )

    def after_validated(self, at: datetime, refusal: Refusal | None = None, ask: Verdict | None = None) -> None:
        """``refusal``: the current policy file's word on a plan the snapshot would auto-approve."""
        review = self.review()
        if not review.needs_approval and refusal is None:
            self.enter_step(at=at, reason=f"policy needs no approval: {review.summary}")
            return
        if review.needs_approval and refusal is None and self.covered_by_parent():
            self.lend_approval(at)  # a child run: the writes its parent's approved plan named
            return
        if review.needs_approval and (refusal is None or refusal.rule == "approval_needed"):
            # What the snapshot said, and the current file too (or it would let the writes run
            # alone, and a person decides all the same): the snapshot's terms.
            self.request_approval(at=at, reason=f"approval needed: {review.summary}")
            return
        assert refusal is not None
        why = f"policy changed [{refusal.rule}]: {refusal.message}; "
        self.request_approval(at=at, reason=f"{why}approval needed: {review.summary}", ask=ask)

    def snapshot_request(self, workflow_id: str, started_at: datetime | None) -> SnapshotRequest:
        """What the run's policy snapshot asks for: the tenant and the start's signature."""
        request = self.request
        return SnapshotRequest(
            tenant=request.tenant,
            workflow_id=workflow_id,
            requested_by=request.requested_by,
            request_digest=request.request_digest(),
            requester_signature=request.requester_signature,
            nonce=request.nonce,
            issued_at=request.issued_at,
            started_at=started_at,
            grant=request.grant,
        )

    # ------------------------------------------------------------------ the program

    def _first_plan(self) -> Program[tuple[Proposal | None, ToolFailure | None]]:
        """The first planner call, which also brings the run's setup (attested). No proposal: the
        planner failed (how, the second); the run then takes its setup alone and records it."""
        yield Publish(listed_as=S.PLANNING)  # corrects a start that listed the run otherwise
        answer = yield self._ask_planner(1, setup=self.snapshot_request(self.workflow_id, self.started_at))
        if not isinstance(answer, ToolFailure):
            # Taken once, for the check the run builds at VALIDATED for this very plan.
            self.prejudged = answer.judged
        if isinstance(answer, ToolFailure):
            return None, answer
        return answer, None

    def _plan(self) -> Program[None]:
        data = self.data
        if (yield from self._take_handoff()):
            return
        budget = self.token_budget_refusal()
        if budget is not None:
            self.apply(
                lambda now: self.move(
                    S.FAILED, at=now, actor="runtime", reason=budget, refs=Refs(error_code="model_token_budget")
                )
            )
            return
        data.planning_rounds += 1
        answer = yield self._ask_planner(data.planning_rounds)
        if isinstance(answer, ToolFailure):
            self.apply(lambda now: self.planner_failed(answer, now))
            return
        yield from self._planned(answer)

    def _ask_planner(self, round: int, *, setup: SnapshotRequest | None = None) -> Call:
        data = self.data
        return Call(
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
                depth=self.depth(),
                max_depth=self.max_depth(),
                # What validating the first plan depends on besides the setup (judged in advance).
                **(self._validation_limits() if setup is not None else {}),
            ),
            Proposal,
            f"plan · {self.request.planner} · round {round}",
            options="planner",
            # A proposal is untrusted input whoever wrote it; the setup that comes with the
            # first one is not, so that answer is attested.
            attested=setup is not None,
            show=setup is None,
            catch=True,
        )

    def _validation_limits(self) -> dict[str, int | None]:
        """The start's limits that validating a plan depends on, where not the defaults (so a
        first call with none of its own asks as before)."""
        limits = self.request.limits
        return {"max_steps": limits.max_steps if limits.max_steps != Limits().max_steps else None,
                "max_model_tokens": limits.max_model_tokens}

    def _planned(self, proposal: Proposal) -> Program[None]:
        """The planner answered (PLANNING): a handoff that came meanwhile first, then the proposal."""
        data = self.data
        if (yield from self._take_handoff()):
            return
        ids = self.ids(proposal_basis(data.planning_rounds, proposal))
        self.apply(lambda now: self.proposal(proposal, at=now, new_id=ids))


def _bounded_context(executed: list[ExecutedStep]) -> list[ExecutedStep]:
    """Observations newest first up to PLANNER_CONTEXT_CHARS; older ones keep only the digest."""
    context, room = [], PLANNER_CONTEXT_CHARS
    for done in reversed(executed):
        fits = len(done.observation) <= room
        room = room - len(done.observation) if fits else 0
        context.append(done if fits else done.model_copy(update={"observation": ""}))
    return list(reversed(context))
