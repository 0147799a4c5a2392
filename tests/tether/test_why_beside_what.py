"""The why beside the what: where a person decides (the inbox page, `tether status`, the approve
prompt), the run's goal and who asked (signed or claimed), beside the plan's effects and money in
words. On real servers: the session's dev server, a
worker, a uvicorn inbox, the installed CLI (in a terminal for the prompt)."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
import pytest_asyncio

import tether.client as tether_client
from tests.helpers.paths import BIN
from tests.helpers.runs import make_request
from tests.helpers.cli import Cli
from tests.helpers.inbox_stack import Stack, inbox_stack
from tests.helpers.terminal import in_terminal
from tests.helpers.demo_refund import GOAL, a_model_looks_up_then_refunds

REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 7550, "reason": "broken"}}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(dev_env, tmp_path_factory) -> Stack:
    async with inbox_stack(dev_env, tmp_path_factory.mktemp("why")) as s:
        yield s


@pytest.mark.asyncio(loop_scope="session")
async def test_the_goal_and_who_asked_are_where_a_person_decides(stack: Stack, dev_env) -> None:
    run_id = await stack.start(requested_by="alice", goal=GOAL, playbook=REFUND)
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    await stack.visible(run_id)
    assert [t.name for t in snap.tools] == ["issue_refund"]

    status = await tether_client.status(stack.client, run_id)
    assert status.goal == GOAL
    cli = Cli(dev_env, stack.worker)
    code, out, err = await cli("status", run_id)
    assert code == 0, err
    assert f"goal       {GOAL}" in out and "asked by   alice (claimed)" in out, out
    assert "75.50 EUR (7550)" in out and "can be undone by void_refund" in out, out

    async with httpx.AsyncClient(base_url=stack.url) as http:
        bob = {"Authorization": f"Bearer {stack.sso.token('bob')}"}
        run = (await http.get(f"/api/runs/{run_id}", headers=bob)).json()
        assert run["goal"] == GOAL and run["requested_by"] == "alice"
        assert run["steps"][0]["money"]["amount_cents"] == "75.50 EUR"
        page = (await http.get(f"/run?id={run_id}", headers=bob)).text
        assert 'id="goal">Refund order A-1001: the parcel arrived broken (ticket T-77)<' in page

    # The approve prompt: the goal and who asked, before the plan and the question.
    argv = [str(BIN / "tether"), "approve", run_id, "--by", "bob"]
    code, shown = await asyncio.to_thread(in_terminal, argv, cli.env, "n")
    assert code == 1 and "[y/N]" in shown, shown
    assert f"asked by alice (claimed): {GOAL}" in shown and shown.index(GOAL) < shown.index("[y/N]"), shown


@pytest.mark.asyncio(loop_scope="session")
async def test_what_the_reads_found_and_each_tools_words_are_in_the_signed_view_and_shown(
    stack: Stack, dev_env, billing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model looks the order up (a read: it runs at once), then proposes the refund. Where bob
    decides, the published view (signed) carries what the lookup found, as the tool's summary
    fields say (its first fields when it names none), and each tool's description and its effect
    in words; `tether status` and the inbox page show them, escaped."""
    run_id = await a_model_looks_up_then_refunds(stack, monkeypatch)

    status = await tether_client.status(stack.client, run_id)  # the signed published view
    assert not status.unpublished
    [found] = status.found
    assert (found.tool, found.args) == ("get_order", {"order_id": "A-1001"})
    assert found.fields["customer_email"] == "ada@example.com" and found.fields["total_cents"] == 4999, found
    tools = {t.name: t for t in status.tools}
    assert tools["issue_refund"].description.startswith("Refund (part of) an order"), tools
    assert tools["send_email"].description, tools

    cli = Cli(dev_env, stack.worker)
    code, out, err = await cli("status", run_id)
    assert code == 0, err
    assert 'found      get_order (order_id: "A-1001"): ' in out and 'customer_email: "ada@example.com"' in out, out
    assert "(Refund (part of) an order" in out, out
    assert "send_email: cannot be undone; unsafe: never re-run" in out, out

    async with httpx.AsyncClient(base_url=stack.url) as http:
        bob = {"Authorization": f"Bearer {stack.sso.token('bob')}"}
        run = (await http.get(f"/api/runs/{run_id}", headers=bob)).json()
        assert run["found"][0]["tool"] == "get_order" and run["found"][0]["fields"]["customer_email"] == "ada@example.com"
        assert run["steps"][0]["description"].startswith("Refund (part of) an order")
        page = (await http.get(f"/run?id={run_id}", headers=bob)).text
        assert 'id="found"' in page and "ada@example.com" in page, page
        assert "Refund (part of) an order" in page and "unsafe: never re-run" in page, page

    # The Web UI's current details (never through the payload codec): the lookup named, its
    # fields only as the tool's summary_fields name them and its money in words (get_order names
    # none: the email stays in the signed view), and where to read the rest.
    details = (await stack.client.get_workflow_handle(run_id).query("__temporal_workflow_metadata")).current_details
    [found] = [line for line in details.splitlines() if line.startswith("- `get_order`")]
    assert "found: total\\_cents `49.99 EUR (4999)`; 4 more field(s): `tether status " in found, found
    assert "ada@example.com" not in details, details


@pytest.mark.asyncio(loop_scope="session")
async def test_a_compensations_view_names_the_run_it_undoes_with_its_writes_and_amounts(
    stack: Stack, dev_env, billing
) -> None:
    """bob asks to undo a completed refund: the compensation run's signed view names the run it
    undoes and each write it puts back, with the write's arguments and the money in words;
    `tether status` and the inbox page show them."""
    refund = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 1250, "reason": "undo me"}}]
    run_id = await stack.start(requested_by="alice", goal="Refund then undo", playbook=refund)
    await stack.wait(run_id, "AWAITING_APPROVAL")
    cli = Cli(dev_env, stack.worker)
    code, out, err = await cli("approve", run_id, "--by", "bob", "--unreviewed")
    assert code == 0, out + err
    await stack.wait(run_id, "COMPLETED")
    code, out, err = await cli("compensate", run_id, "--by", "bob")
    assert code == 0, out + err
    undo = f"{run_id}-compensate"
    await stack.wait(undo, "AWAITING_APPROVAL")
    await stack.visible(undo)

    status = await tether_client.status(stack.client, undo)  # the signed published view
    assert status.compensates == run_id
    [write] = status.compensations
    assert (write.of_tool, write.tool, write.of_args) == ("issue_refund", "void_refund", {"order_id": "A-1002", "amount_cents": 1250})
    code, out, err = await cli("status", undo)
    assert code == 0, err
    assert f"undoes     run {run_id}" in out, out
    assert 'issue_refund (order_id: "A-1002", amount_cents: 12.50 EUR (1250)): kept; undo: void_refund' in out, out

    async with httpx.AsyncClient(base_url=stack.url) as http:
        bob = {"Authorization": f"Bearer {stack.sso.token('bob')}"}
        run = (await http.get(f"/api/runs/{undo}", headers=bob)).json()
        assert run["compensates"] == run_id
        assert run["writes"][0]["args"] == {"order_id": "A-1002", "amount_cents": 1250}
        assert run["writes"][0]["money"] == {"amount_cents": "12.50 EUR"}
        page = (await http.get(f"/run?id={undo}", headers=bob)).text
        assert 'id="compensates"' in page and "12.50 EUR" in page, page


HOSTILE_GOAL = "Refund <b>A-1001</b> \x1b[31mnow\x1b[0m & tell \u202eno one"


@pytest.mark.asyncio(loop_scope="session")
async def test_the_inbox_list_shows_the_goal_and_who_asked_beside_what_it_will_do_escaped(stack: Stack) -> None:
    """bob's list, not only the run's page: each waiting run's goal (read from its start, escaped by
    the one escaping function, and inert as HTML), who asked (signed or claimed), and what it will
    do with the money in words and the effect in words."""
    run_id = await stack.start(requested_by="alice", goal=HOSTILE_GOAL, playbook=REFUND)
    await stack.wait(run_id, "AWAITING_APPROVAL")
    await stack.visible(run_id)
    async with httpx.AsyncClient(base_url=stack.url) as http:
        bob = {"Authorization": f"Bearer {stack.sso.token('bob')}"}
        rows = {r["run_id"]: r for r in (await http.get("/api/approvals", headers=bob)).json()["approvals"]}
        row = rows[run_id]
        assert row["goal"] == HOSTILE_GOAL and row["requested_by"] == "alice" and row["requester_verified"] is False
        assert row["parent"] is None and row["root"] is None
        assert "75.50 EUR (7550)" in row["what"] and "can be undone by void_refund" in row["what"], row
        page = (await http.get("/live/waiting", headers=bob)).text
    cell = page[page.index(f'data-run="{run_id}"'):]
    cell = cell[: cell.index("</tr>")]
    # escape_text, then HTML-escaped: no tag, no ESC, no bidi override reaches the page.
    assert 'class="goal">Refund &lt;b&gt;A-1001&lt;/b&gt; \\x1b[31mnow\\x1b[0m &amp; tell \\u202eno one<' in cell, cell
    assert "\x1b" not in cell and "\u202e" not in cell and "<b>" not in cell
    assert 'class="requested-by">alice (claimed)<' in cell, cell
    assert "75.50 EUR (7550)" in cell, cell


@pytest.mark.asyncio(loop_scope="session")
async def test_a_child_run_asking_its_own_approval_says_on_whose_behalf_everywhere(stack: Stack, dev_env, billing) -> None:
    """A delegation whose grant can refund and names no write: the child's planner proposes a
    refund no approval of the parent's covers, so the child asks bob itself. Its inbox row and
    page, `tether status` and the approve prompt say who asked on whose behalf: the root run
    (walked up from signed views), and the parent's goal."""
    from activities.policy_checks import PolicyStore
    from tests.helpers.runs import approval_for, running_worker
    from tests.helpers.delegation import started_child, writing_child, writing_delegation

    async with running_worker(dev_env.client, policy=PolicyStore.from_env(str(stack.policy)),
                              planners=writing_child("on-behalf")) as worker:
        root = f"why-root-{uuid.uuid4().hex[:8]}"
        request = make_request([writing_delegation()], tenant=stack.tenant, requested_by="alice", goal="parent: refund for ticket T-9")
        await tether_client.start_run(stack.client, request, run_id=root, queue=worker.task_queue)
        snap = await stack.wait(root, "AWAITING_APPROVAL")
        await stack.client.get_workflow_handle(root).signal("approve", approval_for(snap, "bob"))
        child = (await started_child(dev_env, f"{root}.{snap.plan.steps[0].tool_call_id}")).id
        await stack.wait(child, "AWAITING_APPROVAL", timeout=60)
        await stack.visible(child)

        status = await tether_client.status(stack.client, child)
        assert status.parent == root and status.root == root and status.requested_by == "alice"
        cli = Cli(dev_env, worker)
        code, out, err = await cli("status", child)
        assert code == 0, err
        assert f"asked by   alice (claimed), on behalf of root run {root}" in out, out
        assert "goal       child: refund A-1003" in out and "3.00 EUR (300)" in out, out
        details = (await stack.client.get_workflow_handle(child).query("__temporal_workflow_metadata")).current_details
        assert f"**On behalf of** root run `{root}` · **child of** `{root}`: parent\\: refund for ticket T\\-9" in details, details

        async with httpx.AsyncClient(base_url=stack.url) as http:
            bob = {"Authorization": f"Bearer {stack.sso.token('bob')}"}
            rows = {r["run_id"]: r for r in (await http.get("/api/approvals", headers=bob)).json()["approvals"]}
            assert rows[child]["root"] == root and rows[child]["parent"] == root, rows[child]
            assert rows[child]["goal"] == "child: refund A-1003" and rows[child]["parent_goal"] == "parent: refund for ticket T-9"
            listed = (await http.get("/live/waiting", headers=bob)).text
            assert f"on behalf of root run" in listed and f'<code>{root}</code>' in listed, listed
            page = (await http.get(f"/run?id={child}", headers=bob)).text
            assert 'id="root">root run' in page and f"<code>{root}</code>" in page, page

        argv = [str(BIN / "tether"), "approve", child, "--by", "bob"]
        code, shown = await asyncio.to_thread(in_terminal, argv, cli.env, "n")
        assert code == 1, shown
        assert f"asked by alice (claimed), on behalf of root run {root}: child: refund A-1003" in shown, shown
        assert f"child of {root}: parent: refund for ticket T-9" in shown and "3.00 EUR (300)" in shown, shown
        await stack.client.get_workflow_handle(root).cancel()


@pytest.mark.asyncio(loop_scope="session")
async def test_the_web_ui_shows_why_and_what_with_money_in_words(stack: Stack) -> None:
    """What Temporal's Web UI shows for a run waiting on a person, as the server returns it: the
    user metadata (the start's summary and details) and the current details (the workflow's
    metadata query) name the goal, who asked, and the pending write with the money in words and
    its effect in words; the goal escaped and inert as markdown."""
    run_id = await stack.start(requested_by="alice", goal=HOSTILE_GOAL, playbook=REFUND)
    await stack.wait(run_id, "AWAITING_APPROVAL")
    handle = stack.client.get_workflow_handle(run_id)
    described = await handle.describe()
    summary, start = await described.static_summary(), await described.static_details()
    # The control character as its visible escape (\x1b: the Web UI shows a backslash as it is).
    assert summary.startswith("Refund \\<b\\>A\\-1001\\</b\\> \\x1b\\[31mnow"), summary
    assert "**requested by** `alice`" in start, start
    details = (await handle.query("__temporal_workflow_metadata")).current_details
    assert "**Goal:** Refund \\<b\\>A\\-1001\\</b\\> \\x1b\\[31mnow" in details, details
    assert "\x1b" not in details and "\u202e" not in details and "<b>" not in details
    assert "**requested by** `alice` (claimed)" in details, details
    [step] = [line for line in details.splitlines() if line.startswith("1. `issue_refund`")]
    assert "amount\\_cents `75.50 EUR (7550)`" in step and "`7550`" not in step, step
    assert "(can be undone by void\\_refund)" in step and "undo `void_refund`" in step, step
    assert "**Waiting for approval**" in details and "tether approve" in details
