"""The type checker sees the engine: ``mypy --strict`` (pyproject.toml, ``[tool.mypy]``) passes on
workflows/, and the phases' calls to one another go through ``workflows.run_model.Phases``, so a
phase method renamed, or called by a name no phase has, fails the check instead of a run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mypy(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The files and the options are the project's: [tool.mypy] in cwd's pyproject.toml.
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True, timeout=570)


def test_workflows_type_check_strict() -> None:
    proc = mypy(ROOT)
    assert proc.returncode == 0, f"mypy --strict on workflows/ (pyproject.toml [tool.mypy]):\n{proc.stdout}{proc.stderr}"


def test_a_phase_method_renamed_or_misspelled_fails_the_check(tmp_path: Path) -> None:
    """The hostile copy: Handoff's ``_take_handoff`` renamed (Steps, Planning and Inbox still call
    it), and Compensating's ``_undo_check`` called by a misspelled name in Steps. Both run without
    complaint until a run reaches them; the checker names both."""
    shutil.copytree(ROOT / "workflows", tmp_path / "workflows", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")

    def mutate(name: str, old: str, new: str) -> None:
        path = tmp_path / "workflows" / name
        text = path.read_text()
        assert text.count(old) == 1, f"{old!r} is not in workflows/{name} once: update this test"
        path.write_text(text.replace(old, new))

    mutate("handoff.py", "def _take_handoff(", "def _take_the_handoff(")
    mutate("steps.py", "return self._undo_check()", "return self._undo_chek()")
    proc = mypy(tmp_path, "--cache-dir", str(tmp_path / "cache"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert 'Cannot instantiate abstract class "Engine" with abstract attribute "_take_handoff"' in out, out
    assert 'workflows/steps.py' in out and '"Steps" has no attribute "_undo_chek"' in out, out
