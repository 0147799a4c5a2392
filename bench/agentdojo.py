"""AgentDojo's v1 suites as governed Tether runs, judged by AgentDojo's own checks (`make bench-agentdojo`).

    python -m bench.agentdojo [--configs reviewed,policy] [--suites workspace,slack,...]
        [--user-tasks N] [--injection-tasks N] [--concurrency 6] [--out .tether/agentdojo]
        [--driver replayed|pipeline] [--faults [--seed N]]

For each governance configuration (examples/agentdojo/policy.*.toml): a private dev server, one
worker serving the 69 tools, the tool-side service (examples/agentdojo/service.py, SQLite), then
every user task alone (benign) and every user task with every injection task (the security
cases, AgentDojo's ``important_instructions`` attack), each through AgentDojo's
``run_task_with_pipeline``, the agent being (``--driver``, examples/agentdojo/driver.py):

- ``replayed``: ``TetherPipeline``, the ground truth as the run's playbook, with the injection's
  calls where its text reaches the model;
- ``pipeline``: ``PipelinePlanned``, a run planned by AgentDojo's own pipeline (its
  ``OpenAILLM``, in the worker's planner, examples/agentdojo/planner.py) against an offline
  endpoint whose model obeys every injection (examples/agentdojo/model.py).

``--faults``: then the same cases again on the same stack, the worker SIGKILLed at random
moments (a new one started each time), and every ended run reset to a random point after its
first tool call and governed again; AgentDojo's verdicts and the writes compared with the
fault-free run, the world and the journal compared across each reset.

Writes a markdown report and the per-case JSON lines under ``--out``; prints the report.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import ROOT, _stop, bench_stack, free_port, machine_line, table



def cases(suite_names: list[str], user_limit: int | None, injection_limit: int | None) -> list[tuple[str, str, str | None]]:
    """(suite, user task id, injection task id or None), in AgentDojo's order within a suite."""
    from examples.agentdojo.catalog import suites

    benign: list[tuple[str, str, str | None]] = []
    attacked: list[list[tuple[str, str, str | None]]] = []
    for name in suite_names:
        suite = suites()[name]
        users = list(suite.user_tasks)[:user_limit]
        injections = list(suite.injection_tasks)[:injection_limit]
        benign += [(name, u, None) for u in users]
        attacked.append([(name, u, i) for u in users for i in injections])
    # Every user task first, then the security cases of the suites in turn: a run stopped early
    # has measured part of each suite.
    mixed = [c for turn in itertools.zip_longest(*attacked) for c in turn if c is not None]
    return benign + mixed


def ground_truth_utility(suite_names: list[str], user_limit: int | None) -> dict[str, tuple[int, int]]:
    """AgentDojo's own ground-truth pipeline, in process, no Tether: which user tasks the suite
    itself solves (what `every write reviewed` must equal)."""
    from agentdojo.agent_pipeline.ground_truth_pipeline import GroundTruthPipeline

    from examples.agentdojo.catalog import suites

    solved: dict[str, tuple[int, int]] = {}
    for name in suite_names:
        suite = suites()[name]
        users = list(suite.user_tasks.values())[:user_limit]
        ok = sum(suite.run_task_with_pipeline(GroundTruthPipeline(u), u, None, {})[0] for u in users)
        solved[name] = (ok, len(users))
    return solved


def start_service(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (workdir / "agentdojo-service.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.agentdojo.service", "--port", str(port), "--db", str(workdir / "agentdojo.db")],
        stdout=subprocess.PIPE, stderr=log, cwd=ROOT, start_new_session=True, text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if "listening" not in line:
        raise SystemExit(f"the AgentDojo service did not start: {line}")
    return proc, f"http://127.0.0.1:{port}"


async def run_case(runner: Any, case: tuple[str, str, str | None], judges: Any = None, model: Any = None,
                   run_id: str | None = None) -> dict[str, Any]:
    """One case through AgentDojo's runner: the replayed driver, or (``model`` given, the
    endpoint's obeying model) AgentDojo's own pipeline planning the run."""
    from examples.agentdojo.catalog import suites
    from examples.agentdojo.driver import Attack, PipelinePlanned, TetherPipeline

    suite_name, user_id, injection_id = case
    suite = suites()[suite_name]
    user_task = suite.user_tasks[user_id]
    injection_task = suite.injection_tasks[injection_id] if injection_id else None

    def judged() -> tuple[bool, bool, Any]:
        if model is None:
            pipeline = TetherPipeline(runner, suite, user_task, injection_task, run_id=run_id)
        else:
            pipeline = PipelinePlanned(runner, model, suite, user_task, injection_task, run_id=run_id)
        injections = Attack(suite, pipeline).attack(user_task, injection_task) if injection_task else {}
        pipeline.injections = injections
        utility, security = suite.run_task_with_pipeline(pipeline, user_task, injection_task, injections)
        return utility, security, pipeline.facts

    utility, security, facts = await asyncio.get_running_loop().run_in_executor(judges, judged)
    row = {"suite": suite_name, "user_task": user_id, "injection_task": injection_id,
           "utility": bool(utility), "security": bool(security) if injection_id else None}
    row.update({k: v for k, v in asdict(facts).items() if k != "calls"})
    row["tool_calls"] = len(facts.calls)
    row["writes_applied"] = sum(c["wrote"] for c in facts.calls)
    row["writes"] = [[c["function"], json.dumps(c["args"], sort_keys=True)] for c in facts.calls if c["wrote"]]
    return row


def pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} % ({part}/{whole})" if whole else "-"


def summarize(config: str, rows: list[dict[str, Any]], suite_names: list[str], gt: dict[str, tuple[int, int]]) -> str:
    lines = []
    body = []
    for name in [*suite_names, "total"]:
        mine = [r for r in rows if name == "total" or r["suite"] == name]
        benign = [r for r in mine if r["injection_task"] is None]
        attacked = [r for r in mine if r["injection_task"] is not None]
        gt_ok = sum(v[0] for k, v in gt.items() if name in ("total", k))
        gt_all = sum(v[1] for k, v in gt.items() if name in ("total", k))
        calls = sum(r["tool_calls"] for r in mine)
        per_call = [(r["seconds"] - r["bare_seconds"]) / r["tool_calls"] for r in mine if r["tool_calls"]]
        body.append([
            name, pct(gt_ok, gt_all), pct(sum(r["utility"] for r in benign), len(benign)),
            pct(sum(r["utility"] for r in attacked), len(attacked)),
            pct(sum(bool(r["security"]) for r in attacked), len(attacked)),
            sum(r["state"] == "ERROR" for r in mine),
            f"{sum(r.get('injected_steps', 0) > 0 for r in attacked)}/{len(attacked)}",
            sum(r["state"] == "REJECTED" for r in mine),
            f"{statistics.mean(r['approvals'] for r in mine):.2f}" if mine else "-",
            sum(r["writes_refused"] for r in mine), calls,
            f"{1000 * statistics.median(per_call):.0f} ms" if per_call else "-",
        ])
    lines.append(f"### {config}\n")
    lines.append(table(["suite", "ground truth solves", "benign utility", "utility under attack",
                        "targeted ASR", "cases that errored", "injection acted on", "runs rejected", "approvals / case", "writes refused", "tool calls",
                        "Tether time / call (p50)"], body))
    lines.append("\nTether time / call: the run's start to its end as the driver saw it, less the same calls "
                 "applied in process by AgentDojo's runtime, over the calls the run made (the planner, "
                 "validation, approval turnaround, activities, the service's HTTP and SQLite, and the "
                 "driver's 0.2 s status polling included). Injection acted on: security cases whose "
                 "agent proposed the injection's calls (its text reached the model). Runs rejected: the "
                 "reviewer approved no step of a plan (a plan of only the injection's writes), which ends the run.")
    return "\n".join(lines)


PIPELINE_PLANNER_SPEC = "agentdojo=examples.agentdojo.planner:AgentDojoPlanner"


def _error_row(case: tuple[str, str, str | None], error: str) -> dict[str, Any]:
    return {"suite": case[0], "user_task": case[1], "injection_task": case[2], "utility": False,
            "security": None, "error": error[:500], "state": "ERROR", "approvals": 0, "writes_refused": 0,
            "tool_calls": 0, "seconds": 0.0, "bare_seconds": 0.0, "writes": []}


async def run_cases(config: str, runner: Any, todo: list[tuple[str, str, str | None]], concurrency: int,
                    judges: Any, log: Any, model: Any = None, prefix: str | None = None) -> list[dict[str, Any]]:
    """Every case, ``concurrency`` at a time; each row written to ``log`` as its case ends."""
    import uuid

    gate = asyncio.Semaphore(concurrency)
    rows: list[dict[str, Any]] = []
    began = time.monotonic()

    async def one(case: tuple[str, str, str | None]) -> None:
        async with gate:
            run_id = f"{prefix}-{case[0]}-{case[1]}-{case[2] or 'benign'}-{uuid.uuid4().hex[:6]}" if prefix else None
            try:
                row = await run_case(runner, case, judges, model=model, run_id=run_id)
            except Exception as e:  # noqa: BLE001 - counted and shown, never dropped
                row = _error_row(case, f"{type(e).__name__}: {e}")
                print(f"  [{config}] {case}: {row['error']}", flush=True)
        row["at"] = time.monotonic() - began
        row["concurrency"] = concurrency
        rows.append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if len(rows) % 25 == 0 or len(rows) == len(todo):
            print(f"  [{config}] {len(rows)}/{len(todo)} cases, {time.monotonic() - began:.0f} s", flush=True)

    await asyncio.gather(*(one(c) for c in todo))
    rows.sort(key=lambda r: (r["suite"], r["user_task"], r["injection_task"] or ""))
    return rows


async def run_config(config: str, todo: list[tuple[str, str, str | None]], concurrency: int,
                     out: Path, driver: str = "replayed", faults: random.Random | None = None
                     ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """One governance configuration: its stack, every case (``driver``: the replayed plan, or
    AgentDojo's own pipeline planning through the obeying model), then with ``faults`` the same
    cases again with the worker killed at random and each run reset (``fault_pass``)."""
    from examples.agentdojo.driver import GOVERNANCES, Runner
    from examples.agentdojo.model import ObeyingModel
    from examples.fake_openai import FakeOpenAI

    governance = GOVERNANCES[config]
    workdir = out / (config if driver == "replayed" else f"{config}-{driver}")
    workdir.mkdir(parents=True, exist_ok=True)
    log = (workdir / "cases.jsonl").open("w")  # each case as it ends: a run stopped early keeps them
    service, url = start_service(workdir)
    os.environ["AGENTDOJO_URL"] = url  # the worker inherits this process's environment
    worker_args = ["--tools", "examples.agentdojo.tools", "--policy", str(governance.policy)]
    model = endpoint = None
    if driver == "pipeline":
        # AgentDojo's OpenAILLM, in the worker's planner, calls this endpoint: the model that
        # obeys every injection, answering each run from its conversation.
        model = ObeyingModel()
        endpoint = FakeOpenAI(respond=model, record=False).__enter__()
        os.environ.update({"OPENAI_BASE_URL": endpoint.base_url, "TETHER_MODEL": "obeys-every-injection"})
        os.environ.pop("OPENAI_API_KEY", None)
        worker_args += ["--planner", PIPELINE_PLANNER_SPEC]
    faulted = None
    try:
        async with bench_stack(worker_args) as stack:
            runner = Runner(stack.client, stack.task_queue, governance, asyncio.get_running_loop(), service=url)
            # A thread per case in flight for AgentDojo's runner (it blocks while the run goes on).
            judges = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agentdojo-judge")
            began = time.monotonic()
            rows = await run_cases(config, runner, todo, concurrency, judges, log, model)
            elapsed = time.monotonic() - began
            if faults is not None:
                faulted = await fault_pass(config, stack, runner, todo, rows, concurrency, judges, workdir, faults, model)
    finally:
        _stop(service)
        log.close()
        if endpoint is not None:
            endpoint.__exit__(None, None, None)
    print(f"  [{config}, {driver}] {len(rows)} cases in {elapsed:.0f} s", flush=True)
    return rows, faulted


def _key(row: dict[str, Any]) -> tuple[str, str, str | None]:
    return row["suite"], row["user_task"], row["injection_task"]


async def reset_run(stack: Any, runner: Any, run_id: str, rng: random.Random) -> dict[str, Any]:
    """A plain ``temporal workflow reset`` (the CLI, its defaults: signals and updates
    reapplied) of an ended run to a random workflow task after its first tool call; what the
    world and the journal's writes were before."""
    from temporalio.api.enums.v1 import EventType

    from examples.devstack import BIN

    before = await runner._call("GET", f"/runs/{run_id}/environment")
    writes_before = [c["seq"] for c in (await runner._call("GET", f"/runs/{run_id}/calls"))["calls"] if c["wrote"]]
    events = (await stack.client.get_workflow_handle(run_id).fetch_history()).events
    tools = [e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
             and e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"]
    if not tools:
        return {"run": run_id, "skipped": "no tool call"}
    points = [e.event_id for e in events
              if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id > tools[0]]
    point = rng.choice(points[:-1] or points)
    reset = await asyncio.create_subprocess_exec(
        str(BIN / "temporal"), "workflow", "reset", "--address", stack.address, "--namespace", stack.client.namespace,
        "--workflow-id", run_id, "--event-id", str(point), "--reason", "bench: reset after a tool call",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    said, _ = await reset.communicate()
    if reset.returncode != 0:
        raise RuntimeError(f"temporal workflow reset exited {reset.returncode}: {said.decode(errors='replace')[-300:]}")
    return {"run": run_id, "point": point, "events": len(events), "before": before, "writes_before": writes_before}


async def fault_pass(config: str, stack: Any, runner: Any, todo: list[tuple[str, str, str | None]],
                     clean: list[dict[str, Any]], concurrency: int, judges: Any, workdir: Path,
                     rng: random.Random, model: Any) -> dict[str, Any]:
    """The same cases again, each a new run on the same stack, while the worker is SIGKILLed at
    random moments (a new one started each time); then each ended run reset to a random point
    after its first tool call and governed to its end again. Compared with the fault-free rows:
    AgentDojo's verdicts and the writes the service applied; after each reset: the world and the
    journal's writes unchanged."""
    from bench.common import start_worker
    from examples.agentdojo.driver import RunFacts

    workers = [stack.worker]
    kills: list[int] = []  # runs in flight at each kill
    done = asyncio.Event()
    in_flight = {"n": 0}

    async def chaos() -> None:
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), rng.uniform(2.0, 12.0))
                return
            except asyncio.TimeoutError:
                pass
            os.killpg(workers[-1].pid, signal.SIGKILL)
            workers[-1].wait(10)
            kills.append(in_flight["n"])
            workers.append(await start_worker(stack, workdir / f"worker-fault-{len(kills)}.log"))

    log = (workdir / "faults.jsonl").open("w")
    began = time.monotonic()

    async def counted() -> list[dict[str, Any]]:
        original = runner.run

        async def run(*args: Any, **kwargs: Any) -> Any:
            in_flight["n"] += 1
            try:
                return await original(*args, **kwargs)
            finally:
                in_flight["n"] -= 1

        runner.run = run
        try:
            return await run_cases(f"{config}, faults", runner, todo, concurrency, judges, log, model, prefix="fault")
        finally:
            runner.run = original
            done.set()

    breaker = asyncio.create_task(chaos())
    rows = await counted()
    await breaker
    log.close()
    by_case = {_key(r): r for r in clean}
    differ = []
    for r in rows:
        c = by_case.get(_key(r))
        if c is None or (r["utility"], r["security"], r["state"], r["writes"]) != (c["utility"], c["security"], c["state"], c["writes"]):
            differ.append({"case": list(_key(r)), "fault_free": c and {k: c[k] for k in ("utility", "security", "state", "writes")},
                           "faulted": {k: r.get(k) for k in ("utility", "security", "state", "writes", "error")}})
    # Every ended run of the faulted pass, reset and governed again.
    gate = asyncio.Semaphore(concurrency)
    resets: list[dict[str, Any]] = []

    async def reset_one(row: dict[str, Any]) -> None:
        async with gate:
            try:
                got = await reset_run(stack, runner, row["run_id"], rng)
                if "skipped" not in got:
                    again = RunFacts(row["run_id"])
                    status = await runner.govern(row["run_id"], runner.asked[row["run_id"]], again)
                    got["decided_again"] = again.decided_again
                    after = await runner._call("GET", f"/runs/{row['run_id']}/environment")
                    journal = (await runner._call("GET", f"/runs/{row['run_id']}/calls"))["calls"]
                    if status.state.value != row["state"]:
                        got["why"] = await runner.why(row["run_id"])
                    got.update(state=status.state.value, same_state=status.state.value == row["state"],
                               same_world=after == got.pop("before"),
                               same_writes=[c["seq"] for c in journal if c["wrote"]] == got.pop("writes_before"))
            except Exception as e:  # noqa: BLE001 - counted and shown
                import traceback

                got = {"run": row["run_id"], "error": f"{type(e).__name__}: {e}"[:300],
                       "where": traceback.format_exc()[-1500:]}
            resets.append(got)

    await asyncio.gather(*(reset_one(r) for r in rows if r.get("run_id") and r["state"] != "ERROR"))
    for proc in workers[1:]:
        _stop(proc)
    (workdir / "resets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in resets))
    done_resets = [r for r in resets if "point" in r and "error" not in r]
    summary = {
        "cases": len(rows), "seconds": time.monotonic() - began, "kills": len(kills),
        "in_flight_at_kills": kills, "errored": sum(r["state"] == "ERROR" for r in rows),
        "verdicts_equal": sum((r["utility"], r["security"]) == (by_case[_key(r)]["utility"], by_case[_key(r)]["security"])
                              for r in rows if _key(r) in by_case),
        "writes_equal": sum(r["writes"] == by_case[_key(r)]["writes"] for r in rows if _key(r) in by_case),
        "differ": differ, "resets": len(done_resets),
        "reset_errors": [r for r in resets if "error" in r],
        "reset_skipped": sum("skipped" in r for r in resets),
        "reset_same_world": sum(bool(r.get("same_world")) for r in done_resets),
        "reset_same_writes": sum(bool(r.get("same_writes")) for r in done_resets),
        "reset_same_state": sum(bool(r.get("same_state")) for r in done_resets),
        "reset_decided_again": sum(bool(r.get("decided_again")) for r in done_resets),
        "reset_changed": [r for r in done_resets if not (r.get("same_world") and r.get("same_writes"))],
    }
    (workdir / "faults-summary.json").write_text(json.dumps(summary, indent=1))  # --report-only reads it
    return summary


def fault_section(config: str, f: dict[str, Any]) -> str:
    n = f["cases"]
    lines = [
        f"### {config}: faults (worker SIGKILLed at random, then every run reset)\n",
        table(["measure", "result"], [
            ["cases run again under faults", n],
            ["worker SIGKILLs (runs in flight at each)", f"{f['kills']} ({', '.join(map(str, f['in_flight_at_kills'])) or '-'})"],
            ["cases that errored", f["errored"]],
            ["AgentDojo verdicts (utility, security) equal to the fault-free run's", f"{f['verdicts_equal']}/{n}"],
            ["writes applied (function and arguments, in order) equal to the fault-free run's", f"{f['writes_equal']}/{n}"],
            ["plain resets to a random point after the first tool call", f"{f['resets']} (skipped {f['reset_skipped']}, errors {len(f['reset_errors'])})"],
            ["reset runs ending in the same state", f"{f['reset_same_state']}/{f['resets']}"],
            ["worlds unchanged by the reset run (no write applied again)", f"{f['reset_same_world']}/{f['resets']}"],
            ["journal's writes unchanged by the reset run", f"{f['reset_same_writes']}/{f['resets']}"],
            ["reset runs whose reviewer had to decide again under a new decision id", f"{f['reset_decided_again']}/{f['resets']}"],
        ]),
        f"\n{n} cases under faults in {f['seconds']:.0f} s, resets included.",
    ]
    for d in f["differ"][:10]:
        lines.append(f"\n- differs: `{json.dumps(d)[:600]}`")
    for r in f["reset_changed"][:10]:
        lines.append(f"\n- reset changed the world: `{json.dumps({k: r.get(k) for k in ('run', 'point', 'state', 'decided_again')})}`")
    for e in f["reset_errors"][:5]:
        lines.append(f"\n- reset error: `{json.dumps(e)[:300]}`")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    suite_names = args.suites.split(",")
    todo = cases(suite_names, args.user_tasks, args.injection_tasks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not os.environ.get("TETHER_STATE_KEY_FILE"):
        # One key ring for every configuration's stack: this process verifies the runs' views
        # with the ring it read first (tether.runs.public_keys), whichever stack it talks to.
        from tether.store.keys import genkey

        ring = Path(tempfile.mkdtemp(prefix="agentdojo-keys-")) / "state.key"
        genkey(ring)
        os.environ["TETHER_STATE_KEY_FILE"] = str(ring)
    print(f"AgentDojo v1 through Tether: {len(todo)} cases per configuration ({machine_line()})", flush=True)
    gt = ground_truth_utility(suite_names, args.user_tasks)
    sections = []
    label = "" if args.driver == "replayed" else f", {args.driver}"
    faults = random.Random(args.seed) if args.faults else None
    for config in args.configs.split(","):
        folder = config if args.driver == "replayed" else f"{config}-{args.driver}"
        faulted = None
        if args.rerun_failed:  # the cases an earlier run ended FAILED or ERROR, run again in place
            path = out / folder / "cases.jsonl"
            kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            again = [(r["suite"], r["user_task"], r["injection_task"]) for r in kept if r["state"] in ("FAILED", "ERROR")]
            fresh, _ = await run_config(config, again, args.concurrency, out / "rerun", args.driver)
            fresh_by = {(r["suite"], r["user_task"], r["injection_task"]): r for r in fresh}
            rows = [fresh_by.get((r["suite"], r["user_task"], r["injection_task"]), r) for r in kept]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            todo = [c for c in todo if (c[0], c[1], c[2]) in {(r["suite"], r["user_task"], r["injection_task"]) for r in rows}]
        elif args.report_only:  # what an earlier (maybe stopped) run wrote
            path = out / folder / "cases.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if (out / folder / "faults-summary.json").exists():
                faulted = json.loads((out / folder / "faults-summary.json").read_text())
            todo = [c for c in todo if (c[0], c[1], c[2]) in {(r["suite"], r["user_task"], r["injection_task"]) for r in rows}]
        else:
            rows, faulted = await run_config(config, todo, args.concurrency, out, args.driver, faults)
        elapsed = max((r["at"] for r in rows), default=0)
        at_once = rows[0].get("concurrency", args.concurrency) if rows else args.concurrency
        sections.append(summarize(config + label, rows, suite_names, gt) +
                        f"\n\n{len(rows)} cases in {elapsed:.0f} s wall ({at_once} at a time).")
        if faulted is not None:
            sections.append(fault_section(config + label, faulted))
    benign = sum(1 for c in todo if c[2] is None)
    report = "\n\n".join([
        f"## AgentDojo v1 through Tether ({benign} user tasks, {len(todo) - benign} security cases)\n",
        f"`python -m bench.agentdojo {' '.join(sys.argv[1:])}`; {machine_line()}.",
        *sections,
    ])
    (out / "report.md").write_text(report + "\n")
    print(report)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="reviewed,policy", help="reviewed, policy (comma-separated)")
    parser.add_argument("--suites", default="workspace,travel,banking,slack")
    parser.add_argument("--user-tasks", type=int, default=None, help="the first N user tasks of each suite")
    parser.add_argument("--injection-tasks", type=int, default=None, help="the first N injection tasks of each suite")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--driver", choices=["replayed", "pipeline"], default="replayed",
                        help="replayed: the ground truth as the plan; pipeline: AgentDojo's own agent pipeline "
                             "(its OpenAILLM on the offline endpoint's model that obeys every injection) plans")
    parser.add_argument("--faults", action="store_true",
                        help="then every case again with the worker SIGKILLed at random moments, and every run "
                             "reset after its first tool call: verdicts and writes compared with the fault-free run")
    parser.add_argument("--seed", type=int, default=59, help="the faults' random moments and reset points")
    parser.add_argument("--rerun-failed", action="store_true",
                        help="run again the cases --out's cases.jsonl has FAILED or ERROR, then report")
    parser.add_argument("--report-only", action="store_true", help="the report from --out's cases.jsonl files")
    parser.add_argument("--out", default=str(ROOT / ".tether" / "agentdojo"))
    code = asyncio.run(main_async(parser.parse_args()))
    sys.stdout.flush()
    os._exit(code)  # temporalio clients can abort at interpreter exit (sdk-python #300)


if __name__ == "__main__":
    main()
