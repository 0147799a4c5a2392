"""Drive Tether from a program: connect to Temporal, start runs, decide, hand off, cancel, inspect.

The ``tether`` CLI (``starter.py``), the demo, the benchmarks and the tests all go through these
functions; none of them needs argparse. Each returns a pydantic model or raises
:class:`TetherError`, whose ``code`` is the CLI's exit code:

    0 OK        done
    1 REFUSED   the run refused it (stale plan hash, four-eyes, not a member, not awaiting
                approval, already finished) or, for a wait, the run ended other than COMPLETED
    2 USAGE     bad input, unknown run, Temporal unreachable

Connection settings come from Temporal's environment configuration (TEMPORAL_ADDRESS,
TEMPORAL_NAMESPACE, TLS and API-key variables, profiles); payload encryption from
``TETHER_ENCRYPTION_KEY_FILE`` (``activities/codec.py``).

    client = await connect()
    handle = await start_run(client, RunRequest(...), run_id="run-1")
    status = await wait_settled(client, "run-1", timeout=60)
    verdict = await decide(client, "run-1", "approve", DecisionInput(by="bob"))
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.envconfig import ClientConfig
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.codec import KeyFileError, data_converter_from_env
from workflows import policy
from workflows.agent_run import STATE_ATTRIBUTE, TENANT_ATTRIBUTE
from workflows.models import (
    NAME_PATTERN,
    DecideRequest,
    DecideResult,
    HandoffRequest,
    PendingApproval,
    Plan,
    RunOutcome,
    RunRequest,
    RunSnapshot,
    first_error,
)
from workflows.states import TERMINAL, RunState, TransitionRecord

OK, REFUSED, USAGE = 0, 1, 2
DEFAULT_TASK_QUEUE = "tether"
QUERY_TIMEOUT = timedelta(seconds=10)
VERDICT_TIMEOUT = 10.0  # seconds a decision or handoff waits for the run's record of it
CONNECT_HINT = "start it with `make dev-server` or set TEMPORAL_ADDRESS"


class TetherError(Exception):
    """A failed operation, as one line for a person, with the CLI's exit code.

    ``field`` names the input that was invalid (a model field such as ``approver``), so a front
    end can point at its own option for it.
    """

    def __init__(self, message: str, code: int = USAGE, *, field: str | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.field = field
        self.detail = detail or message


def invalid(what: str, err: ValidationError) -> TetherError:
    """A pydantic error as a usage error naming the field (never a traceback)."""
    first = err.errors()[0]
    names = [str(p) for p in first["loc"] if not isinstance(p, int)]
    return TetherError(f"invalid {what}: {first_error(err)}", field=names[-1] if names else None, detail=first["msg"])


# ----------------------------------------------------------------------------- connection


def exit_process(code: int | None) -> None:
    """Exit without interpreter teardown, after flushing output.

    The Temporal client's native threads can outlive the event loop and crash CPython's
    finalization (SIGABRT, "PyGILState_Release ... must be current"; sdk-python issue #300),
    which would turn a successful command into exit code 134.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # the reader went away (`| head`): nothing left to tell it
    os._exit(code or 0)


def task_queue() -> str:
    return os.environ.get("TETHER_TASK_QUEUE", DEFAULT_TASK_QUEUE)


def connect_config(**overrides: Any) -> dict[str, Any]:
    """Temporal's environment configuration (env vars, profiles), with our defaults."""
    config: dict[str, Any] = dict(ClientConfig.load_client_connect_config())
    config.setdefault("target_host", "localhost:7233")
    config.setdefault("namespace", "default")
    config.update(overrides)
    return config


def target_host() -> str:
    return connect_config()["target_host"]


def connect_cause(text: str) -> str:
    """The readable part of the SDK's connection error (a nested Rust debug string)."""
    kind = re.search(r'ConnectError\("([^"]+)"', text)
    details = re.findall(r'(?:message|error): "([^"]+)"', text)
    parts = [p for p in (kind.group(1) if kind else None, details[-1] if details else None) if p]
    return ": ".join(parts) if parts else " ".join(text.split())


async def connect(**overrides: Any) -> Client:
    """Connect with Temporal's environment configuration and Tether's data converter.

    The converter is pydantic's; when ``TETHER_ENCRYPTION_KEY_FILE`` names a key file it also
    encrypts every payload and failure message (``activities/codec.py``). Overrides (target_host,
    namespace, runtime, interceptors, data_converter, ...) go to ``Client.connect``. A server
    that cannot be reached raises :class:`TetherError` naming the address and the cause.
    """
    config = connect_config(**overrides)
    try:
        if "data_converter" not in config:
            config["data_converter"] = data_converter_from_env()
        return await Client.connect(**config)
    except KeyFileError as e:
        raise TetherError(f"payload encryption: {e}") from None
    except RuntimeError as e:
        raise TetherError(
            f"cannot reach Temporal at {config['target_host']} ({connect_cause(str(e))}); {CONNECT_HINT}"
        ) from None


# ----------------------------------------------------------------------------- errors


def rpc_error(err: RPCError, run_id: str) -> TetherError:
    if err.status == RPCStatusCode.NOT_FOUND:
        if "completed" in err.message.lower():
            return TetherError(f"run {run_id} already finished", REFUSED)
        return TetherError(f"unknown run {run_id!r}: check the id with `tether list`")
    if err.status == RPCStatusCode.DEADLINE_EXCEEDED:
        return TetherError(f"no worker answered for run {run_id}: start one with `make worker`")
    if err.status == RPCStatusCode.UNAVAILABLE:
        return TetherError(f"Temporal became unreachable ({err.message.splitlines()[0] if err.message else 'unavailable'})")
    return TetherError(f"Temporal refused the call for {run_id}: {err.message}")


# ----------------------------------------------------------------------------- runs


class RunStatus(RunSnapshot):
    """The ``snapshot`` query, plus why the run ended (the final record) once it has."""

    end_reason: str | None = None
    end_rule: str | None = None  # the rule or error code on that record, when it names one
    end_actor: str | None = None  # who or what ended it (user:bob, operator:dana, runtime)

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL


class RunSummary(BaseModel):
    run_id: str
    state: str | None
    tenant: str | None
    status: str | None
    started: datetime | None


class Verdict(BaseModel):
    """The run's record of a decision or handoff (``record`` None: not processed in time)."""

    run_id: str
    decision_id: str
    record: TransitionRecord | None = None
    plan: Plan | None = None
    pending: PendingApproval | None = None


def sign_request(request: RunRequest, run_id: str, key: Path) -> RunRequest:
    """The request with the requester's Ed25519 signature over policy.start_signature_payload:
    where the tenant requires signatures, a run starts only with it."""
    payload = policy.start_signature_payload(
        workflow_id=run_id,
        tenant=request.tenant,
        requested_by=request.requested_by,
        request_digest=request.request_digest(),
    )
    signature = base64.b64encode(load_private_key(key).sign(payload)).decode()
    return request.model_copy(update={"requester_signature": signature})


async def start_run(
    client: Client,
    request: RunRequest,
    *,
    run_id: str,
    queue: str | None = None,
    allow_id_reuse: bool = False,
) -> WorkflowHandle:
    """Start an AgentRun the one way: search attributes and Web UI summary set from the start.

    The id of a run that has finished is not reused unless asked for: decisions and signatures
    name the first run id, but a person reading "run X" should find one run.
    """
    try:
        return await client.start_workflow(
            "AgentRun",
            request,
            id=run_id,
            task_queue=queue or task_queue(),
            id_reuse_policy=(
                WorkflowIDReusePolicy.ALLOW_DUPLICATE if allow_id_reuse else WorkflowIDReusePolicy.REJECT_DUPLICATE
            ),
            result_type=RunOutcome,
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(STATE_ATTRIBUTE, RunState.RECEIVED.value),
                    SearchAttributePair(TENANT_ATTRIBUTE, request.tenant),
                ]
            ),
            static_summary=f"{request.goal[:120]} · tenant {request.tenant}",
            static_details=(
                f"**Goal:** {request.goal[:500]}\n\n**Tenant:** `{request.tenant}` · "
                f"**requested by** `{request.requested_by}` · **planner** `{request.planner}`"
            ),
        )
    except WorkflowAlreadyStartedError:
        raise TetherError(f"a run with id {run_id!r} already exists: pick another id") from None
    except RPCError as e:
        raise rpc_error(e, run_id) from None


async def snapshot(client: Client, run_id: str) -> RunSnapshot:
    handle = client.get_workflow_handle(run_id)
    try:
        return await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    except WorkflowQueryFailedError as e:
        raise TetherError(f"run {run_id} could not answer: {e}") from None


async def timeline(client: Client, run_id: str) -> list[TransitionRecord]:
    handle = client.get_workflow_handle(run_id)
    try:
        return await handle.query("timeline", result_type=list[TransitionRecord], rpc_timeout=QUERY_TIMEOUT)
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    except WorkflowQueryFailedError as e:
        raise TetherError(f"run {run_id} could not answer: {e}") from None


async def full_timeline(client: Client, run_id: str, audit_dir: str | None = None) -> list[TransitionRecord]:
    """Every record of the run, each once: the audit sink's (TETHER_AUDIT_DIR) merged with the
    window the run keeps (the timeline query holds the first and the latest records only)."""
    from activities.audit import JsonlAuditSink, merge_timeline

    window = await timeline(client, run_id)
    snap = await snapshot(client, run_id)
    sink = JsonlAuditSink.from_env(audit_dir)
    return merge_timeline(sink.read(run_id, snap.first_run_id), window)


async def status(client: Client, run_id: str) -> RunStatus:
    """The run's snapshot; for a run that has ended, also the reason on its final record."""
    snap = await snapshot(client, run_id)
    result = RunStatus(**snap.model_dump())
    if result.ended:
        moves = [r for r in await timeline(client, run_id) if r.kind == "transition"]
        if moves:
            final = moves[-1]
            result.end_reason = final.reason
            result.end_rule = final.rule or final.refs.error_code
            result.end_actor = final.actor
            if final.from_state == RunState.VALIDATION_FAILED and len(moves) > 1:
                # "the replan budget is used up" says little without what failed validation.
                result.end_reason += f"; last validation: {moves[-2].reason}"
    return result


async def wait_settled(client: Client, run_id: str, timeout: float, *, approval_settles: bool = True) -> RunStatus:
    """Poll until the run has ended (or waits for a person, with ``approval_settles``) or
    ``timeout`` seconds have passed; returns its status then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        snap = await snapshot(client, run_id)
        waiting = approval_settles and snap.state == RunState.AWAITING_APPROVAL
        if waiting or snap.state in TERMINAL or loop.time() > deadline:
            return await status(client, run_id)
        await asyncio.sleep(0.2)


async def _await_record(client: Client, run_id: str, decision_id: str, timeout: float) -> TransitionRecord | None:
    """The run decides; read its verdict back from the timeline (refs.decision_id)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for record in reversed(await timeline(client, run_id)):
            if record.refs.decision_id == decision_id:
                return record
        if loop.time() > deadline:
            return None
        await asyncio.sleep(0.2)


def _refused(record: TransitionRecord | None) -> None:
    if record is not None and record.kind == "refused":
        raise TetherError(f"{record.reason} [rule: {record.rule}]", REFUSED)


@dataclass(frozen=True)
class DecisionInput:
    """What a person decides on a pending plan (``plan_hash`` None: the pending one)."""

    by: str
    plan_hash: str | None = None
    decision_id: str | None = None  # None: a random one
    comment: str | None = None
    reason: str | None = None
    key: Path | None = None  # PEM Ed25519 private key: sign the decision


def build_decision(snap: RunSnapshot, kind: Literal["approve", "reject"], given: DecisionInput) -> DecideRequest:
    """The one place a decision is built and, with ``given.key``, signed (Ed25519 over
    ``policy.signature_payload``); the approval contract lives here for every client."""
    pending = snap.pending_approval
    if pending is None:
        raise TetherError(f"run {snap.run_id} has no pending approval", REFUSED)
    try:
        decision = DecideRequest(
            kind=kind,
            decision_id=given.decision_id if given.decision_id is not None else uuid.uuid4().hex,
            approver=given.by,
            plan_hash=given.plan_hash or pending.plan_hash,
            request_id=pending.request_id or None,
            comment=given.comment,
            reason=given.reason,
        )
    except ValidationError as e:
        raise invalid("decision", e) from None
    if given.key is not None:
        payload = policy.decision_signature_payload(
            workflow_id=snap.run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, kind=kind, decision=decision
        )
        decision.signature = base64.b64encode(load_private_key(given.key).sign(payload)).decode()
    return decision


def keygen(path: Path, *, force: bool = False) -> str:
    """Write a new Ed25519 private key (PEM, 0600) to ``path`` and its public key (raw, base64)
    to ``path.pub``; returns the public key, as the policy file lists it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if path.exists() and not force:
        raise TetherError(f"{path} exists; pass --force to overwrite")
    key = Ed25519PrivateKey.generate()
    public = base64.b64encode(
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        path.with_name(path.name + ".pub").write_text(public + "\n")
    except OSError as e:
        raise TetherError(f"cannot write {path}: {e.strerror}") from None
    return public


def ensure_keys(folder: Path, names: Sequence[str]) -> None:
    """Key pairs for these people under ``folder`` (NAME.pem, NAME.pem.pub), made if missing:
    what `make demo` signs with, and what the example policy's signed tenant lists."""
    for name in names:
        if not (folder / f"{name}.pem").exists():
            keygen(folder / f"{name}.pem")


def load_private_key(path: Path) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        key = load_pem_private_key(path.read_bytes(), password=None)
    except (FileNotFoundError, IsADirectoryError):
        raise TetherError(f"key file not found: {path}") from None
    except (ValueError, TypeError) as e:
        raise TetherError(f"{path} is not a PEM private key ({e}); make one with `tether keygen`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise TetherError(f"{path} is not an Ed25519 key; make one with `tether keygen`")
    return key


async def decide(
    client: Client,
    run_id: str,
    kind: Literal["approve", "reject"],
    given: DecisionInput,
    *,
    timeout: float = VERDICT_TIMEOUT,
) -> Verdict:
    """Approve or reject the run's pending plan; returns the run's record of the decision.

    Refused before sending (not awaiting approval, stale plan hash) or by the run (four-eyes,
    role, signature, ...): :class:`TetherError` with code REFUSED and the rule.
    """
    snap = await snapshot(client, run_id)
    pending = snap.pending_approval
    if snap.state != RunState.AWAITING_APPROVAL or pending is None:
        raise TetherError(f"run {run_id} is {snap.state.value}, not awaiting approval", REFUSED)
    if given.plan_hash and given.plan_hash != pending.plan_hash:
        raise TetherError(
            f"stale plan hash {given.plan_hash[:12]}: the pending plan is {pending.plan_hash[:12]}; "
            f"review it with `tether status {run_id}`",
            REFUSED,
        )
    decision = build_decision(snap, kind, given)
    try:
        # The decide Update: what cannot count is refused at once, before it reaches history,
        # and the answer is the run's own record of the decision (policy check included).
        result = await client.get_workflow_handle(run_id).execute_update(
            "decide", decision, result_type=DecideResult, rpc_timeout=timedelta(seconds=timeout)
        )
    except WorkflowUpdateFailedError as e:
        raise TetherError(_update_refusal(e), REFUSED) from None
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    if result.outcome == "refused":
        raise TetherError(f"{result.reason} [rule: {result.rule}]", REFUSED)
    record = await _await_record(client, run_id, decision.decision_id, timeout)
    return Verdict(run_id=run_id, decision_id=decision.decision_id, record=record, plan=snap.plan, pending=pending)


def _update_refusal(err: WorkflowUpdateFailedError) -> str:
    """The validator's one-line verdict (``approve refused [rule]: why``) as "why [rule: rule]"."""
    message = str(getattr(err.cause, "message", None) or err.cause or err)
    if m := re.match(r"^(\w+ refused) \[([\w-]+)\]: (.*)$", message, flags=re.S):
        return f"{m.group(1)}: {m.group(3)} [rule: {m.group(2)}]"
    return message


async def handoff(
    client: Client, run_id: str, *, by: str, reason: str, decision_id: str | None = None,
    key: Path | None = None, timeout: float = VERDICT_TIMEOUT,
) -> Verdict:
    """Hand the run to a human; returns the run's record of it (HANDED_OFF), or raises REFUSED
    with the rule (not a member of the tenant, already ended, a handoff already pending).

    A run in the middle of a tool call hands off once the call has settled: ``record`` is None
    when that takes longer than ``timeout``.
    """
    try:
        request = HandoffRequest(by=by, reason=reason, decision_id=decision_id or uuid.uuid4().hex)
    except ValidationError as e:
        raise invalid("handoff", e) from None
    handle = client.get_workflow_handle(run_id)
    if key is not None:
        snap = await snapshot(client, run_id)
        payload = policy.signature_payload(
            workflow_id=run_id, first_run_id=snap.first_run_id, tenant=snap.tenant, request_id="",
            plan_hash="", kind="handoff", decision_id=request.decision_id or "", signer=request.by,
        )
        request.signature = base64.b64encode(load_private_key(key).sign(payload)).decode()
    try:
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            raise TetherError(f"run {run_id} already finished", REFUSED)
        await handle.signal("handoff", request)
    except RPCError as e:
        raise rpc_error(e, run_id) from None
    record = await _await_record(client, run_id, request.decision_id or "", timeout)
    _refused(record)
    return Verdict(run_id=run_id, decision_id=request.decision_id or "", record=record)


async def cancel(client: Client, run_id: str, *, reason: str) -> None:
    """Request Temporal cancellation; the run ends in CANCELLED once any tool in flight settles."""
    handle = client.get_workflow_handle(run_id)
    try:
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            raise TetherError(f"run {run_id} already finished", REFUSED)
        await handle.cancel(reason=reason)
    except RPCError as e:
        raise rpc_error(e, run_id) from None


def compensation_id(run_id: str) -> str:
    """The one compensation run a run can have (a second ``tether compensate`` is refused)."""
    return f"{run_id}-compensate"


async def compensate(
    client: Client, run_id: str, *, by: str, key: Path | None = None, queue: str | None = None
) -> WorkflowHandle:
    """Start the governed compensation run of an ended run: it undoes the ok writes the
    original's approvals covered (read from the original's record by the worker, not sent
    from here), as ``by`` — who must hold an approval role of the run's tenant."""
    snap = await snapshot(client, run_id)  # its tenant; the worker checks everything again
    if snap.state not in TERMINAL:
        raise TetherError(f"run {run_id} is {snap.state.value}: only an ended run is compensated", REFUSED)
    try:
        request = RunRequest(
            goal=f"compensate run {run_id}", tenant=snap.tenant, requested_by=by, compensate_run=run_id,
        )
    except ValidationError as e:
        raise invalid("compensation request", e) from None
    new_id = compensation_id(run_id)
    if key is not None:
        request = sign_request(request, new_id, key)
    try:
        return await start_run(client, request, run_id=new_id, queue=queue)
    except TetherError as e:
        if "already exists" in str(e):
            raise TetherError(f"run {run_id} already has its compensation run {new_id}: see `tether status {new_id}`", REFUSED) from None
        raise


def list_query(state: str | None, tenant: str | None) -> str:
    """The visibility query for runs; inputs are checked first (they are quoted into it)."""
    if state and state not in RunState.__members__:
        raise TetherError(f"unknown state {state!r}; one of {', '.join(RunState.__members__)}", field="state")
    if tenant and not re.match(NAME_PATTERN, tenant):
        raise TetherError(f"invalid tenant {tenant!r}", field="tenant")
    clauses = ["WorkflowType = 'AgentRun'"]
    if state:
        clauses.append(f"{STATE_ATTRIBUTE.name} = '{state}'")
    if tenant:
        clauses.append(f"{TENANT_ATTRIBUTE.name} = '{tenant}'")
    return " AND ".join(clauses)


async def list_runs(
    client: Client, *, state: str | None = None, tenant: str | None = None, limit: int = 50
) -> list[RunSummary]:
    if limit < 1:
        raise TetherError(f"limit must be at least 1, not {limit}", field="limit")
    rows = []
    try:
        async for wf in client.list_workflows(list_query(state, tenant), limit=limit):
            attrs = wf.typed_search_attributes
            rows.append(
                RunSummary(
                    run_id=wf.id,
                    state=attrs.get(STATE_ATTRIBUTE),
                    tenant=attrs.get(TENANT_ATTRIBUTE),
                    status=wf.status.name if wf.status else None,
                    started=wf.start_time,
                )
            )
    except RPCError as e:
        raise TetherError(f"listing failed: {e.message}") from None
    return rows
