"""The AgentRun workflow end to end on the time-skipping test server, with the real billing
service behind the tools."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.queries import snapshot, timeline
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from workflows.contract import ApprovalDecision, HandoffRequest
from workflows.run_state import RunOutcome, RunSnapshot, RunView
from workflows.states import RunState, is_legal_path

S = RunState

READ_ONLY = [{"tool": "get_order", "args": {"order_id": "A-1001"}}]


def refund(amount: int = 1500, order: str = "A-1002") -> dict:
    return {"tool": "issue_refund", "args": {"order_id": order, "amount_cents": amount, "reason": "test"}}


def approval(target: RunSnapshot | str, approver: str = "bob", decision_id: str | None = None) -> ApprovalDecision:
    return approval_for(target, approver, decision_id)


def path(outcome: RunOutcome) -> list[str]:
    return [r.to_state.value for r in outcome.timeline if r.kind == "transition"]


def refusals(outcome: RunOutcome) -> list[str]:
    return [r.reason for r in outcome.timeline if r.kind == "refused"]


def keys_of(outcome: RunOutcome, tool: str) -> list[str]:
    ids = {s.tool_call_id for s in outcome.steps if s.tool == tool}
    return sorted({r.refs.idempotency_key for r in outcome.timeline if r.refs.tool_call_id in ids})


def upserted_states(events) -> list[str]:
    return [
        e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields["AgentRunState"].data.decode()
        for e in events if e.HasField("upsert_workflow_search_attributes_event_attributes")
        and "AgentRunState" in e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
    ]


async def test_a_start_that_lists_a_run_wrongly_is_corrected_by_its_first_task(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    """Only the client's start says what a run will be (PLANNING): a start by hand that lists it
    as working somewhere else, or as waiting, is corrected at the run's first publish; one whose
    input is no RunRequest is listed FAILED as it fails, not left saying it plans."""
    from temporalio.common import SearchAttributePair, TypedSearchAttributes

    from workflows.published import STATE_ATTRIBUTE, TENANT_ATTRIBUTE

    async with running_worker(ts_env.client) as worker:
        for lie in ("EXECUTING_TOOL", "AWAITING_APPROVAL", "COMPLETED"):
            handle = await ts_env.client.start_workflow(
                "AgentRun", make_request(READ_ONLY), id=unique(f"lie-{lie.lower()}"), task_queue=worker.task_queue,
                search_attributes=TypedSearchAttributes([SearchAttributePair(STATE_ATTRIBUTE, lie),
                                                         SearchAttributePair(TENANT_ATTRIBUTE, "default")]),
            )
            await handle.result()
            assert upserted_states((await handle.fetch_history()).events) == ['"PLANNING"', '"COMPLETED"'], lie
        bad = await ts_env.client.start_workflow(
            "AgentRun", {"goal": ""}, id=unique("bad-input"), task_queue=worker.task_queue,
            search_attributes=TypedSearchAttributes([SearchAttributePair(STATE_ATTRIBUTE, "PLANNING")]),
        )
        with pytest.raises(WorkflowFailureError):
            await bad.result()
        assert upserted_states((await bad.fetch_history()).events) == ['"FAILED"']


async def test_a_new_run_writes_one_patch_marker_and_little_else(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    """One marker (the build's id), no local activity (the setup comes with the first planner
    call, the audit sink is an activity: reads cannot hurt a run), the audit sink written where the run rests (here: its
    end), AgentRunState published only for states a run rests in, and a result without the
    timeline or the steps (client.run_outcome reads them with the queries)."""
    import json

    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request(READ_ONLY * 3))
        raw = await handle.result()
        outcome = await run_outcome(handle)
        events = (await handle.fetch_history()).events
    markers = [e.marker_recorded_event_attributes for e in events if e.HasField("marker_recorded_event_attributes")]
    patches = [json.loads(m.details["patch-data"].payloads[0].data)["id"] for m in markers if m.marker_name == "core_patch"]
    local = [json.loads(m.details["data"].payloads[0].data)["activity_type"] for m in markers if m.marker_name == "core_local_activity"]
    states = [
        e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields["AgentRunState"].data
        for e in events if e.HasField("upsert_workflow_search_attributes_event_attributes")
        and "AgentRunState" in e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
    ]
    from workflows.published import BUILD
    from workflows.wire import DESCRIPTION_CHARS

    assert patches == [BUILD]  # one marker a run: this build's fixes need none
    assert local == []
    scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in events
                 if e.HasField("activity_task_scheduled_event_attributes")]
    # The setup rides on the first planner call, and the end's records go with the end view
    # (the worker's audit collector writes them): two activities less per run.
    assert scheduled == ["plan", "execute_tool", "execute_tool", "execute_tool", "plan"]
    memo = next(e.workflow_properties_modified_event_attributes.upserted_memo.fields["tether"] for e in events
                if e.HasField("workflow_properties_modified_event_attributes"))
    view = RunView.model_validate(memo.data)
    assert [r.seq for r in view.timeline] == list(range(1, outcome.records + 1))
    assert view.snapshot.audit_waiting == outcome.records
    # The start listed it as planning (the state its first task moves it to): one upsert, the end.
    started = events[0].workflow_execution_started_event_attributes.search_attributes.indexed_fields
    assert started["AgentRunState"].data == b'"PLANNING"'
    assert states == [b'"COMPLETED"']
    # The result leaves out what a bounded result has at its defaults; read back, it is the same.
    written = json.loads(events[-1].workflow_execution_completed_event_attributes.result.payloads[0].data)
    assert not {"steps", "timeline", "steps_before", "steps_digest", "compensations"} & set(written), written
    assert RunOutcome.model_validate(written) == raw
    # The setup's answer: each tool's description as one bounded line (what people read), no schema titles (what the run decides with
    # stays), attested by the fleet key.
    first = json.loads(next(e.activity_task_completed_event_attributes.result.payloads[0].data for e in events
                            if e.HasField("activity_task_completed_event_attributes")))
    assert first["attestation"].count(":") == 1 and first["steps"]
    setup = first["setup"]
    assert setup["catalog"]["tools"] and all(len(t.get("description", "")) <= DESCRIPTION_CHARS and "\n" not in t.get("description", "")
                                                 and '"title"' not in json.dumps(t["args_schema"])
                                             for t in setup["catalog"]["tools"])
    assert raw.timeline == [] and raw.records == len(outcome.timeline) == outcome.timeline[-1].seq
    assert raw.steps == [] and raw.steps_executed == len(outcome.steps) == 3  # the steps query has them
    assert is_legal_path(outcome.timeline) and outcome.state == S.COMPLETED
    assert all(s.observation == "" and s.args == {} and len(s.digest) == 64 for s in outcome.steps)


async def test_read_only_plan_completes_without_approval(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request(READ_ONLY))
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED
    assert path(outcome) == ["PLANNING", "VALIDATED", "EXECUTING_TOOL", "OBSERVING_RESULT", "PLANNING", "COMPLETED"]
    assert "AWAITING_APPROVAL" not in path(outcome)
    assert is_legal_path(outcome.timeline)
    # The result carries ids and digests; observations stay out of it (its size budget).
    assert outcome.steps[0].observation == "" and len(outcome.steps[0].digest) == 64
    # The audit timeline references ids; it never copies arguments or results.
    assert "A-1001" not in "".join(r.model_dump_json() for r in outcome.timeline)


async def test_write_plan_waits_then_approval_of_the_pending_hash_completes(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ_ONLY[0], refund()]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert snap.pending_approval is not None and snap.plan is not None
        assert snap.pending_approval.plan_hash == snap.plan.plan_hash
        assert snap.step == 0, "no tool may run before the approval"
        await handle.signal("approve", approval(snap))
        outcome = await run_outcome(handle)
        approved_by = (await snapshot(handle)).approved_by
    assert approved_by == ["bob"]
    assert outcome.state == S.COMPLETED
    assert path(outcome)[:4] == ["PLANNING", "VALIDATED", "AWAITING_APPROVAL", "APPROVED"]
    approved = next(r for r in outcome.timeline if r.to_state == S.APPROVED)
    assert approved.actor == "user:bob" and approved.refs.plan_hash == snap.plan.plan_hash
    assert [s.status for s in outcome.steps] == ["ok", "ok"]
    assert len(billing.refunds(keys_of(outcome, "issue_refund")[0])) == 1


async def test_refused_decisions_change_nothing_and_are_recorded(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund()]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        version = snap.state_version
        await handle.signal("approve", approval("0" * 64, decision_id="stale"))
        await handle.signal("reject", approval("f" * 64, decision_id="stale-reject"))
        after = await snapshot(handle)
        assert (after.state, after.state_version) == (S.AWAITING_APPROVAL, version)
        await handle.signal("approve", approval(snap, decision_id="good"))
        await handle.signal("approve", approval(snap, decision_id="good"))  # repeated id
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED
    reasons = refusals(outcome)
    assert any("approve refused: plan hash" in r and "does not match the plan under review" in r for r in reasons)
    assert any("reject refused: plan hash" in r and "does not match the plan under review" in r for r in reasons)
    assert any("duplicate decision_id good" in r for r in reasons)
    assert path(outcome).count("APPROVED") == 1
    assert is_legal_path(outcome.timeline)


async def test_decision_for_a_run_not_awaiting_approval_is_refused(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    # A read-only run parked in RETRY_WAIT (time does not skip while we only query).
    billing.fail_next("orders", 1, status=503)
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request(READ_ONLY))
        await wait_for_state(handle, "RETRY_WAIT")
        await handle.signal("approve", approval("0" * 64, decision_id="late"))
        outcome = await run_outcome(handle)
    late = [r for r in outcome.timeline if r.refs.decision_id == "late"]
    assert outcome.state == S.COMPLETED
    assert len(late) == 1 and late[0].kind == "refused" and late[0].rule == "not_awaiting_approval"
    assert "run is RETRY_WAIT, not AWAITING_APPROVAL" in late[0].reason


async def test_reject_ends_in_rejected_with_no_tool_executed(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    before = billing.get("/admin/stats")["requests"].get("POST /refunds", 0)
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([READ_ONLY[0], refund()]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal(
            "reject",
            approval_for(snap, "carol", "r1", reason="too much"),
        )
        outcome = await run_outcome(handle)
    assert outcome.state == S.REJECTED
    assert outcome.steps == []
    assert outcome.timeline[-1].reason == "too much" and outcome.timeline[-1].actor == "user:carol"
    assert billing.get("/admin/stats")["requests"].get("POST /refunds", 0) == before


async def test_24h_approval_expires_in_well_under_a_second(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund()], limits={"approval_ttl_seconds": 24 * 3600}))
        loop = asyncio.get_running_loop()
        started = loop.time()
        outcome = await run_outcome(handle)  # the test server skips the 24 h
        elapsed = loop.time() - started
    assert outcome.state == S.EXPIRED
    assert outcome.timeline[-1].actor == "timer"
    assert elapsed < 5, f"time skipping took {elapsed:.1f}s"
    waiting = next(r for r in outcome.timeline if r.to_state == S.AWAITING_APPROVAL)
    expired = outcome.timeline[-1]
    assert (expired.at - waiting.at).total_seconds() == pytest.approx(24 * 3600, abs=5)


async def test_expiry_replans_when_asked_and_the_budget_bounds_it(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(
            ts_env.client,
            worker,
            make_request([refund()], limits={"approval_ttl_seconds": 3600, "on_expiry": "replan", "max_replans": 2}),
        )
        outcome = await run_outcome(handle)
    p = path(outcome)
    assert outcome.state == S.EXPIRED
    # Two expiries replan (budget 2), the third one expires the run.
    assert p.count("AWAITING_APPROVAL") == 3
    assert [r.from_state for r in outcome.timeline if r.actor == "timer"] == [S.AWAITING_APPROVAL] * 3
    assert p[-1] == "EXPIRED"


@pytest.mark.parametrize(
    ("steps", "limits", "expected"),
    [
        ([{"tool": "wire_money", "args": {}}], {}, "unknown tool 'wire_money'"),
        ([{"tool": "issue_refund", "args": {"order_id": "nope"}}], {}, "invalid arguments"),
        ([READ_ONLY[0]] * 3, {"max_steps": 2}, "step budget exhausted"),
    ],
    ids=["unknown-tool", "invalid-args", "step-budget"],
)
async def test_validation_failures_replan_within_budget_then_fail(
    ts_env: WorkflowEnvironment, billing: Billing, steps: list, limits: dict, expected: str
) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request(steps, limits={"max_replans": 2, **limits}))
        outcome = await run_outcome(handle)
    assert outcome.state == S.FAILED
    failures = [r for r in outcome.timeline if r.to_state == S.VALIDATION_FAILED]
    assert len(failures) == 3  # the first proposal and two replans
    assert all(expected in r.reason for r in failures)
    assert "replan budget is used up (max_replans=2)" in outcome.timeline[-1].reason
    assert outcome.steps == []


async def test_idempotent_tool_retries_twice_and_refunds_once(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    # Both failures happen after the service committed: only the idempotency key prevents doubles.
    billing.fail_next("refunds", 2, status=503, when="after_commit")
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund(1200)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval(snap))
        outcome = await run_outcome(handle)
        retries = (await snapshot(handle)).retries
    assert retries == 2
    assert outcome.state == S.COMPLETED
    hops = [(a.to_state.value, b.to_state.value) for a, b in zip(outcome.timeline, outcome.timeline[1:])]
    assert hops.count(("RETRY_WAIT", "EXECUTING_TOOL")) == 2
    retry_waits = [r for r in outcome.timeline if r.to_state == S.RETRY_WAIT]
    assert [r.refs.error_code for r in retry_waits] == ["injected_fault", "injected_fault"]
    assert all(r.from_state == S.EXECUTING_TOOL for r in retry_waits)
    (key,) = keys_of(outcome, "issue_refund")
    assert len(billing.refunds(key)) == 1


async def test_reconcilable_tool_looks_up_before_writing_again(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    billing.fail_next("ledger", 1, status=503, when="after_commit")
    step = {"tool": "post_ledger_entry", "args": {"order_id": "A-1003", "amount_cents": -899, "memo": "t"}}
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([step]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval(snap))
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED
    (key,) = keys_of(outcome, "post_ledger_entry")
    # The retry found the committed entry by key instead of writing (which would be a 409).
    assert len(billing.get(f"/ledger?key={key}")["entries"]) == 1
    assert path(outcome).count("RETRY_WAIT") == 1


async def test_permanent_error_fails_without_retry(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    before = billing.get("/admin/stats")["requests"].get("POST /refunds", 0)
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund(999_999, "A-1003")]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval(snap))
        outcome = await run_outcome(handle)
        last_error = (await snapshot(handle)).last_error
    assert last_error.startswith("amount_exceeds_total")
    assert outcome.state == S.EXECUTION_FAILED
    assert "RETRY_WAIT" not in path(outcome)
    assert outcome.timeline[-1].refs.error_code == "amount_exceeds_total"
    assert billing.get("/admin/stats")["requests"]["POST /refunds"] == before + 1


async def test_unsafe_tool_with_unknown_outcome_is_handed_off_not_rerun(
    ts_env: WorkflowEnvironment, billing: Billing
) -> None:
    billing.fail_next("emails", 1, status=503, when="after_commit")
    step = {"tool": "send_email", "args": {"to": "grace@example.com", "subject": "hi", "body": "refund sent"}}
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([step]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval(snap))
        outcome = await run_outcome(handle)
    assert outcome.state == S.HANDED_OFF
    last = outcome.timeline[-1]
    assert last.from_state == S.EXECUTING_TOOL and "outcome unknown" in last.reason
    assert last.refs.tool_call_id in last.reason
    (key,) = keys_of(outcome, "send_email")
    assert len(billing.get(f"/emails?request_ref={key}")["emails"]) == 1  # called once, not re-run


async def test_handoff_signal_ends_a_waiting_run(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund()]))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("handoff", HandoffRequest(by="dana", reason="customer called"))
        outcome = await run_outcome(handle)
    assert outcome.state == S.HANDED_OFF
    assert outcome.timeline[-1].actor == "operator:dana"
    assert "customer called" in outcome.timeline[-1].reason


async def test_cancellation_ends_in_cancelled(ts_env: WorkflowEnvironment, billing: Billing) -> None:
    async with running_worker(ts_env.client) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund()]))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.cancel(reason="customer withdrew")
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        records = await timeline(handle)
    assert records[-1].to_state == S.CANCELLED
    assert "customer withdrew" in records[-1].reason
    assert is_legal_path(records)
