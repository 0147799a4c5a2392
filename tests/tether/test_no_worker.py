"""A worker that stopped: every command says so at once, naming the queue and the fix.

Temporal goes on listing a stopped worker's poller for minutes (and its last poll looks recent
for up to a minute), so the poller list alone would say a worker serves. The client also reads
the workers' own heartbeats (a stopping worker reports it) and whether a run's task was taken.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tests.helpers.billing import Billing
from tests.helpers.runs import running_worker, unique
from tests.helpers.cli import Cli

REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 250, "reason": "no worker"}}]


async def test_a_stopped_worker_is_named_by_start_wait_status_and_approve(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    playbook = tmp_path / "refund.json"
    playbook.write_text(json.dumps(REFUND))
    queue = unique("stopped")
    async with running_worker(dev_env.client, task_queue=queue) as worker:
        cli = Cli(dev_env, worker)
        code, out, err = await cli("start", "--goal", "g", "--playbook", str(playbook), "--requested-by", "alice",
                                   "--wait")
        assert code == 0 and "AWAITING_APPROVAL" in out, (out, err)
        run_id = out.split()[1]
        assert await tether_client.worker_serving(dev_env.client, queue) is True
    # Stopped (its shutdown has completed); its poller is still listed, and looks fresh. Its
    # last heartbeat says it stopped: wait for the server to have it (an event, bounded only
    # against a hang).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while await tether_client.worker_serving(dev_env.client, queue) is not False:
        assert loop.time() < deadline, "the stopped worker still counts as serving"
        await asyncio.sleep(0.1)

    message = f"no worker polls task queue '{queue}' — start one with `TETHER_TASK_QUEUE={queue} make worker`"
    # A wait far longer than any answer: a command that waited on a worker would not return
    # with the probe's message (and the test would hang, not pass).
    code, out, err = await cli("start", "--goal", "g", "--playbook", str(playbook), "--requested-by", "alice",
                               "--wait", "--wait-timeout", "600")
    assert code == 1 and out.startswith("started run-") and message in err, (code, out, err)
    assert len(err.strip().splitlines()) == 1, err
    # status answers from what the run published, and says no worker serves its queue (issue 34);
    # approve needs a worker to judge the decision: not sent, one line naming the queue and the
    # fix, exit 1 (refused: nothing decided; never 2, which says the input was wrong).
    code, out, err = await cli("status", run_id)
    assert code == 0 and "AWAITING_APPROVAL" in out and f"'{queue}'" in out and "no worker" in out, (code, out, err)
    code, out, err = await cli("approve", run_id, "--by", "bob", "--unreviewed")
    assert code == 1 and "not sent" in err and message in err and len(err.strip().splitlines()) == 1, (code, out, err)
