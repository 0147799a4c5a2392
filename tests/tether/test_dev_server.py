"""On the real dev server: search attributes, the CLI end to end with its exit codes, and
continue-as-new."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from tether.client import run_outcome
from tests.helpers.cli import Cli
from tests.helpers.flooded_run import FloodedRun, OlderRun
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot, timeline
from tests.helpers.runs import approval_for, flood_until_continued, make_request, running_worker, start_run, unique
from tests.helpers.servers import CAN_THRESHOLD
from tests.helpers.waiting import wait_for_state
from workflows.budgets import CARRY_AMORTIZE
from workflows.published import BUILD, STATE_ATTRIBUTE, TENANT_ATTRIBUTE
from workflows.contract import ApprovalDecision
from workflows.effects import QUEUE_CAP
from workflows.run_state import RunOutcome
from workflows.states import RunState, is_legal_path

ROOT = Path(__file__).resolve().parents[2]
REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 700, "reason": "cli"}}]


async def wait_listed(env: WorkflowEnvironment, query: str, run_id: str, present: bool = True) -> None:
    """Visibility is eventually consistent: poll until the run shows up (or not)."""
    for _ in range(100):
        ids = [wf.id async for wf in env.client.list_workflows(query)]
        if (run_id in ids) == present:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{run_id} {'not ' if present else ''}found by {query!r}")


async def test_search_attributes_find_waiting_runs(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    tenant = unique("tenant")
    async with running_worker(dev_env.client) as worker:
        waiting = await start_run(dev_env.client, worker, make_request(REFUND, tenant=tenant))
        done = await start_run(
            dev_env.client, worker, make_request([{"tool": "get_order", "args": {"order_id": "A-1001"}}], tenant=tenant)
        )
        await wait_for_state(waiting, "AWAITING_APPROVAL")
        await run_outcome(done)
        query = f"AgentRunState='AWAITING_APPROVAL' AND AgentTenant='{tenant}'"
        await wait_listed(dev_env, query, waiting.id)
        await wait_listed(dev_env, f"AgentRunState='COMPLETED' AND AgentTenant='{tenant}'", done.id)
        ids = [wf.id async for wf in dev_env.client.list_workflows(query)]
        assert done.id not in ids
        description = await waiting.describe()
        assert description.typed_search_attributes.get(TENANT_ATTRIBUTE) == tenant
        assert description.typed_search_attributes.get(STATE_ATTRIBUTE) == "AWAITING_APPROVAL"
        # Current details for the Web UI name the state and how to approve.
        details = (await waiting.query("__temporal_workflow_metadata")).current_details
        assert "AWAITING_APPROVAL" in details and "tether approve" in details
        await waiting.cancel(reason="test done")


async def test_an_approved_run_is_not_listed_as_waiting_while_it_writes(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """Only rests and endings are published, but leaving a rest is too: from the approval to the
    write's activity, the list must already say the run works (never AWAITING_APPROVAL)."""
    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request(REFUND, tenant=unique("tenant")))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        assert (await run_outcome(handle)).state == RunState.COMPLETED
        history = await handle.fetch_history()
    published, tools = [], []
    for i, event in enumerate(history.events):
        if event.HasField("upsert_workflow_search_attributes_event_attributes"):
            fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
            if STATE_ATTRIBUTE.name in fields:
                published.append((i, json.loads(fields[STATE_ATTRIBUTE.name].data)))
        if (event.HasField("activity_task_scheduled_event_attributes")
                and event.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"):
            tools.append(i)
    states = [state for _, state in published]
    assert "AWAITING_APPROVAL" in states and states[-1] == "COMPLETED", states
    waited = states.index("AWAITING_APPROVAL")
    left_at, left_to = published[waited + 1]
    write_at = next(i for i in tools if i > published[waited][0])
    assert left_to not in ("AWAITING_APPROVAL", "RECEIVED") and left_at < write_at, (published, write_at)


async def test_cli_end_to_end_with_exit_codes(dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path) -> None:
    playbook = tmp_path / "refund.json"
    playbook.write_text(json.dumps(REFUND))
    tenant = unique("cli")
    async with running_worker(dev_env.client) as worker:
        cli = Cli(dev_env, worker)
        run_id = unique("cli-run")
        code, out, err = await cli(
            "start", "--goal", "Refund A-1002", "--playbook", str(playbook), "--requested-by", "alice",
            "--tenant", tenant, "--id", run_id, "--wait", "--json",
        )
        assert code == 0, err
        started = json.loads(out)
        assert started["state"] == "AWAITING_APPROVAL"
        plan_hash = started["pending_approval"]["plan_hash"]

        code, _, err = await cli("start", "--goal", "again", "--playbook", str(playbook),
                                 "--requested-by", "alice", "--id", run_id)
        assert code == 2 and "already exists" in err

        code, out, _ = await cli("status", run_id)
        assert code == 0 and "AWAITING_APPROVAL" in out and plan_hash in out

        other = await start_run(dev_env.client, worker, make_request(REFUND, tenant=unique("other")))
        await wait_for_state(other, "AWAITING_APPROVAL")
        code, out, _ = await cli("list", "--state", "AWAITING_APPROVAL", "--tenant", tenant)
        assert code == 0 and run_id in out
        assert other.id not in out, "list --tenant shows only that tenant's runs"
        await other.cancel()

        code, _, err = await cli("approve", run_id, "--by", "bob", "--plan-hash", "0" * 64)
        assert code == 1 and "does not match the plan under review" in err and "[rule: stale_plan_hash]" in err
        assert f"tether status {run_id}" in err and plan_hash[:12] not in err  # no hash to paste

        code, out, err = await cli("approve", run_id, "--by", "bob", "--plan-hash", plan_hash, "--comment", "ok")
        assert code == 0, err
        assert "issue_refund" in out and plan_hash in out and "APPROVED" in out
        handle = dev_env.client.get_workflow_handle(run_id)
        await run_outcome(handle)

        code, _, err = await cli("approve", run_id, "--by", "bob", "--unreviewed")
        assert code == 1 and "already finished" in err or "not awaiting approval" in err

        code, out, _ = await cli("timeline", run_id, "--json")
        records = json.loads(out)
        assert code == 0 and records[-1]["to_state"] == "COMPLETED"
        # The stale hash reached the run, and is on its record (issue 19: every attempt is).
        assert [r["rule"] for r in records if r["kind"] == "refused"] == ["stale_plan_hash"]

        # Cancel through the CLI (reject and handoff: tests/tether/test_cli.py).
        for verb, extra, final in (("cancel", ["--by", "dana", "--reason", "withdrawn"], "CANCELLED"),):
            rid = unique(verb)
            code, _, err = await cli("start", "--goal", "g", "--playbook", str(playbook),
                                     "--requested-by", "alice", "--id", rid, "--wait")
            assert code == 0, err
            code, _, err = await cli(verb, rid, *extra)
            assert code == 0, err
            snap = await wait_for_state(dev_env.client.get_workflow_handle(rid), final)
            assert snap.state.value == final
            # A request the run judged (the cancel Update), not a Temporal cancel: the execution
            # completes, its outcome CANCELLED; who asked is on the run's record.
            history = await dev_env.client.get_workflow_handle(rid).fetch_history()
            assert not any(e.HasField("workflow_execution_cancel_requested_event_attributes") for e in history.events)
            code, out, err = await cli("status", rid)
            assert code == 0 and "cancellation requested: withdrawn" in out and "(user:dana)" in out, (out, err)

        code, _, err = await cli("cancel", run_id, "--by", "dana", "--reason", "late")
        assert code == 1 and "already finished" in err

    code, _, err = await cli("status", "no-such-run")
    assert code == 2 and "unknown run 'no-such-run'" in err
    code, _, err = await cli("start", "--goal", "g", "--requested-by", "alice")
    assert code == 2 and "--playbook" in err
    code, _, err = await cli("start", "--goal", "g", "--playbook", str(tmp_path / "missing.json"), "--requested-by", "a")
    assert code == 2 and "not found" in err
    code, _, err = await cli("list", "--state", "NAPPING")
    assert code == 2 and "unknown state" in err
    code, _, err = await cli("status", "x", env={"TEMPORAL_ADDRESS": "127.0.0.1:1"})
    assert code == 2 and "cannot reach Temporal" in err and "make dev-server" in err
    assert len(err.strip().splitlines()) == 1


async def test_a_cancel_refused_before_history_says_refused_and_its_rule(dev_env: WorkflowEnvironment) -> None:
    """A cancel Update the run's validator refuses (continuing as new: sent again, it counts in
    the continued run) is REFUSED with its rule, exit 1: never a traceback. An older build's
    plain error is REFUSED with its message, no rule."""
    async with running_worker(dev_env.client, extra_workflows=[FloodedRun, OlderRun]) as worker:
        cli = Cli(dev_env, worker)
        for workflow, said in (("FloodedRun", "cancel refused: this run has taken 1500 decide Updates and continues "
                                "as new first: send it again [rule: continuing_as_new]"),
                               ("OlderRun", "this build takes no cancel request")):
            handle = await dev_env.client.start_workflow(workflow, id=unique(workflow), task_queue=worker.task_queue)
            code, out, err = await cli("cancel", handle.id, "--by", "dana", "--reason", "withdrawn")
            assert (code, out) == (1, ""), (code, out, err)
            assert len(err.strip().splitlines()) == 1 and said in err and "unexpected" not in err, err
            await handle.terminate("test over")


# ----------------------------------------------------------------------------- continue-as-new



async def resting(handle, timeout: float = 5.0) -> None:
    """Until the run's latest workflow task has completed and it waits on its approval timer: a
    query answered while a local activity runs can make a later replay diverge (an sdk-core
    issue, in the closing notes), and these tests are about what the run carries, not that."""
    from temporalio.api.enums.v1 import EventType

    busy = (EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED, EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED)
    for _ in range(int(timeout / 0.05)):
        events = (await handle.fetch_history()).events
        if events[-1].event_type not in busy and any(e.HasField("timer_started_event_attributes") for e in events):
            return
        await asyncio.sleep(0.05)


async def test_a_flood_that_never_pauses_still_lets_the_run_continue_as_new(
    small_history_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Refused decisions sent back to back, without a pause, until the run has continued: the
    settle before continue-as-new gives way after a few tries, so a flood cannot hold a run until
    the server's history limit ends it; every refusal is still counted once."""
    env = small_history_env
    async with running_worker(env.client) as worker:
        handle = await start_run(env.client, worker, make_request(REFUND, tenant="acme"))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        first_run = (await handle.describe()).run_id
        current = env.client.get_workflow_handle(handle.id)
        sent = await flood_until_continued(current, first_run, "flood")
        await resting(current)
        for _ in range(100):
            carried = await snapshot(current)
            if sum(carried.refusals.values()) == sent:
                break
            await asyncio.sleep(0.05)
        assert carried.refusals == {"stale_plan_hash user:eve": sent}
        await current.terminate("test over")


async def test_continue_as_new_keeps_state_timeline_and_search_attributes(
    small_history_env: WorkflowEnvironment, billing: Billing
) -> None:
    env = small_history_env
    async with running_worker(env.client) as worker:
        handle = await start_run(env.client, worker, make_request(REFUND, tenant="acme"))
        first = await wait_for_state(handle, "AWAITING_APPROVAL")
        first_run = (await handle.describe()).run_id
        # Refused decisions grow the history until continue-as-new is worth what it writes.
        current = env.client.get_workflow_handle(handle.id)  # the latest run: it may continue mid-flood
        sent = await flood_until_continued(current, first_run, "stale")
        description = await handle.describe()
        # It did not continue at the suggestion, but once its history was CARRY_AMORTIZE times
        # what continuing writes (its one marker is the build's).
        events = [e async for e in env.client.get_workflow_handle(handle.id, run_id=first_run).fetch_history_events()]
        carried = events[-1].workflow_execution_continued_as_new_event_attributes.input.ByteSize()
        patches = [e.marker_recorded_event_attributes.details["patch-data"].payloads[0].data for e in events
                   if e.HasField("marker_recorded_event_attributes") and e.marker_recorded_event_attributes.marker_name == "core_patch"]
        assert [json.loads(p)["id"] if p.startswith(b"{") else json.loads(p) for p in patches] == [BUILD], patches
        assert len(events) > 2 * CAN_THRESHOLD
        assert sum(e.ByteSize() for e in events) >= 0.9 * CARRY_AMORTIZE * carried, (len(events), carried)
        assert description.typed_search_attributes.get(STATE_ATTRIBUTE) == "AWAITING_APPROVAL"
        assert description.typed_search_attributes.get(TENANT_ATTRIBUTE) == "acme"
        latest = env.client.get_workflow_handle(handle.id, result_type=RunOutcome)
        await resting(latest)
        carried = await snapshot(latest)
        assert (carried.state, carried.state_version) == (RunState.AWAITING_APPROVAL, first.state_version)
        assert carried.pending_approval == first.pending_approval
        records = await timeline(latest)
        # A flood is counted, not stored: the first few on the record, the rest in the count.
        assert sum(r.kind == "refused" for r in records) == 4
        assert carried.refusals == {"stale_plan_hash user:eve": sent}
        # The approval still binds to the same plan, across runs.
        await latest.signal("approve", approval_for(first, "bob", "ok"))
        outcome = await run_outcome(latest)
        assert outcome.state == RunState.COMPLETED
        assert is_legal_path(outcome.timeline)
        assert len({r.state_version for r in outcome.timeline if r.kind == "transition"}) == outcome.timeline[-1].state_version


async def test_refusals_the_policy_checks_leave_no_local_activity_behind(
    small_history_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Decisions refused by the policy activity (the requester approving her own plan), past
    the server's suggestion: the run continues as new, and its history holds no local activity
    (sdk-core hands one's result over at another point live than on replay when a query was
    answered in between: docs/known-issues.md)."""
    env = small_history_env
    async with running_worker(env.client) as worker:
        handle = await start_run(env.client, worker, make_request(REFUND, tenant="acme"))
        first = await wait_for_state(handle, "AWAITING_APPROVAL")
        first_run = (await handle.describe()).run_id
        current = env.client.get_workflow_handle(handle.id)
        await flood_until_continued(current, first_run, "own", lambda i: approval_for(first, "alice"))
        events = [e async for e in env.client.get_workflow_handle(handle.id, run_id=first_run).fetch_history_events()]
        await resting(current)
        refused = [r for r in await timeline(current) if r.kind == "refused"]
    markers = [e.marker_recorded_event_attributes for e in events if e.HasField("marker_recorded_event_attributes")]
    assert {m.marker_name for m in markers} == {"core_patch"}, markers  # no local activity's
    # The build's, and the queue cap's where the flood outran the policy check (how far it does
    # is the machine's timing: a cache-off worker always, a quick one maybe not).
    patches = [json.loads(m.details["patch-data"].payloads[0].data)["id"] for m in markers]
    assert patches[0] == BUILD and patches[1:] in ([], [QUEUE_CAP]), patches
    checks = [e for e in events if e.HasField("activity_task_scheduled_event_attributes")
              and e.activity_task_scheduled_event_attributes.activity_type.name == "policy_check_decision"]
    assert checks and events[-1].HasField("workflow_execution_continued_as_new_event_attributes")
    assert refused and all("alice" in r.actor for r in refused)
