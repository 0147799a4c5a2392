"""Chaos: SIGKILL the worker at the dangerous points of every write tool's call, restart it,
and check what the run and the billing service say.

Real processes: the dev server (a subprocess, SQLite file), the billing service (a subprocess
with ``--delay-ms``, so a write's response comes well after its commit) and worker subprocesses
(``worker.py --tools tests.chaos.chaos_tools``). Each round runs one idempotent, one
reconcilable and one unsafe tool call on a worker of its own, holds every call at one point,
kills the worker there, and restarts it:

- ``before``: the activity started, the HTTP request was not sent yet;
- ``during``: the service committed the write, its response is still delayed;
- ``after``: the tool got its response, the activity has not completed yet.

Then, per run: idempotent and reconcilable runs reach COMPLETED with exactly one effect per
idempotency key; the unsafe tool was never called twice and, its outcome being unknown, the
run is HANDED_OFF with a reason that names the tool call; and every timeline is a legal path
with strictly increasing ``state_version`` and no unapproved write (``tests/helpers/invariants.py``).

In `make test` the rounds run side by side, ROUNDS_AT_ONCE at a time, the writes', the
compensation's and the slow attempts' (most of each round is Temporal noticing the dead
workers: the held tools' heartbeat timeout, then about 10 s more, which matches the SDK's
default 10 s sticky-queue schedule-to-start timeout of the killed worker). What a round needs
to happen first is arranged, never waited out: a hold at a checkpoint, a write's response held
by the billing service until the harness has cancelled or killed, and tool deadlines far past
the harness's turn (harness.py: HELD_TOOL_TIMEOUT, CANCEL_TOOL_TIMEOUT, SLOW_TOOL_TIMEOUT). ``make chaos`` runs the same
rounds at random kill points, many times (``tests/chaos/run_chaos.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from tests.chaos.harness import Stack
from tests.chaos.harness import EFFECTS, POINTS, SCENARIOS, check_result, effect_round, kill_round


T = TypeVar("T")
# Rounds at once: each waits mostly for Temporal, but each is a worker process and a few runs on
# one SQLite dev server; all fourteen at once on a loaded 2-core machine time out the server's
# own persistence calls.
ROUNDS_AT_ONCE = 4


async def test_sigkill_writes_and_compensations_slow_attempts_cancels_and_retries(stack: Stack) -> None:
    """The kill rounds of the writes, and those of a compensation (below), side by side: each
    waits mostly for Temporal to notice its dead worker."""
    from tests.chaos.harness import check_compensation, check_twice, compensation_round, compensation_twice_round

    gate = asyncio.Semaphore(ROUNDS_AT_ONCE)
    writes = asyncio.gather(
        *(limited(gate, kill_round(stack.client, stack.server.address, stack.billing, stack.workdir, point=p))
          for p in POINTS)
    )
    undos = asyncio.gather(
        *(limited(gate, compensation_round(stack.client, stack.server.address, stack.billing, stack.workdir, point=p))
          for p in POINTS)
    )
    # Recovery started twice at once, a kill, and a third start (issue 31).
    twice = limited(gate, compensation_twice_round(stack.client, stack.server.address, stack.billing, stack.workdir))
    # And the slow attempts, cancels and exhausted retries (below), for the same reason.
    rounds, compensations, twice_result, _ = await asyncio.gather(
        writes, undos, twice, slow_attempts_cancels_and_retries_that_run_out(stack, gate))
    check_twice(twice_result)
    # A refund and a ledger entry, then an email refused for good, with on_failure=compensate:
    # the worker is SIGKILLed with the first compensation (the ledger reversal) held before its
    # call, during it (committed, the response delayed) and after it. Restarted, every run ends
    # COMPENSATED with the refund voided and the entry reversed exactly once, each undo recorded
    # once: 0 duplicates.
    for result in compensations:
        check_compensation(result)
    seen = set()
    for point, round_ in zip(POINTS, rounds):
        assert round_.kills == 1
        for result in round_.results:
            assert result.point == point
            check_result(result)
            seen.add((result.effect, result.point))
    assert seen == {(e, p) for e in EFFECTS for p in POINTS}
    # Killed before the call, the email was never sent; killed during or after it, exactly once.
    unsafe = {r.point: r.effects for round_ in rounds for r in round_.results if r.effect == "unsafe"}
    assert unsafe == {"before": 0, "during": 1, "after": 1}


async def limited(gate: asyncio.Semaphore, round_: Awaitable[T]) -> T:
    async with gate:
        return await round_


async def slow_attempts_cancels_and_retries_that_run_out(stack: Stack, gate: asyncio.Semaphore) -> None:
    """A slow attempt that commits after its deadline (within and past the grace period), a
    cancel with the tool held before, during and after its call (and a SIGKILL right after the
    cancel), and an idempotent tool whose retries run out: one effect per key at most, and
    every step's end names an outcome that matches what the billing service holds."""
    cases = [(scenario, variant) for scenario, variants in SCENARIOS.items() for variant in variants]
    rounds = await asyncio.gather(
        *(
            limited(gate, effect_round(stack.client, stack.server.address, stack.billing, stack.workdir,
                                       scenario=s, variant=v))
            for s, v in cases
        )
    )
    outcomes = {}
    for (scenario, variant), round_ in zip(cases, rounds):
        assert {r.effect for r in round_.results} == set(EFFECTS)
        for result in round_.results:
            check_result(result)
            outcomes[(scenario, variant, result.effect)] = (result.state.value, result.outcome, result.effects)
    # The cases the contract pins down exactly.
    assert outcomes[("slow", "past", "reconcilable")] == ("HANDED_OFF", "unknown", 1)
    assert outcomes[("exhaust", "lost", "idempotent")] == ("HANDED_OFF", "unknown", 1)
    assert outcomes[("cancel", "before", "unsafe")] == ("CANCELLED", "failed", 0)
    assert outcomes[("cancel", "after", "unsafe")] == ("CANCELLED", "ok", 1)
