"""What the bench tools do, unregistered: bench/tools.py registers them for Tether's worker, and
pydantic-ai's agents (bench/peer_agents.py) call the same bodies without touching the tool
registry of the process that imports them (a test process keeps its catalog)."""

from __future__ import annotations

from pydantic import BaseModel

from tether.tools.sdk import ToolContext


class KeyArgs(BaseModel):
    key: str


async def read_value(args: KeyArgs, ctx: ToolContext) -> dict:
    """Read a value (no side effect)."""
    return {"key": args.key, "value": len(args.key)}


async def write_value(args: KeyArgs, ctx: ToolContext) -> dict:
    """Pretend to write a value, deduplicated by the idempotency key (needs approval)."""
    return {"key": args.key, "written": True, "idempotency_key": ctx.idempotency_key}
