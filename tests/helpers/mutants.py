"""Mutants of the workflow code: one non-deterministic line put first in move's body, for the
tests that the guard and the replay catch each."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# Module-level names a mutant's line uses, and the import that binds them when the module that
# holds ``move`` does not (appended at the end of the module: no line before it moves, and a
# module-level binding counts wherever it is written).
IMPORTS = {"datetime": "from datetime import datetime", "workflow": "from temporalio import workflow"}


@dataclass(frozen=True)
class Mutant:
    name: str
    line: str  # one physical line, put first in move's body
    rule: str  # what the guard must say about that line
    needs: tuple[str, ...] = ()


def find_move(root: Path) -> tuple[Path, ast.FunctionDef | ast.AsyncFunctionDef, str]:
    """The ``move`` of class Engine under root/workflows; else of a class Engine derives from (a
    phase split into mixins); else of any class (the run model's). Returns its module, the
    function and the class that defines it."""
    found = []
    engine_bases: set[str] = set()
    for path in sorted((root / "workflows").rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(cls, ast.ClassDef):
                if cls.name == "Engine":
                    engine_bases |= {b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))}
                for fn in cls.body:
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == "move":
                        found.append((str(path), path, fn, cls.name))
    assert found, f"no class under {root / 'workflows'} defines move(): the mutants have nowhere to go"
    rank = {"Engine": 0, **{b: 1 for b in engine_bases}}
    _, path, fn, owner = min(found, key=lambda f: (rank.get(f[3], 2), f[0]))
    return path, fn, owner


def module_binds(tree: ast.Module, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


def inject(root: Path, mutant: Mutant) -> tuple[Path, int]:
    """Put the mutant's line first in move's body (after its docstring); return the module and
    the mutant's 1-based line number."""
    path, fn, _ = find_move(root)
    body = fn.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)
    if docstring and len(body) == 1:
        index, indent = body[0].end_lineno, body[0].col_offset
    else:
        first = body[1] if docstring else body[0]
        index, indent = first.lineno - 1, first.col_offset
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    lines.insert(index, " " * indent + mutant.line + "\n")
    tail = [IMPORTS[n] + "\n" for n in mutant.needs if not module_binds(tree, n)]
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    path.write_text("".join(lines + tail))
    ast.parse(path.read_text())  # the mutant is valid Python: a syntax error would be no test
    return path, index + 1
