"""Property tests over random delegation trees and parallel groups, driven through the real
engine (workflows/engine.py, the code the workflow runs): planners that propose anything (tools
outside a grant, delegations deeper than the policy allows, more steps than are left, writes in
a group), people who approve or let requests expire, tools that answer.

The world's part is played here, never the workflow's: each run's engine says what it does next
(``Engine.next``), including starting a child run (``RunChild``), and this driver answers it
(``Engine.on``); a child is another engine, driven the same way, whose outcome is its parent's
step result. Invariants, checked as the runs go:
- a grant never holds more than its parent: a subset of its tools and their effect classes, at
  most its remaining steps, one level deeper and within ``max_depth``, the same tenant and
  requester; the approval it lends is the parent's approval in force, for writes its plan named;
- the children one parallel group starts hold, together, at most the parent's remaining steps;
- a child calls only tools its grant gives;
- no write runs without an approval in force (a lent one only for a write the parent's approved
  plan named: the same tool and arguments);
- every unsafe write is sent at most once;
- a lent approval covers no more writes than the parent's plan named (each once);
- any run of the tree may be reset (its first execution run to its end or cut anywhere, a new
  one replaying its first K commands with their answers, each asked again the same, then going
  on): what the first did stays done, the effect ledger answers a key already written, a child
  started again is met as existing; the invariants above hold over both executions;
- a parent that meets its child existing (as a reset of it would: the child ran, or runs on)
  adopts it and never takes it as not applied: a delegate step whose child (or a run under it)
  may have written and did not complete, or still runs, ends ``unknown``.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import examples.billing.tools  # noqa: F401  (registers the billing tools)
from workflows.commands import Call, Checkpoint, End, Landed, Mint, Probe, Readings, RunChild, RunGroup, RunTool, Sleep, Wait
from workflows.contract import DELEGATE, ApprovalDecision, ToolEffect
from workflows.engine import Engine
from workflows.policy_file import Budgets, TenantPolicy
from workflows.run_state import RunData, RunOutcome, RunRequest
from workflows.states import TERMINAL, RunState
from workflows.run_model import ToolFailure
from workflows.wire import CHILD_EXISTS, PolicySnapshot, Proposal, ProposedStep, RecoverySource, Refusal, ToolOutcome, Verdict
from tests.helpers.delegation import CATALOG, START

S = RunState
TOOLS = [t.name for t in CATALOG.tools]
OK_RESULT = '{"refund_id": "R-1", "entry_id": "L-1", "email_id": "E-1"}'
STEPS = {
    "get_order": {"order_id": "A-1001"},
    "issue_refund": {"order_id": "A-1001", "amount_cents": 100, "reason": "r"},
    "post_ledger_entry": {"order_id": "A-1001", "amount_cents": -100, "memo": "m"},
    "send_email": {"to": "a@b.c", "subject": "s", "body": "b"},
}
MAX_COMMANDS = 400  # per run: a run that goes on longer is cut (nothing it did is unchecked)


def effect(tool: str) -> ToolEffect:
    info = CATALOG.get(tool)
    return info.effect if info else ToolEffect.UNSAFE


class Tree:
    """The world around a tree of runs: planners, approvers, tools and the children's engines."""

    def __init__(self, data: st.DataObject, max_depth: int) -> None:
        self.draw = data.draw
        self.max_depth = max_depth
        self.tenant = TenantPolicy(budgets=Budgets(max_depth=max_depth, max_parallel=3))
        self.sent: Counter[str] = Counter()
        self.runs = 0
        self.written: set[str] = set()  # the keys of the writes sent
        self.existing: set[str] = set()  # children a parent met as existing (a reset of it)
        self.running: set[str] = set()  # of them, those whose record says they run on
        self.lent: dict[str, dict[str, str]] = {}  # each child's writes under a lent approval, by key
        self.ended: dict[str, RunOutcome] = {}  # each child's outcome, by its workflow id
        self.skip_to: datetime | None = None  # the time the next answer lands at, when later
        self.ledger: set[str] = set()  # the effect ledger: keys whose write was sent (a reset's re-send meets it)
        self.signals: list[ApprovalDecision] = []  # the decisions delivered while answering the current command
        self.resets = 0

    def engine(self, request: RunRequest, workflow_id: str) -> Engine:
        data = RunData(catalog=CATALOG, policy=PolicySnapshot(tenant="default", policy=self.tenant, policy_hash="h", source="test"))
        counter = iter(range(10**6))  # derived ids (the workflow's derive from history): a reset asks the same
        engine = Engine(data, request, workflow_id=workflow_id, new_request_id=lambda: f"req-{workflow_id}-{next(counter)}",
                        started_at=START)
        engine.child_ids = request.grant is not None  # as the workflow sets it for a child this build starts
        return engine

    # ------------------------------------------------------------------ proposals

    def step(self, depth: int, among: list[str] | None = None) -> tuple[str, Any]:
        """A step: a tool (mostly one of ``among``, a delegation's tools) or a delegation."""
        kind = self.draw(st.sampled_from(["tool", "tool", "delegate"] if depth < 4 else ["tool"]))
        if kind == "tool":
            pool = [t for t in (among or []) if t in STEPS] if among and self.draw(st.integers(0, 4)) else sorted(STEPS)
            tool = self.draw(st.sampled_from(pool or sorted(STEPS)))
            return tool, dict(STEPS[tool])
        tools = self.draw(st.lists(st.sampled_from(TOOLS), min_size=1, max_size=4, unique=True))
        playbook = None
        if self.draw(st.integers(0, 3)):
            inner = [self.step(depth + 1, among=tools) for _ in range(self.draw(st.integers(1, 3)))]
            playbook = [{"delegate": args} if tool == DELEGATE else {"tool": tool, "args": args} for tool, args in inner]
        args: dict[str, Any] = {"goal": f"sub-task at depth {depth + 1}", "tools": tools, "max_steps": self.draw(st.integers(1, 12))}
        if playbook:
            args["playbook"] = playbook
        return DELEGATE, args

    def proposal(self, engine: Engine) -> Proposal:
        if engine.data.steps_executed and self.draw(st.booleans()):
            return Proposal(answer="done")
        named = [p for p in engine.request.playbook if p.tool] if engine.request.grant is not None else []
        if named and self.draw(st.booleans()):
            # The child's planner proposes what its parent named (as a playbook planner does),
            # sometimes after a lookup: the same writes in another plan (a reset asks it again).
            steps = [ProposedStep(tool=p.tool, args=p.args) for p in named]
            if "get_order" in engine.request.grant.tools and self.draw(st.booleans()):
                steps.insert(0, ProposedStep(tool="get_order", args=dict(STEPS["get_order"])))
            return Proposal(steps=steps)
        steps = [ProposedStep(tool=t, args=a) for t, a in (self.step(engine.depth()) for _ in range(self.draw(st.integers(1, 3))))]
        if len(steps) >= 2 and self.draw(st.booleans()):  # the first two as a parallel group
            steps[0] = steps[0].model_copy(update={"group": 1})
            steps[1] = steps[1].model_copy(update={"group": 1})
        return Proposal(steps=steps)

    # ------------------------------------------------------------------ invariants

    def check_grant(self, parent: Engine, command: RunChild) -> None:
        grant = command.request.grant
        allowed = set(parent.request.grant.tools) if parent.request.grant else set(TOOLS)
        assert set(grant.tools) <= allowed, f"a grant of {grant.tools} from a parent holding {sorted(allowed)}"
        assert set(grant.effects) <= {effect(t) for t in grant.tools}, "an effect class beyond the grant's tools"
        assert grant.max_steps <= parent.limits.max_steps - parent.data.steps_executed, "more steps than the parent has left"
        assert grant.depth == parent.depth() + 1 <= self.max_depth, "deeper than the policy allows"
        assert (grant.tenant, grant.requested_by) == (parent.request.tenant, parent.request.requested_by)
        assert command.request.limits.max_steps <= grant.max_steps
        if grant.approved:
            approval = parent.data.approval
            assert approval is not None and grant.approved == approval.approvals, "a lent approval not in force"
            step = next(s for s in parent.data.plan.steps if f"{parent.workflow_id}.{s.tool_call_id}" == command.child_id)
            named = [(s.get("tool"), s.get("args")) for s in step.args.get("playbook", [])]
            assert all((c.tool, c.args) in named for c in grant.covered), "a covered write the parent's plan did not name"

    def check_call(self, engine: Engine, tool: str, args: dict[str, Any], key: str) -> None:
        grant = engine.request.grant
        if grant is not None:
            assert tool in grant.tools, f"a child called {tool}, outside its grant {grant.tools}"
        if effect(tool) != ToolEffect.READ_ONLY:
            approval = engine.data.approval
            assert approval is not None and approval.approvals, f"a write of {tool} with no approval in force"
            if engine.lent_approval():
                assert (tool, args) in [(c.tool, c.args) for c in grant.covered], "a lent approval for a write it did not name"
                # Named once, covered once: the writes run under it (each once, retries aside)
                # are never more than its plan named, however many rounds propose them.
                lent = self.lent.setdefault(engine.workflow_id, {})
                lent[key] = json.dumps([tool, args], sort_keys=True)
                named = Counter(json.dumps([c.tool, c.args], sort_keys=True) for c in grant.covered)
                over = [w for w, n in Counter(lent.values()).items() if n > named[w]]
                assert not over, f"a lent approval covering more writes than it named: {over}"
        if key in self.ledger:  # sent before (a reset ran it again): the ledger answers, nothing is sent
            return
        if effect(tool) != ToolEffect.READ_ONLY:
            self.ledger.add(key)
        self.sent[key] += 1
        if effect(tool) != ToolEffect.READ_ONLY:
            self.written.add(key)
        if effect(tool) == ToolEffect.UNSAFE:
            assert self.sent[key] == 1, f"unsafe write {key} sent twice"

    # ------------------------------------------------------------------ driving

    def run(self, request: RunRequest, workflow_id: str) -> RunOutcome:
        """Drive one run to its end (its children too, as it starts them). Sometimes it is reset
        (as `temporal workflow reset` does): its first execution runs to its end, or is cut
        anywhere, and a new one replays its first K commands with the answers they had, then goes
        on with new ones; what the first execution did in the world stays done."""
        self.runs += 1
        log: list[tuple[Any, ...]] = []
        reset = self.draw(st.booleans())
        cut = self.draw(st.one_of(st.none(), st.integers(1, 80))) if reset else None
        e = self.drive(request, workflow_id, log, replay=[], cut=cut)
        if reset:
            self.resets += 1
            # Any task; often an early one (before its planning: the planner is asked again).
            point = self.draw(st.integers(0, len(log) if self.draw(st.booleans()) else min(len(log), 12)))
            e = self.drive(request, workflow_id, [], replay=log[:point], cut=None)
        self.check_adopted(e)
        outcome = e.outcome(workflow_id)
        outcome.steps = list(e.data.executed)  # as run_outcome fills them in
        return outcome

    def drive(self, request: RunRequest, workflow_id: str, log: list[tuple[Any, ...]], *,
              replay: list[tuple[Any, ...]], cut: int | None) -> Engine:
        """One execution: ``replay`` the commands of an earlier one (each must be asked again, the
        same; its answer and the decisions delivered with it given again), then new answers, until
        it ends or ``cut`` commands (a worker gone, the run reset meanwhile)."""
        e = self.engine(request, workflow_id)
        now = START
        e.start()
        ending = False
        for i in range(MAX_COMMANDS):
            if cut is not None and i >= cut and i >= len(replay):
                break
            now += timedelta(seconds=1)
            command = e.next(now)
            if i < len(replay):
                kind, key, answer, signals, now, at = replay[i]
                assert (type(command).__name__, getattr(getattr(command, "call", None), "idempotency_key", None)) == (kind, key), \
                    f"a reset's replay asked {command}, not the {kind} of its history"
                for decision in signals:
                    e.receive("approve", decision, e.at)
            if isinstance(command, End):
                log.append(("End", None, None, [], now, now))
                if ending:
                    break
                ending = True
                e.start(ending=True)
                continue
            if i >= len(replay):
                self.signals = []
                answer = self.answer(e, command)
                if self.skip_to is not None:  # nobody approved: time runs to the request's expiry
                    now, self.skip_to = max(now, self.skip_to), None
                signals, at = list(self.signals), now + timedelta(seconds=1)
            key = getattr(getattr(command, "call", None), "idempotency_key", None)
            log.append((type(command).__name__, key, answer, signals, now, at))
            e.on(command, answer, at)
        return e

    def child(self, e: Engine, command: RunChild) -> RunOutcome | ToolFailure:
        """The child's end; or, as for a parent reset after an earlier execution of it started the
        child: the child exists (it ran, or runs on), and the parent must adopt it, never start it
        again nor take it as not applied."""
        self.check_grant(e, command)
        if command.child_id in self.ended:  # a reset parent starts it again: the server says it exists
            self.existing.add(command.child_id)
            return ToolFailure(CHILD_EXISTS, "exists", True)
        self.ended[command.child_id] = self.run(command.request, command.child_id)
        mode = self.draw(st.sampled_from(["started", "started", "exists", "runs_on"]))
        if mode == "started":
            return self.ended[command.child_id]
        if mode == "runs_on":
            self.running.add(command.child_id)  # its record says it is still running
        self.existing.add(command.child_id)
        return ToolFailure(CHILD_EXISTS, "exists", True)

    def check_adopted(self, e: Engine) -> None:
        """A parent that met an existing child: never 'failed' (not applied) when that child
        wrote; a running one ends the step unknown and hands the parent off."""
        for step in e.data.executed:
            child = f"{e.workflow_id}.{step.tool_call_id}"
            if step.tool != DELEGATE or child not in self.existing:
                continue
            ended = self.ended[child]
            # A write sent by the child or any run under it (their ids start with the child's).
            wrote = any(key.startswith((f"{child}:", f"{child}.")) for key in self.written)
            if child in self.running or (ended.state != S.COMPLETED and wrote):
                assert step.outcome == "unknown", f"a child that may have written taken as {step.outcome}: {child}"

    def answer(self, e: Engine, command: Any) -> Any:
        if isinstance(command, Probe):
            return Readings(suggested=False, history_bytes=0, history_events=0, handlers_finished=True, notifying=0)
        if isinstance(command, Mint):
            return command.call
        if isinstance(command, Call):
            if command.name == "plan":
                return self.proposal(e)
            if command.name in ("policy_check_authority", "policy_check_decision", "policy_check_handoff"):
                return Verdict(policy_hash="h")
            if command.name == "recovery_source":  # a completed child's undos, as its record says
                if command.arg.run_id in self.running:
                    return RecoverySource(run_id=command.arg.run_id, refusal=Refusal(rule="still_running", message="running"))
                ended = self.ended[command.arg.run_id]
                return RecoverySource(run_id=ended.run_id, state=ended.state, compensations=ended.compensations)
            raise AssertionError(f"no answer to {command.name}")
        if isinstance(command, RunTool):
            self.check_call(e, command.call.tool, command.call.args, command.call.idempotency_key)
            return ToolOutcome(observation=OK_RESULT, digest="d", size=len(OK_RESULT))
        if isinstance(command, RunGroup):
            landed = []
            grants = [run.request.grant.max_steps for run in command.members if isinstance(run, RunChild)]
            left = e.limits.max_steps - e.data.steps_executed
            assert sum(grants) <= left, f"a group's children hold {sum(grants)} steps, over the {left} their parent has left"
            for i, run in enumerate(command.members):
                if isinstance(run, RunChild):  # a child run in the group: its grant checked as any
                    landed.append(Landed(i, self.child(e, run), START))
                    continue
                self.check_call(e, run.call.tool, run.call.args, run.call.idempotency_key)
                landed.append(Landed(i, ToolOutcome(observation=OK_RESULT, digest="d", size=len(OK_RESULT)), START))
            return landed
        if isinstance(command, RunChild):
            return self.child(e, command)
        if isinstance(command, Wait) and "inbox" in command.until and e.data.pending_approval is not None:
            pending = e.data.pending_approval
            if self.draw(st.integers(0, 4)) > 0:  # bob approves (else the wait runs out: expiry)
                decision = ApprovalDecision(decision_id=uuid.uuid4().hex, approver="bob", plan_hash=pending.plan_hash,
                                            request_id=pending.request_id)
                e.receive("approve", decision, e.at)
                self.signals.append(decision)
            else:
                self.skip_to = pending.expires_at
            return None
        assert isinstance(command, (Checkpoint, Sleep, Wait)) or type(command).__name__ in (
            "Show", "Publish", "Notify", "Notified", "HandlersDone"), f"no answer to {command}"
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), max_depth=st.integers(0, 3))
def test_random_delegation_trees_never_widen_a_grant_or_write_unapproved(data: st.DataObject, max_depth: int) -> None:
    tree = Tree(data, max_depth)
    outcome = tree.run(RunRequest(goal="g", requested_by="alice", limits={"max_steps": 12, "max_replans": 2}), "root")
    assert outcome.state in TERMINAL, f"the root did not end in {MAX_COMMANDS} commands: {outcome.state.value}"


class NamedWrites(Tree):
    """A root whose plan delegates named writes (the approval it lends names each), whose child's
    planner proposes them (sometimes after a lookup, or something else): with random resets of
    either run at any task, the lent approval covers each named write once."""

    def proposal(self, engine: Engine) -> Proposal:
        if engine.request.grant is None and not engine.data.steps_executed:
            writes = self.draw(st.lists(st.sampled_from(["issue_refund", "send_email", "post_ledger_entry"]), min_size=1, max_size=3))
            args = {"goal": "the named writes", "tools": sorted({*writes, "get_order"}), "max_steps": 6,
                    "playbook": [{"tool": w, "args": dict(STEPS[w])} for w in writes]}
            return Proposal(steps=[ProposedStep(tool=DELEGATE, args=args)])
        return super().proposal(engine)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), max_depth=st.integers(1, 3))
def test_a_lent_approval_covers_each_named_write_once_whatever_is_reset(data: st.DataObject, max_depth: int) -> None:
    tree = NamedWrites(data, max_depth)
    outcome = tree.run(RunRequest(goal="g", requested_by="alice", limits={"max_steps": 12, "max_replans": 2}), "root")
    assert outcome.state in TERMINAL, f"the root did not end in {MAX_COMMANDS} commands: {outcome.state.value}"
