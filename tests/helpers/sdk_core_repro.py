"""sdk-core: a query answered while a local activity's result waits reorders that result after
the signals that came meanwhile, on the live worker only (docs/known-issues.md). Plain temporalio,
no Tether code. `make sdk-core-repro` (not in `make test`: it breaks some runs, not all).

    .venv/bin/python -m tests.helpers.sdk_core_repro [--runs 20] [--rounds 20] [--parallel 10] [--read describe]

``--read describe`` reads with DescribeWorkflowExecution instead of the query: the control.

Exit 1 when a run got stuck or a recorded history does not replay; 0 when none did (a fixed
sdk-core, or luck: run it again).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from datetime import timedelta
from pathlib import Path

from temporalio import activity, workflow
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner, Worker


@activity.defn
async def slow() -> int:
    await asyncio.sleep(0.02)  # long enough for a query to arrive while the result waits
    return 1


@workflow.defn
class Repro:
    def __init__(self) -> None:
        self.pokes = 0

    @workflow.signal
    def poke(self) -> None:
        self.pokes += 1

    @workflow.query
    def seen(self) -> int:
        return self.pokes

    @workflow.run
    async def run(self, rounds: int) -> int:
        for _ in range(rounds):
            await workflow.execute_local_activity(slow, start_to_close_timeout=timedelta(seconds=10))
            if self.pokes % 2:  # state fed by signals, read right after the local activity's result
                await workflow.sleep(0.001)  # a timer on one branch only
        return self.pokes


async def one(env: WorkflowEnvironment, queue: str, rounds: int, read: str) -> str | None:
    """Run one workflow under signals and four read loops; what broke, or None."""
    handle = await env.client.start_workflow(Repro.run, rounds, id=f"repro-{uuid.uuid4().hex[:8]}", task_queue=queue)
    done = asyncio.create_task(handle.result())

    async def loop(call, pause: float) -> None:  # noqa: ANN001
        while not done.done():
            try:
                await call()
            except Exception:  # noqa: BLE001 (a closed or stuck run refuses: the result says why)
                pass
            await asyncio.sleep(pause)

    loops = [asyncio.create_task(loop(lambda: handle.signal(Repro.poke), 0.05))]
    reader = (lambda: handle.query(Repro.seen, rpc_timeout=timedelta(seconds=5))) if read == "query" else handle.describe
    loops += [asyncio.create_task(loop(reader, 0)) for _ in range(4)]
    broke = None
    while not done.done() and broke is None:
        await asyncio.wait({done}, timeout=1)
        task = (await handle.describe()).raw_description.pending_workflow_task
        if task.attempt >= 3:  # its workflow task keeps failing
            broke = f"{handle.id} stuck at attempt {task.attempt}"
            try:
                await handle.terminate("stuck")
            except Exception:  # noqa: BLE001 (it ended meanwhile)
                pass
    await asyncio.gather(done, *loops, return_exceptions=True)
    replayed = await Replayer(workflows=[Repro], workflow_runner=UnsandboxedWorkflowRunner()).replay_workflow(
        await handle.fetch_history(), raise_on_replay_failure=False)
    if replayed.replay_failure is not None:
        broke = f"{broke or handle.id}; its history does not replay: {replayed.replay_failure}"
    return broke


async def main(runs: int, rounds: int, parallel: int, read: str) -> int:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        dev_server_extra_args=["--headless", "--log-level", "error"],
        runtime=Runtime(telemetry=TelemetryConfig(logging=None)),  # the failures are counted below, not logged
    )
    queue = "repro"
    # A small cache: runs are evicted and replayed while they work, as on a busy worker.
    async with Worker(env.client, task_queue=queue, workflows=[Repro], activities=[slow], max_cached_workflows=2,
                      workflow_runner=UnsandboxedWorkflowRunner()):
        broken = []
        for start in range(0, runs, parallel):
            batch = await asyncio.gather(*(one(env, queue, rounds, read) for _ in range(start, min(start + parallel, runs))))
            broken += [b for b in batch if b]
    await env.shutdown()
    for line in broken:
        print(line[:600])
    print(f"{len(broken)} of {runs} runs broke (read by {read})")
    return 1 if broken else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=10)
    parser.add_argument("--read", choices=["query", "describe"], default="query")
    args = parser.parse_args()
    code = asyncio.run(main(args.runs, args.rounds, args.parallel, args.read))
    sys.stdout.flush()
    # The SDK's native threads can outlive the loop and abort CPython's teardown (sdk-python
    # issue 300): leave without it, so the exit code is ours.
    os._exit(code)
