"""The installed `tether` command in a subprocess, against a test's Temporal server and worker."""

from __future__ import annotations

import asyncio
import os

from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.policy_checks import PolicyStore
from tests.helpers.paths import BIN, ROOT


class Cli:
    """The installed ``tether`` script (.venv/bin/tether) in a subprocess, against ``env``."""

    def __init__(self, env: WorkflowEnvironment, worker: Worker) -> None:
        self.env = {
            **os.environ,
            "TEMPORAL_ADDRESS": env.client.service_client.config.target_host,
            "TEMPORAL_NAMESPACE": env.client.namespace,
            "TETHER_TASK_QUEUE": worker.task_queue,
        }

    async def __call__(self, *args: str, env: dict | None = None) -> tuple[int, str, str]:
        # Async subprocess: the in-process worker keeps running while the CLI waits.
        proc = await asyncio.create_subprocess_exec(
            str(BIN / "tether"), *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**self.env, **(env or {})}, cwd=ROOT,
        )
        out, err = await proc.communicate()
        return proc.returncode, out.decode(), err.decode()


POLICY = PolicyStore(ROOT / "examples/billing/policy.toml")


SMALL_REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 7000, "reason": "cli"}}]


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]
