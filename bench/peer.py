"""Tether against the peer a user would pick instead: pydantic-ai on Temporal, side by side.

    python -m bench.peer [--runs 50] [--steps 5] [--rounds 3] [--parallel-tools] ...

One private dev server, one worker process serving Tether (``worker.create_worker``), the bare
loop and pydantic-ai's agents (``bench.worker_proc --peer``; bench/peer_agents.py). In rotating
rounds, N concurrent runs of M read-only steps of the same ``bench_read`` tool per variant:

- ``governed``: ``AgentRun`` (read-only plan, no approval); with ``--approval`` also
  ``governed+approval`` (one approval per run, as in ``make bench``);
- ``bare``: ``BareAgentLoop`` (bench/bare.py);
- ``pydantic-ai plan``: an agent whose ``FunctionModel`` plans every call in one request, then
  finishes in a second (Tether's structure: 2 model requests, M tools);
- ``pydantic-ai per call``: one model request per tool call, then one that finishes (M + 1).

It prints the table ``make bench`` prints (bench/overhead.py), with activities per run. Needs
the optional extra ``bench`` (``make bench-peer`` installs it).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from typing import Sequence

from temporalio.client import Client, WorkflowHandle

from bench.common import Stack, machine_line, stack_or_new
from bench.overhead import APPROVAL, BARE, GOVERNED, TETHER, Variant, parser, report, run_rounds, worker_args

PEER_PLAN, PEER_STEP = "pydantic-ai plan", "pydantic-ai per call"
PEER_TOOL_ACTIVITY = "toolset__<agent>__call_tool"  # suffix of the agents' tool activity names


def peer_runs(workflow: str, client: Client, parallel: bool) -> Variant:
    from bench.peer_agents import PeerInput

    async def start(stack: Stack, ids: Sequence[str], steps: int, tenant: str) -> list[WorkflowHandle]:
        return list(await asyncio.gather(*(
            client.start_workflow(
                workflow, PeerInput(steps=steps, parallel=parallel), id=i, task_queue=f"{stack.task_queue}-peer"
            )
            for i in ids
        )))

    agent = "peer_plan" if workflow == "PeerPlanWorkflow" else "peer_step"
    name = PEER_PLAN if workflow == "PeerPlanWorkflow" else PEER_STEP
    return Variant(name, start, tool_activity=f"agent__{agent}__{PEER_TOOL_ACTIVITY}")


async def main_async(args, stack: Stack | None = None) -> None:
    try:
        from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    except ImportError:
        raise SystemExit("pydantic-ai is not installed: `make bench-peer` installs the extra `bench`") from None
    from importlib.metadata import version

    print(f"# Tether vs pydantic-ai on Temporal: {args.runs} runs x {args.steps} steps x {args.rounds} "
          f"round(s) per variant")
    print(f"machine: {machine_line()}")
    print(f"pydantic-ai-slim {version('pydantic-ai-slim')} (TemporalDurability capability, PydanticAIWorkflow), "
          f"temporalio {version('temporalio')}; pydantic-ai's tool calls run "
          + ("in parallel (its default)" if args.parallel_tools else "one at a time, as Tether's steps do"))
    wargs = [*worker_args(args), "--peer"]
    async with stack_or_new(stack, wargs, dynamic_config=args.dynamic_config) as stack:
        print(f"dev server {stack.address} (pid {stack.server.pid}), worker pid {stack.worker.pid}, "
              f"worker options: {' '.join(wargs)}")
        # pydantic-ai's client: its plugin sets the payload converter the peer's workflows use.
        peer = await Client.connect(stack.address, namespace="default", plugins=[PydanticAIPlugin()])
        variants = [
            TETHER[GOVERNED], *([TETHER[APPROVAL]] if args.approval else []), TETHER[BARE],
            peer_runs("PeerPlanWorkflow", peer, args.parallel_tools),
            peer_runs("PeerStepWorkflow", peer, args.parallel_tools),
        ]
        rounds = await run_rounds(stack, variants, args)
        stats = await report(stack.client, rounds)
    g, p = stats[GOVERNED], stats[PEER_PLAN]
    ratios = [a / b for a, b in zip(g["per_round"], p["per_round"])]
    print()
    print(f"governed vs {PEER_PLAN}: throughput per round {', '.join(f'{x:.2f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f}; target >= 1.0), history "
          f"{g['bytes'] / 1024:.1f} vs {p['bytes'] / 1024:.1f} KiB/run (target: no larger), events "
          f"{g['events']:.0f} vs {p['events']:.0f}, worker CPU {g['wcpu']:.1f} vs {p['wcpu']:.1f} ms/step")


def parse(argv: list[str] | None = None):
    p = parser(__doc__.splitlines()[0], quiet_approvals=0)
    p.add_argument("--parallel-tools", action="store_true",
                   help="let pydantic-ai run a plan's tool calls concurrently (its default)")
    p.add_argument("--approval", action="store_true",
                   help="also governed+approval (each run waits for one approval), for approval latency "
                        "next to the others' under the same load")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(main_async(parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
