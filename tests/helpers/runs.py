"""Starting and ending runs in a test: a worker on a queue of its own, a strict request, the runs a
test started (terminated at its end by the autouse fixture in tests/conftest.py), and the
decisions a test sends."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError
from temporalio.worker import Worker

import examples.billing.tools  # noqa: F401  (registers the billing tools)
import tether.client as tether_client
from tests.helpers.paths import ROOT
from worker import create_worker
from workflows.contract import STRICT, ApprovalDecision
from workflows.run_state import RunRequest, RunSnapshot

PLAYBOOK = json.loads((ROOT / "examples/billing/refund.playbook.json").read_text())


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@asynccontextmanager
async def running_worker(client: Client, **options: Any) -> AsyncIterator[Worker]:
    """A worker on a task queue of its own, so tests never steal each other's tasks."""
    worker = create_worker(client, task_queue=options.pop("task_queue", unique("tq")), **options)
    async with worker:
        yield worker


def make_request(steps: list[dict] | None = None, **overrides: Any) -> RunRequest:
    fields: dict[str, Any] = {
        "goal": "Refund order A-1001",
        "requested_by": "alice",
        "playbook": PLAYBOOK if steps is None else steps,
    }
    limits = overrides.pop("limits", None)
    fields.update(overrides)
    if limits:
        fields["limits"] = limits
    # Strict, as a client validates what a person typed: unknown keys are refused.
    return RunRequest.model_validate(fields, context=STRICT)


# Runs started by the current test (start_run): whatever is still open at its end is terminated.
_STARTED: list[tuple[Client, str]] = []


async def start_run(client: Client, worker: Worker, request: RunRequest, run_id: str | None = None) -> WorkflowHandle:
    handle = await tether_client.start_run(client, request, run_id=run_id or unique("run"), queue=worker.task_queue)
    _STARTED.append((client, handle.id))
    return handle


def forget_started() -> None:
    """A new test begins: the runs the last one started are not its own."""
    _STARTED.clear()


async def terminate_started(client: Client | None = None) -> None:
    """Terminate the runs this test started (on `client`'s server only, when given): a server a
    fixture is about to stop calls this first, so nothing later retries against it."""
    for started in list(_STARTED):
        started_client, workflow_id = started
        if client is not None and started_client is not client:
            continue
        _STARTED.remove(started)
        try:
            # The latest run of the id (it may have continued as new); a closed one answers
            # NOT_FOUND: nothing to do.
            await started_client.get_workflow_handle(workflow_id).terminate("test over")
        except RPCError:  # closed already (NOT_FOUND), or its server is gone
            pass


async def cancel_and_settle(handle: WorkflowHandle) -> None:
    """Cancel a run and wait until it has ended, while its worker still runs."""
    await handle.cancel(reason="test over")
    try:
        await handle.result()
    except WorkflowFailureError:
        pass  # cancelled, as asked


def approval_for(
    target: RunSnapshot | str, approver: str = "bob", decision_id: str | None = None, **fields: Any
) -> ApprovalDecision:
    """A decision for a run's pending approval request (a snapshot), or for a bare plan hash
    (a string: no request id, as a stale or forged decision would have)."""
    if isinstance(target, RunSnapshot):
        pending = target.pending_approval
        assert pending is not None, f"run {target.run_id} has no pending approval"
        fields.setdefault("request_id", pending.request_id)
        plan_hash = pending.plan_hash
    else:
        plan_hash = target
    return ApprovalDecision(decision_id=decision_id or uuid.uuid4().hex, approver=approver, plan_hash=plan_hash, **fields)


async def flood_until_continued(current: WorkflowHandle, first_run: str, tag: str, decision: Any = None) -> int:
    """Refused approvals, each with a long comment so history grows by kilobytes, until the run
    has continued as new: a small_history_env server suggests it after CAN_THRESHOLD events, the
    run takes it once its history is CARRY_AMORTIZE times what it carries. ``decision(i)``: the
    refused decision to send (default: eve's, for a plan hash no run has). Returns how many."""
    sent = 0
    while sent < 400:
        made = decision(sent) if decision else ApprovalDecision(decision_id=f"{tag}-{sent}", approver="eve", plan_hash="0" * 64)
        await current.signal("approve", made.model_copy(update={"comment": "x" * 2000}))
        sent += 1
        if sent % 10 == 0 and (await current.describe()).run_id != first_run:
            return sent
    # It continues once its seal has settled (a durable timer): wait for that, bounded only
    # against a hang (a loaded machine takes its time).
    deadline = asyncio.get_running_loop().time() + 120
    while asyncio.get_running_loop().time() < deadline:
        if (await current.describe()).run_id != first_run:
            return sent
        await asyncio.sleep(0.1)
    raise AssertionError(f"no continue-as-new after {sent} refusals")
