"""One run as Temporal holds it, read the same way by a client and by repair: its description,
whether its workflow task keeps failing, and the view it published (checked against the fleet's
public keys)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ValidationError
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from tether.connection import QUERY_TIMEOUT, TetherError, UsageError, rpc_error
from workflows.published import VIEW_MEMO
from workflows.run_state import RunView


class ViewUnverified(TetherError):
    """A run's memo holds a view the fleet's key did not sign for that run: whoever completes a
    task (or starts a workflow) can write a memo. Never shown as the run's state."""

    def __init__(self, message: str) -> None:
        super().__init__(message, rule="view_unverified")


_PUBLIC_KEYS: Any = None


def public_keys() -> Any:
    """The fleet's public keys (TETHER_PUBLIC_KEYS, else the ring's .pub, else the ring): what
    verifies a view or a record; TetherError naming the setting when there are none."""
    global _PUBLIC_KEYS
    if _PUBLIC_KEYS is None:
        from tether.store.keys import KeyRingError, PublicKeys

        try:
            _PUBLIC_KEYS = PublicKeys.from_env()
        except KeyRingError as e:
            raise UsageError(str(e)) from None
    return _PUBLIC_KEYS


async def published_view(description: Any) -> RunView | None:
    """The RunView the run last published in its memo (None: it has published none yet).
    ViewUnverified when the fleet's key did not sign it for this run."""
    try:
        view = await description.memo_value(VIEW_MEMO, None, type_hint=RunView)
        # Published packed (RunView.packed): a binary payload, read back as bytes.
        view = view if view is None or isinstance(view, RunView) else RunView.model_validate(view)
    except (ValueError, TypeError, KeyError, ValidationError) as e:  # another version's, or encrypted by a key not here
        raise UsageError(f"run {description.id} published a view this client cannot read ({type(e).__name__}): "
                          f"is TETHER_ENCRYPTION_KEY_FILE the workers' key?") from None
    if view is None:
        return None
    return verified_view(description, view, "")


def verified_view(description: Any, view: RunView, what: str) -> RunView:
    """``view`` when the fleet's key signed it for the run ``description`` names, else
    ViewUnverified (``what``: which view, for the message; "" for the published one)."""
    from tether.audit.verify import view_problem

    try:
        why = view_problem(public_keys(), description.id, description.run_id, view)
    except TetherError as e:
        why = f"it cannot be verified here ({e})"
    if why is not None:
        raise ViewUnverified(f"{what + ' ' if what else ''}unverified: {why}")
    return view


class StuckTask(BaseModel):
    """A run whose workflow task keeps failing: no worker moves it on while the cause stays
    (``tether repair RUN``)."""

    attempt: int  # the pending workflow task's attempt (2: the task failed once)
    cause: str  # Temporal's WorkflowTaskFailedCause, e.g. NON_DETERMINISTIC_ERROR
    # The failure that began the streak: Temporal records the first failure of a streak in the
    # history, not the attempts after it.
    error: str
    event_id: int | None = None  # its WorkflowTaskFailed event
    since: datetime | None = None


async def describe(client: Client, run_id: str) -> Any:
    """The run's current execution, described (TetherError for an unknown run or no answer)."""
    try:
        return await client.get_workflow_handle(run_id).describe(rpc_timeout=QUERY_TIMEOUT)
    except RPCError as e:
        raise rpc_error(e, run_id) from None


def open_children(description: Any) -> list[str]:
    """The workflow ids of the run's open child executions, as the server records them (its
    pending children: a delegation's child the run started and has not seen end)."""
    return [c.workflow_id for c in description.raw_description.pending_children]


async def stuck_task(client: Client, description: Any) -> StuckTask | None:
    """Whether the run's workflow task keeps failing (its pending task is past its first attempt),
    and with what: the WorkflowTaskFailed event that began the streak, read from the history's
    end."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
    from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest

    task = description.raw_description.pending_workflow_task
    if description.status != WorkflowExecutionStatus.RUNNING or task.attempt < 2:
        return None
    stuck = StuckTask(attempt=task.attempt, cause="unknown", error="(no failure recorded)")
    if task.HasField("original_scheduled_time"):
        stuck.since = task.original_scheduled_time.ToDatetime(timezone.utc)
    token = b""
    try:
        for _ in range(5):  # the streak's first failure is within the history's last events
            page = await client.workflow_service.get_workflow_execution_history_reverse(
                GetWorkflowExecutionHistoryReverseRequest(
                    namespace=client.namespace,
                    execution=WorkflowExecution(workflow_id=description.id, run_id=description.run_id),
                    maximum_page_size=100,
                    next_page_token=token,
                ),
                timeout=QUERY_TIMEOUT,
            )
            for event in page.history.events:
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                    return stuck  # no failure after the last completed task: timeouts, not failures
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                    failed = event.workflow_task_failed_event_attributes
                    stuck.cause = WorkflowTaskFailedCause.Name(failed.cause).removeprefix("WORKFLOW_TASK_FAILED_CAUSE_")
                    stuck.event_id = event.event_id
                    try:
                        error = await client.data_converter.decode_failure(failed.failure)
                        stuck.error = str(error) or failed.failure.message
                    except Exception:  # noqa: BLE001 (encoded with a key this client lacks)
                        stuck.error = failed.failure.message
                    return stuck
            token = page.next_page_token
            if not token:
                break
    except RPCError as e:
        raise rpc_error(e, description.id) from None
    return stuck


class RepairResult(BaseModel):
    """What ``tether repair`` (or a forced hand-off) did: the reset, where to, and what the new
    run does again (or, a forced hand-off, never runs again)."""

    run_id: str  # the workflow id
    from_run_id: str  # the stuck execution
    to_run_id: str  # the new execution the reset made
    event_id: int  # the WorkflowTaskCompleted event reset to: that task is done again
    failure: StuckTask | None = None
    skipped: list[int] = []  # later completed tasks whose history does not replay on this code
    reapplied: int = 0  # signals and Updates after the reset point, applied again to the new run
    rerun: list[str] = []  # tool calls whose results the reset drops: run again under their keys
    in_flight: list[str] = []  # a forced hand-off: writes the reset drops, not run again (they may have applied)
