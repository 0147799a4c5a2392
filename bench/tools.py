"""Trivial tools for the benchmarks: the work they do is negligible, so what is measured is
the orchestration around them. Loaded into the bench worker with ``--tools bench.tools``.
"""

from __future__ import annotations

from pydantic import BaseModel

from activities.tools import ToolContext, tool
from workflows.models import ToolEffect


class KeyArgs(BaseModel):
    key: str


@tool(effect=ToolEffect.READ_ONLY, timeout=30)
async def bench_read(args: KeyArgs, ctx: ToolContext) -> dict:
    """Read a value (no side effect)."""
    return {"key": args.key, "value": len(args.key)}


@tool(effect=ToolEffect.IDEMPOTENT, timeout=30)
async def bench_write(args: KeyArgs, ctx: ToolContext) -> dict:
    """Pretend to write a value, deduplicated by the idempotency key (needs approval)."""
    return {"key": args.key, "written": True, "idempotency_key": ctx.idempotency_key}
