"""Chaos variants of the billing tools: one per effect class, with a short timeout so a killed
worker is noticed in seconds, and checkpoints where the chaos harness can stop a call.

The tools call the same billing endpoints as ``examples/billing/tools.py`` through its ``call``
helper. Around the external call each attempt touches a marker file in ``CHAOS_DIR``
(``<key>.<attempt>.before`` / ``.after``); when ``CHAOS_HOLD`` names a checkpoint, the attempt
waits there until the harness touches ``CHAOS_DIR/release-<checkpoint>`` (or ``HOLD_MAX``
passes). That makes "kill before the call" and "kill after the call returned, before the
activity completed" deterministic; "kill during the call" uses the service's ``--delay-ms``.

Loaded by worker subprocesses: ``python worker.py --tools tests.chaos.chaos_tools``.
"""

from __future__ import annotations

import os
import time
import urllib.parse
from pathlib import Path

from activities.tools import ToolContext, tool
from tests.chaos.markers import marker_name
from examples.billing.tools import EmailArgs, LedgerArgs, OrderRef, RefundArgs, call
from workflows.models import ToolEffect

# Long enough for one attempt (the service's delay included), short enough that a worker
# killed mid-call is noticed quickly: the workflow learns of it at this start_to_close timeout.
# CHAOS_TOOL_TIMEOUT overrides it (the server-restart test holds calls across an outage).
TIMEOUT_SECONDS = float(os.environ.get("CHAOS_TOOL_TIMEOUT") or 3.0)
HOLD_MAX_SECONDS = 20.0

# worker.py loads tool modules into the global registry, so these register there under names
# of their own. Only worker subprocesses import this module: the test process must not (its
# in-process workers would then offer these tools in their catalogs too).


def checkpoint(ctx: ToolContext, point: str) -> None:
    folder = os.environ.get("CHAOS_DIR")
    if not folder:
        return
    Path(folder, marker_name(ctx.idempotency_key, ctx.attempt, point)).touch()
    if point not in os.environ.get("CHAOS_HOLD", "").split(","):
        return
    release = Path(folder, f"release-{point}")
    deadline = time.monotonic() + HOLD_MAX_SECONDS
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


@tool(effect=ToolEffect.READ_ONLY, timeout=TIMEOUT_SECONDS, name="chaos_get_order")
def chaos_get_order(args: OrderRef, ctx: ToolContext) -> dict:
    """Look up an order (read_only)."""
    checkpoint(ctx, "before")
    result = call("GET", f"/orders/{urllib.parse.quote(args.order_id)}")
    checkpoint(ctx, "after")
    return result


@tool(effect=ToolEffect.IDEMPOTENT, timeout=TIMEOUT_SECONDS, max_retries=6, name="chaos_refund")
def chaos_refund(args: RefundArgs, ctx: ToolContext) -> dict:
    """Refund (idempotent: the service dedupes by Idempotency-Key)."""
    checkpoint(ctx, "before")
    result = call("POST", "/refunds", args.model_dump(), headers={"Idempotency-Key": ctx.idempotency_key})
    checkpoint(ctx, "after")
    return result


@tool(effect=ToolEffect.RECONCILABLE, timeout=TIMEOUT_SECONDS, max_retries=6, name="chaos_ledger")
def chaos_ledger(args: LedgerArgs, ctx: ToolContext) -> dict:
    """Post a ledger entry (reconcilable: looked up by key before a retry writes)."""
    checkpoint(ctx, "before")
    result = call("POST", "/ledger", {"key": ctx.idempotency_key, **args.model_dump()})
    checkpoint(ctx, "after")
    return result


@chaos_ledger.lookup
def chaos_find_ledger_entry(ctx: ToolContext) -> dict | None:
    entries = call("GET", "/ledger?" + urllib.parse.urlencode({"key": ctx.idempotency_key}))
    found = entries.get("entries") or []
    return found[0] if found else None


@tool(effect=ToolEffect.UNSAFE, timeout=TIMEOUT_SECONDS, name="chaos_email")
def chaos_email(args: EmailArgs, ctx: ToolContext) -> dict:
    """Send an email (unsafe: runs at most once)."""
    checkpoint(ctx, "before")
    result = call("POST", "/emails", args.model_dump(), headers={"X-Request-Ref": ctx.idempotency_key})
    checkpoint(ctx, "after")
    return result
