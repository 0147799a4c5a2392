"""The suite's own house rule: what tests share lives in tests/helpers/ (one module a job) and
fixtures in conftest.py files, which pytest finds by itself. No module of the suite imports a test
module (``test_*.py``) or a conftest.py: a test module is the tests it holds, never a library, so
moving or deleting a test never breaks another one."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _forbidden(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imports_of_tests(source: str, package: str) -> list[str]:
    """Every import in ``source`` (at any depth, relative ones resolved against ``package``) that
    names a test module or a conftest, as ``line: module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from tests.workflows import test_replay` imports the module by its name.
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if name and _forbidden(name)]
    return found


def test_no_module_of_the_suite_imports_a_test_module_or_a_conftest() -> None:
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        package = ".".join(path.relative_to(TESTS.parent).parent.parts)
        found = imports_of_tests(path.read_text(), package)
        if found:
            offenders[str(path.relative_to(TESTS.parent))] = found
    assert not offenders, (
        "move what they share into tests/helpers/ (fixtures stay in conftest.py, found by pytest): "
        f"{offenders}"
    )


def test_the_rule_sees_every_way_of_importing_one() -> None:
    """The check above is only as good as what it recognises: each spelling is caught."""
    spellings = [
        "from tests.conftest import unique",
        "from conftest import unique",
        "from tests.workflows.test_replay import replayer",
        "from tests.workflows import test_replay",
        "import tests.operations.test_reset",
        "from .test_delegation import delegate",
        "from . import conftest",
        "def f():\n    from tests.e2e.conftest import UiEnv",
    ]
    for source in spellings:
        assert imports_of_tests(source, "tests.workflows"), source
    allowed = "from tests.helpers.runs import unique\nimport tests.helpers.waiting\nfrom tests.chaos.harness import Stack"
    assert imports_of_tests(allowed, "tests.workflows") == []
