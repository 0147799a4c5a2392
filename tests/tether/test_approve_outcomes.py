"""`tether approve` says what happened, with the run's workers stopped: a decision Temporal has
taken in but no worker has judged yet is "sent, pending" (exit 3, with its decision id and how
to follow it), never "not sent" (exit 2); once a worker is back each is on the run's record as
it was judged. And a plan hash that matches no plan says so, without a hash to paste."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tests.helpers.billing import Billing
from tests.helpers.runs import running_worker, unique
from tests.helpers.cli import Cli
from tests.helpers.cli import POLICY, SMALL_REFUND
from tests.helpers.pollers import a_poller_seen_just_now


async def test_decisions_sent_with_the_runs_workers_stopped_are_pending_then_judged(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    queue = unique("tq")
    playbook = tmp_path / "plan.json"
    playbook.write_text(json.dumps(SMALL_REFUND))
    run = unique("outcomes")
    async with running_worker(dev_env.client, policy=POLICY, task_queue=queue) as worker:
        cli = Cli(dev_env, worker)
        code, out, err = await cli("start", "--goal", "g", "--playbook", str(playbook), "--requested-by", "alice",
                                   "--id", run, "--wait")
        assert code == 0 and "AWAITING_APPROVAL" in out, (out, err)
        status = await tether_client.status(dev_env.client, run)
        plan_hash = status.pending_approval.plan_hash
        # A hash of no plan: refused, pointing at `tether status`, with no hash to paste.
        code, out, err = await cli("approve", run, "--by", "bob", "--plan-hash", "0" * 12)
        assert code == tether_client.REFUSED, (out, err)
        assert "does not match the plan under review" in err and f"tether status {run}" in err, err
        assert plan_hash[:12] not in out + err
        # --by as the policy writes the person, or refused before anything is sent: never folded.
        for name in ("Bob", "ＢＯＢ"):
            code, out, err = await cli("approve", run, "--by", name, "--plan-hash", plan_hash[:12])
            assert code == tether_client.USAGE and "--by" in err and "'bob'" in err, (name, out, err)

    await a_poller_seen_just_now(dev_env, queue)
    outcomes = {}
    for by, kind, extra in (("bob", "approve", []), ("carol", "reject", ["--reason", "not this one"])):
        code, out, err = await cli(kind, run, "--by", by, "--plan-hash", plan_hash[:12], "--decision-id", f"{by}-{run}",
                                   *extra, env={"TETHER_VERDICT_TIMEOUT": "3"})
        outcomes[by] = code
        assert code != tether_client.USAGE, (by, out, err)
        if code == tether_client.PENDING:
            assert f"{by}-{run}" in out and f"tether status {run}" in out and "pending" in out, out
    assert outcomes == {"bob": tether_client.PENDING, "carol": tether_client.PENDING}, outcomes

    # A worker of the run's build comes back: it takes both, in the order they were sent.
    async with running_worker(dev_env.client, policy=POLICY, task_queue=queue):
        done = await tether_client.run_outcome(dev_env.client.get_workflow_handle(run))
        assert done.state.value == "COMPLETED"
        records = {r.refs.decision_id: r for r in await tether_client.full_timeline(dev_env.client, run)
                   if r.refs.decision_id}
    assert records[f"bob-{run}"].kind == "transition" and records[f"bob-{run}"].actor == "user:bob"
    assert records[f"carol-{run}"].kind == "refused"
