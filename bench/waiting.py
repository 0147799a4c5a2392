"""Many runs waiting for approval: start rate, memory while they wait, drain rate.

    python -m bench.waiting [--runs 10000] [--concurrency 100] [--worker-option KEY=JSON]...

Starts ``--runs`` AgentRuns whose plan writes (so each waits for one approval), waits until
visibility shows all of them in ``AWAITING_APPROVAL``, reads the worker's and the dev server's
RSS from /proc while they wait, then approves them all and measures how fast they drain.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

from bench.common import approve_pending, bench_stack, cpu_seconds, machine_line, peak_rss_mb, rss_mb, table
from tether.client import start_run
from workflows.run_state import RunRequest


async def count(client, query: str) -> int:
    return (await client.count_workflows(query)).count


async def wait_count(client, query: str, target: int, label: str, t0: float, timeout: float) -> float:
    """Poll visibility until ``target`` runs match; returns the seconds since t0 when they did."""
    last_print = 0.0
    while True:
        n = await count(client, query)
        now = time.perf_counter()
        if n >= target:
            return now - t0
        if now - last_print > 10:
            print(f"  {label}: {n}/{target} after {now - t0:.0f}s", flush=True)
            last_print = now
        if now - t0 > timeout:
            raise SystemExit(f"{label}: only {n}/{target} after {timeout:.0f}s")
        await asyncio.sleep(0.25)


async def bounded(concurrency: int, jobs) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(job):
        async with sem:
            await job()

    await asyncio.gather(*(one(j) for j in jobs))


async def main_async(args: argparse.Namespace) -> None:
    print(f"# Tether waiting benchmark: {args.runs} runs waiting for approval")
    print(f"machine: {machine_line()}")
    worker_args = [a for opt in args.worker_option for a in ("--option", opt)]
    if args.autoscale_pollers:
        worker_args.append("--autoscale-pollers")
    async with bench_stack(worker_args) as stack:
        client, w, s = stack.client, stack.worker.pid, stack.server.pid
        print(f"dev server {stack.address} (pid {s}), worker pid {w}, worker options: "
              f"{' '.join(worker_args) or 'create_worker defaults'}")
        tag = uuid.uuid4().hex[:8]
        tenant = f"bench-wait-{tag}"
        book = [{"tool": "bench_write", "args": {"key": "k0"}}]
        request = RunRequest.model_validate(
            {"goal": "benchmark: wait for approval", "tenant": tenant, "requested_by": "bench",
             "playbook": book}
        )
        ids = [f"wait-{tag}-{i:05d}" for i in range(args.runs)]
        rows: list[list[object]] = []
        rss_idle = rss_mb(w)

        # 1. start them all
        cpu0 = cpu_seconds(w)
        t0 = time.perf_counter()
        await bounded(args.concurrency, [
            (lambda i=i: start_run(client, request, run_id=i, queue=stack.task_queue)) for i in ids
        ])
        started = time.perf_counter() - t0
        waiting_at = await wait_count(
            client, f"AgentTenant='{tenant}' AND AgentRunState='AWAITING_APPROVAL'",
            args.runs, "waiting", t0, args.timeout,
        )
        cpu_start = cpu_seconds(w) - cpu0
        rows.append(["start", f"{args.runs / started:.0f} starts/s ({started:.1f}s)",
                     f"all {args.runs} waiting after {waiting_at:.1f}s "
                     f"({args.runs / waiting_at:.0f} runs/s)",
                     f"worker CPU {cpu_start:.0f}s"])
        await asyncio.sleep(args.settle)
        w_wait, s_wait = rss_mb(w), rss_mb(s)
        rows.append(["waiting", f"worker RSS {w_wait:.0f} MiB (idle {rss_idle:.0f}, peak so far "
                     f"{peak_rss_mb(w):.0f})", f"dev server RSS {s_wait:.0f} MiB", ""])

        # 2. approve them all
        cpu0 = cpu_seconds(w)
        t1 = time.perf_counter()
        await bounded(args.concurrency, [
            (lambda i=i: approve_pending(client, i)) for i in ids
        ])
        signalled = time.perf_counter() - t1
        done_at = await wait_count(
            client, f"AgentTenant='{tenant}' AND ExecutionStatus='Completed'",
            args.runs, "completed", t1, args.timeout,
        )
        cpu_drain = cpu_seconds(w) - cpu0
        rows.append(["drain", f"{args.runs / signalled:.0f} approvals/s sent ({signalled:.1f}s)",
                     f"last run completed {done_at:.1f}s after the first approval "
                     f"({args.runs / done_at:.0f} runs/s)", f"worker CPU {cpu_drain:.0f}s"])
        rows.append(["peak", f"worker peak RSS {peak_rss_mb(w):.0f} MiB",
                     f"dev server peak RSS {peak_rss_mb(s):.0f} MiB", ""])
        print()
        print(table(["phase", "rate", "result", "cost"], rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=100, help="starts / signals in flight")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait before reading RSS")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--worker-option", action="append", default=[],
                        help="Worker option for the worker under test, KEY=JSON (repeatable)")
    parser.add_argument("--autoscale-pollers", action="store_true")
    asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
