"""Deploy a new build without draining, on Worker Versioning (issue 41; docs/changing-workflows.md),
on the dev server: workers of two builds are two versions of one Worker Deployment. A run is
pinned to the version that started it, activities included; B made current takes the new runs;
a waiting run moves to B at its next continue-as-new; a rollback routes new runs back to A while
B's runs stay on B. Build B is this checkout's code with the next build marker, in its own process.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tests.helpers.build_worker import start_build_worker
from tests.helpers.billing import Billing
from tests.helpers.paths import BIN
from tests.helpers.runs import flood_until_continued, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.cli import Cli
from tests.helpers.waiting import until
from tests.helpers.builds import other_build
from workflows.published import BUILD, CHANGE_VERSION_ATTRIBUTE

REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 250, "reason": "versioning"}}]


async def _temporal(env: WorkflowEnvironment, *args: str) -> tuple[int, str]:
    """Temporal's own CLI (the package's ``temporal``), the documented way to route new runs."""
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "temporal"), *args, "--address", env.client.service_client.config.target_host,
        "--namespace", env.client.namespace, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


async def _make_current(env: WorkflowEnvironment, deployment: str, build: str) -> None:
    """Once the server knows the version (it registers with its workers' first poll)."""
    async def made() -> bool:
        code, _ = await _temporal(env, "worker", "deployment", "set-current-version", "--deployment-name", deployment,
                                  "--build-id", build, "--yes")
        return code == 0

    await until(made, f"{build} never became current")


async def _pinned_to(handle: WorkflowHandle) -> tuple[str, list[str]]:
    """The build the run's current execution is pinned to, and the build markers it wrote."""
    description = await handle.describe()
    info = description.raw_description.workflow_execution_info.versioning_info
    markers = description.typed_search_attributes.get(CHANGE_VERSION_ATTRIBUTE) or []
    return info.deployment_version.build_id, [m for m in markers if m.startswith("tether-build-")]


async def _start(client: Any, queue: str) -> WorkflowHandle:
    handle = await start_run(client, SimpleNamespace(task_queue=queue), make_request(REFUND))  # type: ignore[arg-type]
    await wait_for_state(handle, "AWAITING_APPROVAL", timeout=120)
    return handle


async def test_a_new_build_deploys_without_draining(small_history_env: WorkflowEnvironment, billing: Billing) -> None:
    env = small_history_env
    client = env.client
    queue = unique("versioned")
    deployment = unique("fleet")
    a, b = BUILD, other_build(1)
    cli = Cli(env, SimpleNamespace(task_queue=queue))  # type: ignore[arg-type]
    with_deployment = {"TETHER_DEPLOYMENT": deployment}

    async with running_worker(client, task_queue=queue, deployment=deployment, identity="worker-a"):
        await _make_current(env, deployment, a)
        waiting = await _start(client, queue)  # will wait for weeks, then continue as new
        staying = await _start(client, queue)  # decided while B is current
        assert await _pinned_to(waiting) == (a, [a])

        worker_b = await start_build_worker(env, queue, b, deployment=deployment, identity="worker-b")
        try:
            await _make_current(env, deployment, b)
            # A's workers must stay for its two open runs; nothing is older than A (drain by A's CLI).
            code, out, err = await cli("drain", "--json", env=with_deployment)
            state = json.loads(out)
            versions = {v["build"]: v for v in state["versions"]}
            assert code == 1 and state["current"] == b and versions[b]["status"] == "current", (out, err)
            # (The server is shared with other tests: only this test's runs are judged here.)
            ours = [r for r in state["runs"] if r["run_id"] in {waiting.id, staying.id}]
            assert versions[a]["open_runs"] == 2 and not versions[a]["retirable"] and ours == [], state

            # New runs go to B, and write B's marker.
            fresh = await _start(client, queue)
            assert await _pinned_to(fresh) == (b, [b])

            # A's runs keep running on A's workers, activities included, while B is current.
            code, out, err = await cli("approve", staying.id, "--by", "bob", "--unreviewed")
            assert code == 0, (out, err)
            assert (await staying.result()).state.value == "COMPLETED"
            history = await staying.fetch_history()
            took = {
                e.workflow_task_started_event_attributes.identity for e in history.events
                if e.HasField("workflow_task_started_event_attributes")
            } | {
                e.activity_task_started_event_attributes.identity for e in history.events
                if e.HasField("activity_task_started_event_attributes")
            }
            assert {t.split(" ", 1)[0] for t in took} == {"worker-a"}, took  # its identity, then its tools
            assert any(e.HasField("activity_task_started_event_attributes") for e in history.events)

            # A run waiting on A moves to B at its next continue-as-new, and goes on waiting there.
            first_run = (await waiting.describe()).run_id
            await flood_until_continued(waiting, first_run, unique("flood"))
            moved = client.get_workflow_handle(waiting.id)
            assert await until(lambda: _is_pinned(moved, b), "the continued run never moved to B")
            assert (await wait_for_state(moved, "AWAITING_APPROVAL", timeout=120)).state.value == "AWAITING_APPROVAL"

            # Rollback: A is current again; new runs go to A, B's runs stay on B.
            await _make_current(env, deployment, a)
            back = await _start(client, queue)
            assert await _pinned_to(back) == (a, [a])
            assert (await _pinned_to(fresh))[0] == b
            code, out, err = await cli("drain", env=with_deployment)
            assert code == 1 and f"new runs start on {a}" in out, (out, err)
            assert f"  {b}  draining  2 open run(s): keep its workers until its runs end" in out, out

            # B's runs end: B can be retired (its workers stopped) while A serves.
            for handle in (fresh, moved):
                await handle.terminate("test over")

            async def retirable() -> bool:
                versions = {v.build: v for v in (await tether_client.deployment_status(client, deployment)).versions}
                return versions[b].retirable and not versions[a].retirable

            await until(retirable, "B never became retirable")
            await back.terminate("test over")
        finally:
            await worker_b.stop()


async def _is_pinned(handle: WorkflowHandle, build: str) -> bool:
    pinned, markers = await _pinned_to(handle)
    return pinned == build and markers == [build]
