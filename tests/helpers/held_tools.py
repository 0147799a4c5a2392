"""Tools held on events a test releases, for parallel groups and child runs: "every step was
running at once" and "the cancel met a running step" are facts a test waits for, not timings.
The tools count their attempts and the most that were ever in flight together."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, defaultdict

from pydantic import BaseModel

from tether.tools.sdk import ToolContext, ToolError, ToolRegistry, tool
from examples.billing.tools import call
from workflows.contract import ToolEffect

REGISTRY = ToolRegistry()
STARTED: dict[str, threading.Semaphore] = defaultdict(lambda: threading.Semaphore(0))  # tag -> attempts begun
GATES: dict[str, threading.Event] = defaultdict(threading.Event)  # tag -> released by the test
ATTEMPTS: Counter[str] = Counter()  # "tag/n" -> attempts
IN_FLIGHT: Counter[str] = Counter()
MOST: Counter[str] = Counter()  # tag -> most attempts of it in flight at once
ORDER: dict[str, list[str]] = defaultdict(list)  # tag -> "start n", "end n", "after"
LOCK = threading.Lock()
READ_ONLY = ("held_read", "flaky_read", "refused_read", "after_read")


class Probe(BaseModel):
    tag: str
    n: int = 0


def _held(args: Probe) -> dict:
    with LOCK:
        ATTEMPTS[f"{args.tag}/{args.n}"] += 1
        IN_FLIGHT[args.tag] += 1
        MOST[args.tag] = max(MOST[args.tag], IN_FLIGHT[args.tag])
        ORDER[args.tag].append(f"start {args.n}")
    STARTED[args.tag].release()
    try:
        GATES[args.tag].wait(60)
        return {"n": args.n}
    finally:
        with LOCK:
            IN_FLIGHT[args.tag] -= 1
            ORDER[args.tag].append(f"end {args.n}")


@tool(effect=ToolEffect.READ_ONLY, timeout=30, name="held_read", registry=REGISTRY)
def held_read(args: Probe, ctx: ToolContext) -> dict:
    """A lookup that runs until the test releases its tag."""
    return _held(args)


@tool(effect=ToolEffect.READ_ONLY, timeout=30, max_retries=2, name="flaky_read", registry=REGISTRY)
def flaky_read(args: Probe, ctx: ToolContext) -> dict:
    """Fails its first attempt (transient), then answers."""
    with LOCK:
        ATTEMPTS[f"{args.tag}/{args.n}"] += 1
    if ctx.attempt == 1:
        raise ToolError("upstream busy", code="busy")
    return {"n": args.n}


@tool(effect=ToolEffect.READ_ONLY, timeout=30, name="refused_read", registry=REGISTRY)
def refused_read(args: Probe, ctx: ToolContext) -> dict:
    """The target refuses it: a permanent failure."""
    with LOCK:
        ATTEMPTS[f"{args.tag}/{args.n}"] += 1
    raise ToolError("no such record", code="not_found", permanent=True)


@tool(effect=ToolEffect.READ_ONLY, timeout=30, name="after_read", registry=REGISTRY)
def after_read(args: Probe, ctx: ToolContext) -> dict:
    with LOCK:
        ORDER[args.tag].append("after")
    return {"after": True}


@tool(effect=ToolEffect.IDEMPOTENT, timeout=10, max_retries=1, name="group_refund", registry=REGISTRY)
def group_refund(args: Probe, ctx: ToolContext) -> dict:
    """An idempotent write (the billing service dedupes by Idempotency-Key)."""
    with LOCK:
        ATTEMPTS[f"{args.tag}/{args.n}"] += 1
    body = {"order_id": "A-1002", "amount_cents": 100 + args.n, "reason": f"{args.tag}-{args.n}"}
    return call("POST", "/refunds", body, headers={"Idempotency-Key": ctx.idempotency_key}, timeout=ctx.seconds_left())


@tool(effect=ToolEffect.UNSAFE, timeout=10, name="group_email", registry=REGISTRY)
def group_email(args: Probe, ctx: ToolContext) -> dict:
    return {"sent": args.tag}




async def started(tag: str, count: int) -> None:
    """Wait until ``count`` attempts of ``tag`` have begun (they are then running at once)."""
    for _ in range(count):
        assert await asyncio.to_thread(STARTED[tag].acquire, True, 60), f"an attempt of {tag} did not start"
