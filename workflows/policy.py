"""Pure policy decisions: does a plan need approval, may this decision count, is budget left.

No Temporal, no I/O: the workflow calls these with the facts it holds, tests call them directly.
Each refusal is a short reason a person can act on; ``None`` means allowed.
"""

from __future__ import annotations

from datetime import datetime

from workflows.models import ApprovalDecision, Limits, Plan, RunData, ToolCatalog, ToolEffect
from workflows.states import RunState


def steps_needing_approval(plan: Plan, catalog: ToolCatalog) -> list[str]:
    """Names of the plan's tools that ask for approval (writes, by default)."""
    names = []
    for step in plan.steps:
        info = catalog.get(step.tool)
        # A tool missing from the catalog cannot pass validation; treat it as a write anyway.
        if info is None or info.requires_approval:
            names.append(step.tool)
    return names


def needs_approval(plan: Plan, catalog: ToolCatalog) -> bool:
    return bool(steps_needing_approval(plan, catalog))


def decision_refusal(
    decision: ApprovalDecision, data: RunData, *, requested_by: str, now: datetime
) -> str | None:
    """Why an approve/reject decision does not count, or None when it does."""
    if decision.decision_id in data.decisions_seen:
        return f"duplicate decision_id {decision.decision_id}: already handled"
    state = data.lifecycle.state
    pending = data.pending_approval
    if state != RunState.AWAITING_APPROVAL or pending is None:
        return f"run is {state.value}, not AWAITING_APPROVAL"
    if decision.plan_hash != pending.plan_hash:
        return (
            f"stale plan hash {decision.plan_hash[:12]}: the pending plan is "
            f"{pending.plan_hash[:12]}"
        )
    if now >= pending.expires_at:
        return f"approval expired at {pending.expires_at.isoformat()}"
    if not decision.approver.strip():
        return "approver is empty"
    return None


def handoff_refusal(data: RunData) -> str | None:
    if data.lifecycle.terminal:
        return f"run already ended in {data.lifecycle.state.value}"
    return None


def budget_refusal(executed_steps: int, proposed_steps: int, limits: Limits) -> str | None:
    """The step budget: tool calls already made plus the ones proposed."""
    if executed_steps + proposed_steps > limits.max_steps:
        left = max(limits.max_steps - executed_steps, 0)
        return (
            f"step budget exhausted: {proposed_steps} step(s) proposed, {left} of "
            f"max_steps={limits.max_steps} left"
        )
    return None


def may_replan(replans_used: int, limits: Limits) -> bool:
    return replans_used < limits.max_replans


# ----------------------------------------------------------------------------- tool failures

RETRY_BASE_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0


def after_tool_failure(
    effect: ToolEffect, *, permanent: bool, retries_done: int, max_retries: int
) -> tuple[RunState, str]:
    """The retry rule, from what the tool declares about itself.

    Returns the next state (RETRY_WAIT, EXECUTION_FAILED or HANDED_OFF) and why.
    """
    if permanent:
        return RunState.EXECUTION_FAILED, "permanent error: not retried"
    if effect == ToolEffect.UNSAFE:
        # Not idempotent and nothing to look up: a second call could repeat the effect.
        return RunState.HANDED_OFF, "unsafe tool, outcome unknown: not re-run, needs a human"
    if retries_done >= max_retries:
        return RunState.EXECUTION_FAILED, f"retries exhausted ({retries_done}/{max_retries})"
    return RunState.RETRY_WAIT, f"retry {retries_done + 1}/{max_retries}"


def retry_delay_seconds(retries_done: int, suggested: float | None = None) -> float:
    """Exponential backoff, unless the tool suggested a delay (e.g. from Retry-After)."""
    if suggested is not None and suggested > 0:
        return min(suggested, RETRY_MAX_SECONDS * 10)
    return min(RETRY_BASE_SECONDS * 2**retries_done, RETRY_MAX_SECONDS)


def risk_summary(plan: Plan, catalog: ToolCatalog) -> str:
    """One line for approvers: how many steps write, with which effect."""
    writes = []
    for step in plan.steps:
        info = catalog.get(step.tool)
        if info is not None and info.effect != ToolEffect.READ_ONLY:
            writes.append(f"{step.tool} ({info.effect.value})")
    if not writes:
        return f"{len(plan.steps)} step(s), all read-only"
    return f"{len(writes)} of {len(plan.steps)} step(s) write: " + ", ".join(writes)
