"""What it would cost to put every workflow module under the sandbox's checks.

    python -m bench.sandbox_imports [--runs 40] [--history tests/histories/read_only.json]

``workflows/agent_run.py`` imports the other ``workflows/`` modules passed through the Temporal
sandbox, so they are imported once per process and the sandbox's checks (wall clock, I/O,
environment) never see their calls; ``tests/helpers/determinism_lint.py`` checks their source instead.
The alternative is to let the sandbox import them afresh for every run (every workflow
instance the worker creates: a new run, or a cached run evicted and replayed). This replays one
recorded history ``--runs`` times, each as its own run, two ways:

- ``passed through`` — the shipped ``AgentRun``;
- ``under the sandbox`` — the same source with its ``imports_passed_through()`` block turned
  into plain imports (third-party libraries still passed through, as they would be), so the
  sandbox re-imports ``workflows.*`` (pydantic models included) for every run.

It prints the worker CPU per run for each and the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
import tempfile
import time
from pathlib import Path

from temporalio.client import WorkflowHistory
from worker import create_replayer
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

ROOT = Path(__file__).resolve().parent.parent
THIRD_PARTY = (
    "pydantic", "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection",
    "jsonschema", "jsonschema_specifications", "referencing", "rpds", "attrs", "re2", "rfc8785",
    "confusable_homoglyphs",
)


def sandboxed_agent_run(folder: Path) -> type:
    source = (ROOT / "workflows/agent_run.py").read_text()
    marker = "with workflow.unsafe.imports_passed_through():"
    assert marker in source
    (folder / "agent_run_under_sandbox.py").write_text(source.replace(marker, "if True:  # under the sandbox", 1))
    sys.path.insert(0, str(folder))
    return importlib.import_module("agent_run_under_sandbox").AgentRun


async def replay(workflow: type, history: WorkflowHistory, runs: int, runner: SandboxedWorkflowRunner | None) -> float:
    options = {"workflow_runner": runner} if runner else {}
    replayer = create_replayer(workflows=[workflow], **options)
    histories = [WorkflowHistory(f"{history.workflow_id}-{i}", history.events) for i in range(runs)]
    started = time.process_time()
    async with replayer.workflow_replay_iterator(_aiter(histories)) as results:
        async for result in results:
            if result.replay_failure is not None:
                raise SystemExit(f"replay failed: {result.replay_failure}")
    return (time.process_time() - started) / runs


async def _aiter(items):  # noqa: ANN001, ANN202
    for item in items:
        yield item


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--history", default=str(ROOT / "tests/histories/read_only.json"))
    args = parser.parse_args(argv)
    path = Path(args.history)
    history = WorkflowHistory.from_json("bench-sandbox", path.read_text())
    from workflows.agent_run import AgentRun

    with tempfile.TemporaryDirectory() as folder:
        under = sandboxed_agent_run(Path(folder))
        runner = SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(*THIRD_PARTY))
        # Warm-up: imports and bytecode, not counted.
        await replay(AgentRun, history, 2, None)
        await replay(under, history, 2, runner)
        rows = []
        for _ in range(3):  # alternate, so machine noise hits both
            rows.append((await replay(AgentRun, history, args.runs, None), await replay(under, history, args.runs, runner)))
    passed = min(r[0] for r in rows) * 1000
    sandboxed = min(r[1] for r in rows) * 1000
    print(f"history {path.name} ({len(history.events)} events), {args.runs} runs x 3 rounds, best round:")
    print(f"  passed through (shipped):   {passed:6.1f} ms worker CPU per run")
    print(f"  under the sandbox's checks: {sandboxed:6.1f} ms worker CPU per run")
    print(f"  difference:                 {sandboxed - passed:+6.1f} ms per run ({sandboxed / passed:.1f}x)")


if __name__ == "__main__":
    asyncio.run(main())
