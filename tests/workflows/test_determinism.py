"""Every module of workflows/ is deterministic by its source (tests/helpers/determinism_lint.py): the
sandbox never sees the modules agent_run.py imports passed through, so this check does.
Mutants of the real run model (workflows/run_model.py, where the Engine's ``move`` lives),
written to a temporary directory, must be caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.determinism_lint import ROOT, check, problems_in, workflow_modules

ENGINE = ROOT / "workflows/run_model.py"
# Where a mutant goes: the first line of the run model's move (the Engine's) body.
MOVE = "    def move(self, to: RunState, *, at: datetime, actor: str, reason: str, refs: Refs | None = None) -> None:\n"


def test_every_workflow_module_is_checked_and_clean() -> None:
    names = {p.name for p in workflow_modules()}
    assert {"agent_run.py", "engine.py", "policy.py", "validation.py", "identity.py", "models.py", "states.py"} <= names
    assert check(workflow_modules()) == []


def mutant(tmp_path: Path, line: str, *, header: str = "") -> Path:
    source = ENGINE.read_text()
    assert MOVE in source
    mutated = tmp_path / "run_model.py"
    mutated.write_text(header + source.replace(MOVE, MOVE + f"        {line}\n", 1))
    return mutated


def test_the_wall_clock_mutant_of_engine_py_is_caught(tmp_path: Path) -> None:
    # The case from the issue: the engine writes its wall-clock time into a record.
    mutated = mutant(tmp_path, "at = datetime.now()")
    problems = check([mutated])
    assert len(problems) == 1 and "reads the wall clock (.now): use workflow.now()" in problems[0]
    line = 1 + mutated.read_text().splitlines().index("        at = datetime.now()")
    assert problems[0].startswith(f"{mutated}:{line}: ")
    # The command exits 1 and names it, as CI would run it.
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.determinism_lint", str(mutated)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "reads the wall clock" in proc.stdout
    clean = subprocess.run([sys.executable, "-m", "tests.helpers.determinism_lint"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert clean.returncode == 0, clean.stdout


@pytest.mark.parametrize("line, header, rule", [
    ("x = random.random()", "import random\n", "imports random"),
    ("x = os.environ['TETHER']", "import os\n", "imports os"),
    ("x = os.environ", "from workflows import os\n", "leaves the workflow (.environ)"),
    ("x = open('/etc/hostname').read()", "", "calls open()"),
    ("t = threading.Thread(target=print)", "import threading\n", "imports threading"),
    ("x = time.time()", "import time\n", "imports time"),
    ("x = monotonic()", "from time import monotonic\n", "imports from time"),
    ("x = getattr(datetime, 'now')()", "", "getattr(..., 'now')"),
    ("x = getattr(datetime, name)()", "", "getattr with a computed name"),
    ("x = datetime.utcnow", "", "reads the wall clock (.utcnow)"),
    ("x = id(self)", "", "calls id()"),
    ("x = __import__('os')", "", "calls __import__()"),
    ("x = uuid.uuid4()", "import uuid\n", "imports uuid"),
    ("asyncio.to_thread(print)", "import asyncio\n", "leaves the workflow (.to_thread)"),
])
def test_mutants_reading_randomness_environment_io_or_threads_are_caught(tmp_path: Path, line: str, header: str, rule: str) -> None:
    problems = check([mutant(tmp_path, line, header=header)])
    assert any(rule in p for p in problems), problems


def test_the_deterministic_apis_stay_allowed() -> None:
    source = (
        "from temporalio import workflow\nimport asyncio\n"
        "async def f(self):\n    at = workflow.now()\n    key = workflow.uuid4()\n    n = workflow.random().random()\n"
        "    await asyncio.sleep(1)\n    rule = getattr(self, 'rule', None)\n"
    )
    assert problems_in(source, "ok.py") == []


def test_the_worker_passes_the_linted_workflow_modules_through_the_sandbox() -> None:
    """What this lint checks is what the sandbox does not re-import per run: every module under
    workflows/ (agent_run.py included), so no workflow module escapes both checks."""
    from worker import WORKFLOW_RUNNER

    assert "workflows" in WORKFLOW_RUNNER.restrictions.passthrough_modules
    linted = {p.stem for p in (ROOT / "workflows").glob("*.py")}
    assert {"agent_run", "engine", "policy", "states"} <= linted
