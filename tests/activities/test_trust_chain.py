"""Nothing without the keys can write (issue 18), tried as a hostile worker would: a rogue poller
on the task queue that holds no key answers workflow tasks over raw gRPC with commands of its
own. Real dev servers, the real billing service (its email endpoint counts every email)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowQueryFailedError
from temporalio.service import RPCError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tether.store.keys import genkey
from tether.policy.files import PolicyStore
from tether.client import run_outcome
from tests.helpers.rogue import continue_as_new, rogue_answer, schedule_tool
from tests.helpers.billing import Billing, emails_to
from tests.helpers.queries import snapshot
from tests.helpers.runs import approval_for, flood_until_continued, make_request, running_worker, unique
from tests.helpers.waiting import task_failure, wait_for_state
from workflows.contract import canonical_json
from workflows.wire import Capability, PolicySnapshot, Proposal, ProposedStep, ToolCall, args_digest
from workflows.run_state import RunData, RunOutcome

CONVERTER = pydantic_data_converter.payload_converter


def email_step(to: str) -> dict:
    return {"tool": "send_email", "args": {"to": to, "subject": "hello", "body": "forged?"}}


async def tool_failures(client: Client, workflow_id: str, run_id: str | None = None) -> list[str]:
    history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    return [
        f"{e.activity_task_failed_event_attributes.failure.application_failure_info.type}: "
        f"{e.activity_task_failed_event_attributes.failure.message}"
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
    ]


async def wait_tool_failure(client: Client, workflow_id: str) -> list[str]:
    for _ in range(300):
        failures = await tool_failures(client, workflow_id)
        if failures:
            return failures
        await asyncio.sleep(0.05)
    raise AssertionError("the forged execute_tool attempt never ended")


async def test_a_rogue_poller_cannot_make_a_tool_write(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    client = dev_env.client
    to = f"{uuid.uuid4().hex[:10]}@example.com"
    queue = unique("tq")
    # A legitimate run sends one email, approved by bob: its capability is in its history.
    async with running_worker(client, task_queue=queue) as worker:
        legit = await tether_client.start_run(client, make_request([email_step(to)]), run_id=unique("legit"), queue=queue)
        snap = await wait_for_state(legit, "AWAITING_APPROVAL")
        await legit.signal("approve", approval_for(snap, "bob"))
        assert (await legit.result()).state.value == "COMPLETED"
    assert len(emails_to(billing, to)) == 1
    history = await legit.fetch_history()
    scheduled = [
        e.activity_task_scheduled_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"
    ]
    captured = CONVERTER.from_payloads(scheduled[0].input.payloads, [ToolCall])[0]
    assert captured.capability is not None and captured.capability.tool == "send_email"

    # The victim run's first workflow task goes to the rogue (no real worker polls yet).
    victim_queue = unique("tq")
    victim = await client.start_workflow(
        "AgentRun", make_request([{"tool": "get_order", "args": {"order_id": "A-1001"}}]), id=unique("victim"),
        task_queue=victim_queue,
    )
    # Right run, right attempt, a mac made up without the key.
    forged_cap = captured.capability.model_copy(
        update={"workflow_id": victim.id, "run_id": victim.result_run_id, "activity_id": "rogue-2", "mac": "0" * 64}
    )
    calls = [
        ToolCall(tool="send_email", args=email_step(to)["args"], tool_call_id="tc-rogue", idempotency_key="k",
                 run_id=victim.id, tenant="default"),  # no capability at all
        captured.model_copy(update={"run_id": victim.id}),  # another run's real capability
        captured.model_copy(update={"capability": forged_cap}),  # a made-up mac
    ]
    await rogue_answer(client, victim_queue, victim.id, [schedule_tool(victim_queue, c, f"rogue-{i}") for i, c in enumerate(calls)])
    async with running_worker(client, task_queue=victim_queue):
        for _ in range(300):
            failures = await tool_failures(client, victim.id)
            if len(failures) == len(calls):
                break
            await asyncio.sleep(0.05)
    await victim.terminate("test over")
    assert len(failures) == len(calls), failures
    assert all(f.startswith("capability_invalid: write refused") for f in failures), failures
    assert sorted(f.split(": ", 2)[2][:14] for f in failures) == ["no capability ", "the capability", "the capability"], failures
    assert any("another call" in f for f in failures) and any("does not verify" in f for f in failures), failures
    assert len(emails_to(billing, to)) == 1  # only the approved one


async def test_an_older_seal_or_a_captured_continue_as_new_input_is_refused(
    small_history_env: WorkflowEnvironment, billing: Billing
) -> None:
    env = small_history_env
    client = env.client
    to = f"{uuid.uuid4().hex[:10]}@example.com"
    queue = unique("tq")
    async with running_worker(client, task_queue=queue) as worker:
        handle = await tether_client.start_run(client, make_request([email_step(to)]), run_id=unique("chain"), queue=queue)
        first = await wait_for_state(handle, "AWAITING_APPROVAL")
        # Refused decisions grow the history until continuing as new is worth it.
        latest = client.get_workflow_handle(handle.id)
        await flood_until_continued(latest, handle.result_run_id, "chain",
                                    lambda i: approval_for(first.pending_approval.plan_hash, "bob"))
        # It continues once its seal has settled (a short durable timer): wait for that event,
        # with a bound only against a hang.
        deadline = asyncio.get_running_loop().time() + 120
        while (second_run := (await latest.describe()).run_id) == handle.result_run_id:
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        assert second_run != handle.result_run_id, "the run never continued as new"
        await wait_for_state(latest, "AWAITING_APPROVAL")
    # The second run's own start input: the first run's carried state and seal.
    history = await client.get_workflow_handle(handle.id, run_id=second_run).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    assert started.continued_execution_run_id == handle.result_run_id
    captured = started.input

    # 1. A rogue takes a workflow task of the second run and continues it as new with that older
    #    sealed state (the seal is by the first run, the server says the new run continues the
    #    second).
    await latest.signal("approve", approval_for(first.pending_approval.plan_hash, "bob"))  # a workflow task
    await rogue_answer(client, queue, handle.id, [continue_as_new(queue, captured)])
    # 2. The captured continue-as-new input, continued into the same id from another workflow.
    #    That workflow's own task is on a queue of its own: on `queue` the first forgery's new run
    #    already waits, and a poller there may be handed either task (a queue is not FIFO).
    rogue_queue = unique("tq-rogue")
    other = await client.start_workflow("Forger", {"x": 1}, id=unique("replayed"), task_queue=rogue_queue)
    await rogue_answer(client, rogue_queue, other.id, [continue_as_new(queue, captured)])
    # A forgery stops each run where it stands: its workflow task fails naming the carried state.
    async with running_worker(client, task_queue=queue):
        for target in (handle.id, other.id):
            message = await task_failure(client, target, "forgery")
            assert "the carried state" in message and "seal" in message
    assert emails_to(billing, to) == []


# ----------------------------------------------------------------------------- fresh signed starts


def secure_policy(path: Path, extra: str = "") -> Path:
    from tests.helpers.signing import POLICY

    path.write_text(POLICY.replace("require_signatures = true\n", f"require_signatures = true\n{extra}", 1))
    return path


async def test_a_captured_signed_start_replayed_after_the_window_is_refused(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    from cryptography.hazmat.primitives import serialization

    from tests.helpers.signing import KEYS, signed

    client = dev_env.client
    path = secure_policy(tmp_path / "policy.toml", 'start_signature_ttl = "3s"\n')
    reason = uuid.uuid4().hex
    run_id = unique("signed")
    key = tmp_path / "alice.pem"
    key.write_bytes(KEYS["alice"].private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    request = tether_client.sign_request(
        make_request([{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 3000, "reason": reason}}],
                     tenant="secure", requested_by="alice"),
        run_id,
        key,
    )
    assert request.nonce and request.issued_at is not None
    captured = request.model_dump(mode="json")
    async with running_worker(client, policy=PolicyStore.from_env(str(path))) as worker:
        first = await client.start_workflow("AgentRun", captured, id=run_id, task_queue=worker.task_queue, result_type=RunOutcome)
        snap = await wait_for_state(first, "AWAITING_APPROVAL")
        assert snap.requester_verified
        await first.signal("approve", signed("bob", snap))
        assert (await first.result()).state.value == "COMPLETED"
        await asyncio.sleep(3.5)  # the window passes
        # The captured start, verbatim, under the same id (the server's default allows reuse).
        again = await client.start_workflow("AgentRun", captured, id=run_id, task_queue=worker.task_queue, result_type=RunOutcome)
        outcome = await run_outcome(again)
    assert outcome.state.value == "FAILED"
    assert outcome.timeline[-1].refs.error_code == "signature_stale", outcome.timeline[-1]
    assert "start_signature_ttl" in outcome.timeline[-1].reason
    assert len([r for r in billing.refunds() if r["reason"] == reason]) == 1


def test_start_signature_ttl_takes_seconds_or_durations() -> None:
    from workflows import policy
    from workflows.policy_file import TenantPolicy

    assert TenantPolicy().start_signature_ttl == 600
    assert TenantPolicy.model_validate({"start_signature_ttl": "10m"}).start_signature_ttl == 600
    assert TenantPolicy.model_validate({"start_signature_ttl": 90}).start_signature_ttl == 90
    assert TenantPolicy.model_validate({"start_signature_ttl": "2h"}).start_signature_ttl == 7200
    for bad in ("soon", "-5m", 0):
        with pytest.raises(ValueError):
            TenantPolicy.model_validate({"start_signature_ttl": bad})
    now = datetime.now(timezone.utc)
    assert policy.start_freshness_refusal(now - timedelta(minutes=11), now, 600).rule == "signature_stale"
    assert policy.start_freshness_refusal(now - timedelta(minutes=9), now, 600) is None
    assert policy.start_freshness_refusal(now + timedelta(minutes=5), now, 600).rule == "signature_stale"
    assert policy.start_freshness_refusal(None, now, 600).rule == "signature_stale"


# ----------------------------------------------------------------------------- the current file decides


def tight_policy(path: Path, *, roles: str = '["approver"]', signatures: bool = False) -> Path:
    from tests.helpers.signing import KEYS, public

    path.write_text(f"""
[tenants.tight]
tools = ["get_order", "issue_refund"]
approval_roles = {roles}
require_signatures = {'true' if signatures else 'false'}
[tenants.tight.approvers]
alice = {{ roles = ["approver"] }}
bob = {{ roles = ["approver"] }}
dana = {{ roles = ["finance"] }}
carol = {{ roles = ["approver", "finance"], public_key = "{public(KEYS['carol'])}" }}
""")
    return path


async def test_a_tightened_policy_stops_an_approved_write_and_asks_for_an_approval_that_can_be_given(
    ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    from tests.helpers.policies import refund
    from tests.helpers.signing import signed

    path = tight_policy(tmp_path / "policy.toml")
    get = {"tool": "get_order", "args": {"order_id": "A-1002"}}
    async with running_worker(ts_env.client, policy=PolicyStore.from_env(str(path))) as worker:
        # 1. bob approves; while the read step waits to be retried, approval_roles becomes finance.
        billing.fail_next("orders", 1, status=503)
        handle = await tether_client.start_run(
            ts_env.client, make_request([get, refund(1100)], tenant="tight"), run_id=unique("tight"), queue=worker.task_queue
        )
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        await wait_for_state(handle, "RETRY_WAIT")
        tight_policy(path, roles='["finance"]')
        await ts_env.sleep(10)
        again = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert again.pending_approval.request_id != snap.pending_approval.request_id
        assert again.pending_approval.roles == ["finance"] and again.pending_approval.approvals_required == 1
        refund_key = f"{handle.id}:{next(s.tool_call_id for s in snap.plan.steps if s.tool == 'issue_refund')}"
        assert billing.refunds(refund_key) == []
        from workflows.contract import DecideRequest, DecideResult

        bob = approval_for(again, "bob").model_dump()
        # bob can no longer give it (refused on the record, with its rule) ...
        refused = await handle.execute_update("decide", DecideRequest(**bob, kind="approve"), result_type=DecideResult)
        assert (refused.outcome, refused.rule) == ("refused", "role"), refused
        await handle.signal("approve", approval_for(again, "dana"))  # ... dana can
        first = await run_outcome(handle)
        assert first.state.value == "COMPLETED"

        # 2. dana approves, unsigned; before the write, the tenant turns require_signatures on.
        billing.fail_next("orders", 1, status=503)
        handle = await tether_client.start_run(
            ts_env.client, make_request([get, refund(1200)], tenant="tight"), run_id=unique("tight"), queue=worker.task_queue
        )
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "dana"))
        await wait_for_state(handle, "RETRY_WAIT")
        tight_policy(path, roles='["finance"]', signatures=True)
        await ts_env.sleep(10)
        again = await wait_for_state(handle, "AWAITING_APPROVAL")
        timeline = await handle.query("timeline", result_type=list)
        stopped = [r for r in timeline if "approver_revoked" in r["reason"]]
        assert stopped and "signature_required" in stopped[-1]["reason"], [r["reason"] for r in timeline]
        assert again.pending_approval.roles == ["finance"]
        assert [r for r in billing.refunds() if r["amount_cents"] == 1200 and r["idempotency_key"].startswith(handle.id)] == []
        await handle.signal("approve", signed("carol", again))  # finance, signed: can be given
        second = await run_outcome(handle)
    assert second.state.value == "COMPLETED"
    assert [r for r in second.timeline if r.to_state.value == "APPROVED"][-1].actor == "user:carol (signed)"


# ----------------------------------------------------------------------------- one key ring for the fleet


def carried_state(run_id: str, steps: list[dict]) -> tuple[dict, str, RunData]:
    """A run's state in AWAITING_APPROVAL, as a worker would carry it into continue-as-new."""
    import examples.billing.tools  # noqa: F401
    from tether.tools.sdk import REGISTRY
    from workflows import policy as rules
    from workflows.engine import Engine

    request = make_request(steps)
    data = RunData(
        catalog=REGISTRY.catalog(),
        policy=PolicySnapshot(tenant="default", policy=rules.DEFAULT_TENANT_POLICY, policy_hash="h", source="test"),
    )
    engine = Engine(data, request, workflow_id=run_id, new_request_id=lambda: uuid.uuid4().hex)
    now = datetime.now(timezone.utc)
    engine.received(now)
    engine.proposal(Proposal(steps=[ProposedStep(**s) for s in steps]), at=now, new_id=lambda n: f"tc-{n:03d}-{uuid.uuid4().hex[:6]}")
    engine.after_validated(now)
    carried = data.model_dump(mode="json")
    digest = hashlib.sha256(canonical_json(carried).encode()).hexdigest()
    return {**request.model_dump(mode="json"), "carryover": carried}, digest, data


async def snapshot_on_a(handle: Any) -> Any:
    """The snapshot, from whichever worker answers with the key: a query that lands on the
    worker lacking the seal's key fails there (its replay checks the seal), never the run."""
    while True:
        try:
            return await snapshot(handle)
        except WorkflowQueryFailedError as e:
            assert "key_missing" in str(e)


async def test_two_workers_one_missing_the_fleets_newest_key_every_run_completes(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Mid-rotation: worker A holds [K1, K2] (seals and mints with K2), worker B only [K1]. A
    continued run whose first task B takes fails that workflow task, never the run; a write
    attempt B takes is scheduled again; every run completes on A."""
    import urllib.request

    from tether.store.keys import KeyRing
    from tether.metrics import prometheus_runtime
    from tests.helpers.forger import NewerWorker
    from tests.helpers.ports import free_port
    from worker import create_worker

    env = dev_env
    ring_a, ring_b = tmp_path / "a.keys", tmp_path / "b.keys"
    genkey(ring_b)
    ring_a.write_text(ring_b.read_text())
    newest = genkey(ring_a)
    keys_a, keys_b = KeyRing.from_env(str(ring_a)), KeyRing.from_env(str(ring_b))
    assert keys_a.newest == newest and newest not in keys_b.keys
    port = free_port()
    client_b = await tether_client.connect(
        target_host=env.client.service_client.config.target_host, namespace=env.client.namespace,
        runtime=prometheus_runtime(f"127.0.0.1:{port}"), data_converter=pydantic_data_converter,
    )
    sealing_queue, queue = unique("tq"), unique("tq")
    caplog.set_level(logging.WARNING)
    runs = []
    # 1. A seals the carried state of 3 runs with K2; they continue as new on a queue only B polls.
    async with create_worker(env.client, task_queue=sealing_queue, keys=keys_a, extra_workflows=[NewerWorker]):
        async with create_worker(client_b, task_queue=queue, keys=keys_b):
            for i in range(3):
                run_id = unique("rot")
                to = f"rot{i}-{uuid.uuid4().hex[:8]}@example.com"
                request, digest, data = carried_state(run_id, [email_step(to)])
                await env.client.start_workflow(
                    "NewerWorker", {"request": request, "digest": digest, "task_queue": queue}, id=run_id, task_queue=sealing_queue
                )
                runs.append((run_id, to))
            for run_id, _ in runs:  # B fails the first workflow task of each, naming the key id
                for _ in range(300):
                    history = await env.client.get_workflow_handle(run_id).fetch_history()
                    failed = [e.workflow_task_failed_event_attributes.failure.message for e in history.events
                              if e.HasField("workflow_task_failed_event_attributes")]
                    if failed:
                        break
                    await asyncio.sleep(0.05)
                assert failed and newest in failed[0], failed
                assert (await env.client.get_workflow_handle(run_id).describe()).status.name == "RUNNING"
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                metrics = r.read().decode()
    missing = [line for line in metrics.splitlines() if line.startswith("tether_key_missing") and newest in line]
    assert missing, "no tether_key_missing metric for the missing key id"
    assert any(newest in r.getMessage() and "does not hold" in r.getMessage() for r in caplog.records)
    # 2. A worker holding K2 takes the tasks B failed; then B polls again too: write attempts it
    #    takes (their capabilities are by K2) are scheduled again until A runs them.
    outcomes = []
    async with create_worker(env.client, task_queue=queue, keys=keys_a):
        began = asyncio.get_running_loop().time()
        for run_id, _ in runs:
            handle = env.client.get_workflow_handle(run_id, result_type=RunOutcome)
            for _ in range(1200):  # until the retried task lands on A (Temporal's task retry backoff)
                try:
                    snap = await snapshot(handle)
                    if snap.state.value == "AWAITING_APPROVAL":
                        break
                except (RPCError, WorkflowQueryFailedError):
                    pass  # not yet taken by A, or the query landed on B (it lacks the key the seal names)
                await asyncio.sleep(0.1)
        print(f"\nthe tasks B failed were taken by A within {asyncio.get_running_loop().time() - began:.1f}s")
        async with create_worker(client_b, task_queue=queue, keys=keys_b):
            for run_id, _ in runs:
                handle = env.client.get_workflow_handle(run_id, result_type=RunOutcome)
                await handle.signal("approve", approval_for(await snapshot_on_a(handle), "bob"))
            for run_id, _ in runs:  # the end, from history (a query could land on B)
                await asyncio.wait_for(env.client.get_workflow_handle(run_id).result(), 60)
        for run_id, _ in runs:
            outcomes.append(await asyncio.wait_for(run_outcome(env.client.get_workflow_handle(run_id, result_type=RunOutcome)), 60))
    assert [o.state.value for o in outcomes] == ["COMPLETED"] * 3
    assert all(len(emails_to(billing, to)) == 1 for _, to in runs)


async def test_a_capability_by_a_key_the_worker_lacks_is_not_refused_for_good(tmp_path: Path) -> None:
    """execute_tool on a worker without the capability's key id: the tool is not called, and
    the error says the attempt may be scheduled again (not capability_invalid)."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from tether.store.keys import KeyRing
    from activities.tools import ToolActivities
    from tether.tools.sdk import REGISTRY

    other = KeyRing.of(b"x" * 64)
    call = ToolCall(tool="send_email", args=email_step("nobody@example.com")["args"], tool_call_id="tc-1",
                    idempotency_key="wf:tc-1", run_id="wf", tenant="default")
    env = ActivityEnvironment()
    info = env.info
    cap = Capability.model_construct(
        workflow_id=info.workflow_id, run_id=info.workflow_run_id, activity_id=info.activity_id, request_id="r",
        plan_hash="p", tool_call_id="tc-1", tool="send_email", args_digest=args_digest(call.args),
        idempotency_key="wf:tc-1", key_id="", expires_at=datetime.now(timezone.utc) + timedelta(seconds=30), mac="",
    )
    kid, mac = other.sign(cap.fields())
    call.capability = Capability.model_validate({**cap.model_dump(), "key_id": kid, "mac": mac})
    lacking = ToolActivities(REGISTRY, KeyRing.of(b"y" * 64))
    with pytest.raises(ApplicationError) as refused:
        await env.run(lacking.execute_tool, call)
    assert refused.value.type == "capability_key_missing" and kid in refused.value.message
    expired = call.model_copy(deep=True)
    expired.capability.expires_at = datetime.now(timezone.utc) - timedelta(seconds=1)
    kid, expired.capability.mac = other.sign(expired.capability.fields())
    with pytest.raises(ApplicationError) as late:
        await env.run(ToolActivities(REGISTRY, other).execute_tool, expired)
    assert late.value.type == "capability_expired"


def test_a_worker_without_the_fleets_key_ring_refuses_to_start(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    missing = tmp_path / "nowhere" / "state.keys"
    env = {**os.environ, "TETHER_STATE_KEY_FILE": str(missing), "TEMPORAL_ADDRESS": "127.0.0.1:1"}
    done = subprocess.run([sys.executable, str(ROOT / "worker.py")], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1, done
    assert "TETHER_STATE_KEY_FILE" in done.stderr and str(missing) in done.stderr, done.stderr
    assert not missing.exists()  # it created nothing
    short = tmp_path / "short.keys"
    short.write_text("tooshort\n")
    done = subprocess.run([sys.executable, str(ROOT / "worker.py")], env={**env, "TETHER_STATE_KEY_FILE": str(short)},
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1 and "line 1" in done.stderr, done.stderr


def test_key_ids_are_fingerprints_and_the_newest_signs(tmp_path: Path) -> None:
    from tether.store.keys import KeyRing, KeyNotHeld, key_id

    path = tmp_path / "ring"
    path.write_text("a" * 64 + "\n")  # a file written by an earlier version: one key, no id
    old = KeyRing.from_env(str(path))
    assert list(old.keys) == [key_id(b"a" * 64)]
    kid, mac = old.sign({"x": 1})
    genkey(path)  # rotation: a newer key appended
    ring = KeyRing.from_env(str(path))
    assert ring.newest != kid and ring.verify(kid, {"x": 1}, mac)  # older ids still verify
    assert ring.sign({"x": 1})[0] == ring.newest
    assert not ring.verify(kid, {"x": 2}, mac)
    with pytest.raises(KeyNotHeld):
        KeyRing.of(b"b" * 64).verify(kid, {"x": 1}, mac)


async def test_status_and_list_say_when_temporal_closed_a_run_left_waiting(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    from tether.cli.output import format_status

    async with running_worker(dev_env.client) as worker:
        handle = await tether_client.start_run(dev_env.client, make_request(), run_id=unique("closed"), queue=worker.task_queue)
        await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.terminate("operator pulled the plug")
        status = await tether_client.status(dev_env.client, handle.id)
        rows = [r for r in await tether_client.list_runs(dev_env.client, state="AWAITING_APPROVAL", limit=200) if r.run_id == handle.id]
    assert status.state.value == "AWAITING_APPROVAL" and status.temporal_status == "TERMINATED"
    assert "Temporal closed this run (TERMINATED)" in status.closed_by_temporal
    assert "closed     Temporal closed this run" in format_status(status)
    # Visibility may lag a moment; when the row is there, it says so too.
    assert all(r.closed_by_temporal for r in rows if r.status == "TERMINATED")


async def test_a_retry_the_current_policy_no_longer_allows_is_not_started(ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path) -> None:
    """Retries carry a fresh capability from a fresh re-check: a tool withdrawn while the first
    attempt's failure waits out its backoff is not called again; the step ends naming why."""
    from tests.helpers.signing import POLICY

    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    reason = uuid.uuid4().hex
    billing.fail_next("refunds", 1, status=503)
    async with running_worker(ts_env.client, policy=PolicyStore.from_env(str(path))) as worker:
        handle = await tether_client.start_run(
            ts_env.client,
            make_request([{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 700, "reason": reason}}], tenant="shop"),
            run_id=unique("retry"), queue=worker.task_queue,
        )
        await wait_for_state(handle, "RETRY_WAIT")
        path.write_text(POLICY.replace('tools = ["get_order", "issue_refund", "hold_then_fail"]', 'tools = ["get_order", "hold_then_fail"]'))
        outcome = await run_outcome(handle)
    last = outcome.timeline[-1]
    assert outcome.state.value == "HANDED_OFF", last  # the first attempt's outcome is unknown
    assert "write not started" in last.reason and "tool_withdrawn" in last.reason, last.reason
    assert [r for r in billing.refunds() if r["reason"] == reason] == []
    history = await handle.fetch_history()
    scheduled = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                 and e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"]
    assert len(scheduled) == 1  # only the first attempt
