"""A static check of every module in ``workflows/``: no wall clock, randomness, environment,
I/O or threads, read from the source (AST), whatever path the code takes at run time.

Why static: ``workflows/agent_run.py`` imports the other workflow modules passed through the
Temporal sandbox (``workflow.unsafe.imports_passed_through``), so the sandbox's own checks never
see a ``datetime.now()`` in ``workflows/engine.py``; and a sandbox check fires only on the path a
test happens to run. Re-importing them inside the sandbox for every run instead costs what
``python -m bench.sandbox_imports`` prints (docs/performance.md has the number);
``--measure`` here times the bare re-import of the modules.

    python -m tests.determinism_lint [FILE...]     # default: workflows/*.py; exit 1 on a problem

The rules (each problem names file, line and rule):

- imports only from :data:`ALLOWED_IMPORTS` (pure standard library, the validated third-party
  libraries, Temporal's workflow API, ``workflows.*``): no ``os``, ``sys``, ``time``, ``random``,
  ``uuid``, ``secrets``, ``threading``, ``socket``, ``subprocess``, ``pathlib``, ``logging``...;
- no ``.now`` / ``.utcnow`` / ``.today`` / ``.fromtimestamp`` except ``workflow.now()``;
- no ``open``, ``input``, ``print``, ``exec``, ``eval``, ``compile``, ``__import__``,
  ``breakpoint``, ``id``, ``hash`` (process-dependent), and ``getattr`` only with a literal name
  that is not one of the above;
- no thread or process escapes from asyncio (``to_thread``, ``run_in_executor``, subprocesses,
  sockets) and no ``workflow.unsafe.sandbox_unrestricted``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ALLOWED_IMPORTS = frozenset({
    "__future__", "asyncio", "collections.abc", "copy", "dataclasses", "datetime", "enum", "functools",
    "hashlib", "json", "math", "typing", "unicodedata",
    "pydantic", "jsonschema", "jsonschema.validators", "re2", "rfc8785", "confusable_homoglyphs",
    "jsonpatch",  # RFC 6902 diffs of a revised plan (workflows/revision.py): pure, json only
    "temporalio", "temporalio.common", "temporalio.exceptions", "temporalio.workflow",
})
CLOCK = frozenset({"now", "utcnow", "today", "fromtimestamp", "utcfromtimestamp", "time_ns", "monotonic", "perf_counter"})
BUILTINS = frozenset({"open", "input", "print", "exec", "eval", "compile", "__import__", "breakpoint", "id", "hash"})
ESCAPES = frozenset({
    "to_thread", "run_in_executor", "create_subprocess_exec", "create_subprocess_shell", "open_connection",
    "start_server", "open_unix_connection", "sandbox_unrestricted", "environ", "getenv", "urandom",
})


def _allowed(module: str) -> bool:
    return module in ALLOWED_IMPORTS or module == "workflows" or module.startswith("workflows.")


def problems_in(source: str, name: str) -> list[str]:
    """Every rule the module's source breaks, as ``name:line: rule``."""
    found: list[str] = []

    def say(node: ast.AST, rule: str) -> None:
        found.append(f"{name}:{getattr(node, 'lineno', 0)}: {rule}")

    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _allowed(alias.name):
                    say(node, f"imports {alias.name} (not pure: wall clock, randomness, environment, I/O or threads)")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and not _allowed(module):
                say(node, f"imports from {module} (not pure: wall clock, randomness, environment, I/O or threads)")
            for alias in node.names:
                if alias.name in CLOCK | ESCAPES:
                    say(node, f"imports {alias.name} from {module}")
        elif isinstance(node, ast.Attribute):
            receiver = node.value.id if isinstance(node.value, ast.Name) else None
            if node.attr in CLOCK and receiver != "workflow":
                say(node, f"reads the wall clock (.{node.attr}): use workflow.now()")
            elif node.attr in ESCAPES:
                say(node, f"leaves the workflow (.{node.attr})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in BUILTINS:
                say(node, f"calls {node.func.id}() (I/O or process-dependent)")
            elif node.func.id == "getattr":
                attr = node.args[1] if len(node.args) > 1 else None
                if not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)):
                    say(node, "getattr with a computed name (could reach anything)")
                elif attr.value in CLOCK | ESCAPES | BUILTINS:
                    say(node, f"getattr(..., {attr.value!r})")
        elif isinstance(node, ast.Name) and node.id in {"__builtins__", "__import__"}:
            say(node, f"uses {node.id}")
    return found


def workflow_modules() -> list[Path]:
    return sorted((ROOT / "workflows").glob("*.py"))


def check(paths: Iterable[Path]) -> list[str]:
    return [p for path in paths for p in problems_in(path.read_text(), str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))]


def measure(rounds: int = 20) -> str:
    """What re-importing the workflow modules inside the sandbox would cost per run: the time
    to import ``workflows.agent_run`` and everything under it in a fresh module namespace, with
    pydantic, jsonschema and the other libraries already loaded (passed through, as the sandbox
    would keep them)."""
    import importlib
    import statistics
    import time

    import workflows.agent_run  # noqa: F401  (warm: third-party modules and bytecode loaded)

    mine = sorted(m for m in sys.modules if m == "workflows" or m.startswith("workflows."))
    saved = {m: sys.modules[m] for m in mine}
    times = []
    try:
        for _ in range(rounds):
            for m in mine:
                sys.modules.pop(m, None)
            started = time.perf_counter()
            importlib.import_module("workflows.agent_run")
            times.append(time.perf_counter() - started)
    finally:
        sys.modules.update(saved)
    return (f"re-importing {len(mine)} workflow modules: median {statistics.median(times) * 1000:.1f} ms, "
            f"min {min(times) * 1000:.1f} ms per run ({rounds} rounds)")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--measure"]:
        print(measure())
        sys.exit(0)
    problems = check([Path(a).resolve() for a in args] or workflow_modules())
    print("\n".join(problems) or "workflows/: no wall clock, randomness, environment, I/O or threads")
    sys.exit(1 if problems else 0)
