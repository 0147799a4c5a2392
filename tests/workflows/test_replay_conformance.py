"""Replay conformance (issue 55): every run shape, replayed up to every one of its workflow tasks
in every way a worker can come to rebuild it, gives the commands, the ids and the published view
it recorded (tests/helpers/conformance.py says how each way is made).

- Offline, each history this build recorded (tests/histories/*.json: the demo refund, approvals,
  revisions, partial approvals, hand-offs, cancels, compensation, a parallel group, a delegation,
  continue-as-new and the run it continued into): every task, cold, with its clock moved, and reset.
- Live, each of those shapes on a real dev server with a worker whose workflow cache is off (every
  task and every query rebuilds the run from its history, as a fresh worker does), queried all
  along: no query and no workflow task fails, and the run ends as the recording's did.
- Two mutants show the harness fails where it should: an activity id read off the task's clock,
  and one drawn from the random stream that a query handler also reads.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHandle, WorkflowHistory
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.conformance import WAYS, conform, load_recorded as _load, ours_from_the_start, recording_replayer as _replayer, task_starts
from tests.histories.record import shapes, steps
from workflows.effects import Effects
from workflows.engine import Engine
from workflows.run_state import RunSnapshot

HERE = Path(__file__).resolve().parents[1] / "histories"
HISTORIES = sorted(HERE.glob("*.json"))


async def _problems(history: WorkflowHistory, keys: Any = None, ways: tuple[str, ...] = WAYS) -> list[str]:
    replayer = _replayer(keys)
    found = []
    for start in task_starts(history):
        for way in ways:
            found += [f"task at event {start + 1}, {way}: {p}" for p in await conform(replayer, history, start, way)]
    return found


def test_every_shape_is_recorded_by_this_build() -> None:
    names = {p.stem for p in HISTORIES}
    assert {"approve", "revise", "partial", "handoff", "cancel", "compensated", "parallel", "delegate",
            "continue_as_new", "continued"} <= names
    for path in HISTORIES:
        assert ours_from_the_start(_load(path)), f"{path.name} was recorded by an earlier build"


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_every_task_replays_as_recorded_every_way(path: Path) -> None:
    history = _load(path)
    assert len(task_starts(history)) >= 2
    problems = await _problems(history)
    assert problems == [], "\n".join(problems[:5])


# ----------------------------------------------------------------------------- live, cache off


async def _ask_all_along(handle: WorkflowHandle, stop: asyncio.Event) -> tuple[int, list[str]]:
    """``snapshot`` over and over, as a monitor would, until ``stop``: (answers, failures). A query
    the server could not hand to a worker in time is retried, not a failure of the run."""
    from tether.client import timed_out

    answers, failures = 0, []
    while not stop.is_set():
        try:
            await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=timedelta(seconds=5))
            answers += 1
        except RPCError as e:
            if not timed_out(e):
                failures.append(f"{e.status.name}: {e.message}")
        await asyncio.sleep(0.05)
    return answers, failures


# Live: every shape but two, which the offline ways cover at every task: continue-as-new needs a
# server that suggests it early, and the replan's driver must approve a 3-second request in time.
LIVE = [s for s in shapes(None) if s[0] not in ("continue_as_new", "replan")]


@pytest.mark.parametrize("group", [0, 1, 2])
async def test_every_shape_live_on_a_cache_off_worker_queried_all_along(
    dev_env: WorkflowEnvironment, billing: Billing, group: int
) -> None:
    mine = LIVE[group::3]
    async with running_worker(dev_env.client, max_cached_workflows=0) as worker:
        for name, playbook, overrides, _ in mine:
            drive = next(d for n, _, _, d in shapes(billing) if n == name)
            handle = await start_run(dev_env.client, worker, make_request(playbook, **overrides), run_id=unique(f"live-{name}"))
            stop = asyncio.Event()
            asking = asyncio.create_task(_ask_all_along(handle, stop))
            try:
                await drive(dev_env.client, handle)
                try:
                    await dev_env.client.get_workflow_handle(handle.id).result()
                except Exception:
                    pass  # cancelled, rejected, failed: as the recording's
            finally:
                stop.set()
            answers, failures = await asking
            assert failures == [], (name, failures[:3])
            history = await dev_env.client.get_workflow_handle(handle.id).fetch_history()
            failed = [e.workflow_task_failed_event_attributes.failure.message for e in history.events
                      if e.HasField("workflow_task_failed_event_attributes")]
            assert failed == [], (name, failed[:2])
            # And the history it made conforms offline too, cold and reset, at every task.
            from tether.store.keys import KeyRing

            problems = await _problems(history, KeyRing.from_env(), ways=("cold", "reset"))
            assert problems == [], (name, problems[:3])


# ----------------------------------------------------------------------------- mutants


async def _approved_refund(env: WorkflowEnvironment, worker: Any, *, ask_steps: int = 0) -> WorkflowHistory:
    handle = await start_run(env.client, worker, make_request(steps("refund")))
    snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    for _ in range(ask_steps):
        await handle.query("steps")
    await handle.signal("approve", approval_for(snap))
    await handle.result()
    return await handle.fetch_history()


async def test_an_id_read_off_the_tasks_clock_fails_the_harness(
    dev_env: WorkflowEnvironment, billing: Billing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutant: the id's binding takes the task's time, as the build before this one did."""
    from tether.store.keys import KeyRing

    monkeypatch.setattr(Effects, "execution_binding", lambda self: workflow.now().isoformat())
    async with running_worker(dev_env.client) as worker:
        history = await _approved_refund(dev_env, worker)
    problems = await _problems(history, KeyRing.from_env(), ways=("clock",))
    assert problems and all("activity ids" in p for p in problems), problems[:3]
    monkeypatch.undo()


async def test_an_id_drawn_from_a_stream_a_query_reads_fails_the_harness(
    dev_env: WorkflowEnvironment, billing: Billing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutant: the id's binding draws from the run's random stream, and a query handler draws
    from it too (live only: a replay answers no query)."""
    from tether.store.keys import KeyRing

    def drawn(self: Effects) -> str:
        self._stream = getattr(self, "_stream", None) or workflow.random()  # type: ignore[attr-defined]
        return f"{self._stream.getrandbits(64):016x}"  # type: ignore[attr-defined]

    original_steps = Engine.steps

    def steps_query(self: Engine) -> Any:
        effects = getattr(self, "_effects_for_mutant", None)
        if effects is not None and getattr(effects, "_stream", None) is not None:
            effects._stream.getrandbits(64)
        return original_steps(self)

    original_init = Effects.__init__

    def init(self: Effects, engine: Engine, **kw: Any) -> None:
        original_init(self, engine, **kw)
        engine._effects_for_mutant = self  # type: ignore[attr-defined]

    monkeypatch.setattr(Effects, "execution_binding", drawn)
    monkeypatch.setattr(Effects, "__init__", init)
    monkeypatch.setattr(Engine, "steps", steps_query)
    # The run kept between tasks (make test-replay turns the cache off for the suite): the queries
    # move the stream of the run the next task goes on with.
    async with running_worker(dev_env.client, max_cached_workflows=100) as worker:
        history = await _approved_refund(dev_env, worker, ask_steps=3)
    problems = await _problems(history, KeyRing.from_env(), ways=("cold",))
    assert problems, "a stream a query moves gave the same ids on replay"
    monkeypatch.undo()
