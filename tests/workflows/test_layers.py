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

# The house: the programs (worker.py, starter.py and the CLI it runs, tether/cli/, the inbox,
# examples/) over the worker's side (activities/ with the plugin that registers them, and
# tether.repair), that over the client library, the client over the libraries by subsystem
# (tether/policy, audit, tools, planners, ..., the face `tether` among them), the store and the
# deterministic workflow code at the ground. docs/architecture.md draws it a room a line, each on
# its floor ("Where things live"); the tests below hold the drawing to the imports and check each
# house rule.
HOUSE = ("worker.py", "starter.py", "tether", "activities", "examples")
# The policy modules, in the order they import one another (each imports only those before it):
# Cedar's words, its export of the TOML rules, its engine and its checks (tether.policy.cedar, which
# the rest import); the policy file read, checked and kept in force (it loads the Cedar files it
# names); signatures; the judgement log and what-if; the activities that judge and attest.
POLICY_MODULES = ("tether.policy.cedar_text", "tether.policy.cedar_export", "tether.policy.cedar_engine", "tether.policy.cedar",
                  "tether.policy.files", "tether.policy.signatures", "tether.policy.judgements", "activities.policy_checks")
# Files split along their jobs, each family in the same order (each imports only those before it):
# what the others use first, the module the programs import last (imported by none of the others).
SPLIT_MODULES = {
    # the fleet-signature checks; the sinks; the collector of a run's end records; the activities
    "audit": ("tether.audit.verify", "tether.audit.sink", "tether.audit.collector", "activities.audit"),
    # the config file; a server's session and listing; a call; the catalog; the `tools` listing
    "mcp": ("tether.tools.mcp_config", "tether.tools.mcp_session", "tether.tools.mcp_call", "tether.tools.mcp_catalog",
            "tether.tools.mcp"),
    # the database; a request's model and the state; the routes; the HTTP server
    "billing": ("examples.billing.db", "examples.billing.model", "examples.billing.routes", "examples.billing.service"),
}


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
    after them; the activities (activities/policy_checks.py) are imported by none of them."""
    graph = house_imports()
    backward = sorted(f"{m} imports {d}" for i, m in enumerate(POLICY_MODULES) for d in graph[m]
                      if d in POLICY_MODULES[i:])
    assert not backward, backward
    assert "tether.policy.cedar" in graph["tether.policy.files"]  # it loads the Cedar files a policy file names


def test_the_split_modules_import_one_way() -> None:
    """Each family of SPLIT_MODULES imports only backward, and every module of it is in the house."""
    graph = house_imports()
    for family, modules in SPLIT_MODULES.items():
        assert set(modules) <= set(graph), f"{family}: not in the house: {sorted(set(modules) - set(graph))}"
        backward = sorted(f"{m} imports {d}" for i, m in enumerate(modules) for d in graph[m] if d in modules[i:])
        assert not backward, f"{family}: {backward}"


def test_what_the_house_imports_from_a_split_module_is_there() -> None:
    """Every name the house, the tests and the benchmarks take from a module of SPLIT_MODULES
    (``from m import n``, or ``m.n`` after ``from package import m``), at the top or inside a
    function (a CLI command's import runs only when the command does), is found in it: a move
    that left an importer behind fails here, not in front of a user."""
    import importlib

    split = {m for modules in SPLIT_MODULES.values() for m in modules}
    files = [ROOT / p for p in HOUSE if p.endswith(".py")]
    files += [f for folder in (*[p for p in HOUSE if not p.endswith(".py")], "tests", "bench")
              for f in sorted((ROOT / folder).rglob("*.py")) if "histories" not in f.parts]
    missing = []
    for path in files:
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}  # a name bound to a split module in this file -> the module
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                for a in n.names:
                    if f"{n.module}.{a.name}" in split:
                        aliases[a.asname or a.name] = f"{n.module}.{a.name}"
                    elif n.module in split and not hasattr(importlib.import_module(n.module), a.name):
                        missing.append(f"{path.relative_to(ROOT)}:{n.lineno}: {n.module}.{a.name}")
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
                    and not hasattr(importlib.import_module(aliases[n.value.id]), n.attr)):
                missing.append(f"{path.relative_to(ROOT)}:{n.lineno}: {aliases[n.value.id]}.{n.attr}")
    assert not missing, missing


def test_the_cedar_modules_stay_under_600_lines() -> None:
    """tether/policy/cedar.py was split along its jobs (words, export, engine, checks): each stays
    small enough to read whole."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in sorted((ROOT / "tether/policy").glob("cedar*.py"))}
    assert set(sizes) >= {"cedar.py", "cedar_text.py", "cedar_export.py", "cedar_engine.py"}, sizes
    assert all(n < 600 for n in sizes.values()), sizes


# ----------------------------------------------------------------------------- tether.client

CLIENT = ROOT / "tether/client"


def client_layers() -> list[str]:
    """The modules of tether.client top down, as its face (__init__.py) imports them: each
    imports only the modules after it in this list (the face lists them bottom first)."""
    face = ast.parse((CLIENT / "__init__.py").read_text())
    order = [n.module.split(".")[2] for n in face.body if isinstance(n, ast.ImportFrom)
             and n.module and n.module.startswith("tether.client.")]
    return [f"tether.client.{m}" for m in reversed(order)]


def client_upward(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    """The imports that go up (or sideways to the face): ``layers`` is top down."""
    rank = {m: i for i, m in enumerate(layers)}
    return sorted(f"{m} imports {d}" for m in layers for d in graph.get(m, ())
                  if d == "tether.client" or (d in rank and rank[d] <= rank[m]))


def test_the_client_modules_import_one_way() -> None:
    """Every module of tether.client is in its face, in the order it is imported there, and
    imports only the modules below it: never one above, nor the face (a circle Python would
    half-load)."""
    layers = client_layers()
    assert len(layers) == len(set(layers)), "the face imports a module twice: it is the layers' order"
    on_disk = {f"tether.client.{p.stem}" for p in CLIENT.glob("*.py") if p.stem != "__init__"}
    assert set(layers) == on_disk, f"modules the face does not import (or imports but are gone): {on_disk ^ set(layers)}"
    assert client_upward(house_imports(), layers) == []


def test_an_upward_client_import_is_found() -> None:
    """The check itself, on the real graph with one edge added each way."""
    graph, layers = house_imports(), client_layers()
    low, high = layers[-1], layers[0]
    assert client_upward({**graph, low: graph[low] | {high}}, layers) == [f"{low} imports {high}"]
    assert client_upward({**graph, high: graph[high] | {"tether.client"}}, layers) == [f"{high} imports tether.client"]
    assert client_upward({**graph, high: graph[high] | {high}}, layers) == [f"{high} imports {high}"]
def test_only_programs_import_the_cli() -> None:
    """tether/cli/ is the `tether` command: starter.py runs it and the demo takes its hints' script
    path from it; the library (tether, activities, workflows) and the inbox never import it."""
    graph = house_imports()
    def cli(module: str) -> bool:
        return module == "tether.cli" or module.startswith("tether.cli.")

    users = sorted({m for m, deps in graph.items() if not cli(m) for d in deps if cli(d)})
    assert users == ["examples.demo", "starter"], users
    assert "tether.client" in graph["tether.cli.base"]  # the one module of the CLI that names the client
    assert not [m for m, deps in graph.items() if cli(m) and m != "tether.cli.base" and "tether.client" in deps]


# ----------------------------------------------------------------------------- the house drawn

HOUSE_ROW = re.compile(r"^(?P<floor>[a-z ]*?)\s*\|\s*(?P<room>[a-z_.]+)\s*->\s*(?P<deps>.*)$")
# The worker's side: what only a worker runs (its activities and the plugin that registers them,
# activities/plugin.py; the program).
WORKER_SIDE = ("activities", "worker")
# A replay and a reset of a run on this build's workflow code: the worker's power. The CLI runs
# it (`tether repair`) and hands a forced hand-off's reset to the client; the client and the
# inbox never import it.
WORKER_POWER = ("tether.repair",)
CLIENT_SIDE = ("tether.client", "tether.cli", "tether.inbox")


def room_of(module: str) -> str:
    """A module's room in docs/architecture.md's drawing of the house: a top-level folder or
    program, a package of `tether` (tether.policy, tether.client, ...), or one of its own modules."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "tether" and len(parts) > 1 else parts[0]


def in_room(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


def house_drawn() -> tuple[list[str], dict[str, str], dict[str, set[str]]]:
    """The floors top down, each room's floor, and the rooms it imports, as the doc draws them."""
    text = (ROOT / "docs/architecture.md").read_text()
    block = re.search(r"<!-- house -->\n```text\n(.*?)\n```", text, re.S)
    assert block, "docs/architecture.md has no drawing of the house (<!-- house --> and a text block)"
    floors: list[str] = []
    floor_of: dict[str, str] = {}
    deps: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        row = HOUSE_ROW.match(line)
        assert row, f"not a row of the house: {line!r}"
        if row["floor"].strip():
            floors.append(row["floor"].strip())
        assert floors, "the drawing's first row names its floor"
        floor_of[row["room"]] = floors[-1]
        deps[row["room"]] = set() if row["deps"].strip() == "(nothing)" else set(row["deps"].split())
    return floors, floor_of, deps


def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen a room at a time."""
    actual: dict[str, set[str]] = {}
    for module, deps in graph.items():
        room = actual.setdefault(room_of(module), set())
        room |= {room_of(d) for d in deps} - {room_of(module)}
    return actual


def workflows_imports() -> dict[str, set[str]]:
    """What each module of workflows/ imports of the rest of the house (top-level names)."""
    house = {"activities", "tether", "worker", "starter", "examples", "tests", "bench"}
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "workflows").rglob("*.py")):
        names: set[str] = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                names.add(n.module.split(".")[0])
            elif isinstance(n, ast.Import):
                names |= {a.name.split(".")[0] for a in n.names}
        found[path.stem] = names & house
    return found


def back_up(graph: dict[str, set[str]], floor_of: dict[str, str], floors: list[str]) -> list[str]:
    """Imports from a room to a room on a higher floor (floors top down)."""
    rank = {f: i for i, f in enumerate(floors)}
    return sorted(f"{r} ({floor_of[r]}) imports {d} ({floor_of[d]})" for r, ds in rooms(graph).items() for d in ds
                  if rank[floor_of[d]] < rank[floor_of[r]])


def worker_reached(graph: dict[str, set[str]]) -> list[str]:
    """Imports by the client, the CLI or the inbox of the worker's side; by the client or the inbox
    of the worker's power (a replay, a reset)."""
    reach = []
    for module, deps in graph.items():
        if not in_room(module, CLIENT_SIDE):
            continue
        forbidden = WORKER_SIDE if in_room(module, ("tether.cli",)) else WORKER_SIDE + WORKER_POWER
        reach += [f"{module} imports {d}" for d in deps if in_room(d, forbidden)]
    return sorted(reach)


def test_the_house_drawing_is_the_imports() -> None:
    """docs/architecture.md draws the whole house, a room a line: the drawing is the imports."""
    _, _, drawn = house_drawn()
    actual = rooms(house_imports())
    assert drawn == actual, {r: (sorted(drawn.get(r, ())), sorted(actual.get(r, ()))) for r in {*drawn, *actual}
                             if drawn.get(r) != actual.get(r)}


def test_nothing_runs_back_up() -> None:
    """Each room imports only rooms on its own floor or below: the programs over the worker's side
    (the activities and their plugin, the repair), that over the client, the client over the
    libraries (the face among them), the store and workflows/ at the ground."""
    floors, floor_of, _ = house_drawn()
    assert back_up(house_imports(), floor_of, floors) == []


def test_no_circle_of_modules_or_rooms() -> None:
    graph = house_imports()
    assert circles(graph) == [], "import circles between modules"
    assert circles(rooms(graph)) == [], "import circles between rooms"


def test_the_client_the_cli_and_the_inbox_never_reach_the_worker_side() -> None:
    """tether.client, tether.cli and tether.inbox import nothing of activities/ (the worker's
    configuration, activities/plugin.py, included) or worker.py; the client and the inbox not the repair either: a
    forced hand-off's reset is handed to the client by the CLI (tether.repair.HandoffReset)."""
    graph = house_imports()
    assert worker_reached(graph) == []
    assert "tether.repair" in graph["tether.cli.operations"]  # the CLI hands the reset in


def test_workflows_imports_nothing_of_the_rest() -> None:
    found = workflows_imports()
    assert found and {m: sorted(names) for m, names in found.items() if names} == {}


def test_activities_holds_only_the_activities() -> None:
    """Every module of activities/ defines an activity the worker registers (a method under
    ``@activity.defn``), but plugin.py, the plugin that registers them (TetherPlugin: the
    anchors' plugins live beside their activities too); the libraries live in tether/."""
    lacking = []
    for path in sorted((ROOT / "activities").rglob("*.py")):
        if path.name in ("__init__.py", "plugin.py"):
            continue
        tree = ast.parse(path.read_text())
        defined = [d for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for d in n.decorator_list if "activity.defn" in ast.unparse(d)]
        if not defined:
            lacking.append(path.relative_to(ROOT).as_posix())
    assert lacking == [], lacking
    assert not [p for p in (ROOT / "activities").iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_the_house_rules_catch_a_breach() -> None:
    """The checks themselves, on the real graph with one edge added each: a circle, an import back
    up, the client or the inbox reaching the worker's side or its power, workflows/ importing."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []
    graph = house_imports()
    floors, floor_of, _ = house_drawn()
    assert "tether.replay" in graph["tether.repair"]  # imported where a repair replays, not at the top
    assert circles({**graph, "activities.plugin": graph["activities.plugin"] | {"worker"}})  # worker -> activities.plugin
    assert back_up({**graph, "tether.store.keys": graph["tether.store.keys"] | {"tether.inbox.desk"}}, floor_of, floors) == [
        "tether.store (ground) imports tether.inbox (programs)"]
    for module, dep in (("tether.client.sink", "activities.recovery"), ("tether.client.decisions", "tether.repair"),
                        ("tether.inbox.app", "activities.plugin"), ("tether.cli.runs", "worker")):
        assert worker_reached({**graph, module: graph[module] | {dep}}) == [f"{module} imports {dep}"]
    assert worker_reached({**graph, "tether.cli.runs": graph["tether.cli.runs"] | {"tether.repair"}}) == []
