"""Record real histories of the main paths into tests/histories/*.json (`make record-histories`).

Each path runs on a local dev server with the real billing service and a worker in this
process; its event history is saved as JSON. tests/workflows/test_replay.py replays them all with
Temporal's Replayer, so a workflow change that would break runs already in flight fails CI.
Re-record only for a change that is compatible by design (see docs/changing-workflows.md).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = Path(sys.executable).parent
RING = HERE / "recording.keys"


def steps(*names: str) -> list[dict]:
    catalog = {
        "get": {"tool": "get_order", "args": {"order_id": "A-1001"}},
        "refund": {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 700, "reason": "r"}},
        "big_refund": {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 11000, "reason": "r"}},
        "email": {"tool": "send_email", "args": {"to": "grace@example.com", "subject": "s", "body": "b"}},
    }
    return [catalog[n] for n in names]


Drive = Callable[[Client, WorkflowHandle], Awaitable[None]]


def shapes(billing: Any) -> list[tuple[str, list[dict], dict, Drive]]:
    """Every run shape the histories record, each as (name, playbook, request overrides, how a
    person drives it): the replay conformance harness runs the same ones live
    (tests/workflows/test_replay_conformance.py)."""
    from tests.helpers.runs import approval_for
    from tests.helpers.waiting import wait_for_state
    from workflows.contract import ApprovalDecision, DecideRequest, DecideResult, HandoffRequest

    async def approve(handle: WorkflowHandle, approver: str = "bob") -> None:
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal(
            "approve", approval_for(snap, approver)
        )

    async def approve_path(client: Client, h: WorkflowHandle) -> None:
        await approve(h)

    async def reject_path(client: Client, h: WorkflowHandle) -> None:
        snap = await wait_for_state(h, "AWAITING_APPROVAL")
        await h.signal("reject", approval_for(snap, "bob", "r1", reason="no"))

    async def refused_then_approved(client: Client, h: WorkflowHandle) -> None:
        snap = await wait_for_state(h, "AWAITING_APPROVAL")
        await h.signal("approve", ApprovalDecision(decision_id="stale", approver="bob", plan_hash="0" * 64))
        await h.signal("approve", approval_for(snap, "alice", "self"))
        await h.signal("approve", approval_for(snap, "bob", "ok"))
        await h.signal("approve", approval_for(snap, "bob", "ok"))

    async def queue_full_path(client: Client, h: WorkflowHandle) -> None:
        # A flood of alice's own approvals (four eyes refuses each): past QUEUED_PER_SENDER
        # waiting for the policy check, the rest are refused unjudged (rule queue_full, the
        # tether-queue-cap marker); then bob's approval.
        snap = await wait_for_state(h, "AWAITING_APPROVAL")
        await asyncio.gather(*(h.signal("approve", approval_for(snap, "alice", f"own-{i}")) for i in range(24)))
        await approve(h)

    async def nothing(client: Client, h: WorkflowHandle) -> None:
        return None

    async def replan_then_approve(client: Client, h: WorkflowHandle) -> None:
        first = await wait_for_state(h, "AWAITING_APPROVAL")
        for _ in range(100):  # the first request expires and the run replans...
            snap = await wait_for_state(h, "AWAITING_APPROVAL", "PLANNING", "VALIDATED")
            if snap.state_version > first.state_version + 2:
                break
            await asyncio.sleep(0.1)
        await approve(h)  # ...the second request is approved

    async def retry_path(client: Client, h: WorkflowHandle) -> None:
        billing.fail_next("refunds", 2, status=503, when="after_commit")
        await approve(h)

    async def handoff_path(client: Client, h: WorkflowHandle) -> None:
        await wait_for_state(h, "AWAITING_APPROVAL")
        await h.signal("handoff", HandoffRequest(by="dana", reason="customer called"))

    async def cancel_path(client: Client, h: WorkflowHandle) -> None:
        await wait_for_state(h, "AWAITING_APPROVAL")
        await h.cancel(reason="withdrawn")

    async def continue_as_new_path(client: Client, h: WorkflowHandle) -> None:
        await wait_for_state(h, "AWAITING_APPROVAL")
        first = (await h.describe()).run_id
        # Refusals with long comments (~120 KB of history): the run continues once its history
        # is CARRY_AMORTIZE times what it carries (the server suggests it much earlier).
        for i in range(60):
            await h.signal("approve", ApprovalDecision(decision_id=f"s{i}", approver="eve", plan_hash="0" * 64, comment="x" * 2000))
        for _ in range(100):
            if (await h.describe()).run_id != first:
                break
            await asyncio.sleep(0.1)
        await approve(client.get_workflow_handle(h.id))

    async def decide_path(client: Client, h: WorkflowHandle) -> None:
        snap = await wait_for_state(h, "AWAITING_APPROVAL")
        request = DecideRequest(kind="approve", **approval_for(snap, "bob").model_dump())
        await h.execute_update("decide", request, result_type=DecideResult)

    async def roster_path(client: Client, h: WorkflowHandle) -> None:
        # bob is on the run's roster: his approval goes to the write with no activity between,
        # and the write's tool worker judges it (ToolCall.judge).
        await decide_path(client, h)

    async def decide_refused_path(client: Client, h: WorkflowHandle) -> None:
        # Issue 19: a policy refusal through the Update is on the record (the handler's path).
        snap = await wait_for_state(h, "AWAITING_APPROVAL")
        own = DecideRequest(kind="approve", **approval_for(snap, "alice").model_dump())
        await h.execute_update("decide", own, result_type=DecideResult)
        request = DecideRequest(kind="approve", **approval_for(snap, "bob").model_dump())
        await h.execute_update("decide", request, result_type=DecideResult)

    async def revise_path(client: Client, h: WorkflowHandle) -> None:
        # Issue 22: a revision (a new plan version, a new request), then its approval.
        snap = await wait_for_state(h, "AWAITING_APPROVAL")
        revised = [{"tool": s.tool, "args": dict(s.args)} for s in snap.plan.steps]
        revised[0]["args"]["amount_cents"] = 500
        pending = snap.pending_approval
        revision = {"kind": "revise", "decision_id": uuid.uuid4().hex, "editor": "carol", "plan_hash": pending.plan_hash,
                    "request_id": pending.request_id, "steps": revised, "reason": "lower"}
        await h.execute_update("decide", revision, result_type=DecideResult)
        await approve(h)

    async def partial_path(client: Client, h: WorkflowHandle) -> None:
        snap = await wait_for_state(h, "AWAITING_APPROVAL")
        request = DecideRequest(kind="approve", **{**approval_for(snap, "bob").model_dump(), "steps": [1, 2]})
        await h.execute_update("decide", request, result_type=DecideResult)

    async def compensated_path(client: Client, h: WorkflowHandle) -> None:
        # Issue 24: the refund is issued, the email is refused for good, the refund is voided.
        billing.fail_next("emails", 1, status=400)
        await approve(h)

    async def unsafe_path(client: Client, h: WorkflowHandle) -> None:
        billing.fail_next("emails", 1, status=503, when="after_commit")
        await approve(h)

    return [
        ("read_only", steps("get"), {}, nothing),
        ("approve", steps("get", "refund"), {}, approve_path),
        ("reject", steps("refund"), {}, reject_path),
        ("refused_then_approved", steps("refund"), {}, refused_then_approved),
        ("queue_full", steps("refund"), {}, queue_full_path),
        ("expiry", steps("refund"), {"limits": {"approval_ttl_seconds": 1}}, nothing),
        ("replan", steps("refund"), {"limits": {"approval_ttl_seconds": 3, "on_expiry": "replan", "max_replans": 1}}, replan_then_approve),
        ("retry", steps("refund"), {}, retry_path),
        ("handoff", steps("refund"), {}, handoff_path),
        ("cancel", steps("refund"), {}, cancel_path),
        ("validation_failed", [{"tool": "wire_money", "args": {}}], {"limits": {"max_replans": 1}}, nothing),
        ("unsafe_unknown_outcome", steps("email"), {}, unsafe_path),
        ("continue_as_new", steps("refund"), {}, continue_as_new_path),
        ("decide", steps("refund"), {}, decide_path),
        ("roster", steps("refund", "get"), {}, roster_path),
        # The same path, its first plan's re-check judged by the planner call (PlanJudged).
        ("plan_judged", steps("refund", "get"), {}, roster_path),
        ("decide_refused", steps("refund"), {}, decide_refused_path),
        ("revise", steps("refund"), {}, revise_path),
        ("partial", steps("get", "refund", "email"), {}, partial_path),
        ("compensated", steps("refund", "email"), {"on_failure": "compensate"}, compensated_path),
        # A parallel group of a read and an idempotent write, approved, then a step after its barrier.
        ("parallel", [{"parallel": steps("get", "refund")}, *steps("get")], {}, approve_path),
        # A delegated lookup (a child run), then a refund with approval.
        ("delegate", [{"delegate": {"goal": "look up the order", "tools": ["get_order"], "max_steps": 2,
                                    "playbook": steps("get")}}, *steps("refund")], {}, approve_path),
    ]


async def main() -> None:
    # Imported here: the sandbox re-imports this module, and the workflow must not see them run.
    from examples.billing.service import make_server
    from tests.helpers.billing import Billing
    from tests.helpers.runs import make_request, running_worker, start_run
    from workflows.published import SEARCH_ATTRIBUTES

    db = HERE / f".record-{uuid.uuid4().hex[:6]}.db"
    server = make_server(0, str(db))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    billing = Billing(url=f"http://127.0.0.1:{server.server_address[1]}", db=db)
    os.environ["BILLING_URL"] = billing.url
    # The workers' key ring for the recording: a fixture (no secret), committed beside the
    # histories, since replaying them checks every attestation and seal with it.
    from tether.store.keys import KEY_SETTING

    os.environ[KEY_SETTING] = str(RING)

    paths = shapes(billing)

    async def record(paths: list, extra_args: list[str]) -> None:
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=str(BIN / "temporal"),
            search_attributes=SEARCH_ATTRIBUTES,
            data_converter=pydantic_data_converter,
            dev_server_extra_args=["--headless", *extra_args],
        )
        try:
            async with running_worker(env.client) as worker:
                for name, playbook, overrides, drive in paths:
                    handle = await start_run(env.client, worker, make_request(playbook, **overrides), run_id=f"history-{name}")
                    await drive(env.client, handle)
                    try:
                        await env.client.get_workflow_handle(handle.id).result()
                    except Exception:
                        pass  # cancelled
                    # The continue-as-new path saves the first run: the one that continued.
                    history = await env.client.get_workflow_handle(handle.id, run_id=handle.result_run_id).fetch_history()
                    (HERE / f"{name}.json").write_text(history.to_json())
                    print(f"recorded {name}: {len(history.events)} events, ends {history.events[-1].event_type}")
                    if name == "continue_as_new":
                        # And the run it continued into: its carried state and seal replay too.
                        latest = await env.client.get_workflow_handle(handle.id).fetch_history()
                        (HERE / "continued.json").write_text(latest.to_json())
                        print(f"recorded continued: {len(latest.events)} events")
        finally:
            await env.shutdown()

    only = set(sys.argv[1:])  # names: record only these paths (the others stay as recorded)
    if only:
        paths = [p for p in paths if p[0] in only]
    try:
        await record([p for p in paths if p[0] != "continue_as_new"], [])
        # A server that suggests continue-as-new after a few dozen events.
        await record(
            [p for p in paths if p[0] == "continue_as_new"],
            ["--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=40"],
        )
    finally:
        server.shutdown()
        for stale in HERE.glob(".record-*.db*"):
            stale.unlink()


if __name__ == "__main__":
    asyncio.run(main())
    from tether.connection import exit_process

    exit_process(0)  # past the Temporal runtime's teardown crash (sdk-python #300)
