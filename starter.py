"""Tether's client CLI: start runs, decide approvals, inspect runs.

    python starter.py start --goal "Refund A-1001" --playbook examples/billing/refund.playbook.json \\
        --requested-by alice
    python starter.py status RUN
    python starter.py approve RUN --by bob
    python starter.py timeline RUN
    python starter.py list --state AWAITING_APPROVAL

Exit codes: 0 done; 1 the run refused it (stale plan hash, not awaiting approval, already
finished); 2 usage error, unknown run, or Temporal unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from pydantic import ValidationError
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError, RPCStatusCode

from activities.codec import KeyFileError
from worker import connect, exit_process, target_host, task_queue
from workflows import policy
from workflows.agent_run import STATE_ATTRIBUTE, TENANT_ATTRIBUTE
from workflows.models import (
    ApprovalDecision,
    HandoffRequest,
    Limits,
    PlaybookStep,
    RunOutcome,
    RunRequest,
    RunSnapshot,
    first_error,
)
from workflows.states import TERMINAL, RunState, TransitionRecord

OK, REFUSED, USAGE = 0, 1, 2
QUERY_TIMEOUT = timedelta(seconds=10)


class CliError(Exception):
    def __init__(self, message: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------- helpers


async def _client() -> Client:
    try:
        return await connect()
    except KeyFileError as e:
        raise CliError(f"payload encryption: {e}") from None
    except RuntimeError as e:
        text = str(e)
        why = "connection refused" if "refused" in text.lower() else text.splitlines()[0][:160]
        raise CliError(
            f"cannot reach Temporal at {target_host()} ({why}); start it with "
            f"`make dev-server` or set TEMPORAL_ADDRESS"
        ) from None


def _rpc_error(err: RPCError, run_id: str) -> CliError:
    if err.status == RPCStatusCode.NOT_FOUND:
        if "completed" in err.message.lower():
            return CliError(f"run {run_id} already finished", REFUSED)
        return CliError(f"unknown run {run_id!r}: check the id with `starter.py list`")
    if err.status == RPCStatusCode.DEADLINE_EXCEEDED:
        return CliError(
            f"no worker answered for run {run_id}: start one with `make worker`"
        )
    return CliError(f"Temporal refused the call for {run_id}: {err.message}")


async def _snapshot(handle: WorkflowHandle) -> RunSnapshot:
    try:
        return await handle.query("snapshot", result_type=RunSnapshot, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as e:
        raise _rpc_error(e, handle.id) from None
    except WorkflowQueryFailedError as e:
        raise CliError(f"run {handle.id} could not answer: {e}") from None


async def _timeline(handle: WorkflowHandle) -> list[TransitionRecord]:
    try:
        return await handle.query(
            "timeline", result_type=list[TransitionRecord], rpc_timeout=QUERY_TIMEOUT
        )
    except RPCError as e:
        raise _rpc_error(e, handle.id) from None


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=str))


def _format_snapshot(s: RunSnapshot) -> str:
    lines = [
        f"run        {s.run_id}",
        f"state      {s.state.value} (version {s.state_version}, was "
        f"{s.previous_state.value if s.previous_state else '-'})",
        f"tenant     {s.tenant}",
        f"steps      {s.step} executed, {s.retries} retries",
    ]
    if s.approved_by:
        lines.append(f"approved   by {', '.join(s.approved_by)}")
    if s.last_error:
        lines.append(f"last error {s.last_error}")
    if s.plan is not None:
        lines.append(f"plan       {s.plan.plan_hash}")
        for i, step in enumerate(s.plan.steps, start=1):
            lines.append(f"  {i}. {step.tool} {json.dumps(step.args, sort_keys=True)}")
    if s.pending_approval is not None:
        p = s.pending_approval
        lines.append(f"pending    approval until {p.expires_at.isoformat()}: {p.summary}")
        lines.append(f"           approve: python starter.py approve {s.run_id} --by NAME")
    if s.answer:
        lines.append(f"answer     {s.answer}")
    return "\n".join(lines)


def _format_timeline(records: Sequence[TransitionRecord]) -> str:
    lines = []
    for r in records:
        # Hashes shortened for reading; `timeline --json` has them in full.
        refs = ", ".join(
            f"{k}={v[:12] if k.endswith('_hash') else v}"
            for k, v in r.refs.model_dump(exclude_none=True).items()
        )
        arrow = (
            f"{r.from_state.value} -> {r.to_state.value}"
            if r.kind == "transition"
            else f"{r.kind.upper()} in {r.from_state.value}"
        )
        lines.append(
            f"v{r.state_version:<3} {r.at.strftime('%H:%M:%S.%f')[:-3]}  {arrow:<42} "
            f"{r.actor:<18} {r.reason}" + (f"  [{r.rule}]" if r.rule else "") + (f"  [{refs}]" if refs else "")
        )
    return "\n".join(lines)


async def _wait_settled(handle: WorkflowHandle, timeout: float) -> RunSnapshot:
    """Poll until the run waits for a person or has ended."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        snap = await _snapshot(handle)
        if snap.state == RunState.AWAITING_APPROVAL or snap.state in TERMINAL:
            return snap
        if loop.time() > deadline:
            return snap
        await asyncio.sleep(0.2)


# ----------------------------------------------------------------------------- commands


async def start_run(
    client: Client, request: RunRequest, *, run_id: str, queue: str | None = None
) -> WorkflowHandle:
    """Start an AgentRun the one way: search attributes and Web UI summary set from the start."""
    return await client.start_workflow(
        "AgentRun",
        request,
        id=run_id,
        task_queue=queue or task_queue(),
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


def _load_playbook(path: str | None) -> list[PlaybookStep]:
    if path is None:
        return []
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CliError(f"playbook file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise CliError(f"playbook {path} is not valid JSON: {e.msg} (line {e.lineno})") from None
    steps = raw.get("steps") if isinstance(raw, dict) else raw
    if not isinstance(steps, list):
        raise CliError(f"playbook {path} must be a JSON list of {{\"tool\", \"args\"}} steps")
    try:
        return [PlaybookStep.model_validate(s) for s in steps]
    except ValidationError as e:
        raise CliError(f"playbook {path}: {first_error(e)}") from None


async def cmd_start(args: argparse.Namespace) -> int:
    playbook = _load_playbook(args.playbook)
    if args.planner == "playbook" and not playbook:
        raise CliError("the playbook planner needs steps: pass --playbook PATH")
    try:
        limits = Limits(
            approval_ttl_seconds=args.approval_ttl,
            on_expiry=args.on_expiry,
            max_steps=args.max_steps,
            max_replans=args.max_replans,
            max_model_tokens=args.max_model_tokens,
        )
        request = RunRequest(
            goal=args.goal,
            tenant=args.tenant,
            requested_by=args.requested_by,
            planner=args.planner,
            playbook=playbook,
            limits=limits,
        )
    except ValidationError as e:
        raise CliError(f"invalid run request: {first_error(e)}") from None
    run_id = args.id or f"run-{uuid.uuid4().hex[:12]}"
    client = await _client()
    try:
        handle = await start_run(client, request, run_id=run_id)
    except WorkflowAlreadyStartedError:
        raise CliError(f"a run with id {run_id!r} already exists: pick another --id") from None
    except RPCError as e:
        raise _rpc_error(e, run_id) from None
    if not args.wait:
        if args.json:
            _print_json({"run_id": run_id})
        else:
            print(f"started {run_id}")
        return OK
    snap = await _wait_settled(handle, args.wait_timeout)
    if args.json:
        _print_json(snap.model_dump(mode="json"))
    else:
        print(f"started {run_id}")
        print(_format_snapshot(snap))
    return OK


async def _decide(args: argparse.Namespace, signal: str) -> int:
    client = await _client()
    handle = client.get_workflow_handle(args.run)
    snap = await _snapshot(handle)
    if snap.state != RunState.AWAITING_APPROVAL or snap.pending_approval is None:
        raise CliError(f"run {args.run} is {snap.state.value}, not awaiting approval", REFUSED)
    pending_hash = snap.pending_approval.plan_hash
    if args.plan_hash and args.plan_hash != pending_hash:
        raise CliError(
            f"stale plan hash {args.plan_hash[:12]}: the pending plan is {pending_hash[:12]}; "
            f"review it with `starter.py status {args.run}`",
            REFUSED,
        )
    decision = ApprovalDecision(
        decision_id=args.decision_id or uuid.uuid4().hex,
        approver=args.by,
        plan_hash=args.plan_hash or pending_hash,
        request_id=snap.pending_approval.request_id,
        comment=getattr(args, "comment", None),
        reason=getattr(args, "reason", None),
    )
    if args.key:
        decision.signature = sign_decision(Path(args.key), snap, signal, decision)
    verb = "approving" if signal == "approve" else "rejecting"
    print(f"{verb} plan {decision.plan_hash} of run {args.run}:")
    print(f"  {snap.pending_approval.summary}")
    for i, step in enumerate(snap.plan.steps if snap.plan else [], start=1):
        print(f"  {i}. {step.tool} {json.dumps(step.args, sort_keys=True)}")
    try:
        await handle.signal(signal, decision)
    except RPCError as e:
        raise _rpc_error(e, args.run) from None
    # The workflow decides; read its verdict back from the timeline.
    for _ in range(50):
        for record in reversed(await _timeline(handle)):
            if record.refs.decision_id == decision.decision_id:
                if record.kind == "refused":
                    raise CliError(f"{record.reason} [rule: {record.rule}]", REFUSED)
                print(f"{record.to_state.value}: {record.reason} (decision {decision.decision_id})")
                return OK
        await asyncio.sleep(0.2)
    print(f"decision {decision.decision_id} sent; the run has not processed it yet")
    return OK


def sign_decision(key_path: Path, snap: RunSnapshot, kind: str, decision: ApprovalDecision) -> str:
    """Ed25519 signature over policy.signature_payload (run, request, plan, decision), base64."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        key = load_pem_private_key(key_path.read_bytes(), password=None)
    except FileNotFoundError:
        raise CliError(f"key file not found: {key_path}") from None
    except ValueError as e:
        raise CliError(f"{key_path} is not a PEM private key ({e}); make one with `starter.py keygen`") from None
    payload = policy.signature_payload(
        workflow_id=snap.run_id,
        first_run_id=snap.first_run_id,
        tenant=snap.tenant,
        request_id=decision.request_id or "",
        plan_hash=decision.plan_hash,
        kind=kind,
        decision_id=decision.decision_id,
        signer=decision.approver,
    )
    return base64.b64encode(key.sign(payload)).decode()


async def cmd_keygen(args: argparse.Namespace) -> int:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(args.out)
    if path.exists() and not args.force:
        raise CliError(f"{path} exists; pass --force to overwrite")
    key = Ed25519PrivateKey.generate()
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    print(f"private key written to {path} (keep it secret)")
    print("add the public key to the approver in the policy file:")
    print(f'public_key = "{base64.b64encode(public).decode()}"')
    return OK


async def cmd_approve(args: argparse.Namespace) -> int:
    return await _decide(args, "approve")


async def cmd_reject(args: argparse.Namespace) -> int:
    return await _decide(args, "reject")


async def cmd_cancel(args: argparse.Namespace) -> int:
    client = await _client()
    handle = client.get_workflow_handle(args.run)
    try:
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            raise CliError(f"run {args.run} already finished", REFUSED)
        await handle.cancel(reason=args.reason)
    except RPCError as e:
        raise _rpc_error(e, args.run) from None
    print(f"cancellation requested for {args.run}: the run ends in CANCELLED once any tool "
          f"in flight has settled")
    return OK


async def cmd_handoff(args: argparse.Namespace) -> int:
    client = await _client()
    handle = client.get_workflow_handle(args.run)
    try:
        await handle.signal("handoff", HandoffRequest(by=args.by, reason=args.reason))
    except RPCError as e:
        raise _rpc_error(e, args.run) from None
    print(f"handoff requested for {args.run}")
    return OK


async def cmd_status(args: argparse.Namespace) -> int:
    client = await _client()
    snap = await _snapshot(client.get_workflow_handle(args.run))
    print(snap.model_dump_json(indent=2) if args.json else _format_snapshot(snap))
    return OK


async def cmd_timeline(args: argparse.Namespace) -> int:
    client = await _client()
    records = await _timeline(client.get_workflow_handle(args.run))
    if args.json:
        _print_json([r.model_dump(mode="json") for r in records])
    else:
        print(_format_timeline(records))
    return OK


def list_query(state: str | None, tenant: str | None) -> str:
    clauses = ["WorkflowType = 'AgentRun'"]
    if state:
        clauses.append(f"AgentRunState = '{state}'")
    if tenant:
        clauses.append(f"AgentTenant = '{tenant}'")
    return " AND ".join(clauses)


async def cmd_list(args: argparse.Namespace) -> int:
    if args.state and args.state not in RunState.__members__:
        raise CliError(f"unknown state {args.state!r}; one of {', '.join(RunState.__members__)}")
    if args.tenant and not args.tenant.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise CliError(f"invalid tenant {args.tenant!r}")
    client = await _client()
    rows = []
    try:
        async for wf in client.list_workflows(list_query(args.state, args.tenant), limit=args.limit):
            attrs = wf.typed_search_attributes
            rows.append(
                {
                    "run_id": wf.id,
                    "state": attrs.get(STATE_ATTRIBUTE),
                    "tenant": attrs.get(TENANT_ATTRIBUTE),
                    "status": wf.status.name if wf.status else None,
                    "started": wf.start_time.isoformat() if wf.start_time else None,
                }
            )
    except RPCError as e:
        raise CliError(f"listing failed: {e.message}") from None
    if args.json:
        _print_json(rows)
    else:
        for row in rows:
            print(f"{row['run_id']:<28} {row['state'] or '-':<18} {row['tenant'] or '-':<12} "
                  f"{row['started']}")
    return OK


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="starter.py", description="Tether client CLI")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("start", help="start a run")
    p.add_argument("--goal", required=True)
    p.add_argument("--playbook", help="JSON file: list of {tool, args} steps")
    p.add_argument("--planner", default="playbook")
    p.add_argument("--tenant", default="default")
    p.add_argument("--requested-by", required=True)
    p.add_argument("--id", help="workflow id (default: run-<random>)")
    p.add_argument("--approval-ttl", type=float, default=24 * 3600, metavar="SECONDS")
    p.add_argument("--on-expiry", choices=["expire", "replan"], default="expire")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--max-replans", type=int, default=3)
    p.add_argument("--max-model-tokens", type=int, default=None, metavar="N",
                   help="model tokens the run may use in all (model planner; default: no limit)")
    p.add_argument("--wait", action="store_true",
                   help="wait until the run needs an approval or has ended, then print it")
    p.add_argument("--wait-timeout", type=float, default=60.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_start)

    for name, fn in (("approve", cmd_approve), ("reject", cmd_reject)):
        p = sub.add_parser(name, help=f"{name} the pending plan of a run")
        p.add_argument("run")
        p.add_argument("--by", required=True, help="who decides")
        p.add_argument("--plan-hash", help="the plan you reviewed (default: the pending one)")
        p.add_argument("--decision-id", help="unique id of this decision (default: random)")
        p.add_argument("--key", help="PEM Ed25519 private key: sign the decision (see keygen)")
        if name == "approve":
            p.add_argument("--comment")
        else:
            p.add_argument("--reason", required=True)
        p.set_defaults(fn=fn)

    p = sub.add_parser("keygen", help="make an Ed25519 key pair for signed approvals")
    p.add_argument("--out", required=True, help="where to write the private key (PEM)")
    p.add_argument("--force", action="store_true")
    p.set_defaults(fn=cmd_keygen)

    p = sub.add_parser("cancel", help="cancel a run (Temporal cancellation)")
    p.add_argument("run")
    p.add_argument("--reason", required=True)
    p.set_defaults(fn=cmd_cancel)

    p = sub.add_parser("handoff", help="hand a run to a human")
    p.add_argument("run")
    p.add_argument("--by", required=True)
    p.add_argument("--reason", required=True)
    p.set_defaults(fn=cmd_handoff)

    for name, fn in (("status", cmd_status), ("timeline", cmd_timeline)):
        p = sub.add_parser(name, help=f"show a run's {name}")
        p.add_argument("run")
        p.add_argument("--json", action="store_true")
        p.set_defaults(fn=fn)

    p = sub.add_parser("list", help="list runs")
    p.add_argument("--state", help="e.g. AWAITING_APPROVAL")
    p.add_argument("--tenant")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(args.fn(args))
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except WorkflowFailureError as e:
        print(f"error: {e}", file=sys.stderr)
        return REFUSED


if __name__ == "__main__":
    exit_process(main())
