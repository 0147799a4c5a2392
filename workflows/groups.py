"""The parallel-group phase: a plan's steps that share a group run at once.

A playbook writes them ``{"parallel": [step, ...]}``; validation lets only read-only and
idempotent steps share a group (a second attempt of either changes nothing). The group's steps
start together, at most the policy's ``max_parallel`` at a time; each result is on the record
as it lands (EXECUTING_TOOL -> EXECUTING_TOOL, at the time it landed), a failed step follows its
own retry rule while its siblings go on, and nothing after the group runs before every step of
it has ended: the barrier. A write in a group has its own capability, minted after one keyed
re-check of the plan's remaining writes, as any write: an approval covers the steps it named.
"""

from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import Any

from workflows import retries
from workflows.budgets import REASON_CHARS, clip
from workflows.commands import Call, Checkpoint, Landed, Mint, RunChild, RunGroup, RunTool, Wait
from workflows.contract import DELEGATE, PlanStep, ToolEffect
from workflows.run_model import Program, RunModel, S, ToolFailure, require
from workflows.states import EffectOutcome, RunState
from workflows.wire import CHILD_CANCELLED, CHILD_EXISTS, CHILD_HANDED_OFF, CHILD_UNREACHABLE, HANDOFF_NOT_STARTED, CAPABILITY_EXPIRED, CAPABILITY_KEY_MISSING, LEDGER_UNAVAILABLE, RECORDS_NOT_WRITTEN, Refusal, ToolCall, ToolOutcome, Verdict

# Steps of a group that run at once when the policy sets no max_parallel.
DEFAULT_PARALLEL = 8
# Answers that say the tool was not called (a key or the ledger missing, records not in the
# sink): the step is scheduled again, not counted as a retry.
NOT_CALLED = (CAPABILITY_KEY_MISSING, CAPABILITY_EXPIRED, LEDGER_UNAVAILABLE, *RECORDS_NOT_WRITTEN)
MAX_NOT_CALLED = 50


class Groups(RunModel):
    """A group of the plan's steps, run at once behind one barrier."""

    def in_group(self) -> bool:
        step = self.current_step()
        return self.state == S.EXECUTING_TOOL and step is not None and step.group is not None

    def group_members(self) -> list[int]:
        """Plan indexes of the group the current step opens (next to one another)."""
        plan = require(self.data.plan, "no plan")
        first = self.data.next_step
        group = plan.steps[first].group
        end = first
        while end < len(plan.steps) and plan.steps[end].group == group:
            end += 1
        return list(range(first, end))

    def parallel_limit(self) -> int:
        budgets = self.tenant.budgets if self.tenant else None
        return (budgets.max_parallel if budgets else None) or DEFAULT_PARALLEL

    def group_call(self, index: int, attempt: int, at: datetime) -> ToolCall | None:
        """The call for one step of the group, or None: the run's tool call budget is spent."""
        plan = require(self.data.plan, "no plan")
        step = plan.steps[index]
        max_calls = self.tenant.budgets.max_tool_calls if self.tenant else None
        if max_calls is not None and self.data.tool_calls >= max_calls:
            return None
        self.data.tool_calls += 1
        self.spend_cover(step)
        refs = self.step_refs(step)
        return ToolCall(
            tool=step.tool, args=step.args, tool_call_id=step.tool_call_id, idempotency_key=refs.idempotency_key or "",
            run_id=self.workflow_id, tenant=self.request.tenant, attempt=attempt,
        )

    def _where(self, step: PlanStep, members: list[int], done: int) -> str:
        return f"parallel group {step.group}: {done} of {len(members)} ended"

    def member_succeeded(self, index: int, outcome: ToolOutcome, members: list[int], done: int, at: datetime) -> None:
        step = require(self.data.plan, "no plan").steps[index]
        self._record_step(step, "ok", outcome)
        noted = self._note_compensation(step, outcome)
        refs = self.step_refs(step).model_copy(update={"outcome": "ok"})
        self.move(
            S.EXECUTING_TOOL, at=at, actor="runtime", refs=refs,
            reason=f"tool call {step.tool_call_id} ({step.tool}) succeeded ({self._where(step, members, done)})" + noted,
        )

    def member_failed(
        self, index: int, failure: ToolFailure, tries: int, members: list[int], done: int, at: datetime
    ) -> tuple[float | None, RunState | None]:
        """One step of the group failed: its retry rule says when it runs again (the delay), or
        how it ends (the state the run takes at the barrier for it). Its siblings go on."""
        step = require(self.data.plan, "no plan").steps[index]
        info = self.tool_info(step)
        effect = info.effect if info else ToolEffect.UNSAFE
        outcome = retries.failure_outcome(effect, permanent=failure.permanent, started=failure.started)
        next_state, why = retries.after_tool_failure(
            effect, permanent=failure.permanent, retries_done=tries,
            max_retries=info.max_retries if info else 0, attempt_over=not failure.still_running,
        )
        refs = self._end_refs(step, outcome, failure.code)
        what = f"tool call {step.tool_call_id} ({step.tool}) failed [{failure.code}], outcome {outcome}"
        if next_state != S.RETRY_WAIT:
            self._end_step(step, outcome, failure.code)
            self.move(S.EXECUTING_TOOL, at=at, actor="runtime", refs=refs,
                      reason=f"{what} — {why} ({self._where(step, members, done)})")
            return None, next_state
        settle = retries.settle_seconds(retries.tool_timeouts(info.timeout_seconds), failure.code) if info and outcome == "unknown" else 0.0
        delay = retries.retry_delay_seconds(tries, failure.suggested_delay, settle)
        self.data.retries += 1
        self.data.last_error = self._error_line(step, outcome, failure.code)
        self.move(S.EXECUTING_TOOL, at=at, actor="runtime", refs=refs,
                  reason=f"{what}: {why} in {delay:g}s; its siblings go on")
        return delay, None

    def member_handed_off(self, index: int, members: list[int], done: int, code: str, at: datetime) -> RunState:
        """A child run of the group handed off (or exists and cannot be adopted): a write of it may
        have applied; the run is handed off at the barrier (its siblings go on)."""
        step = require(self.data.plan, "no plan").steps[index]
        self._end_step(step, "unknown", code)
        what = "handed off" if code == CHILD_HANDED_OFF else "cannot be adopted"
        self.move(S.EXECUTING_TOOL, at=at, actor="runtime", refs=self._end_refs(step, "unknown", code),
                  reason=f"child run {self.child_id(step.tool_call_id)} {what}: a write of it may have applied ({self._where(step, members, done)})")
        return S.HANDED_OFF

    def member_cancelled(self, index: int, members: list[int], done: int, at: datetime) -> RunState:
        """A child run of the group that a hand-off of this run cancelled has settled (its
        attempts ended, on its record): its step ends as a lone child's would."""
        step = require(self.data.plan, "no plan").steps[index]
        outcome = self.cancelled_outcome(step)
        self._end_step(step, outcome, CHILD_CANCELLED)
        self.move(S.EXECUTING_TOOL, at=at, actor="runtime", refs=self._end_refs(step, outcome, CHILD_CANCELLED),
                  reason=f"child run {self.child_id(step.tool_call_id)} cancelled for the hand-off, its attempts settled "
                         f"(on its record), outcome {outcome} ({self._where(step, members, done)})")
        return S.HANDED_OFF

    def member_not_started(self, index: int, code: str, why: str, at: datetime) -> RunState:
        step = require(self.data.plan, "no plan").steps[index]
        self._end_step(step, "failed", code)
        self.move(S.EXECUTING_TOOL, at=at, actor="runtime", refs=self._end_refs(step, "failed", code),
                  reason=f"tool call {step.tool_call_id} ({step.tool}) not started: {why}")
        return S.EXECUTION_FAILED

    def group_done(self, members: list[int], ended: dict[int, RunState], at: datetime) -> None:
        """The barrier: every step of the group has ended. All ok: the run observes; else the
        run ends as the worst of them says (an outcome unknown hands off)."""
        plan = require(self.data.plan, "no plan")
        self.data.step_retries, self.data.step_outcome = 0, None
        group = plan.steps[members[0]].group
        if not ended:
            self.data.last_error = None
            self.data.next_step = members[-1] + 1
            self.move(S.OBSERVING_RESULT, at=at, actor="runtime",
                      reason=f"parallel group {group}: all {len(members)} steps succeeded")
            return
        failed = ", ".join(plan.steps[i].tool_call_id for i in sorted(ended))
        what = f"parallel group {group}: {len(ended)} of {len(members)} steps did not succeed ({failed})"
        if S.HANDED_OFF in ended.values():
            self.move(S.HANDED_OFF, at=at, actor="runtime",
                      reason=clip(f"{what}; one may have applied: needs a human", REASON_CHARS))
        elif self.compensates():
            self.move(S.COMPENSATING, at=at, actor="runtime",
                      reason=clip(f"{what}; on_failure=compensate: {self._undo_left(start=True)}", REASON_CHARS))
        else:
            self.move(S.EXECUTION_FAILED, at=at, actor="runtime", reason=clip(what, REASON_CHARS))

    def group_settled_on_cancel(self, landed: list[Landed]) -> None:
        """A cancel met the group: what each step that ended did is kept (the ok ones can be
        undone); the cancel's record names the last one."""
        running = self.group_running or []
        plan = self.data.plan
        self.group_running = None
        if plan is None:
            return
        for item in landed:
            step = plan.steps[running[item.index]]
            result = self.child_answer(step, item.result) if step.tool == DELEGATE else item.result
            if isinstance(result, ToolOutcome):
                self._record_step(step, "ok", result)
                self._note_compensation(step, result)
                self._settled = (step, "ok", None)
            elif isinstance(result, ToolFailure):
                info = self.tool_info(step)
                effect = info.effect if info else ToolEffect.UNSAFE
                settled: EffectOutcome = "unknown" if result.code == CHILD_HANDED_OFF else \
                    retries.failure_outcome(effect, permanent=result.permanent, started=result.started)
                self._end_step(step, settled, result.code)
                self._settled = (step, settled, result.code)

    # ------------------------------------------------------------------ the program

    def _execute_group(self) -> Program[None]:
        detail, refs = self.handoff_point()
        if (yield from self._take_handoff(detail=detail, refs=refs)):
            self.step_handed_off()
            return
        members = self.group_members()
        plan = require(self.data.plan, "no plan")
        pending, ended = list(members), {}
        done, not_called = 0, 0
        tries: dict[int, int] = {}
        while pending:
            calls: list[tuple[int, ToolCall]] = []
            for index in pending:
                call = self.apply(partial(self.group_call, index, tries.get(index, 0) + 1))
                if call is None:
                    done += 1
                    ended[index] = self.apply(partial(
                        self.member_not_started, index, "tool_call_budget", "the run's tool call budget is spent"))
                else:
                    calls.append((index, call))
            writes = [(i, c) for i, c in calls if (info := self.tool_info(plan.steps[i])) is None or info.effect != ToolEffect.READ_ONLY]
            minted: dict[int, tuple[ToolCall, str | None]] = {}
            if writes:
                check = self.authority_check(from_step=members[0])
                verdict: Verdict | None = None
                if check is not None:
                    verdict = self.checked_verdict(check, take=True)
                    if verdict is None:
                        verdict = yield Call("policy_check_authority", check, Verdict, "policy re-check before the group's writes")
                if check is None or verdict is None or verdict.refusal is not None:
                    refusal = (verdict.refusal if verdict else None) or Refusal(rule="capability_invalid", message="no re-check for this write")
                    for i, _ in writes:
                        done += 1
                        self.data.tool_calls -= 1
                        ended[i] = self.apply(
                            partial(self.member_not_started, i, refusal.rule,
                                    f"the current policy refuses it [{refusal.rule}]: {refusal.message}"),
                            policies=verdict.policies if verdict else None,
                        )
                    calls = [(i, c) for i, c in calls if (i, c) not in writes]
                else:
                    for i, call in writes:
                        write_id = f"{call.tool_call_id}.{self.data.tool_calls}.{self.bounces}.{i}"
                        ttl = retries.tool_timeouts(require(self.tool_info(plan.steps[i]), "no tool").timeout_seconds).start_to_close
                        minted[i] = ((yield Mint(call, write_id, check, ttl)), write_id)
                    # The records before the group's writes are in the sink before any of them starts.
                    yield Checkpoint()
            if not calls:
                break
            runs: list[RunTool | RunChild] = []
            for i, call in calls:
                if plan.steps[i].tool == DELEGATE:
                    runs.append(self.child_run(plan.steps[i]))  # a child run: its own grant, its own gates
                    continue
                info = require(self.tool_info(plan.steps[i]), "no tool")
                timeouts = retries.tool_timeouts(info.timeout_seconds)
                sent, activity_id = minted.get(i, (call, None))
                runs.append(RunTool(
                    sent, activity_id, timeouts.start_to_close, timeouts.heartbeat,
                    summary=f"{info.name} · " + (f"{info.effect.value} · " if activity_id else "")
                    + f"step {i + 1} (parallel group {plan.steps[i].group})",
                ))
            self.group_running = [i for i, _ in calls]
            # A hand-off of this run while a child of the group runs is judged now, as for a lone
            # child; taken, the open children are cancelled first, the attempts in flight end on
            # their own, and the run takes it once every one has ended.
            answer, taken = yield from self._await_children(RunGroup(tuple(runs), self.parallel_limit()))
            self.group_running = None
            landed: list[Landed] = answer
            stopped: list[PlanStep] = []  # the children the hand-off cancelled
            held_back = 0  # the steps it kept from starting
            now, pending, delay = self.at, [], 0.0
            children: list[tuple[str, Any]] = []
            for item in landed:
                index = calls[item.index][0]
                result = item.result
                self.at = item.at  # each result on the record at the time it landed
                run = runs[item.index]
                if isinstance(result, ToolFailure) and result.code == HANDOFF_NOT_STARTED:
                    done, held_back = done + 1, held_back + 1
                    self.data.tool_calls -= 1  # not called: the hand-off was taken first
                    ended[index] = self.apply(partial(
                        self.member_not_started, index, HANDOFF_NOT_STARTED, "a hand-off of the run was taken first"))
                    continue
                if isinstance(run, RunChild) and taken is not None and isinstance(result, ToolFailure) and result.code == CHILD_CANCELLED:
                    done += 1
                    stopped.append(plan.steps[index])
                    ended[index] = self.apply(partial(self.member_cancelled, index, members, done))
                    continue
                if isinstance(run, RunChild):
                    if isinstance(result, ToolFailure) and result.code == CHILD_EXISTS:
                        # Started by an execution of this run before a reset: never again.
                        result = yield from self._adopt_child(run.child_id, plan.steps[index])
                        self.at = item.at
                    children.append((run.child_id, result))
                    result = self.child_answer(plan.steps[index], result)
                    if isinstance(result, ToolFailure) and result.code in (CHILD_HANDED_OFF, CHILD_UNREACHABLE):
                        done += 1
                        ended[index] = self.apply(partial(self.member_handed_off, index, members, done, result.code))
                        continue
                if isinstance(result, ToolOutcome):
                    done += 1
                    self.apply(partial(self.member_succeeded, index, result, members, done))
                    continue
                failure = result if isinstance(result, ToolFailure) else ToolFailure("cancelled", "not started", False, started=False)
                if failure.code in NOT_CALLED and not_called < MAX_NOT_CALLED:
                    not_called += 1
                    self.data.tool_calls -= 1  # the tool was not called: scheduled again
                    pending.append(index)
                    delay = max(delay, 1.0)
                    continue
                wait, end = self.apply(partial(self.member_failed, index, failure, tries.get(index, 0), members, done + 1))
                if wait is None:
                    done += 1
                    ended[index] = require(end, "no end")
                else:
                    tries[index] = tries.get(index, 0) + 1
                    pending.append(index)
                    delay = max(delay, wait)
            self.at = now
            for child, result in children:
                yield from self.child_undos(child, result)
            if taken is not None:
                request, verdict = taken
                if stopped or held_back:
                    # Every attempt has ended: the run is a person's now (a retry due is not made).
                    also = f"parallel group {plan.steps[members[0]].group}: {held_back} step(s) not started" if held_back else None
                    self.apply(partial(self.handed_off_with_children, request, verdict, stopped, ended=True, also=also),
                                policies=verdict.policies)
                    return
                self.apply(partial(self.handoff_later, request))  # each child ended first
            if pending:
                yield Checkpoint()
                yield Wait(delay, "retry backoff (parallel group)")
        self.apply(lambda now: self.group_done(members, ended, now))
