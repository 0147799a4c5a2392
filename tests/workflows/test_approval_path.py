"""The approval path: from a person's decision to the write it allows, no activity of its own,
and the records before the write travel with it.

- Between the decide Update and the write's schedule the run asks no activity: the decision is
  on the run's roster (judged with its setup), and the write's tool worker judges it and the
  approved plan's remaining writes under the current file before the tool, logging the lines the
  policy activity would. A decision off the roster takes the policy activity (one).
- The records before a write are in the audit sink when the tool is called (the tool itself looks),
  though no ``audit_append`` ran: the tool worker appended them in the same activity.
- A sink that fails when a write takes its records along: the tool is not called; the run writes
  them itself on the sink's backoff, then the write runs, once.
- A policy tightened while the plan waits: the decision is accepted on the roster, the write's
  tool worker refuses the plan's re-check, the policy activity judges it again and refuses, and the
  run asks again (a new request for what the current file asks); nothing is written. Real dev
  servers, real workers.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import BaseModel
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from activities.audit import AuditActivities
from tether.audit.sink import JsonlAuditSink
from tether.audit.verify import verify_streams
from tether.policy.judgements import log_from_env
from tether.store.keys import KeyRing
from tether.policy.files import PolicyStore
from tether.tools.sdk import ToolContext, ToolEffect, ToolRegistry, tool
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import audit_collected, wait_for_state
from workflows.contract import DecideRequest, DecideResult
from workflows.states import RunState

WITNESSED = ToolRegistry()
# The run's records in the audit sink at the moment its write's tool was called: tag -> states.
SEEN: dict[str, list[str]] = {}


class Note(BaseModel):
    tag: str


@tool(effect=ToolEffect.UNSAFE, timeout=30, name="witnessed_write", registry=WITNESSED)
def witnessed_write(args: Note, ctx: ToolContext) -> dict:
    """Writes nothing; notes what the audit sink holds of its run when it is called."""
    streams = asyncio.run(JsonlAuditSink.from_env().read(ctx.run_id))
    SEEN.setdefault(args.tag, []).extend(r.to_state.value for records in streams.values() for r in records)
    return {"noted": args.tag}


def write_request(tag: str, **overrides):
    return make_request([{"tool": "witnessed_write", "args": {"tag": tag}}], **overrides)


async def scheduled(handle: WorkflowHandle) -> list[tuple[str, str]]:
    """The run's history as (event, activity type or update name), in order."""
    out = []
    for e in (await handle.fetch_history()).events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            out.append(("scheduled", e.activity_task_scheduled_event_attributes.activity_type.name))
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            out.append(("update", e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name))
    return out


def between(events: list[tuple[str, str]], start: tuple[str, str], end: tuple[str, str]) -> list[str]:
    """The activities scheduled after ``start`` and before ``end`` (their first occurrences)."""
    i = events.index(start)
    j = events.index(end, i)
    return [name for kind, name in events[i + 1 : j] if kind == "scheduled"]


async def test_no_activity_between_a_decision_and_its_write_and_the_records_go_with_it(
    dev_env: WorkflowEnvironment,
) -> None:
    tag = unique("path")
    async with running_worker(dev_env.client, registry=WITNESSED) as worker:
        handle = await start_run(dev_env.client, worker, write_request(tag))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        decision = approval_for(snap, "bob").model_dump()
        answer = await handle.execute_update("decide", DecideRequest(**decision, kind="approve"), result_type=DecideResult)
        # The answer is the record itself: what a client prints, with no query after it.
        assert answer.record is not None and answer.record.to_state == RunState.APPROVED, answer
        assert answer.record.actor == "user:bob" and answer.record.refs.decision_id == decision["decision_id"]
        outcome = await tether_client.run_outcome(handle)
        assert outcome.state == RunState.COMPLETED, outcome
        trail = await audit_collected(dev_env.client, handle.id)

    events = await scheduled(handle)
    assert between(events, ("update", "decide"), ("scheduled", "execute_tool")) == [], events
    # The write's tool worker judged the decision and the plan, as the policy activity does: its
    # lines are on the judgement log, under the write's activity.
    lines = [e for e in log_from_env().read(workflow_id=handle.id) if e.get("check") in ("decision", "plan")]
    decided = [e for e in lines if e["check"] == "decision"]
    assert [(e["person"], e["allowed"]) for e in decided] == [("bob", True)], lines
    assert decided[0]["activity_id"].startswith(snap.plan.steps[0].tool_call_id), decided
    # After the decision no record needed an activity of its own: they went with the write, and
    # with the end view (before it, the run rested waiting: its records were written then).
    assert ("scheduled", "audit_append") not in events[events.index(("update", "decide")) :], events
    # When the tool was called, the sink had the decision and the step it entered.
    assert "APPROVED" in SEEN[tag] and "EXECUTING_TOOL" in SEEN[tag], SEEN[tag]
    streams = {b.run_id: b.records for b in trail.branches}
    assert verify_streams(KeyRing.from_env().public_keys(), handle.id, streams).problems == []


class FailingOnce(JsonlAuditSink):
    """The JSON-lines sink, failing its first ``failures`` appends (a database restarting)."""

    failures = 0

    async def append(self, batch):  # type: ignore[no-untyped-def]
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("sink restarting")
        return await super().append(batch)


async def test_a_failing_sink_holds_the_write_until_its_records_are_in(dev_env: WorkflowEnvironment) -> None:
    tag = unique("sinkdown")
    sink = FailingOnce.from_env()
    async with running_worker(dev_env.client, registry=WITNESSED, audit=AuditActivities(sink)) as worker:
        handle = await start_run(dev_env.client, worker, write_request(tag))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        while snap.audit_waiting:  # the records of its rest are in: the next append is the write's
            await asyncio.sleep(0.02)
            snap = await tether_client.snapshot(dev_env.client, handle.id)
        sink.failures = 2  # the write's own append, then the run's first retry of it
        await handle.execute_update(
            "decide", DecideRequest(**approval_for(snap, "bob").model_dump(), kind="approve"), result_type=DecideResult
        )
        outcome = await tether_client.run_outcome(handle)
        await audit_collected(dev_env.client, handle.id)
    assert outcome.state == RunState.COMPLETED, outcome
    # The tool ran once, and only once its records were in.
    assert SEEN[tag].count("APPROVED") == 1 and "EXECUTING_TOOL" in SEEN[tag], SEEN[tag]
    events = await scheduled(handle)
    assert [name for kind, name in events if name == "execute_tool"] == ["execute_tool", "execute_tool"], events
    assert ("scheduled", "audit_append") in events  # the run wrote them itself, on its backoff


def tightening_policy(path: Path, *, high_above: int | None) -> Path:
    high = (
        f'[tenants.default.high_risk]\napprovals = 2\nroles = ["approver"]\n'
        f'when = [{{ tool = "issue_refund", field = "amount_cents", above = {high_above} }}]\n'
        if high_above is not None else ""
    )
    path.write_text(
        '[tenants.default]\ntools = ["get_order", "issue_refund"]\n'
        '[tenants.default.approvers]\nbob = { roles = ["approver"] }\ncarol = { roles = ["approver"] }\n' + high
    )
    return path


async def decide_as(handle: WorkflowHandle, snap, who: str) -> DecideResult:  # type: ignore[no-untyped-def]
    request = DecideRequest(**approval_for(snap, who).model_dump(), kind="approve")
    return await handle.execute_update("decide", request, result_type=DecideResult)


async def after_decide(handle: WorkflowHandle) -> list[str]:
    """The policy activities and tool calls the run scheduled after the decide Update, in order."""
    events = await scheduled(handle)
    return [name for kind, name in events[events.index(("update", "decide")) + 1 :]
            if name.startswith("policy_") or name == "execute_tool"]


@pytest.mark.parametrize("approver", ["bob", "mallory"])
async def test_a_policy_tightened_while_the_plan_waits_writes_nothing(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path, approver: str
) -> None:
    from tests.helpers.policies import refund

    path = tightening_policy(tmp_path / "policy.toml", high_above=None)
    async with running_worker(dev_env.client, policy=PolicyStore.from_env(str(path))) as worker:
        handle = await start_run(dev_env.client, worker, make_request([refund(3100)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert snap.pending_approval.approvals_required == 1
        tightening_policy(path, high_above=3000)  # now a high-risk refund: two approvals
        answer = await decide_as(handle, snap, approver)
        refund_key = f"{handle.id}:{snap.plan.steps[0].tool_call_id}"
        if approver == "mallory":
            # Not an approver: the roster does not decide her approval; the activity refuses it.
            assert answer.outcome == "refused" and answer.rule == "tenant_membership", answer
            assert await after_decide(handle) == ["policy_check_decision"]
            assert billing.refunds(refund_key) == []
            return
        # bob may decide (the roster says so): his approval is accepted; the plan's re-check,
        # judged by the write's tool worker and then by the policy activity, refuses.
        assert answer.outcome == "transition" and answer.state == RunState.APPROVED, answer
        again = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert again.pending_approval.request_id != snap.pending_approval.request_id
        assert again.pending_approval.approvals_required == 2
        timeline = await tether_client.timeline(dev_env.client, handle.id)
        asked = [r for r in timeline if r.to_state == RunState.AWAITING_APPROVAL]
        assert "approval no longer holds" in asked[-1].reason, [r.reason for r in timeline]
        assert billing.refunds(refund_key) == []
        # The write's worker refused it before the tool; one policy activity judged the decision
        # and the plan again (then the run rests again, waiting).
        assert await after_decide(handle) == ["execute_tool", "policy_check_decision"]


async def test_a_policy_file_that_stops_loading_keeps_the_last_good_one_and_the_run_says_so(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """Issue 43: a change that does not load (here 2,000 nested parentheses in a tenant's Cedar
    file, which once killed the parser's process) leaves the worker judging by the last good
    policy: the run goes on, and its status, snapshot and Web UI details say which problem."""
    from tests.helpers.policies import refund

    cedar_file = tmp_path / "tenant.cedar"
    cedar_file.write_text('@id("anyone may decide")\npermit (principal, action, resource);\n')
    path = tmp_path / "policy.toml"
    path.write_text('[tenants.default]\ntools = ["get_order", "issue_refund"]\ncedar = ["tenant.cedar"]\n'
                    '[tenants.default.approvers]\nbob = { roles = ["approver"] }\n')
    store = PolicyStore.from_env(str(path))
    async with running_worker(dev_env.client, policy=store) as worker:
        handle = await start_run(dev_env.client, worker, make_request([refund(1300)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        cedar_file.write_text("permit (principal, action, resource) when { " + "(" * 2000 + "true" + ")" * 2000 + " };\n")
        answer = await handle.execute_update(
            "decide", DecideRequest(**approval_for(snap, "bob").model_dump(), kind="approve"), result_type=DecideResult
        )
        assert answer.outcome == "transition", answer
        outcome = await tether_client.run_outcome(handle)
        assert outcome.state == RunState.COMPLETED, outcome
        assert store.reload_failures == 1 and store.problem is not None and "nest" in store.problem, store.problem
        status = await tether_client.status(dev_env.client, handle.id)
        assert status.policy_problem is not None and "last good policy" in status.policy_problem, status


def test_a_policy_problem_carried_to_every_run_is_bounded(tmp_path: Path) -> None:
    """Every verdict carries the problem into the run's state, views and details: a changed file
    with thousands of problems (one per policy) still gives one bounded line, naming the first."""
    from tether.policy.files import PROBLEM_CHARS

    cedar_file = tmp_path / "tenant.cedar"
    cedar_file.write_text('@id("anyone")\npermit (principal, action, resource);\n')
    path = tmp_path / "policy.toml"
    path.write_text('[tenants.default]\ncedar = ["tenant.cedar"]\n')
    store = PolicyStore.from_env(str(path))
    cedar_file.write_text("".join(f'@id("p{i}")\npermit (principal, action == Tether::Action::"launch{i}", resource);\n'
                                  for i in range(3000)))
    store.load()
    problem = store.problem
    assert problem is not None and len(problem) <= PROBLEM_CHARS and "\n" not in problem, problem
    assert "launch0" in problem and problem.endswith(f"(kept the last good policy, hash {store.load()[1][:12]})")


async def test_the_first_plans_re_check_comes_with_the_planners_answer(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    """From the start to the request: the planner call, which brings the run's setup and the plan's
    re-check judged under the current file as the planner answered, and the records before the
    rest; no policy activity. The request asks what that check said (a high-risk refund: two)."""
    from tests.helpers.policies import refund

    path = tightening_policy(tmp_path / "policy.toml", high_above=3000)
    async with running_worker(dev_env.client, policy=PolicyStore.from_env(str(path))) as worker:
        handle = await start_run(dev_env.client, worker, make_request([refund(3100)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert snap.pending_approval.approvals_required == 2
        assert [name for _, name in await scheduled(handle)] == ["plan", "audit_append"]
        # Judged and logged as the policy activity does, under the planner call.
        lines = [e for e in log_from_env().read(workflow_id=handle.id) if e.get("check") == "plan"]
        assert lines and all(e["activity_id"].startswith("plan:") for e in lines), lines
        for who, outcome in (("bob", "accepted"), ("carol", "transition")):  # the first of two, then the second
            answer = await decide_as(handle, await wait_for_state(handle, "AWAITING_APPROVAL"), who)
            assert answer.outcome == outcome, answer
        outcome = await tether_client.run_outcome(handle)
        assert outcome.state == RunState.COMPLETED, outcome
        assert len(billing.refunds(f"{handle.id}:{snap.plan.steps[0].tool_call_id}")) == 1
