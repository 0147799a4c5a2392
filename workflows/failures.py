"""What a failed activity tells the engine (code, message, permanent?, suggested delay, over?),
and the worker log line that keeps the error's text off the record."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, TimeoutError

from workflows.run_model import ToolFailure
from workflows.wire import ATTEMPT_STILL_RUNNING


def log_failure(tool_call_id: str, failure: ToolFailure) -> None:
    # The error's text stays in the worker log: it may quote arguments, so the timeline and
    # last_error only name its code.
    workflow.logger.warning("tool call %s failed [%s]: %s", tool_call_id, failure.code, failure.message)


def activity_failure(err: ActivityError) -> ToolFailure:
    """What a failed activity tells the engine: code, message, permanent?, suggested delay,
    and whether the attempt is known to be over."""
    cause = err.cause
    if isinstance(cause, ApplicationError):
        delay = cause.next_retry_delay.total_seconds() if cause.next_retry_delay else None
        code = cause.type or "error"
        return ToolFailure(
            code, cause.message, cause.non_retryable, delay, still_running=code == ATTEMPT_STILL_RUNNING
        )
    if isinstance(cause, TimeoutError):
        # start_to_close: the deadline plus the grace period passed; heartbeat: the worker is
        # gone. Either way the attempt is over, its outcome unknown.
        code = f"timeout_{cause.type.name.lower()}" if cause.type else "timeout"
        return ToolFailure(code, "no result in time (timeout or worker crash): outcome unknown", False)
    if isinstance(cause, CancelledError):
        # The server cancels an attempt no worker had started; a started one reports how its
        # tool ended (tether/tools/sdk.py), so a cancel of a started one is not expected.
        started = bool(err.started_event_id)
        return ToolFailure("cancelled", "activity cancelled", False, started=started)
    return ToolFailure(type(cause).__name__ if cause else "error", str(cause or err), False)
