"""Tether's views need no worker (issue 34): `tether status`, `list` and `timeline` and the inbox's
pages read what a run publishes where it rests (search attributes, the memo ``tether``, the audit
sink), say how fresh it is, and say when no worker serves the run's queue. The worker here is
stopped for real before anything is read."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
from cryptography.hazmat.primitives.asymmetric import ed25519
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tether.policy.files import PolicyStore
from tether.client import run_outcome
from tether.inbox.app import InboxConfig, create_app
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.inbox_stack import AUDIENCE, ISSUER, POLICY, Sso, _serve, raw_public, write_pem
from tests.helpers.ports import free_port
from tests.helpers.cli import Cli
from tests.helpers.waiting import wait_published

REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 321, "reason": "published"}}]


async def wait_listed(env: WorkflowEnvironment, run_id: str, state: str) -> None:
    """Visibility is eventually consistent: until the list shows the run in ``state``."""
    for _ in range(300):
        rows = await tether_client.list_runs(env.client, state=state, limit=500)
        if any(r.run_id == run_id and r.published_at is not None for r in rows):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id} never listed in {state} with a published view")


async def test_with_the_worker_stopped_every_view_answers_from_what_the_runs_published(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    people = {n: ed25519.Ed25519PrivateKey.generate() for n in ("alice", "bob", "inbox")}
    for name, key in people.items():
        write_pem(key, tmp_path / f"{name}.pem")
    tenant = unique("views")
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.format(inbox=raw_public(people["inbox"]), alice=raw_public(people["alice"]),
                                    bob=raw_public(people["bob"]), tenant=tenant, signed=unique("views-signed")))
    async with running_worker(dev_env.client, policy=PolicyStore.from_env(str(policy))) as worker:
        queue = worker.task_queue
        waiting = await start_run(dev_env.client, worker, make_request(REFUND, tenant=tenant))
        ended = await start_run(dev_env.client, worker, make_request(REFUND, tenant=tenant))
        await wait_for_state(waiting, "AWAITING_APPROVAL")
        await ended.signal("approve", approval_for(await wait_for_state(ended, "AWAITING_APPROVAL"), "bob"))
        assert (await run_outcome(ended)).state.value == "COMPLETED"
        await wait_published(dev_env, waiting.id, "AWAITING_APPROVAL")
        await wait_published(dev_env, ended.id, "COMPLETED")
        await wait_listed(dev_env, waiting.id, "AWAITING_APPROVAL")
        await wait_listed(dev_env, ended.id, "COMPLETED")
    # The worker has stopped. Temporal lists its pollers for minutes: it counts as gone once it
    # said so in its heartbeats, or its last poll is older than a live worker's long poll.
    for _ in range(200):
        if await tether_client.worker_serving(dev_env.client, queue) is False:
            break
        await asyncio.sleep(1)
    else:
        raise AssertionError(f"a stopped worker still counts as serving {queue}")
    gone = tether_client.no_worker_message(queue)

    loop = asyncio.get_running_loop()
    for handle, state in ((waiting, "AWAITING_APPROVAL"), (ended, "COMPLETED")):
        began = loop.time()
        status = await tether_client.status(dev_env.client, handle.id)
        # Nothing was asked of the run: a query to nobody would have waited out QUERY_TIMEOUT.
        assert loop.time() - began < tether_client.QUERY_TIMEOUT.total_seconds()
        assert status.state.value == state and status.published_at is not None and status.worker_serving is False
    assert status.end_actor and status.approved_by == ["bob"]

    cli = Cli(dev_env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
    for handle, state in ((waiting, "AWAITING_APPROVAL"), (ended, "COMPLETED")):
        code, out, err = await cli("status", handle.id)
        assert code == 0, (out, err)
        assert f"state      {state}" in out and "view       as published at " in out and " s ago" in out
        assert f"worker     {gone}" in out
        code, out, err = await cli("timeline", handle.id)
        assert code == 0 and f"-> {state}" in out and "note: the run's own records as published at " in err, (out, err)
        code, out, err = await cli("timeline", handle.id, "--json")
        assert code == 0 and [r["seq"] for r in json.loads(out)] == list(range(1, len(json.loads(out)) + 1))
    code, out, err = await cli("list", "--state", "AWAITING_APPROVAL", "--limit", "500")
    row = next(line for line in out.splitlines() if line.startswith(waiting.id))
    assert code == 0 and (" s ago " in row or " min ago " in row), out
    # Live detail still asks the run, and says plainly that nobody can answer.
    code, out, err = await cli("status", waiting.id, "--live")
    assert code == 2 and "no worker polls task queue" in err, (out, err)

    sso = Sso()
    (tmp_path / "jwks.json").write_text(json.dumps(sso.jwks()))
    app = create_app(InboxConfig(policy=policy, jwks=str(tmp_path / "jwks.json"), issuer=ISSUER, audience=AUDIENCE,
                                 key=tmp_path / "inbox.pem", poll_ms=300), temporal=dev_env.client)
    port = free_port()
    server, task = await _serve(app, port)
    try:
        auth = {"Authorization": f"Bearer {sso.token('bob')}"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=auth, timeout=30) as http:
            page = await http.get("/")
            assert page.status_code == 200 and waiting.id in page.text and "as published at" in page.text
            approvals = (await http.get("/api/approvals")).json()["approvals"]
            assert [a["run_id"] for a in approvals] == [waiting.id] and approvals[0]["as_of"].startswith("as published at")
            for handle, state in ((waiting, "AWAITING_APPROVAL"), (ended, "COMPLETED")):
                page = await http.get(f"/runs/{handle.id}")
                assert page.status_code == 200, page.text
                assert f">{state}<" in page.text and "as published at" in page.text and "no worker polls task queue" in page.text
                run = (await http.get(f"/api/runs/{handle.id}")).json()
                assert run["state"] == state and run["published_at"] and run["worker"] == gone and run["timeline"]
    finally:
        server.should_exit = True
        await task
