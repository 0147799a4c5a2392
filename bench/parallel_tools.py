"""A lookup that takes a given time: the parallel-group bench's step (``--tools
bench.tools,bench.parallel_tools``)."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from tether.tools.sdk import ToolContext, tool
from workflows.contract import ToolEffect


class WaitArgs(BaseModel):
    key: str
    seconds: float = Field(ge=0, le=10)


@tool(effect=ToolEffect.READ_ONLY, timeout=30, name="bench_wait")
async def bench_wait(args: WaitArgs, ctx: ToolContext) -> dict:
    """A read that answers after ``seconds`` (a slow upstream)."""
    await asyncio.sleep(args.seconds)
    return {"key": args.key, "waited": args.seconds}
