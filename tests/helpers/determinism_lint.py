"""A static check of every module in ``workflows/``: no wall clock, randomness, environment,
I/O or threads, read from the source (AST), whatever path the code takes at run time.

Why static: ``workflows/agent_run.py`` imports the other workflow modules passed through the
Temporal sandbox (``workflow.unsafe.imports_passed_through``), so the sandbox's own checks never
see a ``datetime.now()`` in ``workflows/engine.py``; and a sandbox check fires only on the path a
test happens to run. Re-importing them inside the sandbox for every run instead costs what
``python -m bench.sandbox_imports`` prints (docs/performance.md has the number);
``--measure`` here times the bare re-import of the modules.

    python -m tests.helpers.determinism_lint [FILE...]     # default: workflows/**/*.py; exit 1 on a problem
    python -m tests.helpers.determinism_lint --root DIR    # DIR/workflows/ (a copy with a mutant)

Names are checked by what they are bound to, not by how they are spelled (issue 33): every scope's
bindings are collected with Python's rules, so ``h = hash; h(x)`` is a call of hash,
``workflow = datetime; workflow.now()`` is the wall clock, and a parameter named ``id`` is not the
builtin. The rules (each problem names file, line and rule):

- imports only from :data:`ALLOWED_IMPORTS` (pure standard library, the validated third-party
  libraries, Temporal's workflow API, ``workflows.*``): no ``os``, ``sys``, ``time``, ``random``,
  ``uuid``, ``secrets``, ``threading``, ``socket``, ``subprocess``, ``pathlib``, ``logging``...;
- no ``.now`` / ``.utcnow`` / ``.today`` / ``.fromtimestamp``... except on what is bound to
  ``temporalio.workflow``;
- the builtins ``open``, ``input``, ``print``, ``exec``, ``eval``, ``compile``, ``__import__``,
  ``breakpoint``, ``id``, ``hash`` (process-dependent) and ``vars``, ``globals``, ``locals``
  (a namespace reaches past these rules) are neither called nor used, whatever name they are
  reached by (an alias, ``key=id``); ``object()`` is not called (its repr and hash are its
  address); ``getattr`` only called by name with a literal name that is not one of these;
- no text made of an object whose repr is its address (``object()``, an instance of a plain class
  of the module with no ``__repr__`` / ``__str__``, ``self`` in one): ``f"{self}"`` in the Engine;
- no dunder attribute beyond plain ones like ``__name__`` (``__hash__``, ``__dict__``,
  ``__globals__``...);
- no ``workflow.unsafe`` beyond ``imports_passed_through``: no ``is_replaying()`` (replay would
  take another path than the run);
- no set whose order reaches the run: a set (display, ``set()`` / ``frozenset()``, set
  operations, a name, parameter, module constant or field bound or annotated to one, a mapping to
  sets, a dict comprehension over one) is not iterated by ``for`` or a list / generator
  comprehension, nor given to ``list``, ``tuple``, ``iter``, ``next``, ``enumerate``, ``zip``,
  ``dict``, ``str``, ``.join``..., unpacked or formatted, nor ``.pop()``-ed. ``sorted``, ``min``,
  ``max``, ``len``, ``any``, ``all``, ``in`` and set operations are fine. A set's order follows
  ``PYTHONHASHSEED`` for str, Enum and tuple members: three worker processes differ;
- no thread or process escapes from asyncio (``to_thread``, ``run_in_executor``, subprocesses,
  sockets) and no ``workflow.unsafe.sandbox_unrestricted``.

What this cannot see (values flowing through calls into code it does not read, a class without
``__repr__`` formatted as text) the recorded histories replayed under several hash seeds with the
sandbox's checks on catch instead (tests/helpers/determinism_replay.py).
"""

from __future__ import annotations

import ast
import builtins
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ALLOWED_IMPORTS = frozenset({
    "__future__", "asyncio", "collections.abc", "copy", "dataclasses", "datetime", "enum", "functools",
    "hashlib", "json", "math", "typing", "unicodedata",
    "hmac",  # MACs by the fleet key computed in workflow code (issue 33): pure, bytes in and out
    "zlib",  # what a run sends for itself alone, packed (states.pack_json): pure, bytes in and out
    "base64",  # the records a write takes along (effects.Effects.tool): pure, bytes in and out
    "contextlib",  # contextmanager; its process-wide helpers (chdir, redirect_*) are ESCAPES
    "pydantic", "jsonschema", "jsonschema.validators", "re2", "rfc8785", "confusable_homoglyphs",
    "jsonpatch",  # RFC 6902 diffs of a revised plan (workflows/revision.py): pure, json only
    "temporalio", "temporalio.common", "temporalio.exceptions", "temporalio.workflow",
})
CLOCK = frozenset({"now", "utcnow", "today", "fromtimestamp", "utcfromtimestamp", "time_ns", "monotonic", "perf_counter"})
BUILTINS = frozenset({"open", "input", "print", "exec", "eval", "compile", "__import__", "breakpoint", "id", "hash"})
ESCAPES = frozenset({
    "to_thread", "run_in_executor", "create_subprocess_exec", "create_subprocess_shell", "open_connection",
    "start_server", "open_unix_connection", "sandbox_unrestricted", "environ", "getenv", "urandom",
    "chdir", "redirect_stdout", "redirect_stderr",
})


def _allowed(module: str) -> bool:
    return module in ALLOWED_IMPORTS or module == "workflows" or module.startswith("workflows.")


# ---------------------------------------------------------------- bindings
#
# A name is checked by what it is bound to, not by how it is spelled: ``h = hash`` makes ``h`` the
# builtin hash, ``workflow = datetime`` makes ``workflow.now()`` the wall clock, a parameter named
# ``id`` is not the builtin. Each scope (module, function, lambda, class body, comprehension) lists
# every binding of each name it holds, with Python's rules: a name bound anywhere in a function is
# local to all of it, class bodies are not seen from functions inside them, ``global`` binds in
# the module. A name is what ANY of its bindings may make it (flow-insensitive, so a rebinding
# further down cannot hide one).

_SETS = frozenset({"set", "frozenset", "Set", "FrozenSet", "AbstractSet", "MutableSet"})
_SET_METHODS = frozenset({"union", "intersection", "difference", "symmetric_difference", "copy"})
# A dict built by a comprehension over a set is ordered by the set: its views are unordered too.
_VIEW_METHODS = frozenset({"keys", "values", "items", "copy"})
_SET_OPS = (ast.BitOr, ast.BitAnd, ast.Sub, ast.BitXor)
# Builtins that keep their argument's iteration order in what they return or do.
_ORDERED = frozenset({"list", "tuple", "iter", "next", "enumerate", "zip", "map", "filter", "reversed", "dict",
                      "str", "repr", "ascii", "format", "print"})
# Builtins whose result does not depend on their argument's order (a generator over a set fed to one is fine).
_ORDER_FREE = frozenset({"sorted", "set", "frozenset", "any", "all", "min", "max", "len"})
_ORDERED_METHODS = frozenset({"join", "extend", "fromkeys", "writelines"})
# Dunder attributes that workflow code may read; any other reaches past this lint (__dict__,
# __globals__, __builtins__, __subclasses__) or is process-dependent (__hash__, object.__repr__).
_DUNDERS = frozenset({"__name__", "__qualname__", "__doc__", "__module__", "__init__", "__post_init__",
                      "__init_subclass__", "__members__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"})
# workflow.unsafe: only marking imports as passed through. is_replaying() and its kin make replay
# take another path than the run took.
_UNSAFE_ALLOWED = frozenset({"imports_passed_through"})
_REPLAY_BRANCHES = frozenset({"is_replaying", "is_replaying_history_events", "is_read_only"})
# Builtins that are fine only when called by name with arguments the rules can read.
_CHECKED_CALLS = frozenset({"getattr", "setattr", "delattr"})
# Builtins that reach a module's namespace, the caller's or the process's.
_NAMESPACES = frozenset({"vars", "globals", "locals"})
_WORKFLOW = "ref:temporalio.workflow"
_BUILTIN_NAMES = frozenset(dir(builtins))


class _Scope:
    def __init__(self, kind: str, parent: _Scope | None) -> None:
        self.kind, self.parent = kind, parent
        self.bindings: dict[str, list[tuple]] = {}
        self.globals: set[str] = set()

    @property
    def module(self) -> _Scope:
        s = self
        while s.parent is not None:
            s = s.parent
        return s

    def bind(self, name: str, binding: tuple) -> None:
        target = self.module if name in self.globals else self
        target.bindings.setdefault(name, []).append(binding)

    def lookup(self, name: str) -> list[tuple] | None:
        s: _Scope | None = self
        first = True
        while s is not None:
            if name in s.globals:
                return s.module.bindings.get(name)
            if (s.kind != "class" or first) and name in s.bindings:
                return s.bindings[name]
            first, s = False, s.parent
        return None


def _plain(cls: ast.ClassDef, classes: dict[str, ast.ClassDef] | None = None) -> bool:
    """A class whose instances' repr and str are ``object``'s: their address (no base but
    ``object``, ``typing.Protocol`` or a plain class of the same module (``classes``), no decorator
    such as @dataclass, no __repr__ / __str__ / __format__ of its own)."""
    def plain_base(b: ast.expr) -> bool:
        if not isinstance(b, ast.Name):
            return False
        if b.id in ("object", "Protocol"):
            return True
        base = (classes or {}).get(b.id)
        return base is not None and base is not cls and _plain(base, classes)

    if cls.decorator_list or not all(plain_base(b) for b in cls.bases) or cls.keywords:
        return False
    return not any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name in {"__repr__", "__str__", "__format__"}
                   for f in cls.body)


def _setish(annotation: ast.AST | None) -> str | None:
    """"set" for a set annotation, "setdict" for a mapping to sets (``dict[K, frozenset[V]]``)."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):  # X | None
        return _setish(annotation.left) or _setish(annotation.right)
    head = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    name = head.attr if isinstance(head, ast.Attribute) else head.id if isinstance(head, ast.Name) else None
    if name in _SETS:
        return "set"
    if name in {"dict", "Dict", "Mapping", "MutableMapping"} and isinstance(annotation, ast.Subscript):
        args = annotation.slice
        if isinstance(args, ast.Tuple) and len(args.elts) == 2 and _setish(args.elts[1]) == "set":
            return "setdict"
    if name == "Optional" and isinstance(annotation, ast.Subscript):
        return _setish(annotation.slice)
    return None


class _Module:
    """One module's scopes and bindings, and what its names resolve to."""

    def __init__(self, tree: ast.Module, module: str, index: dict[str, dict[str, str]], set_fields: set[str]) -> None:
        self.tree, self.module, self.index, self.set_fields = tree, module, index, set_fields
        self.cache: dict[tuple[ast.AST, int], set[str]] = {}
        self.scope_of: dict[ast.AST, _Scope] = {}
        self.method_of: dict[ast.AST, ast.ClassDef] = {}
        self.parent: dict[ast.AST, ast.AST] = {}
        # The module's own classes: a base among them is judged as the class itself is (_plain).
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.top = _Scope("module", None)
        self._visit(tree, self.top)

    def walk(self) -> Iterator[ast.AST]:
        """ast.walk, recording each node's parent before the node is yielded (the rules ask)."""
        todo = deque([self.tree])
        while todo:
            node = todo.popleft()
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
                todo.append(child)
            yield node

    # -------------------------------------------------------------- building the scopes

    def _params(self, args: ast.arguments, scope: _Scope) -> None:
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            scope.bind(a.arg, ("annot", a.annotation))
        for a in (args.vararg, args.kwarg):
            if a is not None:
                scope.bind(a.arg, ("opaque",))

    def _target(self, target: ast.AST, value: ast.AST | None, scope: _Scope) -> None:
        if isinstance(target, ast.Name):
            scope.bind(target.id, ("value", value, scope) if value is not None else ("opaque",))
        elif isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) else None
            paired = values is not None and len(values) == len(target.elts) and not any(isinstance(v, ast.Starred) for v in values)
            for i, t in enumerate(target.elts):
                self._target(t, values[i] if paired else None, scope)
        elif isinstance(target, ast.Starred):
            self._target(target.value, None, scope)
        elif isinstance(target, ast.Attribute) and value is not None and self._is_set(value, scope):
            self.set_fields.add(target.attr)  # self.x = set(): x is a set wherever it is read

    def _visit(self, node: ast.AST, scope: _Scope) -> None:
        self.scope_of[node] = scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if not isinstance(node, ast.Lambda):
                scope.bind(node.name, ("def", node))
                for d in node.decorator_list:
                    self._visit(d, scope)
                if node.returns is not None:
                    self._visit(node.returns, scope)
            for d in [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]:
                self._visit(d, scope)
            inner = _Scope("function", scope)
            self._params(node.args, inner)
            owner = self.method_of.get(node)
            positional = [*node.args.posonlyargs, *node.args.args]
            plain_method = not any(isinstance(d, ast.Name) and d.id in {"staticmethod", "classmethod"} for d in getattr(node, "decorator_list", []))
            if owner is not None and positional and plain_method:
                inner.bindings[positional[0].arg] = [("instance", owner)]  # self: an instance of the class
            self.scope_of[node.args] = inner
            for a in ast.walk(node.args):
                if isinstance(a, ast.arg):
                    self.scope_of[a] = inner
                    if a.annotation is not None:
                        self._visit(a.annotation, scope)
            for stmt in node.body if isinstance(node.body, list) else [node.body]:
                self._visit(stmt, inner)
            return
        if isinstance(node, ast.ClassDef):
            scope.bind(node.name, ("class", node))
            for child in [*node.bases, *node.keywords, *node.decorator_list]:
                self._visit(child, scope)
            inner = _Scope("class", scope)
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.method_of[stmt] = node
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and _setish(stmt.annotation) == "set":
                    self.set_fields.add(stmt.target.id)  # a model's set field: obj.field is a set
                self._visit(stmt, inner)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = _Scope("comprehension", scope)
            for i, gen in enumerate(node.generators):
                self.scope_of[gen] = inner
                self._visit(gen.iter, scope if i == 0 else inner)  # the first iterable is evaluated outside
                self._target(gen.target, None, inner)
                self._visit(gen.target, inner)
                for cond in gen.ifs:
                    self._visit(cond, inner)
            for part in ("elt", "key", "value"):
                if hasattr(node, part):
                    self._visit(getattr(node, part), inner)
            return
        if isinstance(node, ast.Global):
            scope.globals.update(node.names)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                self._target(t, node.value, scope)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            scope.bind(node.target.id, ("value", node.value, scope, node.annotation) if node.value is not None
                       else ("annot", node.annotation))
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            scope.bind(node.target.id, ("value", ast.BinOp(left=ast.Name(node.target.id, ast.Load()), op=node.op, right=node.value), scope))
        elif isinstance(node, ast.NamedExpr):
            home = scope
            while home.kind == "comprehension" and home.parent is not None:
                home = home.parent
            home.bind(node.target.id, ("value", node.value, scope))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._target(node.target, None, scope)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._target(node.optional_vars, None, scope)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            scope.bind(node.name, ("opaque",))
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            scope.bind(node.name, ("opaque",))
        elif isinstance(node, ast.MatchMapping) and node.rest:
            scope.bind(node.rest, ("opaque",))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    scope.bind(a.asname, ("ref", a.name))
                else:
                    scope.bind(a.name.split(".")[0], ("ref", a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = self.module.rsplit(".", node.level)[0] if "." in self.module else self.module
                base = f"{package}.{base}" if base else package
            for a in node.names:
                scope.bind(a.asname or a.name, ("ref", f"{base}.{a.name}"))
        for child in ast.iter_child_nodes(node):
            self._visit(child, scope)

    # -------------------------------------------------------------- resolving

    def resolve(self, expr: ast.AST, scope: _Scope | None = None, seen: frozenset = frozenset()) -> set[str]:
        """What ``expr`` may be: ``builtin:NAME``, ``ref:dotted.name`` (an imported module or
        member), ``set``, ``setdict`` (a mapping to sets), ``setfunc`` (returns a set), ``opaque``."""
        scope = scope or self.scope_of.get(expr, self.top)
        if expr in seen:
            return {"opaque"}
        if not seen:  # a top-level question: asked again by several rules
            key = (expr, id(scope))
            if key not in self.cache:
                self.cache[key] = self._resolve(expr, scope, frozenset({expr}))
            return self.cache[key]
        return self._resolve(expr, scope, seen | {expr})

    def _resolve(self, expr: ast.AST, scope: _Scope, seen: frozenset) -> set[str]:
        if isinstance(expr, ast.Name):
            bindings = scope.lookup(expr.id)
            if bindings is None:
                return {f"builtin:{expr.id}"} if expr.id in _BUILTIN_NAMES else {"opaque"}
            out: set[str] = set()
            for b in bindings:
                if b[0] == "ref":
                    out.add(f"ref:{b[1]}")
                    kind = self._indexed(b[1])
                    if kind:
                        out.add(kind)
                elif b[0] == "value":
                    out |= self.resolve(b[1], b[2], seen)
                    if len(b) > 3:
                        out.add(_setish(b[3]) or "opaque")
                elif b[0] == "annot":
                    out.add(_setish(b[1]) or "opaque")
                elif b[0] == "def":
                    out.add("setfunc" if _setish(b[1].returns) == "set" else "opaque")
                elif b[0] == "class":
                    out.add("plainclass" if _plain(b[1], self.classes) else "opaque")
                elif b[0] == "instance":
                    out.add("addressed" if _plain(b[1], self.classes) else "opaque")
                else:
                    out.add("opaque")
            return out
        if isinstance(expr, ast.Attribute):
            out = set()
            for r in self.resolve(expr.value, scope, seen):
                if r.startswith("ref:"):
                    out.add(f"{r}.{expr.attr}")
                    kind = self._indexed(f"{r[4:]}.{expr.attr}")
                    if kind:
                        out.add(kind)
            if expr.attr in self.set_fields:
                out.add("set")
            return out or {"opaque"}
        if isinstance(expr, (ast.Set, ast.SetComp)):
            return {"set"}
        if isinstance(expr, ast.DictComp):
            # Fine as a lookup table (TEMPORAL_STATUS); its iteration order is the set's.
            return {"set"} if any(self._is_set(g.iter) for g in expr.generators) else {"opaque"}
        if isinstance(expr, ast.Call):
            func = self.resolve(expr.func, scope, seen)
            if {"builtin:set", "builtin:frozenset", "setfunc"} & func:
                return {"set"}
            if {"builtin:object", "plainclass"} & func:
                return {"addressed"}
            if isinstance(expr.func, ast.Attribute):
                receiver = self.resolve(expr.func.value, scope, seen)
                if expr.func.attr in _SET_METHODS | _VIEW_METHODS and "set" in receiver:
                    return {"set"}
                if expr.func.attr == "get" and "setdict" in receiver:
                    return {"set"}
            return {"opaque"}
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, _SET_OPS):
            if "set" in self.resolve(expr.left, scope, seen) | self.resolve(expr.right, scope, seen):
                return {"set"}
            return {"opaque"}
        if isinstance(expr, ast.IfExp):
            return self.resolve(expr.body, scope, seen) | self.resolve(expr.orelse, scope, seen)
        if isinstance(expr, ast.BoolOp):
            return set().union(*(self.resolve(v, scope, seen) for v in expr.values))
        if isinstance(expr, ast.NamedExpr):
            return self.resolve(expr.value, scope, seen)
        if isinstance(expr, ast.Subscript):
            return {"set"} if "setdict" in self.resolve(expr.value, scope, seen) else {"opaque"}
        if isinstance(expr, ast.Dict):
            if expr.values and all("set" in self.resolve(v, scope, seen) for v in expr.values):
                return {"setdict"}
            return {"opaque"}
        return {"opaque"}

    def _indexed(self, dotted: str) -> str | None:
        """Whether a module-level name of another linted module is a set (a mapping to sets, a
        function returning one): ``from workflows.states import TERMINAL``."""
        module, _, name = dotted.rpartition(".")
        return self.index.get(module, {}).get(name)

    def _is_set(self, expr: ast.AST, scope: _Scope | None = None) -> bool:
        return "set" in self.resolve(expr, scope)

    def module_kinds(self) -> dict[str, str]:
        out = {}
        for name in self.top.bindings:
            kinds = self.resolve(ast.Name(name, ast.Load()), self.top) & {"set", "setdict", "setfunc"}
            if kinds:
                out[name] = sorted(kinds)[0]
        return out


def _order_free(m: _Module, call: ast.Call) -> bool:
    """Whether the call's result does not depend on its argument's order. sorted / min / max
    with a key= are taken to sort by a total order (states.mermaid sorts by table position):
    a key with ties would keep the set's order among them, which this check does not see."""
    return bool(m.resolve(call.func) & {f"builtin:{b}" for b in _ORDER_FREE})


def _module_name(path: Path, root: Path | None) -> str:
    try:
        parts = list(path.resolve().relative_to(root).with_suffix("").parts) if root else [path.stem]
    except ValueError:
        parts = [path.stem]
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(sources: dict[str, ast.Module]) -> dict[str, _Module]:
    """Every linted module's scopes, with a shared index of the module-level sets, mappings to
    sets and set-returning functions of each, and the attribute names that hold sets, so an
    import or an attribute resolves across modules. Two rounds: a module's sets may come from
    another's (``PUBLISHED = TERMINAL | {...}`` in one, imported by the next)."""
    index: dict[str, dict[str, str]] = {}
    fields: set[str] = set()
    modules = {name: _Module(tree, name, index, fields) for name, tree in sources.items()}
    for _ in range(2):
        kinds = {name: m.module_kinds() for name, m in modules.items()}
        index.clear()
        index.update(kinds)
        for m in modules.values():
            m.cache.clear()
    return modules


def problems_in(source: str, name: str, *, module: str = "", prebuilt: _Module | None = None) -> list[str]:
    """Every rule the module's source breaks, as ``name:line: rule``."""
    found: list[str] = []

    def say(node: ast.AST, rule: str) -> None:
        found.append(f"{name}:{getattr(node, 'lineno', 0)}: {rule}")

    module = module or Path(name).stem
    m = prebuilt or _modules({module: ast.parse(source, name)})[module]
    tree = m.tree

    def is_set(expr: ast.AST) -> bool:
        return m._is_set(expr)

    def set_order(node: ast.AST, how: str) -> None:
        say(node, f"order of a set ({how}): it follows PYTHONHASHSEED for str, Enum and tuple members, "
                  "so it differs between worker processes; use sorted(...) or a list / dict")

    for node in m.walk():
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _allowed(alias.name):
                    say(node, f"imports {alias.name} (not pure: wall clock, randomness, environment, I/O or threads)")
        elif isinstance(node, ast.ImportFrom):
            module_name = node.module or ""
            if node.level == 0 and not _allowed(module_name):
                say(node, f"imports from {module_name} (not pure: wall clock, randomness, environment, I/O or threads)")
            for alias in node.names:
                if alias.name in CLOCK | ESCAPES | _REPLAY_BRANCHES | {"unsafe"}:
                    say(node, f"imports {alias.name} from {module_name}")
        elif isinstance(node, ast.Attribute):
            if node.attr in CLOCK and m.resolve(node.value) != {_WORKFLOW}:
                # Allowed only on what IS temporalio.workflow, by binding (workflow = datetime is not).
                say(node, f"reads the wall clock (.{node.attr}): use workflow.now()")
            elif node.attr in ESCAPES:
                say(node, f"leaves the workflow (.{node.attr})")
            elif node.attr in _REPLAY_BRANCHES:
                say(node, f"workflow.unsafe.{node.attr}(): replay would take another path than the run took")
            elif node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in _DUNDERS:
                say(node, f"reads .{node.attr} (process-dependent, or reaches past this check)")
            elif node.attr == "unsafe" and _WORKFLOW in m.resolve(node.value):
                up = m.parent.get(node)
                if not (isinstance(up, ast.Attribute) and up.attr in _UNSAFE_ALLOWED):
                    say(node, "workflow.unsafe beyond imports_passed_through")
            elif node.attr == "pop" and isinstance(m.parent.get(node), ast.Call) and is_set(node.value):
                set_order(node, "set.pop() takes whichever member comes first")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in {"__builtins__", "__import__"}:
                say(node, f"uses {node.id}")
            kinds = m.resolve(node)
            called = isinstance(m.parent.get(node), ast.Call) and m.parent[node].func is node
            for kind in sorted(kinds):
                builtin = kind[len("builtin:"):] if kind.startswith("builtin:") else None
                if builtin is None or builtin == "__import__" and not called:
                    continue
                shown = builtin if builtin == node.id else f"{node.id}, which is {builtin},"
                why = "reaches a namespace past this check" if builtin in _NAMESPACES else "I/O or process-dependent"
                if builtin in BUILTINS | _NAMESPACES:
                    if called and builtin == node.id:
                        say(node, f"calls {builtin}() ({why})")
                    elif called:
                        say(node, f"calls {node.id}(), which is {builtin}() ({why})")
                    else:
                        say(node, f"uses {shown} ({why}) without calling it by name: an alias or a key= calls it all the same")
                elif builtin in _CHECKED_CALLS and not called:
                    say(node, f"uses {shown} not called by name (its arguments cannot be checked)")
                elif builtin == "object" and called:
                    say(node, "calls object() (its repr and hash are its address: process-dependent); use a named constant")
                elif builtin == "getattr" and called:
                    call = m.parent[node]
                    attr = call.args[1] if len(call.args) > 1 else None
                    if not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)):
                        say(node, "getattr with a computed name (could reach anything)")
                    elif (attr.value in CLOCK | ESCAPES | BUILTINS | _REPLAY_BRANCHES | {"unsafe"}
                          or attr.value.startswith("__") and attr.value not in _DUNDERS):
                        say(node, f"getattr(..., {attr.value!r})")
                elif builtin in {"setattr", "delattr"} and called:
                    say(node, f"calls {builtin}() (rebinds what this check reads)")
        # ---- an object whose repr is its address, made text
        shown_as_text = []
        if isinstance(node, ast.FormattedValue):
            shown_as_text = [node.value]
        elif isinstance(node, ast.Call) and (m.resolve(node.func) & {"builtin:repr", "builtin:str", "builtin:format", "builtin:ascii"}
                                             or isinstance(node.func, ast.Attribute) and node.func.attr == "format"):
            shown_as_text = [*node.args, *(k.value for k in node.keywords)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
            shown_as_text = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
        for value in shown_as_text:
            if "addressed" in m.resolve(value):
                say(value, "makes text of an object whose repr is its address (object(), or a class with no __repr__): process-dependent")
        # ---- sets whose order reaches the run (iteration, ordered builtins, unpacking, text)
        if isinstance(node, (ast.For, ast.AsyncFor)) and is_set(node.iter):
            set_order(node.iter, "for over a set")
        elif isinstance(node, (ast.ListComp, ast.GeneratorExp)):  # a DictComp resolves to unordered, checked where used
            up = m.parent.get(node)
            order_free = isinstance(up, ast.Call) and up.args == [node] and _order_free(m, up)
            for gen in node.generators:
                if not order_free and is_set(gen.iter):
                    set_order(gen.iter, "a comprehension over a set")
        elif isinstance(node, ast.Call):
            func = m.resolve(node.func)
            ordered = sorted(b[len("builtin:"):] for b in func if b.startswith("builtin:") and b[len("builtin:"):] in _ORDERED)
            if not ordered and isinstance(node.func, ast.Attribute) and node.func.attr in _ORDERED_METHODS:
                ordered = [f".{node.func.attr}"]
            if ordered:
                for arg in node.args:
                    if not isinstance(arg, ast.Starred) and is_set(arg):
                        set_order(arg, f"{ordered[0]}() of a set")
        elif isinstance(node, ast.Starred) and isinstance(node.ctx, ast.Load) and is_set(node.value):
            set_order(node, "*unpacking a set")
        elif isinstance(node, ast.FormattedValue) and is_set(node.value):
            set_order(node, "a set formatted as text")
        elif isinstance(node, ast.Assign) and any(isinstance(t, (ast.Tuple, ast.List)) for t in node.targets) and is_set(node.value):
            set_order(node, "unpacking a set")
        elif isinstance(node, ast.YieldFrom) and is_set(node.value):
            set_order(node, "yield from a set")
    return sorted(found, key=lambda p: int(p[len(name) + 1:].split(":", 1)[0]))


def workflow_modules(root: Path = ROOT) -> list[Path]:
    """Every module of the workflows package, subpackages included."""
    return sorted((root / "workflows").rglob("*.py"))


def check(paths: Iterable[Path], root: Path = ROOT) -> list[str]:
    """Lint ``paths`` together: an import of another linted module resolves to what it binds."""
    texts = {_module_name(path, root): (path, path.read_text()) for path in paths}
    modules = _modules({module: ast.parse(text, str(path)) for module, (path, text) in texts.items()})
    found = []
    for module, (path, text) in texts.items():
        shown = str(path.relative_to(root) if path.is_relative_to(root) else path)
        found += problems_in(text, shown, module=module, prebuilt=modules[module])
    return found


def check_tree(root: Path) -> list[str]:
    """The workflows package under ``root`` (a checkout, or a copy with a mutant), named relative to it."""
    root = root.resolve()
    return check(workflow_modules(root), root)


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
    if args[:1] == ["--root"]:  # a tree with a workflows/ package (a copy with a mutant)
        problems = check_tree(Path(args[1]))
    else:
        problems = check([Path(a).resolve() for a in args] or workflow_modules())
    print("\n".join(problems) or "workflows/: no wall clock, randomness, environment, I/O or threads")
    sys.exit(1 if problems else 0)
