"""A hand-off to a human (``handoff``): through the run's handoff signal, answered by the run's
record of it; forced on a stuck run by a reset the worker's side makes (``ForcedReset``).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from workflows import policy
from workflows.contract import HandoffRequest
from tether.connection import NoWorker, Refused, TetherError, UsageError, rpc_error
from tether.runs import RepairResult, stuck_task
from tether.client.decisions import VERDICT_TIMEOUT, Verdict, _await_record
from tether.client.errors import _refused, invalid
from tether.client.workers import has_worker, no_worker_message
from tether.client.signing import sign
from tether.client.reads import snapshot


class ForcedReset(Protocol):
    """The worker's side of a forced hand-off (``tether.repair.HandoffReset``): where the stuck run
    resets to, with the writes the reset leaves out, and the reset itself, the hand-off applied."""

    async def point(self, client: Client, description: Any) -> RepairResult: ...

    async def reset(self, client: Client, run_id: str, base_run_id: str, event_id: int, reason: str, *,
                    handoff: HandoffRequest) -> str: ...


async def handoff(
    client: Client, run_id: str, *, by: str, reason: str, decision_id: str | None = None,
    key: Path | None = None, timeout: float = VERDICT_TIMEOUT, force: bool = False, forced: ForcedReset | None = None,
) -> Verdict:
    """Hand the run to a human; returns the run's record of it (HANDED_OFF), or raises REFUSED
    with the rule (not a member of the tenant, already ended, a handoff already pending).

    A run in the middle of a tool call hands off once the call has settled: ``record`` is None
    when that takes longer than ``timeout``.

    ``force``: a run whose workflow tasks keep failing never takes a signal. The hand-off is
    signalled to the execution judged, which is then reset (``reset_judged``: compare-and-set)
    to its newest completed task that replays with no tool call pending at it, the hand-off
    applied again: the new run takes it before it schedules anything. The tool calls the reset
    leaves out were in flight and may have applied: the hand-off names them
    (``HandoffRequest.in_flight``), the run never runs them again and records its step's outcome
    as unknown. The reset is the worker's side (a replay of the run on this build's code):
    ``forced`` does it (``tether.repair.HandoffReset``, which the CLI hands in); this library
    only asks it.
    """
    try:
        request = HandoffRequest(by=by, reason=reason, decision_id=decision_id or uuid.uuid4().hex)
    except ValidationError as e:
        raise invalid("handoff", e) from None
    handle = client.get_workflow_handle(run_id)
    try:
        description = await handle.describe()
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    if description.status != WorkflowExecutionStatus.RUNNING:
        raise Refused(f"run {run_id} already finished")
    if not await has_worker(client, description.task_queue):
        raise NoWorker(no_worker_message(description.task_queue))
    reset = None
    if force:
        if forced is None:
            raise UsageError("a forced hand-off resets the run, which is the worker's side: pass "
                             "forced=tether.repair.HandoffReset() (`tether handoff --force` does)")
        reset = await forced.point(client, description)
        try:
            request = HandoffRequest.model_validate({**request.model_dump(), "in_flight": reset.in_flight})
        except ValidationError as e:
            raise invalid("handoff", e) from None
    elif (stuck := await stuck_task(client, description)) is not None:
        raise Refused(
            f"run {run_id} is stuck (workflow task attempt {stuck.attempt} failing: {stuck.cause}): it takes no "
            f"signal, a hand-off included. Heal it (`tether repair {run_id}`) or end it on the record "
            f"(`tether handoff {run_id} --force --by NAME --reason TEXT`)")
    if key is not None:
        snap = await snapshot(client, run_id)
        payload = policy.signature_payload(
            workflow_id=run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, request_id="",
            plan_hash="", kind="handoff", decision_id=request.decision_id or "", signer=request.by,
        )
        request.signature = sign(key, payload)
    if reset is not None:
        why = f"tether handoff --force by {by}: {reason}"
        assert forced is not None
        reset.to_run_id = await forced.reset(client, run_id, reset.from_run_id, reset.event_id, why, handoff=request)
    else:
        try:
            await handle.signal("handoff", request)
        except RPCError as e:
            raise rpc_error(e, run_id) from None
    record = await _await_record(client, run_id, request.decision_id or "", timeout)
    try:
        _refused(record)
    except TetherError as e:
        if reset is None:
            raise
        raise Refused(
            f"{e}; run {reset.from_run_id} was reset all the same (new run {reset.to_run_id}), which does not run "
            f"again what was in flight: {', '.join(reset.in_flight) or 'nothing'} (may have applied)", rule=e.rule,
        ) from None
    return Verdict(run_id=run_id, decision_id=request.decision_id or "", record=record, reset=reset)
