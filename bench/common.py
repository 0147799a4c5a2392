"""Shared benchmark plumbing: a private dev server and the worker process under test, /proc
readings (RSS, CPU) and small formatting helpers. Never touches the demo stack's ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from temporalio.client import Client

from examples.devstack import DEV_SERVER_DYNAMIC_CONFIG, dev_server_command
from tether.client import connect

if TYPE_CHECKING:
    from workflows.run_state import PendingApproval

ROOT = Path(__file__).resolve().parent.parent
RESERVED_PORTS = {7233, 8233, 8765}  # the demo stack's: never used here
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RESERVED_PORTS:
            return port


def _descendants(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                children = Path(f"/proc/{p}/task/{task}/children").read_text().split()
                todo.extend(int(c) for c in children)
        except OSError:
            pass
    return pids


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mb(pid: int) -> float:
    """Current resident set of a process and its descendants, in MiB."""
    return sum(_status_kb(p, "VmRSS") for p in _descendants(pid)) / 1024


def peak_rss_mb(pid: int) -> float:
    """Peak resident set (VmHWM) of a process and its descendants, in MiB."""
    return sum(_status_kb(p, "VmHWM") for p in _descendants(pid)) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its descendants."""
    total = 0
    for p in _descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / CLK_TCK


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (pastes into docs/performance.md as is)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)]
    )


def _stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: only what we started
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


@dataclass
class Stack:
    address: str
    task_queue: str
    client: Client
    server: subprocess.Popen
    worker: subprocess.Popen
    workdir: Path
    worker_options: list[str] = field(default_factory=list)
    metrics_port: int | None = None  # the dev server's Prometheus endpoint (None: a stack given)
    dynamic_config: list[str] = field(default_factory=list)


def server_counter(metrics_port: int | None, task_queue: str, name: str) -> float | None:
    """The dev server's counter ``name`` for ``task_queue``, summed over its other labels, from
    the server's Prometheus endpoint (``--metrics-port``); None: it cannot be read."""
    import urllib.request

    if metrics_port is None:
        return None
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    # The server's label writes the queue's name with "_" for "-".
    label = f'taskqueue="{task_queue.replace("-", "_")}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line.replace("-", "_"))


def eager_line(stack: Stack, before: float | None, scheduled: int) -> str:
    """What the bench ran with: the server's eager activity setting and how many of the
    activities it scheduled it handed to the worker in its reply to the workflow task."""
    key = "system.enableActivityEagerExecution="
    given = [v for v in stack.dynamic_config if v.startswith(key)]
    setting = (f"{given[-1]} (--dynamic-config)" if given else
               next((f"{v} (the dev server's flags)" for v in DEV_SERVER_DYNAMIC_CONFIG if v.startswith(key)),
                    f"{key.rstrip('=')} not set (the server's default)"))
    after = server_counter(stack.metrics_port, stack.task_queue, "activity_eager_execution")
    if before is None or after is None:
        return f"eager activity execution: {setting}; the server's metrics were not read"
    return (f"eager activity execution: {setting}; {after - before:.0f} activity tasks handed to the worker in the "
            f"workflow task's reply while the {scheduled} activities measured ran (server metric "
            f"activity_eager_execution; runs of the warm-up still going count too)")


async def _wait_for(predicate, what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode}):\n{log.read_text()[:3000]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} not ready after {timeout:.0f}s:\n{log.read_text()[-3000:]}")
        await asyncio.sleep(0.1)


async def start_worker(stack: Stack, log: Path) -> subprocess.Popen:
    """A worker process on the stack's server and task queue, with its options, ready (the
    stack's own, or another one: bench/agentdojo.py's faults start one after each kill)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.worker_proc", "--address", stack.address,
         "--task-queue", stack.task_queue, "--tools", "bench.tools", *stack.worker_options],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True,
    )
    await _wait_for(lambda: "bench worker ready" in log.read_text(errors="replace"), "bench worker", proc, log, 60)
    return proc


@asynccontextmanager
async def bench_stack(
    worker_args: Sequence[str] = (), *, dynamic_config: Sequence[str] = (), keep: bool = False
) -> AsyncIterator[Stack]:
    """A dev server on free ports (search attributes registered, SQLite in a temp dir) and one
    worker process; both are stopped on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    port, ui_port, metrics_port = free_port(), free_port(), free_port()
    address = f"127.0.0.1:{port}"
    # --http-port too: its default (port + 1000) may be taken by another process.
    cmd = dev_server_command(port, ui_port, workdir / "temporal.db", dynamic_config) + [
        "--headless", "--http-port", str(free_port()), "--metrics-port", str(metrics_port),
    ]
    server_log = workdir / "server.log"
    server = subprocess.Popen(
        cmd, stdout=server_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    worker_proc = None
    try:
        client = None
        deadline = time.monotonic() + 60
        while client is None:
            try:
                client = await connect(target_host=address, namespace="default")
                await client.count_workflows()  # the namespace and visibility answer
            except Exception:
                client = None
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"dev server did not start:\n{server_log.read_text()[-3000:]}")
                await asyncio.sleep(0.3)
        task_queue = f"bench-{os.getpid()}"
        if not os.environ.get("TETHER_STATE_KEY_FILE"):  # a worker never creates its key ring
            from tether.store.keys import genkey

            genkey(workdir / "state.key")
            # This process verifies the views the worker signs (``listed_pending``) with it.
            os.environ["TETHER_STATE_KEY_FILE"] = str(workdir / "state.key")
        stack = Stack(address, task_queue, client, server, None, workdir, list(worker_args),  # type: ignore[arg-type]
                      metrics_port, list(dynamic_config))
        worker_proc = stack.worker = await start_worker(stack, workdir / "worker.log")
        yield stack
    finally:
        if worker_proc is not None:
            _stop(worker_proc)
        _stop(server)
        if not keep:
            for f in workdir.iterdir():
                f.unlink(missing_ok=True)
            workdir.rmdir()


def stack_or_new(stack: Stack | None, *args, **kwargs):
    """The stack given (a test's shared one: left running), else a new ``bench_stack``."""
    if stack is not None:
        return contextlib.nullcontext(stack)
    return bench_stack(*args, **kwargs)


def machine_line() -> str:
    load = Path("/proc/loadavg").read_text().split()[:3]
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) / 1024 / 1024
    return f"{os.cpu_count()} cores, {total:.0f} GiB RAM, load average {' '.join(load)} at start"


async def listed_pending(execution) -> PendingApproval | None:
    """The pending request a listed run's published view shows (the memo a visibility listing
    carries, as the inbox reads it), when the view verifies and the run waits for approval; else
    None (``approve_pending`` then asks the run by query)."""
    from tether.connection import TetherError
    from tether.runs import published_view
    from workflows.states import RunState

    try:
        view = await published_view(execution)
    except TetherError:  # unverified or unreadable here: ask the run itself
        return None
    if view is None or view.snapshot.state != RunState.AWAITING_APPROVAL:
        return None
    return view.snapshot.pending_approval


async def approve_pending(
    client: Client, run_id: str, approver: str = "bench-approver", pending: PendingApproval | None = None
) -> None:
    """Approve the run's pending request as a signal, as a client that only signals does: the
    decision names the request id and plan hash of ``pending`` (the listing's view,
    ``listed_pending``), else of the snapshot the run answers a query with."""
    import uuid

    from workflows.contract import ApprovalDecision
    from workflows.run_state import RunSnapshot

    handle = client.get_workflow_handle(run_id)
    if pending is None:
        pending = (await handle.query("snapshot", result_type=RunSnapshot)).pending_approval
    assert pending is not None, f"{run_id} has nothing pending"
    await handle.signal(
        "approve",
        ApprovalDecision(
            decision_id=uuid.uuid4().hex, approver=approver, plan_hash=pending.plan_hash, request_id=pending.request_id
        ),
    )


# ----------------------------------------------------------------------------- histories


def event_seconds(event) -> float:
    return event.event_time.seconds + event.event_time.nanos / 1e9


def event_kind(event) -> str:
    from temporalio.api.enums.v1 import EventType

    return EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")


async def chain_events(client: Client, workflow_id: str, run_id: str | None = None) -> tuple[list, int]:
    """Every event of a run and of the runs it continued as new into, in order, and how many
    runs the chain has (1 when it never continued)."""
    events: list = []
    runs = 0
    while True:
        runs += 1
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        events += history.events
        last = history.events[-1]
        if event_kind(last) != "WORKFLOW_EXECUTION_CONTINUED_AS_NEW":
            return events, runs
        run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id


@dataclass
class HistoryFacts:
    """What one run (its whole continue-as-new chain) wrote to history, and its latencies."""

    events: int
    bytes: int
    runs: int  # 1 + the times it continued as new
    activities: int  # activity tasks scheduled (local activities are markers)
    markers: int
    upserts: int
    task_trouble: int  # workflow tasks timed out (a busy worker misses the sticky queue) or failed
    kinds: dict[str, int]
    kind_bytes: dict[str, int]
    schedule_to_start: list[float]  # ms, every activity task
    turnaround: list[float]  # ms, an activity completed -> the next one scheduled (a workflow task)
    approval_to_schedule: list[float]  # ms, the server's signal event -> the tool's activity scheduled
    approval_to_start: list[float]  # ms, ... -> that activity started
    signaled_at: list[float]  # epoch s of each signal event


def history_facts(events: list, runs: int = 1, tool_activity: str = "execute_tool") -> HistoryFacts:
    kinds: dict[str, int] = {}
    kind_bytes: dict[str, int] = {}
    scheduled: dict[int, float] = {}
    s2s, turn, a_sched, a_start, signaled_at = [], [], [], [], []
    last_completed: float | None = None
    signal_at: float | None = None
    waiting_for: int | None = None  # scheduled event id of the tool the last signal released
    for e in events:
        kind = event_kind(e)
        kinds[kind] = kinds.get(kind, 0) + 1
        kind_bytes[kind] = kind_bytes.get(kind, 0) + e.ByteSize()
        at = event_seconds(e)
        if kind == "WORKFLOW_EXECUTION_SIGNALED":
            signal_at = at
            signaled_at.append(at)
            last_completed = None  # what follows reacts to the signal, not to an activity
        elif kind == "ACTIVITY_TASK_SCHEDULED":
            scheduled[e.event_id] = at
            if last_completed is not None:
                turn.append((at - last_completed) * 1000)
                last_completed = None
            name = e.activity_task_scheduled_event_attributes.activity_type.name
            if signal_at is not None and name == tool_activity:
                a_sched.append((at - signal_at) * 1000)
                waiting_for, signal_at = e.event_id, None
        elif kind == "ACTIVITY_TASK_STARTED":
            sid = e.activity_task_started_event_attributes.scheduled_event_id
            if sid in scheduled:
                s2s.append((at - scheduled[sid]) * 1000)
            if sid == waiting_for:
                a_start.append((at - signaled_at[-1]) * 1000)
                waiting_for = None
        elif kind == "ACTIVITY_TASK_COMPLETED":
            last_completed = at
        elif kind in ("WORKFLOW_EXECUTION_CONTINUED_AS_NEW", "WORKFLOW_EXECUTION_STARTED"):
            last_completed = None
    return HistoryFacts(
        events=len(events), bytes=sum(e.ByteSize() for e in events), runs=runs,
        activities=kinds.get("ACTIVITY_TASK_SCHEDULED", 0), markers=kinds.get("MARKER_RECORDED", 0),
        upserts=kinds.get("UPSERT_WORKFLOW_SEARCH_ATTRIBUTES", 0),
        task_trouble=kinds.get("WORKFLOW_TASK_TIMED_OUT", 0) + kinds.get("WORKFLOW_TASK_FAILED", 0),
        kinds=kinds, kind_bytes=kind_bytes,
        schedule_to_start=s2s, turnaround=turn, approval_to_schedule=a_sched,
        approval_to_start=a_start, signaled_at=signaled_at,
    )


async def run_facts(
    client: Client, workflow_id: str, run_id: str | None, *, tool_activity: str = "execute_tool",
    sem: asyncio.Semaphore | None = None,
) -> HistoryFacts:
    """The facts of the chain that starts at ``run_id`` (the handle start_workflow returned has it;
    without one, the workflow id's latest run)."""
    async with sem or contextlib.nullcontext():
        events, runs = await chain_events(client, workflow_id, run_id)
    return history_facts(events, runs, tool_activity)


def ms(values: Sequence[float]) -> str:
    """p50 / p99 in ms, or a dash when there is nothing to show."""
    if not values:
        return "-"
    return f"{percentile(values, 50):.0f} / {percentile(values, 99):.0f}"
