"""Server restart: stop the dev server (SQLite file) while runs wait for approval, while a tool
call is in flight and while an approval timer runs; start it again on the same file and show
that every run continues and finishes as if nothing happened.

The worker is a subprocess that stays up through the outage (it reconnects by itself); a run
finished before the outage is the baseline the others' paths are compared with.
"""

from __future__ import annotations

import asyncio
import time

from tests.chaos.harness import Stack
from tests.chaos.harness import TOOLS, _await_state, _marker, _unique, start_worker
from tests.helpers.invariants import check_timeline, tools_by_call
from tether.client import run_outcome, start_run
from tests.helpers.runs import approval_for
from workflows.contract import Limits
from workflows.run_state import RunOutcome, RunRequest, RunSnapshot
from workflows.states import RunState

S = RunState


def request(effect: str, **limits: object) -> RunRequest:
    tool, args = TOOLS[effect]
    return RunRequest(
        goal=f"restart {effect}", requested_by="alice", playbook=[{"tool": tool, "args": args}],
        limits=Limits(**limits),
    )


def path(outcome: RunOutcome) -> list[str]:
    return [r.to_state.value for r in outcome.timeline if r.kind == "transition"]


async def approve(handle) -> None:
    snap = await handle.query("snapshot", result_type=RunSnapshot)
    await handle.signal(
        "approve", approval_for(snap, "bob")
    )


async def test_runs_survive_a_dev_server_restart(stack: Stack) -> None:
    server, billing = stack.server, stack.billing
    chaos_dir = stack.workdir / _unique("restart")
    chaos_dir.mkdir()
    queue = _unique("restart-q")
    # Tool calls stop at their "before" checkpoint until we release them: in flight on purpose,
    # with a timeout that outlasts the outage (the server would rightly time them out otherwise).
    worker = start_worker(server.address, billing.url, queue, chaos_dir, hold="before", tool_timeout=30)
    try:
        await worker.wait_for_output("worker ready")
        client = stack.client

        async def start(name: str, req: RunRequest):
            return await start_run(client, req, run_id=_unique(f"restart-{name}"), queue=queue)

        # Baseline: an idempotent run that nothing disturbs.
        (chaos_dir / "release-before").touch()
        baseline = await start("baseline", request("idempotent"))
        await _await_state(baseline, {S.AWAITING_APPROVAL}, 60)
        await approve(baseline)
        normal = path(await run_outcome(baseline))
        (chaos_dir / "release-before").unlink()

        waiting = {e: await start(f"wait-{e}", request(e)) for e in TOOLS}
        inflight = {e: await start(f"fly-{e}", request(e)) for e in TOOLS}
        # Its approval expires while the server is down or just after: a durable timer.
        timer = await start("timer", request("idempotent", approval_ttl_seconds=8))
        for handle in [*waiting.values(), *inflight.values(), timer]:
            await _await_state(handle, {S.AWAITING_APPROVAL}, 60)
        keys = {}
        for effect, handle in inflight.items():
            await approve(handle)
            snap = await _await_state(handle, {S.EXECUTING_TOOL}, 60)
            keys[handle.id] = f"{handle.id}:{snap.plan.steps[0].tool_call_id}"
        deadline = time.monotonic() + 60
        while not all(_marker(chaos_dir, k, 1, "before").exists() for k in keys.values()):
            assert time.monotonic() < deadline, "tool calls never started"
            await asyncio.sleep(0.05)

        server.stop()
        await asyncio.sleep(1.0)  # the worker's polls fail meanwhile; it must ride it out
        await server.start()
        assert worker.alive, "the worker died with the server"

        client = await server.client()
        (chaos_dir / "release-before").touch()  # the in-flight calls complete after the restart
        for handle in waiting.values():
            await approve(client.get_workflow_handle(handle.id))
        outcomes: dict[str, RunOutcome] = {}
        for handle in [*waiting.values(), *inflight.values(), timer]:
            outcomes[handle.id] = await asyncio.wait_for(
                run_outcome(client.get_workflow_handle(handle.id, result_type=RunOutcome)), 90
            )
        assert worker.alive
    finally:
        worker.stop()

    for effect, handle in [*waiting.items(), *inflight.items()]:
        outcome = outcomes[handle.id]
        check_timeline(outcome.timeline, tools_by_call(outcome))
        assert outcome.state == S.COMPLETED, (handle.id, outcome.timeline[-1].reason)
        assert path(outcome) == normal, f"{handle.id} took another path: {path(outcome)}"
        key = next(r.refs.idempotency_key for r in outcome.timeline if r.refs.idempotency_key)
        assert billing.effects(effect, key) == 1
    expired = outcomes[timer.id]
    check_timeline(expired.timeline, tools_by_call(expired))
    assert expired.state == S.EXPIRED and expired.timeline[-1].actor == "timer"
    assert expired.steps == []
