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
from tests.conftest import BIN
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
