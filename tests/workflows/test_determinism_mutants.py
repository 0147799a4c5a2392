"""Issue 33: one-line mutants of ``move`` that are non-deterministic across worker processes
(hash seeds, addresses) or between a run and its replay must be caught before they ship.

The worker passes ``workflows/`` through the sandbox (worker.WORKFLOW_RUNNER), so in production
nothing re-checks that code per run: tests/helpers/determinism_lint.py is the guard, and it must see
these by what a name is bound to, not by the name written. Each mutant is injected into a copy
of the whole ``workflows/`` package, into the body of the ``move`` that records a run's state
changes, found by AST wherever it lives (engine.py is being split into phases: the test follows
``def move(`` of class ``Engine``, else of the run model, in any module under workflows/). The
guard must name the mutant's line; the unmutated copy must be clean, so a finding is the mutant's.

A second, slower layer (tests/helpers/determinism_replay.py: recorded histories replayed with the
sandbox's checks on, under several PYTHONHASHSEED values) is shown to catch a mutant too.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.determinism_lint import ROOT, check_tree
from tests.helpers.mutants import IMPORTS, Mutant, find_move, inject, module_binds

MUTANTS = [
    # 1. A set of strings iterates in an order that depends on PYTHONHASHSEED: three worker
    # processes yielded approver / approver / finance first (issue 33). Three spellings: a set
    # display, set() of a list, and a set reached through a name.
    Mutant("set-display-for", 'for _who in {"approver", "finance"}: _first = _who', "order of a set"),
    Mutant("list-of-set", '_order = list(set(["approver", "finance"]))', "order of a set"),
    Mutant("set-bound-to-a-name", '_roles = {"approver", "finance"}; _first = next(iter(_roles))', "order of a set"),
    # 2. str.__hash__ is salted per process.
    Mutant("dunder-hash", '_h = "approver".__hash__()', "__hash__"),
    # 3. hash() through an alias: the call site never says "hash(".
    Mutant("hash-alias", 'h = hash; _h = h("approver")', "calls h(), which is hash()"),
    # 4. object()'s repr is its address.
    Mutant("repr-object", "_tag = repr(object())", "object()"),
    # 5. id() as a sort key, never called by name.
    Mutant("sorted-key-id", '_order = sorted(["approver", "finance"], key=id)', "uses id "),
    # 6. A local named workflow that is datetime: .now() on it is the wall clock.
    Mutant("workflow-is-datetime", "workflow = datetime; _at = workflow.now()", "wall clock", ("datetime",)),
    # 7. The clock reached through the module's namespace, no attribute named now.
    Mutant("vars-datetime", '_at = vars(datetime)["now"]()', "calls vars()", ("datetime",)),
    # 8. Replay takes another branch than the run did.
    Mutant("is-replaying", "if workflow.unsafe.is_replaying(): return", "is_replaying", ("workflow",)),
]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the workflows package (sources only) to mutate."""
    shutil.copytree(ROOT / "workflows", tmp_path / "workflows", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_real_tree_and_its_copy_are_clean(tree: Path) -> None:
    # Zero false positives: every finding on a mutant is the mutant's, not the tree's.
    assert check_tree(ROOT) == []
    assert check_tree(tree) == []


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_guard_names_the_mutant_line(tree: Path, mutant: Mutant) -> None:
    path, line = inject(tree, mutant)
    problems = check_tree(tree)
    where = f"{path.relative_to(tree)}:{line}: "
    assert problems, f"{mutant.name} passes the determinism lint"
    # Every finding is on the mutant's line (the copy was clean), and one says what is wrong.
    assert all(p.startswith(where) for p in problems), problems
    assert any(mutant.rule in p for p in problems), problems


def test_the_lint_command_fails_on_a_mutated_tree(tree: Path) -> None:
    # As CI runs it: exit 1, naming file and line (exit 0 on the checkout: tests/workflows/test_determinism.py).
    path, line = inject(tree, MUTANTS[0])
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.determinism_lint", "--root", str(tree)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"{path.relative_to(tree)}:{line}: " in proc.stdout, proc.stdout + proc.stderr


def test_the_sandboxed_replay_catches_a_clock_mutant(tree: Path) -> None:
    """The second layer is really on: with the workflows package re-imported in a default
    sandbox (not passed through), a recorded history replayed on mutant 6 fails on the
    restricted datetime.now, though the lint's old name check let it through. It also shows the
    injection point is code every run executes (a move() nothing calls would replay clean)."""
    from tests.helpers.determinism_replay import HISTORIES, replay

    inject(tree, next(m for m in MUTANTS if m.name == "workflow-is-datetime"))
    approve = next(h for h in HISTORIES if h.stem == "approve")
    results = replay(tree, [approve], seeds=[0])
    failure = results[0][approve.name]["failure"]
    assert failure is not None and "datetime.datetime.now" in failure, failure


# More spellings of the same hazards, each in a nested function of its own (so one's bindings
# cannot explain another's finding), all in one copy: one lint run for all of them. The guard
# must name every line of SPELLINGS and none of CLEAN (a deterministic use the old name check
# also allowed, or one that only looks like a hazard).
SPELLINGS = [
    'import datetime as workflow; _at = workflow.datetime.now()',  # the module imported under the API's name
    'u = workflow.unsafe; _r = u.is_replaying()',
    '_r = getattr(workflow.unsafe, "is_replaying")()',
    '_k = sorted(["a", "b"], key=hash)',
    '_h = type("a").__hash__("a")',
    '_v = globals()["datetime"].now()',
    '_f = lambda: hash("a")',
    '_l = [h("a") for h in [hash]]',
    '_s = ", ".join({"a", "b"})',
    '_s = f"{ {chr(97), chr(98)} }"',
    '_s = str(frozenset(["a", "b"]))',
    '_x = {"a", "b"}.pop()',
    '_x, _y = {"a", "b"}',
    '_l = [*{"a", "b"}]',
    '_d = dict.fromkeys({"a", "b"})',
    '_roles = set(["a"]) | {"b"}; _l = [r for r in _roles]',
    '_l = list({k: 1 for k in {"a", "b"}})',
    'import workflows.states as st; _l = list(st.TERMINAL)',  # a set that is another module's constant
    '_o = object()',
    '_t = f"{self}"',  # the engine has no __repr__: object's, an address
    '_t = "%s" % (self,)',
]
CLEAN = [
    'wf = workflow; _at = wf.now()',  # an alias of the workflow API is the workflow API
    'id = len; _n = id("ab")',  # a local named id is not the builtin
    '_l = sorted({"b", "a"})',
    '_ok = "a" in {"a", "b"} and len({"a"}) == 1 and min({"a", "b"}) == "a"',
    '_s = frozenset(x.upper() for x in {"a", "b"})',
    '_n = getattr(self, "rule", None)',
    '_t = type(self).__name__',
]


def test_more_spellings_are_caught_and_deterministic_code_is_not(tree: Path) -> None:
    path, fn, _ = find_move(tree)
    body = fn.body
    first = body[1] if len(body) > 1 and isinstance(body[0], ast.Expr) else body[0]
    lines = path.read_text().splitlines(keepends=True)
    indent = " " * first.col_offset
    block = [f"{indent}def _spelling_{i}(): {line}\n" for i, line in enumerate(SPELLINGS)]
    block += [f"{indent}def _clean_{i}(): {line}\n" for i, line in enumerate(CLEAN)]
    lines[first.lineno - 1:first.lineno - 1] = block
    source = "".join(lines)
    if not module_binds(ast.parse(source), "workflow"):
        source += IMPORTS["workflow"] + "\n"
    path.write_text(source)
    problems = check_tree(tree)
    rel = path.relative_to(tree)
    named = {int(p.split(":")[1]) for p in problems if p.startswith(f"{rel}:")}
    spelled = {first.lineno + i: line for i, line in enumerate(SPELLINGS)}
    clean = {first.lineno + len(SPELLINGS) + i: line for i, line in enumerate(CLEAN)}
    assert not {n: line for n, line in spelled.items() if n not in named}, "not caught"
    assert not {n: line for n, line in clean.items() if n in named}, [p for p in problems if int(p.split(":")[1]) in clean]
    assert named <= set(spelled), problems
