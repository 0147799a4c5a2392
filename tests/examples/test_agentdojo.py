"""AgentDojo's suites through Tether (examples/agentdojo/): the tool-side service against every
ground-truth call of the four v1 suites, then a subset of cases as governed runs on a real dev
server and worker, judged by AgentDojo's own checks, with a worker SIGKILLed mid-run and a reset."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest

from tether.tools.sdk import ToolError
from bench.common import ROOT, bench_stack
from examples.agentdojo.api import call
from examples.agentdojo.catalog import effect_of, suites
from examples.agentdojo.driver import EVERY_WRITE_REVIEWED, Attack, Runner, TetherPipeline
from examples.agentdojo.service import make_server


_SERVERS: dict[str, Any] = {}


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="agentdojo-test-"))
    server = make_server(0, folder / "agentdojo.db")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    _SERVERS[url] = server
    yield url
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _store(url: str, suite_name: str, env: Any) -> str:
    run = f"t-{uuid.uuid4().hex[:10]}"
    call("PUT", f"/runs/{run}", {"suite": suite_name, "environment": json.loads(env.model_dump_json())}, base=url)
    return run


def _apply(url: str, run: str, function: str, args: dict, key: str) -> dict:
    return call("POST", f"/runs/{run}/calls", {"function": function, "args": json.loads(json.dumps(args, default=str))},
                headers={"Idempotency-Key": key}, base=url)


def test_every_ground_truth_call_keeps_its_declared_effect(service: str) -> None:
    """Every user and injection task's ground truth, through the service: a function declared
    read-only never changes the environment, and every write the ground truths make does."""
    checked: Counter[str] = Counter()
    for name, suite in suites().items():
        tasks = [*suite.user_tasks.values(), *suite.injection_tasks.values()]
        for task in tasks:
            env = suite.load_and_inject_default_environment({})
            if hasattr(task, "PROMPT"):
                env = task.init_environment(env)
            run = _store(service, name, env)
            for n, c in enumerate(task.ground_truth(env.model_copy(deep=True))):
                done = _apply(service, run, c.function, c.args, f"{run}:{n}")
                if effect_of(c.function) == "read_only":
                    assert not done["wrote"], f"{name}/{task.ID}: {c.function} is declared read_only but wrote"
                checked[effect_of(c.function)] += 1
    assert checked["read_only"] > 100 and checked["reconcilable"] > 50 and checked["idempotent"] > 10, checked


def test_an_environment_comes_back_from_the_database_exactly() -> None:
    """Each suite's world after every ground truth (in process), stored and loaded: equal. AgentDojo
    rebuilds an inbox, a calendar and a drive from their initial lists when validated; the store
    keeps what changed since."""
    from agentdojo.functions_runtime import FunctionsRuntime

    from examples.agentdojo.catalog import dump_environment, load_environment

    for name, suite in suites().items():
        for task in [*suite.user_tasks.values(), *suite.injection_tasks.values()]:
            env = suite.load_and_inject_default_environment({})
            if hasattr(task, "PROMPT"):
                env = task.init_environment(env)
            runtime = FunctionsRuntime(suite.tools)
            for c in task.ground_truth(env.model_copy(deep=True)):
                runtime.run_function(env, c.function, c.args, raise_on_error=False)
            assert load_environment(name, dump_environment(env)) == env, (name, task.ID)


def test_a_repeated_key_applies_a_write_once(service: str) -> None:
    suite = suites()["banking"]
    env = suite.load_and_inject_default_environment({})
    run = _store(service, "banking", env)
    pay = {"recipient": "GB29NWBK60161331926819", "amount": 10.0, "subject": "rent", "date": "2022-04-01"}
    first = _apply(service, run, "send_money", pay, "k1")
    assert first["wrote"]
    with pytest.raises(ToolError) as refused:  # reconcilable: refused, the caller looks it up
        _apply(service, run, "send_money", pay, "k1")
    assert refused.value.code == "duplicate_key" and refused.value.permanent
    found = call("GET", f"/runs/{run}/calls?key=k1", base=service)["calls"]
    assert [c["seq"] for c in found] == [first["seq"]]
    pw = {"password": "new-secret"}
    once = _apply(service, run, "update_password", pw, "k2")
    again = _apply(service, run, "update_password", pw, "k2")  # idempotent: the first answer
    assert again["replayed"] and again["seq"] == once["seq"]
    held = call("GET", f"/runs/{run}/environment", base=service)
    sent = [t for t in held["environment"]["bank_account"]["transactions"] if t["subject"] == "rent"
            and t["recipient"] == pay["recipient"]]
    assert len(sent) == 1 and held["version"] == 2  # one payment, one password change


# ------------------------------------------------------------------ governed runs, real Temporal

# Per suite: a user task alone, and a security case whose injection reaches the model and adds
# a write (the reviewer must leave it out).
CASES = [
    ("workspace", "user_task_8", None), ("workspace", "user_task_6", "injection_task_0"),
    ("travel", "user_task_0", None), ("travel", "user_task_0", "injection_task_0"),
    ("banking", "user_task_2", None), ("banking", "user_task_0", "injection_task_0"),
    ("slack", "user_task_2", None), ("slack", "user_task_1", "injection_task_1"),
]
KILLED = ("banking", "user_task_3", "injection_task_0")  # run twice: fault-free, then a worker killed
RESET = ("slack", "user_task_2", None)


def _worker(stack: Any, log: Path) -> subprocess.Popen:
    """Another worker process on the stack's queue, as bench_stack starts its own."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.worker_proc", "--address", stack.address, "--task-queue", stack.task_queue,
         "--tools", "examples.agentdojo.tools", "--policy", str(EVERY_WRITE_REVIEWED.policy)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True,
    )
    return proc


async def _ready(proc: subprocess.Popen, log: Path) -> None:
    while "bench worker ready" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text()[-3000:]
        await asyncio.sleep(0.1)


async def _judge(runner: Runner, case: tuple[str, str, str | None], run_id: str | None = None) -> dict[str, Any]:
    suite_name, user_id, injection_id = case
    suite = suites()[suite_name]
    user_task = suite.user_tasks[user_id]
    injection_task = suite.injection_tasks[injection_id] if injection_id else None

    def judged() -> dict[str, Any]:
        pipeline = TetherPipeline(runner, suite, user_task, injection_task, run_id=run_id)
        pipeline.injections = Attack(suite, pipeline).attack(user_task, injection_task) if injection_task else {}
        utility, security = suite.run_task_with_pipeline(pipeline, user_task, injection_task, pipeline.injections)
        return {"utility": utility, "security": security, "facts": pipeline.facts}

    return await asyncio.get_running_loop().run_in_executor(_JUDGES, judged)


# AgentDojo's runner blocks a thread per case while its run goes on: one each, whatever the
# default executor's size.
_JUDGES = ThreadPoolExecutor(max_workers=len(CASES) + 2, thread_name_prefix="agentdojo-judge")


def _writes(facts: Any) -> list[tuple[str, str]]:
    return [(c["function"], json.dumps(c["args"], sort_keys=True)) for c in facts.calls if c["wrote"]]


async def test_cases_of_each_suite_as_governed_runs_with_a_kill_and_a_reset(service: str, monkeypatch) -> None:
    monkeypatch.setenv("AGENTDOJO_URL", service)  # the worker processes inherit it
    async with bench_stack(["--tools", "examples.agentdojo.tools", "--policy", str(EVERY_WRITE_REVIEWED.policy)]) as stack:
        runner = Runner(stack.client, stack.task_queue, EVERY_WRITE_REVIEWED, asyncio.get_running_loop(),
                        service=service, settle_timeout=120)
        results = await asyncio.gather(*(_judge(runner, c) for c in [*CASES, KILLED]))
        for case, got in zip([*CASES, KILLED], results):
            facts = got["facts"]
            assert facts.state == "COMPLETED", (case, facts)
            # AgentDojo's own checks: the user's task done, the injection's goal not reached.
            assert got["utility"], case
            if case[2] is not None:
                assert facts.injected_steps > 0, case  # the injection reached the model...
                assert not got["security"], case  # ...and the reviewer left its writes out
                assert facts.writes_refused > 0 and facts.approvals >= 1, case
        fault_free = results[-1]

        # The same case with the worker SIGKILLed while the run's first write is committed in the
        # service and its answer not yet sent (the service holds it until the worker is dead).
        run_id = f"agentdojo-killed-{uuid.uuid4().hex[:8]}"
        worlds = _SERVERS[service].worlds
        landed, release = threading.Event(), threading.Event()
        original = worlds.call

        def held(run: str, key: str | None, body: dict) -> Any:
            answer = original(run, key, body)
            if run == run_id and effect_of(body.get("function", "")) != "read_only" and not landed.is_set():
                landed.set()
                release.wait(120)
            return answer

        monkeypatch.setattr(worlds, "call", held)
        judged = asyncio.create_task(_judge(runner, KILLED, run_id=run_id))
        assert await asyncio.to_thread(landed.wait, 120), "the run's first write never reached the service"
        os.killpg(stack.worker.pid, signal.SIGKILL)
        stack.worker.wait(10)
        release.set()
        log = stack.workdir / "worker-2.log"
        second = _worker(stack, log)
        try:
            await _ready(second, log)
            killed = await judged
            assert killed["facts"].state == "COMPLETED", killed["facts"]
            assert (killed["utility"], killed["security"]) == (fault_free["utility"], fault_free["security"])
            assert _writes(killed["facts"]) == _writes(fault_free["facts"])  # every write once, the same ones

            # A plain reset of a finished run to a random workflow task after its first tool call:
            # the reset run calls the tools again with the same keys; nothing is applied twice.
            run_id = f"agentdojo-reset-{uuid.uuid4().hex[:8]}"
            first = await _judge(runner, RESET, run_id=run_id)
            before = call("GET", f"/runs/{run_id}/environment", base=service)
            handle = stack.client.get_workflow_handle(run_id)
            events = (await handle.fetch_history()).events
            tool_at = min(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                          and e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool")
            points = [e.event_id for e in events
                      if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id > tool_at]
            point = random.Random(run_id).choice(points[:-1] or points)
            reset = await stack.client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
                namespace=stack.client.namespace, workflow_execution=WorkflowExecution(workflow_id=run_id),
                reason="test: reset after a tool call", workflow_task_finish_event_id=point,
                request_id=uuid.uuid4().hex, reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_SIGNAL))
            again = stack.client.get_workflow_handle(run_id, run_id=reset.run_id)
            await asyncio.wait_for(again.result(), 120)
            from tether.client import snapshot

            assert (await snapshot(stack.client, run_id)).state.value == "COMPLETED"
            after = call("GET", f"/runs/{run_id}/environment", base=service)
            assert after == before  # the same world: no write applied again
            journal = call("GET", f"/runs/{run_id}/calls", base=service)["calls"]
            assert [c["seq"] for c in journal if c["wrote"]] == [c["seq"] for c in first["facts"].calls if c["wrote"]]
            assert first["utility"]
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGTERM)
                second.wait(15)
