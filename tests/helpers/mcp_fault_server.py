"""An MCP server of our own for the fault cases, run as a stdio subprocess by tests/activities/test_mcp.py:

    python tests/helpers/mcp_fault_server.py STATE_DIR [--http PORT]   # stdio, or streamable HTTP on /mcp

Built on the ``mcp`` package's server API (``MCPServer``), like the reference servers. Every call
appends one line to ``STATE_DIR/calls`` (tool, idempotency key from the request ``_meta``, note)
*before* it does anything else, so a test counts the calls the server really got. Faults are
switched per test by files in STATE_DIR:

- ``slow``: ``record`` sleeps that many seconds (a worker can be killed meanwhile);
- ``crash``: ``record`` exits the server process mid-call (no answer ever comes);
- ``upsert`` crashes the server on its first call only (a retry reconnects and succeeds).

- ``post`` applies its effect (a line in ``STATE_DIR/posted``), then crashes on its first call:
  the answer is lost, the effect is not; ``find`` looks a post up by idempotency key.

``decline`` always answers ``isError`` with a Tether error code in the result's ``_meta``; ``fail``
answers ``isError`` through the SDK's own ``ToolError``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent, ToolAnnotations

STATE = Path(sys.argv[1])
server = MCPServer("tether-faults")

UNSAFE = ToolAnnotations(read_only_hint=False, idempotent_hint=False, destructive_hint=False)
IDEMPOTENT = ToolAnnotations(read_only_hint=False, idempotent_hint=True, destructive_hint=False)


def count(tool: str, ctx: Context, note: str) -> int:
    meta = ctx.request_context.meta or {}
    key = meta.get("io.tether/idempotency-key", "-")
    with open(STATE / "calls", "a") as f:
        f.write(f"{tool} {key} {note}\n")
        f.flush()
        os.fsync(f.fileno())
    return sum(1 for line in (STATE / "calls").read_text().splitlines() if line.startswith(tool + " "))


@server.tool(description="Records a note (writes; not idempotent).", annotations=UNSAFE, structured_output=False)
async def record(note: str, ctx: Context) -> str:
    count("record", ctx, note)
    if (STATE / "crash").exists():
        os._exit(3)
    if (STATE / "slow").exists():
        await asyncio.sleep(float((STATE / "slow").read_text()))
    return f"recorded {note}"


@server.tool(description="Stores a note under a key (idempotent).", annotations=IDEMPOTENT, structured_output=False)
async def upsert(note: str, ctx: Context) -> str:
    if count("upsert", ctx, note) == 1:
        os._exit(3)  # mid-call, before any answer
    return f"stored {note}"


@server.tool(description="Charges a card; this one is always declined.", annotations=UNSAFE)
async def decline(amount_cents: int, ctx: Context) -> CallToolResult:
    count("decline", ctx, str(amount_cents))
    return CallToolResult(
        content=[TextContent(type="text", text=f"card declined for {amount_cents} cents")],
        is_error=True,
        _meta={"io.tether/error-code": "card_declined"},
    )


@server.tool(description="Always fails.", annotations=UNSAFE, structured_output=False)
async def fail(ctx: Context) -> str:
    count("fail", ctx, "-")
    raise ToolError("this tool always fails")


@server.tool(description="Posts a note (not idempotent; find it by key).", annotations=UNSAFE, structured_output=False)
async def post(note: str, ctx: Context) -> str:
    key = (ctx.request_context.meta or {}).get("io.tether/idempotency-key", "-")
    first = count("post", ctx, note) == 1
    with open(STATE / "posted", "a") as f:
        f.write(f"{key} {note}\n")
    if first:
        os._exit(3)  # the effect is applied, its answer never arrives
    return f"posted {note}"


READ_ONLY = ToolAnnotations(read_only_hint=True)


@server.tool(description="Finds a post by idempotency key.", annotations=READ_ONLY, structured_output=False)
async def find(idempotency_key: str, ctx: Context) -> str:
    count("find", ctx, idempotency_key)
    posted = (STATE / "posted").read_text().splitlines() if (STATE / "posted").exists() else []
    return next((f"found {line}" for line in posted if line.split(" ", 1)[0] == idempotency_key), "")


if __name__ == "__main__":
    if "--http" in sys.argv:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[sys.argv.index("--http") + 1]))
    else:
        server.run()
