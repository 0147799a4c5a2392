"""A real worker process of a given build: Tether's own worker code whose build marker is BUILD_ID
(this checkout's, or one before or after it), a version of Worker Deployment DEPLOYMENT ('-':
unversioned), polling QUEUE under IDENTITY ('-': the SDK's default).

    python -m tests.helpers.build_worker ADDRESS NAMESPACE QUEUE BUILD_ID DEPLOYMENT IDENTITY

The build marker is the only thing that differs between two builds of the same code: the runs
this worker starts write BUILD_ID, and it replays no history another build started. It prints
"ready" once polling, and runs until SIGTERM (a graceful stop) or SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from temporalio.testing import WorkflowEnvironment

ROOT = Path(__file__).resolve().parents[2]


class BuildWorker:
    """A started ``tests.helpers.build_worker`` process."""

    def __init__(self, proc: asyncio.subprocess.Process, identity: str) -> None:
        self.proc = proc
        self.identity = identity

    async def stop(self) -> None:
        """SIGTERM, and wait for its graceful shutdown to have completed."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        await self.proc.wait()

    async def kill(self) -> None:
        """SIGKILL: it says nothing to the server, its pollers stay listed."""
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


async def start_build_worker(
    env: WorkflowEnvironment, queue: str, build: str, *, deployment: str | None = None, identity: str | None = None,
    environ: dict[str, str] | None = None,
) -> BuildWorker:
    """A worker process of ``build`` on ``queue`` (``environ``: settings over this process's), once it polls."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.helpers.build_worker", env.client.service_client.config.target_host,
        env.client.namespace, queue, build, deployment or "-", identity or "-",
        stdout=asyncio.subprocess.PIPE, cwd=ROOT, env={**os.environ, **(environ or {})},
    )
    assert proc.stdout is not None
    line = await proc.stdout.readline()  # an event: it polls, or it died (EOF)
    if line.strip() != b"ready":
        await proc.wait()
        raise AssertionError(f"build worker {build} did not start (exit {proc.returncode}): {line!r}")
    return BuildWorker(proc, identity or "")


@asynccontextmanager
async def build_worker(env: WorkflowEnvironment, queue: str, build: str, **options: Any) -> AsyncIterator[BuildWorker]:
    worker = await start_build_worker(env, queue, build, **options)
    try:
        yield worker
    finally:
        await worker.kill()  # a no-op once it has stopped


async def _serve(address: str, namespace: str, queue: str, deployment: str, identity: str) -> None:
    # Imported only now, with BUILD set: this process is that build.
    from temporalio.client import Client
    from temporalio.contrib.pydantic import pydantic_data_converter

    import examples.billing.tools  # noqa: F401  (the catalog the tests' workers offer)
    from worker import create_worker

    client = await Client.connect(
        address, namespace=namespace, data_converter=pydantic_data_converter,
        **({"identity": identity} if identity != "-" else {}),
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with create_worker(client, task_queue=queue, deployment=None if deployment == "-" else deployment):
        print("ready", flush=True)
        await stop.wait()


if __name__ == "__main__":
    import workflows.published

    workflows.published.BUILD = sys.argv[4]  # before anything imports it
    # That build replays the one before it, as this build replays its previous one.
    prefix, number = sys.argv[4].rsplit("-", 1)
    workflows.published.PREVIOUS_BUILD = f"{prefix}-{int(number) - 1}" if number.isdigit() else workflows.published.PREVIOUS_BUILD
    asyncio.run(_serve(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5], sys.argv[6]))
    from tether.connection import exit_process

    exit_process(0)  # past the Temporal runtime's teardown crash (sdk-python #300)
