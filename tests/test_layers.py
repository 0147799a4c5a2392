"""docs/architecture.md ("Where things live") draws the layers of workflows/: every module, its
layer, and the workflows/ modules it imports. The drawing is the imports: a module imports only
from its own layer or below, and nothing imports in a cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs/architecture.md"
ROW = re.compile(r"^(?P<layer>[a-z ]*?)\s*\|\s*(?P<module>\w+)\s*->\s*(?P<deps>.*)$")


def drawn() -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    """The layers top down, each module's layer, and its imports, as the doc draws them."""
    block = re.search(r"<!-- layers -->\n```text\n(.*?)\n```", DOC.read_text(), re.S)
    assert block, "docs/architecture.md has no layers diagram (<!-- layers --> and a text block)"
    layers: list[str] = []
    layer_of: dict[str, str] = {}
    deps: dict[str, list[str]] = {}
    for line in block.group(1).splitlines():
        row = ROW.match(line)
        assert row, f"not a row of the diagram: {line!r}"
        if row["layer"].strip():
            layers.append(row["layer"].strip())
        assert layers, "the diagram's first row names its layer"
        layer_of[row["module"]] = layers[-1]
        deps[row["module"]] = [] if row["deps"].strip() == "(nothing)" else row["deps"].split()
    return layers, layer_of, deps


def imports() -> dict[str, list[str]]:
    """What each module of workflows/ imports from workflows/."""
    graph = {}
    for path in sorted((ROOT / "workflows").glob("*.py")):
        if path.stem == "__init__":
            continue
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("workflows."):
                    found.add(node.module.split(".")[1])
                elif node.module == "workflows":
                    found |= {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("workflows.")}
        graph[path.stem] = sorted(found - {path.stem})
    return graph


def test_the_diagram_is_the_imports() -> None:
    _, _, deps = drawn()
    actual = imports()
    assert sorted(deps) == sorted(actual), "modules drawn but not in workflows/, or the other way round"
    wrong = {m: (sorted(deps[m]), actual[m]) for m in actual if sorted(deps[m]) != actual[m]}
    assert not wrong, f"drawn imports differ from the code's (drawn, actual): {wrong}"


def test_a_module_imports_only_from_its_layer_or_below() -> None:
    layers, layer_of, deps = drawn()
    rank = {layer: i for i, layer in enumerate(layers)}  # 0: the top
    upward = [f"{m} ({layer_of[m]}) imports {d} ({layer_of[d]})" for m, ds in deps.items() for d in ds
              if rank[layer_of[d]] < rank[layer_of[m]]]
    assert not upward, upward


def test_nothing_imports_in_a_cycle() -> None:
    graph = imports()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for dep in graph[module]:
            visit(dep, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
