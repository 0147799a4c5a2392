"""A real worker (the billing tools) that holds the N-th activity it is handed, before the
activity's code runs, until it is killed: tests/chaos/test_query_after_kill.py SIGKILLs it there,
once for every activity of a run. Run as a script (the sandbox re-imports modules):

    python -m tests.helpers.held_activity_worker QUEUE N MARKER

The marker file gets the held activity's type and id when it is held.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

import examples.billing.tools  # noqa: F401  (the tools the run uses)
from tether.client import connect, exit_process


class Hold(Interceptor):
    def __init__(self, nth: int, marker: Path) -> None:
        self.nth, self.marker, self.seen = nth, marker, 0

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        hold = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                hold.seen += 1
                if hold.seen == hold.nth:
                    info = activity.info()
                    hold.marker.write_text(f"{info.activity_type} {info.activity_id}")
                    await asyncio.Event().wait()  # until killed
                return await super().execute_activity(input)

        return Held(next)


async def main(queue: str, nth: str, marker: str) -> None:
    from activities.audit import AuditActivities
    from tether.store.effect_ledger import local_ledger_id
    from worker import LEDGER_MARK, create_worker

    client = await connect()
    # Named with its ledger as `worker.py` names itself: the worker that replaces it keeps the
    # same local ledger, and a worker refuses a queue another ledger serves.
    audit = AuditActivities()
    identity = f"{client.identity}{LEDGER_MARK}{local_ledger_id(audit.sink) or 'shared'}"
    async with create_worker(client, task_queue=queue, audit=audit, identity=identity,
                             interceptors=[Hold(int(nth), Path(marker))]):
        print("worker ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
    exit_process(0)
