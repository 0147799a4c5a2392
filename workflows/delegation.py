"""The delegation phase: a plan step that hands a sub-task to a child run, which can never hold
more than its parent.

A playbook writes it ``{"delegate": {"goal": ..., "tools": [...], "max_steps": N, "playbook":
[...]}}``; in the plan it is a step of the tool ``tether.delegate`` whose arguments are the
Delegation (the plan hash covers them: an approver sees what is handed on). Running it starts a
child ``AgentRun`` (a Temporal child workflow, its id the parent's and the step's) with a Grant
the parent's workflow code seals with the fleet key: a subset of the parent's tools and effect
classes, at most its remaining steps, one level deeper (the policy's ``max_depth``), the same
tenant, policy and requester. The child refuses a grant that is not sealed for it by the parent
the server names, and proposes nothing outside it. The child's outcome is the step's result;
the steps it ran count against the parent's tool call budget.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import partial
from typing import Any, Literal

from pydantic import ValidationError

from workflows import policy
from workflows.budgets import REASON_CHARS, clip
from workflows.commands import Call, RunChild, RunGroup
from workflows.contract import DELEGATE, STRICT, WORKFLOW_ID_CHARS, Delegation, Grant, HandoffRequest, Limits, PlanStep, PlaybookStep, ToolEffect, first_error
from workflows.run_model import IllegalState, Program, RunModel, S, ToolFailure, require
from workflows.run_state import PendingApproval, RunOutcome, RunRequest
from workflows.wire import CHILD_CANCELLED, CHILD_EXISTS, CHILD_HANDED_OFF, CHILD_UNREACHABLE, CHILD_WOKEN, RecoveryRequest, RecoverySource, Refusal, ToolOutcome, Verdict

# Approvals a grant lends at most (more: the child asks its own).
GRANT_APPROVALS = 20


class Delegating(RunModel):
    """Child runs: what a delegation may ask for, the grant it gets, and how its end counts."""

    # The reason to cancel the open child with: a hand-off of this run taken while it ran.
    child_cancel: str | None = None

    def depth(self) -> int:
        return self.request.grant.depth if self.request.grant else 0

    def max_depth(self) -> int | None:
        """The tenant's max_depth (None: the policy sets none, policy.DEFAULT_DEPTH holds)."""
        budgets = self.tenant.budgets if self.tenant else None
        return budgets.max_depth if budgets else None

    def cannot_give(self, tool: str) -> str | None:
        """Why this run cannot hand ``tool`` on: the tenant's tools list, or its own grant."""
        return policy.tool_refusal(self.tenant, tool) or self.grant_refusal(tool)

    def grant_refusal(self, tool: str) -> str | None:
        """A tool this run's grant does not give it (a child proposes it: refused at validation)."""
        grant = self.request.grant
        if grant is None or tool == DELEGATE:
            return None
        info = self.catalog.get(tool)
        if tool not in grant.tools or (info is not None and info.effect not in grant.effects):
            return f"tool {tool!r} is outside this run's grant from {grant.parent} (it may use: {', '.join(grant.tools)})"
        return None

    def delegation_problem(self, args: dict[str, Any]) -> str | None:
        """Why a delegate step cannot be planned: its arguments, a tool the run cannot give, the
        depth limit, a step budget beyond what the run has left."""
        try:
            delegation = Delegation.model_validate(args, context=STRICT)
        except ValidationError as e:
            return f"not a delegation: {first_error(e)}"
        if len(self.child_id("tc-000-" + "0" * 12)) > WORKFLOW_ID_CHARS:
            return f"this run's id is too long to name a child run by (over {WORKFLOW_ID_CHARS} characters)"
        if not policy.may_delegate(self.depth(), self.max_depth()):
            limit = policy.DEFAULT_DEPTH if self.max_depth() is None else self.max_depth()
            return f"delegation beyond the depth limit: this run is at depth {self.depth()}, max_depth is {limit}"
        for tool in delegation.tools:
            if tool == DELEGATE or self.catalog.get(tool) is None:
                return f"delegation names {tool!r}, not a tool this run has"
            if (why := self.cannot_give(tool)) is not None:
                return f"delegation names a tool it cannot give: {why}"
        for step in delegation.playbook or []:
            if step.tool and step.tool not in delegation.tools:
                return f"the delegation's playbook calls {step.tool!r}, outside the tools it gives"
        left = self.limits.max_steps - self.data.steps_executed
        if delegation.max_steps > left:
            return f"delegation of {delegation.max_steps} steps, over the {left} this run has left"
        return None

    def child_id(self, step_id: str) -> str:
        return f"{self.workflow_id}.{step_id}"

    def grant_for(self, delegation: Delegation, step_id: str) -> Grant:
        """The child's grant (unsealed: the workflow seals it with the fleet key)."""
        tools = [t for t in delegation.tools if self.cannot_give(t) is None and self.catalog.get(t) is not None]
        effects = sorted({info.effect for t in tools if (info := self.catalog.get(t))}, key=lambda e: e.value)
        parent = self.request.grant
        # The approval in force (this run's own: one its grant lent it covers no grandchild) covers
        # the writes the delegation's playbook names: the approved plan hash covers them.
        approval = self.data.approval if self.data.approval is not None and not self.lent_approval() else None
        covered = [
            PlaybookStep(tool=s.tool, args=s.args) for s in policy.named_steps(delegation.playbook or [])
            if approval is not None and s.tool in tools and (info := self.catalog.get(s.tool)) is not None
            and info.effect != ToolEffect.READ_ONLY
        ]
        coverage: dict[str, Any] = {}
        if approval is not None and covered and len(approval.approvals) <= GRANT_APPROVALS:
            coverage = dict(
                covered=covered, approved=list(approval.approvals), approved_roles=list(approval.roles),
                approvals_required=approval.approvals_required, approved_request=approval.request_id,
                approved_plan=approval.plan_hash, parent_first_run=self.data.first_run_id,
            )
        return Grant(
            root=parent.root if parent else self.workflow_id,
            parent=self.workflow_id,
            parent_run="-",  # the execution's run id: the workflow fills it in as it seals
            child=self.child_id(step_id),
            depth=self.depth() + 1,
            tenant=self.request.tenant,
            tools=tools,
            effects=effects,
            max_steps=min(delegation.max_steps, self.limits.max_steps - self.data.steps_executed),
            requested_by=self.request.requested_by,
            parent_goal=self.request.goal[:2000],
            spent=self.tree_spent(step_id),
            sums_unknown=self.sums_unknown(step_id),
            **coverage,
        )

    def tree_spent(self, step_id: str) -> dict[str, float]:
        """The sums a child started for ``step_id`` is judged on: the tree's (this run's totals),
        and the writes its siblings in the same parallel group make or name, in flight beside it."""
        totals = dict(self.totals())
        plan = self.data.plan
        step = next((s for s in plan.steps if s.tool_call_id == step_id), None) if plan else None
        if plan is None or step is None or step.group is None:
            return totals
        for sibling in plan.steps:
            if sibling.group != step.group or sibling.tool_call_id == step_id:
                continue
            if sibling.tool != DELEGATE:  # this run's own write beside the child
                if self.is_write(sibling):
                    policy.spend(totals, sibling.tool, sibling.args)
                continue
            for named in policy.named_steps(Delegation.model_validate(sibling.args).playbook or [], nested=True):
                if self.is_write(named):
                    policy.spend(totals, named.tool, named.args)
        return totals

    def sums_unknown(self, step_id: str) -> bool:
        """Are the tree's sums unknown to a child started for ``step_id``: this run's are (its
        grant says so), or a sibling in its parallel group may write amounts nobody named (a
        planner other than its playbook plans it)?"""
        grant, plan = self.request.grant, self.data.plan
        if grant is not None and grant.sums_unknown:
            return True
        step = next((s for s in plan.steps if s.tool_call_id == step_id), None) if plan else None
        if plan is None or step is None or step.group is None:
            return False
        for sibling in plan.steps:
            if sibling.group != step.group or sibling.tool != DELEGATE or sibling.tool_call_id == step_id:
                continue
            delegation = Delegation.model_validate(sibling.args)
            planned = delegation.planner not in (None, "playbook") or not delegation.playbook
            if planned and any(self.is_write(PlaybookStep(tool=t)) for t in delegation.tools):
                return True
        return False

    def child_request(self, delegation: Delegation, grant: Grant) -> RunRequest:
        return RunRequest(
            goal=delegation.goal,
            tenant=self.request.tenant,
            requested_by=self.request.requested_by,
            planner=delegation.planner or ("playbook" if delegation.playbook else self.request.planner),
            playbook=delegation.playbook or [],
            limits=Limits(max_steps=grant.max_steps, max_replans=self.limits.max_replans,
                          approval_ttl_seconds=self.limits.approval_ttl_seconds),
            on_failure=self.request.on_failure,
            on_cancel=self.request.on_cancel,
            grant=grant,
        )

    def lent_approval(self) -> bool:
        """Is the approval in force the parent's, lent by this run's grant?"""
        grant, approval = self.request.grant, self.data.approval
        return grant is not None and approval is not None and bool(grant.approved_request) \
            and approval.request_id == grant.approved_request

    def is_write(self, step: PlanStep | PlaybookStep) -> bool:
        return (info := self.catalog.get(step.tool)) is None or info.effect != ToolEffect.READ_ONLY

    def cover_left(self) -> list[int]:
        """The grant's covered writes (indexes into ``Grant.covered``) no write of this run has
        spent yet: the parent's approval named each once."""
        grant = self.request.grant
        if grant is None:
            return []
        spent = set(self.data.cover_spent.values())
        return [i for i in range(len(grant.covered)) if i not in spent]

    def _cover_for(self, step: PlanStep, left: list[int]) -> int | None:
        """The first of ``left`` that names exactly ``step`` (its tool and arguments)."""
        covered = require(self.request.grant, "no grant").covered
        return next((i for i in left if covered[i].tool == step.tool and covered[i].args == step.args), None)

    def covered_by_parent(self, from_step: int = 0) -> bool:
        """Does the parent's approval cover the plan's remaining writes: each one a write its
        approved plan named and no write of this run has spent yet (a multiset: named once,
        covered once), the same tool and the same arguments?"""
        grant, plan = self.request.grant, self.data.plan
        if grant is None or not grant.approved or plan is None:
            return False
        writes = [s for s in plan.steps[from_step:] if self.is_write(s)]
        # A write that has spent its cover already (a retry's re-check) stays covered by it.
        pending = [s for s in writes if s.tool_call_id not in self.data.cover_spent]
        left = self.cover_left()
        for step in pending:
            index = self._cover_for(step, left)
            if index is None:
                return False
            left.remove(index)
        return bool(writes)

    def spend_cover(self, step: PlanStep) -> None:
        """A write about to run under the parent's lent approval spends the cover it has (once,
        whatever its retries): no later write, equal or not, is covered by it."""
        if not self.lent_approval() or not self.is_write(step) or step.tool_call_id in self.data.cover_spent:
            return
        index = self._cover_for(step, self.cover_left())
        if index is None:
            raise IllegalState("a write under the parent's approval that it does not cover")
        self.data.cover_spent[step.tool_call_id] = index

    def cover_key(self, step: PlanStep) -> str | None:
        """The idempotency key of a write under the parent's lent approval: the slot of the
        named write it spends (``<workflow id>:cover-<i>``), not its tool call's. A reset of this
        run to before the spend forgets it (``cover_spent`` is this run's state), and a plan made
        again differently has other tool call ids: the same slot's key meets the effect ledger's
        record of the write instead of writing it twice. None: not such a write."""
        index = self.data.cover_spent.get(step.tool_call_id)
        if index is None and self.lent_approval() and self.is_write(step):
            index = self._cover_for(step, self.cover_left())
        return None if index is None else f"{self.workflow_id}:cover-{index}"

    def lend_approval(self, at: datetime) -> None:
        """The parent's approval covers the plan (and the current file still says so): it is
        the approval in force here; the writes run under it, each re-checked as any write."""
        grant, plan = require(self.request.grant, "no grant"), require(self.data.plan, "no plan")
        self.data.approval = PendingApproval(
            plan_hash=grant.approved_plan, request_id=grant.approved_request, expires_at=at,
            summary=f"the approval of {grant.parent}", approvals_required=grant.approvals_required,
            roles=list(grant.approved_roles), approvals=list(grant.approved),
        )
        self.data.approved_by = [a.approver for a in grant.approved]
        self.enter_step(at=at, reason=(
            f"covered by the approval of parent run {grant.parent} (request {grant.approved_request}, approved by "
            f"{', '.join(self.data.approved_by)}): its approved plan named these writes (plan {plan.plan_hash[:12]})"
        ))

    def grant_refused(self, at: datetime) -> None:
        """A start whose grant is not the fleet's for this child: nothing runs."""
        problem = require(self.grant_problem, "no grant problem")
        self.data.last_error = f"grant_invalid: {problem}"
        self.move(S.FAILED, at=at, actor="runtime", reason=clip(f"run request refused [grant_invalid]: {problem}", REASON_CHARS))

    def child_answer(self, step: PlanStep, result: RunOutcome | ToolFailure) -> ToolOutcome | ToolFailure:
        """The child's end as the delegate step's answer (COMPLETED: its summary; HANDED_OFF:
        CHILD_HANDED_OFF; else a failure naming its end); the steps it ran count against this run."""
        if isinstance(result, ToolFailure):
            return result
        self.data.tool_calls += result.steps_executed
        # What the child's writes may have applied is the tree's: charged to this run's sums,
        # which judge its next plans and the grants of its later children.
        for key, value in result.spent.items():
            self.data.spent[key] = self.data.spent.get(key, 0) + value
        summary = {"child": self.child_id(step.tool_call_id), "state": result.state.value, "answer": result.answer}
        observation = json.dumps(summary, sort_keys=True)
        if result.state == S.COMPLETED:
            digest = hashlib.sha256(observation.encode()).hexdigest()
            return ToolOutcome(observation=observation, digest=digest, size=len(observation))
        if result.state == S.HANDED_OFF:
            return ToolFailure(CHILD_HANDED_OFF, f"child run {summary['child']} handed off", True)
        return ToolFailure(f"child_{result.state.value.lower()}", f"child run ended {result.state.value}", True)

    def child_ended(self, result: RunOutcome | ToolFailure, at: datetime) -> None:
        """The child's end is the delegate step's result; its steps count against this run."""
        step = require(self.current_step(), "no delegate step")
        answer = self.child_answer(step, result)
        if isinstance(answer, ToolOutcome):
            self.tool_succeeded(answer, at)
        elif answer.code in (CHILD_HANDED_OFF, CHILD_UNREACHABLE):
            # A write of the child's may have applied: a person takes the parent too.
            self._end_step(step, "unknown", answer.code)
            why = "handed off" if answer.code == CHILD_HANDED_OFF else "cannot be adopted (it runs on, or its record does not say)"
            self.move(S.HANDED_OFF, at=at, actor="runtime", refs=self._end_refs(step, "unknown", answer.code),
                      reason=f"child run {self.child_id(step.tool_call_id)} {why}: a write of it may have applied; "
                             f"outcome unknown, needs a human")
        else:
            self.tool_failed(answer, at)

    def child_run(self, step: PlanStep) -> RunChild:
        """What starts the child run of a delegate step: its request, carrying its grant."""
        delegation = Delegation.model_validate(step.args)
        grant = self.grant_for(delegation, step.tool_call_id)
        return RunChild(self.child_request(delegation, grant), grant.child, f"delegate · {delegation.goal[:80]}")

    def child_undos(self, child: str, result: RunOutcome | ToolFailure) -> Program[None]:
        """A completed child's undos become this run's, newest last: what the child's closed record
        says (attested by the fleet key: a keyless poller's result for the child cannot add any)."""
        if isinstance(result, RunOutcome) and result.state == S.COMPLETED and result.compensations:
            source = yield Call(
                "recovery_source", RecoveryRequest(run_id=child, tenant=self.request.tenant), RecoverySource,
                f"recovery source · {child}", show=False,
            )
            self.data.compensations.extend(c for c in source.compensations if c.status == "pending")

    def cancelled_outcome(self, step: PlanStep) -> Literal["unknown", "failed"]:
        """A delegate step whose child a hand-off cancelled: ``unknown`` when its grant could write
        (what it did is on its record), else ``failed``."""
        delegation = Delegation.model_validate(step.args)
        wrote = any((info := self.catalog.get(t)) is None or info.effect != ToolEffect.READ_ONLY for t in delegation.tools)
        return "unknown" if wrote else "failed"

    def handed_off_with_children(
        self, request: HandoffRequest, verdict: Verdict, steps: list[PlanStep], at: datetime, *, ended: bool = False,
        also: str | None = None,
    ) -> None:
        """A hand-off taken while children ran: they were cancelled and have settled (their
        attempts ended, on their records); the delegate steps end with them (``ended``: each is on
        the record already, as a group's member), and a person takes the run (``also``: what else
        the record says). A hand-off that arrived meanwhile is refused: this one is taken."""
        later = self.pending_handoff
        if later is not None:
            self.pending_handoff = None
            self.refuse_handoff(later, Refusal(rule="handoff_pending", message="a handoff is already pending"), at)
        outcomes = [self.cancelled_outcome(step) for step in steps]
        outcome: Literal["unknown", "failed"] = "unknown" if "unknown" in outcomes else "failed"
        refs = self._end_refs(steps[0], outcome, CHILD_CANCELLED) if steps else None
        if not ended:
            for step, settled in zip(steps, outcomes):
                self._end_step(step, settled, CHILD_CANCELLED)
        details = [also] if also else []
        if len(steps) == 1:
            details.insert(0, f"child run {self.child_id(steps[0].tool_call_id)} cancelled first, its attempts settled "
                              f"(on its record); delegate step outcome {outcome}")
        elif steps:
            names = ", ".join(self.child_id(step.tool_call_id) for step in steps)
            details.insert(0, f"child runs {names} cancelled first, their attempts settled (on their records); "
                              f"outcome {outcome}")
        self.take_handoff(request, at, "; ".join(details), None, verdict.verified, refs=refs)

    def handoff_later(self, request: HandoffRequest, at: datetime) -> None:
        """A hand-off taken while children ran, but none was cancelled (each ended first): their
        ends count as any; it is taken at the run's next point that allows it (judged again
        there), before any that arrived since, which is refused."""
        later = self.pending_handoff
        if later is not None:
            self.refuse_handoff(later, Refusal(rule="handoff_pending", message="a handoff is already pending"), at)
        self.pending_handoff = request

    def _await_children(self, command: RunChild | RunGroup) -> Program[tuple[Any, tuple[HandoffRequest, Verdict] | None]]:
        """Wait for open child runs (a delegate step's RunChild, a parallel group's RunGroup): its
        result, and the hand-off taken meanwhile (or None). A hand-off of this run wakes the wait
        (CHILD_WOKEN: the children run on) and is judged now, as any: refused, on the record, the
        wait goes on untouched; taken, the same command again cancels the open children first,
        with its reason (``child_cancel``), and waits for everything in it to end."""
        result = yield command
        taken: tuple[HandoffRequest, Verdict] | None = None
        while isinstance(result, ToolFailure) and result.code == CHILD_WOKEN:
            request, verdict = yield from self._judge_handoff()
            if verdict.refusal is not None:
                refusal = verdict.refusal
                self.apply(lambda now: self.refuse_handoff(request, refusal, now), policies=verdict.policies)
            else:
                taken = (request, verdict)
                self.child_cancel = f"by {request.by}: parent run {self.workflow_id} handed off: {request.reason}"
            result = yield command
        self.child_cancel = None
        return result, taken

    # ------------------------------------------------------------------ the program

    def _delegate_step(self) -> Program[None]:
        detail, refs = self.handoff_point()
        if (yield from self._take_handoff(detail=detail, refs=refs)):
            self.step_handed_off()
            return
        run = self.child_run(require(self.current_step(), "no delegate step"))
        self.data.tool_calls += 1
        # A hand-off of this run while the child runs is judged now; taken, the child is cancelled
        # first (it settles its attempts), and the run takes it once the child has ended.
        result, taken = yield from self._await_children(run)
        if taken is not None and isinstance(result, ToolFailure) and result.code == CHILD_CANCELLED:
            request, verdict = taken
            step = require(self.current_step(), "no delegate step")
            self.apply(lambda now: self.handed_off_with_children(request, verdict, [step], now), policies=verdict.policies)
            return
        if taken is not None:
            # The child ended before the cancel reached it: its end counts as any.
            self.apply(partial(self.handoff_later, taken[0]))
        if isinstance(result, ToolFailure) and result.code == CHILD_EXISTS:
            result = yield from self._adopt_child(run.child_id, require(self.current_step(), "no delegate step"))
        yield from self.child_undos(run.child_id, result)
        self.apply(lambda now: self.child_ended(result, now))

    def _adopt_child(self, child: str, step: PlanStep) -> Program[RunOutcome | ToolFailure]:
        """The child of this step exists already (this run was reset or repaired after its first
        start of it): never started again. Closed, its end is the step's (what its closed record
        says, attested by the fleet key); running or unreadable, what it wrote is unknown: the step
        ends ``unknown`` and a person takes this run, naming the child; so does one that ended
        otherwise when its grant could write (a read-only one's end counts as any)."""
        source = yield Call(
            "recovery_source", RecoveryRequest(run_id=child, tenant=self.request.tenant), RecoverySource,
            f"adopt child · {child}", show=False,
        )
        if source.refusal is not None or source.state is None:
            why = source.refusal.message if source.refusal is not None else "its record names no state"
            return ToolFailure(CHILD_UNREACHABLE, f"child run {child} exists and cannot be adopted: {why}", True)
        if source.state != S.COMPLETED and self.cancelled_outcome(step) == "unknown":
            # Ended otherwise (cancelled as the earlier execution closed, failed, handed off): a
            # write of it may have applied, and its record, not this run, says which.
            return ToolFailure(CHILD_UNREACHABLE, f"child run {child} exists and ended {source.state.value}", True)
        return RunOutcome(run_id=child, state=source.state, answer=f"adopted: child run {child} had ended {source.state.value}",
                          compensations=source.compensations, spent=source.spent)

