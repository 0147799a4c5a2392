"""Nothing unsigned is shown as a run: a run that was only started (``AgentRunState``
AWAITING_APPROVAL set by whoever started it) and answered by a plain worker of the starter's own
is never listed as waiting, never offered for approval, and never sent a decision: not by the
inbox, `tether status`, `tether list`, `tether timeline` or `tether approve`. A real run beside it is."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

import tether.client as tether_client
from tests.helpers.cli import Cli
from tests.helpers.inbox_stack import Stack, inbox_stack
from tests.helpers.rogue_run import rogue_run


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(dev_env, tmp_path_factory) -> Stack:
    async with inbox_stack(dev_env, tmp_path_factory.mktemp("unsigned-runs")) as s:
        yield s


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def listed(http: httpx.AsyncClient, token: str, run_id: str, timeout: float = 30.0) -> list[str]:
    """bob's "waiting on me", once it lists ``run_id`` (visibility is eventually consistent)."""
    deadline = time.monotonic() + timeout
    while True:
        ids = [r["run_id"] for r in (await http.get("/api/approvals", headers=bearer(token))).json()["approvals"]]
        if run_id in ids or time.monotonic() > deadline:
            return ids
        await asyncio.sleep(0.2)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_started_only_run_answering_queries_is_never_listed_or_offered_for_approval(
    stack: Stack, dev_env, tmp_path: Path
) -> None:
    real = await stack.start(requested_by="alice")
    await stack.wait(real, "AWAITING_APPROVAL")
    # The rogue answers with a real run's snapshot, its id and requester changed: a plan whose
    # steps hash to the hash its request binds, so nothing but a signature tells them apart.
    answer = (await tether_client.snapshot(stack.client, real)).model_dump(mode="json")
    answer["requested_by"] = "carol"
    async with rogue_run(stack.client, answer, tenant=stack.tenant) as rogue:
        await stack.visible(rogue.run_id)  # listed by Temporal as AWAITING_APPROVAL in bob's tenant
        token = stack.sso.token("bob")
        async with httpx.AsyncClient(base_url=stack.url) as http:
            # The inbox: the real run is in bob's list, the rogue's never.
            ids = await listed(http, token, real)
            assert real in ids and rogue.run_id not in ids, ids
            page = await http.get(f"/api/runs/{rogue.run_id}", headers=bearer(token))
            assert page.status_code == 404 or page.json()["may_decide"] is False, page.text
            decided = await http.post(f"/api/runs/{rogue.run_id}/decisions", headers=bearer(token), json={
                "kind": "approve", "request_id": answer["pending_approval"]["request_id"],
                "plan_hash": answer["pending_approval"]["plan_hash"],
            })
            assert decided.status_code == 404 or decided.json()["outcome"] == "refused", decided.text

        # The client: not published yet, nothing pending, no Approve.
        status = await tether_client.status(stack.client, rogue.run_id)
        assert status.pending_approval is None and status.plan is None
        assert status.unpublished is not None and "not published yet" in status.unpublished
        with pytest.raises(tether_client.TetherError) as refused:
            await tether_client.pending_request(stack.client, rogue.run_id)
        assert refused.value.code == tether_client.REFUSED and refused.value.rule == "not_published"

        # The CLI: status, list and approve say so, and send nothing.
        cli = Cli(dev_env, stack.worker)
        code, out, err = await cli("status", rogue.run_id)
        assert code == 0, (out, err)
        assert "not published yet" in out and "approve:" not in out and "carol" not in out, out
        code, out, err = await cli("list", "--state", "AWAITING_APPROVAL", "--tenant", stack.tenant)
        assert code == 0, (out, err)
        rogue_lines = [line for line in out.splitlines() if rogue.run_id in line]
        assert rogue_lines and all("not published yet" in line for line in rogue_lines), out
        code, out, err = await cli("timeline", rogue.run_id)  # the sink has nothing of it; the run is not asked
        assert code == 2 and "not published yet" in err and "carol" not in out, (out, err)
        code, out, err = await cli("approve", rogue.run_id, "--by", "bob", "--unreviewed")
        assert code == tether_client.REFUSED, (code, out, err)
        assert "not published yet" in err, err

        assert await rogue.received() == []  # no decision ever reached the rogue's code


@pytest.mark.asyncio(loop_scope="session")
async def test_status_live_reads_the_runs_signed_answer_and_never_an_unsigned_one_as_the_run(stack: Stack, dev_env) -> None:
    """`tether status --live`: a run of this build answers its ``view`` query signed by the
    fleet's key for itself, checked as its published view is (its pending approval shown, with
    the command to approve). A keyless poller that copies that signed answer for a run of its own
    is refused (the signature names the real run); one that answers no ``view`` query is shown
    only as its unsigned answer, marked, with nothing pending."""
    real = await stack.start(requested_by="alice")
    await stack.wait(real, "AWAITING_APPROVAL")
    cli = Cli(dev_env, stack.worker)
    code, out, err = await cli("status", real, "--live")
    assert code == 0, err
    assert "view       its live answer, signed by the fleet's key (as answered at " in out, out
    assert "state      AWAITING_APPROVAL" in out and "approve: " in out, out
    signed = await stack.client.get_workflow_handle(real).query("view")
    answer = (await tether_client.snapshot(stack.client, real)).model_dump(mode="json")

    async with rogue_run(stack.client, answer, tenant=stack.tenant, view=signed) as rogue:
        code, out, err = await cli("status", rogue.run_id, "--live")
        assert code != 0 and "its live answer unverified" in err and "AWAITING_APPROVAL" not in out, (code, out, err)
        code, out, err = await cli("approve", rogue.run_id, "--by", "bob", "--unreviewed")
        assert code == tether_client.REFUSED and await rogue.received() == [], (code, out, err)
    async with rogue_run(stack.client, answer, tenant=stack.tenant) as rogue:
        code, out, err = await cli("status", rogue.run_id, "--live")
        assert code == 0, err
        assert "state      not published yet (its live answer, unsigned" in out and "approve: " not in out, out
    await stack.client.get_workflow_handle(real).cancel()
