"""The tool SDK: ``@tool``, ``ToolSpec``, ``ToolContext``, ``ToolError``, the registry (the activity
that runs them is activities/tools.py).

A tool is a function taking one pydantic argument model and a :class:`ToolContext`, with a
declared effect. The effect decides the retry rule in the workflow and the approval default::

    class RefundArgs(BaseModel):
        order_id: str
        amount_cents: int

    @tool(effect=ToolEffect.IDEMPOTENT)
    def issue_refund(args: RefundArgs, ctx: ToolContext) -> dict:
        ...  # send ctx.idempotency_key to the target system

Tools raise :class:`ToolError` for failures they understand: ``permanent=True`` for bad input
or a 4xx (never retried), otherwise a transient error the workflow may retry (if the effect
allows it).

Each attempt runs under a deadline (``ctx.deadline``, the tool's declared timeout from the
attempt's start; pass ``ctx.seconds_left()`` to HTTP clients as their timeout) and heartbeats
while the tool runs: a dead worker is noticed within seconds, and a cancel of the run reaches
the tool (async tools are cancelled, sync tools see ``ctx.cancelled`` set). The activity ends
only when the tool has: a tool still running a grace period after its deadline is reported as
``attempt_still_running``, and the workflow does not retry it (see ``workflows/policy.py``).
"""

from __future__ import annotations

import inspect
import logging
import threading
from contextvars import ContextVar
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, get_type_hints

import jsonschema
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from tether.loading import LoadError, import_named
from workflows.contract import Compensation, ToolCatalog, ToolEffect, ToolInfo, first_error
from workflows.validation import BoundedValidator, PatternError, schema_problem

log = logging.getLogger("tether.tools")


class ToolError(Exception):
    """A failure the tool understands. ``code`` shows on the timeline as the error code."""

    def __init__(self, message: str, *, code: str = "tool_error", permanent: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.permanent = permanent


@dataclass(frozen=True)
class ToolContext:
    """What a tool knows about the call it is serving."""

    run_id: str
    tenant: str
    tool_call_id: str
    # Stable across retries, worker crashes and continue-as-new: send it to the target system.
    idempotency_key: str
    attempt: int
    # When this attempt must be over (UTC): nothing may be sent to the target system after it.
    deadline: datetime | None = None
    # Set when the run was cancelled while the tool runs: a long sync tool should stop early.
    cancelled: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    def seconds_left(self, default: float = 30.0) -> float:
        """Time to the deadline (``default`` without one): the timeout for an HTTP call."""
        if self.deadline is None:
            return default
        return max((self.deadline - datetime.now(timezone.utc)).total_seconds(), 0.0)


ToolFn = Callable[[Any, ToolContext], Any]
LookupFn = Callable[[ToolContext], Any]


@dataclass
class ToolSpec:
    name: str
    fn: ToolFn
    # The argument model of a Python tool; None for a tool described by ``args_schema`` alone
    # (MCP tools: the server's JSON schema), whose arguments reach ``fn`` as a validated dict.
    args_model: type[BaseModel] | None
    effect: ToolEffect
    requires_approval: bool
    timeout_seconds: float
    max_retries: int
    description: str
    summary_fields: tuple[str, ...] = ()
    lookup_fn: LookupFn | None = None
    args_schema: dict[str, Any] | None = None
    source: str = "python"  # or "mcp:<server>"
    why: str = "declared"  # where the effect came from (`tools` shows it)
    destructive: bool = False
    compensate: Compensation | None = None  # how its effect is undone (None: no recovery path)
    # The pydantic model ``fn`` declares it returns (None: undeclared): its schema tells an
    # approver which fields of a read's result are money.
    result_model: type[BaseModel] | None = None
    # Declared by a plain @tool (no ``registry=``): it belongs to whichever registry loads its module.
    plain: bool = field(default=False, repr=False, compare=False)

    def lookup(self, fn: LookupFn) -> LookupFn:
        """Register the function that finds a previous effect by idempotency key.

        Required for ``reconcilable`` tools: on a retry the runtime calls it first and returns
        what it finds (anything but ``None``) instead of acting again.
        """
        self.lookup_fn = fn
        return fn

    def info(self) -> ToolInfo:
        return ToolInfo(
            name=self.name,
            description=self.description,
            effect=self.effect,
            requires_approval=self.requires_approval,
            args_schema=(self.args_schema or {}) if self.args_model is None else self.args_model.model_json_schema(),
            timeout_seconds=self.timeout_seconds,
            max_retries=self.max_retries,
            summary_fields=list(self.summary_fields),
            destructive=self.destructive,
            source=self.source,
            compensate=self.compensate,
            result_schema=None if self.result_model is None else self.result_model.model_json_schema(),
        )

    def parse_args(self, raw: dict[str, Any]) -> Any:
        """The arguments ``fn`` gets: the pydantic model, or the raw dict checked against
        ``args_schema``. Raises pydantic's ValidationError either way (one error path)."""
        if self.args_model is not None:
            return self.args_model.model_validate(raw)
        # The same linear-time regex engine as the workflow's validation (workflows/validation.py).
        validator = BoundedValidator(self.args_schema or {})
        try:
            first = min(validator.iter_errors(raw), key=lambda e: list(map(str, e.absolute_path)), default=None)
        except PatternError as e:
            first = jsonschema.ValidationError(f"the tool's schema cannot be checked: {e}")
        if first is None:
            return raw
        error = PydanticCustomError("json_schema", "{message}", {"message": first.message[:200]})
        raise ValidationError.from_exception_data(
            self.name, [{"type": error, "loc": tuple(first.absolute_path), "input": first.instance}]
        )

    def __call__(self, args: Any, ctx: ToolContext) -> Any:
        return self.fn(args, ctx)


@dataclass
class ToolRegistry:
    tools: dict[str, ToolSpec] = field(default_factory=dict)
    # Tools left out at load, with why (`tether tools` lists them): a schema the workflow could
    # not check in bounded time, or a bad MCP listing entry.
    refused: dict[str, str] = field(default_factory=dict)
    # Built once: JSON-schema generation is the costly part of every run's catalog snapshot.
    _catalog: ToolCatalog | None = field(default=None, repr=False, compare=False)

    def register(self, spec: ToolSpec) -> ToolSpec:
        existing = self.tools.get(spec.name)
        if existing is not None and existing.fn is not spec.fn:
            raise ValueError(f"tool {spec.name!r} is registered twice; give one of them name=...")
        problem = schema_problem(spec.info().args_schema)
        if problem is not None:
            # Never offered: the workflow would have to run a regex it cannot bound.
            self.refuse(spec.name, problem, source=spec.source)
            return spec
        self.tools[spec.name] = spec
        self._catalog = None
        return spec

    def refuse(self, name: str, reason: str, *, source: str = "python", logged: bool = False) -> None:
        """Leave a tool out of the catalog, with a log line and the reason `tether tools` shows."""
        if not logged:
            log.warning("tool %r (%s) left out: %s", name, source, reason)
        self.refused[name] = f"{source}: {reason}"

    def get(self, name: str) -> ToolSpec | None:
        return self.tools.get(name)

    def catalog(self) -> ToolCatalog:
        if self._catalog is None:
            self._catalog = ToolCatalog(tools=[spec.info() for spec in self.tools.values()])
        return self._catalog.model_copy(deep=True)

    def check(self) -> None:
        """Fail at worker start, not mid-run, on a tool that cannot honour its effect or whose
        declared compensation cannot be built."""
        for spec in self.tools.values():
            if spec.compensate is not None:
                compensation_problem(spec, self.tools)
            if spec.effect == ToolEffect.RECONCILABLE and spec.lookup_fn is None:
                raise ValueError(
                    f"tool {spec.name!r} is reconcilable but has no lookup: add "
                    f"@{spec.name}.lookup on a function (ctx) -> previous result or None"
                )


# Tools register here on import; worker.py imports the configured tool modules.
REGISTRY = ToolRegistry()


def _arg_names(spec: ToolSpec) -> set[str] | None:
    schema = spec.args_schema if spec.args_model is None else spec.args_model.model_json_schema()
    props = (schema or {}).get("properties")
    return set(props) if isinstance(props, dict) else None


def as_compensation(value: Compensation | dict[str, Any] | tuple[str, dict[str, Any]] | None) -> Compensation | None:
    """``compensate=`` as given: a Compensation, {"tool": ..., "args": {...}} or (tool, args)."""
    if value is None or isinstance(value, Compensation):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        value = {"tool": value[0], "args": value[1]}
    try:
        return Compensation.model_validate(value, context={"strict_keys": True})
    except ValidationError as e:
        raise ValueError(f"invalid compensate= declaration: {first_error(e)}") from None


def compensation_problem(spec: ToolSpec, tools: dict[str, ToolSpec]) -> None:
    """Raise ValueError naming what is wrong with ``spec``'s compensation declaration."""
    comp = spec.compensate
    assert comp is not None
    target = tools.get(comp.tool)
    if target is None:
        raise ValueError(f"tool {spec.name!r} is compensated by {comp.tool!r}, which is not registered")
    if target.effect == ToolEffect.READ_ONLY:
        raise ValueError(f"tool {spec.name!r} is compensated by {comp.tool!r}, which is read_only and undoes nothing")
    names, own = _arg_names(target), _arg_names(spec)
    for name, pointer in comp.args.items():
        if names is not None and name not in names:
            raise ValueError(f"tool {spec.name!r}: its compensation {comp.tool!r} takes no argument {name!r}")
        parts = pointer.split("/")
        if parts[1] == "args" and own is not None and len(parts) > 2 and parts[2] not in own:
            raise ValueError(f"tool {spec.name!r}: compensation argument {name!r} points at {pointer!r}, not an argument of {spec.name!r}")


# The registry a plain ``@tool(...)`` registers into while load_tool_modules imports a module for
# a registry of its own (unset: the process-wide REGISTRY).
_LOADING: ContextVar[ToolRegistry | None] = ContextVar("tether_tools_loading", default=None)


def load_tool_modules(modules: Iterable[str], registry: ToolRegistry = REGISTRY) -> ToolRegistry:
    """Import the tool modules and check ``registry``; raises LoadError naming the module or
    tool that is wrong (tether/loading.py). A module's ``@tool`` declarations (without
    ``registry=``) land in ``registry``: a registry of one's own (a test's, a second worker's in
    one process) gets the module's tools and the process-wide one is left as it was; a module
    imported before gives its tools to ``registry`` too."""
    for name in modules:
        name = name.strip()
        if name:
            token = _LOADING.set(registry)
            try:
                module = import_named(name, "tool module")
            finally:
                _LOADING.reset(token)
            specs = [value for value in vars(module).values() if isinstance(value, ToolSpec)]
            if not specs:
                raise LoadError(f"tool module {name!r} declares no tool: decorate a function in it with "
                                f"@tool(effect=...), {EFFECTS_HELP}")
            # Imported before (for another registry): its plain @tool declarations.
            for spec in specs:
                if spec.plain and registry.get(spec.name) is None and spec.name not in registry.refused:
                    try:
                        registry.register(spec)
                    except ValueError as e:
                        raise LoadError(f"tool module {name!r}: {e}") from None
    try:
        registry.check()
    except ValueError as e:
        raise LoadError(str(e)) from None
    return registry


# What a @tool declaration says when its effect is missing or wrong: the four, with what each means.
EFFECTS_HELP = (
    "an effect is one of ToolEffect.READ_ONLY (no side effect), IDEMPOTENT (the target dedupes by the "
    "idempotency key), RECONCILABLE (an earlier effect can be looked up by its key) or UNSAFE (neither: "
    "runs at most once)"
)


class ToolDeclarationError(TypeError):
    """A @tool declaration that cannot make a tool: says what to write instead."""


def tool(
    fn: ToolFn | None = None,
    /,
    *,
    effect: ToolEffect | str | None = None,
    requires_approval: bool | None = None,
    timeout: float = 30.0,
    max_retries: int = 3,
    name: str | None = None,
    registry: ToolRegistry | None = None,
    summary_fields: tuple[str, ...] = (),
    compensate: Compensation | dict[str, Any] | tuple[str, dict[str, Any]] | None = None,
) -> Callable[[ToolFn], ToolSpec]:
    """Declare a tool. ``requires_approval`` defaults to "the tool writes" (effect != read_only).

    ``summary_fields`` names the arguments an approver sees in the risk summary (the target,
    the amount); keep secrets and personal data out of it.

    ``compensate`` declares how the tool's effect is undone: the compensating tool and its
    arguments as JSON pointers into the original call's arguments and result, e.g.
    ``("void_refund", {"refund_id": "/result/refund_id"})``. The approver sees it, the plan hash
    covers it, and a run with ``on_failure="compensate"`` runs it (docs/writing-tools.md).

    A function annotated to return a pydantic model (``-> OrderTotal``) gives its schema to the
    catalog: result fields declared as money (``x-money``, as on arguments) are shown to an
    approver in words where a read step's result is (``120.00 EUR (12000)``).
    """
    if fn is not None:  # @tool without its arguments
        raise ToolDeclarationError(
            f"@tool on {getattr(fn, '__name__', fn)!r} needs its effect: @tool(effect=ToolEffect.IDEMPOTENT), "
            f"{EFFECTS_HELP}")
    if effect is None:
        raise ToolDeclarationError(f"@tool() needs effect=...: {EFFECTS_HELP}")
    try:
        effect = ToolEffect(effect)
    except ValueError:
        raise ToolDeclarationError(f"@tool(effect={effect!r}) is no effect: {EFFECTS_HELP}") from None
    declared = as_compensation(compensate)

    def decorate(fn: ToolFn) -> ToolSpec:
        params = list(inspect.signature(fn).parameters)
        hints = get_type_hints(fn)
        model = hints.get(params[0]) if params else None
        returns = hints.get("return")
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ToolDeclarationError(
                f"tool {fn.__name__}: the first parameter must be annotated with a pydantic model "
                "(def my_tool(args: MyArgs, ctx: ToolContext) -> dict)"
            )
        spec = ToolSpec(
            name=name or fn.__name__,
            fn=fn,
            args_model=model,
            effect=effect,
            requires_approval=(
                effect != ToolEffect.READ_ONLY if requires_approval is None else requires_approval
            ),
            timeout_seconds=timeout,
            max_retries=max_retries,
            description=inspect.cleandoc(fn.__doc__ or ""),
            summary_fields=tuple(summary_fields),
            compensate=declared,
            result_model=returns if isinstance(returns, type) and issubclass(returns, BaseModel) else None,
            plain=registry is None,
        )
        return (registry or _LOADING.get() or REGISTRY).register(spec)

    return decorate
