"""What the effect ledger costs a write (tether/store/effect_ledger.py): the CPU of the claim and
the settle that ``execute_tool`` adds to every write, against a write step's worker CPU.

The ledger's part is measured on its own, in this process, on a SQLite ledger in a fresh folder
(the embedded default; what the worker does per write: one claim, one ``done`` with the
outcome's JSON, each in a thread, each its own transaction), and compared with the worker CPU
per step of ``make bench``'s ``governed+writes`` variant (every step a write), whose worker
already pays it. Goal: at most 10% of a write step's worker CPU.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from tether.store.effect_ledger import LEDGER_FILE, SqliteEffectLedger
from activities.tools import bounded_observation

GOAL = 0.10


async def ledger_cpu_ms_per_write(writes: int = 500) -> float:
    """CPU milliseconds (all threads of this process) of one write's claim and done."""
    outcome = bounded_observation({"key": "k0", "written": True, "value": "x" * 64}).model_dump_json()
    with tempfile.TemporaryDirectory() as folder:
        ledger = SqliteEffectLedger(Path(folder) / LEDGER_FILE)
        await ledger.claim("warm-up", tool="bench_write", workflow_id="bench", run_id="bench-run")
        start = time.process_time()
        for i in range(writes):
            key = f"bench-{i:06d}:tc-{i}"
            await ledger.claim(key, tool="bench_write", workflow_id="bench", run_id="bench-run")
            await ledger.done(key, outcome, workflow_id="bench", run_id="bench-run")
        spent = time.process_time() - start
        await ledger.aclose()
    return spent / writes * 1000


def report_line(ledger_ms: float, write_step_ms: float) -> str:
    share = ledger_ms / write_step_ms if write_step_ms else float("nan")
    verdict = "within" if share <= GOAL else "OVER"
    return (f"effect ledger: {ledger_ms:.2f} ms CPU per write (claim + done, SQLite), "
            f"{share:.1%} of a write step's worker CPU ({write_step_ms:.1f} ms, governed+writes): "
            f"{verdict} the goal of {GOAL:.0%}")


if __name__ == "__main__":
    print(f"effect ledger: {asyncio.run(ledger_cpu_ms_per_write()):.2f} ms CPU per write (claim + done, SQLite)")
