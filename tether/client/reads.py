"""One run, read: its status (from what it published, or live from its queries), the
``snapshot`` and ``timeline`` queries, how it ended (``run_outcome``), and waiting until it
settles (``wait_settled``).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, Field

from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowQueryFailedError
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.service import RPCError

from workflows.display import escape_text
from workflows.published import STATE_ATTRIBUTE, TENANT_ATTRIBUTE
from workflows.contract import DELEGATE, ExecutedStep
from workflows.run_state import RunOutcome, RunSnapshot, RunView
from workflows.wire import UNKNOWN_TOOL
from workflows.states import TERMINAL, RunState, TransitionRecord
from tether.connection import QUERY_TIMEOUT, NoWorker, TetherError, UsageError, rpc_error, timed_out
from tether.runs import StuckTask, ViewUnverified, describe as _describe, open_children, published_view, stuck_task, verified_view
from tether.client.workers import no_answer, no_worker_message, require_worker, worker_serving
from tether.pollers import live_pollers, served_by
from tether.client.sink import _sink_records, ledger_standing


class ChildSpend(BaseModel):
    """One child of a delegation tree as its own signed view says (``read_run``): where it
    stands, what it spent of the approval its parent lent it and of the budgets. ``error``: why
    its view could not be read (then nothing else of it is shown as its word)."""

    run_id: str
    parent: str
    depth: int = 1  # below the run whose status this is
    state: RunState | None = None
    covered: int = 0
    covered_spent: int = 0
    spent: dict[str, float] = {}
    error: str | None = None


class RunStatus(RunSnapshot):
    """The ``snapshot`` query, plus why the run ended (the final record) once it has."""

    end_reason: str | None = None
    end_rule: str | None = None  # the rule or error code on that record, when it names one
    end_actor: str | None = None  # who or what ended it (user:bob, operator:dana, runtime)
    temporal_status: str | None = None  # Temporal's word: RUNNING, COMPLETED, FAILED, TERMINATED, ...
    # Set when Temporal has closed the run while its last Tether state is a working one (a
    # failed or terminated run that still says AWAITING_APPROVAL): it will not go on.
    closed_by_temporal: str | None = None
    # The run's record of the latest decision or handoff (its verdict, once the run has one).
    last_decision: TransitionRecord | None = None
    # Read from what the run published (its memo), or its signed live answer, at this workflow
    # time; None: read live from its unsigned queries.
    published_at: datetime | None = None
    # Read live (``live``): True from its signed ``view`` answer; False from its unsigned
    # ``snapshot`` (a build without the view query: nothing pending, never the run's word).
    live_signed: bool | None = None
    # The state the run is listed in (AgentRunState) when it has moved on since it published.
    listed_state: str | None = None
    task_queue: str | None = None
    worker_serving: bool | None = None  # a worker serves the run's queue now (None: cannot tell)
    # The tools the run's remaining steps call that no live worker on its queue serves (each
    # worker's identity lists its tools), or the one its write waits for (the run's last error
    # says `unknown_tool`): approved, it waits until a worker that serves them polls.
    waits_for_tools: list[str] = Field(default_factory=list)
    stuck: StuckTask | None = None  # its workflow task keeps failing
    # Why the effect ledger could not be read: where each write stands is then unknown.
    ledger_error: str | None = None
    # The goal it was started with (``run_goal``): read by ``status`` for a run whose view verified.
    goal: str | None = None
    # A child run's root (``root_of``): the run whose requester it acts for (its ``requested_by``
    # is the root's). None: a root, or a child whose ancestors' signed views could not be read.
    root: str | None = None
    # Set when the run has published no signed view yet: what is shown is only what Temporal
    # lists of it (its state, a claim; its start), or with ``live`` its unsigned answer, and
    # nothing pending (no Approve is offered on it).
    unpublished: str | None = None
    # A root's (or any parent's) delegation tree, its children depth first (``tree_spend``):
    # what each child spent of the approval lent to it and of the budgets.
    tree: list[ChildSpend] = []

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL


def closed_note(state: str | None, temporal_status: str | None) -> str | None:
    """What to say of a run Temporal has closed while its last Tether state is a working one."""
    if temporal_status in (None, "RUNNING", "CONTINUED_AS_NEW") or state is None:
        return None
    try:
        if RunState(state) in TERMINAL:
            return None
    except ValueError:
        return None
    return (
        f"Temporal closed this run ({temporal_status}) while its last Tether state was {state}: "
        f"it will not go on (see the Web UI / `temporal workflow show` for why)"
    )


async def snapshot(client: Client, run_id: str, *, timeout: float | None = None) -> RunSnapshot:
    handle = client.get_workflow_handle(run_id)
    rpc_timeout = QUERY_TIMEOUT if timeout is None else min(QUERY_TIMEOUT, timedelta(seconds=timeout))
    try:
        # By name: the client does not load the workflow's module (tests/tether/test_tether_package.py).
        snap: RunSnapshot = await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=rpc_timeout)
        return snap
    except RPCError as e:
        if timed_out(e):
            raise await no_answer(client, run_id, rpc_timeout.total_seconds()) from None
        raise rpc_error(e, run_id) from None
    except WorkflowQueryFailedError as e:
        raise UsageError(f"run {run_id} could not answer: {e}") from None


async def run_goal(client: Client, run_id: str) -> str | None:
    """The goal the run was started with, as Temporal recorded its start (the first event of its
    current execution: a continued or reset run carries the same request). Only for a run whose
    signed view was read: the goal of a run that published nothing is no one's word. None: it
    cannot be read here (another version's input, a key this client lacks)."""
    from workflows.run_state import RunRequest

    handle = client.get_workflow_handle(run_id)
    try:
        async for event in handle.fetch_history_events(page_size=1, rpc_timeout=QUERY_TIMEOUT):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            if not payloads:
                return None
            request = (await client.data_converter.decode(payloads[:1], [RunRequest]))[0]
            return request.goal if isinstance(request, RunRequest) else None
    except Exception:  # noqa: BLE001 (gone, another version's input, encrypted with another key)
        return None
    return None


# A tree is at most the policy's max_depth deep (Grant.depth <= 16): the walk up stops there.
_ROOT_HOPS = 16


async def root_of(client: Client, snap: RunSnapshot) -> str | None:
    """The root of a child run's delegation tree: on whose behalf it acts (a child's
    ``requested_by`` is its root's requester). Walked up from parent to parent, each read from its
    own signed view (never a query answer). None: ``snap`` is a root, or an ancestor's view could
    not be read or verified (then nobody's word names the root)."""
    parent = snap.parent
    for _ in range(_ROOT_HOPS):
        if not parent:
            return None
        try:
            view = await published_view(await _describe(client, parent))
        except TetherError:
            return None
        if view is None:
            return None
        if not view.snapshot.parent:
            return parent
        parent = view.snapshot.parent
    return None


async def _live_view(client: Client, description: Any) -> RunView | None:
    """The run's ``view`` query: its view as it stands now, signed by the fleet's key for this
    run as its published view is, and checked the same way (ViewUnverified otherwise: a keyless
    poller's answer, or another run's). None: the run does not answer it (a build without the
    query, or a failed query): only its unsigned ``snapshot`` is there, never the run's word."""
    handle = client.get_workflow_handle(description.id)
    try:
        view = await handle.query("view", result_type=RunView, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as e:
        if timed_out(e):
            raise await no_answer(client, description.id, QUERY_TIMEOUT.total_seconds()) from None
        raise rpc_error(e, description.id) from None
    except WorkflowQueryFailedError:
        return None
    if not isinstance(view, RunView):
        raise ViewUnverified(f"run {description.id}: its live answer is not a view; nothing of it is shown as the run's")
    try:
        return verified_view(description, view, "its live answer")
    except ViewUnverified as e:
        raise ViewUnverified(f"run {description.id}: {e}; nothing of it is shown as the run's") from None


async def timeline(client: Client, run_id: str) -> list[TransitionRecord]:
    handle = client.get_workflow_handle(run_id)
    try:
        records: list[TransitionRecord] = await handle.query("timeline", result_type=list[TransitionRecord],
                                                             rpc_timeout=QUERY_TIMEOUT)
        return records
    except RPCError as e:
        if timed_out(e):
            raise await no_answer(client, run_id, QUERY_TIMEOUT.total_seconds()) from None
        raise rpc_error(e, run_id) from None
    except WorkflowQueryFailedError as e:
        raise UsageError(f"run {run_id} could not answer: {e}") from None


async def status(client: Client, run_id: str, *, live: bool = False, goal: bool = True) -> RunStatus:
    """The run's state, and for a run that has ended the reason on its final record.

    By default from what the run published where it last rested (its memo; ``published_at``
    says when): no worker is needed and nothing reaches the run. ``live``: the ``snapshot`` and
    ``timeline`` queries, through a worker. A run that has published nothing yet is read live.
    Each write's undo is shown as the effect ledger says it stands (``ledger_standing``).
    ``goal`` (for a person to read): its goal, and its delegation tree's spend (``tree``).
    """
    result = (await read_run(client, run_id, live=live))[0]
    if goal and not result.unpublished:  # ``goal``: for a person to read (not a wait's end)
        result.goal = await run_goal(client, run_id)
        result.root = await root_of(client, result)
    if result.ended:
        result.compensations, result.ledger_error = await ledger_standing(result.compensations)
    if goal:  # its children: those its view names, and its open ones as the server records them
        result.tree = await tree_spend(client, result)
    return result


# A tree is bounded by the policy's max_depth (a few levels) and each level by the parent's
# steps: the walk stops here all the same.
TREE_NODES = 64


async def tree_spend(client: Client, root: RunSnapshot) -> list[ChildSpend]:
    """The delegation tree below ``root``, depth first: the children each run's signed view
    names (closed ones included) and its open ones as the server records them (a parent waiting
    on a child may not have published since it started it). Each child is read from its own
    signed view, never its query answers (whoever can poll its queue may answer those)."""
    found: list[ChildSpend] = []
    todo = [(root.run_id, list(root.children), 0)]
    seen = {root.run_id}
    while todo and len(found) < TREE_NODES:
        parent, named, depth = todo.pop()
        try:
            pending = open_children(await _describe(client, parent))
        except TetherError:
            pending = []
        kids = [k for k in dict.fromkeys([*named, *pending]) if k not in seen]
        seen.update(kids)
        for child_id in reversed(kids):
            todo.append((child_id, [], depth + 1))
        nodes = []
        for child_id in kids:
            node = ChildSpend(run_id=child_id, parent=parent, depth=depth + 1)
            try:
                snap = (await read_run(client, child_id))[0]
            except TetherError as e:
                node.error = str(e)
            else:
                if snap.unpublished:
                    node.error = "not published yet: nothing of it is the fleet's word"
                else:
                    node.state, node.covered, node.covered_spent, node.spent = (
                        snap.state, snap.covered, snap.covered_spent, snap.spent)
                    todo_entry = next(t for t in todo if t[0] == child_id)
                    todo_entry[1].extend(snap.children)
            nodes.append(node)
        found.extend(nodes)

    def below(parent: str) -> list[ChildSpend]:  # depth first: each child's subtree right after it
        return [m for n in found if n.parent == parent for m in (n, *below(n.run_id))]

    return below(root.run_id)


def _listed_snapshot(description: Any) -> RunSnapshot:
    """What Temporal lists of a run that has published nothing: its start and tenant; its state
    RECEIVED (the listed one is a claim, kept in ``listed_state``), nothing pending."""
    attrs = description.typed_search_attributes
    return RunSnapshot(
        run_id=description.id, tenant=attrs.get(TENANT_ATTRIBUTE) or "",
        state=RunState.RECEIVED,
        previous_state=None, state_version=0, plan=None, pending_approval=None, step=0, retries=0, last_error=None,
        approved_by=[], answer=None, created_at=description.start_time, updated_at=None,
    )


async def read_run(client: Client, run_id: str, *, live: bool = False) -> tuple[RunStatus, list[TransitionRecord]]:
    """``status`` and the records it was read with (the published view's latest records, or
    the ``timeline`` query's window when ``live``).

    Only what the fleet's key vouches for is shown as the run: its signed view. A view that does
    not verify raises ViewUnverified (never read live instead: whoever started the run may
    answer its queries). A run that has published nothing yet is ``unpublished``: what Temporal
    lists of it (a claim) and nothing pending, so nothing offers Approve on it; ``live`` adds its
    query answer, marked unsigned, still with nothing pending."""
    description = await _describe(client, run_id)
    queue = description.task_queue
    pollers = await live_pollers(client, queue)  # once: whether a worker serves, and which tools
    serving = None if pollers is None else bool(pollers)
    try:
        view = await published_view(description)
    except ViewUnverified as e:
        raise ViewUnverified(f"run {run_id}: {e}; nothing of it is shown as the run's") from None
    if serving is False and (live or view is None):
        # Nobody can answer a query, and a run that has published nothing will not until one serves it.
        raise NoWorker(no_worker_message(queue))
    if view is None:
        listed = description.typed_search_attributes.get(STATE_ATTRIBUTE)
        note = (f"not published yet: the run has published no signed view (it publishes where it rests), so "
                f"nothing of it is the fleet's word{'; Temporal lists it as ' + escape_text(listed, 40) + ', a claim' if listed else ''}"
                f"; no decision can be sent to it until it publishes")
        records: list[TransitionRecord] = []
        snap = None
        signed = await _live_view(client, description) if live else None
        if signed is not None:
            # Its live answer, signed by the fleet's key for this run: the run's word, as of now.
            records = signed.timeline
            result = RunStatus(**signed.snapshot.model_dump(), published_at=signed.published_at, live_signed=True)
        elif live:
            # As the run answers now, shown for its progress only: unsigned, nothing pending.
            snap = (await snapshot(client, run_id)).model_copy(update={"pending_approval": None})
            records = await timeline(client, run_id)
            note += " (the state below is the run's live answer, unsigned)"
        if signed is None:
            result = RunStatus(**(snap or _listed_snapshot(description)).model_dump(), unpublished=note)
            if snap is None:
                result.listed_state = listed
    elif live:
        signed = await _live_view(client, description)
        if signed is not None:  # the run's word as of now, signed as its published view is
            records = signed.timeline
            result = RunStatus(**signed.snapshot.model_dump(), published_at=signed.published_at, live_signed=True)
        else:  # a build without the signed answer: shown marked unsigned, nothing pending
            snap = (await snapshot(client, run_id)).model_copy(update={"pending_approval": None})
            records = await timeline(client, run_id)
            result = RunStatus(**snap.model_dump(), live_signed=False)
    else:
        # The view holds the latest few records, and the run does not publish it again for every
        # decision it refuses while it waits (a flood would write one each): the audit sink has
        # every record of this execution, the decisions among them.
        from tether.audit.sink import merge_timeline

        records = merge_timeline(await _sink_records(description.id, description.run_id), view.timeline)
        result = RunStatus(**view.snapshot.model_dump(), published_at=view.published_at)
        listed = description.typed_search_attributes.get(STATE_ATTRIBUTE)
        if listed and listed != result.state.value:
            result.listed_state = listed  # it has moved on since it published (states.to_publish)
    result.task_queue = queue
    result.worker_serving = serving
    result.temporal_status = description.status.name if description.status else None
    result.closed_by_temporal = closed_note(result.state.value, result.temporal_status)
    result.stuck = await stuck_task(client, description)
    if not result.ended and serving:
        result.waits_for_tools = unserved(result, served_by(pollers))
    result.last_decision = next((r for r in reversed(records) if r.refs.decision_id), None)
    if result.ended:
        moves = [r for r in records if r.kind == "transition"]
        if moves:
            final = moves[-1]
            result.end_reason = final.reason
            result.end_rule = final.rule or final.refs.error_code
            result.end_actor = final.actor
            if final.from_state == RunState.VALIDATION_FAILED and len(moves) > 1:
                # "the replan budget is used up" says little without what failed validation.
                result.end_reason += f"; last validation: {moves[-2].reason}"
    return result, records


def _remaining_tools(snap: RunSnapshot) -> list[str]:
    """The tools the plan's steps not yet executed call, in plan order, each once."""
    if snap.plan is None:
        return []
    return list(dict.fromkeys(s.tool for s in snap.plan.steps[snap.step:] if s.tool != DELEGATE))


def unserved(snap: RunSnapshot, served: frozenset[str] | None) -> list[str]:
    """``RunStatus.waits_for_tools``: what no live worker serves (``served``, from
    tether/pollers.py; None: cannot tell) of the tools the run's remaining steps call, and the
    tool of the step whose write the run says waits (`unknown_tool`, the workflow's own word:
    workflows/steps.py) even when the workers do not list theirs."""
    remaining = _remaining_tools(snap)
    missing = [t for t in remaining if t not in served] if served else []
    if snap.last_error and snap.last_error.startswith(f"{UNKNOWN_TOOL}:") and snap.plan is not None:
        waiting = snap.plan.steps[min(snap.step, len(snap.plan.steps) - 1)].tool
        if waiting not in missing and (served is None or waiting not in served):
            missing.insert(0, waiting)
    return missing


async def run_outcome(handle: WorkflowHandle[Any, Any]) -> RunOutcome:
    """How a run ended (waits for it), whatever Temporal status it ended with.

    Completed: the workflow's result. Failed with a RunOutcome (FAILED, EXECUTION_FAILED): the
    outcome is the failure's details. Canceled (CANCELLED): read back with the snapshot and
    timeline queries (a cancelled execution carries no result; ``steps`` is then empty). Any
    other failure (an invalid start input, a terminated run) raises WorkflowFailureError.
    The result carries no timeline or steps (RunOutcome.records and steps_executed count them):
    they are read with the ``timeline`` and ``steps`` queries (a worker replays the closed run
    to answer them).
    """
    try:
        raw = await handle.result()
    except WorkflowFailureError as e:
        cause = e.cause
        if isinstance(cause, ApplicationError) and cause.details and cause.type in RunState.__members__:
            return await _with_timeline(handle, RunOutcome.model_validate(cause.details[0]))
        if isinstance(cause, CancelledError):
            snap = await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=QUERY_TIMEOUT)
            if snap.state == RunState.CANCELLED:
                records = await handle.query("timeline", result_type=list[TransitionRecord], rpc_timeout=QUERY_TIMEOUT)
                return RunOutcome(
                    run_id=snap.run_id, state=snap.state, answer=snap.answer, steps=[], timeline=records,
                    records=snap.timeline_records,
                )
        raise
    return await _with_timeline(handle, raw if isinstance(raw, RunOutcome) else RunOutcome.model_validate(raw))


async def _with_timeline(handle: WorkflowHandle[Any, Any], outcome: RunOutcome) -> RunOutcome:
    if not outcome.records or outcome.timeline:
        return outcome  # a run recorded before: its result carried both
    # The chain's last run (a run that continued as new ended in a later one than started).
    last = handle._client.get_workflow_handle(handle.id)  # noqa: SLF001 (the handle's own client)
    outcome.timeline = await last.query("timeline", result_type=list[TransitionRecord], rpc_timeout=QUERY_TIMEOUT)
    if outcome.steps_executed and not outcome.steps:
        outcome.steps = await last.query("steps", result_type=list[ExecutedStep], rpc_timeout=QUERY_TIMEOUT)
    return outcome


async def wait_settled(
    client: Client, run_id: str, timeout: float, *, approval_settles: bool = True,
    progress: Any = None,
) -> RunStatus:
    """Poll until the run has ended (or waits for a person, with ``approval_settles``) or
    ``timeout`` seconds have passed; returns its status then. A run no worker answers for
    within ``timeout`` raises TetherError (rule ``no_worker``) naming its task queue.
    ``progress(snapshot, seconds)`` is called after each look."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline = began + timeout
    await require_worker(client, run_id)
    while True:
        try:
            snap = await snapshot(client, run_id, timeout=max(deadline - loop.time(), 1.0))
        except TetherError as e:
            if e.rule == "no_worker" and loop.time() < deadline:
                continue  # a query can time out before the wait does
            raise
        if progress is not None:
            progress(snap, loop.time() - began)
        waiting = approval_settles and snap.state == RunState.AWAITING_APPROVAL
        if waiting or snap.state in TERMINAL or loop.time() > deadline:
            return await status(client, run_id, live=True, goal=False)  # as the query just saw it, not as last published
        await asyncio.sleep(0.2)
