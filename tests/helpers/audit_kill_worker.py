"""A worker whose audit sink stops in the middle of a write and waits to be killed:
tests/workflows/test_bounded_runs.py (JSON lines: half a line on disk) and tests/activities/test_audit.py
(PostgreSQL: a transaction with some of the batch's rows, not committed) SIGKILL it there.
With ``held``, its sink writes nothing at all: each batch's workflow id goes on a line of MARKER
and the append waits until the worker is killed (tests/activities/test_audit.py: another worker's sweep
must collect those runs). Run as a script (the sandbox re-imports modules):

    python -m tests.helpers.audit_kill_worker QUEUE AUDIT_DIR|postgresql://DSN MARKER [held]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import examples.billing.tools  # noqa: F401  (the tools the run uses)
from activities.audit import AuditActivities
from tether.audit.sink import AUDIT_TABLE, JsonlAuditSink, PostgresAuditSink, audit_path
from tether.client import connect, exit_process
from workflows.wire import AuditBatch

TORN_CALL = 1  # the sink's first batch is the one torn (a read-only run's records reach it at its end, by the audit collector: the next worker's catch-up writes them)


class Torn:
    """A sink whose ``TORN_CALL``-th batch is torn (``tear``), then it hangs until killed."""

    def __init__(self, target: Any, marker: Path) -> None:
        super().__init__(target)  # type: ignore[call-arg]  (the sink's own field)
        self.marker = marker
        self.calls = 0

    async def append(self, batch: AuditBatch) -> int:
        self.calls += 1
        if self.calls < TORN_CALL:
            return await super().append(batch)  # type: ignore[misc]
        await self.tear(batch)
        time.sleep(120)
        raise SystemExit("not killed")

    async def tear(self, batch: AuditBatch) -> None:
        raise NotImplementedError


class TornSink(Torn, JsonlAuditSink):
    """Writes half of the first line of its third batch, says so, and hangs until killed."""

    async def tear(self, batch: AuditBatch) -> None:
        target = audit_path(self.root, batch.workflow_id, batch.run_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab") as f:
            f.write(batch.records[0].model_dump_json().encode()[:40])
            f.flush()
        self.marker.write_text(str(target))


class TornPostgresSink(Torn, PostgresAuditSink):
    """Inserts the first row of its third batch in a transaction it never commits, says so, and
    hangs until killed (the server rolls the transaction back when the connection drops)."""

    async def tear(self, batch: AuditBatch) -> None:
        conn = await self.db._connection()  # the sink's one connection (tether/store/postgres.py)
        first = batch.records[0]
        await conn.execute(
            f"INSERT INTO {AUDIT_TABLE} (workflow_id, run_id, seq, first_run_id, record) VALUES (%s, %s, %s, %s, %s)",
            (batch.workflow_id, batch.run_id, first.seq, batch.first_run_id, first.model_dump_json()),
        )
        self.marker.write_text(f"seq {first.seq} inserted, not committed")


class HeldSink(JsonlAuditSink):
    """Names each batch's run in the marker and never writes it: the worker holds it until killed."""

    def __init__(self, root: Path, marker: Path) -> None:
        super().__init__(root)
        self.marker = marker

    async def append(self, batch: AuditBatch) -> int:
        with open(self.marker, "a") as f:
            f.write(batch.workflow_id + "\n")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def main(queue: str, target: str, marker: str, mode: str = "torn") -> None:
    from worker import create_worker

    client = await connect()
    if mode == "held":
        sink: JsonlAuditSink | PostgresAuditSink = HeldSink(Path(target), Path(marker))
    elif target.startswith("postgresql://"):
        sink: JsonlAuditSink | PostgresAuditSink = TornPostgresSink(target, Path(marker))
    else:
        sink = TornSink(Path(target), Path(marker))  # type: ignore[assignment]
    async with create_worker(client, task_queue=queue, audit=AuditActivities(sink=sink)):
        print("worker ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
    exit_process(0)
