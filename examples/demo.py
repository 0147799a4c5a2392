"""The demo behind `make demo`: a refund agent stops for approval, is approved, and finishes.

Runs against the stack `examples.devstack up` started, through the same CLI a user types.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

import starter
from worker import connect
from workflows.models import RunSnapshot
from workflows.states import TERMINAL, RunState

PLAYBOOK = "examples/billing/refund.playbook.json"


def step(title: str, argv: list[str]) -> int:
    print(f"\n$ python starter.py {' '.join(argv)}", flush=True)
    code = starter.main(argv)
    if code != 0:
        raise SystemExit(f"demo step failed ({title}): exit code {code}")
    return code


async def wait_for_end(run_id: str, timeout: float = 60.0) -> RunSnapshot:
    client = await connect()
    handle = client.get_workflow_handle(run_id)
    deadline = time.monotonic() + timeout
    while True:
        snap = await handle.query("snapshot", result_type=RunSnapshot)
        if snap.state in TERMINAL or time.monotonic() > deadline:
            return snap
        await asyncio.sleep(0.2)


def main() -> int:
    run_id = f"refund-A-1001-{uuid.uuid4().hex[:6]}"
    print("== alice asks the refund agent to refund order A-1001")
    step("start", ["start", "--goal", "Refund order A-1001 (damaged on arrival)",
                   "--playbook", PLAYBOOK, "--requested-by", "alice", "--id", run_id, "--wait"])
    print("\n== the plan writes (refund, ledger, email): the run waits for a human")
    step("list", ["list", "--state", "AWAITING_APPROVAL"])
    print("\n== bob reviews the plan and approves exactly this plan hash")
    step("approve", ["approve", run_id, "--by", "bob", "--comment", "checked the order"])
    snap = asyncio.run(wait_for_end(run_id))
    print(f"\n== the run ended in {snap.state.value}")
    step("status", ["status", run_id])
    step("timeline", ["timeline", run_id])
    print(
        "\nWeb UI: http://localhost:8233/namespaces/default/workflows?query="
        "AgentRunState%3D%22AWAITING_APPROVAL%22  (runs waiting for approval)\n"
        f"This run: http://localhost:8233/namespaces/default/workflows/{run_id}\n"
        "The server, UI, billing service and worker keep running; `make down` stops them."
    )
    return 0 if snap.state == RunState.COMPLETED else 1


if __name__ == "__main__":
    sys.exit(main())
