"""Tools whose attempts are held on events a test releases (a slow attempt, a late write, a send
a cancel meets), counting effects where nothing deduplicates them: the billing service's emails
endpoint keeps every POST, found again by its X-Request-Ref; and a run of one of them, approved."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from datetime import datetime, timezone

from pydantic import BaseModel
from temporalio.testing import WorkflowEnvironment

from tether.tools.sdk import ToolContext, ToolRegistry, tool
from examples.billing.tools import call
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, start_run
from tests.helpers.waiting import wait_for_state
from workflows.contract import ToolEffect

REGISTRY = ToolRegistry()
ATTEMPTS: Counter[str] = Counter()  # tag -> attempts that started
GATES: dict[str, threading.Event] = {}  # tag -> released by the test
DONE: dict[str, threading.Event] = {}  # tag -> the first attempt's thread has returned


class Note(BaseModel):
    tag: str


def _event(table: dict[str, threading.Event], tag: str) -> threading.Event:
    return table.setdefault(tag, threading.Event())


def _send(args: Note, ctx: ToolContext, timeout: float | None = None) -> dict:
    # No deadline on purpose where timeout is None: a sync tool the runtime cannot stop.
    extra = {} if timeout is None else {"timeout": timeout}
    return call(
        "POST", "/emails", {"to": "grace@example.com", "subject": args.tag, "body": "effects"},
        headers={"X-Request-Ref": ctx.idempotency_key}, **extra,
    )


def _find(ctx: ToolContext) -> dict | None:
    found = call("GET", f"/emails?request_ref={ctx.idempotency_key}")["emails"]
    return found[0] if found else None


@tool(effect=ToolEffect.RECONCILABLE, timeout=2, max_retries=2, name="held_note", registry=REGISTRY)
def held_note(args: Note, ctx: ToolContext) -> dict:
    """Attempt 1 hangs (past its deadline, ignoring it) until the test releases it, then writes."""
    ATTEMPTS[args.tag] += 1
    try:
        if ctx.attempt == 1:
            _event(GATES, args.tag).wait(60)
        return _send(args, ctx)
    finally:
        if ctx.attempt == 1:
            _event(DONE, args.tag).set()


held_note.lookup(_find)


@tool(effect=ToolEffect.RECONCILABLE, timeout=4, max_retries=2, name="late_note", registry=REGISTRY)
def late_note(args: Note, ctx: ToolContext) -> dict:
    """Attempt 1 writes shortly after its deadline (within the grace period)."""
    ATTEMPTS[args.tag] += 1
    if ctx.attempt == 1 and ctx.deadline is not None:
        time.sleep(max((ctx.deadline - datetime.now(timezone.utc)).total_seconds(), 0) + 0.3)
    return _send(args, ctx)


late_note.lookup(_find)


@tool(effect=ToolEffect.UNSAFE, timeout=8, name="async_email", registry=REGISTRY)
async def async_email(args: Note, ctx: ToolContext) -> dict:
    """Sends, then waits for a response that does not come: a cancel catches it mid-call."""
    sent = await asyncio.to_thread(_send, args, ctx, ctx.seconds_left())
    _event(DONE, args.tag).set()
    await asyncio.sleep(60)
    return sent


@tool(effect=ToolEffect.UNSAFE, timeout=8, name="patient_email", registry=REGISTRY)
def patient_email(args: Note, ctx: ToolContext) -> dict:
    """Sends, then finishes as soon as the run's cancel reaches it (ctx.cancelled)."""
    sent = _send(args, ctx, ctx.seconds_left())
    _event(DONE, args.tag).set()
    ctx.cancelled.wait(60)
    return sent


@tool(effect=ToolEffect.IDEMPOTENT, timeout=2, max_retries=1, name="quick_refund", registry=REGISTRY)
def quick_refund(args: Note, ctx: ToolContext) -> dict:
    """An idempotent write (the service dedupes by Idempotency-Key)."""
    ATTEMPTS[args.tag] += 1
    body = {"order_id": "A-1002", "amount_cents": 100, "reason": args.tag}
    return call("POST", "/refunds", body, headers={"Idempotency-Key": ctx.idempotency_key}, timeout=ctx.seconds_left())


@tool(effect=ToolEffect.IDEMPOTENT, timeout=10, max_retries=2, name="patient_refund", registry=REGISTRY)
def patient_refund(args: Note, ctx: ToolContext) -> dict:
    """An idempotent write whose retry waits out a 5 s grace period."""
    return quick_refund.fn(args, ctx)


def emails(billing: Billing, key: str) -> int:
    return len(billing.get(f"/emails?request_ref={key}")["emails"])


async def approved_run(env: WorkflowEnvironment, worker, tool_name: str, tag: str):
    handle = await start_run(env.client, worker, make_request([{"tool": tool_name, "args": {"tag": tag}}]))
    snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    plan = snap.plan
    await handle.signal("approve", approval_for(snap, "bob"))
    return handle, f"{handle.id}:{plan.steps[0].tool_call_id}", plan.steps[0].tool_call_id
