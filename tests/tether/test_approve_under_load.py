"""`tether approve` exits as the outcome was, beside two busy CPU loops and with the run's
workers stopped: 0 applied, 1 refused or not sent, 3 sent and pending (with its decision id and
how to follow it); never 2. Each exit is checked against the run's own record once a worker of
its build is back. Event-driven: it waits for the runs' states and records, never for a time."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections import Counter

from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tests.helpers.billing import Billing
from tests.helpers.runs import make_request, running_worker, unique
from tests.helpers.cli import Cli
from tests.helpers.pollers import a_poller_seen_just_now
from tests.helpers.cli import POLICY

# A write that needs an approval, as often as the test approves it (an email: no balance runs out).
EMAIL = [{"tool": "send_email", "args": {"to": "ada@example.com", "subject": "Your refund", "body": "Done."}}]

OK, REFUSED, PENDING = tether_client.OK, tether_client.REFUSED, tether_client.PENDING


async def published_waiting(client, run_id: str) -> str:
    """The plan hash of the run's pending request, once its signed view says it waits."""
    while True:
        try:
            status = await tether_client.status(client, run_id, goal=False)
        except tether_client.TetherError:
            status = None
        if status is not None and not status.unpublished and status.pending_approval is not None:
            return status.pending_approval.plan_hash
        await asyncio.sleep(0.1)


async def test_approve_beside_busy_loops_and_with_workers_stopped_never_exits_2(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    client = dev_env.client
    queue = unique("load")
    runs = [f"load-{uuid.uuid4().hex[:10]}" for _ in range(3)]
    began = time.monotonic()
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(2)]
    sent: list[tuple[str, str, int, str]] = []  # (run, decision id, exit code, output)
    try:
        async with running_worker(client, policy=POLICY, task_queue=queue) as worker:
            cli = Cli(dev_env, worker)
            for run in runs:
                await tether_client.start_run(client, make_request(EMAIL, requested_by="alice"), run_id=run, queue=queue)
            hashes = {run: await published_waiting(client, run) for run in runs}

            async def decide(run: str, by: str, kind: str = "approve", *extra: str, env: dict | None = None) -> int:
                decision = f"{by}-{kind}-{uuid.uuid4().hex[:8]}"
                code, out, err = await cli(kind, run, "--by", by, "--plan-hash", hashes[run][:12],
                                           "--decision-id", decision, *extra, env=env)
                sent.append((run, decision, code, out + err))
                print(f"{kind} {run} by {by}: exit {code} at {time.monotonic() - began:.1f}s")
                return code

            # Workers up, the machine busy: each approval is applied (0) or sent and pending (3);
            # a second decision on a run already approved is refused (1), or pending (3).
            await decide(runs[0], "bob")
            await decide(runs[0], "carol", "reject", "--reason", "too late")
        # Every worker of the run's build stopped, and said so: not sent (1), nothing decided.
        while await tether_client.worker_serving(client, queue) is not False:  # its shutdown, as Temporal lists it
            await asyncio.sleep(0.2)
        await decide(runs[1], "bob")
        # A worker killed a moment ago (its last poll fresh, nobody takes its tasks): Temporal
        # takes the decision in and keeps it: sent and pending (3), its id and how to follow it.
        await a_poller_seen_just_now(dev_env, queue)
        # (How long it waits for a verdict before saying "pending" changes no outcome, only the wait.)
        quick = {"TETHER_VERDICT_TIMEOUT": "3"}
        await decide(runs[2], "bob", env=quick)
        await decide(runs[2], "carol", "reject", "--reason", "no", env=quick)  # kept too: refused once judged
    finally:
        for p in busy:
            p.kill()
            p.wait()

    codes = Counter(code for _, _, code, _ in sent)
    print(f"\nexit codes: {dict(sorted(codes.items()))}")
    assert set(codes) <= {OK, REFUSED, PENDING}, sent  # never 2 (usage) for a decision
    for run, decision, code, shown in sent:
        if code == PENDING:  # its decision id and how to follow it
            assert decision in shown and f"tether status {run}" in shown, shown
        if code == REFUSED:
            assert any(w in shown for w in ("not sent", "not awaiting approval", "refused", "[rule:")), shown

    # A worker of the runs' build comes back: every run ends, and each exit was the outcome.
    print(f"worker back at {time.monotonic() - began:.1f}s")
    async with running_worker(client, policy=POLICY, task_queue=queue):
        await client.get_workflow_handle(runs[1]).cancel()
        ends = {run: (await tether_client.run_outcome(client.get_workflow_handle(run))).state.value for run in runs}
        records = {r.refs.decision_id: r for run in runs for r in await tether_client.full_timeline(client, run)
                   if r.refs.decision_id}
    assert ends[runs[0]] == "COMPLETED", ends
    for run, decision, code, shown in sent:
        record = records.get(decision)
        if code == OK:
            assert record is not None and record.kind == "transition" and record.actor.startswith("user:"), (decision, record)
        elif code == PENDING:  # kept by Temporal: judged once a worker took it
            assert record is not None, (decision, shown)
        else:  # refused by the run (its record says so) or never sent (no record)
            assert record is None or record.kind == "refused", (decision, record)
    # Not sent: runs[1] still waited (cancelled above); runs[2] took bob's approval, then refused carol's.
    assert ends[runs[1]] == "CANCELLED" and ends[runs[2]] == "COMPLETED", ends
    assert [c for r, _, c, _ in sent if r == runs[1]] == [REFUSED], sent
    assert [c for r, _, c, _ in sent if r == runs[2]] == [PENDING, PENDING], sent
