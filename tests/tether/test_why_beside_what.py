"""The why beside the what: where a person decides (the inbox page, `tether status`, the approve
prompt), the run's goal and who asked (signed or claimed), beside the plan's effects and money in
words. On real servers: the session's dev server, a
worker, a uvicorn inbox, the installed CLI (in a terminal for the prompt)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import pytest_asyncio

import tether.client as tether_client
from examples.fake_openai import FakeOpenAI, call, tool_calls
from tests.helpers.paths import BIN
from tests.helpers.cli import Cli
from tests.helpers.inbox_stack import Stack, inbox_stack
from tests.helpers.terminal import in_terminal

GOAL = "Refund order A-1001: the parcel arrived broken (ticket T-77)"
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
    with FakeOpenAI() as fake:
        monkeypatch.setenv("TETHER_MODEL", "tether-test-model")
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        fake.script(
            tool_calls(call("get_order", {"order_id": "A-1001"})),
            tool_calls(call("issue_refund", {"order_id": "A-1001", "amount_cents": 4999, "reason": "broken"}),
                       call("send_email", {"to": "ada@example.com", "subject": "Refund", "body": "Refunded."})),
        )
        run_id = await stack.start(requested_by="alice", goal=GOAL, planner="model", playbook=[])
        await stack.wait(run_id, "AWAITING_APPROVAL")
        await stack.visible(run_id)

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
