"""A worker whose audit sink stops in the middle of writing a line and waits to be killed:
tests/test_bounded_runs.py SIGKILLs it there. Run as a script (the sandbox re-imports modules)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import examples.billing.tools  # noqa: F401  (the tools the run uses)
from activities.audit import AuditActivities, JsonlAuditSink
from client import connect, exit_process
from workflows.models import AuditBatch


class TornSink(JsonlAuditSink):
    """Writes half of the first line of its third batch, says so, and hangs until killed."""

    def __init__(self, root: Path, marker: Path) -> None:
        super().__init__(root)
        self.marker = marker
        self.calls = 0

    async def append(self, batch: AuditBatch) -> int:
        self.calls += 1
        if self.calls < 3:
            return await super().append(batch)
        path = self.root / "torn"
        from activities.audit import audit_path

        target = audit_path(self.root, batch.workflow_id, batch.run_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab") as f:
            f.write(batch.records[0].model_dump_json().encode()[:40])
            f.flush()
        self.marker.write_text(str(path))
        time.sleep(120)
        raise SystemExit("not killed")


async def main(queue: str, audit_dir: str, marker: str) -> None:
    from worker import create_worker

    client = await connect()
    audit = AuditActivities(sink=TornSink(Path(audit_dir), Path(marker)))
    async with create_worker(client, task_queue=queue, audit=audit):
        print("worker ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
    exit_process(0)
