"""Parallel step groups and child runs against the same steps inline.

    python -m bench.parallel [--rounds 5]

Each round runs one plan whose steps take 0.2, 0.4, 0.6, 0.8 and 1.0 s: as a group
(``{"parallel": [...]}``), inline, and delegated to a child run (``{"delegate": ...}``, the same
steps inline in the child). It reads from each run's timeline how long its steps took, from
entering the first to the record after the last (the barrier's, for the group; the delegate
step's, for the child). Targets: the group within 1.3x its slowest step (1.0 s); the child within
1.5x the same steps inline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import uuid

from bench.common import bench_stack, machine_line, table
from tether.client import run_outcome, start_run
from workflows.run_state import RunRequest
from workflows.states import RunState, TransitionRecord

SECONDS = (0.2, 0.4, 0.6, 0.8, 1.0)
TARGET = 1.3
CHILD_TARGET = 1.5


def _steps() -> list[dict]:
    return [{"tool": "bench_wait", "args": {"key": f"k{i}", "seconds": s}} for i, s in enumerate(SECONDS)]


def span(timeline: list[TransitionRecord]) -> float:
    """Seconds from entering the first step to the record that ends the last."""
    entered = next(r.at for r in timeline if r.to_state == RunState.EXECUTING_TOOL)
    observed = [r.at for r in timeline if r.to_state == RunState.OBSERVING_RESULT]
    return (observed[-1] - entered).total_seconds()


async def one(stack, playbook: list[dict]) -> float:
    request = RunRequest(goal="bench parallel", requested_by="bench", playbook=playbook)
    handle = await start_run(stack.client, request, run_id=f"par-{uuid.uuid4().hex[:10]}", queue=stack.task_queue)
    outcome = await run_outcome(handle)
    assert outcome.state == RunState.COMPLETED, outcome.state
    timeline = await handle.query("timeline", result_type=list[TransitionRecord])
    return span(timeline)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    grouped, inline, delegated = [], [], []
    child = {"delegate": {"goal": "wait", "tools": ["bench_wait"], "max_steps": len(SECONDS), "playbook": _steps()}}
    async with bench_stack(["--tools", "bench.tools,bench.parallel_tools"]) as stack:
        for _ in range(args.rounds):
            grouped.append(await one(stack, [{"parallel": _steps()}]))
            inline.append(await one(stack, _steps()))
            delegated.append(await one(stack, [child]))
    slowest, total = max(SECONDS), sum(SECONDS)
    g, i, c = statistics.median(grouped), statistics.median(inline), statistics.median(delegated)
    print(table(
        ["", "median s", "rounds", "vs slowest step (1.0 s)", "target"],
        [
            ["5-way parallel group", f"{g:.2f}", " ".join(f"{x:.2f}" for x in grouped), f"{g / slowest:.2f}x", f"≤ {TARGET}x"],
            ["same 5 steps inline", f"{i:.2f}", " ".join(f"{x:.2f}" for x in inline), f"{i / slowest:.2f}x", f"(sum {total:.1f} s)"],
            ["same 5 steps in a child run", f"{c:.2f}", " ".join(f"{x:.2f}" for x in delegated), f"{c / slowest:.2f}x",
             f"≤ {CHILD_TARGET}x inline"],
        ],
    ))
    print(f"group / slowest step: {g / slowest:.2f}x ({'met' if g / slowest <= TARGET else 'missed'}); inline / group: {i / g:.2f}x")
    print(f"child run / inline: {c / i:.2f}x ({'met' if c / i <= CHILD_TARGET else 'missed'})")


if __name__ == "__main__":
    asyncio.run(main())
