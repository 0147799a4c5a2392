"""Deterministic validation of a planner's proposal against the run's tool catalog snapshot.

The proposal is untrusted input (a model may invent tools or arguments). Every problem becomes
a reason for VALIDATION_FAILED and feedback for the next planning round, never an exception.
Problems name the step, the argument path and the rule that failed, never the value: they go on
the audit timeline, and a value there may be personal data the model copied. Pure: no Temporal,
no I/O; ``new_id`` is passed in so the workflow can supply deterministic ids.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.validators
import re2

from workflows.budgets import FEEDBACK_CHARS, FEEDBACK_PROBLEMS, PROPOSAL_BYTES, clip
from workflows.contract import DELEGATE, GROUP_MAX, Delegation, Limits, Plan, PlanStep, ToolCatalog, ToolEffect
from workflows.wire import Proposal
from workflows.policy import budget_refusal

_TOOL_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")
# Schema keywords whose message may quote the input value: for these we say which rule failed.
_RULES = {
    "type": "has the wrong type (expected {expected})",
    "pattern": "does not match the required pattern",
    "format": "is not in the required format",
    "enum": "is not one of the allowed values",
    "const": "is not the required value",
    "minimum": "is below the minimum {expected}",
    "exclusiveMinimum": "is not above {expected}",
    "maximum": "is above the maximum {expected}",
    "exclusiveMaximum": "is not below {expected}",
    "minLength": "is shorter than {expected} characters",
    "maxLength": "is longer than {expected} characters",
    "minItems": "has fewer than {expected} items",
    "maxItems": "has more than {expected} items",
    "multipleOf": "is not a multiple of {expected}",
}


@dataclass(frozen=True)
class Validation:
    plan: Plan | None
    problems: list[str]

    @property
    def reason(self) -> str:
        """The first problems, bounded: the timeline's reason and the planner's feedback."""
        shown = self.problems[:FEEDBACK_PROBLEMS]
        more = len(self.problems) - len(shown)
        return clip("; ".join(shown) + (f" (+{more} more problems)" if more > 0 else ""), FEEDBACK_CHARS)


def closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown keys refused wherever it lists properties and says nothing else.

    An argument the schema does not name would be hashed and approved, then dropped by the
    tool's model at execution: what is approved must be what runs.
    """
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node and "patternProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def _non_finite_path(value: Any, path: str = "") -> str | None:
    """Where a NaN or infinity sits in the arguments (JSON has no such number), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(root)"
    if isinstance(value, dict):
        for k, v in value.items():
            if (found := _non_finite_path(v, f"{path}/{k}" if path else str(k))) is not None:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            if (found := _non_finite_path(v, f"{path}/{i}" if path else str(i))) is not None:
                return found
    return None


def _describe(error: jsonschema.ValidationError) -> str:
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    if error.validator == "required":
        missing = [p for p in error.validator_value if p not in (error.instance or {})]
        return f"{where}: missing required {', '.join(map(str, missing))[:200]}"
    if error.validator == "additionalProperties":
        patterns = list(error.schema.get("patternProperties", {}))
        extra = sum(
            1 for k in (error.instance or {})
            if k not in error.schema.get("properties", {}) and not any(pattern_search(p, k) for p in patterns)
        )
        return f"{where}: {extra} argument(s) the tool does not take"
    template = _RULES.get(str(error.validator), "fails the '{rule}' rule")
    return f"{where}: " + template.format(expected=str(error.validator_value)[:60], rule=error.validator)


def _args_problem(args: object, schema: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """Arguments as a dict, or why they are not acceptable (path and rule, never the value)."""
    if isinstance(args, str):
        # Models often send arguments as a JSON string; malformed JSON is a validation failure.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return None, f"arguments are not valid JSON ({e.msg} at position {e.pos})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, f"arguments must be a JSON object, got {type(args).__name__}"
    if (where := _non_finite_path(args)) is not None:
        return None, f"invalid arguments at {where}: not a finite number (NaN and infinities are refused)"
    if (refused := schema_problem(schema)) is not None:
        return None, f"the tool's schema cannot be checked: {refused}"
    validator = BoundedValidator(closed_schema(schema))
    try:
        errors = sorted(validator.iter_errors(args), key=lambda e: list(e.absolute_path))
    except PatternError as e:  # a pattern inside a $ref'd definition schema_problem missed
        return None, f"the tool's schema cannot be checked: {e}"
    if errors:
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        return None, f"invalid arguments at {_describe(errors[0])}{more}"
    return args, None


def validate_proposal(
    proposal: Proposal,
    catalog: ToolCatalog,
    *,
    executed_steps: int,
    limits: Limits,
    new_id: Callable[[int], str],
    tool_refusal: Callable[[str], str | None] = lambda tool: None,
    delegation_problem: Callable[[dict[str, Any]], str | None] = lambda args: "this run cannot delegate",
) -> Validation:
    """Check every proposed step; return a plan with fresh tool call ids, or the problems. The
    plan carries each step's declared compensation and its hash covers them."""
    if proposal.oversized_bytes is not None:
        return Validation(
            plan=None,
            problems=[
                f"the proposal is {proposal.oversized_bytes} bytes, over the {PROPOSAL_BYTES}-byte "
                f"budget (sha256 {str(proposal.oversized_digest)[:16]}): propose fewer or smaller steps"
            ],
        )
    problems: list[str] = []
    if not proposal.steps:
        problems.append("the proposal has no steps and no answer")
    budget = budget_refusal(executed_steps, len(proposal.steps), limits)
    if budget:
        problems.append(budget)
    steps: list[PlanStep] = []
    for i, proposed in enumerate(proposal.steps, start=1):
        info = catalog.get(proposed.tool)
        if info is None:
            name = repr(proposed.tool) if _is_tool_name(proposed.tool) else "(not a tool name)"
            known = ", ".join(sorted(t.name for t in catalog.tools)) or "none"
            problems.append(f"step {i}: unknown tool {name} (known: {known})")
            continue
        if (refused := tool_refusal(info.name)) is not None:
            problems.append(f"step {i}: {refused}")
            continue
        args, problem = _args_problem(proposed.args, info.args_schema)
        if problem is None and info.name == DELEGATE:
            problem = delegation_problem(args or {})
        if problem:
            problems.append(f"step {i} ({info.name}): {problem}")
            continue
        steps.append(
            PlanStep(tool_call_id=new_id(executed_steps + i), tool=info.name, args=args or {}, group=proposed.group)
        )
    if not problems:
        problems.extend(group_problems(steps, catalog, steps_left=limits.max_steps - executed_steps))
    if problems:
        return Validation(plan=None, problems=problems)
    steps = [s if s.group is None or _members(steps, s.group) > 1 else s.model_copy(update={"group": None}) for s in steps]
    undo = [info.compensate if (info := catalog.get(s.tool)) else None for s in steps]
    try:
        plan_hash = Plan.hash_steps(steps, undo)
    except ValueError as e:  # e.g. an integer beyond what JSON numbers carry exactly
        return Validation(plan=None, problems=[f"arguments cannot be hashed exactly: {str(e)[:200]}"])
    return Validation(plan=Plan(steps=steps, plan_hash=plan_hash, undo=undo), problems=[])


# Effect classes that may run in a parallel group: a retry or a second attempt changes nothing.
PARALLEL_EFFECTS = frozenset({ToolEffect.READ_ONLY, ToolEffect.IDEMPOTENT})


def _members(steps: list[PlanStep], group: int) -> int:
    return sum(1 for s in steps if s.group == group)


def group_problems(steps: list[PlanStep], catalog: ToolCatalog, *, steps_left: int | None = None) -> list[str]:
    """Why the plan's parallel groups cannot run as proposed: a group's steps stand next to one
    another, number at most GROUP_MAX, and are read-only or idempotent or delegations (an unsafe
    or reconcilable step never runs beside another: its outcome must be known before anything
    else runs); the child runs a group starts at once ask, together, at most ``steps_left``."""
    problems: list[str] = []
    seen: set[int] = set()
    previous: int | None = None
    for i, step in enumerate(steps, start=1):
        group = step.group
        if group is not None and group != previous:
            if group in seen:
                problems.append(f"step {i} ({step.tool}): parallel group {group} is split by other steps")
            seen.add(group)
            if (count := _members(steps, group)) > GROUP_MAX:
                problems.append(f"parallel group {group}: {count} steps, over the {GROUP_MAX} a group may hold")
            asked = sum(Delegation.model_validate(s.args).max_steps for s in steps if s.group == group and s.tool == DELEGATE)
            if steps_left is not None and asked > steps_left:
                problems.append(f"parallel group {group}: its delegations ask {asked} steps together, over the "
                                f"{steps_left} this run has left (the step budget): give them fewer max_steps")
        previous = group
        info = catalog.get(step.tool)
        if group is not None and _members(steps, group) > 1 and info is not None and info.effect not in PARALLEL_EFFECTS:
            problems.append(
                f"step {i} ({step.tool}): a {info.effect.value} step never runs in parallel (only read_only and "
                "idempotent steps do): propose it on its own, after the group"
            )
    return problems


# ----------------------------------------------------------------------------- bounded-cost regexes
#
# A schema's ``pattern`` and ``patternProperties`` run on the model's arguments inside the
# workflow, holding the worker's only thread for workflow code. Python's ``re`` backtracks: one
# 32-character argument against ``^(\w+\s?)+$`` takes minutes. They run on RE2 instead (google-re2):
# time linear in the input, memory bounded per pattern. A pattern RE2 cannot take (backreferences,
# lookaround, a repetition over 1000) makes the tool's schema unusable: the catalog leaves the
# tool out with the reason (:func:`schema_problem`), and a schema that still carries one (an old
# snapshot) fails the step, never falls back to ``re``. Formats are annotations only (no format
# checker is configured), so no format regex ever runs on an argument.

# The memory RE2 may use for one compiled pattern; a pattern needing more is refused.
PATTERN_MAX_MEM = 1 << 20
PATTERN_MAX_CHARS = 1000


class PatternError(ValueError):
    """A schema pattern the linear-time engine cannot take, with RE2's reason."""


def _is_tool_name(name: str) -> bool:
    return 1 <= len(name) <= 64 and all(ch in _TOOL_NAME_CHARS for ch in name)


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    if len(pattern) > PATTERN_MAX_CHARS:
        raise PatternError(f"pattern longer than {PATTERN_MAX_CHARS} characters")
    options = re2.Options()
    options.log_errors = False
    options.max_mem = PATTERN_MAX_MEM
    try:
        return re2.compile(pattern, options=options)
    except re2.error as e:
        detail = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise PatternError(detail[:200]) from None


def pattern_search(pattern: str, text: str) -> bool:
    """``re.search`` semantics (JSON Schema patterns are unanchored), in time linear in ``text``."""
    return _compiled(pattern).search(text) is not None


# Keywords whose values are data, not schemas: a "pattern" key inside them is no regex.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _schemas(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (sub)schema object in a schema, with its JSON pointer."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            if key not in _DATA_KEYWORDS:
                yield from _schemas(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _schemas(value, f"{path}/{i}")


def _patterns(schema: Any) -> Iterator[tuple[str, Any]]:
    """Every regex a schema holds (``pattern`` values, ``patternProperties`` keys), with where."""
    for path, node in _schemas(schema):
        if isinstance(node.get("pattern"), str):
            yield f"{path}/pattern", node["pattern"]
        if isinstance(props := node.get("patternProperties"), dict):
            for key in props:
                yield f"{path}/patternProperties", key


def schema_problem(schema: Any) -> str | None:
    """Why a tool's argument schema cannot be checked in bounded time, or None.

    The catalog (Python tools and MCP listings alike) leaves such a tool out with this reason.
    """
    for where, pattern in _patterns(schema):
        if not isinstance(pattern, str):
            continue  # check_schema reports a non-string pattern
        try:
            _compiled(pattern)
        except PatternError as e:
            return f"schema pattern at {where or '/'} cannot run in linear time (RE2: {e})"
    nodes = [node for _, node in _schemas(schema)]
    if any("unevaluatedProperties" in n for n in nodes) and any("patternProperties" in n for n in nodes):
        # jsonschema evaluates this pair with Python's backtracking re: not offered.
        return "schema combines unevaluatedProperties with patternProperties (not supported)"
    return None


def _pattern(validator: Any, patrn: str, instance: Any, schema: dict[str, Any]) -> Iterator[jsonschema.ValidationError]:
    if validator.is_type(instance, "string") and not pattern_search(patrn, instance):
        yield jsonschema.ValidationError("does not match the required pattern")


def _pattern_properties(validator: Any, pattern_properties: dict[str, Any], instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for patrn, subschema in pattern_properties.items():
        for k, v in instance.items():
            if pattern_search(patrn, k):
                yield from validator.descend(v, subschema, path=k, schema_path=patrn)


def _additional_properties(validator: Any, ap: Any, instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [
        k for k in instance
        if k not in properties and not any(pattern_search(p, k) for p in patterns)
    ]
    if validator.is_type(ap, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], ap, path=extra)
    elif not ap and extras:
        yield jsonschema.ValidationError(f"{len(extras)} additional properties are not allowed")


# Draft 2020-12 with every regex keyword on RE2 (unevaluatedProperties + patternProperties is
# refused by schema_problem, so jsonschema's own re never sees an argument).
BoundedValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    {
        "pattern": _pattern,
        "patternProperties": _pattern_properties,
        "additionalProperties": _additional_properties,
    },
)
