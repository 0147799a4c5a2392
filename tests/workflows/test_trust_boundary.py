"""The trust boundary, tried as a hostile user would (issue: nothing from outside the worker
can bypass, wedge or impersonate). Real servers, real signals and starts from a raw client:
each case ends with nothing executed that a verified person did not approve for that exact
request, and the refusal on the timeline with its rule."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError, WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tether.policy.files import PolicyStore
from tether.tools.sdk import REGISTRY, ToolContext, ToolError, ToolRegistry, tool
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot, timeline
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import task_failure, wait_for_state
from tests.helpers.forger import Forger
from tests.helpers.invariants import check_timeline, tools_by_call
from workflows.contract import ApprovalDecision, HandoffRequest, Plan, PlanStep, ToolCatalog, ToolEffect
from workflows.policy_file import TenantPolicy
from workflows.wire import PolicySnapshot
from workflows.run_state import RunData, RunOutcome
from workflows.states import Lifecycle, RunState, TransitionRecord
from tests.helpers.signing import KEYS, POLICY, signed

S = RunState


def refund(amount: int, order: str = "A-1002", reason: str = "trust test") -> dict:
    return {"tool": "issue_refund", "args": {"order_id": order, "amount_cents": amount, "reason": reason}}


GET = {"tool": "get_order", "args": {"order_id": "A-1002"}}


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    return path


@asynccontextmanager
async def secure_worker(env: WorkflowEnvironment, path: Path, **options: Any) -> AsyncIterator[Any]:
    async with running_worker(env.client, policy=PolicyStore.from_env(str(path)), **options) as worker:
        yield worker


async def start_signed(env: WorkflowEnvironment, worker: Any, steps: list[dict], who: str = "alice", **fields: Any) -> WorkflowHandle:
    run_id = unique("run")
    request = make_request(steps, tenant="secure", requested_by=who, **fields)
    key = Path(worker.task_queue + ".pem")
    key.write_bytes(KEYS[who].private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    try:
        request = tether_client.sign_request(request, run_id, key)
    finally:
        key.unlink()
    return await start_run(env.client, worker, request, run_id)


async def record_of(handle: WorkflowHandle, decision_id: str) -> TransitionRecord:
    for _ in range(300):
        found = [r for r in await timeline(handle) if r.refs.decision_id == decision_id]
        if found:
            return found[-1]
        await asyncio.sleep(0.02)
    raise AssertionError(f"decision {decision_id} never recorded")


async def refused(handle: WorkflowHandle, decision: ApprovalDecision, signal: str = "approve") -> str | None:
    await handle.signal(signal, decision)
    record = await record_of(handle, decision.decision_id)
    assert record.kind == "refused", record
    return record.rule


def events(history: Any, kind: int) -> list[Any]:
    return [e for e in history.events if e.event_type == kind]


# ----------------------------------------------------------------------------- 2: forged state


def forged_request() -> dict:
    """A start input carrying a made-up run: mid-execution of a refund nobody approved, with a
    catalog that calls the refund read-only."""
    info = REGISTRY.get("issue_refund").info().model_copy(update={"effect": ToolEffect.READ_ONLY, "requires_approval": False})
    step = PlanStep(tool_call_id="tc-forged", tool="issue_refund", args=refund(777, reason="forged")["args"])
    data = RunData(
        lifecycle=Lifecycle(state=S.EXECUTING_TOOL, state_version=4),
        catalog=ToolCatalog(tools=[info]),
        policy=PolicySnapshot(tenant="default", policy=TenantPolicy(), policy_hash="0" * 64, source="forged"),
        plan=Plan(steps=[step], plan_hash=Plan.hash_steps([step])),
    )
    request = make_request([refund(777, reason="forged")]).model_dump(mode="json")
    request["carryover"] = data.model_dump(mode="json")
    return request


async def test_a_start_input_with_forged_state_fails_before_any_activity(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(dev_env.client) as worker:
        handle = await dev_env.client.start_workflow("AgentRun", forged_request(), id=unique("forged"), task_queue=worker.task_queue)
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    assert "may not carry state" in str(failure.value.cause)
    history = await handle.fetch_history()
    assert not events(history, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
    assert not events(history, EventType.EVENT_TYPE_MARKER_RECORDED)  # no local activity either
    assert [r for r in billing.refunds() if r["amount_cents"] == 777] == []


async def test_state_continued_into_a_run_without_this_workers_seal_is_refused(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    # Continue-as-new from a workflow that is not this run's previous run: the server says the
    # run continued, but nothing a Tether worker sealed comes with it.
    # A forgery stops the run where it stands: its workflow task fails, naming what failed to
    # verify; nothing is scheduled, nothing written.
    async with running_worker(dev_env.client, extra_workflows=[Forger]) as worker:
        handle = await dev_env.client.start_workflow("Forger", forged_request(), id=unique("forger"), task_queue=worker.task_queue)
        latest = dev_env.client.get_workflow_handle(handle.id)
        message = await task_failure(dev_env.client, handle.id, "forgery")
    assert "the carried state" in message and "seal" in message and f"tether repair {handle.id}" in message
    history = await latest.fetch_history()
    scheduled = events(history, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
    assert scheduled == []
    assert [r for r in billing.refunds() if r["amount_cents"] == 777] == []


# ----------------------------------------------------------------------------- 3: identity


async def test_names_are_normalised_before_four_eyes(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(ts_env.client) as worker:  # no policy file: anyone but the requester
        handle = await start_run(ts_env.client, worker, make_request([refund(300)], requested_by="alice"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert await refused(handle, approval_for(snap, "Alice")) == "four_eyes"
        assert await refused(handle, approval_for(snap, "ＡＬＩＣＥ")) == "four_eyes"  # full-width
        for disguised in ("alice ", "alice\u200b", " alice"):
            await handle.signal("approve", {**approval_for(snap, "bob").model_dump(), "approver": disguised})
        await handle.signal("approve", approval_for(snap, "bob", "marker"))
        await record_of(handle, "marker")
        after = await snapshot(handle)
        assert after.refusals.get("malformed_signal unknown") == 3
        records = [r for r in await timeline(handle) if r.rule == "malformed_signal"]
        assert all("whitespace or invisible" in r.reason for r in records)
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED
    assert [r.actor for r in outcome.timeline if r.to_state == S.APPROVED] == ["user:bob"]


async def test_a_look_alike_name_cannot_approve_and_never_shows_as_an_approver(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    cyrillic = "\u0430lice"  # а (U+0430, Cyrillic) + lice: renders as alice
    async with running_worker(ts_env.client) as worker:  # the default policy: anyone but the requester
        handle = await start_run(ts_env.client, worker, make_request([refund(300)], requested_by="alice"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        # As a signal: recorded as refused under its own rule, the name itself not on the record.
        await handle.signal("approve", {**approval_for(snap, "bob").model_dump(), "approver": cyrillic})
        # Through decide: refused before history, with the rule's words.
        with pytest.raises(WorkflowUpdateFailedError) as failure:
            await handle.execute_update("decide", {**approval_for(snap, "bob").model_dump(), "approver": cyrillic, "kind": "approve"})
        assert "mixes scripts" in str(failure.value.cause) and "reads as 'alice'" in str(failure.value.cause)
        # An ASCII look-alike passes as a name, but four-eyes compares skeletons: a1ice is alice.
        assert await refused(handle, approval_for(snap, "a1ice")) == "four_eyes"
        await handle.signal("approve", approval_for(snap, "bob", "marker"))
        await record_of(handle, "marker")
        records = await timeline(handle)
        assert (await snapshot(handle)).approved_by == ["bob"]
        outcome = await run_outcome(handle)
    look_alike = [r for r in records if r.rule == "look_alike_name"]
    assert len(look_alike) == 1 and "U+0430 is cyrillic" in look_alike[0].reason and look_alike[0].actor == "unknown"
    four_eyes = next(r for r in records if r.rule == "four_eyes")
    assert "a1ice looks like alice, who requested this run" in four_eyes.reason
    assert outcome.state == S.COMPLETED
    assert [r.actor for r in outcome.timeline if r.to_state == S.APPROVED] == ["user:bob"]
    assert not any(cyrillic in r.actor or cyrillic in r.reason for r in records + list(outcome.timeline))


async def test_an_unsigned_or_forged_identity_cannot_start_or_decide(ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path) -> None:
    async with secure_worker(ts_env, policy_file) as worker:
        # A run started for zed, unsigned: it fails at once, before planning.
        zed = await start_run(ts_env.client, worker, make_request([refund(11000)], tenant="secure", requested_by="zed"))
        outcome = await run_outcome(zed)
        assert outcome.state == S.FAILED and outcome.timeline[-1].refs.error_code == "signature_required"
        assert [r.to_state for r in outcome.timeline] == [S.FAILED]

        # alice, signed, asks for a HIGH RISK refund of 110.00; she then poses as carol and erin.
        handle = await start_signed(ts_env, worker, [refund(11000)])
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert snap.requester_verified and snap.pending_approval.risk == "high"
        assert await refused(handle, approval_for(snap, "carol")) == "signature_required"
        assert await refused(handle, signed("alice", snap, as_name="carol")) == "bad_signature"
        assert await refused(handle, signed("alice", snap, as_name="erin")) == "bad_signature"
        assert await refused(handle, signed("alice", snap)) == "four_eyes"
        assert await refused(handle, signed("alice", snap, as_name="Alice")) == "four_eyes"
        # A signature for reject does not approve.
        wrong_kind = signed("carol", snap, "reject")
        assert await refused(handle, wrong_kind) == "bad_signature"
        assert (await snapshot(handle)).state_version == snap.state_version
        # The two finance approvers, signed: the refund runs once.
        await handle.signal("approve", signed("carol", snap))
        await handle.signal("approve", signed("erin", snap))
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED
    assert [r.actor for r in outcome.timeline if r.kind == "accepted" or r.to_state == S.APPROVED] == [
        "user:carol (signed)", "user:erin (signed)"
    ]
    check_timeline(outcome.timeline, tools_by_call(outcome))
    key = next(r.refs.idempotency_key for r in outcome.timeline if r.refs.idempotency_key)
    assert len(billing.refunds(key)) == 1


# ----------------------------------------------------------------------------- 4: replays


async def test_a_signed_decision_cannot_be_replayed_on_a_later_run_or_request(ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path) -> None:
    async with secure_worker(ts_env, policy_file) as worker:
        first = await start_signed(ts_env, worker, [refund(900)])
        snap1 = await wait_for_state(first, "AWAITING_APPROVAL")
        bobs = signed("bob", snap1)
        await first.signal("reject", signed("bob", snap1, "reject", reason="not now"))
        assert (await run_outcome(first)).state == S.REJECTED
        # The same workflow id again, same plan (so the same plan hash): bob's old approval,
        # replayed verbatim, names another request of another run.
        run_id = first.id
        request = make_request([refund(900)], tenant="secure", requested_by="alice")
        key = Path(worker.task_queue + ".pem")
        key.write_bytes(KEYS["alice"].private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        with pytest.raises(tether_client.TetherError):  # id reuse is refused unless asked for
            await tether_client.start_run(ts_env.client, tether_client.sign_request(request, run_id, key), run_id=run_id, queue=worker.task_queue)
        second = await tether_client.start_run(
            ts_env.client, tether_client.sign_request(request, run_id, key), run_id=run_id, queue=worker.task_queue, allow_id_reuse=True
        )
        key.unlink()
        snap2 = await wait_for_state(second, "AWAITING_APPROVAL")
        assert snap2.pending_approval.plan_hash == snap1.pending_approval.plan_hash
        assert snap2.first_run_id != snap1.first_run_id
        assert await refused(second, bobs) == "stale_request"
        # Even rebound to the new request, the old signature does not cover it.
        rebound = bobs.model_copy(update={"request_id": snap2.pending_approval.request_id, "decision_id": uuid.uuid4().hex})
        assert await refused(second, rebound) == "bad_signature"
        await second.signal("approve", signed("bob", snap2))
        outcome = await run_outcome(second)
    assert outcome.state == S.COMPLETED
    assert len([r for r in billing.refunds() if r["amount_cents"] == 900]) == 1


async def test_a_decision_for_an_earlier_request_of_the_same_plan_does_not_count(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    # The request expires and the run replans: the same refund, the same plan hash, a new request.
    limits = {"approval_ttl_seconds": 3600, "on_expiry": "replan", "max_replans": 2}
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund(400)], limits=limits))
        round1 = await wait_for_state(handle, "AWAITING_APPROVAL")
        prepared = approval_for(round1, "bob", "prepared-for-round-1")
        await ts_env.sleep(3700)
        for _ in range(200):
            round2 = await snapshot(handle)
            if round2.pending_approval and round2.pending_approval.request_id != round1.pending_approval.request_id:
                break
            await asyncio.sleep(0.02)
        assert round2.pending_approval.plan_hash == round1.pending_approval.plan_hash
        assert await refused(handle, prepared) == "stale_request"
        await handle.signal("approve", approval_for(round2, "bob"))
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED
    assert len([r for r in billing.refunds() if r["amount_cents"] == 400]) == 1


# ----------------------------------------------------------------------------- 5: policy holes


async def test_split_refunds_are_judged_on_their_sum(ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path) -> None:
    # Four refunds of 49.99 on a 120.00 order: each is under the 50.00 auto-approval limit,
    # together they are 199.96 and need a person. The service would refuse the fourth anyway.
    async with secure_worker(ts_env, policy_file) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund(4999)] * 4, tenant="shop"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL", "EXECUTING_TOOL", "COMPLETED")
        assert snap.state == S.AWAITING_APPROVAL, "a split refund was auto-approved"
        assert [r for r in billing.refunds() if r["order_id"] == "A-1002"] == []
        await handle.signal("reject", approval_for(snap, "bob", reason="split"))
        assert (await run_outcome(handle)).state == S.REJECTED
        # One refund of 49.99 is still auto-approved.
        single = await start_run(ts_env.client, worker, make_request([refund(4999)], tenant="shop"))
        outcome = await run_outcome(single)
    assert outcome.state == S.COMPLETED
    assert "policy needs no approval" in next(r.reason for r in outcome.timeline if r.from_state == S.VALIDATED)


async def test_a_tool_withdrawn_mid_run_stops_an_auto_approved_write(dev_env: WorkflowEnvironment, billing: Billing, policy_file: Path) -> None:
    # get_order fails once (a 1 s retry backoff, real time); the file withdraws the refund
    # meanwhile; the re-check before the write stops it although no approval was ever needed.
    billing.fail_next("orders", 1)
    async with secure_worker(dev_env, policy_file) as worker:
        handle = await start_run(dev_env.client, worker, make_request([GET, refund(1000)], tenant="shop"))
        await wait_for_state(handle, "RETRY_WAIT")
        policy_file.write_text(POLICY.replace('tools = ["get_order", "issue_refund", "hold_then_fail"]', 'tools = ["get_order", "hold_then_fail"]'))
        # From then on the run judges by the current file (issue 18): the replanned refund no
        # longer validates for this tenant, and the run ends without writing.
        outcome = await run_outcome(handle)
        records = outcome.timeline
        assert outcome.state == S.FAILED
        assert any("[tool_withdrawn]" in r.reason for r in records), [r.reason for r in records]
        assert any("not allowed for this tenant" in r.reason for r in records if r.to_state == S.VALIDATION_FAILED)
        assert [r for r in billing.refunds() if r["order_id"] == "A-1002"] == []


async def test_a_handoff_sent_before_the_policy_snapshot_is_screened_when_taken(ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path) -> None:
    async with secure_worker(ts_env, policy_file) as worker:
        handle = await ts_env.client.start_workflow(
            "AgentRun",
            make_request([refund(6000)], tenant="shop"),  # over the auto-approval limit: it waits
            id=unique("sws"),
            task_queue=worker.task_queue,
            start_signal="handoff",
            start_signal_args=[HandoffRequest(by="mallory", reason="mine now", decision_id="mallory-1")],
            result_type=RunOutcome,
        )
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        record = await record_of(handle, "mallory-1")
        assert (record.kind, record.rule) == ("refused", "tenant_membership")
        await handle.signal("handoff", HandoffRequest(by="dana", reason="call the customer", decision_id="dana-1"))
        outcome = await run_outcome(handle)
    assert outcome.state == S.HANDED_OFF and outcome.timeline[-1].actor == "operator:dana"
    assert snap.state == S.AWAITING_APPROVAL


class Hold(BaseModel):
    order_id: str


GATE = threading.Event()
HOLD_TOOLS = ToolRegistry()


@tool(effect=ToolEffect.READ_ONLY, max_retries=0, registry=HOLD_TOOLS, name="hold_then_fail")
def hold_then_fail(args: Hold, ctx: ToolContext) -> dict:
    """Waits for the test, then fails for good."""
    GATE.wait(20)
    raise ToolError("the order system said no", code="refused_by_target", permanent=True)


async def test_a_handoff_the_run_cannot_honour_is_recorded_as_refused(ts_env: WorkflowEnvironment, policy_file: Path) -> None:
    GATE.clear()
    async with secure_worker(ts_env, policy_file, registry=HOLD_TOOLS) as worker:
        handle = await start_run(ts_env.client, worker, make_request([{"tool": "hold_then_fail", "args": {"order_id": "A-1"}}], tenant="shop"))
        await wait_for_state(handle, "EXECUTING_TOOL")
        await handle.signal("handoff", HandoffRequest(by="dana", reason="taking over", decision_id="dana-late"))
        await asyncio.sleep(0.3)  # the handoff is accepted while the tool runs
        GATE.set()
        outcome = await run_outcome(handle)
    assert outcome.state == S.EXECUTION_FAILED
    (record,) = [r for r in outcome.timeline if r.refs.decision_id == "dana-late"]
    assert (record.kind, record.rule) == ("refused", "run_ended")
    assert "before the handoff could be honoured" in record.reason


# ----------------------------------------------------------------------------- 6: no values


async def test_the_audit_record_copies_no_argument_values(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    secret = "SSN-123-45-6789"
    bad = [refund(100, order=secret), {"tool": "issue_refund", "args": {**refund(100)["args"], "approve_all": True}}]
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request(bad, limits={"max_replans": 0}))
        outcome = await run_outcome(handle)
        snap = await snapshot(handle)
    assert outcome.state == S.FAILED
    reason = next(r.reason for r in outcome.timeline if r.to_state == S.VALIDATION_FAILED)
    assert "order_id: does not match the required pattern" in reason
    assert "1 argument(s) the tool does not take" in reason
    text = " ".join(r.model_dump_json() for r in outcome.timeline) + (snap.last_error or "")
    assert secret not in text and "123-45" not in text
