"""The type checker sees the whole house: ``mypy --strict`` (pyproject.toml, ``[tool.mypy]``) passes
on everything ``pip install .`` installs (workflows/, activities/, tether/, worker.py, starter.py),
and the phases' calls to one another go through ``workflows.run_model.Phases``, so a
phase method renamed, or called by a name no phase has, fails the check instead of a run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def mypy(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The files and the options are the project's: [tool.mypy] in cwd's pyproject.toml. Its
    # incremental cache (.mypy_cache, or --cache-dir) makes a run after a small change take seconds.
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True, timeout=570)


def test_the_installed_code_type_checks_strict() -> None:
    proc = mypy(ROOT)
    assert proc.returncode == 0, f"mypy --strict (pyproject.toml [tool.mypy]):\n{proc.stdout}{proc.stderr}"
    # Every installed package and module is checked, not workflows/ alone (116 files today).
    checked = re.search(r"(\d+) source files", proc.stdout)
    assert checked is not None and int(checked[1]) > 100, proc.stdout


def test_a_phase_method_renamed_misspelled_or_resigned_fails_the_check(tmp_path: Path) -> None:
    """The hostile copy: Handoff's ``_take_handoff`` renamed (Steps, Planning and Decisions still call
    it), Compensating's ``_undo_check`` called by a misspelled name in Steps, and its ``on_cancel``
    given a parameter Handoff does not pass. Each runs without complaint until a run reaches it;
    the checker names all three."""
    shutil.copytree(ROOT / "workflows", tmp_path / "workflows", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")

    def mutate(name: str, old: str, new: str) -> None:
        path = tmp_path / "workflows" / name
        text = path.read_text()
        assert text.count(old) == 1, f"{old!r} is not in workflows/{name} once: update this test"
        path.write_text(text.replace(old, new))

    mutate("handoff.py", "def _take_handoff(", "def _take_the_handoff(")
    mutate("steps.py", "return self._undo_check()", "return self._undo_chek()")
    mutate("compensating.py", "def on_cancel(self) -> str:", "def on_cancel(self, now: datetime) -> str:")
    proc = mypy(tmp_path, "--cache-dir", str(tmp_path / "cache"), "workflows")  # the copy holds workflows/ alone
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert 'Cannot instantiate abstract class "Engine" with abstract attribute "_take_handoff"' in out, out
    assert 'workflows/steps.py' in out and '"Steps" has no attribute "_undo_chek"' in out, out
    assert '"on_cancel" incompatible with supertype "workflows.run_model.Phases"' in out, out


def test_require_gives_back_what_the_state_guarantees() -> None:
    """``require`` returns its value (so the checker knows it is there) and fails the run, as
    IllegalState, on None, False or an empty value: the same test as before it returned."""
    from workflows.run_model import IllegalState, require

    plan = object()
    assert require(plan, "no plan") is plan
    assert require(True, "never") is True
    for missing in (None, False, 0, ""):
        with pytest.raises(IllegalState, match="^no plan$"):
            require(missing, "no plan")


def test_the_face_tether_names_typed_objects(tmp_path: Path) -> None:
    """``tether``'s names load on first use (``__getattr__``), yet the checker sees each as what
    it is, never ``object``: a program using them is checked too."""
    program = tmp_path / "program.py"
    program.write_text("import tether\n" + "".join(f"reveal_type(tether.{name})\n" for name in (
        "create_replayer", "tool", "ToolEffect", "Refused", "connect")))
    proc = mypy(ROOT, str(program))
    revealed = [line.split('Revealed type is "', 1)[1] for line in proc.stdout.splitlines() if "Revealed type" in line]
    assert len(revealed) == 5 and not any(r.startswith("builtins.object") for r in revealed), proc.stdout
    assert revealed[0].startswith("def (") and "Replayer" in revealed[0], revealed
    assert revealed[3].startswith("def (") and "Refused" in revealed[3], revealed
