"""A fleet shares one effect ledger (issue 58: two workers on one queue, each with its default
SQLite ledger, as on two machines; a reset of an approved email run taken by the other worker
sent the email again). Real worker processes on the dev server: a worker whose ledger is local
refuses to serve a queue a worker with another ledger polls, naming the shared one to set."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from tests.chaos.harness import Proc
from tests.helpers.runs import unique

ROOT = Path(__file__).resolve().parents[2]


def _worker(dev_env: WorkflowEnvironment, queue: str, log_dir: Path, **env: str) -> Proc:
    settings = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_PROXY": "127.0.0.1,localhost",
                "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host,
                "TEMPORAL_NAMESPACE": dev_env.client.namespace, **env}
    if "TETHER_AUDIT_DSN" not in env:
        settings.pop("TETHER_AUDIT_DSN", None)
    return Proc(f"worker {queue}", [sys.executable, "worker.py", "--task-queue", queue],
                log_dir / f"worker-{uuid.uuid4().hex[:6]}.log", settings)


async def test_a_worker_with_a_local_ledger_refuses_a_queue_another_ledger_serves(
    dev_env: WorkflowEnvironment, tmp_path: Path, postgres: str,
) -> None:
    queue = unique("fleet-ledger")
    machine_a, machine_b = tmp_path / "a", tmp_path / "b"
    first = _worker(dev_env, queue, tmp_path, TETHER_AUDIT_DIR=str(machine_a))
    others: list[Proc] = []
    try:
        await first.wait_for_output("worker ready")
        # A second machine's worker, its own SQLite ledger: refused, saying what to set.
        second = _worker(dev_env, queue, tmp_path, TETHER_AUDIT_DIR=str(machine_b))
        others.append(second)
        assert second.popen.wait(timeout=120) == 1, second.output()
        out = second.output()
        assert "worker ready" not in out
        assert f"task queue '{queue}' is served by another worker with another effect ledger" in out, out
        assert "TETHER_AUDIT_DSN" in out and "Scaling workers" in out and str(machine_b) in out, out
        # Another process on the same ledger (the same folder: a restart, a second process on
        # the same machine) serves beside it.
        same = _worker(dev_env, queue, tmp_path, TETHER_AUDIT_DIR=str(machine_a))
        others.append(same)
        await same.wait_for_output("worker ready")
    finally:
        for proc in [*others, first]:
            proc.stop()

    # Workers on the fleet's one ledger (PostgreSQL) serve one queue side by side; a worker with
    # a local ledger that starts beside them is refused.
    queue = unique("fleet-shared")
    fleet = [_worker(dev_env, queue, tmp_path, TETHER_AUDIT_DSN=postgres) for _ in range(2)]
    try:
        for proc in fleet:
            await proc.wait_for_output("worker ready")
        local = _worker(dev_env, queue, tmp_path, TETHER_AUDIT_DIR=str(machine_b))
        fleet.append(local)
        assert local.popen.wait(timeout=120) == 1, local.output()
        assert "ledger=shared" in local.output() and "TETHER_AUDIT_DSN" in local.output()
    finally:
        for proc in fleet:
            proc.stop()
