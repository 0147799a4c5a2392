"""Starting a run (``start_run``, and the name and tenant checks before one), cancelling one,
and compensating one that ended.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateHandle,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError

from workflows import policy
from workflows.display import escape_text
from workflows import states
from workflows.published import STATE_ATTRIBUTE, TENANT_ATTRIBUTE
from workflows.details import start_details, start_summary
from workflows.contract import CancelRequest, CompensationCall, DecideResult, first_error
from workflows.run_state import RunOutcome, RunRequest, RunSnapshot
from workflows.states import TERMINAL, RunState
from tether.runs import describe, stuck_task
from tether.connection import PENDING, QUERY_TIMEOUT, REFUSED, NoWorker, Pending, Refused, TetherError, UsageError, checkout_stack, rpc_error, task_queue
from tether.client.errors import _refused_update, invalid
from tether.client.workers import has_worker, no_answer, no_worker_message, require_worker
from tether.client.signing import sign, sign_request
from tether.client.sink import ledger_standing
from tether.client.reads import read_run, snapshot, timeline, tree_spend
from tether.client.decisions import VERDICT_TIMEOUT, Verdict
from tether.client.handoffs import ForcedReset, handoff


async def start_run(
    client: Client,
    request: RunRequest,
    *,
    run_id: str,
    queue: str | None = None,
    allow_id_reuse: bool = False,
) -> WorkflowHandle[Any, Any]:
    """Start an AgentRun the one way: search attributes and Web UI summary set from the start.

    The id of a run that has finished is not reused unless asked for: decisions and signatures
    name the first run id, but a person reading "run X" should find one run.
    """
    try:
        return await client.start_workflow(
            "AgentRun",
            # The fields at their defaults left out: read back, the request is the same.
            request.model_dump(mode="json", exclude_defaults=True),
            id=run_id,
            task_queue=queue or task_queue(),
            id_reuse_policy=(
                WorkflowIDReusePolicy.ALLOW_DUPLICATE if allow_id_reuse else WorkflowIDReusePolicy.REJECT_DUPLICATE
            ),
            result_type=RunOutcome,
            search_attributes=TypedSearchAttributes(
                [
                    # The state the run's first workflow task moves it to (RECEIVED lasts only
                    # inside that task): listed as it will be, without an upsert of its own.
                    SearchAttributePair(STATE_ATTRIBUTE, states.first_published(compensation=request.compensate_run is not None).value),
                    SearchAttributePair(TENANT_ATTRIBUTE, request.tenant),
                ]
            ),
            # The Web UI renders both as markdown (the requester's text shown inert), and shows
            # them together: the details say what the summary does not.
            static_summary=start_summary(request),
            static_details=start_details(request),
        )
    except WorkflowAlreadyStartedError:
        raise UsageError(f"a run with id {run_id!r} already exists: pick another id", rule="already_started") from None
    except RPCError as e:
        raise rpc_error(e, run_id) from None


def person_name(by: str) -> str:
    """A person's name as the run takes it (normalised), or a usage error naming ``--by``."""
    from pydantic import TypeAdapter

    from workflows.identity import Name

    try:
        return TypeAdapter(Name).validate_python(by)
    except ValidationError as e:
        raise UsageError(f"invalid name: {first_error(e)}", field="by", detail=first_error(e)) from None


def tenant_refusal(tenant: str, policy_path: Path | None) -> TetherError | None:
    """A start for a tenant the policy file does not name, refused before anything is sent (a
    typo would otherwise start a run the worker fails at once). No policy file here: the
    worker's is the only word."""
    if policy_path is None:
        return None
    try:
        policy_tenant(tenant, policy_path)
    except TetherError as e:
        return e
    return None


def policy_tenant(tenant: str, policy_path: Path) -> Any:
    """``tenant``'s policy in the file; a tenant it does not name is a usage error with the
    nearest names it does ("did you mean"), as is a file that cannot be read."""
    import difflib

    from tether.policy.files import PolicyFileError, PolicyStore

    store = PolicyStore(policy_path)
    try:
        tenant_policy, _ = store.tenant(tenant)
        document, _ = store.load()
    except (PolicyFileError, OSError, ValueError) as e:
        raise UsageError(f"cannot read the policy file {policy_path}: {e}") from None
    if tenant_policy is not None:
        return tenant_policy
    known = sorted(document.tenants) if document is not None else []
    near = difflib.get_close_matches(tenant, known, n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(repr(escape_text(n)) for n in near)}?" if near
            else f"its tenants: {', '.join(map(escape_text, known)) or 'none'}")
    raise UsageError(f"tenant {escape_text(tenant)!r} is not in the policy file {policy_path}: {hint}",
                      field="tenant", rule="tenant_unknown")


def planner_refusal(planner: str) -> TetherError | None:
    """A start naming a planner the worker does not have, refused before anything is sent (a
    typo would otherwise use the run's id up on a run that fails at once). The worker has the
    built-in planners and those it is configured with: TETHER_PLANNERS, as the worker reads it,
    else what the checkout's dev stack recorded; with neither here, the worker's is the only word."""
    import difflib

    from tether.planners.planning import BUILTIN_PLANNERS

    configured = os.environ.get("TETHER_PLANNERS")
    if configured is not None:
        names = [spec.partition("=")[0].strip() for spec in configured.split(",") if spec.strip()]
        where = "TETHER_PLANNERS"
    else:
        listed = checkout_stack().get("planners")
        if not isinstance(listed, list):
            return None
        names = [str(n) for n in listed]
        where = "the dev stack's worker"
    known = sorted({*BUILTIN_PLANNERS, *names})
    if planner in known:
        return None
    near = difflib.get_close_matches(planner, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(escape_text(n)) for n in near)}? " if near else ""
    return UsageError(f"no planner {escape_text(planner)!r}: {hint}the worker has {', '.join(known)} ({where}); "
                       "nothing was started")


def policy_file() -> Path | None:
    """The policy file a client checks against: TETHER_POLICY, else the one the checkout's dev
    stack's worker applies (none: the worker's alone decides)."""
    path = os.environ.get("TETHER_POLICY") or checkout_stack().get("policy")
    return Path(path) if isinstance(path, str) and path else None


async def cancel(
    client: Client, run_id: str, *, reason: str, by: str, decision_id: str | None = None, key: Path | None = None,
    timeout: float = VERDICT_TIMEOUT,
) -> DecideResult:
    """Ask the run to stop, as ``by``: the run's policy decides (the ``cancel`` Update) and the
    answer is its record: CANCELLED (or COMPENSATING, with on_cancel=compensate) once any tool
    in flight has settled. Refused by the run: REFUSED with the rule (on its record too); no
    verdict within ``timeout``: PENDING. A Temporal cancel (the Web UI, ``temporal workflow
    cancel``) is an operator's, and is not sent from here."""
    try:
        request = CancelRequest(by=by, reason=reason, decision_id=decision_id or uuid.uuid4().hex)
    except ValidationError as e:
        raise invalid("cancel", e) from None
    handle = client.get_workflow_handle(run_id)
    try:
        description = await handle.describe(rpc_timeout=QUERY_TIMEOUT)
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    if description.status != WorkflowExecutionStatus.RUNNING:
        raise Refused(f"run {run_id} already finished", rule="run_ended")
    if not await has_worker(client, description.task_queue):
        raise NoWorker(no_worker_message(description.task_queue))
    if key is not None:
        snap = await snapshot(client, run_id)
        payload = policy.signature_payload(
            workflow_id=run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, request_id="",
            plan_hash="", kind="cancel", decision_id=request.decision_id, signer=request.by,
        )
        request.signature = sign(key, payload)
    update: WorkflowUpdateHandle[DecideResult] | None = None
    try:
        update = await handle.start_update(
            "cancel", request, wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=DecideResult,
            rpc_timeout=timedelta(seconds=timeout),
        )
        result = await asyncio.wait_for(update.result(rpc_timeout=timedelta(seconds=timeout)), timeout)
    except WorkflowUpdateFailedError as e:
        raise _refused_update(e, "cancel") from None
    except (WorkflowUpdateRPCTimeoutOrCancelledError, asyncio.TimeoutError):
        if update is None:
            raise await no_answer(client, run_id, timeout) from None
        raise Pending(
            f"cancel {request.decision_id} accepted, verdict pending: the run is judging it, or waits for a tool in "
            f"flight to settle (`tether status {run_id}` shows the verdict once it is there)",
        ) from None
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    if result.outcome == "refused":
        raise Refused(f"{result.reason} [rule: {result.rule}]", rule=result.rule)
    return result


async def cancel_tree(
    client: Client, run_id: str, *, reason: str, by: str, key: Path | None = None, timeout: float = VERDICT_TIMEOUT,
) -> list[tuple[str, DecideResult]]:
    """``cancel`` of a run and its delegation tree, as one unit. A running run's cancel reaches
    its open children through its own code (each settles first); a child whose parent has ended
    (a parent reset or handed off while its child ran on) has nobody to reach it, and is sent
    the cancel itself, each judged by its own policy. Returns each run cancelled with its
    verdict, the run's first; a run that has ended with no open child left: REFUSED
    (``run_ended``), as ``cancel``."""
    done: list[tuple[str, DecideResult]] = []
    try:
        done.append((run_id, await cancel(client, run_id, reason=reason, by=by, key=key, timeout=timeout)))
        ended_root = None
    except TetherError as e:
        if e.rule != "run_ended":
            raise
        ended_root = e
    tree = await tree_spend(client, await snapshot(client, run_id))
    states_of = {c.run_id: c.state for c in tree}
    for child in tree:
        parent_state = states_of.get(child.parent) if child.parent != run_id else (None if ended_root is None else RunState.COMPLETED)
        if child.state is None or child.state in TERMINAL or parent_state is None or parent_state not in TERMINAL:
            continue  # ended, unread, or its parent runs and reaches it
        try:
            done.append((child.run_id, await cancel(client, child.run_id, reason=reason, by=by, key=key, timeout=timeout)))
        except TetherError as e:
            if e.rule != "run_ended":  # it ended meanwhile: nothing to cancel
                raise
        states_of[child.run_id] = RunState.CANCELLED  # its children are its own to reach
    if not done and ended_root is not None:
        raise ended_root
    return done


async def snapshot_or_listed(client: Client, run_id: str) -> RunSnapshot:
    """The run's snapshot as far as the tree walk needs it (its id and the children its signed
    view names); a run that cannot answer (stuck, no worker) is walked by its open children alone."""
    try:
        return (await read_run(client, run_id))[0]
    except TetherError:
        # A partial snapshot: the tree walk (tree_spend) reads its run_id and children alone.
        return RunSnapshot.model_construct(run_id=run_id, children=[])  # type: ignore[call-arg]


async def handoff_tree(
    client: Client, run_id: str, *, by: str, reason: str, decision_id: str | None = None, key: Path | None = None,
    timeout: float = VERDICT_TIMEOUT, force: bool = False, forced: ForcedReset | None = None,
) -> list[tuple[str, Verdict]]:
    """``handoff`` of a run and its delegation tree, as one unit. Without ``force``: the run's
    own hand-off (its code cancels its open children first). ``force``: each stuck run of the
    tree is handed off by force, the deepest first (a stuck child takes no cancel, so its
    parent's hand-off would wait on it for ever); then the run itself, by force when it is stuck,
    else as a hand-off (a parent whose child handed off hands itself off too: one that has ended
    meanwhile is left as it ended). Returns each run handed off with its verdict, the run's last;
    a tree with nothing stuck: as ``handoff --force`` of the run says."""
    if not force:
        return [(run_id, await handoff(client, run_id, by=by, reason=reason, decision_id=decision_id, key=key,
                                       timeout=timeout))]
    tree = await tree_spend(client, await snapshot_or_listed(client, run_id))
    done: list[tuple[str, Verdict]] = []
    for child in reversed(tree):  # depth first, reversed: each child before its parent
        try:
            description = await describe(client, child.run_id)
        except TetherError:
            continue
        if description.status == WorkflowExecutionStatus.RUNNING and await stuck_task(client, description) is not None:
            done.append((child.run_id, await handoff(client, child.run_id, by=by, reason=reason, key=key, timeout=timeout,
                                                     force=True, forced=forced)))
    description = await describe(client, run_id)
    stuck = description.status == WorkflowExecutionStatus.RUNNING and await stuck_task(client, description) is not None
    if stuck or not done:  # the run's own, under the decision id asked for (a child's each its own)
        done.append((run_id, await handoff(client, run_id, by=by, reason=reason, decision_id=decision_id, key=key,
                                           timeout=timeout, force=True, forced=forced)))
    elif description.status == WorkflowExecutionStatus.RUNNING:
        try:
            done.append((run_id, await handoff(client, run_id, by=by, reason=reason, decision_id=decision_id, key=key,
                                               timeout=timeout)))
        except TetherError as e:
            # Refused because it ended (or hands itself off) on its child's hand-off: left so.
            if not isinstance(e, Refused) or (e.rule != "handoff_pending" and
                                     (await describe(client, run_id)).status == WorkflowExecutionStatus.RUNNING):
                raise
    return done


def compensation_id(run_id: str) -> str:
    """The workflow id of a run's compensation runs: one at a time; a new one may follow one
    that ended however it ended (refused, failed, cancelled, terminated, handed off)."""
    return f"{run_id}-compensate"


def compensate_refusal(
    by: str, snap: RunSnapshot, standing: list[CompensationCall], policy_path: Path | None
) -> TetherError | None:
    """Why ``tether compensate`` of this ended run is refused, as far as a client can tell: the
    run did not end where its writes are left to a person (a COMPLETED run may be undone, as a
    request its undos' approval governs), nothing of it is left to undo (the undo ledger says every undo is done), or the policy file
    (when this client has it) does not let ``by`` compensate."""
    if snap.state not in policy.COMPENSABLE_STATES | {RunState.COMPLETED}:
        states = ", ".join(sorted(s.value for s in policy.COMPENSABLE_STATES | {RunState.COMPLETED}))
        return Refused(f"run {snap.run_id} ended {snap.state.value}: its writes are kept; only runs ended {states} "
                           "are compensated [rule: not_compensable]", rule="not_compensable")
    if policy_path is not None:
        from tether.policy.files import PolicyFileError, PolicyStore

        try:
            tenant_policy, _ = PolicyStore(policy_path).tenant(snap.tenant)
        except (PolicyFileError, OSError, ValueError) as e:
            return UsageError(f"cannot read the policy file {policy_path}: {e}")
        refusal = policy.compensator_refusal(tenant_policy, by)
        if refusal is not None:
            return Refused(f"{refusal.message} [rule: {refusal.rule}]", rule=refusal.rule)
    if not any(c.tool and c.status != "ok" for c in standing):
        done = [c for c in standing if c.status == "ok"]
        return Refused(f"run {snap.run_id} has no write left to undo ({len(done)} undone) [rule: nothing_to_compensate]", rule="nothing_to_compensate")
    return None


async def compensate(
    client: Client, run_id: str, *, by: str, key: Path | None = None, queue: str | None = None,
    rerun_unknown: Sequence[str] = (), policy_path: Path | None = None, timeout: float = VERDICT_TIMEOUT,
) -> WorkflowHandle[Any, Any]:
    """Start the governed compensation run of an ended run: it undoes the ok writes the
    original's approvals covered (read from the original's record by the worker, not sent
    from here), as ``by`` — who must hold an approval role of the run's tenant. Nothing a
    compensation run does uses recovery up: another may follow it, and the worker's undo ledger
    starts each undo at most once whichever run asks. ``rerun_unknown``: the steps (tool call
    ids) whose unsafe undo may have applied that ``by`` instructs it to run again. Returns once
    the compensation run has judged the request (``compensation_judged``): refused, REFUSED."""
    snap = await snapshot(client, run_id)  # its tenant; the worker checks everything again
    if snap.state not in TERMINAL:
        raise Refused(f"run {run_id} is {snap.state.value}: only an ended run is compensated")
    # Refused here, before anything starts, where this client can tell (a refused request leaves
    # no Failed execution behind); the compensation run's worker judges everything again.
    standing, unread = await ledger_standing(snap.compensations)
    if unread is not None:
        # What no run undid yet is what the ledger says: without it, nothing is started.
        raise UsageError(f"run {run_id} is not compensated now: {unread}; fix the workers' audit sink "
                          "(TETHER_AUDIT_DIR / TETHER_AUDIT_DSN) and try again", rule="ledger_unavailable")
    refused = compensate_refusal(by, snap, standing, policy_path)
    if refused is not None:
        raise refused
    try:
        request = RunRequest(
            goal=f"compensate run {run_id}", tenant=snap.tenant, requested_by=by, compensate_run=run_id,
            rerun_unknown=list(rerun_unknown),
        )
    except ValidationError as e:
        raise invalid("compensation request", e) from None
    new_id = compensation_id(run_id)
    if key is not None:
        request = sign_request(request, new_id, key)
    try:
        handle = await start_run(client, request, run_id=new_id, queue=queue, allow_id_reuse=True)
    except TetherError as e:
        if e.rule == "already_started":
            raise Refused(f"run {run_id} is being compensated now by {new_id}: see `tether status {new_id}`") from None
        raise
    await compensation_judged(client, new_id, timeout)
    return handle


async def compensate_tree(
    client: Client, run_id: str, *, by: str, key: Path | None = None, queue: str | None = None,
    rerun_unknown: Sequence[str] = (), policy_path: Path | None = None, timeout: float = VERDICT_TIMEOUT,
) -> list[WorkflowHandle[Any, Any]]:
    """``compensate`` of a run and its delegation tree, as one unit: the run's own compensation
    (a completed child's undos are already the parent's), then one for each child whose writes
    no run above it took as its undos (a child the parent handed off on, or adopted as unknown,
    or one that ended without completing): its writes are undone too. Refused, before anything
    starts, while a child of the tree is still open (it may still write) or cannot be read.
    Returns the compensation runs started, the run's first (none of its own: only its
    children's). Each is ``compensate``: the same checks, judgement and undo ledger."""
    snap = await snapshot(client, run_id)
    if snap.state not in TERMINAL:
        raise Refused(f"run {run_id} is {snap.state.value}: only an ended run is compensated")
    tree = await tree_spend(client, snap)
    open_ = [c.run_id for c in tree if c.error is not None or c.state not in TERMINAL]
    if open_:
        raise Refused(
            f"run {run_id} has children that may still write or cannot be read: {', '.join(map(escape_text, open_))}; "
            f"cancel or hand them off (or wait for their end), then compensate", rule="tree_open")
    taken = {c.of for c in snap.compensations}  # the undos a run above a child holds
    steps = {run_id: set(taken)}  # each run's writes: a --rerun-unknown STEP goes to the run that wrote it
    targets = []
    for child in tree:
        child_snap = await snapshot(client, child.run_id)
        if any(c.tool and c.of not in taken for c in child_snap.compensations):
            targets.append(child.run_id)
        steps[child.run_id] = {c.of for c in child_snap.compensations}
        taken |= steps[child.run_id]
    if stray := [s for s in rerun_unknown if not any(s in of for of in steps.values())]:
        raise UsageError(f"--rerun-unknown {', '.join(map(escape_text, stray))}: no write of run {run_id} or its "
                          "children has that tool call id; nothing was started")
    handles: list[WorkflowHandle[Any, Any]] = []
    nothing: TetherError | None = None
    for target in (run_id, *targets):
        try:
            handles.append(await compensate(
                client, target, by=by, key=key, queue=queue, policy_path=policy_path, timeout=timeout,
                rerun_unknown=[s for s in rerun_unknown if s in steps[target]]))
        except TetherError as e:
            if e.rule != "nothing_to_compensate":
                raise  # the ones started go on: each is a governed run of its own
            nothing = nothing or e
    if not handles and nothing is not None:
        raise nothing
    return handles


async def compensation_judged(client: Client, run_id: str, timeout: float) -> RunSnapshot:
    """The compensation run's first judgement (its requester may ask it: the current file, Cedar's
    ``compensate``; then what the original left to undo): it has left RECEIVED. Refused (it
    ended FAILED on its record): REFUSED with the rule; no judgement within ``timeout``:
    PENDING."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    await require_worker(client, run_id)
    while True:
        try:
            snap = await snapshot(client, run_id, timeout=max(deadline - loop.time(), 1.0))
        except TetherError as e:
            if e.rule != "no_worker" or loop.time() >= deadline:
                raise
            continue
        if snap.state != RunState.RECEIVED:
            break
        if loop.time() >= deadline:
            raise Pending(f"compensation {run_id} started, verdict pending: the run has not judged it yet "
                              f"(`tether status {run_id}` shows it)")
        await asyncio.sleep(0.2)
    if snap.state == RunState.FAILED:
        final = (await timeline(client, run_id))[-1]
        raise Refused(f"{final.reason} [rule: {final.refs.error_code}]", rule=final.refs.error_code)
    return snap
