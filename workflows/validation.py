"""Deterministic validation of a planner's proposal against the run's tool catalog snapshot.

The proposal is untrusted input (a model may invent tools or arguments). Every problem becomes
a reason for VALIDATION_FAILED and feedback for the next planning round, never an exception.
Problems name the step, the argument path and the rule that failed, never the value: they go on
the audit timeline, and a value there may be personal data the model copied. Pure: no Temporal,
no I/O; ``new_id`` is passed in so the workflow can supply deterministic ids.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from workflows.budgets import FEEDBACK_CHARS, FEEDBACK_PROBLEMS, PROPOSAL_BYTES, clip
from workflows.models import Limits, Plan, PlanStep, Proposal, ToolCatalog
from workflows.policy import budget_refusal

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
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


def closed_schema(schema: dict) -> dict:
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
        extra = len(set(error.instance or {}) - set(error.schema.get("properties", {})))
        return f"{where}: {extra} argument(s) the tool does not take"
    template = _RULES.get(str(error.validator), "fails the '{rule}' rule")
    return f"{where}: " + template.format(expected=str(error.validator_value)[:60], rule=error.validator)


def _args_problem(args: object, schema: dict) -> tuple[dict | None, str | None]:
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
    validator = jsonschema.Draft202012Validator(closed_schema(schema))
    errors = sorted(validator.iter_errors(args), key=lambda e: list(e.absolute_path))
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
    recovery: bool = True,
) -> Validation:
    """Check every proposed step; return a plan with fresh tool call ids, or the problems.

    ``recovery``: the plan carries each step's declared compensation and its hash covers them
    (False only for runs recorded before recovery existed, so their hashes stay as they were).
    """
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
            name = repr(proposed.tool) if _TOOL_NAME.match(proposed.tool) else "(not a tool name)"
            known = ", ".join(sorted(t.name for t in catalog.tools)) or "none"
            problems.append(f"step {i}: unknown tool {name} (known: {known})")
            continue
        if (refused := tool_refusal(info.name)) is not None:
            problems.append(f"step {i}: {refused}")
            continue
        args, problem = _args_problem(proposed.args, info.args_schema)
        if problem:
            problems.append(f"step {i} ({info.name}): {problem}")
            continue
        steps.append(
            PlanStep(tool_call_id=new_id(executed_steps + i), tool=info.name, args=args or {})
        )
    if problems:
        return Validation(plan=None, problems=problems)
    undo = [info.compensate if (info := catalog.get(s.tool)) else None for s in steps] if recovery else None
    try:
        plan_hash = Plan.hash_steps(steps, undo)
    except ValueError as e:  # e.g. an integer beyond what JSON numbers carry exactly
        return Validation(plan=None, problems=[f"arguments cannot be hashed exactly: {str(e)[:200]}"])
    return Validation(plan=Plan(steps=steps, plan_hash=plan_hash, undo=undo), problems=[])
