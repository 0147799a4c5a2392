"""docs/architecture.md ("Where things live") draws the layers of workflows/: every module, its
layer, and the workflows/ modules it imports. The drawing is the imports: a module imports only
from its own layer or below, and nothing imports in a cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


# ----------------------------------------------------------------------------- the whole house

# The programs (client.py, worker.py, starter.py, inbox/, examples/) import `tether`, which imports
# `activities`, which imports `workflows`: never the other way round, and nothing in a circle.
HOUSE = ("client.py", "worker.py", "starter.py", "tether", "activities", "inbox", "examples")
PROGRAMS = {"client", "worker", "starter", "inbox", "examples"}
# The policy modules, in the order they import one another (each imports only those before it):
# Cedar the engine; the policy file read, checked and kept in force (it loads the Cedar files it
# names); signatures; the judgement log and what-if; the activities that judge and attest.
POLICY_MODULES = ("activities.cedar", "activities.policy_file", "activities.signatures", "activities.judgements",
                  "activities.policy")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def house_imports() -> dict[str, set[str]]:
    """Each module of the house (workflows/ as one), and the modules of the house it imports,
    at its top or inside a function alike: an import deferred to first use is still an edge."""
    paths = [ROOT / p for p in HOUSE if p.endswith(".py")]
    paths += [p for folder in HOUSE if not folder.endswith(".py") for p in sorted((ROOT / folder).rglob("*.py"))]
    modules = {_module_name(p): p for p in paths}

    def node(name: str) -> str | None:
        if name == "workflows" or name.startswith("workflows."):
            return "workflows"
        parts = name.split(".")
        return next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules), None)

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        found: set[str | None] = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                found |= {node(f"{n.module}.{a.name}") or node(n.module) for a in n.names}
            elif isinstance(n, ast.Import):
                found |= {node(a.name) for a in n.names}
        graph[module] = {m for m in found if m is not None and m != module}
    graph["workflows"] = set()  # its own layers: the diagram above
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_house_has_no_import_circle() -> None:
    assert circles(house_imports()) == [], "import circles"


def test_the_policy_modules_import_one_way() -> None:
    """Cedar imports none of the policy modules; the policy file, signatures and judgements none
    after them; the activities (activities/policy.py) are imported by none of them."""
    graph = house_imports()
    backward = sorted(f"{m} imports {d}" for i, m in enumerate(POLICY_MODULES) for d in graph[m]
                      if d in POLICY_MODULES[i:])
    assert not backward, backward
    assert "activities.cedar" in graph["activities.policy_file"]  # it loads the Cedar files a policy file names


def test_what_moved_keeps_its_old_import_path() -> None:
    """For one release, `from activities.policy import ...` still finds what moved out of it."""
    import activities.policy as old
    from activities import policy_file, signatures

    moved = {**{n: policy_file for n in ("PolicyStore", "PolicyFileError", "parse_policy", "check_policy_file",
                                         "load_cedar_files", "resolve_key_files", "_locate", "DEFAULT_SOURCE",
                                         "RELOAD_FAILURES")},
             **{n: signatures for n in ("signature_refusal", "verify_signature", "person_signature_refusal",
                                        "decision_signature_refusal")}}
    assert {n: getattr(old, n, None) for n in moved} == {n: getattr(m, n) for n, m in moved.items()}


def test_the_house_imports_only_downward() -> None:
    """workflows imports none of the house; activities nothing above it; tether no program."""
    graph = house_imports()

    def top(module: str) -> str:
        return module.split(".")[0]

    above = {"workflows": {"activities", "tether", *PROGRAMS}, "activities": {"tether", *PROGRAMS}, "tether": PROGRAMS}
    upward = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps if top(d) in above.get(top(m), ()))
    assert not upward, upward


def test_a_circle_is_found() -> None:
    """The check itself: a circle is reported, and an import inside a function is an edge."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []
    graph = house_imports()
    assert "tether.plugin" in graph["tether.repair"]  # imported where a repair replays, not at the top
    assert circles({**graph, "tether.plugin": graph["tether.plugin"] | {"worker"}})  # worker -> tether.plugin
