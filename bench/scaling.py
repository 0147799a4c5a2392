"""Cost as work grows: longer runs and more of them at once, governed and bare.

    python -m bench.scaling [--steps 5,50,200] [--concurrency 1,10,100] [--max-total-steps 4000]
        [--can-after 400] [--variants governed,bare]

One private dev server (which suggests continue-as-new after ``--can-after`` events, so the long
runs continue as new a few times; 0 keeps the server's default) and one worker process. For each
run length M and concurrency C (cells with M x C over ``--max-total-steps`` are skipped and
listed), a batch of C runs of M read-only steps per variant. Per cell: wall time per step of a
run, steps/s, history events and bytes per step over the whole continue-as-new chain, worker and
server CPU per step, and for governed runs the ``snapshot`` and ``timeline`` queries' latency and
answer size, sampled while the first run of the batch runs (answered from the worker's cache)
and once after it closed (answered by replaying its last run); for both variants, how long a
replay of the first run's last run takes in process (what any query after close waits for).

Then, per variant and concurrency, what one more step costs between consecutive lengths; a
figure whose marginal cost grows from the first interval to the last, or a query whose answer or
latency grows with the run, is flagged: per-step cost should be flat in run length.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.query.v1 import WorkflowQuery
from temporalio.api.workflowservice.v1 import QueryWorkflowRequest
from temporalio.client import Client

from bench.common import HistoryFacts, Stack, machine_line, percentile, run_facts, stack_or_new, table
from bench.overhead import BARE, GOVERNED, TETHER, run_batch

QUERIES = ("snapshot", "timeline")
GROWTH = 1.25  # marginal cost of a step in the last interval over the first: flagged above this
QUERY_GROWTH = 2.0  # a query's p50 latency or size at the longest run over the shortest


async def query_once(client: Client, workflow_id: str, query: str) -> tuple[float, int]:
    """One query through the raw service API: latency (ms) and the answer's payload bytes."""
    t0 = time.perf_counter()
    resp = await client.workflow_service.query_workflow(
        QueryWorkflowRequest(
            namespace=client.namespace,
            execution=WorkflowExecution(workflow_id=workflow_id),
            query=WorkflowQuery(query_type=query),
        )
    )
    return (time.perf_counter() - t0) * 1000, sum(p.ByteSize() for p in resp.query_result.payloads)


QUERY_EVERY = 0.5  # seconds between live samples: the worker's CPU for answering stays ~1% of a run's


async def sample_queries(client: Client, workflow_id: str, stop: asyncio.Event, out: dict) -> None:
    """Query the run every QUERY_EVERY seconds until ``stop``: (latency ms, bytes) per query."""
    while not stop.is_set():
        for q in QUERIES:
            try:
                out[q].append(await query_once(client, workflow_id, q))
            except Exception:  # not started yet, or closed between two queries
                pass
        try:  # quickly until the run answers, then every QUERY_EVERY seconds
            await asyncio.wait_for(stop.wait(), QUERY_EVERY if all(out.values()) else 0.05)
        except asyncio.TimeoutError:
            pass


async def replay_ms(client: Client, workflow_id: str, variant: str) -> float:
    """What a query after close costs the worker, governed or bare alike: a replay of the
    chain's last run (its history fetched once; the second of two replays timed, in process)."""
    from bench.bare import BareAgentLoop
    from worker import WORKFLOW_RUNNER, create_replayer
    from workflows.agent_run import AgentRun

    history = await client.get_workflow_handle(workflow_id).fetch_history()
    replayer = create_replayer(workflows=[AgentRun if variant == GOVERNED else BareAgentLoop],
                               data_converter=client.data_converter, workflow_runner=WORKFLOW_RUNNER)
    await replayer.replay_workflow(history)
    t0 = time.perf_counter()
    await replayer.replay_workflow(history)
    return (time.perf_counter() - t0) * 1000


async def cell(stack, variant: str, steps: int, concurrency: int, tag: str) -> dict:
    live: dict[str, list[tuple[float, int]]] = {q: [] for q in QUERIES}
    stop = asyncio.Event()
    sampler = None
    if variant == GOVERNED:
        sampler = asyncio.create_task(sample_queries(stack.client, f"{tag}-0000", stop, live))
    batch = await run_batch(stack, TETHER[variant], concurrency, steps, tag)
    stop.set()
    if sampler is not None:
        await sampler
    after = {}
    if variant == GOVERNED:
        for q in QUERIES:
            after[q] = await query_once(stack.client, batch.handles[0].id, q)
    sem = asyncio.Semaphore(20)
    facts: list[HistoryFacts] = list(await asyncio.gather(*(run_facts(stack.client, h.id, h.first_execution_run_id, sem=sem) for h in batch.handles)))
    total = concurrency * steps
    return dict(
        variant=variant, steps=steps, concurrency=concurrency, seconds=batch.seconds,
        ms_step=batch.seconds / steps * 1000, sps=total / batch.seconds,
        runs_in_chain=statistics.mean(f.runs for f in facts),
        events=statistics.mean(f.events for f in facts), bytes=statistics.mean(f.bytes for f in facts),
        trouble=statistics.mean(f.task_trouble for f in facts),
        wcpu=batch.worker_cpu / total * 1000, scpu=batch.server_cpu / total * 1000,
        live={q: live[q] for q in QUERIES}, after=after,
        replay=await replay_ms(stack.client, batch.handles[0].id, variant),
    )


def _q(samples: list[tuple[float, int]]) -> str:
    if not samples:
        return "-"
    return f"{percentile([s[0] for s in samples], 50):.1f} ms, {max(s[1] for s in samples) / 1024:.1f} KiB"


def _after(after: dict, q: str) -> str:
    if q not in after:
        return "-"
    latency, size = after[q]
    return f"{latency:.0f} ms, {size / 1024:.1f} KiB"


def flags(cells: list[dict]) -> list[str]:
    """What grows with run length: marginal per-step cost, first interval against the last."""
    out = []
    for variant in dict.fromkeys(c["variant"] for c in cells):
        for conc in sorted({c["concurrency"] for c in cells if c["variant"] == variant}):
            row = sorted((c for c in cells if c["variant"] == variant and c["concurrency"] == conc),
                         key=lambda c: c["steps"])
            if len(row) < 3:
                continue
            for key, label, unit in (("events", "events", ""), ("bytes", "history bytes", " B"),
                                     ("wcpu_run", "worker CPU", " ms")):
                per_run = [c["wcpu"] * c["steps"] if key == "wcpu_run" else c[key] for c in row]
                first = (per_run[1] - per_run[0]) / (row[1]["steps"] - row[0]["steps"])
                last = (per_run[-1] - per_run[-2]) / (row[-1]["steps"] - row[-2]["steps"])
                verdict = "GROWS" if first > 0 and last > GROWTH * first else "flat"
                noisy = key == "events" and any(c["trouble"] for c in row)
                out.append(f"{verdict:<5} {variant} x{conc}: {label}, one more step costs "
                           f"{first:.1f}{unit} from {row[0]['steps']} to {row[1]['steps']} steps, "
                           f"{last:.1f}{unit} from {row[-2]['steps']} to {row[-1]['steps']}"
                           + (" (with workflow task timeouts in these runs: partly load)" if noisy else ""))
            bare = {c["steps"]: c for c in cells if c["variant"] == BARE and c["concurrency"] == conc}
            if variant == GOVERNED and row[-1]["steps"] in bare:
                # A replay grows with the run for any workflow: governance's share is the ratio.
                longest = row[-1]["steps"]
                ratio = row[-1]["replay"] / max(bare[longest]["replay"], 0.1)
                out.append(f"{'GROWS' if ratio > QUERY_GROWTH else 'flat':<5} {variant} x{conc}: replay of the last "
                           f"run at {longest} steps {row[-1]['replay']:.0f} ms, {ratio:.2f}x bare's "
                           f"{bare[longest]['replay']:.0f} ms (what a query after close waits for)")
            if variant == GOVERNED:
                for q in QUERIES:
                    a, b = row[0]["live"][q], row[-1]["live"][q]
                    if not a or not b:
                        continue
                    lat_a, lat_b = percentile([s[0] for s in a], 50), percentile([s[0] for s in b], 50)
                    size_a, size_b = max(s[1] for s in a), max(s[1] for s in b)
                    grows = lat_b > QUERY_GROWTH * lat_a or size_b > QUERY_GROWTH * size_a
                    out.append(f"{'GROWS' if grows else 'flat':<5} {variant} x{conc}: {q} query "
                               f"{lat_a:.1f} -> {lat_b:.1f} ms p50, {size_a / 1024:.1f} -> {size_b / 1024:.1f} KiB "
                               f"from {row[0]['steps']} to {row[-1]['steps']} steps (live)")
                    aa, ab = row[0]["after"].get(q), row[-1]["after"].get(q)
                    if aa and ab:
                        grows = ab[0] > QUERY_GROWTH * aa[0]
                        out.append(f"{'GROWS' if grows else 'flat':<5} {variant} x{conc}: {q} query after "
                                   f"close {aa[0]:.0f} -> {ab[0]:.0f} ms (a replay of the last run)")
    return out


async def main_async(args: argparse.Namespace, stack: Stack | None = None) -> None:
    lengths = [int(x) for x in args.steps.split(",")]
    concurrency = [int(x) for x in args.concurrency.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in (GOVERNED, BARE):
            raise SystemExit(f"unknown variant {v!r}: governed, bare")
    dynamic = list(args.dynamic_config)
    if args.can_after:
        dynamic.append(f"limit.historyCount.suggestContinueAsNew={args.can_after}")
    print(f"# Tether scaling benchmark: {', '.join(map(str, lengths))} steps x "
          f"{', '.join(map(str, concurrency))} concurrent runs; {', '.join(variants)}")
    print(f"machine: {machine_line()}")
    cells, skipped = [], []
    async with stack_or_new(stack, dynamic_config=dynamic) as stack:
        print(f"dev server {stack.address} (pid {stack.server.pid}; continue-as-new suggested after "
              f"{args.can_after or 'the default number of'} events), worker pid {stack.worker.pid}")
        stamp = uuid.uuid4().hex[:6]
        for v in variants if args.warmup else ():  # warm-up, not counted
            await run_batch(stack, TETHER[v], args.warmup, 5, f"w{stamp}{v[:3]}")
        for conc in concurrency:
            for steps in lengths:
                if steps * conc > args.max_total_steps:
                    skipped.append(f"{steps} steps x {conc}")
                    continue
                for n, v in enumerate(variants if (steps + conc) % 2 else variants[::-1]):
                    c = await cell(stack, v, steps, conc, f"s{stamp}-{steps}-{conc}-{v[:3]}")
                    cells.append(c)
                    print(f"  {v:<8} {steps:>4} steps x {conc:>3}: {c['seconds']:.1f}s, "
                          f"{c['sps']:.1f} steps/s", flush=True)
    cells.sort(key=lambda c: (c["variant"] != GOVERNED, c["concurrency"], c["steps"]))
    print()
    print(table(
        ["variant", "steps", "concurrent", "runs in chain", "ms/step (wall, one run)", "steps/s",
         "events/step", "KiB/step", "task timeouts/run", "worker CPU ms/step", "server CPU ms/step",
         "snapshot live p50, max size", "timeline live p50, max size", "snapshot after close",
         "timeline after close", "replay of the last run"],
        [[c["variant"], c["steps"], c["concurrency"], f"{c['runs_in_chain']:.1f}", f"{c['ms_step']:.1f}",
          f"{c['sps']:.1f}", f"{c['events'] / c['steps']:.1f}", f"{c['bytes'] / 1024 / c['steps']:.2f}",
          f"{c['trouble']:.1f}",
          f"{c['wcpu']:.1f}", f"{c['scpu']:.1f}", _q(c["live"]["snapshot"]), _q(c["live"]["timeline"]),
          _after(c["after"], "snapshot"), _after(c["after"], "timeline"), f"{c['replay']:.0f} ms"]
         for c in cells],
    ))
    if skipped:
        print(f"\nskipped (over --max-total-steps {args.max_total_steps}): {', '.join(skipped)}")
    found = flags(cells)
    if found:
        print("\nper-step cost against run length (flagged when the last interval's marginal cost is "
              f"over {GROWTH}x the first's; queries over {QUERY_GROWTH}x):")
        for line in found:
            print(f"  {line}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", default="5,50,200", help="run lengths, comma-separated")
    p.add_argument("--concurrency", default="1,10,100", help="concurrent runs, comma-separated")
    p.add_argument("--max-total-steps", type=int, default=4000,
                   help="skip cells with more steps x concurrent runs than this")
    p.add_argument("--can-after", type=int, default=400,
                   help="the dev server suggests continue-as-new after this many events (0: its default)")
    p.add_argument("--variants", default=f"{GOVERNED},{BARE}")
    p.add_argument("--warmup", type=int, default=5, help="runs of 5 steps per variant before measuring")
    p.add_argument("--dynamic-config", action="append", default=[],
                   help="dev server dynamic config KEY=VALUE (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(main_async(parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
