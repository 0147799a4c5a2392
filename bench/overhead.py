"""What governance costs: AgentRun against a bare Temporal agent loop, side by side.

    python -m bench.overhead [--runs 50] [--steps 5] [--rounds 3] [--worker-option KEY=JSON]...

One private dev server, one worker process (built with ``worker.create_worker``; it serves both
workflows on one task queue). Each round runs a batch of N concurrent runs of M steps for each
variant, in a rotating order so machine noise hits all of them:

- ``governed``: ``AgentRun`` with read-only tools (policy needs no approval);
- ``governed+approval``: ``AgentRun`` whose plan writes once, so each run waits for one
  approval; the benchmark sends it as soon as the run shows ``AgentRunState=AWAITING_APPROVAL``;
- ``governed+writes``: ``AgentRun`` whose every step writes (one approval): a write step's
  worker CPU, which the effect ledger's cost per write is measured against (bench/ledger.py);
- ``bare``: ``BareAgentLoop`` (bench/bare.py) calling the same ``plan`` and ``execute_tool``
  activities;
- ``bare+approval``: the bare loop waiting for one ``approve`` signal before its first tool,
  listed as waiting by the same search attributes and approved the same way: the baseline of
  ``governed+approval``'s reaction to its approval.

Besides throughput, CPU and history per run, it reports latency under the same load: every
activity's schedule-to-start (the queue), an activity's completion to the next one's schedule
(one workflow task reacting to an event), and for the approval variant the server's signal
event to the tool's schedule and start: what governance adds to reacting is the difference
between that and ``bare+approval``'s, measured at the same clock points (the server's signal
event, the tool's schedule) under the same burst of approvals. One run at a time, after the
rounds, the approvals alternate with bare approvals, so both are measured in one machine state.

The approver finds waiting runs by listing visibility, as the inbox does, and takes the pending
request from the view the run published in its memo (no query per run: a query is one more task
for the worker, in the window the other runs' reactions are measured in).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Sequence

from temporalio.client import Client, WorkflowExecution, WorkflowHandle

from bench.common import (
    HistoryFacts,
    Stack,
    approve_pending,
    cpu_seconds,
    listed_pending,
    machine_line,
    ms,
    peak_rss_mb,
    percentile,
    rss_mb,
    run_facts,
    eager_line,
    server_counter,
    stack_or_new,
    table,
)
from bench import ledger
from bench.profile import Recorder, report as profile_report
from tether.client import start_run
from workflows.run_state import RunRequest

GOVERNED, APPROVAL, WRITES, BARE = "governed", "governed+approval", "governed+writes", "bare"
BARE_APPROVAL = "bare+approval"
APPROVER_POLL = 0.01  # seconds between the approver's listings
VARIANTS = (GOVERNED, APPROVAL, WRITES, BARE, BARE_APPROVAL)


def playbook(variant: str, steps: int) -> list[dict]:
    reads = [{"tool": "bench_read", "args": {"key": f"k{i}"}} for i in range(steps)]
    if variant == APPROVAL:  # the first step writes: the plan needs one approval
        reads[0] = {"tool": "bench_write", "args": {"key": "k0"}}
    if variant == WRITES:  # every step writes (one approval covers them)
        return [{"tool": "bench_write", "args": {"key": f"k{i}"}} for i in range(steps)]
    return reads


def bench_request(variant: str, steps: int, tenant: str) -> RunRequest:
    return RunRequest.model_validate({
        "goal": f"benchmark {variant}", "tenant": tenant, "requested_by": "bench",
        "playbook": playbook(variant, steps), "limits": {"max_steps": max(steps, 20)},
    })


StartFn = Callable[[Stack, Sequence[str], int, str], Awaitable[list[WorkflowHandle]]]
ApproveFn = Callable[[Client, WorkflowExecution], Awaitable[None]]


async def approve_governed(client: Client, wf: WorkflowExecution) -> None:
    """The request from the listing's view, as the inbox takes it: no query to the worker."""
    await approve_pending(client, wf.id, pending=await listed_pending(wf))


async def approve_bare(client: Client, wf: WorkflowExecution) -> None:
    await client.get_workflow_handle(wf.id).signal("approve")


@dataclass(frozen=True)
class Variant:
    """One way of running the same M steps: how a batch of its runs starts."""

    name: str
    start: StartFn
    # Each run waits for one approval, sent this way as soon as it shows waiting.
    approve: ApproveFn | None = None
    tool_activity: str = "execute_tool"

    @property
    def approvals(self) -> bool:
        return self.approve is not None


def agent_runs(variant: str) -> StartFn:
    async def start(stack: Stack, ids: Sequence[str], steps: int, tenant: str) -> list[WorkflowHandle]:
        request = bench_request(variant, steps, tenant)
        return list(await asyncio.gather(*(
            start_run(stack.client, request, run_id=i, queue=stack.task_queue) for i in ids
        )))
    return start


def bare_runs(wait_for_approval: bool) -> StartFn:
    async def start(stack: Stack, ids: Sequence[str], steps: int, tenant: str) -> list[WorkflowHandle]:
        request = bench_request(BARE, steps, tenant)
        return list(await asyncio.gather(*(
            stack.client.start_workflow("BareAgentLoop", args=[request, wait_for_approval], id=i, task_queue=stack.task_queue)
            for i in ids
        )))
    return start


start_bare = bare_runs(False)

TETHER = {
    GOVERNED: Variant(GOVERNED, agent_runs(GOVERNED)),
    APPROVAL: Variant(APPROVAL, agent_runs(APPROVAL), approve=approve_governed),
    WRITES: Variant(WRITES, agent_runs(WRITES), approve=approve_governed),
    BARE: Variant(BARE, start_bare),
    BARE_APPROVAL: Variant(BARE_APPROVAL, bare_runs(True), approve=approve_bare),
}


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
    client: Client, tenant: str, expected: int, signals: dict[str, float], approve_one: ApproveFn
) -> None:
    """Approve every run of the batch as soon as visibility shows it waiting."""
    query = f"AgentTenant='{tenant}' AND AgentRunState='AWAITING_APPROVAL'"
    sent: list[asyncio.Task] = []

    async def approve(wf: WorkflowExecution) -> None:
        signals[wf.id] = time.time()
        await approve_one(client, wf)

    while len(signals) < expected:
        async for wf in client.list_workflows(query, page_size=1000):
            if wf.id not in signals:
                signals[wf.id] = 0.0
                sent.append(asyncio.create_task(approve(wf)))
        await asyncio.sleep(APPROVER_POLL)
    await asyncio.gather(*sent)


async def run_batch(stack: Stack, variant: Variant, runs: int, steps: int, tag: str) -> Batch:
    tenant = f"bench-{tag}"
    ids = [f"{tag}-{i:04d}" for i in range(runs)]
    signals: dict[str, float] = {}
    cpu_w0, cpu_s0 = cpu_seconds(stack.worker.pid), cpu_seconds(stack.server.pid)
    t0 = time.perf_counter()
    approver = None
    if variant.approve is not None:
        approver = asyncio.create_task(approve_when_waiting(stack.client, tenant, runs, signals, variant.approve))
    handles = await variant.start(stack, ids, steps, tenant)
    await asyncio.gather(*(h.result() for h in handles))
    seconds = time.perf_counter() - t0
    if approver is not None:
        await approver
    return Batch(
        variant.name, runs, seconds,
        cpu_seconds(stack.worker.pid) - cpu_w0, cpu_seconds(stack.server.pid) - cpu_s0,
        list(handles), signals,
    )


async def batch_facts(client: Client, batch: Batch, variant: Variant) -> list[HistoryFacts]:
    sem = asyncio.Semaphore(20)
    return list(await asyncio.gather(*(
        run_facts(client, h.id, h.first_execution_run_id, tool_activity=variant.tool_activity, sem=sem) for h in batch.handles
    )))


def client_latency(batch: Batch, facts: list[HistoryFacts]) -> list[float]:
    """Client signal sent -> tool started, ms (the server's start time minus the client's clock:
    one machine, one clock)."""
    out = []
    for h, f in zip(batch.handles, facts):
        if f.approval_to_start and batch.signals.get(h.id):
            started = f.signaled_at[-1] + f.approval_to_start[-1] / 1000
            out.append((started - batch.signals[h.id]) * 1000)
    return out


@dataclass
class Rounds:
    variants: list[Variant]
    steps: int
    batches: list[Batch]
    worker_rss_max: float
    server_rss_max: float
    worker_peak: float
    server_peak: float
    quiet: list[tuple[Batch, list[HistoryFacts]]]
    profiles: dict[str, Path] = field(default_factory=dict)  # variant -> py-spy stacks (--profile)
    stack: Stack | None = None
    eager_before: float | None = None  # the server's eager activity count when the measuring began


async def run_rounds(stack: Stack, variants: Sequence[Variant], args: argparse.Namespace) -> Rounds:
    """Warm-up, then ``args.rounds`` rounds of one batch per variant in rotating order, then
    ``args.quiet_approvals`` approvals one run at a time (when a variant waits for approvals),
    each followed by one of ``bare+approval`` when it is among the variants: the two are
    measured in the same machine state (a server still digesting the rounds is slower)."""
    variants = list(variants)
    stamp = uuid.uuid4().hex[:6]
    # Warm-up: imports, sandbox, caches and connections; not counted.
    for n, variant in enumerate(variants):
        if args.warmup:
            await run_batch(stack, variant, min(args.runs, args.warmup), args.steps, f"w{stamp}{n}")
    batches: list[Batch] = []
    eager_before = server_counter(stack.metrics_port, stack.task_queue, "activity_eager_execution")
    worker_rss_max = server_rss_max = 0.0
    recorders: dict[str, Recorder] = {}
    if getattr(args, "profile", None):
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        for variant in variants:
            path = Path(args.profile) / f"{re.sub(r'[^A-Za-z0-9]+', '-', variant.name)}.txt"
            path.unlink(missing_ok=True)
            recorders[variant.name] = Recorder(stack.worker.pid, path)
    for r in range(args.rounds):
        k = r % len(variants)
        for variant in variants[k:] + variants[:k]:
            tag = f"r{r}{stamp}{variants.index(variant)}"
            if recorders:
                await asyncio.to_thread(recorders[variant.name].start)
            b = await run_batch(stack, variant, args.runs, args.steps, tag)
            if recorders:
                await asyncio.to_thread(recorders[variant.name].stop)
            batches.append(b)
            worker_rss_max = max(worker_rss_max, rss_mb(stack.worker.pid))
            server_rss_max = max(server_rss_max, rss_mb(stack.server.pid))
            print(f"  round {r + 1} {variant.name:<18} {b.runs / b.seconds:7.1f} runs/s "
                  f"({b.seconds:.2f}s)", flush=True)
    quiet = []
    approving = [v for v in variants if v.approvals and v.name != BARE_APPROVAL][:1]
    approving += [v for v in variants if v.name == BARE_APPROVAL and approving]
    for i in range(args.quiet_approvals if approving else 0):
        for n, variant in enumerate(approving):
            b = await run_batch(stack, variant, 1, args.steps, f"q{stamp}{n}{i:03d}")
            quiet.append((b, await batch_facts(stack.client, b, variant)))
    return Rounds(
        variants, args.steps, batches, worker_rss_max, server_rss_max,
        peak_rss_mb(stack.worker.pid), peak_rss_mb(stack.server.pid), quiet,
        {n: r.path for n, r in recorders.items()}, stack, eager_before,
    )


async def report(client: Client, rounds: Rounds, base: str = BARE) -> dict[str, dict]:
    """Print the tables ``make bench`` prints (peer.py prints the same); returns the figures."""
    steps = rounds.steps
    stats: dict[str, dict] = {}
    for variant in rounds.variants:
        mine = [b for b in rounds.batches if b.variant == variant.name]
        facts: list[HistoryFacts] = []
        c_lat: list[float] = []
        for b in mine:
            f = await batch_facts(client, b, variant)
            facts += f
            c_lat += client_latency(b, f)
        runs = sum(b.runs for b in mine)
        secs = sum(b.seconds for b in mine)
        pooled = lambda attr: [x for f in facts for x in getattr(f, attr)]  # noqa: E731
        stats[variant.name] = dict(
            runs=runs, secs=secs, rps=runs / secs, sps=runs * steps / secs,
            events=statistics.mean(f.events for f in facts),
            bytes=statistics.mean(f.bytes for f in facts),
            activities=statistics.mean(f.activities for f in facts),
            markers=statistics.mean(f.markers for f in facts),
            upserts=statistics.mean(f.upserts for f in facts),
            trouble=sum(f.task_trouble for f in facts),
            kinds=facts[0].kinds if facts else {},
            kind_bytes=facts[0].kind_bytes if facts else {},
            wcpu=sum(b.worker_cpu for b in mine) / (runs * steps) * 1000,
            scpu=sum(b.server_cpu for b in mine) / (runs * steps) * 1000,
            per_round=[b.runs / b.seconds for b in mine],
            s2s=pooled("schedule_to_start"), turn=pooled("turnaround"),
            a_sched=pooled("approval_to_schedule"), a_start=pooled("approval_to_start"), c_lat=c_lat,
        )
    names = [v.name for v in rounds.variants]
    b = stats[base]
    rows = []
    for name in names:
        s = stats[name]
        rows.append([
            name, s["runs"], f"{s['rps']:.1f}", f"{s['sps']:.1f}", f"{s['rps'] / b['rps']:.2f}",
            f"{s['events']:.0f}", f"{s['events'] / steps:.1f}", f"{s['activities']:.0f}",
            f"{s['markers']:.0f}", f"{s['upserts']:.0f}", f"{s['bytes'] / 1024:.1f}",
            f"{s['wcpu']:.1f}", f"{s['scpu']:.1f}",
        ])
    print()
    print(table(
        ["variant", "runs", "runs/s", "steps/s", f"vs {base}", "events/run", "events/step",
         "activities/run", "markers/run", "upserts/run", "history KiB/run",
         "worker CPU ms/step", "server CPU ms/step"],
        rows,
    ))
    print()
    trouble = {n: stats[n]["trouble"] for n in names if stats[n]["trouble"]}
    if trouble:
        print("workflow tasks timed out or failed (a busy worker missed the sticky queue; extra events "
              "that are load, not the variant): " + ", ".join(f"{n} {k}" for n, k in trouble.items()))
    for name in names:
        if name == base:
            continue
        ratios = [g / r for g, r in zip(stats[name]["per_round"], b["per_round"])]
        print(f"{name}/{base} throughput per round: {', '.join(f'{x:.2f}' for x in ratios)} "
              f"(median {statistics.median(ratios):.2f})")
    if GOVERNED in stats and base == BARE:
        g = stats[GOVERNED]
        median = statistics.median(x / y for x, y in zip(g["per_round"], b["per_round"]))
        print(f"targets: governed/bare median {median:.2f} (>= 0.95), history {g['bytes'] / b['bytes']:.2f}x "
              f"bare (<= 1.3x), events per step {g['events'] / steps - b['events'] / steps:+.1f} over bare (<= +1)")
    cpu = {n: stats[n]["wcpu"] + stats[n]["scpu"] for n in names}
    print("CPU per step, worker + dev server: "
          + ", ".join(f"{n} {cpu[n]:.1f} ms" for n in names)
          + f" -> when the box is CPU-bound, throughput vs {base} tends to "
          + ", ".join(f"{n} {cpu[base] / cpu[n]:.2f}" for n in names if n != base))
    print(f"worker peak RSS {rounds.worker_peak:.0f} MiB (max sampled {rounds.worker_rss_max:.0f} MiB); "
          f"dev server peak RSS {rounds.server_peak:.0f} MiB")
    print()
    print(f"latency under the same load (batches of {rounds.batches[0].runs} concurrent runs), "
          "ms p50 / p99, from the servers' event times:")
    rows = [
        [n, ms(stats[n]["s2s"]), ms(stats[n]["turn"]), ms(stats[n]["a_sched"]), ms(stats[n]["a_start"]),
         ms(stats[n]["c_lat"])]
        for n in names
    ]
    quiet: dict[str, dict[str, list[float]]] = {}
    for b_, fs in rounds.quiet:
        q = quiet.setdefault(b_.variant, {"s2s": [], "turn": [], "a_sched": [], "a_start": [], "c_lat": []})
        for f in fs:
            q["s2s"] += f.schedule_to_start
            q["turn"] += f.turnaround
            q["a_sched"] += f.approval_to_schedule
            q["a_start"] += f.approval_to_start
        q["c_lat"] += client_latency(b_, fs)
    for name, q in quiet.items():
        rows.append([f"{name}, one run at a time", *(ms(q[k]) for k in ("s2s", "turn", "a_sched", "a_start", "c_lat"))])
    print(table(
        ["variant", "activity schedule -> start", "activity done -> next scheduled",
         "approval signal -> tool scheduled", "approval signal -> tool start", "client signal -> tool start"],
        rows,
    ))
    approving = next((n for n in names if n != BARE_APPROVAL and stats[n]["a_start"]), None)
    if approving and stats[base]["turn"]:
        a, t, q = stats[approving]["a_sched"], stats[base]["turn"], stats[base]["s2s"]
        print(f"what governance adds to reacting to an approval, p50: {percentile(a, 50):.0f} ms from the "
              f"signal to the tool's schedule, against {percentile(t, 50):.0f} ms for {base}'s workflow task "
              f"reacting to an activity's result (the dispatch after it: {percentile(q, 50):.0f} ms "
              f"schedule-to-start in {base})")
    if approving and BARE_APPROVAL in stats and stats[BARE_APPROVAL]["a_sched"]:
        a, ba = stats[approving]["a_sched"], stats[BARE_APPROVAL]["a_sched"]
        line = (f"targets: approval signal -> tool scheduled, {approving} vs {BARE_APPROVAL} (the same clock points, "
                f"the same burst of approvals), p50 {percentile(a, 50):.0f} vs {percentile(ba, 50):.0f} ms = "
                f"{percentile(a, 50) / percentile(ba, 50):.2f}x (<= 1.5x)")
        qa, qb = quiet.get(approving, {}).get("a_sched"), quiet.get(BARE_APPROVAL, {}).get("a_sched")
        if qa and qb:
            line += (f"; one run at a time {percentile(qa, 50):.0f} ms (<= 60 ms), "
                     f"{BARE_APPROVAL} {percentile(qb, 50):.0f} ms")
        print(line)
    if approving and base in stats:
        ratios = [x / y for x, y in zip(stats[approving]["per_round"], b["per_round"])]
        print(f"targets: {approving}/{base} median {statistics.median(ratios):.2f} (>= 0.75)")
    if rounds.stack is not None:
        scheduled = sum(s["activities"] * s["runs"] for s in stats.values())
        scheduled += sum(f.activities for _, fs in rounds.quiet for f in fs)
        print(eager_line(rounds.stack, rounds.eager_before, round(scheduled)))
    if rounds.profiles:
        print()
        print(f"where the worker's Python time goes (py-spy, {100} Hz, measured batches only; "
              f"stacks in {next(iter(rounds.profiles.values())).parent}):")
        print(profile_report(rounds.profiles, {n: stats[n]["runs"] * steps for n in names}))
    print()
    print("history events of one run, by type (count / bytes):")
    kinds = sorted(set().union(*(stats[n]["kinds"] for n in names)))
    cell = lambda n, k: f"{stats[n]['kinds'].get(k, 0)} / {stats[n]['kind_bytes'].get(k, 0)}"  # noqa: E731
    print(table(["event type", *names], [[k, *(cell(n, k) for n in names)] for k in kinds]))
    return stats


def worker_args(args: argparse.Namespace) -> list[str]:
    out = [a for opt in args.worker_option for a in ("--option", opt)]
    if args.autoscale_pollers:
        out.append("--autoscale-pollers")
    return out


async def main_async(args: argparse.Namespace, stack: Stack | None = None) -> None:
    print(f"# Tether overhead benchmark: {args.runs} runs x {args.steps} steps x {args.rounds} "
          f"round(s) per variant")
    print(f"machine: {machine_line()}")
    wargs = worker_args(args)
    async with stack_or_new(stack, wargs, dynamic_config=args.dynamic_config) as stack:
        print(f"dev server {stack.address} (pid {stack.server.pid}), worker pid {stack.worker.pid}, "
              f"worker options: {' '.join(wargs) or 'create_worker defaults'}")
        rounds = await run_rounds(stack, [TETHER[v] for v in VARIANTS], args)
        stats = await report(stack.client, rounds)
    print()
    print(ledger.report_line(await ledger.ledger_cpu_ms_per_write(), stats[WRITES]["wcpu"]))


def parser(description: str, *, quiet_approvals: int = 20) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--runs", type=int, default=50, help="concurrent runs per batch (N)")
    p.add_argument("--steps", type=int, default=5, help="tool steps per run (M)")
    p.add_argument("--rounds", type=int, default=3, help="batches per variant, interleaved")
    p.add_argument("--warmup", type=int, default=10, help="runs per variant before measuring (not counted)")
    p.add_argument("--quiet-approvals", type=int, default=quiet_approvals,
                   help="approvals measured one run at a time, after the rounds")
    p.add_argument("--worker-option", action="append", default=[],
                   help="Worker option for the worker under test, KEY=JSON (repeatable)")
    p.add_argument("--autoscale-pollers", action="store_true")
    p.add_argument("--profile", metavar="DIR",
                   help="sample the worker with py-spy (extra `bench`) during the measured batches; "
                        "stacks per variant in DIR, and a table of where its Python time goes")
    p.add_argument("--dynamic-config", action="append", default=[],
                   help="dev server dynamic config KEY=VALUE (repeatable)")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return parser(__doc__.splitlines()[0]).parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(main_async(parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
