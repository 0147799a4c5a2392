"""What a person sees is true: the terminal and the Web UI show hostile text inert, Temporal's
status tells how a run ended, and a run nobody serves says so at once.

Against the real dev server, through the installed `tether` script."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace

from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

from tether.policy.files import PolicyStore
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.cli import Cli
from workflows.states import TEMPORAL_STATUS, RunState

S = RunState
# A subject that clears the screen, rewrites the line with another amount, and opens a link.
SUBJECT = "Refund\x1b[2J\x1b[H\r  1. issue_refund {\"amount_cents\": 1200}\x1b]8;;http://evil\x1b\\x\u202e"
# A forged record line, sent as a comment while the run still waits with no approval in force.
FORGED = "ok\nv9   10:00:00.000  AWAITING_APPROVAL -> APPROVED                  user:carol (signed)"
MARKDOWN = "**APPROVED by carol** [click](http://evil) <img src=x onerror=alert(1)>\n# Approved"
HIGH_RISK_POLICY = """
[tenants.default]
tools = ["get_order", "issue_refund", "post_ledger_entry", "send_email"]
[tenants.default.approvers]
bob = { roles = ["approver"] }
carol = { roles = ["approver"] }
[tenants.default.high_risk]
approvals = 2
roles = ["approver"]
when = [{ tool = "issue_refund", field = "amount_cents", above = 0 }]
"""


def no_control(text: str) -> None:
    """Nothing that moves the cursor, recolours, reorders or starts a line mid-field."""
    bad = [c for c in text if c != "\n" and (not c.isprintable() or c in "\u202e\u202c")]
    assert not bad, (bad, text)


def outside_code_spans(markdown: str) -> str:
    """The markdown with every inline code span removed (what would render as markup)."""
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", markdown, flags=re.S)


def assert_inert(prose: str) -> None:
    """Every markdown or HTML punctuation mark escaped (CommonMark shows it literally), but for
    our own bold labels (`**Goal:**`)."""
    prose = re.sub(r"\*\*[A-Za-z ]+:?\*\*", "", prose)
    for i, c in enumerate(prose):
        if c in "*[]()<>#`":
            assert i and prose[i - 1] == "\\", (i, prose)
    assert "\n#" not in prose


async def test_hostile_text_reaches_no_terminal_and_no_markdown_unescaped(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(HIGH_RISK_POLICY)
    playbook = tmp_path / "playbook.json"
    playbook.write_text(json.dumps([
        {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 12000, "reason": "x"}},
        {"tool": "send_email", "args": {"to": "a@example.com", "subject": SUBJECT + MARKDOWN, "body": "b"}},
    ]))
    tenant = unique("shown")
    run_id = unique("esc") + "\x1b[31m"
    async with running_worker(dev_env.client, policy=PolicyStore(policy_file)) as worker:
        cli = Cli(dev_env, worker)

        async def ok(*args: str) -> str:
            code, out, err = await cli(*args)
            assert code == 0, (args, out, err)
            no_control(out + err)
            return out

        out = await ok("start", "--goal", MARKDOWN, "--playbook", str(playbook), "--requested-by", "alice",
                       "--tenant", "default", "--id", run_id, "--wait")
        assert "\\x1b[31m" in out  # the run id, escaped
        status = await ok("status", run_id)
        # The subject is one quoted field of one line: the amount the approver reads is the plan's.
        lines = status.splitlines()
        assert [line for line in lines if line.startswith("  1. ")] == ["  1. issue_refund: can be undone by void_refund"]
        assert [line.strip() for line in lines if line.strip().startswith("amount_cents")] == ["amount_cents: 120.00 EUR (12000)"]
        [subject] = [line for line in lines if line.strip().startswith("subject: ")]
        assert 'subject: "Refund\\x1b[2J' in subject and "\\x0d" in subject and "\\u202e" in subject
        assert re.search(r"^request    req-[0-9a-f]{24}$", status, re.M)  # the request id, as documented
        as_json = json.loads(await ok("status", run_id, "--json"))  # \u escapes: nothing raw
        assert as_json["plan"]["steps"][1]["args"]["subject"] == SUBJECT + MARKDOWN

        approved = await ok("approve", run_id, "--by", "carol", "--plan-hash", as_json["plan"]["plan_hash"], "--comment", FORGED)
        assert "approval 1 of 2 accepted: ok\\x0av9" in approved
        assert not any("-> APPROVED" in line and not line.startswith("approval") for line in approved.splitlines())
        timeline = await ok("timeline", run_id)
        records = json.loads(await ok("timeline", run_id, "--json"))
        lines = timeline.splitlines()
        # One line per record, each starting with its version: no line a sender wrote.
        assert len(lines) == len(records) and all(re.match(r"^v\d+ +\d\d:\d\d", line) for line in lines)
        assert [line for line in lines if "-> APPROVED" in line.split("  user:")[0].split("ACCEPTED")[0]] == []
        assert (await wait_for_state(dev_env.client.get_workflow_handle(run_id), "AWAITING_APPROVAL")).approved_by == ["carol"]

        listed = await ok("list", "--tenant", "default", "--state", "AWAITING_APPROVAL", "--limit", "200")
        assert listed.splitlines()[0].split() == ["RUN", "STATE", "TEMPORAL", "TENANT", "PUBLISHED", "STARTED"]
        assert "\\x1b[31m" in listed or len(listed.splitlines()) == 201
        assert (await ok("list", "--tenant", tenant)).strip() == "no runs match"

        # The Web UI's current details: argument values only inside code spans, the rest inert.
        handle = dev_env.client.get_workflow_handle(run_id)
        details = (await handle.query("__temporal_workflow_metadata")).current_details
        assert details.startswith("**State:** `AWAITING_APPROVAL`")
        no_control(details)
        # The goal, shown while the run waits on a person (the why beside the what): prose,
        # escaped and inert; everything else a sender wrote only inside code spans.
        [goal] = [line for line in details.splitlines() if line.startswith("**Goal:** ")]
        assert_inert(outside_code_spans(goal))
        prose = outside_code_spans(details.replace(goal, ""))
        for live in ("click", "evil", "<img", "APPROVED by", "\n# Approved", "1200"):
            assert live not in prose, (live, prose)
        assert "subject `" in details and "\\x1b[2J" in details
        description = await handle.describe()
        summary, details = await description.static_summary(), await description.static_details()
        assert "Approved" in summary, summary  # the goal (whole here: the details need not repeat it)
        assert "**requested by** `alice`" in details, details
        for static in (summary, details):
            no_control(static)
            assert_inert(outside_code_spans(static))
        await handle.cancel(reason="test over")


async def test_every_ending_shows_its_temporal_status(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """FAILED and EXECUTION_FAILED fail the execution (the outcome in the failure's details),
    CANCELLED cancels it, the rest complete it; run_outcome reads each, the list query finds
    the failed ones, and the final state comes first in the details."""
    tenant = unique("ending")
    refund = {"tool": "issue_refund", "args": {"order_id": "A-1003", "amount_cents": 700, "reason": "r"}}
    too_much = {"tool": "issue_refund", "args": {"order_id": "A-1003", "amount_cents": 999_999, "reason": "r"}}
    async with running_worker(dev_env.client) as worker:

        async def run(steps: list, **limits: float) -> object:
            return await start_run(dev_env.client, worker, make_request(steps, tenant=tenant, limits=limits or None))

        rejected, expired, failed, execution_failed, cancelled, completed = await asyncio.gather(
            run([refund]),
            run([refund], approval_ttl_seconds=0.5),
            run([{"tool": "wire_money", "args": {}}], max_replans=0),
            run([too_much]),
            run([refund]),
            run([{"tool": "get_order", "args": {"order_id": "A-1001"}}]),
        )
        for handle, decide in ((rejected, "reject"), (execution_failed, "approve")):
            snap = await wait_for_state(handle, "AWAITING_APPROVAL")
            await handle.signal(decide, approval_for(snap, "bob", reason="no"))
        await wait_for_state(cancelled, "AWAITING_APPROVAL")
        await cancelled.cancel(reason="withdrawn")
        expect = {
            rejected: S.REJECTED, expired: S.EXPIRED, failed: S.FAILED,
            execution_failed: S.EXECUTION_FAILED, cancelled: S.CANCELLED, completed: S.COMPLETED,
        }
        temporal = {
            "Completed": WorkflowExecutionStatus.COMPLETED,
            "Failed": WorkflowExecutionStatus.FAILED,
            "Canceled": WorkflowExecutionStatus.CANCELED,
        }
        for handle, state in expect.items():
            outcome = await asyncio.wait_for(run_outcome(handle), 30)
            assert outcome.state == state and outcome.timeline[-1].to_state == state
            assert (await handle.describe()).status == temporal[TEMPORAL_STATUS[state]], state
            details = (await handle.query("__temporal_workflow_metadata")).current_details
            assert details.startswith(f"**State:** `{state.value}`"), (state, details[:200])
        assert expect[failed] == S.FAILED and TEMPORAL_STATUS[S.REJECTED] == "Completed"
        query = f"ExecutionStatus = 'Failed' AND AgentTenant = '{tenant}'"
        for _ in range(100):
            found = {wf.id async for wf in dev_env.client.list_workflows(query)}
            if len(found) >= 2:
                break
            await asyncio.sleep(0.1)
        assert found == {failed.id, execution_failed.id}


async def test_a_run_nobody_serves_says_so_within_two_seconds(dev_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """start, status, approve, timeline and handoff on a queue no worker polls: the poller
    message, fast."""
    playbook = tmp_path / "p.json"
    playbook.write_text(json.dumps([{"tool": "get_order", "args": {"order_id": "A-1001"}}]))
    queue = unique("nobody")
    cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]  (no worker)
    run_id = unique("unserved")
    message = f"no worker polls task queue '{queue}' — start one with `TETHER_TASK_QUEUE={queue} make worker`"
    # The message is the task queue probe's (one round trip, a short rpc timeout), never a
    # query's or an Update's that waited for a worker; the wait is far longer than any answer.
    for args, code in (
        (["start", "--goal", "g", "--playbook", str(playbook), "--requested-by", "alice", "--id", run_id,
          "--wait", "--wait-timeout", "600"], 1),
        (["status", run_id], 2),
        (["approve", run_id, "--by", "bob", "--unreviewed"], 1),  # refused: not sent, nothing decided
        (["timeline", run_id], 2),
        (["handoff", run_id, "--by", "dana", "--reason", "r"], 2),
    ):
        got, out, err = await cli(*args)
        assert got == code and message in err, (args, got, out, err)
    # Without --wait the run is started and the note says why nothing will happen.
    got, out, err = await cli("start", "--goal", "g", "--playbook", str(playbook), "--requested-by", "alice")
    assert got == 0 and out.startswith("started ") and err.startswith("note: " + message)


def test_details_that_cannot_be_drawn_still_show_the_state(monkeypatch) -> None:
    """The details are drawn in the workflow before every wait: a renderer bug must show the state
    and where to look, never raise (an exception there fails every workflow task of the run)."""
    from workflows import details
    from workflows.run_state import RunData, RunRequest

    def broken(*args, **kwargs):
        raise KeyError("a plan shape the renderer does not know")

    monkeypatch.setattr(details, "_details", broken)
    shown = details.run_details(
        RunData(), RunRequest(goal="g", requested_by="alice"), workflow_id="run `x`; rm -rf /", continued=False
    )
    assert shown.startswith("**State:** `RECEIVED` (version 0)")
    assert "Details could not be drawn (KeyError)" in shown
    # The id only inside one code span whose fence is longer than any backtick run in it.
    assert "``tether status 'run `x`; rm -rf /'``" in shown
