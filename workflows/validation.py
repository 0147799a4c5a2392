"""Deterministic validation of a planner's proposal against the run's tool catalog snapshot.

The proposal is untrusted input (a model may invent tools or arguments). Every problem becomes
a reason string for VALIDATION_FAILED and feedback for the next planning round, never an
exception. Pure: no Temporal, no I/O; ``new_id`` is passed in so the workflow can supply
deterministic ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema

from workflows.models import Limits, Plan, PlanStep, Proposal, ToolCatalog
from workflows.policy import budget_refusal


@dataclass(frozen=True)
class Validation:
    plan: Plan | None
    problems: list[str]

    @property
    def reason(self) -> str:
        return "; ".join(self.problems)


def _args_problem(args: object, schema: dict) -> tuple[dict | None, str | None]:
    """Arguments as a dict, or why they are not acceptable."""
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
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(args), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.absolute_path) or "(root)"
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        return None, f"invalid arguments at {where}: {first.message[:200]}{more}"
    return args, None


def validate_proposal(
    proposal: Proposal,
    catalog: ToolCatalog,
    *,
    executed_steps: int,
    limits: Limits,
    new_id: Callable[[int], str],
    tool_refusal: Callable[[str], str | None] = lambda tool: None,
) -> Validation:
    """Check every proposed step; return a plan with fresh tool call ids, or the problems."""
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
            known = ", ".join(sorted(t.name for t in catalog.tools)) or "none"
            problems.append(f"step {i}: unknown tool {proposed.tool[:80]!r} (known: {known})")
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
    return Validation(plan=Plan(steps=steps, plan_hash=Plan.hash_steps(steps)), problems=[])
