"""The long, randomized chaos run behind ``make chaos``.

    python -m tests.chaos.run_chaos --kills 200 [--lanes 4] [--seed N]

Starts its own dev server (SQLite file) and billing service (``--delay-ms``), then runs
rounds (tests/chaos/harness.py, the same code as the pytest suite) in parallel lanes until at
least ``--kills`` worker SIGKILLs happened. Most rounds are ``kill_round``: the kill point
(before / during / after the external call, or a random moment), 1-2 runs per effect class,
and 0-2 further kills of the restarted worker at random moments (mid-retry, mid-task). The
others are ``effect_round``: a slow attempt that commits after its deadline, a cancel during
the call (one with a SIGKILL after it), or an idempotent tool whose retries run out. Prints a
summary table per effect class (with the ``unknown`` outcomes and how each run ended) and exits
1 on any violation of the chaos contract. Then ``--compensations`` rounds of
``compensation_round``: a run putting its writes back, its worker SIGKILLed before, during or
after a compensation's call or at a random moment; every one must end COMPENSATED with each
write undone exactly once. Then one ``compensation_twice_round`` a lane: two compensation runs of
one original at once, a SIGKILL, a third after them; each undo applied exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

from tests.chaos.harness import (
    EFFECTS,
    SCENARIOS,
    BillingProc,
    DevServer,
    RunResult,
    check_compensation,
    check_result,
    check_twice,
    compensation_round,
    compensation_twice_round,
    effect_round,
    kill_round,
)
from workflows.states import RunState

S = RunState


class Tally:
    def __init__(self) -> None:
        self.kills = 0
        self.rounds = 0
        self.results: list[RunResult] = []
        self.violations: list[str] = []
        self.errors: list[str] = []
        self.kills_by_effect: Counter[str] = Counter()


async def lane(n: int, target: int, tally: Tally, server: DevServer, billing: BillingProc, workdir: Path, seed: int) -> None:
    rng = random.Random(seed * 1000 + n)
    client = await server.client()
    while tally.kills < target:
        runs = rng.randint(1, 2)
        started = time.monotonic()
        # One round in three is a fault of the attempt itself rather than a worker kill.
        scenario = rng.choice(["kill", "kill", "slow", "cancel", "exhaust", "kill"])
        point: str | None = None
        try:
            if scenario == "kill":
                point = rng.choice(["before", "during", "after", None])
                round_ = await kill_round(
                    client, server.address, billing, workdir, point=point, runs_per_effect=runs,
                    extra_kills=rng.choice([0, 0, 1, 2]), rng=rng,
                )
            else:
                point = rng.choice(SCENARIOS[scenario])
                round_ = await effect_round(
                    client, server.address, billing, workdir, scenario=scenario, variant=point,
                    runs_per_effect=runs,
                )
        except Exception as e:  # a round that could not finish is a failure, not a crash
            tally.errors.append(f"lane {n} {scenario} {point}: {type(e).__name__}: {e}")
            traceback.print_exc()
            continue
        tally.rounds += 1
        tally.kills += round_.kills
        for effect in {r.effect for r in round_.results}:
            tally.kills_by_effect[effect] += round_.kills
        for result in round_.results:
            tally.results.append(result)
            try:
                check_result(result)
            except AssertionError as e:
                tally.violations.append(f"{result.effect} {result.run_id}: {e}")
        points = Counter(r.point for r in round_.results)
        print(
            f"lane {n} round {tally.rounds:>3}: {scenario:<7} {point or 'random':<10} runs/effect={runs} "
            f"kills={round_.kills} caught at {dict(points)} in {time.monotonic() - started:.0f}s "
            f"(total kills {tally.kills})",
            flush=True,
        )


def table(tally: Tally) -> str:
    """Per effect class: runs, kills, the faults they met, how they ended, what the effect
    outcome was, and the exactly-once checks. ``unknown`` runs may have applied their effect;
    ``unrecorded`` counts runs whose effect exists (or may) without ``ok``/``unknown`` on the
    record: the contract says 0."""
    header = ("effect", "runs", "kills", "mid-call", "slow", "cancels", "exhaust", "completed",
              "handed off", "cancelled", "other end", "ok", "failed", "unknown", "unknown->handed off",
              "unknown->cancelled", "unknown applied", "unrecorded", "effects/key max", "duplicates",
              "repeated calls", "violations")
    rows = [header]
    by_effect: dict[str, list[RunResult]] = defaultdict(list)
    for r in tally.results:
        by_effect[r.effect].append(r)
    for effect in EFFECTS:
        rs = by_effect[effect]
        unknown = [r for r in rs if r.outcome == "unknown"]

        def count(pred) -> str:
            return str(sum(1 for r in rs if pred(r)))

        rows.append((
            effect,
            str(len(rs)),
            str(tally.kills_by_effect[effect]),
            count(lambda r: r.scenario == "kill" and r.point in ("before", "during", "after")),
            count(lambda r: r.scenario == "slow"),
            count(lambda r: r.scenario == "cancel"),
            count(lambda r: r.scenario == "exhaust"),
            count(lambda r: r.state == S.COMPLETED),
            count(lambda r: r.state == S.HANDED_OFF),
            count(lambda r: r.state == S.CANCELLED),
            count(lambda r: r.state not in (S.COMPLETED, S.HANDED_OFF, S.CANCELLED)),
            count(lambda r: r.outcome == "ok"),
            count(lambda r: r.outcome == "failed"),
            str(len(unknown)),
            str(sum(1 for r in unknown if r.state == S.HANDED_OFF)),
            str(sum(1 for r in unknown if r.state == S.CANCELLED)),
            str(sum(1 for r in unknown if r.effects)),
            count(lambda r: r.effects and r.outcome not in ("ok", "unknown")),
            str(max((r.effects for r in rs), default=0)),
            count(lambda r: r.effects > 1) if effect != "unsafe" else "-",
            count(lambda r: r.attempts > 1 or r.effects > 1) if effect == "unsafe" else "-",
            str(sum(1 for v in tally.violations if v.startswith(effect + " "))),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="tether-chaos-"))
    server, billing = DevServer(workdir), BillingProc(workdir)
    tally = Tally()
    undo_points: Counter[str] = Counter()
    started = time.monotonic()
    try:
        await asyncio.gather(server.start(), billing.ready())
        print(f"chaos: dev server {server.address}, billing {billing.url}, logs in {workdir}", flush=True)
        await asyncio.gather(
            *(lane(n, args.kills, tally, server, billing, workdir, args.seed) for n in range(args.lanes))
        )
        rng = random.Random(args.seed)
        client = await server.client()
        for batch in range(0, args.compensations, args.lanes):
            picks = [rng.choice(["before", "during", "after", None]) for _ in range(min(args.lanes, args.compensations - batch))]
            results = await asyncio.gather(
                *(compensation_round(client, server.address, billing, workdir, point=p, rng=rng) for p in picks),
                return_exceptions=True,
            )
            for result in results:
                if isinstance(result, BaseException):
                    tally.errors.append(f"compensation round: {result!r}")
                    continue
                tally.kills += 1
                undo_points[result.point] += 1
                try:
                    check_compensation(result)
                except AssertionError as e:
                    tally.violations.append(f"compensation {result.run_id}: {e}")
        # Recovery started twice at once, a kill, then a third start (issue 31): one round a lane.
        twice = await asyncio.gather(
            *(compensation_twice_round(client, server.address, billing, workdir) for _ in range(args.lanes)),
            return_exceptions=True,
        )
        for result in twice:
            if isinstance(result, BaseException):
                tally.errors.append(f"compensation twice round: {result!r}")
                continue
            tally.kills += 1
            undo_points["twice"] += 1
            try:
                check_twice(result)
            except AssertionError as e:
                tally.violations.append(f"compensation twice {result.run_id}: {e}")
    finally:
        billing.stop()
        server.stop()
    points = Counter(r.point for r in tally.results if r.scenario == "kill")
    faults = Counter(f"{r.scenario} {r.variant}" for r in tally.results if r.scenario != "kill")
    print()
    print(f"chaos summary: {tally.kills} worker SIGKILLs in {tally.rounds} rounds, "
          f"{len(tally.results)} runs, {time.monotonic() - started:.0f}s, seed {args.seed}")
    print("first kill caught the tool call: " + ", ".join(f"{p} {n}" for p, n in sorted(points.items())))
    print("faults of the attempt: " + ", ".join(f"{f} {n}" for f, n in sorted(faults.items())))
    print("kills while compensating: " + (", ".join(f"{p} {n}" for p, n in sorted(undo_points.items())) or "none"))
    print()
    print(table(tally))
    for v in tally.violations:
        print(f"VIOLATION {v}")
    for e in tally.errors:
        print(f"ERROR {e}")
    ok = not tally.violations and not tally.errors and tally.kills >= args.kills
    print("\nchaos: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM: unwind, so the dev server, billing and workers are stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200, help="worker SIGKILLs to reach (default 200)")
    parser.add_argument("--lanes", type=int, default=4, help="rounds running in parallel (default 4)")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--compensations", type=int, default=12,
                        help="rounds with a SIGKILL while a run compensates (default 12)")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    from tether.connection import exit_process

    exit_process(main())  # past the Temporal runtime's teardown crash (sdk-python #300)
