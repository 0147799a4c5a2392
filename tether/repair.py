"""Repair: a stuck run reset to the last workflow task that replays on this code, and the reset a
forced hand-off makes. Repair is worker configuration: it replays the run's history with the
replayer a worker of this build would have (``tether.replay``: the workflow, the fleet's key ring,
the sandbox), and judges the writes a reset drops by the tools' effects.

The worker's side, which the client library does not import: the CLI runs ``tether repair``
(``repair_tree``) here, and hands a forced hand-off's reset to the client as
:class:`HandoffReset` (``tether.client.handoff(..., forced=HandoffReset())``).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError

from tether.client.operations import snapshot_or_listed
from tether.client.reads import tree_spend
from tether.connection import QUERY_TIMEOUT, REFUSED, Refused, TetherError, UsageError, rpc_error
from tether.runs import RepairResult, StuckTask, ViewUnverified, describe, published_view, stuck_task
from workflows.contract import HandoffRequest

# Completed workflow tasks tried, newest first, for one that replays on this code.
REPAIR_CANDIDATES = 20
# The namespace of reset request ids (uuid5): fixed, so every client derives the same id.
RESET_IDS = uuid.UUID("5b0f3c1e-8a52-4d0e-9b57-3f2d6c1a9e47")
# A write whose result a reset drops is run again under its own idempotency key: only where the
# target system dedupes by that key, or nothing was written at all.
RERUN_SAFE = {"read_only", "idempotent"}
RESET_CLAIM_TYPE = "TetherResetClaim"  # a workflow type no worker serves: its id is the claim
RESET_CLAIM_QUEUE = "tether-reset-claims"  # a task queue no worker polls


def reset_request_id(base_run_id: str, event_id: int) -> str:
    """A reset's request id, derived from the execution judged and the task reset to (the same
    judgement, the same id: Temporal's own record of the reset names it)."""
    return str(uuid.uuid5(RESET_IDS, f"{base_run_id}/{event_id}"))


def reset_claim_id(run_id: str, base_run_id: str) -> str:
    """The workflow id that claims the one reset of execution ``base_run_id`` of ``run_id``:
    the server starts one workflow under an id, ever (bounded: a hash of the run id)."""
    return f"tether-reset-claim/{hashlib.sha256(run_id.encode()).hexdigest()[:32]}/{base_run_id}"


def moved_on(run_id: str, judged: str, current: Any, *, ours: str | None = None, claimed: bool = False) -> TetherError:
    """REFUSED: the execution a repair or hand-off judged is no longer the current, running one
    (``claimed``: another repair or hand-off is resetting it; ``ours``: this one's reset, undone)."""
    status_name = current.status.name if current.status else "closed"
    if claimed:
        what = f"another repair or hand-off has reset run {judged} (now run {current.run_id} is current, {status_name})"
    else:
        what = f"run {current.run_id} is current ({status_name}), not run {judged} that was judged"
    done = f" (this command's reset made run {ours}, and another reset came after it)" if ours else ""
    return Refused(f"the run moved on: {what}{done}; look at it again: tether status {run_id}")


async def reset_judged(
    client: Client, run_id: str, judged: str, event_id: int, reason: str, *, handoff: HandoffRequest | None = None,
) -> str:
    """Reset execution ``judged`` of ``run_id`` to the workflow task completed at ``event_id``
    (signals and Updates after it applied again), compare-and-set: only while ``judged`` is the
    current, running execution (looked at right before), and only once whoever asks: the reset
    first claims the execution by starting a workflow under an id derived from it, which the
    server starts once (a second claim, a repair or hand-off racing this one: "moved on").
    Checked after it too (a reset made meanwhile outside Tether: "moved on"). ``handoff``: once
    claimed, signalled to ``judged`` (a stuck run's history takes it), applied again by the
    reset. Returns the new execution's run id."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import ResetReapplyType
    from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest

    current = await describe(client, run_id)
    if current.run_id != judged or current.status != WorkflowExecutionStatus.RUNNING:
        raise moved_on(run_id, judged, current)
    try:
        claim = await client.start_workflow(
            RESET_CLAIM_TYPE, id=reset_claim_id(run_id, judged), task_queue=RESET_CLAIM_QUEUE,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            memo={"workflow_id": run_id, "run_id": judged, "event_id": event_id},
            static_summary=f"the reset of run {judged} to event {event_id}"[:200], rpc_timeout=QUERY_TIMEOUT,
        )
    except WorkflowAlreadyStartedError:
        raise moved_on(run_id, judged, await describe(client, run_id), claimed=True) from None
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    try:
        await claim.terminate("claimed: its id is the record", rpc_timeout=QUERY_TIMEOUT)  # nothing runs it
    except RPCError:
        pass  # it holds the claim all the same; the server's retention removes it
    if handoff is not None:
        try:
            await client.get_workflow_handle(run_id, run_id=judged).signal("handoff", handoff, rpc_timeout=QUERY_TIMEOUT)
        except RPCError as e:
            raise rpc_error(e, run_id) from None
    try:
        response = await client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=run_id, run_id=judged),
                reason=reason[:1000],
                workflow_task_finish_event_id=event_id,
                request_id=reset_request_id(judged, event_id),
                reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_ALL_ELIGIBLE,
                identity=client.identity,
            ),
            timeout=QUERY_TIMEOUT,
        )
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    after = await describe(client, run_id)
    if after.run_id != response.run_id:
        raise moved_on(run_id, judged, after, ours=response.run_id)
    return response.run_id


async def repair(
    client: Client,
    run_id: str,
    *,
    reason: str | None = None,
    event_id: int | None = None,
    workflows: Sequence[type] = (),  # the workflow classes to replay with (default: AgentRun)
    base_run_id: str | None = None,  # the execution judged (default: the current one, described now)
) -> RepairResult:
    """Reset a stuck run to the last workflow task that completed before its failure and whose
    history this code replays (Temporal's ResetWorkflowExecution): the new execution keeps the
    history up to that task, does the task again, and gets every signal and Update that came
    after it again. Records go on in the audit sink under the new run id.

    Refused (REFUSED) for a run that is not stuck (unless ``event_id`` names the task), one no
    task of which replays, or where the reset would run a write again that is not safe to repeat
    (effect other than read_only or idempotent): hand it off instead.

    Compare-and-set: the repair judges one execution (``base_run_id``, else the current one) and
    resets only while that execution is still the current, running one (``reset_judged``):
    otherwise REFUSED, "the run moved on".
    """
    from temporalio.api.enums.v1 import EventType

    description = await describe(client, run_id)
    if base_run_id is not None and description.run_id != base_run_id:
        raise moved_on(run_id, base_run_id, description)
    if description.status != WorkflowExecutionStatus.RUNNING:
        status_name = description.status.name if description.status else "closed"
        raise Refused(f"run {run_id} is {status_name}: only a running run can be repaired")
    stuck, events, chosen, skipped = await _judged(
        client, description, workflows, event_id=event_id,
        not_stuck=None if event_id is not None else (
            f"run {run_id} is not stuck: its workflow tasks complete, nothing to repair "
            f"(`--event-id N` resets to a task of your choice)"),
        no_point=f"no workflow task of run {run_id} among the last {REPAIR_CANDIDATES} before the failure replays on "
                 f"this code: end the run on the record (`tether handoff {run_id} --force --by NAME --reason TEXT`) "
                 f"or fix the code first",
    )
    started = chosen.workflow_task_completed_event_attributes.started_event_id
    dropped = [e for e in events if e.event_id > started]
    calls = await _dropped_calls(client, dropped, await _tool_effects(description))
    rerun = [call.tool_call_id for call, _ in calls]
    unsafe = [f"{call.tool_call_id} ({call.tool}, effect {effect})" for call, effect in calls if effect not in RERUN_SAFE]
    if unsafe:
        raise Refused(
            f"resetting run {run_id} to event {chosen.event_id} would run {', '.join(unsafe)} again, which is not "
            f"safe to repeat: end the run on the record instead, without running it again "
            f"(`tether handoff {run_id} --force --by NAME --reason TEXT`)")
    reapplied = sum(
        1 for e in dropped
        if e.event_type in (EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ADMITTED,
                            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED)
    )
    why = reason or (f"tether repair: workflow task failing ({stuck.cause})" if stuck else "tether repair")
    to_run_id = await reset_judged(client, run_id, description.run_id, chosen.event_id, why)
    return RepairResult(
        run_id=run_id, from_run_id=description.run_id, to_run_id=to_run_id, event_id=chosen.event_id,
        failure=stuck, skipped=skipped, reapplied=reapplied, rerun=rerun,
    )


async def _judged(
    client: Client, description: Any, workflows: Sequence[type], *, not_stuck: str | None, no_point: str,
    event_id: int | None = None, settled: bool = False,
) -> tuple[StuckTask | None, list[Any], Any, list[int]]:
    """A reset's judgement of one execution: whether it is stuck (else REFUSED ``not_stuck``,
    unless None), its history, and the task to reset to (``_reset_point``; none: REFUSED
    ``no_point``) with the later ones skipped."""
    stuck = await stuck_task(client, description)
    if stuck is None and not_stuck is not None:
        raise Refused(not_stuck)
    events = await _history_events(client, description.id, description.run_id)
    chosen, skipped = await _reset_point(client, description.id, events, stuck, workflows, event_id=event_id, settled=settled)
    if chosen is None:
        raise Refused(no_point)
    return stuck, events, chosen, skipped


async def _history_events(client: Client, run_id: str, execution: str) -> list[Any]:
    try:
        return list((await client.get_workflow_handle(run_id, run_id=execution).fetch_history()).events)
    except RPCError as e:
        raise rpc_error(e, run_id) from None


async def _reset_point(
    client: Client, run_id: str, events: list[Any], stuck: StuckTask | None, workflows: Sequence[type], *,
    event_id: int | None = None, settled: bool = False,
) -> tuple[Any | None, list[int]]:
    """The newest workflow task completed before the failure (``event_id``: that one) whose
    history replays on this code (at most REPAIR_CANDIDATES tried), and the later ones skipped
    because they do not. ``settled``: only a task with no tool call pending at it (Temporal would
    send such a call to a worker again after the reset)."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import WorkflowHistory

    # The workflow and its worker configuration, imported only for a repair (a CLI starts lighter).
    from tether.replay import create_replayer

    bound = stuck.event_id if stuck is not None and stuck.event_id else events[-1].event_id + 1
    completed = [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id < bound]
    if event_id is not None:
        completed = [e for e in completed if e.event_id == event_id]
        if not completed:
            raise UsageError(f"event {event_id} of run {run_id} is no completed workflow task before the failure")
    tools = {e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
             and e.activity_task_scheduled_event_attributes.activity_type.name == "execute_tool"}
    # A worker's own configuration (TetherPlugin), with the fleet's ring (TETHER_STATE_KEY_FILE):
    # replay checks every seal and attestation.
    replayer = create_replayer(workflows=workflows, data_converter=client.data_converter)
    skipped: list[int] = []
    for candidate in list(reversed(completed))[:REPAIR_CANDIDATES]:
        started = candidate.workflow_task_completed_event_attributes.started_event_id
        if settled and _pending_at(events, tools, started):
            continue
        prefix = WorkflowHistory(run_id, [e for e in events if e.event_id <= started])
        replayed = await replayer.replay_workflow(prefix, raise_on_replay_failure=False)
        if replayed.replay_failure is None:
            return candidate, skipped
        skipped.append(candidate.event_id)
    return None, skipped


def _pending_at(events: list[Any], tools: set[int], started: int) -> bool:
    """Whether a tool call scheduled before event ``started`` had not closed by then."""
    closed = set()
    for e in events:
        if e.event_id > started:
            break
        for field in ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
                      "activity_task_timed_out_event_attributes", "activity_task_canceled_event_attributes"):
            if e.HasField(field):
                closed.add(getattr(e, field).scheduled_event_id)
    return any(t < started and t not in closed for t in tools)


async def _tool_effects(description: Any) -> dict[str, str]:
    """Each tool's effect class: the run's own catalog entries, else what the tool modules the
    workers load declare (TETHER_TOOLS, as `tether tools`). A view the fleet did not sign (a
    keyless poller's, which is what a repair often follows) says nothing: the modules decide."""
    try:
        view = await published_view(description)
    except ViewUnverified:
        view = None
    if view is not None:
        return {t.name: t.effect.value for t in view.snapshot.tools}
    from tether.loading import LoadError
    from tether.tools.sdk import REGISTRY, load_tool_modules

    modules = os.environ.get("TETHER_TOOLS", "examples.billing.tools").split(",")
    try:
        return {t.name: t.effect.value for t in load_tool_modules(modules, REGISTRY).catalog().tools}
    except LoadError as e:
        raise UsageError(f"{e} (TETHER_TOOLS)") from None


async def _dropped_calls(client: Client, dropped: list[Any], effects: dict[str, str]) -> list[tuple[Any, str]]:
    """The tool calls scheduled among ``dropped`` (the events a reset leaves out), each with its
    effect class ("unknown" for a tool no catalog names)."""
    from temporalio.api.enums.v1 import EventType

    from workflows.wire import ToolCall

    calls = []
    for event in dropped:
        if event.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            continue
        scheduled = event.activity_task_scheduled_event_attributes
        if scheduled.activity_type.name != "execute_tool":
            continue
        [call] = await client.data_converter.decode(scheduled.input.payloads, [ToolCall])
        calls.append((call, effects.get(call.tool, "unknown")))
    return calls


async def forced_reset(client: Client, description: Any, workflows: Sequence[type]) -> RepairResult:
    """Where a forced hand-off resets a stuck run to (``to_run_id`` left empty), and the writes
    the reset leaves out (``in_flight``: not run again, they may have applied)."""
    run_id = description.id
    stuck, events, chosen, skipped = await _judged(
        client, description, workflows, settled=True,
        not_stuck=f"run {run_id} is not stuck: its workflow tasks complete, so it takes a hand-off as it is "
                  f"(`tether handoff {run_id} --by NAME --reason TEXT`, without --force)",
        no_point=f"no workflow task of run {run_id} among the last {REPAIR_CANDIDATES} before the failure replays "
                 f"on this code with no tool call pending at it: deploy a build that replays it, then try again",
    )
    started = chosen.workflow_task_completed_event_attributes.started_event_id
    dropped = [e for e in events if e.event_id > started]
    calls = await _dropped_calls(client, dropped, await _tool_effects(description))
    in_flight = list(dict.fromkeys(call.tool_call_id for call, effect in calls if effect != "read_only"))
    return RepairResult(
        run_id=run_id, from_run_id=description.run_id, to_run_id="", event_id=chosen.event_id, failure=stuck,
        skipped=skipped, reapplied=1, in_flight=in_flight,
    )


@dataclass(frozen=True)
class HandoffReset:
    """The worker's side of a forced hand-off, handed to ``tether.client.handoff(..., forced=)`` by
    the CLI: where a stuck run resets to (a replay of its history on this build's workflow code,
    ``workflows`` replacing AgentRun) and the reset itself (compare-and-set, the hand-off applied)."""

    workflows: Sequence[type] = ()

    async def point(self, client: Client, description: Any) -> RepairResult:
        return await forced_reset(client, description, self.workflows)

    async def reset(self, client: Client, run_id: str, base_run_id: str, event_id: int, reason: str, *,
                    handoff: HandoffRequest) -> str:
        return await reset_judged(client, run_id, base_run_id, event_id, reason, handoff=handoff)


async def repair_tree(client: Client, run_id: str, *, reason: str | None = None, event_id: int | None = None,
                      workflows: Sequence[type] = ()) -> list[RepairResult]:
    """``repair`` of a run and its delegation tree, as one unit: each run of the tree whose
    workflow tasks keep failing is repaired (a parent waiting on a stuck child is not stuck
    itself, and waits for ever otherwise), the run first, then its children depth first.
    ``event_id`` names a task of the run itself (then only it is reset). A tree with no stuck run:
    REFUSED, as ``repair`` says of the run."""
    if event_id is not None:
        return [await repair(client, run_id, reason=reason, event_id=event_id, workflows=workflows)]
    tree = await tree_spend(client, await snapshot_or_listed(client, run_id))
    done: list[RepairResult] = []
    for node in (run_id, *(c.run_id for c in tree)):
        try:
            description = await describe(client, node)
        except TetherError:
            continue  # a child that cannot be described: its own `status` says why
        if description.status != WorkflowExecutionStatus.RUNNING or await stuck_task(client, description) is None:
            continue
        done.append(await repair(client, node, reason=reason, workflows=workflows, base_run_id=description.run_id))
    if not done:
        # Nothing in the tree is stuck: the run's own answer (not stuck, or not running).
        done.append(await repair(client, run_id, reason=reason, workflows=workflows))
    return done
