"""Chaos variants of the billing tools: one per effect class, with a short timeout so a killed
worker is noticed in seconds, and checkpoints where the chaos harness can stop a call.

The tools call the same billing endpoints as ``examples/billing/tools.py`` through its ``call``
helper. Around the external call each attempt touches a marker file in ``CHAOS_DIR``
(``<key>.<attempt>.before`` / ``.after``); when ``CHAOS_HOLD`` names a checkpoint, the attempt
waits there until the harness touches ``CHAOS_DIR/release-<checkpoint>`` (or ``HOLD_MAX``
passes). That makes "kill before the call" and "kill after the call returned, before the
activity completed" deterministic. For "during", ``CHAOS_HOLD=during`` has the billing service
(``--gate-dir``, the parent of ``CHAOS_DIR``) hold the write's response after its commit until
the harness touches ``CHAOS_DIR/release-<key>.<attempt>.during`` (``markers.gate_name``).

Faults of the attempt itself, per worker (environment):

- ``CHAOS_SLOW=S``: attempt 1 of every call waits until S seconds after its deadline before
  the external call, which then ignores the deadline: a slow attempt that commits after its
  timeout, in a thread nothing can stop.
- ``CHAOS_LOSE_RESPONSE=1``: every write's response is lost after the service committed it
  (a transient error), so an idempotent tool's retries run out with the effect in place.

- ``CHAOS_HOLD_UNDO_ONLY=1``: ``CHAOS_HOLD`` holds only compensations (keys ending ``:undo``),
  so a run's forward steps pass and its undo is where the worker is killed.

A held checkpoint also ends when the run's cancel reaches the tool (``ctx.cancelled``): held
before the call, the tool stops without calling; held after it, it returns what it got.

Loaded by worker subprocesses: ``python worker.py --tools tests.chaos.chaos_tools``.
"""

from __future__ import annotations

import os
import time
import urllib.parse
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tether.tools.sdk import ToolContext, ToolError, tool
from tests.chaos.markers import gate_name, marker_name
from examples.billing.tools import EmailArgs, LedgerArgs, OrderRef, RefundArgs, ReverseArgs, VoidArgs, call
from workflows.contract import ToolEffect

# Long enough for one attempt (the service's delay included), short enough that a worker
# killed mid-call is noticed quickly: the workflow learns of it at this start_to_close timeout.
# CHAOS_TOOL_TIMEOUT overrides it (the server-restart test holds calls across an outage).
TIMEOUT_SECONDS = float(os.environ.get("CHAOS_TOOL_TIMEOUT") or 3.0)
# A hold is ended by the harness or the run's cancel; this only keeps a broken test from hanging
# (longer than the tool's own deadline, so a hold never ends by itself before the attempt's).
HOLD_MAX_SECONDS = max(20.0, TIMEOUT_SECONDS * 1.5)

# worker.py loads tool modules into the global registry, so these register there under names
# of their own. Only worker subprocesses import this module: the test process must not (its
# in-process workers would then offer these tools in their catalogs too).


def held(ctx: ToolContext, point: str) -> bool:
    if point not in os.environ.get("CHAOS_HOLD", "").split(","):
        return False
    return not (os.environ.get("CHAOS_HOLD_UNDO_ONLY") and not ctx.idempotency_key.endswith(":undo"))


def checkpoint(ctx: ToolContext, point: str) -> None:
    folder = os.environ.get("CHAOS_DIR")
    if not folder:
        return
    Path(folder, marker_name(ctx.idempotency_key, ctx.attempt, point)).touch()
    if not held(ctx, point):
        return
    release = Path(folder, f"release-{point}")
    deadline = time.monotonic() + HOLD_MAX_SECONDS
    while not release.exists() and not ctx.cancelled.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)
    if point == "before" and ctx.cancelled.is_set():
        # Nothing sent yet: a tool that sees the cancel in time stops, and says so.
        raise ToolError("cancelled before the call", code="cancelled_before_call", permanent=True)


def external(ctx: ToolContext, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> Any:
    """The external call between the two checkpoints, with the worker's faults applied."""
    checkpoint(ctx, "before")
    folder = os.environ.get("CHAOS_DIR")
    if folder and method == "POST" and held(ctx, "during"):
        gate = gate_name(ctx.idempotency_key, ctx.attempt)
        headers = {**(headers or {}), "X-Test-Gate": f"{Path(folder).name}/{gate}"}
    slow = float(os.environ.get("CHAOS_SLOW") or 0)
    if slow and ctx.attempt == 1 and ctx.deadline is not None:
        time.sleep(max((ctx.deadline - datetime.now(timezone.utc)).total_seconds(), 0.0) + slow)
        result = call(method, path, body, headers)  # past the deadline: ignores it on purpose
    else:
        result = call(method, path, body, headers, timeout=ctx.seconds_left())
    if method == "POST" and os.environ.get("CHAOS_LOSE_RESPONSE"):
        raise ToolError(f"{method} {path}: response lost", code="response_lost")
    checkpoint(ctx, "after")
    return result


@tool(effect=ToolEffect.READ_ONLY, timeout=TIMEOUT_SECONDS, name="chaos_get_order")
def chaos_get_order(args: OrderRef, ctx: ToolContext) -> dict:
    """Look up an order (read_only)."""
    return external(ctx, "GET", f"/orders/{urllib.parse.quote(args.order_id)}")


@tool(effect=ToolEffect.IDEMPOTENT, timeout=TIMEOUT_SECONDS, max_retries=6, name="chaos_refund")
def chaos_refund(args: RefundArgs, ctx: ToolContext) -> dict:
    """Refund (idempotent: the service dedupes by Idempotency-Key)."""
    return external(ctx, "POST", "/refunds", args.model_dump(), {"Idempotency-Key": ctx.idempotency_key})


@tool(effect=ToolEffect.IDEMPOTENT, timeout=TIMEOUT_SECONDS, max_retries=2, name="chaos_refund_short")
def chaos_refund_short(args: RefundArgs, ctx: ToolContext) -> dict:
    """Refund with only two retries: the one whose retries run out."""
    return external(ctx, "POST", "/refunds", args.model_dump(), {"Idempotency-Key": ctx.idempotency_key})


@tool(effect=ToolEffect.RECONCILABLE, timeout=TIMEOUT_SECONDS, max_retries=6, name="chaos_ledger")
def chaos_ledger(args: LedgerArgs, ctx: ToolContext) -> dict:
    """Post a ledger entry (reconcilable: looked up by key before a retry writes)."""
    return external(ctx, "POST", "/ledger", {"key": ctx.idempotency_key, **args.model_dump()})


@chaos_ledger.lookup
def chaos_find_ledger_entry(ctx: ToolContext) -> dict | None:
    query = urllib.parse.urlencode({"key": ctx.idempotency_key})
    entries = call("GET", "/ledger?" + query, timeout=ctx.seconds_left())
    found = entries.get("entries") or []
    return found[0] if found else None


@tool(effect=ToolEffect.RECONCILABLE, timeout=TIMEOUT_SECONDS, max_retries=6, name="chaos_note")
def chaos_note(args: EmailArgs, ctx: ToolContext) -> dict:
    """A reconcilable write to a store with no UNIQUE key (the emails endpoint, found again by
    its request ref): a retry racing an attempt would show here as two effects."""
    return external(ctx, "POST", "/emails", args.model_dump(), {"X-Request-Ref": ctx.idempotency_key})


@chaos_note.lookup
def chaos_find_note(ctx: ToolContext) -> dict | None:
    query = urllib.parse.urlencode({"request_ref": ctx.idempotency_key})
    found = call("GET", "/emails?" + query, timeout=ctx.seconds_left()).get("emails") or []
    return found[0] if found else None


@tool(effect=ToolEffect.UNSAFE, timeout=TIMEOUT_SECONDS, name="chaos_email")
def chaos_email(args: EmailArgs, ctx: ToolContext) -> dict:
    """Send an email (unsafe: runs at most once)."""
    return external(ctx, "POST", "/emails", args.model_dump(), {"X-Request-Ref": ctx.idempotency_key})


# ----------------------------------------------------------------------------- compensation
# A refund and a ledger entry that declare their undo, the two undo tools (held at their
# checkpoints for the kill), and an email the service refuses for good (the failure that
# makes a run with on_failure=compensate put things back).


@tool(effect=ToolEffect.IDEMPOTENT, timeout=TIMEOUT_SECONDS, max_retries=6, name="chaos_void")
def chaos_void(args: VoidArgs, ctx: ToolContext) -> dict:
    """Void a refund (idempotent: a second void is a no-op)."""
    return external(ctx, "POST", f"/refunds/{urllib.parse.quote(args.refund_id)}/void", {})


@tool(effect=ToolEffect.IDEMPOTENT, timeout=TIMEOUT_SECONDS, max_retries=6, name="chaos_reverse")
def chaos_reverse(args: ReverseArgs, ctx: ToolContext) -> dict:
    """Reverse a ledger entry (at most one reversal per entry)."""
    return external(ctx, "POST", f"/ledger/{urllib.parse.quote(args.entry_id)}/reverse", {"key": ctx.idempotency_key})


@tool(effect=ToolEffect.IDEMPOTENT, timeout=TIMEOUT_SECONDS, max_retries=6, name="chaos_refund_undoable",
      compensate=("chaos_void", {"refund_id": "/result/refund_id"}))
def chaos_refund_undoable(args: RefundArgs, ctx: ToolContext) -> dict:
    """Refund, undone by chaos_void."""
    return external(ctx, "POST", "/refunds", args.model_dump(), {"Idempotency-Key": ctx.idempotency_key})


@tool(effect=ToolEffect.RECONCILABLE, timeout=TIMEOUT_SECONDS, max_retries=6, name="chaos_ledger_undoable",
      compensate=("chaos_reverse", {"entry_id": "/result/entry_id"}))
def chaos_ledger_undoable(args: LedgerArgs, ctx: ToolContext) -> dict:
    """Post a ledger entry, undone by chaos_reverse."""
    return external(ctx, "POST", "/ledger", {"key": ctx.idempotency_key, **args.model_dump()})


chaos_ledger_undoable.lookup(chaos_find_ledger_entry)


@tool(effect=ToolEffect.UNSAFE, timeout=TIMEOUT_SECONDS, name="chaos_email_refused")
def chaos_email_refused(args: EmailArgs, ctx: ToolContext) -> dict:
    """An email the mail system refuses (permanent: known not sent)."""
    raise ToolError("mailbox refused the message", code="mail_refused", permanent=True)
