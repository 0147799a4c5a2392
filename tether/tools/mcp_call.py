"""One MCP tool call (``tools/call``), run inside the worker's ``execute_tool`` activity
(tether/tools/sdk.py) like every tool's: the run's idempotency key in the request ``_meta``, and
the failure mapped to what the runtime needs to know (tether/tools/mcp.py says how).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from pydantic import ValidationError

from tether.tools.mcp_session import CONNECT_TIMEOUT_SECONDS, Connection, McpUnavailable, _reason, list_tools
from tether.tools.sdk import LookupFn, ToolContext, ToolError, ToolFn

IDEMPOTENCY_META_KEY = "io.tether/idempotency-key"
# What a server may put in an isError result's _meta: the error code the timeline shows, and
# whether the failure is transient (the tool's effect class then decides about a retry).
ERROR_CODE_META_KEY = "io.tether/error-code"
RETRYABLE_META_KEY = "io.tether/retryable"
_ERROR_CODE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # a server's error code, as the timeline shows it


def _value(result: Any) -> Any:
    """What a tool result says: its structured content, else its text blocks."""
    if result.structured_content is not None:
        return result.structured_content
    texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    other = [block.type for block in result.content if getattr(block, "type", None) != "text"]
    text = "\n".join(texts)
    return text + (f"\n[{len(other)} non-text block(s): {', '.join(other)}]" if other else "")


async def call_tool(connection: Connection, tool: str, args: dict[str, Any], ctx: ToolContext, timeout: float) -> Any:
    """One ``tools/call``, with the failure mapped to what the runtime needs to know."""
    from mcp import MCPError
    from mcp_types import INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR, REQUEST_TIMEOUT

    server = connection.name
    try:
        session = await connection.session()
    except McpUnavailable as e:
        # Nothing was sent, but to the effect rule a missing answer is a missing answer.
        raise ToolError(f"MCP server {server!r} unavailable: {e}", code="mcp_unavailable") from None
    if tool not in getattr(session, "_tool_output_schemas", {tool: None}):
        # A new session knows no listing, and the SDK would list (whole, typed) after the call:
        # a listing with one bad entry would then fail a call that ran. List it our way first.
        try:
            await asyncio.wait_for(list_tools(session, server), CONNECT_TIMEOUT_SECONDS)
        except (OSError, RuntimeError, ValidationError, MCPError, asyncio.TimeoutError) as e:
            await connection.reset(session)
            raise ToolError(f"{server}: {_reason(e)} (before the call)", code="mcp_unavailable") from None
    # Answer before the activity's own timeout, so the worker, not only the server, knows.
    read_timeout = max(timeout - min(2.0, timeout * 0.2), 0.1)
    try:
        result = await session.call_tool(
            tool, args, read_timeout_seconds=read_timeout, meta={IDEMPOTENCY_META_KEY: ctx.idempotency_key}
        )
    except MCPError as e:
        if e.code in (INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR):
            # A protocol-level refusal: the server did not run the tool.
            raise ToolError(f"{server} refused {tool}: {e.message}", code="mcp_refused", permanent=True) from None
        if e.code == REQUEST_TIMEOUT:
            raise ToolError(
                f"no answer from {server} in {read_timeout:g}s: outcome unknown", code="mcp_timeout"
            ) from None
        await connection.reset(session)
        raise ToolError(f"{server}: {e.message}: outcome unknown", code="mcp_connection_lost") from None
    except (OSError, RuntimeError, ValidationError) as e:
        await connection.reset(session)
        raise ToolError(f"{server}: {_reason(e)}: outcome unknown", code="mcp_connection_lost") from None
    if result.is_error:
        meta = result.meta or {}
        code = meta.get(ERROR_CODE_META_KEY)
        message = str(_value(result)).strip() or "the tool reported an error"
        raise ToolError(
            message[:200],  # the server's words reach the timeline: bounded
            code=code if isinstance(code, str) and _ERROR_CODE.match(code) else "mcp_tool_error",
            permanent=meta.get(RETRYABLE_META_KEY) is not True,
        )
    return _value(result)


def _tool_fn(connection: Connection, tool: str, timeout: float) -> ToolFn:
    async def fn(args: dict[str, Any], ctx: ToolContext) -> Any:
        return await call_tool(connection, tool, args, ctx, timeout)

    return fn


def _lookup_fn(connection: Connection, tool: str, arg: str, timeout: float) -> LookupFn:
    async def lookup(ctx: ToolContext) -> Any:
        found = await call_tool(connection, tool, {arg: ctx.idempotency_key}, ctx, timeout)
        return None if found in (None, "", "null", [], {}) else found

    return lookup
