"""A run whose tools no live worker on its queue serves is visible as such (issue 58: the inbox
listed it with Approve offered and no warning; `tether status` said nothing). Each worker's
identity lists the tools it serves; `tether status`, the inbox's list and its run page name the
tools the run waits for, and Approve stays offered beside that warning. When a worker that serves
them polls again, the warning goes."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import httpx

import examples.billing.tools  # noqa: F401 (registers the billing tools)
import tether.client as tether_client
from tether.policy.files import PolicyStore
from tether.tools.sdk import REGISTRY, ToolRegistry
from tether.cli.output import format_status
from tether.pollers import identity_tools, tools_mark
from tests.helpers.billing import counts_in_db
from tests.helpers.billing import Billing
from tests.helpers.runs import make_request, running_worker, unique
from tests.helpers.cli import Cli
from tests.helpers.inbox_stack import inbox_stack


def test_a_worker_identity_lists_its_tools_or_says_it_cannot() -> None:
    assert identity_tools(f"1@host{tools_mark(['b', 'a'])} ledger=shared") == frozenset({"a", "b"})
    assert identity_tools(f"1@host{tools_mark([f'tool_{i:04d}' for i in range(200)])} ledger=x") is None  # too long: `*`
    assert identity_tools("1@host ledger=shared") is None  # a worker that does not say


async def _waits_for(client, run_id: str, expected: list[str]) -> tether_client.RunStatus:
    while True:  # until the workers polling the queue are the ones just started
        shown = await tether_client.status(client, run_id)
        if shown.waits_for_tools == expected:
            return shown
        await asyncio.sleep(0.2)


async def test_status_and_inbox_say_which_tools_no_worker_serves_and_still_offer_approve(dev_env, tmp_path, billing: Billing) -> None:
    client = dev_env.client
    queue = unique("unserved")
    async with inbox_stack(dev_env, tmp_path) as stack:
        policy = PolicyStore.from_env(str(stack.policy))
        email = [{"tool": "send_email", "args": {"to": f"{uuid.uuid4().hex[:8]}@example.com", "subject": "s", "body": "b"}}]
        run_id = f"unserved-{uuid.uuid4().hex[:10]}"
        async with running_worker(client, task_queue=queue, policy=policy):
            await tether_client.start_run(client, make_request(email, tenant=stack.tenant, requested_by="alice"),
                                          run_id=run_id, queue=queue)
            await stack.wait(run_id, "AWAITING_APPROVAL")
        # The worker comes back with other tools (the user's own module, without send_email).
        others = ToolRegistry()
        for name, spec in REGISTRY.tools.items():
            if name != "send_email":
                others.register(spec)
        async with running_worker(client, task_queue=queue, registry=others, policy=policy):
            shown = await _waits_for(client, run_id, ["send_email"])
            text = format_status(shown)
            assert "waits      waits for tool send_email: no live worker on task queue" in text, text
            await stack.visible(run_id)
            bob = {"Authorization": f"Bearer {stack.sso.token('bob')}"}
            async with httpx.AsyncClient(base_url=stack.url) as http:
                run = (await http.get(f"/api/runs/{run_id}", headers=bob)).json()
                assert run["may_decide"] is True and "send_email" in run["waits_for"], run
                page = (await http.get(f"/runs/{run_id}", headers=bob)).text
                assert 'id="approve-warning"' in page and 'id="approve"' in page and "send_email" in page
                rows = (await http.get("/api/approvals", headers=bob)).json()["approvals"]
                row = next(r for r in rows if r["run_id"] == run_id)
                assert "send_email" in row["waits_for"], row
            # `tether approve` says the same before it sends; the approval is taken all the same.
            code, out, err = await Cli(dev_env, SimpleNamespace(task_queue=queue))("approve", run_id, "--by", "bob", "--unreviewed")
            assert code == 0 and "warning: waits for tool send_email: no live worker on task queue" in out, (code, out, err)
            await _waits_for(client, run_id, ["send_email"])  # the write reached a worker without it: it waits
            assert counts_in_db(billing, run_id)["emails"] == 0
        # A worker that serves it polls: nothing is waited for, and the write runs once.
        async with running_worker(client, task_queue=queue, policy=policy):
            shown = await _waits_for(client, run_id, [])
            assert "waits      " not in format_status(shown)
            async with httpx.AsyncClient(base_url=stack.url) as http:
                run = (await http.get(f"/api/runs/{run_id}", headers=bob)).json()
                assert run["waits_for"] is None, run
            outcome = await tether_client.run_outcome(client.get_workflow_handle(run_id))
        assert outcome.state.value == "COMPLETED", outcome
        assert counts_in_db(billing, run_id)["emails"] == 1
