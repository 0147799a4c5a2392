"""The inbox's pages as a person meets them on the dev stack: its root leads to the dev sign-in,
and after a decision the page says one thing (the header's outcome and the live part agree)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import pytest_asyncio

from tests.helpers.billing import Billing
from tests.helpers.inbox_stack import Stack, inbox_stack

HANG = 300.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(dev_env, tmp_path_factory) -> Stack:
    async with inbox_stack(dev_env, tmp_path_factory.mktemp("inbox-pages"), jwks=False, dev_login=True) as s:
        yield s


@pytest.mark.asyncio(loop_scope="session")
async def test_the_dev_root_leads_to_sign_in_and_the_page_agrees_with_itself_after_approving(
    stack: Stack, billing: Billing
) -> None:
    run_id = await stack.start()
    await stack.wait(run_id, "AWAITING_APPROVAL", timeout=HANG)
    # A decision's answer waits for the run's verdict: bounded only against a hang.
    async with httpx.AsyncClient(base_url=stack.dev_url, timeout=HANG) as http:
        root = await http.get("/")
        assert root.status_code == 303 and root.headers["location"] == "/login"
        assert (await http.get("/api/approvals")).status_code == 401  # scripts get the status, not a page
        assert (await http.post("/login", data={"name": "bob"})).status_code == 303
        page = (await http.get(f"/runs/{run_id}")).text
        form = {name: re.search(rf'name="{name}" value="([^"]*)"', page).group(1)
                for name in ("csrf", "request_id", "plan_hash")}
        decided = await http.post(f"/runs/{run_id}/decide", data={**form, "kind": "approve"})
        assert decided.status_code == 200
        # The header says the run approved it; nothing below says bob may not, or that it waits.
        assert 'id="outcome-state">APPROVED<' in decided.text, decided.text
        assert "You cannot decide" not in decided.text and 'id="decide"' not in decided.text
        assert "You have decided this run" in decided.text or "COMPLETED" in decided.text
        # The live part follows the run to its end, and says no more than that.
        # The page reads what the run published where it last rested: its end's view is
        # published once the audit sink has the end's records, after the state is listed.
        for _ in range(int(HANG / 0.2)):
            live = (await http.get(f"/runs/{run_id}/live", params={"shown": form["request_id"]})).text
            if 'id="state" class="state state-COMPLETED"' in live:
                break
            await asyncio.sleep(0.2)
        assert 'id="state" class="state state-COMPLETED"' in live
        assert "You cannot decide" not in live and "You have decided" not in live and "This plan changed" not in live
