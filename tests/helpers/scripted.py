"""One run's engine driven the way the workflow drives it, the world's part answered from a
script.

``AgentRun._drive`` (workflows/agent_run.py) asks ``Engine.next(now)`` for a command, carries it
out (workflows/effects.py) and hands the result back with ``Engine.on(command, result, now)``;
its signal and Update handlers reach the engine through ``receive`` and ``deciding``, and a
notification's answer through ``notification_done``. :class:`Scripted` does the same, with no
Temporal: the planner's proposals and the tools' answers come from lists, in order; a policy
check is judged as the policy activity words it (the pure approver rules of
``workflows.policy``, or a refusal the test names); checkpoints, publishing and probes are
answered at once; time passes only when the test says (``elapse``). What the run does, and
when, is the engine's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

import examples.billing.tools  # noqa: F401  (registers the billing tools)
from tether.tools.sdk import REGISTRY
from workflows import policy
from workflows.commands import (
    Call, Checkpoint, Command, ContinueAsNew, End, Mint, Notify, Probe, Readings, RunTool, Show, Sleep, Wait,
)
from workflows.contract import DecideResult
from workflows.engine import Engine
from workflows.policy_file import TenantPolicy
from workflows.run_model import Decision, DecisionKind, ToolFailure
from workflows.run_state import RunData, RunRequest
from workflows.states import TransitionRecord
from workflows.wire import (
    ApproverRoster, Notification, NotificationResult, PolicySnapshot, Proposal, Refusal, RunSetup, ToolOutcome, Verdict,
)

START = datetime(2026, 1, 1, tzinfo=timezone.utc)


class Scripted:
    """A run of ``alice``'s under ``tenant`` (the billing tools' catalog), started at START.

    ``proposals`` and ``tools``: what the planner and the tool calls answer, in order (more can
    be appended as the test goes). ``refusals``: decision id -> what the policy activity refuses
    that decision with. ``notes``: notifications the run started, not yet answered."""

    def __init__(
        self,
        tenant: TenantPolicy | None = None,
        *,
        proposals: Iterable[Proposal] = (),
        tools: Iterable[ToolOutcome | ToolFailure] = (),
        webhooks: dict[str, list[str]] | None = None,
        first_plan: bool = False,
        **limits: Any,
    ) -> None:
        # The run's setup; with ``first_plan`` it comes with the first planner answer, as a run
        # started by the server takes it (Planning._first_plan), else the run starts holding it.
        self.setup = RunSetup(
            catalog=REGISTRY.catalog(),
            policy=PolicySnapshot(tenant="default", policy=tenant or TenantPolicy(), policy_hash="h", source="test",
                                  webhooks=webhooks or {}),
        )
        data = RunData() if first_plan else RunData(catalog=self.setup.catalog, policy=self.setup.policy)
        request = RunRequest(goal="g", requested_by="alice", limits=limits)
        self.audit: list[TransitionRecord] = []  # records written since the last checkpoint
        self.engine = Engine(data, request, workflow_id="wf", on_record=self.audit.append,
                             new_request_id=lambda: uuid.uuid4().hex, started_at=START,
                             first_run_id="run-1" if first_plan else "")
        self.now = START
        self.proposals = list(proposals)
        self.tools = list(tools)
        self.refusals: dict[str, Refusal] = {}
        self.rosters: list[ApproverRoster] | None = None  # what a planning-time check's roster says
        self.notes: list[Notification] = []
        self.commands: list[Command] = []  # every command the engine gave, in order
        self.command: Command | None = None  # the one under way, not answered yet
        self.since = START  # when the command under way was given
        self.ending = False
        self.ended = False
        self.engine.start()
        self.go()

    # ------------------------------------------------------------------ the run's loop

    def go(self, until: Callable[[Command], bool] | None = None) -> Command | None:
        """Answer every command the world answers at once, as the workflow's loop does (and its
        ending, once the program ends); stop at one that waits on the world (the planner or a
        tool with nothing scripted, a wait or a sleep whose time has not come), at the first one
        ``until`` picks (unanswered), or at the end. Returns the command it stopped at."""
        while not self.ended:
            if self.command is None:
                self.command = self.engine.next(self.now)
                self.commands.append(self.command)
                self.since = self.now
            command = self.command
            if isinstance(command, End):
                self.command = None
                if self.ending:
                    self.ended = True
                    break
                self.ending = True  # as the workflow does once its program returns: the ending
                self.engine.start(ending=True)
                continue
            if until is not None and until(command):
                return command
            answered, result = self._answer(command)
            if not answered:
                return command
            self._respond(result)
        return None

    def _respond(self, result: Any) -> None:
        command, self.command = self.command, None
        assert command is not None
        self.engine.on(command, result, self.now)

    def _answer(self, command: Command) -> tuple[bool, Any]:
        engine = self.engine
        if isinstance(command, (Checkpoint, Show, Notify)) or (isinstance(command, Call) and command.show):
            self.notes += engine.take_notifications()  # Effects.show / notify: started, not awaited
        if isinstance(command, Checkpoint):
            self.audit.clear()  # every record to the sink
        match command:
            case Call(name="plan"):
                if not self.proposals:
                    return False, None
                proposal = self.proposals.pop(0)
                return True, proposal.model_copy(update={"setup": self.setup}) if command.arg.setup else proposal
            case Call(name="policy_check_authority") | Call(name="policy_check_handoff"):
                # A check that asks for the roster gets ``rosters`` (None: the snapshot's again).
                asked = getattr(command.arg, "roster", False)
                return True, Verdict(policy_hash="h", rosters=self.rosters if asked else None)
            case Call(name="policy_check_decision"):
                check = command.arg
                refusal = self.refusals.pop(check.decision.decision_id, None) or policy.approver_refusal(
                    engine.tenant, approver=check.decision.approver, requested_by=check.requested_by,
                    kind=check.kind, roles=check.roles, already_approved=check.already_approved, editors=check.editors,
                )
                return True, Verdict(refusal=refusal, policy_hash="h")
            case Call() | ContinueAsNew():
                raise AssertionError(f"the script has no answer to {command}")
            case RunTool():
                return (True, self.tools.pop(0)) if self.tools else (False, None)
            case Mint():  # as Effects.mint, less the capability: the call carries a roster's decision
                return True, command.call if command.judge is None else command.call.model_copy(update={"judge": command.judge})
            case Probe():
                return True, Readings(suggested=False, history_bytes=0, history_events=0,
                                      handlers_finished=not engine.verdicts, notifying=len(self.notes))
            case Wait():
                until = command.until
                woken = (("inbox" in until and bool(engine.inbox))
                         or ("handoff" in until and engine.pending_handoff is not None)
                         or ("audit" in until and bool(self.audit)))
                return woken, None
            case Sleep():
                return False, None
        return True, None  # checkpoints, publishing, notifications: nothing the engine reads back

    # ------------------------------------------------------------------ the world

    def wait_ends(self) -> tuple[datetime, str]:
        """When the wait under way ends by its timer, and what for."""
        command = self.command
        assert isinstance(command, (Wait, Sleep)), f"the run is not waiting: {command}"
        return self.since + timedelta(seconds=command.seconds), command.summary

    def elapse(self, to: datetime) -> None:
        """Time passes to ``to``: the wait under way ends if its timer has run out by then (a
        worker that was away wakes at ``to``, late), and the run goes on."""
        ends, _ = self.wait_ends()
        assert to >= self.now
        self.now = to
        if to >= ends:
            self._respond(None)
            self.go()

    def signal(self, kind: DecisionKind, decision: Decision) -> None:
        """A decision as a signal (the approve, reject and revise handlers)."""
        self.engine.receive(kind, decision, self.now)
        self.go()

    def decide(self, kind: DecisionKind, decision: Decision, until: Callable[[Command], bool] | None = None) -> DecideResult:
        """A decision as the decide Update: its verdict, once the run has given it (``until``:
        the run stops there, as ``go``)."""
        answered = self.engine.deciding(kind, decision, self.now)
        if answered is not None:
            return answered
        self.go(until)
        assert self.engine.verdicts.get(decision.decision_id) is not None, "the run gave the decision no verdict"
        return self.engine.take_verdict(decision.decision_id)

    def deliver(self, result: NotificationResult) -> Notification:
        """The oldest notification in flight comes back with ``result`` (Effects._deliver)."""
        note = self.notes.pop(0)
        self.engine.notification_done(note, result, self.now)
        self.go()
        return note
