"""Real processes for the chaos and restart suites: a dev server (SQLite file), the billing
service with ``--delay-ms``, and worker subprocesses that are SIGKILLed at the dangerous points
of a tool call. Used by ``tests/chaos/test_chaos.py`` (a small deterministic subset) and by
``python -m tests.chaos.run_chaos`` (the long randomized version); both run ``kill_round``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter

import starter
from examples.devstack import dev_server_command
from tests.chaos.markers import marker_name
from tests.conftest import approval_for, Billing
from tests.invariants import check_timeline, tools_by_call
from workflows.models import ApprovalDecision, RunOutcome, RunRequest, RunSnapshot
from workflows.states import RunState

ROOT = Path(__file__).resolve().parents[2]
S = RunState

# Effect class -> (chaos tool, its arguments). Names match tests/chaos/chaos_tools.py, which
# only worker subprocesses import.
TOOLS = {
    "idempotent": ("chaos_refund", {"order_id": "A-1002", "amount_cents": 100, "reason": "chaos"}),
    "reconcilable": ("chaos_ledger", {"order_id": "A-1003", "amount_cents": -100, "memo": "chaos"}),
    "unsafe": ("chaos_email", {"to": "grace@example.com", "subject": "chaos", "body": "chaos"}),
}
EFFECTS = tuple(TOOLS)
POINTS = ("before", "during", "after")
# Billing delay: every write's response waits this long after its commit ("during" kills land here).
BILLING_DELAY_MS = 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    async def wait_for_output(self, text: str, timeout: float = 60.0) -> None:
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
               "--db", str(self.db), "--delay-ms", str(delay_ms)]
        self.proc = Proc("billing", cmd, workdir / "billing.log", _env())

    async def ready(self) -> BillingProc:
        await self.proc.wait_for_output("listening")
        return self

    def effects(self, effect: str, key: str) -> int:
        """How many effects the service holds for one idempotency key."""
        if effect == "idempotent":
            return len(self.refunds(key))
        if effect == "reconcilable":
            return len(self.get(f"/ledger?key={key}")["entries"])
        return len(self.get(f"/emails?request_ref={key}")["emails"])

    def stop(self) -> None:
        self.proc.stop()


def start_worker(
    address: str, billing_url: str, queue: str, chaos_dir: Path, hold: str = "", tool_timeout: float | None = None
) -> Proc:
    cmd = [sys.executable, "worker.py", "--tools", "tests.chaos.chaos_tools", "--task-queue", queue]
    env = _env(TEMPORAL_ADDRESS=address, BILLING_URL=billing_url, CHAOS_DIR=str(chaos_dir), CHAOS_HOLD=hold,
               CHAOS_TOOL_TIMEOUT=str(tool_timeout or ""))
    return Proc(f"worker {queue}", cmd, chaos_dir / f"worker-{uuid.uuid4().hex[:6]}.log", env)


# ----------------------------------------------------------------------------- one kill round


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
        snap = await handle.query("snapshot", result_type=RunSnapshot)
        if snap.state in states:
            return snap
        if time.monotonic() > deadline:
            raise TimeoutError(f"{handle.id} is {snap.state.value}, waited for {sorted(s.value for s in states)}")
        await asyncio.sleep(0.05)


def _marker(chaos_dir: Path, key: str, attempt: int, point: str) -> Path:
    return chaos_dir / marker_name(key, attempt, point)


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
    hold = {"before": "before", "during": "before", "after": "after"}.get(point or "", "")
    worker = start_worker(address, billing.url, queue, chaos_dir, hold)
    round_ = Round()
    round_.mark("start")
    try:
        await worker.wait_for_output("worker ready")
        round_.mark("worker ready")
        runs: list[tuple[str, WorkflowHandle]] = []
        for effect in effects:
            tool, args = TOOLS[effect]
            for _ in range(runs_per_effect):
                request = RunRequest(goal=f"chaos {effect}", requested_by="alice", playbook=[{"tool": tool, "args": args}])
                handle = await starter.start_run(client, request, run_id=_unique(f"chaos-{effect}"), queue=queue)
                runs.append((effect, handle))
        keys: dict[str, tuple[str, str]] = {}
        for effect, handle in runs:
            snap = await _await_state(handle, {S.AWAITING_APPROVAL}, 60)
            assert snap.plan is not None
            tool_call_id = snap.plan.steps[0].tool_call_id
            keys[handle.id] = (f"{handle.id}:{tool_call_id}", tool_call_id)
        round_.mark("awaiting approval")
        for _, handle in runs:
            await handle.signal("approve", approval_for(await handle.query("snapshot", result_type=RunSnapshot), "chaos-bob"))

        def attempts(key: str) -> int:
            return sum(1 for a in range(1, 20) if _marker(chaos_dir, key, a, "before").exists())

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
            worker = start_worker(address, billing.url, queue, chaos_dir)
            await worker.wait_for_output("worker ready")
            await asyncio.sleep(rng.uniform(0.2, 3.0))
            worker.kill()
            round_.kills += 1
        worker = start_worker(address, billing.url, queue, chaos_dir)
        await worker.wait_for_output("worker ready")
        round_.mark("restarted")

        for effect, handle in runs:
            outcome: RunOutcome = await asyncio.wait_for(
                client.get_workflow_handle(handle.id, result_type=RunOutcome).result(), 120
            )
            key, tool_call_id = keys[handle.id]
            check_timeline(outcome.timeline, tools_by_call(outcome))
            last = outcome.timeline[-1]
            completions = await _tool_completions(handle)
            if completions and min(completions) < killed_at:
                points[handle.id] = "done"  # a random kill that came after the call completed
            round_.results.append(
                RunResult(
                    effect=effect, run_id=handle.id, key=key, point=points[handle.id],
                    state=outcome.state, effects=billing.effects(effect, key),
                    attempts=attempts(key), reason=last.reason, tool_call_id=tool_call_id,
                    held=point is not None, tool_completed=bool(completions),
                )
            )
            round_.mark(f"{effect} done")
    finally:
        worker.stop()
    return round_


def check_result(r: RunResult) -> None:
    """The chaos contract for one run (see tests/chaos/test_chaos.py)."""
    if r.effect in ("idempotent", "reconcilable"):
        assert r.state == S.COMPLETED, f"{r.effect} run {r.run_id} ended {r.state.value}: {r.reason}"
        assert r.effects == 1, f"{r.effect} key {r.key}: {r.effects} effects"
    else:
        assert r.attempts <= 1 and r.effects <= 1, f"unsafe tool called twice: {r}"
        if r.held:
            # Killed while held at the point: the activity cannot have completed.
            assert not r.tool_completed, r
        if not r.tool_completed:
            # The call's outcome never reached Temporal: unknown, so a human decides.
            assert r.state == S.HANDED_OFF, f"unsafe run with unknown outcome ended {r.state.value}: {r}"
        assert r.state in (S.COMPLETED, S.HANDED_OFF), r
        if r.state == S.HANDED_OFF:
            assert r.tool_call_id in r.reason and "outcome unknown" in r.reason, r.reason
        else:
            assert r.tool_completed and r.effects == 1, r
