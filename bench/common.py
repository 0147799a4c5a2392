"""Shared benchmark plumbing: a private dev server and the worker process under test, /proc
readings (RSS, CPU) and small formatting helpers. Never touches the demo stack's ports."""

from __future__ import annotations

import asyncio
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
from typing import AsyncIterator, Sequence

from temporalio.client import Client

from examples.devstack import dev_server_command
from client import connect

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


async def _wait_for(predicate, what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode}):\n{log.read_text()[:3000]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} not ready after {timeout:.0f}s:\n{log.read_text()[-3000:]}")
        await asyncio.sleep(0.1)


@asynccontextmanager
async def bench_stack(
    worker_args: Sequence[str] = (), *, dynamic_config: Sequence[str] = (), keep: bool = False
) -> AsyncIterator[Stack]:
    """A dev server on free ports (search attributes registered, SQLite in a temp dir) and one
    worker process; both are stopped on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    port, ui_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    # --http-port too: its default (port + 1000) may be taken by another process.
    cmd = dev_server_command(port, ui_port, workdir / "temporal.db") + [
        "--headless", "--http-port", str(free_port()),
    ]
    for value in dynamic_config:
        cmd += ["--dynamic-config-value", value]
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
        worker_log = workdir / "worker.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not env.get("TETHER_STATE_KEY_FILE"):  # a worker never creates its key ring
            from activities.keys import genkey

            env["TETHER_STATE_KEY_FILE"] = str(workdir / "state.key")
            genkey(Path(env["TETHER_STATE_KEY_FILE"]))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        worker_proc = subprocess.Popen(
            [sys.executable, "-m", "bench.worker_proc", "--address", address,
             "--task-queue", task_queue, "--tools", "bench.tools", *worker_args],
            stdout=worker_log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            start_new_session=True,
        )
        await _wait_for(
            lambda: "bench worker ready" in worker_log.read_text(errors="replace"),
            "bench worker", worker_proc, worker_log, 60,
        )
        yield Stack(address, task_queue, client, server, worker_proc, workdir, list(worker_args))
    finally:
        if worker_proc is not None:
            _stop(worker_proc)
        _stop(server)
        if not keep:
            for f in workdir.iterdir():
                f.unlink(missing_ok=True)
            workdir.rmdir()


def machine_line() -> str:
    load = Path("/proc/loadavg").read_text().split()[:3]
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) / 1024 / 1024
    return f"{os.cpu_count()} cores, {total:.0f} GiB RAM, load average {' '.join(load)} at start"


async def approve_pending(client: Client, run_id: str, approver: str = "bench-approver") -> None:
    """Approve the run's pending request as a signal, as a client that only signals does: the
    decision names the request id and plan hash the snapshot shows."""
    import uuid

    from workflows.models import ApprovalDecision, RunSnapshot

    handle = client.get_workflow_handle(run_id)
    pending = (await handle.query("snapshot", result_type=RunSnapshot)).pending_approval
    assert pending is not None, f"{run_id} has nothing pending"
    await handle.signal(
        "approve",
        ApprovalDecision(
            decision_id=uuid.uuid4().hex, approver=approver, plan_hash=pending.plan_hash, request_id=pending.request_id
        ),
    )
