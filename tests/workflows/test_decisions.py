"""Decisions people make besides yes and no: revise the pending plan, approve part of it.

Real parts: the time-skipping server, a worker with the billing tools, the billing service.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from tether.policy.files import PolicyStore
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, flood_until_continued, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from tests.helpers.invariants import check_timeline, tools_by_call
from workflows.contract import DecideResult, ReviseDecideRequest
from workflows.wire import PlannerInput
from workflows.run_state import RunOutcome, RunSnapshot
from workflows.states import RunState
from tests.helpers.replay import replays

S = RunState

READ = {"tool": "get_order", "args": {"order_id": "A-1002"}}
REFUND = {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 9000, "reason": "late"}}
EMAIL = {"tool": "send_email", "args": {"to": "grace@example.com", "subject": "Refund", "body": "Refunded."}}

# The tenant may not send email; at most 3 steps a run.
POLICY = """
[tenants.default]
tools = ["get_order", "issue_refund", "post_ledger_entry"]
[tenants.default.approvers]
alice = { roles = ["approver"] }
bob = { roles = ["approver"] }
carol = { roles = ["approver"] }
[tenants.default.budgets]
max_steps = 3
[tenants.strict]
editor_may_approve = false
[tenants.strict.approvers]
alice = { roles = ["approver"] }
bob = { roles = ["approver"] }
carol = { roles = ["approver"] }
[tenants.trusting]
reviser_may_approve_alone = true
[tenants.trusting.approvers]
bob = { roles = ["approver"] }
carol = { roles = ["approver"] }
"""


@pytest.fixture(scope="module")
def policy_store(tmp_path_factory: pytest.TempPathFactory) -> PolicyStore:
    path = tmp_path_factory.mktemp("decisions") / "policy.toml"
    path.write_text(POLICY)
    return PolicyStore.from_env(str(path))


async def decide(handle: WorkflowHandle, **payload: Any) -> DecideResult:
    """The decide Update's verdict; a refusal by its validator (before history) as a refused
    verdict with the rule, so these tests hold whichever side refuses."""
    payload.setdefault("decision_id", uuid.uuid4().hex)
    try:
        return await handle.execute_update("decide", payload, result_type=DecideResult)
    except WorkflowUpdateFailedError as e:
        # The validator's refusal is typed by its rule; its message keeps the form "kind refused [rule]: why".
        assert isinstance(e.cause, ApplicationError) and e.cause.type, e.cause
        rule, head = e.cause.type, f"{payload.get('kind')} refused [{e.cause.type}]: "
        assert e.cause.message.startswith(head), (e.cause.message, head)
        snap = await handle.query("snapshot", result_type=RunSnapshot)
        return DecideResult(
            decision_id=payload["decision_id"], outcome="refused", state=snap.state, reason=e.cause.message.removeprefix(head),
            rule=rule,
        )


def revision(snap: RunSnapshot, steps: list[dict], editor: str = "carol", **extra: Any) -> dict:
    pending = snap.pending_approval
    assert pending is not None
    return {
        "kind": "revise",
        "editor": editor,
        "plan_hash": pending.plan_hash,
        "request_id": pending.request_id,
        "steps": steps,
        "reason": "customer asked for less",
        **extra,
    }


def with_amount(amount: Any) -> dict:
    return {**REFUND, "args": {**REFUND["args"], "amount_cents": amount}}


async def planner_inputs(handle: WorkflowHandle) -> list[PlannerInput]:
    history = await handle.fetch_history()
    converter = pydantic_data_converter.payload_converter
    return [
        converter.from_payloads(e.activity_task_scheduled_event_attributes.input.payloads, [PlannerInput])[0]
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "plan"
    ]


async def test_revise_lowers_a_refund_old_request_is_stale_new_one_runs(
    ts_env: WorkflowEnvironment, billing: Billing, policy_store: PolicyStore
) -> None:
    async with running_worker(ts_env.client, policy=policy_store) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND]))
        before = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert before.plan is not None and before.plan.version == 1
        old_approval = approval_for(before, "bob")

        verdict = await decide(handle, **revision(before, [READ, with_amount(1000)]))
        assert verdict.outcome == "transition" and verdict.state == S.VALIDATED, verdict
        after = await wait_for_state(handle, "AWAITING_APPROVAL")
        pending = after.pending_approval
        assert pending is not None and after.plan is not None
        assert after.plan.version == 2 and after.plan.plan_hash != before.plan.plan_hash
        assert pending.request_id != before.pending_approval.request_id
        assert pending.editors == ["carol"] and "amount_cents=10.00 EUR (1000)" in pending.summary
        assert [r.changed for r in after.revisions] == [["replace /1/args/amount_cents"]]
        details = (await handle.query("__temporal_workflow_metadata")).current_details
        assert "**Plan** v2 " in details
        [revised_line] = [line for line in details.splitlines() if line.startswith("**Revised**")]
        assert revised_line == "**Revised** 1 time(s), last by `carol`: `replace /1/args/amount_cents`"

        # The approval prepared for the old request: stale, refused, recorded.
        await handle.signal("approve", old_approval)
        stale = await decide(handle, kind="approve", **approval_for(before, "bob").model_dump(exclude_none=True))
        assert stale.outcome == "refused" and stale.rule == "stale_plan_hash", stale
        ok = await decide(handle, kind="approve", **approval_for(after, "bob").model_dump(exclude_none=True))
        assert ok.outcome == "transition" and ok.state == S.APPROVED, ok
        outcome = await run_outcome(handle)
        await replays(handle)
    assert outcome.state == S.COMPLETED
    keys = {f"{handle.id}:{s.tool_call_id}" for s in outcome.steps if s.tool == "issue_refund"}
    refunds = [r for key in keys for r in billing.refunds(key)]
    assert [r["amount_cents"] for r in refunds] == [1000], "billing holds exactly the revised amount"
    revised = next(r for r in outcome.timeline if r.from_state == S.AWAITING_APPROVAL and r.to_state == S.VALIDATED)
    assert revised.actor == "user:carol" and revised.refs.previous_plan_hash == before.plan.plan_hash
    assert revised.refs.changed == ["replace /1/args/amount_cents"]
    # Paths, never values: neither amount is on the revision record.
    assert "9000" not in revised.model_dump_json(exclude={"at"}) and "1000" not in revised.reason  # (a time may hold 9000)
    assert any(r.kind == "refused" and r.rule == "stale_plan_hash" and r.refs.decision_id == old_approval.decision_id
               for r in outcome.timeline)
    check_timeline(outcome.timeline, tools_by_call(outcome))


@pytest.mark.parametrize(
    ("steps", "why"),
    [
        ([READ, {"tool": "wire_money", "args": {}}], "unknown tool"),
        ([READ, with_amount("ten euros")], "has the wrong type"),
        ([READ, with_amount(10**9)], "is above the maximum"),
        ([READ, REFUND, EMAIL], "not allowed for this tenant"),
        ([READ, REFUND, REFUND, READ], "step budget exhausted"),
        ([READ, REFUND], "nothing to revise"),
    ],
    ids=["unknown-tool", "bad-type", "amount-over-schema-limit", "tool-not-for-tenant", "over-step-budget", "unchanged"],
)
async def test_an_invalid_revision_is_refused_and_changes_nothing(
    ts_env: WorkflowEnvironment, billing: Billing, policy_store: PolicyStore, steps: list[dict], why: str
) -> None:
    async with running_worker(ts_env.client, policy=policy_store) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND]))
        before = await wait_for_state(handle, "AWAITING_APPROVAL")
        verdict = await decide(handle, **revision(before, steps))
        assert verdict.outcome == "refused" and verdict.rule == "invalid_revision", verdict
        assert why in verdict.reason, verdict.reason
        after = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert (after.plan, after.pending_approval, after.revisions) == (before.plan, before.pending_approval, [])
        assert after.state_version == before.state_version
        # The pending request still takes its approval.
        ok = await decide(handle, kind="approve", **approval_for(before, "bob").model_dump(exclude_none=True))
        assert ok.state == S.APPROVED
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED


async def test_partial_approval_runs_the_approved_steps_and_tells_the_planner(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    # The default policy: any tool; the email step (unsafe) needs an approval like the refund.
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND, EMAIL]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        verdict = await decide(handle, kind="approve", steps=[2, 1], **approval_for(snap, "bob").model_dump(exclude_none=True))
        assert verdict.outcome == "transition" and verdict.state == S.APPROVED, verdict
        outcome = await run_outcome(handle)
        inputs = await planner_inputs(handle)
        await replays(handle)
    assert outcome.state == S.COMPLETED
    assert [s.tool for s in outcome.steps] == ["get_order", "issue_refund"]
    assert not [e for e in billing.get("/emails")["emails"] if handle.id in str(e)], "the email was never sent"
    assert len(inputs) == 2 and inputs[0].not_approved == []
    [left_out] = inputs[1].not_approved
    assert (left_out.step, left_out.tool, left_out.by) == (3, "send_email", "bob")
    assert "not approved: send_email" in (outcome.answer or "")
    path = [(r.kind, r.to_state.value) for r in outcome.timeline if r.refs.decision_id == verdict.decision_id]
    # Both recorded: the revision to steps 1-2, then the approval of the result.
    assert path == [("transition", "VALIDATED"), ("transition", "APPROVED")]
    check_timeline(outcome.timeline, tools_by_call(outcome))


async def test_after_a_partial_approval_the_playbook_never_proposes_a_step_that_ran_or_was_left_out(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    """Issue 31, row 8: step 2 of [refund, email] approved alone; the email is sent once and the
    planner proposes neither it (it ran) nor the refund (left out) again: the run completes."""
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([REFUND, EMAIL]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        verdict = await decide(handle, kind="approve", steps=[2], **approval_for(snap, "bob").model_dump(exclude_none=True))
        assert verdict.state == S.APPROVED, verdict
        outcome = await run_outcome(handle)
        inputs = await planner_inputs(handle)
    assert outcome.state == S.COMPLETED, outcome.timeline[-1].reason
    assert [s.tool for s in outcome.steps] == ["send_email"]
    assert len([e for e in billing.get("/emails")["emails"] if handle.id in str(e)]) == 1
    assert len(inputs) == 2 and "not approved: issue_refund" in (outcome.answer or "")
    path = [r.to_state.value for r in outcome.timeline if r.kind == "transition"]
    # The second planning round proposes nothing: no plan v3 to approve, the run completes.
    assert path.count("PLANNING") == 2 and path.count("VALIDATED") == 2 and path[-2:] == ["PLANNING", "COMPLETED"], path


async def test_with_two_approvals_needed_the_other_approves_the_subset(
    ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(
        POLICY.replace('tools = ["get_order", "issue_refund", "post_ledger_entry"]\n', "")
        + '[tenants.default.high_risk]\napprovals = 2\nroles = ["approver"]\n'
        'when = [{ tool = "issue_refund", field = "amount_cents", above = 5000 }]\n'
    )
    async with running_worker(ts_env.client, policy=PolicyStore.from_env(str(path))) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND, EMAIL]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        first = await decide(handle, kind="approve", **approval_for(snap, "carol").model_dump(exclude_none=True))
        assert first.outcome == "accepted"
        part = await decide(handle, kind="approve", steps=[1, 2], **approval_for(snap, "bob").model_dump(exclude_none=True))
        # carol's approval was of the whole plan: the subset needs its second approval anew.
        assert part.outcome == "accepted", part
        subset = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert subset.pending_approval is not None and [a.approver for a in subset.pending_approval.approvals] == ["bob"]
        again = await decide(handle, kind="approve", **approval_for(subset, "bob").model_dump(exclude_none=True))
        assert again.rule == "distinct_approvers"
        done = await decide(handle, kind="approve", **approval_for(subset, "carol").model_dump(exclude_none=True))
        assert done.state == S.APPROVED
        outcome = await run_outcome(handle)
    assert [s.tool for s in outcome.steps] == ["get_order", "issue_refund"]
    check_timeline(outcome.timeline, tools_by_call(outcome))


async def test_editor_may_approve_false_refuses_the_editors_approval(
    ts_env: WorkflowEnvironment, billing: Billing, policy_store: PolicyStore
) -> None:
    async with running_worker(ts_env.client, policy=policy_store) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND], tenant="strict"))
        before = await wait_for_state(handle, "AWAITING_APPROVAL")
        # The requester may correct her own run...
        assert (await decide(handle, **revision(before, [READ, with_amount(1000)], editor="alice"))).state == S.VALIDATED
        after = await wait_for_state(handle, "AWAITING_APPROVAL")
        # ...and still not approve it (four-eyes); carol edits too, so neither editor counts.
        own = await decide(handle, kind="approve", **approval_for(after, "alice").model_dump(exclude_none=True))
        assert own.rule == "four_eyes"
        assert (await decide(handle, **revision(after, [READ, with_amount(900)], editor="carol"))).state == S.VALIDATED
        latest = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert latest.plan is not None and latest.plan.version == 3
        editor = await decide(handle, kind="approve", **approval_for(latest, "carol").model_dump(exclude_none=True))
        assert editor.outcome == "refused" and editor.rule == "editor_approval", editor
        ok = await decide(handle, kind="approve", **approval_for(latest, "bob").model_dump(exclude_none=True))
        assert ok.state == S.APPROVED
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED


async def test_a_refused_partial_approval_changes_nothing(
    ts_env: WorkflowEnvironment, billing: Billing, policy_store: PolicyStore
) -> None:
    """editor_may_approve = false: a partial approval revises the plan, so its approver may not
    approve the result. The run refuses it before narrowing anything: same plan, same request."""
    async with running_worker(ts_env.client, policy=policy_store) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND], tenant="strict"))
        before = await wait_for_state(handle, "AWAITING_APPROVAL")
        part = await decide(handle, kind="approve", steps=[1], **approval_for(before, "bob").model_dump(exclude_none=True))
        assert part.outcome == "refused" and part.rule == "editor_approval", part
        after = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert after.plan == before.plan and after.pending_approval == before.pending_approval
        assert after.revisions == [] and after.state_version == before.state_version
        whole = await decide(handle, kind="approve", **approval_for(after, "bob").model_dump(exclude_none=True))
        assert whole.state == S.APPROVED
        assert (await run_outcome(handle)).state == S.COMPLETED


async def test_whoever_changed_the_plan_is_not_its_only_approver(
    ts_env: WorkflowEnvironment, billing: Billing, policy_store: PolicyStore
) -> None:
    """bob lowers the amount and approves his own revision: accepted, but someone who did not
    revise it must approve too (unless the tenant says reviser_may_approve_alone)."""
    async with running_worker(ts_env.client, policy=policy_store) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND]))
        before = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert (await decide(handle, **revision(before, [READ, with_amount(4900)], editor="bob"))).state == S.VALIDATED
        revised = await wait_for_state(handle, "AWAITING_APPROVAL")
        own = await decide(handle, kind="approve", **approval_for(revised, "bob").model_dump(exclude_none=True))
        assert own.outcome == "accepted" and "still needed" in own.reason, own
        assert (await wait_for_state(handle, "AWAITING_APPROVAL")).pending_approval.revisers == ["bob"]
        other = await decide(handle, kind="approve", **approval_for(revised, "carol").model_dump(exclude_none=True))
        assert other.state == S.APPROVED
        assert (await run_outcome(handle)).state == S.COMPLETED

        trusting = await start_run(ts_env.client, worker, make_request([READ, REFUND], tenant="trusting"))
        before = await wait_for_state(trusting, "AWAITING_APPROVAL")
        assert (await decide(trusting, **revision(before, [READ, with_amount(4800)], editor="bob"))).state == S.VALIDATED
        revised = await wait_for_state(trusting, "AWAITING_APPROVAL")
        alone = await decide(trusting, kind="approve", **approval_for(revised, "bob").model_dump(exclude_none=True))
        assert alone.state == S.APPROVED and "reviser_may_approve_alone = true" in alone.reason, alone


ESCALATING = """
[tenants.default]
[tenants.default.approvers]
bob = { roles = ["approver"] }
mia = { roles = ["manager"] }
[tenants.default.escalation]
normal = [{ after = "2h", notify = ["ops"] }, { after = "6h", roles = ["manager"], notify = ["ops"] }]
high = [{ after = "20m" }]
[notify.webhooks.ops]
url = "http://127.0.0.1:9/hook"
"""


async def test_escalation_stages_fire_on_skipped_time_and_widen_the_roles(
    ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(ESCALATING)
    async with running_worker(ts_env.client, policy=PolicyStore.from_env(str(path))) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        pending = snap.pending_approval
        assert pending is not None and [s.after for s in pending.escalation] == [7200, 21600]
        early = await decide(handle, kind="approve", **approval_for(snap, "mia").model_dump(exclude_none=True))
        assert early.rule == "role", early

        loop = asyncio.get_running_loop()
        started = loop.time()
        await ts_env.sleep(2 * 3600 + 60)
        first = await handle.query("snapshot", result_type=RunSnapshot)
        assert first.pending_approval is not None and first.pending_approval.stage == 1
        still = await decide(handle, kind="approve", **approval_for(first, "mia").model_dump(exclude_none=True))
        assert still.rule == "role", "a manager may approve only after stage 2"
        await ts_env.sleep(4 * 3600)
        second = await handle.query("snapshot", result_type=RunSnapshot)
        elapsed = loop.time() - started
        assert second.pending_approval is not None and second.pending_approval.stage == 2
        assert second.pending_approval.roles == ["approver", "manager"]
        assert second.pending_approval.request_id == pending.request_id, "the same request, escalated"
        details = (await handle.query("__temporal_workflow_metadata")).current_details
        assert "escalation stage 2 of 2" in details and "`manager`" in details
        ok = await decide(handle, kind="approve", **approval_for(second, "mia").model_dump(exclude_none=True))
        assert ok.state == S.APPROVED, ok
        outcome = await run_outcome(handle)
        await replays(handle)
    # Speed is for benchmarks, not assertions: the stages' own times below show the skipped hours.
    print(f"\n[escalation] 2 h and 6 h stages, 8 h skipped: {elapsed:.3f}s real time")
    escalated = [r for r in outcome.timeline if r.kind == "escalated"]
    assert [r.reason.split(":")[0] for r in escalated] == ["escalation stage 1/2", "escalation stage 2/2"]
    assert all(r.actor == "timer" and r.refs.request_id == pending.request_id for r in escalated)
    assert "roles approver, manager may approve" in escalated[1].reason
    # Each at its time after the request opened (timer resolution aside), expiry still a day out.
    fired = [(r.at - pending.opened_at).total_seconds() for r in escalated]
    assert abs(fired[0] - 7200) < 1 and abs(fired[1] - 21600) < 1, fired
    check_timeline(outcome.timeline, tools_by_call(outcome))


async def test_hostile_revisions_wrong_person_repeated_late_concurrent_malformed(
    ts_env: WorkflowEnvironment, billing: Billing, policy_store: PolicyStore
) -> None:
    async with running_worker(ts_env.client, policy=policy_store) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ, REFUND]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        lower = [READ, with_amount(1000)]
        outsider = await decide(handle, **revision(snap, lower, editor="zed"))
        assert outsider.rule == "tenant_membership", outsider
        # Through the signal: malformed (no steps, unknown key) and a forged request id are
        # refused on the record; nothing changes.
        signal = {k: v for k, v in revision(snap, lower).items() if k != "kind"}
        await handle.signal("revise", {**signal, "steps": [], "decision_id": "m1"})
        await handle.signal("revise", {**signal, "kind": "revise", "decision_id": "m2"})  # not a signal key
        await handle.signal("revise", {**signal, "request_id": "forged", "decision_id": "m3"})
        # A revision and an approval of the same request at once: exactly one of them counts.
        results = await asyncio.gather(
            decide(handle, **revision(snap, lower), decision_id="race-revise"),
            decide(handle, kind="approve", **approval_for(snap, "bob", decision_id="race-approve").model_dump(exclude_none=True)),
        )
        counted = [r for r in results if r.outcome != "refused"]
        assert len(counted) == 1, results
        again = await decide(handle, **revision(snap, lower), decision_id="race-revise")
        assert again.rule == "duplicate_decision"
        if counted[0].decision_id == "race-revise":
            after = await wait_for_state(handle, "AWAITING_APPROVAL")
            await handle.signal("approve", approval_for(after, "bob"))
        outcome = await run_outcome(handle)
        late = await handle.query("timeline", result_type=list)
    refused = {r.refs.decision_id: r.rule for r in outcome.timeline if r.kind == "refused"}
    assert refused.get("m3") == "stale_request"
    assert sum(1 for r in outcome.timeline if r.rule == "malformed_signal") == 2
    assert outcome.state == S.COMPLETED and late
    check_timeline(outcome.timeline, tools_by_call(outcome))


async def test_a_signed_revision_covers_the_revised_steps(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    ts_env = dev_env  # the client library checks for a worker (DescribeTaskQueue): a real server
    import tether.client as tether_client
    from workflows import policy as rules

    keys = {name: tether_client.keygen(tmp_path / f"{name}.pem") for name in ("alice", "carol", "bob")}
    path = tmp_path / "policy.toml"
    path.write_text(
        "[tenants.default]\nrequire_signatures = true\n[tenants.default.approvers]\n"
        + "".join(f'{n} = {{ roles = ["approver"], public_key = "{k}" }}\n' for n, k in keys.items())
    )
    async with running_worker(ts_env.client, policy=PolicyStore.from_env(str(path))) as worker:
        request = tether_client.sign_request(make_request([READ, REFUND]), run_id := f"signed-{uuid.uuid4().hex[:8]}", tmp_path / "alice.pem")
        handle = await start_run(ts_env.client, worker, request, run_id=run_id)
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        lower = [READ, with_amount(1000)]
        unsigned = await decide(handle, **revision(snap, lower))
        assert unsigned.rule == "signature_required", unsigned
        # Signed over other steps than those sent: the signature does not cover this revision.
        other = ReviseDecideRequest.model_validate(revision(snap, [READ, with_amount(2000)], decision_id="x"))
        payload = rules.decision_signature_payload(
            workflow_id=run_id, first_run_id=snap.first_run_id, tenant="default", kind="revise",
            decision=other.as_decision(), steps_digest=other.revised_hash(),
        )
        forged = base64.b64encode(tether_client.load_private_key(tmp_path / "carol.pem").sign(payload)).decode()
        bad = await decide(handle, **revision(snap, lower, decision_id="x", signature=forged))
        assert bad.rule == "bad_signature", bad
        given = tether_client.DecisionInput(by="carol", reason="agreed", key=tmp_path / "carol.pem")
        verdict = await tether_client.revise(ts_env.client, run_id, given, lower)
        assert verdict.record is not None and verdict.record.to_state == S.VALIDATED
        assert verdict.record.actor == "user:carol (signed)"
        after = await wait_for_state(handle, "AWAITING_APPROVAL")
        approved = await tether_client.decide(
            ts_env.client, run_id, "approve", tether_client.DecisionInput(by="bob", key=tmp_path / "bob.pem")
        )
        assert approved.record is not None and approved.record.to_state == S.APPROVED
        assert after.plan is not None and after.plan.version == 2
        await handle.result()


async def test_a_revised_escalating_plan_continues_as_new_and_keeps_its_version(
    small_history_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    # Revisions add events; the server suggests continue-as-new after 40: the carried state keeps
    # the plan version, the revisions, the editors and the request.
    path = tmp_path / "policy.toml"
    path.write_text(POLICY.replace("max_steps = 3", "max_steps = 20"))
    env = small_history_env
    async with running_worker(env.client, policy=PolicyStore.from_env(str(path))) as worker:
        handle = await start_run(env.client, worker, make_request([READ, REFUND]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        first_run = (await handle.describe()).run_id
        for amount in (8000, 7000, 6000, 5500):
            assert (await decide(handle, **revision(snap, [READ, with_amount(amount)]))).state == S.VALIDATED
            snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        # Refusals grow the history until the continue-as-new is worth it; it happens while the
        # run waits.
        await flood_until_continued(env.client.get_workflow_handle(handle.id), first_run, "stale")
        carried = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert carried.plan is not None and carried.plan.version == 5
        assert [r.version for r in carried.revisions] == [2, 3, 4, 5]
        assert carried.pending_approval == snap.pending_approval and carried.pending_approval.editors == ["carol"]
        ok = await decide(handle, kind="approve", **approval_for(carried, "bob").model_dump(exclude_none=True))
        assert ok.state == S.APPROVED
        outcome = await run_outcome(env.client.get_workflow_handle(handle.id, result_type=RunOutcome))
    refunds = [r for s in outcome.steps if s.tool == "issue_refund" for r in billing.refunds(f"{handle.id}:{s.tool_call_id}")]
    assert [r["amount_cents"] for r in refunds] == [5500]
