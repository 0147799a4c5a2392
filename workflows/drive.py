"""The run's program: what the engine asks for next, one command at a time.

``Engine.next(now)`` returns the next command (call an activity, run a tool, wait, continue as
new, end); the workflow carries it out (``workflows/effects.py``) and hands the result back with
``Engine.on(command, result, now)``. The program is the run's sequencing, the one there is: it
dispatches on the run's state to the phases' own programs (planning, approvals, steps, carry),
each a generator that yields commands and is sent their results; it never awaits.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from workflows.commands import Call, Checkpoint, Command, End, HandlersDone, Notified, Notify, RunChild, RunGroup, RunTool, Sleep, Wait
from workflows.contract import DELEGATE
from workflows.run_model import Program, RunFailed, RunModel, S
from workflows.wire import RecoveryRequest, RecoverySource, Refusal, RunSetup, Verdict


class Drive(RunModel):
    """Where the run's program stands, and the program itself."""

    _program: Program[None] | None = None
    _result: Any = None

    def start(self, *, ending: bool = False) -> None:
        """Begin the run's program (again, after a cancel that compensates), or its ending: the
        run has ended, and nothing may be left unsaid on the record, or unanswered."""
        self._program = self._ending() if ending else self._driving()
        self._result = None

    def next(self, now: datetime) -> Command:
        """The next command, deciding everything that can be decided before it at ``now``."""
        assert self._program is not None, "start() the program first"
        self.at = now
        try:
            command = self._program.send(self._result)
        except StopIteration:
            self._program = None
            return End()
        self._result = None
        if isinstance(command, (Call, RunTool, RunGroup, RunChild, Sleep, Wait)):
            self.checked = None  # the run waits: a re-check it had covers no write after this
        return command

    def on(self, command: Command, result: Any, now: datetime) -> None:
        """What ``command`` came to: the program goes on from there at the next ``next``."""
        self.at = now
        self._result = result
        if isinstance(result, Verdict):  # what the worker's policy file is, as its verdict says
            self.data.policy_problem = result.policy_problem

    def delegating(self) -> bool:
        step = self.current_step()
        return self.state == S.EXECUTING_TOOL and step is not None and step.tool == DELEGATE and step.group is None

    def _driving(self) -> Program[None]:
        data = self.data
        first = failure = None
        if self.grant_problem is not None and data.lifecycle.state == S.RECEIVED:
            self.apply(self.grant_refused)  # a grant not the fleet's for this child: nothing runs
            return
        if data.catalog is None or data.policy is None:
            # One snapshot per run: validation must not change under a run's feet. A run that
            # plans takes it with its first planner call.
            if self.request.compensate_run is None:
                first, failure = yield from self._first_plan()
            setup = first.setup if first is not None else None
            if setup is None:
                setup = yield Call(
                    "run_setup", self.snapshot_request(self.workflow_id, self.started_at), RunSetup, "run setup", show=False
                )
            data.catalog, data.policy = setup.catalog, setup.policy
        if data.lifecycle.state == S.RECEIVED:
            self.apply(self.received)
        if data.lifecycle.state == S.PLANNING and self.request.compensate_run is None and data.planning_rounds == 0:
            data.planning_rounds = 1  # the first planner call: its proposal, or how it failed
            if first is not None:
                yield from self._planned(first)
                if self.state != S.VALIDATED:
                    self.prejudged = None  # judged for a plan the run did not take
            elif failure is not None:
                self.apply(lambda now: self.planner_failed(failure, now))
        if data.lifecycle.state == S.RECEIVED and self.request.compensate_run is not None:
            # A compensation run: its first judgement is whether its requester may ask it (the
            # current file: Cedar's compensate), what `tether compensate` waits for.
            judged = yield self.person_check("compensate", self.request.requested_by)
            if judged.refusal is not None:
                self.apply(lambda now: self.compensation_refused(judged.refusal, now), policies=judged.policies)
            else:
                # The original's closed record says what its approvals covered (attested by the
                # fleet key: a keyless poller cannot say what gets undone).
                source = yield Call(
                    "recovery_source",
                    RecoveryRequest(run_id=self.request.compensate_run, tenant=self.request.tenant),
                    RecoverySource,
                    f"recovery source · {self.request.compensate_run}",
                    show=False,
                )
                self.apply(lambda now: self.begin_compensation(source, now), policies=judged.policies)

        while not data.lifecycle.terminal:
            yield from self._maybe_continue_as_new()
            state = data.lifecycle.state
            if state == S.PLANNING:
                yield from self._plan()
            elif state == S.VALIDATION_FAILED:
                self.apply(self.after_validation_failed)
            elif state == S.VALIDATED:
                # Whether its writes need a person, judged by the current file (Cedar's
                # auto_approve, on the judgement log: what-if sees a loosening too). Auto-approved
                # by the run's snapshot: the current file must agree, or a person decides.
                # A plan that asks for approval has the run's roster judged again as it does.
                verdict = yield from self._authority(from_step=0, roster=self.asks_roster())
                self.apply(lambda now: self.after_validated(now, _refusal(verdict), verdict), policies=_policies(verdict))
                self.take_rosters(verdict)
            elif state == S.AWAITING_APPROVAL:
                yield from self._await_decision()
            elif state == S.APPROVED:
                verdict = yield from self._authority(from_step=data.next_step)
                self.apply(lambda now: self.after_approved(_refusal(verdict), now, verdict), policies=_policies(verdict))
            elif state == S.EXECUTING_TOOL:
                if self.delegating():
                    yield from self._delegate_step()
                else:
                    yield from (self._execute_group() if self.in_group() else self._execute_step())
            elif state == S.COMPENSATING:
                # The same step path as the plan's steps: one way to call a tool.
                if self.apply(self.compensation_ready):
                    yield from self._execute_step()
            elif state == S.OBSERVING_RESULT:
                verdict = None
                if self.current_step() is not None:
                    verdict = yield from self._authority(from_step=data.next_step)
                self.apply(lambda now: self.after_observation(_refusal(verdict), now, verdict), policies=_policies(verdict))
            else:
                raise RunFailed(f"no handler for working state {state.value}", "IllegalState")
            if data.lifecycle.state != S.AWAITING_APPROVAL and self.inbox:
                self._flush_inbox()

    def _ending(self) -> Program[None]:
        """Every decision in the inbox, the one being checked included, is refused
        (``run_ended``) and its decide Update answered; an accepted handoff is said to be
        unhonoured; notifications get their bounded wait; the sink gets every record."""
        if self.pending_handoff is not None:
            self.handoff_unhonoured(self.pending_handoff, self.workflow_time)
            self.pending_handoff = None
        if self.inbox or self.early:
            self._flush_inbox(ended=True)
        yield Notify()
        # The ending's own event (expired, failed, handed off) and any still being retried:
        # bounded by their backoff, so a dead webhook never holds the run.
        yield Notified()
        yield Checkpoint(end=True)
        yield HandlersDone()


def _refusal(verdict: Verdict | None) -> Refusal | None:
    return verdict.refusal if verdict is not None else None


def _policies(verdict: Verdict | None) -> list[str] | None:
    return verdict.policies if verdict is not None else None
