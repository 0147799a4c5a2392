"""The tool SDK (``@tool``, ``ToolSpec``, the registry) and the activities that expose tools.

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

import asyncio
import base64
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, get_type_hints

import jsonschema
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from tether.store.keys import KeyRing, attest, capability_refusal
from tether.store.effect_ledger import EffectLedger, LedgerUnavailable
from tether.loading import LoadError, import_named
from workflows.keys import attested_call
from tether.metrics import tool_call_metrics
from workflows.contract import Compensation, ToolCatalog, ToolEffect, ToolInfo, first_error, json_digest
from workflows.wire import (
    ATTEMPT_STILL_RUNNING, CANCELLED_MID_CALL, CAPABILITY_INVALID, DECISION_NOT_HELD, JUDGE_UNAVAILABLE, LEDGER_UNAVAILABLE,
    RECORD_UNVERIFIED, SINK_UNAVAILABLE, UNKNOWN_TOOL, DecisionCheck, ToolCall, ToolOutcome, Verdict,
)
from workflows.recovery import UNDO_KEY_SUFFIX
from workflows.retries import ToolTimeouts, tool_timeouts
from workflows.validation import BoundedValidator, PatternError, schema_problem

# Why the policy file did not load, as this attempt's judgement of a roster's decision found it.
_JUDGED_UNDER_PROBLEM: contextvars.ContextVar[str | None] = contextvars.ContextVar("judged_under_problem", default=None)

# Writes a run's packed records to the audit sink (activities/audit.py AuditActivities.write).
RecordWriter = Callable[[bytes], Awaitable[int]]

log = logging.getLogger("tether.tools")

# Observations are cut to this many characters before they enter workflow history, so history
# does not grow with the size of tool results. The digest covers the full result.
MAX_OBSERVATION_CHARS = 4000

# A write (an undo) of an unsafe tool whose earlier start never settled: not run again, its
# outcome unknown; the run treats it as any attempt whose outcome is unknown (HANDED_OFF).
MAY_HAVE_APPLIED = "may_have_applied"
UNDO_MAY_HAVE_APPLIED = "undo_may_have_applied"
# A write (an undo) another attempt may be running right now: tried again after a backoff.
IN_FLIGHT = "write_in_flight"
UNDO_IN_FLIGHT = "undo_in_flight"


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


def load_tool_modules(modules: Iterable[str], registry: ToolRegistry = REGISTRY) -> ToolRegistry:
    """Import the tool modules (their tools register on import) and check the registry; raises
    LoadError naming the module or tool that is wrong (tether/loading.py)."""
    for name in modules:
        name = name.strip()
        if name:
            module = import_named(name, "tool module")
            if not any(isinstance(value, ToolSpec) for value in vars(module).values()):
                raise LoadError(f"tool module {name!r} declares no tool: decorate a function in it with "
                                f"@tool(effect=...), {EFFECTS_HELP}")
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
        )
        return (registry or REGISTRY).register(spec)

    return decorate


class _Attempt:
    """One attempt of a tool call: runs the tool's functions while heartbeating, until they end.

    A sync function runs in a thread, which nothing can stop: on a cancel the attempt sets
    ``ctx.cancelled`` and keeps waiting, so the activity never reports an attempt as over while
    its tool still runs. An async function is cancelled. Past the deadline plus half the grace
    period (the other half lets the report reach the server before start_to_close), the attempt
    gives up and says the tool is still running.
    """

    def __init__(self, ctx: ToolContext, timeouts: ToolTimeouts, started: float) -> None:
        self.ctx = ctx
        self.timeouts = timeouts
        self.give_up = started + timeouts.run + timeouts.grace / 2
        self.cancel_seen = False

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        if inspect.iscoroutinefunction(fn):
            work: asyncio.Future[Any] = asyncio.ensure_future(fn(*args))
        else:
            # Sync tools (most HTTP clients) run in a thread so they never block the worker's loop.
            call = functools.partial(contextvars.copy_context().run, fn, *args)
            work = asyncio.ensure_future(loop.run_in_executor(None, call))
        while True:
            activity.heartbeat()
            left = self.give_up - time.monotonic()
            if left <= 0:
                if isinstance(work, asyncio.Task):
                    work.cancel()
                raise ApplicationError(
                    f"{self.ctx.tool_call_id}: the tool was still running "
                    f"{self.timeouts.grace / 2:g}s after its deadline",
                    type=ATTEMPT_STILL_RUNNING,
                )
            try:
                # asyncio.wait never cancels ``work``: the tool ends on its own terms.
                await asyncio.wait({work}, timeout=min(self.timeouts.heartbeat / 4, left))
            except asyncio.CancelledError:
                # The run was cancelled (it arrives with a heartbeat) or the worker shuts down.
                self.cancel_seen = True
                self._stop(work)
                continue
            if work.done():
                if work.cancelled():
                    raise ApplicationError(
                        f"{self.ctx.tool_call_id}: cancelled while the tool ran", type=CANCELLED_MID_CALL
                    )
                return work.result()

    def _stop(self, work: asyncio.Future[Any]) -> None:
        self.ctx.cancelled.set()
        if not isinstance(work, asyncio.Task):
            return  # a thread: it sees ctx.cancelled, and we wait for it
        work.cancel()

    def stop_if_cancelled(self) -> None:
        """Between the lookup and the write: a cancelled attempt does not start writing."""
        if self.cancel_seen:
            raise ApplicationError(
                f"{self.ctx.tool_call_id}: cancelled before the tool ran", type=CANCELLED_MID_CALL
            )


def bounded_observation(result: Any) -> ToolOutcome:
    if isinstance(result, BaseModel):
        result = result.model_dump(mode="json")
    text = json.dumps(result, sort_keys=True, default=str)
    return ToolOutcome(
        observation=text[:MAX_OBSERVATION_CHARS],
        digest=hashlib.sha256(text.encode()).hexdigest(),
        size=len(text),
        truncated=len(text) > MAX_OBSERVATION_CHARS,
    )


class ToolActivities:
    """The activities that expose a registry's tools to the workflow."""

    def __init__(
        self, registry: ToolRegistry = REGISTRY, keys: KeyRing | None = None, ledger: EffectLedger | None = None,
        records: RecordWriter | None = None, judge: Callable[[DecisionCheck], Awaitable[Verdict]] | None = None,
    ) -> None:
        self.registry = registry
        # The policy activities' judging of a decision (PolicyActivities.judge_decision), where
        # this process has the policy file: the first call after a roster's decision is judged here.
        self.judge = judge
        self.keys = keys  # verifies the capability every write attempt must carry
        self.ledger = ledger  # each write (undos too) started at most once, whoever asks (tether/store/effect_ledger.py)
        # The audit sink's writer (AuditActivities.write): the records a write takes along go in
        # before the tool is called.
        self.records = records

    @activity.defn(name="execute_tool")
    async def execute_tool(self, call: ToolCall) -> ToolOutcome:
        spec = self.registry.get(call.tool)
        effect = spec.effect.value if spec is not None else "unknown"
        # Counts the call (and the retry, for attempt > 1) by tool, effect and outcome.
        with tool_call_metrics(call.tool, effect, call.attempt):
            if spec is None:
                raise ApplicationError(
                    f"tool {call.tool!r} is not registered on this worker; start the worker with "
                    f"the module that defines it (--tools / TETHER_TOOLS)",
                    type=UNKNOWN_TOOL,
                    non_retryable=True,
                )
            if spec.effect != ToolEffect.READ_ONLY:
                # Nothing writes unless the governed run's own worker minted this call's capability.
                refused = capability_refusal(self.keys, call)
                if refused is not None:
                    raise refused
            if call.judge is not None or (call.capability is not None and call.capability.judge_digest):
                await self._judged(call)
            if call.records is not None:
                await self._write_records(call.records)
            try:
                args = spec.parse_args(call.args)
            except ValidationError as e:
                raise ApplicationError(
                    f"invalid arguments for {spec.name}: {first_error(e)}",
                    type="invalid_arguments",
                    non_retryable=True,
                ) from None
            timeouts = tool_timeouts(spec.timeout_seconds)
            started = time.monotonic()
            ctx = ToolContext(
                run_id=call.run_id,
                tenant=call.tenant,
                tool_call_id=call.tool_call_id,
                idempotency_key=call.idempotency_key,
                attempt=call.attempt,
                deadline=datetime.now(timezone.utc) + timedelta(seconds=timeouts.run),
            )
            attempt = _Attempt(ctx, timeouts, started)
            key = self._ledger_key(spec, call)
            look_up_first = call.attempt > 1
            if key is not None:
                held = await self._claim(spec, call, key)
                if isinstance(held, ToolOutcome):
                    return self._outcome(spec, call, held)
                look_up_first = look_up_first or held
            try:
                if spec.effect == ToolEffect.RECONCILABLE and look_up_first and spec.lookup_fn:
                    # A previous attempt (of this run, a reset run, a repair) may have acted before
                    # its answer was lost: find it first. Nothing else runs under the key now.
                    previous = await attempt.run(spec.lookup_fn, ctx)
                    if previous is not None:
                        activity.logger.info("reconciled %s by key %s", spec.name, ctx.idempotency_key)
                        return await self._settled(spec, call, key, bounded_observation(previous))
                    attempt.stop_if_cancelled()
                result = await attempt.run(spec.fn, args, ctx)
            except ToolError as e:
                # Refused by the target: known not applied. Else the attempt is over (not racing
                # anyone now) and it may have applied.
                await self._settle(key, "released" if e.permanent else "unknown")
                raise ApplicationError(str(e), type=e.code, non_retryable=e.permanent) from None
            except ApplicationError as e:
                if e.type != ATTEMPT_STILL_RUNNING:  # still running: it stays claimed
                    await self._settle(key, "unknown")
                raise
            except Exception:
                await self._settle(key, "unknown")
                raise
            return await self._settled(spec, call, key, bounded_observation(result))

    async def _judged(self, call: ToolCall) -> None:
        """The first call after a decision the run took on its roster: the decision, and the
        approved plan's re-check, judged under the current file as the policy activity judges
        them (and logged as it logs them), before anything else of the call happens. Raises
        (non-retryable, the tool not called) when they do not hold, or this worker cannot judge:
        the run then judges the decision again through the policy activity."""
        cap = call.capability
        if cap is not None and cap.judge_digest and (call.judge is None or json_digest(call.judge.model_dump(mode="json")) != cap.judge_digest):
            raise ApplicationError("write refused: the capability names a decision check the call does not carry",
                                   type=CAPABILITY_INVALID, non_retryable=True)
        assert call.judge is not None
        if self.judge is None:
            raise ApplicationError(
                "this worker does not judge decisions (no policy file in this process): the run judges it through "
                "the policy activity", type=JUDGE_UNAVAILABLE, non_retryable=True)
        try:
            verdict = await self.judge(call.judge)
        except Exception as e:  # the file cannot be judged by here: the policy activity waits for it
            raise ApplicationError(f"this worker cannot judge the decision now ({e}): the run judges it through the "
                                   "policy activity", type=JUDGE_UNAVAILABLE, non_retryable=True) from None
        _JUDGED_UNDER_PROBLEM.set(verdict.policy_problem)
        refusal = verdict.refusal or (verdict.then.refusal if verdict.then is not None else None)
        if refusal is not None:
            raise ApplicationError(f"not started: the decision does not hold under the current policy file: {refusal}",
                                   type=DECISION_NOT_HELD, non_retryable=True)

    async def _write_records(self, records: str) -> None:
        """The run's records before this write, into the audit sink before the tool is called
        (refused whole unless the fleet signed them for this run: activities/audit.py). Any
        failure is the sink's: the tool is not called, and the run writes them itself."""
        if self.records is None:
            raise ApplicationError(
                "this worker has no audit sink for the records before a write (worker.create_worker wires it)",
                type=SINK_UNAVAILABLE,
            )
        try:
            packed = base64.b64decode(records, validate=True)
        except ValueError:
            raise ApplicationError("the records before this write are not base64", type=RECORD_UNVERIFIED,
                                   non_retryable=True) from None
        await self.records(packed)

    def _ledger_key(self, spec: ToolSpec, call: ToolCall) -> str | None:
        """The ledger key of a write (an undo included): its idempotency key, which the call's
        capability (minted by the run's workflow code) covers. None for a read."""
        if self.ledger is None or spec.effect == ToolEffect.READ_ONLY:
            return None
        return call.idempotency_key

    async def _claim(self, spec: ToolSpec, call: ToolCall, key: str) -> ToolOutcome | bool:
        """Claim the write before the tool is called. Its recorded outcome when some call already
        did it (the tool is not called again); True when an earlier claim never settled (it may
        have applied) and the tool's effect allows running it again; False when it was free;
        else refused."""
        assert self.ledger is not None
        info = activity.info()
        undo = key.endswith(UNDO_KEY_SUFFIX)
        what = "undo" if undo else "write"
        try:
            held = await self.ledger.claim(key, tool=spec.name, workflow_id=info.workflow_id or "", run_id=info.workflow_run_id or "")
        except Exception as e:  # noqa: BLE001 (any ledger error: the tool is not called)
            log.warning("effect ledger %s unavailable for %s: %s", self.ledger.describe(), key[:200], e)
            # Our own words for a lost ledger (what to do: --new-ledger); else only the error's
            # type on the run (a driver's text stays in the worker log).
            why = f"{type(e).__name__}: {str(e)[:300]}" if isinstance(e, LedgerUnavailable) else type(e).__name__
            raise ApplicationError(
                f"the effect ledger ({self.ledger.describe()}) is unavailable: {why}; "
                f"the {what} was not started, and is scheduled again",
                type=LEDGER_UNAVAILABLE, non_retryable=True,
            ) from None
        if held is None:
            return False
        if held.state == "done":
            log.info("%s %s already done by %s at %s: not started again", what, key[:200], held.by_workflow[:200], held.at)
            return ToolOutcome.model_validate_json(held.outcome)
        rerun = call.capability is not None and call.capability.rerun_unknown
        if spec.effect == ToolEffect.UNSAFE and not rerun:
            raise ApplicationError(
                f"the {what} {call.tool_call_id} ({spec.name}) may have applied: run {held.by_workflow} started it at "
                f"{held.at.isoformat(timespec='seconds')} and its outcome is unknown; {spec.name} is unsafe, so it "
                + ("is re-run only on an approver's recorded instruction (tether compensate RUN --rerun-unknown STEP)"
                   if undo else "is not run again: a person decides (the run hands it off)"),
                type=UNDO_MAY_HAVE_APPLIED if undo else MAY_HAVE_APPLIED,
            )
        if held.state == "claimed" and datetime.now(timezone.utc) - held.at < timedelta(
            seconds=tool_timeouts(spec.timeout_seconds).start_to_close
        ):
            # Another attempt (another run's, a reset run's, a replayed capability's) may still be
            # running it: a run's own next attempt starts only once its last is over, which is
            # later than this. Not a second request now; tried again after a backoff, by then
            # done (or its outcome unknown).
            raise ApplicationError(
                f"the {what} {call.tool_call_id} ({spec.name}) is being run by run {held.by_workflow} "
                f"(started at {held.at.isoformat(timespec='seconds')}): not started twice at once",
                type=UNDO_IN_FLIGHT if undo else IN_FLIGHT,
            )
        await self.ledger.reclaim(key, workflow_id=info.workflow_id or "", run_id=info.workflow_run_id or "")
        return True  # idempotent: the target dedupes on the same key; reconcilable: look it up first

    async def _settle(self, key: str | None, state: str) -> None:
        """Record how an attempt that did not succeed ended (released, unknown). A ledger that
        fails now leaves the claim ``claimed``: a later call treats it as may-have-applied."""
        if key is None or self.ledger is None:
            return
        try:
            await (self.ledger.release(key) if state == "released" else self.ledger.unknown(key))
        except Exception as e:  # noqa: BLE001 (the attempt's own error is what the run must see)
            log.warning("effect ledger %s: could not record %s as %s: %s", self.ledger.describe(), key[:200], state, e)

    async def _settled(self, spec: ToolSpec, call: ToolCall, key: str | None, outcome: ToolOutcome) -> ToolOutcome:
        if key is not None and self.ledger is not None:
            info = activity.info()
            try:
                await self.ledger.done(key, outcome.model_dump_json(), workflow_id=info.workflow_id or "", run_id=info.workflow_run_id or "")
            except Exception as e:  # noqa: BLE001 (the write happened: the run gets its outcome)
                # The claim stays ``claimed``: a later call under the key looks up, re-runs an
                # idempotent tool, or refuses an unsafe one (may have applied); never blind.
                log.warning("effect ledger %s: could not record %s as done: %s", self.ledger.describe(), key[:200], e)
        return self._outcome(spec, call, outcome)

    def _outcome(self, spec: ToolSpec, call: ToolCall, outcome: ToolOutcome) -> ToolOutcome:
        """A write's outcome decides what gets undone: attested with the fleet key (the run checks
        it); a read's is only an observation for the planner."""
        if spec.effect == ToolEffect.READ_ONLY or self.keys is None:
            return outcome
        if call.judge is not None:
            # The file this worker judged the decision by did not load: the run says so, as a
            # policy activity's verdict would have made it (attested with the outcome).
            outcome = outcome.model_copy(update={"policy_problem": _JUDGED_UNDER_PROBLEM.get()})
        return attest(self.keys, attested_call(call), outcome)
