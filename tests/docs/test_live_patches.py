"""docs/changing-workflows.md lists the live patches exactly as the code has them: every
`workflow.patched` call in workflows/ but the builds' markers, and every `fixed` (a patch this
build's runs have without its marker), by patch id and where it is asked, each with its removal
condition."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/changing-workflows.md"


def patches_in_code() -> set[tuple[str, str, str]]:
    """(patch id, file, Class.function) of every ``workflow.patched(X)`` and ``….fixed(X)`` in
    workflows/, X resolved through the string constants of workflows/ (the builds' markers, BUILD
    and PREVIOUS_BUILD, are not patches; ``Effects.fixed`` itself asks the patch it is given)."""
    files = sorted((ROOT / "workflows").glob("*.py"))
    constants: dict[str, str] = {}
    for path in files:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                constants.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    found: set[tuple[str, str, str]] = set()

    def visit(node: ast.AST, where: list[str], path: Path) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [*where, child.name], path)
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and (
                    child.func.attr == "fixed"
                    or (child.func.attr == "patched" and isinstance(child.func.value, ast.Name) and child.func.value.id == "workflow")):
                [arg] = child.args
                builds = isinstance(arg, ast.Name) and arg.id in ("BUILD", "PREVIOUS_BUILD")
                given = where[-1:] == ["fixed"] and isinstance(arg, ast.Name) and arg.id not in constants
                if not builds and not given:
                    patch = constants[arg.id] if isinstance(arg, ast.Name) else arg.value
                    found.add((patch, str(path.relative_to(ROOT)), ".".join(where)))
            visit(child, where, path)

    for path in files:
        visit(ast.parse(path.read_text()), [], path)
    return found


def patches_in_doc() -> tuple[set[tuple[str, str, str]], dict[str, str]]:
    """The table's rows: (patch id, file, Class.function) for each place it names, and each
    patch's removal condition."""
    block = re.search(r"<!-- live-patches -->\n(.*?)\n<!-- /live-patches -->", DOC.read_text(), re.S)
    assert block, "docs/changing-workflows.md has no <!-- live-patches --> table"
    rows = [line for line in block.group(1).splitlines()[2:] if line.strip()]
    listed: set[tuple[str, str, str]] = set()
    removal: dict[str, str] = {}
    for row in rows:
        patch, asked, _what, remove = [cell.strip() for cell in row.strip().strip("|").split("|")]
        patch = patch.strip("`")
        places = re.findall(r"`(workflows/\w+\.py)` `([\w.]+)`", asked)
        assert places, f"row {patch!r} names no place (`workflows/FILE.py` `Class.function`)"
        listed |= {(patch, file, where) for file, where in places}
        removal[patch] = remove
    return listed, removal


def test_the_live_patches_listed_are_the_codes() -> None:
    code = patches_in_code()
    listed, removal = patches_in_doc()
    assert listed == code, (
        f"docs/changing-workflows.md's live patches differ from the code's: listed only {sorted(listed - code)}, "
        f"in the code only {sorted(code - listed)}"
    )
    assert all(condition for condition in removal.values()), f"a patch without its removal condition: {removal}"


def test_the_code_has_patches_to_list() -> None:
    """The reader finds the calls at all (a parser that found none would pass on an empty table)."""
    assert {patch for patch, _, _ in patches_in_code()} >= {"tether-child-once"}
