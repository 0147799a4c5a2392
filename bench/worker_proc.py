"""The worker under test, in a process of its own so its RSS can be read from /proc.

    python -m bench.worker_proc --address 127.0.0.1:PORT --task-queue Q [--tools bench.tools]
        [--option max_cached_workflows=2000] [--autoscale-pollers] [--peer] [--policy FILE]
        [--planner NAME=MODULE:ATTR ...]

Built with ``worker.create_worker`` (the same settings as a production worker), plus the bare
baseline workflow on the same worker, task queue and activities, so both paths share one
process, one cache and one set of pollers. With ``--peer`` (``make bench-peer``), the same
process also serves pydantic-ai's Temporal agents (bench/peer_agents.py) on the queue
``<task queue>-peer``, with the same worker options, through a client carrying
``PydanticAIPlugin`` as a pydantic-ai user's would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from datetime import timedelta
from typing import Any

from temporalio.worker import PollerBehaviorAutoscaling, Worker

from tether.planners.planning import load_planners
from tether.policy.files import PolicyStore
from tether.tools.sdk import load_tool_modules
from bench.bare import BareAgentLoop
from tether.client import connect
from worker import create_worker


def parse_options(pairs: list[str], autoscale: bool) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    if autoscale:
        options["workflow_task_poller_behavior"] = PollerBehaviorAutoscaling()
        options["activity_task_poller_behavior"] = PollerBehaviorAutoscaling()
    return options


async def peer_worker(args: argparse.Namespace, options: dict[str, Any]) -> Worker:
    """pydantic-ai's agents on their own queue; the plugin registers their activities."""
    from temporalio.client import Client

    from bench.peer_agents import PEER_WORKFLOWS
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin

    client = await Client.connect(args.address, namespace="default", plugins=[PydanticAIPlugin()])
    return Worker(
        client, task_queue=f"{args.task_queue}-peer", workflows=PEER_WORKFLOWS,
        graceful_shutdown_timeout=timedelta(seconds=10), **options,
    )


async def serve(args: argparse.Namespace) -> None:
    registry = load_tool_modules(args.tools.split(","))
    # A policy file (bench/agentdojo.py's governance configurations); none: the built-in default.
    policy = PolicyStore.from_env(args.policy) if args.policy else None
    client = await connect(target_host=args.address, namespace="default")
    options = parse_options(args.option, args.autoscale_pollers)
    # create_worker's configuration (its TetherPlugin), with the bare baseline next to AgentRun.
    planners = load_planners(args.planner)  # the built-in ones, and those named (bench/agentdojo.py's pipeline)
    worker = create_worker(client, task_queue=args.task_queue, registry=registry, policy=policy, planners=planners,
                           extra_workflows=[BareAgentLoop], **options)
    peer = await peer_worker(args, options) if args.peer else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with worker, (peer or contextlib.nullcontext()):
        shown = {k: (type(v).__name__ if not isinstance(v, (int, float, str, bool)) else v)
                 for k, v in options.items()}
        print(f"bench worker ready on {args.task_queue} options={shown}", flush=True)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--task-queue", required=True)
    parser.add_argument("--tools", default="bench.tools")
    parser.add_argument("--policy", help="a TOML policy file (default: the built-in default)")
    parser.add_argument("--option", action="append", default=[],
                        help="a Worker option as key=JSON value (repeatable)")
    parser.add_argument("--autoscale-pollers", action="store_true",
                        help="PollerBehaviorAutoscaling for workflow and activity pollers")
    parser.add_argument("--planner", action="append", default=[],
                        help="a planner runs may name, NAME=MODULE:ATTR (repeatable), as worker.py's")
    parser.add_argument("--peer", action="store_true",
                        help="also serve pydantic-ai's agents (bench/peer_agents.py, extra `bench`)")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
