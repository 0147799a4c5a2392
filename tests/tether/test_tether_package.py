"""The `tether` package: what programs import. Its face, the old import paths that keep working
for one release, what it leaves out of a CLI's start, and that `pip install .` installs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_face_names_only_what_it_has() -> None:
    import tether

    assert sorted(tether.__all__) == sorted(set(tether.__all__))
    missing = [name for name in tether.__all__ if getattr(tether, name, None) is None]
    assert missing == []
    try:
        tether.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_the_old_import_paths_are_the_same_objects() -> None:
    """`from client import repair, connect, TetherError` (and the worker's replayer) keep working
    for one release: the very objects of the `tether` package, not copies."""
    import client
    import tether.connection
    import tether.plugin
    import tether.repair
    import worker

    assert client.repair is tether.repair.repair and client.RepairResult is tether.repair.RepairResult
    assert client.connect is tether.connection.connect and client.TetherError is tether.connection.TetherError
    assert (client.OK, client.REFUSED, client.USAGE, client.PENDING) == (0, 1, 2, 3)
    assert worker.create_replayer is tether.plugin.create_replayer and worker.WORKFLOW_RUNNER is tether.plugin.WORKFLOW_RUNNER
    assert worker.TetherError is client.TetherError  # one error type: the CLI maps its code to the exit code


def test_a_program_that_only_connects_does_not_load_the_worker() -> None:
    """`import client` (the CLI, the inbox) loads neither the workflow nor the worker's
    configuration: they come with the first repair or replayer."""
    code = "import sys, client, tether; print(sorted(m for m in ('tether.plugin', 'workflows.agent_run', 'worker') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_the_checkout_stack_is_the_one_the_dev_stack_writes() -> None:
    import examples.devstack
    import tether.connection

    assert tether.connection.STACK_FILE == examples.devstack.STACK_FILE


def test_pip_install_packages_tether() -> None:
    import tomllib

    from tests.operations.test_compose import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = find_packages(ROOT, config["packages"]["find"]["include"])
    assert "tether" in found and not [p for p in found if p.startswith("tests")]
    assert "COPY tether ./tether" in (ROOT / "Dockerfile").read_text()  # the image installs it too


def test_a_tool_author_imports_from_tether_alone() -> None:
    """`from tether import tool, ToolContext, ToolError, ToolEffect`: the very objects
    the worker uses, loaded on first use (a program that only connects does not load the tools)."""
    code = ("import sys, tether; assert 'activities.tools' not in sys.modules, 'tools loaded at import'\n"
            "from tether import ToolContext, ToolEffect, ToolError, tool\n"
            "import activities.tools as t, workflows.contract as c\n"
            "assert (tool, ToolContext, ToolError, ToolEffect) == (t.tool, t.ToolContext, t.ToolError, c.ToolEffect)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
