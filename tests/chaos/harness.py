"""Real processes for the chaos and restart suites: a dev server (SQLite file), the billing
service with ``--delay-ms``, and worker subprocesses that are SIGKILLed at the dangerous points
of a tool call. Used by ``tests/chaos/test_chaos.py`` (a small deterministic subset) and by
``python -m tests.chaos.run_chaos`` (the long randomized version); both run ``kill_round``
(worker SIGKILLs) and ``effect_round`` (slow attempts, cancels, retries that run out).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.contrib.pydantic import pydantic_data_converter

from examples.devstack import dev_server_command
from tether.client import run_outcome, start_run, timed_out
from tests.helpers.ports import free_port
from tests.chaos.markers import gate_name, marker_name
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for
from tests.helpers.invariants import check_timeline, tools_by_call
from workflows.run_state import RunOutcome, RunRequest, RunSnapshot
from workflows.states import RunState, TransitionRecord

ROOT = Path(__file__).resolve().parents[2]
S = RunState

# Effect class -> (chaos tool, its arguments). Names match tests/chaos/chaos_tools.py, which
# only worker subprocesses import. The reconcilable tool writes where no UNIQUE key dedupes
# (the ledger's would turn a racing retry into a 409): two effects would show as two.
TOOLS = {
    "idempotent": ("chaos_refund", {"order_id": "A-1002", "amount_cents": 1, "reason": "chaos"}),
    "reconcilable": ("chaos_note", {"to": "ledger@example.com", "subject": "chaos", "body": "chaos"}),
    "unsafe": ("chaos_email", {"to": "grace@example.com", "subject": "chaos", "body": "chaos"}),
}
EFFECTS = tuple(TOOLS)
POINTS = ("before", "during", "after")
# effect_round's scenarios and their variants:
# - slow: attempt 1 commits 0.2 s ("within" the grace period) or 2 s ("past" it) after its deadline;
# - cancel: the run is cancelled with its tool held before the call, during it (committed, the
#   response delayed), after it, or after it with the worker SIGKILLed right after the cancel;
# - exhaust: every write's response is lost, so the idempotent tool's two retries run out.
SCENARIOS = {
    "slow": ("within", "past"),
    "cancel": ("before", "during", "after", "after+kill"),
    "exhaust": ("lost",),
}
# The slow rounds' tools time out after SLOW_TOOL_TIMEOUT s (grace 5 s): "past" commits after
# the whole grace period. The activity reports the tool still running at half the grace period,
# and that report must reach the server before its start_to_close (the other half): 2.5 s of
# room for a loaded machine rather than the 0.75 s a 3 s tool leaves.
SLOW_TOOL_TIMEOUT = 10.0
SLOW_SECONDS = {"within": 0.2, "past": 6.0}
# The cancel rounds' holds end by the cancel reaching the tool (with a heartbeat, every 0.8 x
# 15 s at most), never by the attempt's deadline: the tool's timeout is far beyond that.
CANCEL_TOOL_TIMEOUT = 30.0
# A kill held at a checkpoint: the held attempt must still be inside its deadline when released
# (a call past it is not sent), however long a loaded machine takes to bring every call of the
# round there; a dead worker is then noticed at the heartbeat timeout (15 s), not the 3 s tool's 2 s.
HELD_TOOL_TIMEOUT = 30.0
EXHAUST_TOOLS = {"idempotent": "chaos_refund_short"}
# Billing delay: every write's response waits this long after its commit. "During" holds the
# response itself (the service's --gate-dir, CHAOS_HOLD=during) until the harness releases it.
BILLING_DELAY_MS = 1000


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_PROXY": "127.0.0.1,localhost"}
    env.update(extra)
    return env


class Proc:
    """A subprocess with its output in a log file; we only ever signal the pid we spawned."""

    def __init__(self, name: str, cmd: Sequence[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self._log = open(log, "ab")
        self.popen = subprocess.Popen(
            list(cmd), stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_for_output(self, text: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {text!r} after {timeout:g}s:\n{self.output()[-3000:]}")
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, no goodbye to the server."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)
        self._log.close()

    def stop(self, timeout: float = 20.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.send_signal(signal.SIGKILL)
                self.popen.wait(timeout=30)
        self._log.close()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class DevServer:
    """``temporal server start-dev`` on free ports with a SQLite file: survives a restart."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.db = workdir / "temporal.db"
        self.port, self.ui_port = free_port(), free_port()
        self.proc: Proc | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        cmd = dev_server_command(self.port, self.ui_port, self.db) + ["--headless"]
        self.proc = Proc("dev-server", cmd, self.workdir / "dev-server.log", _env())
        deadline = time.monotonic() + 60
        while True:
            try:
                client = await self.client()
                await client.count_workflows()
                return
            except Exception:
                if not self.proc.alive:
                    raise RuntimeError(f"dev server exited:\n{self.proc.output()[-3000:]}") from None
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def client(self) -> Client:
        return await Client.connect(self.address, data_converter=pydantic_data_converter)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class BillingProc(Billing):
    """The billing service as a subprocess (``--delay-ms``), with conftest's HTTP helpers."""

    def __init__(self, workdir: Path, delay_ms: int = BILLING_DELAY_MS) -> None:
        port = free_port()
        super().__init__(url=f"http://127.0.0.1:{port}", db=workdir / "billing.db")
        cmd = [sys.executable, "-m", "examples.billing.service", "--port", str(port),
               "--db", str(self.db), "--delay-ms", str(delay_ms), "--gate-dir", str(workdir)]
        self.proc = Proc("billing", cmd, workdir / "billing.log", _env())

    async def ready(self) -> BillingProc:
        await self.proc.wait_for_output("listening")
        return self

    def effects(self, effect: str, key: str) -> int:
        """How many effects the service holds for one idempotency key."""
        if effect == "idempotent":
            return len(self.refunds(key))
        return len(self.get(f"/emails?request_ref={key}")["emails"])

    def stop(self) -> None:
        self.proc.stop()


def start_worker(
    address: str,
    billing_url: str,
    queue: str,
    chaos_dir: Path,
    hold: str = "",
    tool_timeout: float | None = None,
    **faults: str,
) -> Proc:
    """``faults``: CHAOS_SLOW / CHAOS_LOSE_RESPONSE for the chaos tools (chaos_tools.py)."""
    cmd = [sys.executable, "worker.py", "--tools", "tests.chaos.chaos_tools", "--task-queue", queue]
    from tether.store.keys import KEY_SETTING, genkey

    if not os.environ.get(KEY_SETTING):
        # The workers of a chaos run share one key ring (a worker never creates one).
        faults.setdefault(KEY_SETTING, str(chaos_dir / "state.key"))
        genkey(Path(faults[KEY_SETTING]), if_missing=True)
    env = _env(TEMPORAL_ADDRESS=address, BILLING_URL=billing_url, CHAOS_DIR=str(chaos_dir), CHAOS_HOLD=hold,
               CHAOS_TOOL_TIMEOUT=str(tool_timeout or ""), **faults)
    return Proc(f"worker {queue}", cmd, chaos_dir / f"worker-{uuid.uuid4().hex[:6]}.log", env)


# ----------------------------------------------------------------------------- one kill round


@dataclass
class Stack:
    """A stack of real processes per test module (the ``stack`` fixture, tests/chaos/conftest.py):
    a dev server on a SQLite file and the billing service, in a folder of their own."""

    server: DevServer
    billing: BillingProc
    workdir: Path
    client: Client


@dataclass
class RunResult:
    effect: str
    run_id: str
    key: str
    point: str  # where the first kill caught the tool call: not_started/before/during/after/done
    state: RunState
    effects: int
    attempts: int  # tool attempts that reached the "before" checkpoint
    reason: str
    tool_call_id: str
    held: bool  # the kill point was held deterministically (else: a random moment)
    tool_completed: bool  # the server recorded a completed execute_tool activity
    outcome: str | None = None  # the effect outcome the run recorded for its step (refs.outcome)
    step_started: bool = False  # the run reached EXECUTING_TOOL
    scenario: str = "kill"  # kill, or an effect_round scenario
    variant: str = ""  # the scenario's variant (SCENARIOS)


async def _tool_completions(handle: WorkflowHandle) -> list[float]:
    """Event times (epoch seconds) of the run's completed ``execute_tool`` activities."""
    history = await handle.fetch_history()
    scheduled, done = {}, []
    for event in history.events:
        if event.HasField("activity_task_scheduled_event_attributes"):
            scheduled[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        elif event.HasField("activity_task_completed_event_attributes"):
            attrs = event.activity_task_completed_event_attributes
            if scheduled.get(attrs.scheduled_event_id) == "execute_tool":
                done.append(event.event_time.ToDatetime().timestamp())
    return done


@dataclass
class Round:
    results: list[RunResult] = field(default_factory=list)
    kills: int = 0
    trace: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, label: str) -> None:
        self.trace.append((label, time.monotonic()))


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def _wait(cond, timeout: float, what: str, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g}s for {what}")
        await asyncio.sleep(step)


async def _await_state(handle: WorkflowHandle, states: set[RunState], timeout: float) -> RunSnapshot:
    deadline = time.monotonic() + timeout
    while True:
        try:
            snap = await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=timedelta(seconds=10))
        except RPCError as e:
            # A worker still starting (many at once on a loaded machine) has not answered yet,
            # or its first workflow task timed out and Temporal retries it (WorkflowNotReady).
            not_yet = timed_out(e) or e.status == RPCStatusCode.FAILED_PRECONDITION
            if not not_yet or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
            continue
        if snap.state in states:
            return snap
        if time.monotonic() > deadline:
            raise TimeoutError(f"{handle.id} is {snap.state.value}, waited for {sorted(s.value for s in states)}")
        await asyncio.sleep(0.05)


def _marker(chaos_dir: Path, key: str, attempt: int, point: str) -> Path:
    return chaos_dir / marker_name(key, attempt, point)


async def _start_approved(
    client: Client, queue: str, effects: Sequence[str], runs_per_effect: int, tools: dict[str, str] | None = None
) -> tuple[list[tuple[str, WorkflowHandle]], dict[str, tuple[str, str]]]:
    """Start runs of one write tool each and approve them. Returns (effect, handle) pairs and
    run id -> (idempotency key, tool call id)."""
    runs: list[tuple[str, WorkflowHandle]] = []
    for effect in effects:
        tool, args = TOOLS[effect]
        tool = (tools or {}).get(effect, tool)
        for _ in range(runs_per_effect):
            request = RunRequest(goal=f"chaos {effect}", requested_by="alice", playbook=[{"tool": tool, "args": args}])
            handle = await _start(client, request, _unique(f"chaos-{effect}"), queue)
            runs.append((effect, handle))
    keys: dict[str, tuple[str, str]] = {}
    snaps = await asyncio.gather(*(_await_state(handle, {S.AWAITING_APPROVAL}, 180) for _, handle in runs))
    for (_, handle), snap in zip(runs, snaps):
        assert snap.plan is not None
        tool_call_id = snap.plan.steps[0].tool_call_id
        keys[handle.id] = (f"{handle.id}:{tool_call_id}", tool_call_id)
    # All approved at once, after every run waits: the tools' clocks start together, never
    # while the harness still looks at another run (a held tool must outlast the harness's turn).
    await asyncio.gather(*(handle.signal("approve", approval_for(snap, "chaos-bob")) for (_, handle), snap in zip(runs, snaps)))
    return runs, keys


async def _start(client: Client, request: RunRequest, run_id: str, queue: str) -> WorkflowHandle:
    """Start a run, again if the server failed the call (an overloaded SQLite dev server times
    out its own persistence calls and answers NOT_FOUND or UNAVAILABLE): the run's id makes a
    second start of one that did begin a refusal, which is as good as a start here."""
    from tether.client import TetherError

    for attempt in range(10):
        try:
            return await start_run(client, request, run_id=run_id, queue=queue)
        except TetherError as e:
            if "already exists" in str(e) and attempt > 0:
                return client.get_workflow_handle(run_id, result_type=RunOutcome)
            if attempt == 9 or not ("unknown run" in str(e) or "unreachable" in str(e)):
                raise
            await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


def _release(chaos_dir: Path, key: str, attempt: int = 1) -> None:
    """Let the billing service answer this call's held write (CHAOS_HOLD=during)."""
    (chaos_dir / gate_name(key, attempt)).touch()


def _attempts(chaos_dir: Path, key: str) -> int:
    """Tool attempts that reached the "before" checkpoint."""
    return sum(1 for a in range(1, 20) if _marker(chaos_dir, key, a, "before").exists())


def recorded_outcome(timeline: list[TransitionRecord], tool_call_id: str) -> str | None:
    """The effect outcome the run's latest record for this tool call names, if any."""
    found = [r.refs.outcome for r in timeline if r.refs.tool_call_id == tool_call_id and r.refs.outcome]
    return found[-1] if found else None


async def _ended(client: Client, run_id: str) -> tuple[RunState, list[TransitionRecord]]:
    """Wait for a run to end; its state and timeline (a cancelled run has no result: query it)."""
    handle = client.get_workflow_handle(run_id, result_type=RunOutcome)
    outcome: RunOutcome | None = None
    deadline = time.monotonic() + 300
    while True:
        # The ended run is read back with queries, which a worker answers by replaying it: on a
        # loaded machine one can time out, and is asked again (bounded only against a hang).
        try:
            try:
                outcome = await asyncio.wait_for(run_outcome(handle), 120)
                timeline = outcome.timeline
                if outcome.state == RunState.CANCELLED:
                    outcome = None  # read back without steps
            except WorkflowFailureError:
                timeline = await handle.query("timeline", result_type=list[TransitionRecord],
                                              rpc_timeout=timedelta(seconds=10))
            break
        except RPCError as e:
            if not (timed_out(e) or e.status == RPCStatusCode.FAILED_PRECONDITION) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    check_timeline(timeline, tools_by_call(outcome))
    return timeline[-1].to_state, timeline


async def kill_round(
    client: Client,
    address: str,
    billing: BillingProc,
    workdir: Path,
    *,
    point: str | None,
    effects: Sequence[str] = EFFECTS,
    runs_per_effect: int = 1,
    extra_kills: int = 0,
    rng: random.Random | None = None,
) -> Round:
    """Start runs of one write tool each, approve them, SIGKILL their worker with every tool call
    at ``point`` (``None``: at a random moment), restart the worker (``extra_kills`` more times at
    random moments), and return how each run ended and what the billing service holds."""
    rng = rng or random.Random()
    chaos_dir = workdir / _unique("round")
    chaos_dir.mkdir(parents=True)
    queue = _unique("chaos-q")
    hold = {"before": "before", "during": "before,during", "after": "after"}.get(point or "", "")
    timeout = HELD_TOOL_TIMEOUT if point is not None else None
    worker = start_worker(address, billing.url, queue, chaos_dir, hold, timeout)
    round_ = Round()
    round_.mark("start")
    try:
        await worker.wait_for_output("worker ready")
        round_.mark("worker ready")
        runs, keys = await _start_approved(client, queue, effects, runs_per_effect)
        round_.mark("approved")

        if point is None:
            await asyncio.sleep(rng.uniform(0.0, 2.5))
        else:
            checkpoint = "after" if point == "after" else "before"
            await _wait(
                lambda: all(_marker(chaos_dir, k, 1, checkpoint).exists() for k, _ in keys.values()),
                60, f"every tool call at its {checkpoint!r} checkpoint",
            )
            if point == "during":
                (chaos_dir / "release-before").touch()
                by_run = {h.id: e for e, h in runs}
                await _wait(
                    lambda: all(billing.effects(by_run[rid], k) >= 1 for rid, (k, _) in keys.items()),
                    30, "every effect committed (its response is delayed)", step=0.05,
                )
        round_.mark("kill")
        killed_at = time.time()
        worker.kill()
        round_.kills += 1
        for key, _ in keys.values():
            _release(chaos_dir, key)  # the held responses go to a dead worker

        # Where did the kill catch each call?
        points: dict[str, str] = {}
        for effect, handle in runs:
            key, _ = keys[handle.id]
            committed = billing.effects(effect, key) >= 1
            if _marker(chaos_dir, key, 1, "after").exists():
                points[handle.id] = "after"
            elif committed:
                points[handle.id] = "during"
            elif _marker(chaos_dir, key, 1, "before").exists():
                points[handle.id] = "before"
            else:
                points[handle.id] = "not_started"
        if point is not None:
            assert set(points.values()) == {point}, f"kill meant for {point!r} landed at {points}"

        for _ in range(extra_kills):
            worker = start_worker(address, billing.url, queue, chaos_dir, tool_timeout=timeout)
            await worker.wait_for_output("worker ready")
            await asyncio.sleep(rng.uniform(0.2, 3.0))
            worker.kill()
            round_.kills += 1
        worker = start_worker(address, billing.url, queue, chaos_dir, tool_timeout=timeout)
        await worker.wait_for_output("worker ready")
        round_.mark("restarted")

        for effect, handle in runs:
            key, tool_call_id = keys[handle.id]
            state, timeline = await _ended(client, handle.id)
            completions = await _tool_completions(handle)
            if completions and min(completions) < killed_at:
                points[handle.id] = "done"  # a random kill that came after the call completed
            round_.results.append(
                _result(effect, handle.id, key, tool_call_id, state, timeline, billing, chaos_dir,
                        point=points[handle.id], held=point is not None, tool_completed=bool(completions))
            )
            round_.mark(f"{effect} done")
    finally:
        worker.stop()
    return round_


def _result(
    effect: str, run_id: str, key: str, tool_call_id: str, state: RunState, timeline: list[TransitionRecord],
    billing: BillingProc, chaos_dir: Path, **fields: object,
) -> RunResult:
    return RunResult(
        effect=effect, run_id=run_id, key=key, state=state, effects=billing.effects(effect, key),
        attempts=_attempts(chaos_dir, key), reason=timeline[-1].reason, tool_call_id=tool_call_id,
        outcome=recorded_outcome(timeline, tool_call_id),
        step_started=any(r.to_state == S.EXECUTING_TOOL for r in timeline if r.kind == "transition"),
        **fields,  # type: ignore[arg-type]
    )


async def effect_round(
    client: Client,
    address: str,
    billing: BillingProc,
    workdir: Path,
    *,
    scenario: str,
    variant: str,
    effects: Sequence[str] = EFFECTS,
    runs_per_effect: int = 1,
) -> Round:
    """One round of a fault of the attempt itself (SCENARIOS): slow attempts, a cancel while the
    tool runs (with a SIGKILL after it for ``after+kill``), or retries that run out."""
    assert variant in SCENARIOS[scenario], (scenario, variant)
    chaos_dir = workdir / _unique(f"{scenario}-{variant}")
    chaos_dir.mkdir(parents=True)
    queue = _unique("chaos-q")
    faults: dict[str, str] = {}
    hold = ""
    tool_timeout = None
    if scenario == "slow":
        faults["CHAOS_SLOW"] = str(SLOW_SECONDS[variant])
        tool_timeout = SLOW_TOOL_TIMEOUT
    elif scenario == "exhaust":
        faults["CHAOS_LOSE_RESPONSE"] = "1"
    else:
        hold = variant.split("+")[0]
        tool_timeout = CANCEL_TOOL_TIMEOUT
    worker = start_worker(address, billing.url, queue, chaos_dir, hold, tool_timeout, **faults)
    round_ = Round()
    try:
        await worker.wait_for_output("worker ready")
        runs, keys = await _start_approved(
            client, queue, effects, runs_per_effect, EXHAUST_TOOLS if scenario == "exhaust" else None
        )
        if scenario == "cancel":

            async def cancel(effect: str, handle: WorkflowHandle) -> None:
                key = keys[handle.id][0]
                if variant == "during":
                    await _wait(lambda: billing.effects(effect, key) >= 1, 60,
                                "the effect committed (its response held)", step=0.05)
                else:
                    await _wait(lambda: _marker(chaos_dir, key, 1, hold).exists(), 60,
                                f"the tool call at its {hold!r} checkpoint")
                await handle.cancel(reason="chaos cancel")
                # The cancel is on the run's history: only now may its held response arrive.
                _release(chaos_dir, key)

            await asyncio.gather(*(cancel(effect, handle) for effect, handle in runs))
            if variant == "after+kill":
                worker.kill()
                round_.kills += 1
                worker = start_worker(address, billing.url, queue, chaos_dir, tool_timeout=tool_timeout)
                await worker.wait_for_output("worker ready")
        for effect, handle in runs:
            key, tool_call_id = keys[handle.id]
            state, timeline = await _ended(client, handle.id)
            if scenario == "slow" and _attempts(chaos_dir, key):
                # The slow attempt commits after the run may have ended: count it once it has.
                await _wait(lambda: _marker(chaos_dir, key, 1, "after").exists(), 30, "the slow attempt's commit")
            round_.results.append(
                _result(effect, handle.id, key, tool_call_id, state, timeline, billing, chaos_dir,
                        point=scenario, held=False, tool_completed=bool(await _tool_completions(handle)),
                        scenario=scenario, variant=variant)
            )
    finally:
        worker.stop()
    return round_


def check_result(r: RunResult) -> None:
    """The chaos contract for one run (see tests/chaos/test_chaos.py)."""
    # Exactly once: never two effects under one key; an unsafe tool never called twice.
    assert r.effects <= 1, f"{r.effect} key {r.key}: {r.effects} effects"
    if r.effect == "unsafe":
        assert r.attempts <= 1, f"unsafe tool called twice: {r}"
    # Every step that started ends with its outcome on the record, and the outcome is true:
    # ok = applied, failed = not applied, unknown = may have applied (and then a human decides
    # or the operator who cancelled sees it).
    if r.step_started:
        assert r.outcome in ("ok", "failed", "unknown"), f"step ended without an outcome: {r}"
    if r.outcome == "ok":
        assert r.effects == 1, f"outcome ok but {r.effects} effects: {r}"
    elif r.outcome == "failed":
        assert r.effects == 0, f"outcome failed but the effect exists: {r}"
    elif r.outcome == "unknown":
        assert r.state in (S.HANDED_OFF, S.CANCELLED), f"outcome unknown ended {r.state.value}: {r}"
        assert r.tool_call_id in r.reason and "outcome unknown" in r.reason, r.reason
    if r.scenario == "cancel":
        assert r.state == S.CANCELLED, r
        if r.variant in ("during", "after"):
            # The cancel waited for the call: the email went out and the record says so.
            assert r.outcome == "ok", r
        elif r.variant == "before":
            assert r.outcome == "failed" and r.effects == 0, r
        return
    if r.scenario == "slow":
        # Within the grace period the late result counts; past it the attempt is not over,
        # so nothing retries and a human decides. Either way: one effect.
        assert r.effects == 1, r
        if r.variant == "past":
            assert r.state == S.HANDED_OFF and r.outcome == "unknown" and r.attempts == 1, r
        else:
            assert (r.state, r.outcome) in ((S.COMPLETED, "ok"), (S.HANDED_OFF, "unknown")), r
        return
    if r.scenario == "exhaust":
        # Every response lost: the reconcilable retry finds its effect; the others end unknown.
        assert r.effects == 1, r
        expected = S.COMPLETED if r.effect == "reconcilable" else S.HANDED_OFF
        assert r.state == expected, r
        return
    if r.effect in ("idempotent", "reconcilable"):
        assert r.state == S.COMPLETED, f"{r.effect} run {r.run_id} ended {r.state.value}: {r.reason}"
        assert r.effects == 1, f"{r.effect} key {r.key}: {r.effects} effects"
    else:
        if r.held:
            # Killed while held at the point: the activity cannot have completed.
            assert not r.tool_completed, r
        if not r.tool_completed:
            # The call's outcome never reached Temporal: unknown, so a human decides.
            assert r.state == S.HANDED_OFF, f"unsafe run with unknown outcome ended {r.state.value}: {r}"
        assert r.state in (S.COMPLETED, S.HANDED_OFF), r
        if r.state == S.HANDED_OFF:
            assert r.outcome == "unknown", r
        else:
            assert r.tool_completed and r.effects == 1, r


# ----------------------------------------------------------------------------- compensation round

# A refund and a ledger entry that declare their undo, then an email refused for good: with
# on_failure=compensate the run reverses the entry, then voids the refund.
COMPENSATION_PLAN = [
    {"tool": "chaos_refund_undoable", "args": {"order_id": "A-1002", "amount_cents": 1, "reason": "chaos"}},
    {"tool": "chaos_ledger_undoable", "args": {"order_id": "A-1002", "amount_cents": -1, "memo": "chaos"}},
    {"tool": "chaos_email_refused", "args": {"to": "grace@example.com", "subject": "chaos", "body": "chaos"}},
]


@dataclass
class CompensationResult:
    run_id: str
    point: str  # where the kill caught the first compensation (or "random")
    state: RunState
    refunds: int  # refunds under the run's refund key
    voided: bool
    reversals: int  # reversing entries of the run's ledger entry
    undo_records: dict[str, int]  # undo tool call id -> records saying it succeeded
    reason: str
    retried: bool = False  # the killed compensation's attempt was lost and retried (on the record)


async def compensation_round(
    client: Client, address: str, billing: BillingProc, workdir: Path, *, point: str | None,
    rng: random.Random | None = None,
) -> CompensationResult:
    """SIGKILL the worker while the run puts things back: held at ``point`` of its first
    compensation (the ledger reversal; ``None``: at a random moment after the approval), then
    restart it and check every write was undone exactly once."""
    rng = rng or random.Random()
    chaos_dir = workdir / _unique("undo")
    chaos_dir.mkdir(parents=True)
    queue = _unique("chaos-q")
    hold = {"before": "before", "during": "before,during", "after": "after"}.get(point or "", "")
    timeout = HELD_TOOL_TIMEOUT if point is not None else None
    worker = start_worker(address, billing.url, queue, chaos_dir, hold, timeout, CHAOS_HOLD_UNDO_ONLY="1")
    try:
        await worker.wait_for_output("worker ready")
        request = RunRequest(goal="chaos undo", requested_by="alice", playbook=COMPENSATION_PLAN, on_failure="compensate")
        handle = await _start(client, request, _unique("chaos-undo"), queue)
        snap = await _await_state(handle, {S.AWAITING_APPROVAL}, 180)
        refund_tc, ledger_tc = snap.plan.steps[0].tool_call_id, snap.plan.steps[1].tool_call_id
        await handle.signal("approve", approval_for(snap, "chaos-bob"))
        undo_key = f"{handle.id}:{ledger_tc}:undo"
        if point is None:
            await asyncio.sleep(rng.uniform(0.0, 3.0))
        else:
            checkpoint = "after" if point == "after" else "before"
            await _wait(lambda: _marker(chaos_dir, undo_key, 1, checkpoint).exists(), 60, f"the undo at {checkpoint!r}")
            if point == "during":
                entry = billing.get(f"/ledger?key={handle.id}:{ledger_tc}")["entries"][0]
                (chaos_dir / "release-before").touch()
                await _wait(lambda: billing.get(f"/ledger?reverses={entry['entry_id']}")["entries"], 30,
                            "the reversal committed (its response held)", step=0.05)
        worker.kill()
        _release(chaos_dir, undo_key)
        worker = start_worker(address, billing.url, queue, chaos_dir, tool_timeout=timeout)
        await worker.wait_for_output("worker ready")
        state, timeline = await _ended(client, handle.id)
        refunds = billing.refunds(f"{handle.id}:{refund_tc}")
        entries = billing.get(f"/ledger?key={handle.id}:{ledger_tc}")["entries"]
        reversals = billing.get(f"/ledger?reverses={entries[0]['entry_id']}")["entries"] if entries else []
        undo_records: dict[str, int] = {}
        for r in timeline:
            if r.from_state == S.COMPENSATING and r.refs.outcome == "ok" and (r.refs.tool_call_id or "").endswith(":undo"):
                undo_records[r.refs.tool_call_id] = undo_records.get(r.refs.tool_call_id, 0) + 1
        return CompensationResult(
            run_id=handle.id, point=point or "random", state=state, refunds=len(refunds),
            voided=bool(refunds) and refunds[0]["voided_at"] is not None, reversals=len(reversals),
            undo_records=undo_records, reason=timeline[-1].reason,
            retried=any(r.from_state == r.to_state == S.COMPENSATING and r.refs.outcome == "unknown"
                        and r.refs.tool_call_id == f"{ledger_tc}:undo" for r in timeline),
        )
    finally:
        worker.stop()


@dataclass
class TwiceResult:
    run_id: str
    states: list[RunState]  # the compensation runs', in start order; the last one after the kill
    refunds: int
    voided: bool
    reversals: int
    reversal_calls: int  # attempts of the reversal that reached its "before" checkpoint
    reasons: list[str]


async def compensation_twice_round(client: Client, address: str, billing: BillingProc, workdir: Path) -> TwiceResult:
    """Recovery started twice, a SIGKILL and a third start in the mix (issue 31): a run that
    kept its writes (on_failure=stop), two compensation runs of it started at once under ids a
    client chose; the worker is SIGKILLed with the ledger reversal held before its call; the
    restarted worker finishes them; then `tether compensate` once more. Each undo reaches the
    service once: the tool worker's undo ledger decides, whichever run asks."""
    chaos_dir = workdir / _unique("twice")
    chaos_dir.mkdir(parents=True)
    queue = _unique("chaos-q")
    worker = start_worker(address, billing.url, queue, chaos_dir, "before", HELD_TOOL_TIMEOUT, CHAOS_HOLD_UNDO_ONLY="1")
    try:
        await worker.wait_for_output("worker ready")
        request = RunRequest(goal="chaos kept", requested_by="alice", playbook=COMPENSATION_PLAN, on_failure="stop")
        handle = await _start(client, request, _unique("chaos-kept"), queue)
        snap = await _await_state(handle, {S.AWAITING_APPROVAL}, 180)
        refund_tc, ledger_tc = snap.plan.steps[0].tool_call_id, snap.plan.steps[1].tool_call_id
        await handle.signal("approve", approval_for(snap, "chaos-bob"))
        state, _ = await _ended(client, handle.id)
        assert state == S.EXECUTION_FAILED, state
        undo_key = f"{handle.id}:{ledger_tc}:undo"
        again = RunRequest(goal="chaos compensate", requested_by="chaos-bob", compensate_run=handle.id)
        runs = [await _start(client, again, _unique("chaos-comp"), queue) for _ in range(2)]
        await _wait(lambda: _marker(chaos_dir, undo_key, 1, "before").exists(), 60, "the reversal held before its call")
        worker.kill()
        _release(chaos_dir, undo_key)
        worker = start_worker(address, billing.url, queue, chaos_dir, tool_timeout=HELD_TOOL_TIMEOUT)
        await worker.wait_for_output("worker ready")
        ended = [await _ended(client, run.id) for run in runs]
        runs.append(await _start(client, again, _unique("chaos-comp"), queue))
        ended.append(await _ended(client, runs[-1].id))
        refunds = billing.refunds(f"{handle.id}:{refund_tc}")
        entries = billing.get(f"/ledger?key={handle.id}:{ledger_tc}")["entries"]
        reversals = billing.get(f"/ledger?reverses={entries[0]['entry_id']}")["entries"] if entries else []
        return TwiceResult(
            run_id=handle.id, states=[s for s, _ in ended], refunds=len(refunds),
            voided=bool(refunds) and refunds[0]["voided_at"] is not None, reversals=len(reversals),
            reversal_calls=_attempts(chaos_dir, undo_key), reasons=[t[-1].reason for _, t in ended],
        )
    finally:
        worker.stop()


def check_twice(r: TwiceResult) -> None:
    """Every undo applied exactly once, however many compensation runs asked; none left."""
    assert r.refunds == 1 and r.voided, r
    assert r.reversals == 1, f"{r.reversals} reversals of one ledger entry: {r}"
    assert all(s in (S.COMPENSATED, S.HANDED_OFF, S.FAILED) for s in r.states), r
    # The last one, after the others ended: nothing left to undo (the ledger says so), or it
    # finished what a run that handed off left.
    assert r.states[-1] == S.COMPENSATED or "nothing_to_compensate" in r.reasons[-1], r


def check_compensation(r: CompensationResult) -> None:
    """The recovery contract under a SIGKILL: COMPENSATED, each write undone exactly once."""
    assert r.state == S.COMPENSATED, f"{r.run_id} ended {r.state.value}: {r.reason}"
    assert r.refunds == 1 and r.voided, r
    assert r.reversals == 1, f"{r.reversals} reversals of one ledger entry: {r}"
    assert sorted(r.undo_records.values()) == [1, 1], f"an undo recorded twice or missing: {r}"
    if r.point != "random":
        assert r.retried, f"the kill held at {r.point!r} did not cost the undo an attempt: {r}"
