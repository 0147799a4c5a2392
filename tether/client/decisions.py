"""A person's word on a run: approve or reject (``decide``, ``build_decision``), revise; through
the run's decide Update, answered by the run's record of it (``Verdict``); and the plan an
approval lets run (``plan_to_run``). A hand-off is tether/client/handoffs.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from temporalio.client import (
    Client,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.api.enums.v1 import PendingWorkflowTaskState
from temporalio.service import RPCError, RPCStatusCode

from workflows import policy
from workflows.contract import DecideRequest, DecideResult, Plan, ReviseDecideRequest
from workflows.run_state import PendingApproval, RunSnapshot
from workflows.states import TERMINAL, RunState, TransitionRecord
from tether.connection import PENDING, REFUSED, NoWorker, Pending, Refused, TetherError, UsageError, rpc_error
from tether.runs import RepairResult, ViewUnverified, describe as _describe, published_view, stuck_task
from tether.client.errors import _refused_update, invalid
from tether.pollers import PROBE_TIMEOUT
from tether.client.workers import no_answer, no_worker_message, require_worker
from tether.client.signing import sign
from tether.client.shown import approval_offer_problem
from tether.client.reads import RunStatus, read_run, timeline


# Seconds a decision or handoff waits for the run's verdict (TETHER_VERDICT_TIMEOUT).
VERDICT_TIMEOUT = float(os.environ.get("TETHER_VERDICT_TIMEOUT") or 10.0)


class Verdict(BaseModel):
    """The run's record of a decision or handoff (``record`` None: not processed in time)."""

    run_id: str
    decision_id: str
    record: TransitionRecord | None = None
    plan: Plan | None = None
    pending: PendingApproval | None = None
    reset: RepairResult | None = None  # a forced hand-off's reset


async def _await_record(client: Client, run_id: str, decision_id: str, timeout: float) -> TransitionRecord | None:
    """The run decides; read its verdict back from the timeline (refs.decision_id): the
    ``timeline`` query, or where no worker that replays the run answers it (another build's
    took it), what the run published and its audit records."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if (record := await _record_now(client, run_id, decision_id)) is not None:
            return record
        if loop.time() > deadline:
            return None
        await asyncio.sleep(0.2)


async def _record_now(client: Client, run_id: str, decision_id: str) -> TransitionRecord | None:
    """The run's record of the decision as it stands now (None: not on it, or not readable)."""
    try:
        records = await timeline(client, run_id)
    except TetherError:
        try:
            records = (await read_run(client, run_id))[1]
        except TetherError:
            records = []  # sent all the same: the verdict is read later (`tether status`)
    return next((r for r in reversed(records) if r.refs.decision_id == decision_id), None)


@dataclass(frozen=True)

class DecisionInput:
    """What a person decides on a pending plan (``plan_hash`` None: the pending one)."""

    by: str
    plan_hash: str | None = None
    decision_id: str | None = None  # None: a random one
    comment: str | None = None
    reason: str | None = None
    key: Path | None = None  # PEM Ed25519 private key: sign the decision
    request_id: str | None = None  # None: the pending one (else refused when it is not)
    # A trusted signer's name (policy [signers.NAME]): ``key`` is that signer's, attesting that
    # it verified ``by`` itself (the inbox); the run shows ``user:BY via NAME``.
    attest_as: str | None = None
    steps: list[int] | None = None  # approve only these steps (1-based); None: all
    # Not bound to a plan the person was shown (`tether approve --unreviewed`): the record says so.
    unreviewed: bool = False


# The shortest plan hash prefix a decision may name: what `tether` prints (timeline, refusals).
HASH_PREFIX = 12


def resolve_plan_hash(given: str | None, pending: str) -> str:
    """The plan hash a decision names: ``given`` in full, or a prefix of at least HASH_PREFIX
    hex characters of the pending hash (the form tether prints) widened to it. Any other hash
    is sent as given, and the run refuses it as stale on its record."""
    if given is None:
        return pending
    text = given.strip().lower()
    if not re.fullmatch(r"[0-9a-f]+", text) or len(text) < HASH_PREFIX:
        raise UsageError(
            f"plan hash {given[:80]!r}: give the plan's hash, or at least its first {HASH_PREFIX} hex characters "
            f"(as `tether status RUN` prints it)", field="plan_hash", detail=f"give at least {HASH_PREFIX} hex characters of the plan hash",
        )
    return pending if pending.startswith(text) else text


def build_decision(snap: RunSnapshot, kind: Literal["approve", "reject"], given: DecisionInput) -> DecideRequest:
    """The one place a decision is built and, with ``given.key``, signed (Ed25519 over
    ``policy.signature_payload``); the approval contract lives here for every client."""
    pending = snap.pending_approval
    if pending is None:
        raise Refused(f"run {snap.run_id} has no pending approval")
    _refuse_folded(given.by)
    try:
        decision = DecideRequest(
            kind=kind,
            decision_id=given.decision_id if given.decision_id is not None else uuid.uuid4().hex,
            approver=given.by,
            plan_hash=resolve_plan_hash(given.plan_hash, pending.plan_hash),
            request_id=given.request_id or pending.request_id or None,
            comment=given.comment,
            reason=given.reason,
            attested_by=given.attest_as,
            steps=given.steps,
            unreviewed=given.unreviewed,
        )
    except ValidationError as e:
        raise invalid("decision", e) from None
    if given.key is not None:
        payload = policy.decision_signature_payload(
            workflow_id=snap.run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, kind=kind, decision=decision
        )
        decision.signature = sign(given.key, payload)
    return decision


def _refuse_folded(name: str) -> None:
    """A decider's name exactly as the policy writes people: "Bob" or fullwidth "ＢＯＢ" is refused
    (naming the field), never folded onto bob, as the inbox refuses such a sign-in."""
    from workflows.identity import normalize_name

    try:
        normal = normalize_name(name)
    except ValueError as e:
        raise UsageError(f"invalid name {name[:80]!r}: {e}", field="by", detail=str(e)) from None
    if normal != name:
        raise UsageError(
            f"name {name[:80]!r} is not written as the policy names people ({normal!r}): refused, never folded",
            field="by", detail=f"write the name as the policy does: {normal!r}",
        )


def revised_steps(plan: Plan, edits: Sequence[tuple[int, str, Any]]) -> list[dict[str, Any]]:
    """The whole plan as ``{tool, args}`` steps with the edits applied (the run validates it)."""
    steps: list[dict[str, Any]] = [{"tool": s.tool, "args": dict(s.args)} for s in plan.steps]
    for number, key, value in edits:
        if number > len(steps):
            raise Refused(f"--step {number}: the pending plan has {len(steps)} step(s)")
        steps[number - 1]["args"][key] = value
    return steps


async def revise(
    client: Client,
    run_id: str,
    given: DecisionInput,
    steps: list[dict[str, Any]],
    *,
    held: RunSnapshot | None = None,
    timeout: float = VERDICT_TIMEOUT,
) -> Verdict:
    """Revise the run's pending plan (the whole revised list of steps); returns the run's record
    of it (VALIDATED: a new plan version, then a new approval request), or raises REFUSED with
    the rule (``invalid_revision`` and the validation reason, stale, not awaiting, role, ...).
    ``held``: the run as the caller read it, as for ``decide``."""
    snap, pending = await pending_request(client, run_id, held=held)
    _refuse_folded(given.by)
    try:
        # The steps as the user gave them, validated here (as the run validates them).
        revision = ReviseDecideRequest.model_validate(dict(
            kind="revise",
            decision_id=given.decision_id if given.decision_id is not None else uuid.uuid4().hex,
            editor=given.by,
            plan_hash=resolve_plan_hash(given.plan_hash, pending.plan_hash),  # a stale one is sent, refused on the record
            request_id=given.request_id or pending.request_id or None,
            steps=steps,
            reason=given.reason or "",
            attested_by=given.attest_as,
        ))
    except ValidationError as e:
        raise invalid("revision", e) from None
    if given.key is not None:
        payload = policy.decision_signature_payload(
            workflow_id=snap.run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, kind="revise",
            decision=revision.as_decision(), steps_digest=revision.revised_hash(),
        )
        revision.signature = sign(given.key, payload)
    try:
        record = await _send_decision(client, run_id, revision, timeout)
    except TetherError as e:
        raise _unmatched(e, snap, revision.plan_hash) from None
    return Verdict(run_id=run_id, decision_id=revision.decision_id, record=record, plan=snap.plan, pending=pending)


async def decide(
    client: Client,
    run_id: str,
    kind: Literal["approve", "reject"],
    given: DecisionInput,
    *,
    held: RunSnapshot | None = None,
    timeout: float = VERDICT_TIMEOUT,
) -> Verdict:
    """Approve or reject the run's pending plan; returns the run's record of the decision.

    ``held``: the run as the caller read it and showed it (``pending_request``): its pending
    request is the one decided, not read a second time.

    Refused before sending (not awaiting approval, stale plan hash) or by the run (four-eyes,
    role, signature, ...): :class:`TetherError` with code REFUSED and the rule.
    """
    snap, pending = await pending_request(client, run_id, held=held)
    # A stale plan hash is sent all the same: the run records the attempt, and refuses it
    # (stale_plan_hash) on its timeline.
    decision = build_decision(snap, kind, given)
    try:
        record = await _send_decision(client, run_id, decision, timeout)
    except TetherError as e:
        raise _unmatched(e, snap, decision.plan_hash) from None
    return Verdict(run_id=run_id, decision_id=decision.decision_id, record=record, plan=snap.plan, pending=pending)


def _unmatched(error: TetherError, snap: RunSnapshot, given: str) -> TetherError:
    """A refusal for a plan hash that is not the pending plan's, said as what it is: the hash
    given matches no plan under review (an earlier version's, or none). The run's own words name
    the pending hash, which a person would paste and so approve a plan they never reviewed: never
    shown here."""
    if error.rule != "stale_plan_hash":
        return error
    run_id = snap.run_id
    earlier = any(r.previous_plan_hash.startswith(given) for r in snap.revisions)
    return Refused(
        f"plan hash {given[:HASH_PREFIX]} {'is an earlier version of the plan (revised since) and ' if earlier else ''}"
        f"does not match the plan under review: nothing was decided (the run "
        f"recorded the attempt). Review the plan with `tether status {run_id}`, then decide the plan you reviewed "
        f"[rule: {error.rule}]", rule=error.rule,
    )


async def pending_request(
    client: Client, run_id: str, *, held: RunSnapshot | None = None
) -> tuple[RunSnapshot, PendingApproval]:
    """``_pending_request``; a run no worker serves now is REFUSED (exit 1): nothing is sent, so
    nothing is decided (never USAGE: the person's input was fine, the outcome is "not sent")."""
    try:
        return await _pending_request(client, run_id, held=held)
    except TetherError as e:
        if e.rule != "no_worker":
            raise
        raise _not_sent(e, run_id) from None


def _not_sent(error: TetherError, run_id: str) -> Refused:
    """A decision refused before it was sent (no worker to take it): REFUSED, saying so."""
    return Refused(f"not sent: nothing was decided on run {run_id}: {error}", rule=error.rule)


async def _pending_request(
    client: Client, run_id: str, *, held: RunSnapshot | None = None
) -> tuple[RunSnapshot, PendingApproval]:
    """The run's pending request, read from the view it published and the fleet's key signed
    (a worker is there to take a decision), or REFUSED.

    Never from the ``snapshot`` query: whoever started the run may answer it. A run that has
    published nothing yet is REFUSED (``not_published``), one whose view does not verify too
    (``view_unverified``): no decision is sent to either.

    ``held``: the run as the caller already read it from its signed view (a ``RunStatus`` with
    ``published_at``): taken as it is when it holds a pending request, with no call. The view
    lags a moment behind a run that is just coming to rest on a request (its first, a revision,
    a new one): it is read again for up to PENDING_QUERY_SECONDS until it holds one. Either way
    the steps shown must hash to the plan hash the request binds (``approval_offer_problem``),
    or nothing is offered."""
    signed = isinstance(held, RunStatus) and held.published_at is not None and not held.unpublished
    if signed and isinstance(held, RunStatus) and held.state == RunState.AWAITING_APPROVAL \
            and held.pending_approval is not None:
        if held.worker_serving is False and held.task_queue is not None:
            raise NoWorker(no_worker_message(held.task_queue))  # as its probe said
        return held, held_request(held)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PENDING_QUERY_SECONDS
    description = await _describe(client, run_id)
    await require_worker(client, run_id, description)
    while True:
        try:
            view = await published_view(description)
        except ViewUnverified as e:
            raise Refused(f"run {run_id}: {e}: no decision is sent to it", rule="view_unverified") from None
        if view is None and loop.time() > deadline:
            raise Refused(
                f"run {run_id} is not published yet: it has published no view the fleet's key signed, so what it "
                f"answers is no one's word; no decision is sent to it (`tether status {run_id}`)", rule="not_published",
            )
        if view is not None and (
            view.snapshot.state == RunState.AWAITING_APPROVAL and view.snapshot.pending_approval is not None
            or view.snapshot.state in TERMINAL or loop.time() > deadline
        ):
            snap = view.snapshot
            break
        await asyncio.sleep(0.2)
        description = await _describe(client, run_id)
    # As read from its signed view: a later call given it (``held``) takes it as it is.
    status = RunStatus(**snap.model_dump(), published_at=view.published_at, task_queue=description.task_queue)
    return status, held_request(status)


def held_request(snap: RunSnapshot) -> PendingApproval:
    """The pending request of a run as read, or REFUSED: it is not awaiting approval, or the steps
    shown do not hash to the plan hash the request binds (``approval_offer_problem``)."""
    pending = snap.pending_approval
    if snap.state != RunState.AWAITING_APPROVAL or pending is None:
        raise Refused(
            f"run {snap.run_id} is {snap.state.value}, not awaiting approval", rule="not_awaiting_approval"
        )
    problem = approval_offer_problem(snap)
    if problem is not None:
        raise Refused(f"run {snap.run_id}: {problem}", rule="plan_unverified")
    return pending


# How long `approve` waits for a run's signed view to hold its pending request (it publishes where it rests).
PENDING_QUERY_SECONDS = 2.0


# How soon a decision the run had no room for is sent again (it is continuing as new).
CONTINUING_RETRY = 0.25


async def _send_decision(
    client: Client, run_id: str, decision: DecideRequest | ReviseDecideRequest, timeout: float
) -> TransitionRecord | None:
    """Through the decide Update; the run's record of it, or REFUSED / PENDING with the rule."""
    handle = client.get_workflow_handle(run_id)
    pending_verdict = Pending(
        f"decision {decision.decision_id} accepted, verdict pending: the run is still checking it "
        f"(`tether status {run_id}` shows the verdict once it is there)",
    )
    deadline = asyncio.get_running_loop().time() + timeout
    resent = False  # sent again after Temporal refused it while the run's task failed
    result: DecideResult | None = None
    while True:
        update = None
        try:
            # The decide Update: only a malformed or repeated decision, or one the run has no
            # room for until it continues as new, is refused before history; the answer is the
            # run's own record of the decision (policy check included).
            # An id of its own (never the decision's alone: the same decision id sent again is the
            # run's to refuse, not Temporal's to answer with the first one's result), so whether
            # Temporal holds it can be asked (``_update_held``).
            update_id = f"{decision.decision_id}.{uuid.uuid4().hex[:12]}"
            update = await handle.start_update(
                "decide", decision, wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=DecideResult,
                id=update_id, rpc_timeout=timedelta(seconds=timeout),
            )
            result = await asyncio.wait_for(update.result(rpc_timeout=timedelta(seconds=timeout)), timeout)
            break
        except WorkflowUpdateFailedError as e:
            refused = _refused_update(e, decision.kind)
            if resent and refused.rule == "duplicate_decision":
                break  # the first one was kept and taken once the task went through: read its verdict
            if refused.rule != "continuing_as_new" or asyncio.get_running_loop().time() >= deadline:
                raise refused from None
            # The run continues as new in a moment: the handle's latest run takes it then.
            await asyncio.sleep(CONTINUING_RETRY)
        except WorkflowUpdateRPCTimeoutOrCancelledError:
            if update is not None:
                raise pending_verdict from None  # accepted: on the run's record, to be judged
            # Not acknowledged in time: a worker is in the middle of the run's task (the policy
            # check runs in it, and the acceptance goes out with it), or no worker is there.
            task = await _pending_task(handle)
            if task is not None and task.attempt > 1 and await _task_failed(client, run_id):
                raise _task_failing_error(run_id) from None  # failing (not timing out): nothing is taken
            if task is not None and task.state == PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_STARTED:
                raise pending_verdict from None
            if await _update_held(client, run_id, update_id) is not False:
                # Temporal took it in: a worker of the run's build judges it when it takes the
                # run's task, however long that is (a task retried after timing out on a worker
                # that is gone included). Sent, pending; never "not sent".
                raise await _sent_untaken(client, run_id, decision.decision_id, timeout) from None
            # Temporal says it holds no such Update: nothing was sent.
            raise _not_sent(await no_answer(client, run_id, timeout), run_id) from None
        except asyncio.TimeoutError:
            # Accepted: it is on the run's record, and will be judged; not an error, not a verdict.
            raise pending_verdict from None
        except RPCError as e:
            if not _task_failing(e):
                error = rpc_error(e, run_id)
                if resent and isinstance(error, Refused):
                    # Sent while the run's task failed, Temporal may have kept it: the run took it
                    # and ended before this resend. Its record says so.
                    if (record := await _record_now(client, run_id, decision.decision_id)) is not None:
                        return record
                raise error from None
            if asyncio.get_running_loop().time() >= deadline:
                raise _task_failing_error(run_id) from None
            # Not taken: the run's workflow task failed on a worker that does not replay it (another
            # build's, on an unversioned queue). Temporal retries the task; a worker of the run's
            # own build takes it, and then the decision.
            resent = True
            await asyncio.sleep(TASK_FAILING_RETRY)
    if result is not None and result.outcome == "refused":
        raise Refused(f"{result.reason} [rule: {result.rule}]", rule=result.rule)
    if result is not None and result.record is not None:
        return result.record  # the run's own record of it, in its answer: nothing more to ask
    # A run of an older build answers with the verdict alone: its record is read back.
    return await _await_record(client, run_id, decision.decision_id, timeout)


async def _task_failed(client: Client, run_id: str) -> bool:
    """Whether the run's workflow task keeps failing (a WorkflowTaskFailed event begins the
    streak), not only timing out on a worker that is gone."""
    try:
        stuck = await stuck_task(client, await _describe(client, run_id))
    except TetherError:
        return False
    return stuck is not None and stuck.event_id is not None


async def _update_held(client: Client, run_id: str, update_id: str) -> bool | None:
    """Whether Temporal holds the decide Update ``update_id`` of the run (admitted, or further):
    False only when it says it has none; None when it cannot tell."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import UpdateWorkflowExecutionLifecycleStage
    from temporalio.api.update.v1 import UpdateRef, WaitPolicy
    from temporalio.api.workflowservice.v1 import PollWorkflowExecutionUpdateRequest

    try:
        await client.workflow_service.poll_workflow_execution_update(
            PollWorkflowExecutionUpdateRequest(
                namespace=client.namespace,
                update_ref=UpdateRef(workflow_execution=WorkflowExecution(workflow_id=run_id), update_id=update_id),
                identity=client.identity,
                wait_policy=WaitPolicy(
                    lifecycle_stage=UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ADMITTED
                ),
            ),
            timeout=PROBE_TIMEOUT,
        )
    except RPCError as e:
        return False if e.status == RPCStatusCode.NOT_FOUND else None
    return True


async def _sent_untaken(client: Client, run_id: str, decision_id: str, waited: float) -> TetherError:
    """A decision Temporal holds that no worker has taken within ``waited`` seconds: sent and
    pending (exit 3), with its id, how to follow it, and why it waits (which queue, and how to
    start a worker of it)."""
    why = str(await no_answer(client, run_id, waited))
    return Pending(
        f"decision {decision_id} sent and pending: Temporal holds it, and no worker has taken it yet ({why}); "
        f"a worker of the run's build judges it when it takes the run's task: follow it with "
        f"`tether status {run_id}` (its verdict shows as decision {decision_id}); do not send it again", rule="pending",
    )


# How soon a decision is sent again that Temporal refused while the run's workflow task failed.
TASK_FAILING_RETRY = 0.5


def _task_failing(err: RPCError) -> bool:
    """Temporal takes no Update while the run's last workflow task failed (until one completes)."""
    return err.status == RPCStatusCode.FAILED_PRECONDITION and "workflow task in failed state" in err.message.lower()


async def _pending_task(handle: WorkflowHandle[Any, Any]) -> Any:
    """The run's pending workflow task (STARTED: a worker is working on the run right now;
    attempt > 1: it keeps failing); None: none, or the run cannot be described."""
    try:
        description = await handle.describe()
    except RPCError:
        return None
    raw = description.raw_description
    return raw.pending_workflow_task if raw.HasField("pending_workflow_task") else None


def _task_failing_error(run_id: str) -> TetherError:
    return UsageError(
        f"run {run_id} takes no decision while its workflow task keeps failing: `tether status {run_id}` says why "
        f"(older_build: a worker of another build took it, run one of the run's own build; otherwise "
        f"`tether repair {run_id}`)", rule="task_failing",
    )


def plan_to_run(verdict: Verdict, steps: Sequence[int] | None = None) -> Plan | None:
    """The plan an approval lets run, read from the run's record of it (no call): the plan
    decided, or for a partial approval (``steps``) its kept steps, the plan's next version, when
    they hash to the plan hash the record names. None: the record does not tell (it names no
    plan, or the kept steps do not hash to it): ask the run (``snapshot``)."""
    record, plan = verdict.record, verdict.plan
    if record is None or plan is None or not record.refs.plan_hash:
        return None
    if record.refs.plan_hash == plan.plan_hash:
        return plan
    kept = sorted(set(steps or ()))
    if not kept or kept[-1] > len(plan.steps) or kept[0] < 1:
        return None
    narrowed = plan.model_copy(update={
        "steps": [plan.steps[n - 1] for n in kept],
        "undo": None if plan.undo is None else [plan.undo[n - 1] for n in kept],
        "plan_hash": record.refs.plan_hash,
        "version": plan.version + 1,  # a partial approval revises the plan: its next version
    })
    return narrowed if narrowed.hashes_to_itself() else None
