"""AgentDojo's v1 suites as governed Tether runs, judged by AgentDojo's own checks (`make bench-agentdojo`).

    python -m bench.agentdojo [--configs reviewed,policy] [--suites workspace,slack,...]
        [--user-tasks N] [--injection-tasks N] [--concurrency 6] [--out .tether/agentdojo]

For each governance configuration (examples/agentdojo/policy.*.toml): a private dev server, one
worker serving the 69 tools, the tool-side service (examples/agentdojo/service.py, SQLite), then
every user task alone (benign) and every user task with every injection task (the security
cases, AgentDojo's ``important_instructions`` attack), each through AgentDojo's
``run_task_with_pipeline`` with ``TetherPipeline`` as the agent (examples/agentdojo/driver.py).
Writes a markdown report and the per-case JSON lines under ``--out``; prints the report.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import ROOT, _stop, bench_stack, free_port, machine_line, table


_KEY_GIVEN = os.environ.get("TETHER_STATE_KEY_FILE")


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


async def run_case(runner: Any, case: tuple[str, str, str | None], judges: Any = None) -> dict[str, Any]:
    from examples.agentdojo.catalog import suites
    from examples.agentdojo.driver import Attack, TetherPipeline

    suite_name, user_id, injection_id = case
    suite = suites()[suite_name]
    user_task = suite.user_tasks[user_id]
    injection_task = suite.injection_tasks[injection_id] if injection_id else None

    def judged() -> tuple[bool, bool, Any]:
        pipeline = TetherPipeline(runner, suite, user_task, injection_task)
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
            f"{statistics.mean(r['approvals'] for r in mine):.2f}" if mine else "-",
            sum(r["writes_refused"] for r in mine), calls,
            f"{1000 * statistics.median(per_call):.0f} ms" if per_call else "-",
        ])
    lines.append(f"### {config}\n")
    lines.append(table(["suite", "ground truth solves", "benign utility", "utility under attack",
                        "targeted ASR", "cases that errored", "approvals / case", "writes refused", "tool calls",
                        "Tether time / call (p50)"], body))
    lines.append("\nTether time / call: the run's start to its end as the driver saw it, less the same calls "
                 "applied in process by AgentDojo's runtime, over the calls the run made (the planner, "
                 "validation, approval turnaround, activities, the service's HTTP and SQLite, and the "
                 "driver's 0.2 s status polling included).")
    return "\n".join(lines)


async def run_config(config: str, todo: list[tuple[str, str, str | None]], concurrency: int,
                     out: Path) -> list[dict[str, Any]]:
    from examples.agentdojo.driver import GOVERNANCES, Runner

    governance = GOVERNANCES[config]
    # bench_stack makes a key ring in its own temp dir and points this process at it: each
    # configuration's stack makes its own.
    if _KEY_GIVEN is None:
        os.environ.pop("TETHER_STATE_KEY_FILE", None)
    rows: list[dict[str, Any]] = []
    workdir = out / config.replace(" ", "-")
    workdir.mkdir(parents=True, exist_ok=True)
    log = (workdir / "cases.jsonl").open("w")  # each case as it ends: a run stopped early keeps them
    service, url = start_service(workdir)
    os.environ["AGENTDOJO_URL"] = url  # the worker inherits this process's environment
    try:
        async with bench_stack(["--tools", "examples.agentdojo.tools", "--policy", str(governance.policy)]) as stack:
            runner = Runner(stack.client, stack.task_queue, governance, asyncio.get_running_loop(), service=url)
            gate = asyncio.Semaphore(concurrency)
            # A thread per case in flight for AgentDojo's runner (it blocks while the run goes on).
            judges = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agentdojo-judge")
            began = time.monotonic()
            done = 0

            async def one(case: tuple[str, str, str | None]) -> None:
                nonlocal done
                async with gate:
                    try:
                        row = await run_case(runner, case, judges)
                    except Exception as e:  # noqa: BLE001 - counted and shown, never dropped
                        row = {"suite": case[0], "user_task": case[1], "injection_task": case[2], "utility": False,
                               "security": None, "error": f"{type(e).__name__}: {e}"[:500], "state": "ERROR",
                               "approvals": 0, "writes_refused": 0, "tool_calls": 0, "seconds": 0.0,
                               "bare_seconds": 0.0}
                        print(f"  [{config}] {case}: {row['error']}", flush=True)
                row["at"] = time.monotonic() - began
                row["concurrency"] = concurrency
                rows.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                done += 1
                if done % 25 == 0 or done == len(todo):
                    print(f"  [{config}] {done}/{len(todo)} cases, {time.monotonic() - began:.0f} s", flush=True)

            await asyncio.gather(*(one(c) for c in todo))
            elapsed = time.monotonic() - began
    finally:
        _stop(service)
        log.close()
    rows.sort(key=lambda r: (r["suite"], r["user_task"], r["injection_task"] or ""))
    print(f"  [{config}] {len(rows)} cases in {elapsed:.0f} s", flush=True)
    return rows


async def main_async(args: argparse.Namespace) -> int:
    suite_names = args.suites.split(",")
    todo = cases(suite_names, args.user_tasks, args.injection_tasks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"AgentDojo v1 through Tether: {len(todo)} cases per configuration ({machine_line()})", flush=True)
    gt = ground_truth_utility(suite_names, args.user_tasks)
    sections = []
    for config in args.configs.split(","):
        if args.rerun_failed:  # the cases an earlier run ended FAILED or ERROR, run again in place
            path = out / config / "cases.jsonl"
            kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            again = [(r["suite"], r["user_task"], r["injection_task"]) for r in kept if r["state"] in ("FAILED", "ERROR")]
            fresh = await run_config(config, again, args.concurrency, out / "rerun")
            fresh_by = {(r["suite"], r["user_task"], r["injection_task"]): r for r in fresh}
            rows = [fresh_by.get((r["suite"], r["user_task"], r["injection_task"]), r) for r in kept]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            todo = [c for c in todo if (c[0], c[1], c[2]) in {(r["suite"], r["user_task"], r["injection_task"]) for r in rows}]
        elif args.report_only:  # what an earlier (maybe stopped) run wrote
            path = out / config / "cases.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            todo = [c for c in todo if (c[0], c[1], c[2]) in {(r["suite"], r["user_task"], r["injection_task"]) for r in rows}]
        else:
            rows = await run_config(config, todo, args.concurrency, out)
        elapsed = max((r["at"] for r in rows), default=0)
        at_once = rows[0].get("concurrency", args.concurrency) if rows else args.concurrency
        sections.append(summarize(config, rows, suite_names, gt) +
                        f"\n\n{len(rows)} cases in {elapsed:.0f} s wall ({at_once} at a time).")
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
    parser.add_argument("--rerun-failed", action="store_true",
                        help="run again the cases --out's cases.jsonl has FAILED or ERROR, then report")
    parser.add_argument("--report-only", action="store_true", help="the report from --out's cases.jsonl files")
    parser.add_argument("--out", default=str(ROOT / ".tether" / "agentdojo"))
    code = asyncio.run(main_async(parser.parse_args()))
    sys.stdout.flush()
    os._exit(code)  # temporalio clients can abort at interpreter exit (sdk-python #300)


if __name__ == "__main__":
    main()
