"""The `tether` package: what programs import. Its face, the old import paths gone, what it leaves
out of a CLI's start, and that `pip install .` installs it."""

from __future__ import annotations

import ast
import json
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


def test_the_old_import_paths_are_gone() -> None:
    """The shims of earlier releases are gone (issue 60): `client`, `inbox`, `activities.undo_ledger`
    and the libraries' old homes under activities/ do not import, from the checkout either; the
    worker still names the replayer it configures."""
    # Spelled so that a rewrite of moved modules' names (the move's script) passes them by.
    gone = ["client", "inbox", *(f"activities.{m}" for m in ("undo_ledger", "policy_file", "keys", "audit_sink",
                                                               "cedar", "planners", "planning"))]
    code = ("import importlib, json\n"
            "out = {}\n"
            f"for name in {gone!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "        out[name] = 'imported'\n"
            "    except ModuleNotFoundError as e:\n"
            "        out[name] = e.name\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {name: name for name in gone}
    import activities.audit
    import activities.policy_checks

    # What the activity modules imported for their own use is not theirs to hand on any more.
    assert not hasattr(activities.audit, "merge_timeline") and not hasattr(activities.audit, "verify_streams")
    import tether.replay
    import worker

    assert worker.create_replayer is tether.replay.create_replayer and worker.WORKFLOW_RUNNER is tether.replay.WORKFLOW_RUNNER


def test_a_program_that_only_connects_does_not_load_the_worker() -> None:
    """`import tether.client` (the CLI, the inbox) loads neither the workflow nor the worker's
    configuration: they come with the first repair or replayer."""
    code = "import sys, tether.client, tether; print(sorted(m for m in ('activities.plugin', 'tether.replay', 'workflows.agent_run', 'worker') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_the_cli_imports_tether_without_temporal() -> None:
    """tether.cli lives in the package, so `tether --help` imports `tether`: its face loads the
    connection (Temporal) only when a name of it is first used, and that name is the connection's."""
    code = ("import sys, tether, tether.cli.main\n"
            "print(sorted(m for m in ('temporalio', 'tether.connection', 'pydantic') if m in sys.modules))\n"
            "from tether import TetherError, connect\n"
            "import tether.connection as c\n"
            "print(connect is c.connect and TetherError is c.TetherError and tether.USAGE == c.USAGE == 2)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True"], out


def test_the_checkout_stack_is_the_one_the_dev_stack_writes() -> None:
    import examples.devstack
    import tether.connection

    assert tether.connection.STACK_FILE == examples.devstack.STACK_FILE


def test_the_image_installs_tether() -> None:
    """`pip install .` installs the package (tests/tether/test_install_layout.py builds the wheel); the
    image's build stage copies it in, to install it."""
    assert "COPY tether ./tether" in (ROOT / "Dockerfile").read_text()


def test_a_tool_author_imports_from_tether_alone() -> None:
    """`from tether import tool, ToolContext, ToolError, ToolEffect`: the very objects
    the worker uses, loaded on first use (a program that only connects does not load the tools)."""
    code = ("import sys, tether; assert 'tether.tools.sdk' not in sys.modules, 'tools loaded at import'\n"
            "from tether import ToolContext, ToolEffect, ToolError, tool\n"
            "import tether.tools.sdk as t, workflows.contract as c\n"
            "assert (tool, ToolContext, ToolError, ToolEffect) == (t.tool, t.ToolContext, t.ToolError, c.ToolEffect)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------- tether.client

CLIENT = ROOT / "tether/client"


def client_modules() -> list[str]:
    return sorted(p.stem for p in CLIENT.glob("*.py") if p.stem != "__init__")


def test_the_client_face_names_every_public_name_of_its_modules_once() -> None:
    """`from tether.client import X` for every public name any of its modules defines: the very
    object, named once; and nothing the face names is missing or unknown."""
    import importlib

    import tether.client

    face = tether.client.__all__
    assert face == sorted(set(face)), "__all__ is sorted, each name once"
    defined: dict[str, object] = {}
    for stem in client_modules():
        module = importlib.import_module(f"tether.client.{stem}")
        for node in ast.parse((CLIENT / f"{stem}.py").read_text()).body:
            names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     else [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else [])
            for name in names:
                if not name.startswith("_"):
                    assert name not in defined, f"{name} is defined in two modules of tether.client"
                    defined[name] = getattr(module, name)
    assert sorted(set(defined) - set(face)) == [], "public names the face does not name"
    assert {n: getattr(tether.client, n) for n in defined} == defined, "the face names a copy, not the object"
    unknown = [n for n in face if getattr(tether.client, n, None) is None]
    assert unknown == []


def test_no_client_module_is_above_600_lines() -> None:
    sizes = {stem: len((CLIENT / f"{stem}.py").read_text().splitlines()) for stem in [*client_modules(), "__init__"]}
    assert {s: n for s, n in sizes.items() if n > 600} == {}, "split the module by job"
