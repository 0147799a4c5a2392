"""What governance costs: AgentRun against a bare Temporal agent loop, side by side.

    python -m bench.overhead [--runs 50] [--steps 5] [--rounds 3] [--worker-option KEY=JSON]...

One private dev server, one worker process (built with ``worker.create_worker``; it serves both
workflows on one task queue). Each round runs a batch of N concurrent runs of M steps for each
variant, in a rotating order so machine noise hits all of them:

- ``governed``: ``AgentRun`` with read-only tools (policy needs no approval);
- ``governed+approval``: ``AgentRun`` whose plan writes once, so each run waits for one
  approval; the benchmark sends it as soon as the run shows ``AgentRunState=AWAITING_APPROVAL``;
- ``bare``: ``BareAgentLoop`` (bench/bare.py) calling the same ``plan`` and ``execute_tool``
  activities.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle

from bench.common import (
    approve_pending,
    bench_stack,
    cpu_seconds,
    machine_line,
    peak_rss_mb,
    percentile,
    rss_mb,
    table,
)
from client import start_run
from workflows.models import RunRequest

GOVERNED, APPROVAL, BARE = "governed", "governed+approval", "bare"
VARIANTS = (GOVERNED, APPROVAL, BARE)


def playbook(variant: str, steps: int) -> list[dict]:
    reads = [{"tool": "bench_read", "args": {"key": f"k{i}"}} for i in range(steps)]
    if variant == APPROVAL:  # the first step writes: the plan needs one approval
        reads[0] = {"tool": "bench_write", "args": {"key": "k0"}}
    return reads


@dataclass
class Batch:
    variant: str
    runs: int
    seconds: float
    worker_cpu: float
    server_cpu: float
    handles: list[WorkflowHandle]
    signals: dict[str, float] = field(default_factory=dict)  # run id -> signal sent (epoch s)


async def approve_when_waiting(
    client: Client, tenant: str, expected: int, signals: dict[str, float]
) -> None:
    """Approve every run of the batch as soon as visibility shows it waiting."""
    query = f"AgentTenant='{tenant}' AND AgentRunState='AWAITING_APPROVAL'"
    sent: list[asyncio.Task] = []

    async def approve(run_id: str) -> None:
        signals[run_id] = time.time()
        await approve_pending(client, run_id)

    while len(signals) < expected:
        async for wf in client.list_workflows(query, page_size=1000):
            if wf.id not in signals:
                signals[wf.id] = 0.0
                sent.append(asyncio.create_task(approve(wf.id)))
        await asyncio.sleep(0.01)
    await asyncio.gather(*sent)


async def run_batch(stack, variant: str, runs: int, steps: int, tag: str) -> Batch:
    client = stack.client
    tenant = f"bench-{tag}"
    book = playbook(variant, steps)
    request = RunRequest.model_validate(
        {"goal": f"benchmark {variant}", "tenant": tenant, "requested_by": "bench", "playbook": book}
    )
    ids = [f"{tag}-{i:04d}" for i in range(runs)]
    signals: dict[str, float] = {}
    cpu_w0, cpu_s0 = cpu_seconds(stack.worker.pid), cpu_seconds(stack.server.pid)
    t0 = time.perf_counter()
    approver = None
    if variant == APPROVAL:
        approver = asyncio.create_task(approve_when_waiting(client, tenant, runs, signals))
    if variant == BARE:
        handles = await asyncio.gather(*(
            client.start_workflow("BareAgentLoop", request, id=i, task_queue=stack.task_queue)
            for i in ids
        ))
    else:
        handles = await asyncio.gather(*(
            start_run(client, request, run_id=i, queue=stack.task_queue) for i in ids
        ))
    await asyncio.gather(*(h.result() for h in handles))
    seconds = time.perf_counter() - t0
    if approver is not None:
        await approver
    return Batch(
        variant, runs, seconds,
        cpu_seconds(stack.worker.pid) - cpu_w0, cpu_seconds(stack.server.pid) - cpu_s0,
        list(handles), signals,
    )


def _ts(event) -> float:
    return event.event_time.seconds + event.event_time.nanos / 1e9


async def history_stats(batch: Batch) -> tuple[list[int], list[float], list[float], Counter, list[int]]:
    """Events per run; approval latency (client signal -> tool start, and server signal event ->
    tool start) in ms; event types of the first run; history bytes per run."""
    lengths, client_lat, server_lat, sizes = [], [], [], []
    kinds: Counter = Counter()
    sem = asyncio.Semaphore(20)

    async def one(h: WorkflowHandle, first: bool) -> None:
        async with sem:
            history = await h.fetch_history()
        events = history.events
        lengths.append(len(events))
        sizes.append(sum(e.ByteSize() for e in events))
        if first:
            kinds.update(EventType.Name(e.event_type).removeprefix("EVENT_TYPE_") for e in events)
        if batch.variant != APPROVAL:
            return
        signaled = next(e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
        scheduled = next(
            e for e in events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.event_id > signaled.event_id
            and e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"
        )
        started = next(
            e for e in events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
            and e.activity_task_started_event_attributes.scheduled_event_id == scheduled.event_id
        )
        client_lat.append((_ts(started) - batch.signals[h.id]) * 1000)
        server_lat.append((_ts(started) - _ts(signaled)) * 1000)

    await asyncio.gather(*(one(h, i == 0) for i, h in enumerate(batch.handles)))
    return lengths, client_lat, server_lat, kinds, sizes


async def main_async(args: argparse.Namespace) -> None:
    print(f"# Tether overhead benchmark: {args.runs} runs x {args.steps} steps x {args.rounds} "
          f"round(s) per variant")
    print(f"machine: {machine_line()}")
    worker_args = [a for opt in args.worker_option for a in ("--option", opt)]
    if args.autoscale_pollers:
        worker_args.append("--autoscale-pollers")
    async with bench_stack(worker_args, dynamic_config=args.dynamic_config) as stack:
        print(f"dev server {stack.address} (pid {stack.server.pid}), worker pid {stack.worker.pid}, "
              f"worker options: {' '.join(worker_args) or 'create_worker defaults'}")
        stamp = uuid.uuid4().hex[:6]
        # Warm-up: imports, sandbox, caches and connections; not counted.
        for variant in VARIANTS:
            await run_batch(stack, variant, min(args.runs, 10), args.steps, f"w{stamp}{variant[:4]}{variant[-3:]}")
        batches: list[Batch] = []
        worker_rss_max = 0.0
        server_rss_max = 0.0
        for r in range(args.rounds):
            order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
            for variant in order:
                tag = f"r{r}{stamp}{VARIANTS.index(variant)}"
                b = await run_batch(stack, variant, args.runs, args.steps, tag)
                batches.append(b)
                worker_rss_max = max(worker_rss_max, rss_mb(stack.worker.pid))
                server_rss_max = max(server_rss_max, rss_mb(stack.server.pid))
                print(f"  round {r + 1} {variant:<18} {b.runs / b.seconds:7.1f} runs/s "
                      f"({b.seconds:.2f}s)", flush=True)
        # Approval latency without load: one run at a time.
        quiet_c, quiet_s = [], []
        for i in range(args.quiet_approvals):
            b = await run_batch(stack, APPROVAL, 1, args.steps, f"q{stamp}{i:03d}")
            _, c, s, _, _ = await history_stats(b)
            quiet_c += c
            quiet_s += s
        worker_peak = peak_rss_mb(stack.worker.pid)
        server_peak = peak_rss_mb(stack.server.pid)

        stats = {}
        for variant in VARIANTS:
            mine = [b for b in batches if b.variant == variant]
            lengths, c_lat, s_lat, kinds, sizes = [], [], [], Counter(), []
            for b in mine:
                l, c, s, k, z = await history_stats(b)
                lengths += l
                sizes += z
                c_lat += c
                s_lat += s
                kinds = kinds or k
            runs = sum(b.runs for b in mine)
            secs = sum(b.seconds for b in mine)
            stats[variant] = dict(
                runs=runs, secs=secs, rps=runs / secs, sps=runs * args.steps / secs,
                events=statistics.mean(lengths), bytes=statistics.mean(sizes), c_lat=c_lat, s_lat=s_lat, kinds=kinds,
                wcpu=sum(b.worker_cpu for b in mine) / (runs * args.steps) * 1000,
                scpu=sum(b.server_cpu for b in mine) / (runs * args.steps) * 1000,
                per_round=[b.runs / b.seconds for b in mine],
            )

    bare = stats[BARE]
    rows = []
    for variant in VARIANTS:
        s = stats[variant]
        rows.append([
            variant, s["runs"], f"{s['rps']:.1f}", f"{s['sps']:.1f}",
            f"{s['rps'] / bare['rps']:.2f}",
            f"{s['events']:.0f}", f"{s['events'] / args.steps:.1f}", f"{s['bytes'] / 1024:.1f}",
            f"{s['wcpu']:.1f}", f"{s['scpu']:.1f}",
        ])
    print()
    print(table(
        ["variant", "runs", "runs/s", "steps/s", "vs bare", "events/run", "events/step", "history KiB/run",
         "worker CPU ms/step", "server CPU ms/step"],
        rows,
    ))
    ratios = [g / b for g, b in zip(stats[GOVERNED]["per_round"], bare["per_round"])]
    print()
    print(f"governed/bare throughput per round: {', '.join(f'{x:.2f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f})")
    cpu = {v: stats[v]["wcpu"] + stats[v]["scpu"] for v in VARIANTS}
    print(f"CPU per step, worker + dev server: governed {cpu[GOVERNED]:.1f} ms, "
          f"governed+approval {cpu[APPROVAL]:.1f} ms, bare {cpu[BARE]:.1f} ms -> when the box is "
          f"CPU-bound, governed/bare throughput tends to {cpu[BARE] / cpu[GOVERNED]:.2f}")
    a = stats[APPROVAL]
    print(f"approval signal -> tool start, under load ({len(a['c_lat'])} approvals, sent in "
          f"bursts of {args.runs} while the batch runs): p50 {percentile(a['c_lat'], 50):.0f} ms, "
          f"p99 {percentile(a['c_lat'], 99):.0f} ms (from the server's signal event: "
          f"p50 {percentile(a['s_lat'], 50):.0f} ms, p99 {percentile(a['s_lat'], 99):.0f} ms)")
    if quiet_c:
        print(f"approval signal -> tool start, one run at a time ({len(quiet_c)} approvals): "
              f"p50 {percentile(quiet_c, 50):.0f} ms, p99 {percentile(quiet_c, 99):.0f} ms "
              f"(from the server's signal event: p50 {percentile(quiet_s, 50):.0f} ms, "
              f"p99 {percentile(quiet_s, 99):.0f} ms)")
    print(f"worker peak RSS {worker_peak:.0f} MiB (max sampled {worker_rss_max:.0f} MiB); "
          f"dev server peak RSS {server_peak:.0f} MiB")
    print()
    print("history events of one run, by type:")
    kinds = sorted(set().union(*(stats[v]["kinds"] for v in VARIANTS)))
    print(table(["event type", *VARIANTS], [[k, *(stats[v]["kinds"].get(k, 0) for v in VARIANTS)] for k in kinds]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="concurrent runs per batch (N)")
    parser.add_argument("--steps", type=int, default=5, help="tool steps per run (M)")
    parser.add_argument("--rounds", type=int, default=3, help="batches per variant, interleaved")
    parser.add_argument("--quiet-approvals", type=int, default=20,
                        help="approvals measured one run at a time, after the rounds")
    parser.add_argument("--worker-option", action="append", default=[],
                        help="Worker option for the worker under test, KEY=JSON (repeatable)")
    parser.add_argument("--autoscale-pollers", action="store_true")
    parser.add_argument("--dynamic-config", action="append", default=[],
                        help="dev server dynamic config KEY=VALUE (repeatable)")
    asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
