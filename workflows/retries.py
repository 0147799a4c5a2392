"""The retry rule of a tool call, from what the tool declares about itself: the clock of one
attempt, what a failure says about its effect, whether to retry, and how long to wait first.
Pure: the engine's steps phase and the tool activity call these with the facts they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from workflows.contract import ToolEffect
from workflows.states import EffectOutcome, RunState

RETRY_BASE_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0


@dataclass(frozen=True)
class ToolTimeouts:
    """The clock of one tool attempt, all derived from the tool's declared timeout.

    The tool runs until ``run`` seconds after the attempt started (``ToolContext.deadline``).
    The activity waits for it ``grace / 2`` longer and then reports it as still running; the
    server gives the attempt ``run + grace`` (start_to_close) and declares its worker gone when
    no heartbeat came for ``heartbeat`` seconds.
    """

    run: float
    grace: float
    heartbeat: float

    @property
    def start_to_close(self) -> float:
        return self.run + self.grace


def tool_timeouts(timeout_seconds: float) -> ToolTimeouts:
    # Heartbeats go out every 0.8 x heartbeat (the SDK's throttle): at least 2 s, so a busy
    # machine does not miss one and a live attempt is not taken for a dead worker.
    return ToolTimeouts(
        run=timeout_seconds,
        grace=min(max(timeout_seconds * 0.5, 1.0), 30.0),
        heartbeat=min(max(timeout_seconds / 2, 2.0), 30.0),
    )


def failure_outcome(effect: ToolEffect, *, permanent: bool, started: bool = True) -> EffectOutcome:
    """What a failed attempt says about its effect: ``failed`` when it cannot have applied (a
    read, a call refused as permanent, a call that never started), else ``unknown``."""
    if effect == ToolEffect.READ_ONLY or permanent or not started:
        return "failed"
    return "unknown"


def after_tool_failure(
    effect: ToolEffect, *, permanent: bool, retries_done: int, max_retries: int, attempt_over: bool = True
) -> tuple[RunState, str]:
    """The retry rule, from what the tool declares about itself.

    Returns the next state (RETRY_WAIT, EXECUTION_FAILED or HANDED_OFF) and why. A write whose
    outcome stays unknown ends in HANDED_OFF: EXECUTION_FAILED means "failed, nothing applied".
    """
    if permanent:
        return RunState.EXECUTION_FAILED, "permanent error: not retried"
    if effect == ToolEffect.UNSAFE:
        # Not idempotent and nothing to look up: a second call could repeat the effect.
        return RunState.HANDED_OFF, "unsafe tool, outcome unknown: not re-run, needs a human"
    if not attempt_over and effect != ToolEffect.READ_ONLY:
        # A retry (or a lookup) now could race the attempt that is still running.
        return RunState.HANDED_OFF, "outcome unknown, the attempt may still be running: not retried, needs a human"
    if retries_done >= max_retries:
        if effect == ToolEffect.READ_ONLY:
            return RunState.EXECUTION_FAILED, f"retries exhausted ({retries_done}/{max_retries})"
        return RunState.HANDED_OFF, f"retries exhausted ({retries_done}/{max_retries}), outcome unknown: needs a human"
    return RunState.RETRY_WAIT, f"retry {retries_done + 1}/{max_retries}"


def settle_seconds(timeouts: ToolTimeouts, code: str) -> float:
    """How long after a write attempt whose outcome is unknown ended the next one may start.

    A request it sent may still be landing at the target: give it the grace period. After a
    heartbeat timeout the worker may only be cut off from Temporal, its tool still running
    until its deadline: wait as long as a whole attempt may last, which ends past that
    deadline plus the grace period.
    """
    if code == "timeout_heartbeat":
        return timeouts.start_to_close
    return timeouts.grace


def retry_delay_seconds(retries_done: int, suggested: float | None = None, settle: float = 0.0) -> float:
    """Exponential backoff, unless the tool suggested a delay (e.g. from Retry-After); never
    less than ``settle`` (the previous attempt must be over before the next starts)."""
    if suggested is not None and suggested > 0:
        delay = min(suggested, RETRY_MAX_SECONDS * 10)
    else:
        delay = min(RETRY_BASE_SECONDS * 2**retries_done, RETRY_MAX_SECONDS)
    return max(delay, settle)
