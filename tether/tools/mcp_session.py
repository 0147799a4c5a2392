"""One MCP session per worker per server: the transport (stdio or streamable HTTP), started on
first use, restarted after a failure, closed at shutdown; and the tool listing it reads (all
pages, each entry checked on its own).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tether.tools.mcp_config import ServerConfig
from workflows.contract import first_error

log = logging.getLogger("tether.mcp")

CONNECT_TIMEOUT_SECONDS = 20.0
PING_TIMEOUT_SECONDS = 5.0


class McpUnavailable(Exception):
    """The server could not be started or reached."""


def _executable(command: str) -> str:
    # Servers installed into this virtualenv (the dev extra's reference servers) are found
    # even when the worker was started without the venv's bin directory on PATH.
    if os.sep in command:
        return command
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which(command, path=path) or command


class Connection:
    """One MCP session to one server, owned by a background task (the SDK's transports are
    anyio task groups, which must be entered and left in one task); calls come from any task."""

    def __init__(self, name: str, config: ServerConfig) -> None:
        self.name, self.config = name, config
        self._session: Any = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()

    def _transport(self) -> Any:
        if self.config.url is not None:
            from mcp.client.streamable_http import streamable_http_client

            return streamable_http_client(self.config.url)
        from mcp import StdioServerParameters, stdio_client

        assert self.config.command is not None
        return stdio_client(
            StdioServerParameters(
                command=_executable(self.config.command),
                args=self.config.args,
                env=self.config.env or None,
                cwd=self.config.cwd,
            )
        )

    async def _own(self, ready: asyncio.Future[Any], stop: asyncio.Event) -> None:
        try:
            from mcp import ClientSession

            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(read, write))
                await asyncio.wait_for(session.initialize(), CONNECT_TIMEOUT_SECONDS)
                ready.set_result(session)
                await stop.wait()
        except BaseException as e:  # noqa: BLE001  (anyio groups wrap failures; report them all)
            if not ready.done():
                ready.set_exception(McpUnavailable(_reason(e)))
            elif not isinstance(e, asyncio.CancelledError):
                log.warning("MCP server %r: session ended: %s", self.name, _reason(e))
            if isinstance(e, asyncio.CancelledError):
                raise

    async def session(self) -> Any:
        """The live session, started (or restarted) when there is none or it stopped answering."""
        async with self._lock:
            if self._session is not None and self._task is not None and not self._task.done():
                try:
                    # Cheap on a live session; a dead one is found here, before the call is sent.
                    await asyncio.wait_for(self._session.send_ping(), PING_TIMEOUT_SECONDS)
                    return self._session
                except Exception as e:  # noqa: BLE001
                    log.warning("MCP server %r stopped answering (%s); reconnecting", self.name, _reason(e))
                    await self._close()
            self._stop = asyncio.Event()
            ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()  # the session
            self._task = asyncio.create_task(self._own(ready, self._stop), name=f"mcp-{self.name}")
            try:
                self._session = await asyncio.wait_for(asyncio.shield(ready), CONNECT_TIMEOUT_SECONDS + 5)
            except BaseException:
                await self._close()
                raise
            return self._session

    async def reset(self, session: Any = None) -> None:
        """Drop the session (only if it is still ``session``, when given) after a failure: the
        next call starts a new one."""
        async with self._lock:
            if session is None or session is self._session:
                await self._close()

    async def _close(self) -> None:
        task, self._task, self._session = self._task, None, None
        if task is None:
            return
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
        except BaseException:  # noqa: BLE001  (a stuck transport is cancelled below)
            task.cancel()

    async def aclose(self) -> None:
        await self.reset()


def _reason(e: BaseException) -> str:
    """One line for a failure, looking inside anyio's exception groups."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


MAX_LISTED_TOOLS = 1000  # entries beyond this many are not read (one server, all pages)


async def list_tools(session: Any, server: str = "?", left_out: dict[str, str] | None = None) -> list[Any]:
    """Every tool the server publishes, all pages; an entry the protocol's ``Tool`` type refuses
    is left out on its own (log line naming server and entry), not the whole listing."""
    from mcp_types import ListToolsRequest, ListToolsResult, PaginatedRequestParams

    tools, cursor = [], None
    for _ in range(1000):  # a server that never stops paginating is not followed forever
        params: PaginatedRequestParams | None = PaginatedRequestParams(cursor=cursor) if cursor else None
        try:
            page = await session.list_tools(params=params)
            entries, cursor = list(page.tools), page.next_cursor
        except ValidationError:
            # One bad entry fails the SDK's typed page: read it raw and check entry by entry.
            entries, cursor = await _raw_page(session, ListToolsRequest(params=params), server, left_out)
            # The SDK caches what a listing says (output schemas) and re-lists a tool it does
            # not know after each call: it gets the good entries, so it never re-lists.
            session._absorb_tool_listing(ListToolsResult(tools=entries), complete=False)
        tools.extend(entries)
        if len(tools) > MAX_LISTED_TOOLS:
            log.warning("MCP server %r lists more than %d tools: the rest are left out", server, MAX_LISTED_TOOLS)
            return tools[:MAX_LISTED_TOOLS]
        if not cursor:
            break
    return tools


async def _raw_page(
    session: Any, request: Any, server: str, left_out: dict[str, str] | None = None
) -> tuple[list[Any], str | None]:
    """One ``tools/list`` page as the server sent it, each entry validated on its own.

    The SDK (``mcp`` 2.x, the range pyproject.toml allows) validates a page whole; this sends
    the request as its ``send_request`` does, without that step.
    """
    from mcp_types import Tool

    data = request.model_dump(by_alias=True, mode="json", exclude_none=True)
    opts: dict[str, Any] = {"timeout": CONNECT_TIMEOUT_SECONDS}
    session._stamp(data, opts)
    raw = await session._dispatcher.send_raw_request(data["method"], data.get("params"), opts)
    raw = raw if isinstance(raw, dict) else {}
    entries: list[Any] = []
    listed = raw.get("tools")
    for i, entry in enumerate(listed[:MAX_LISTED_TOOLS + 1] if isinstance(listed, list) else []):
        try:
            entries.append(Tool.model_validate(entry, by_name=False))
        except ValidationError as e:
            name = entry.get("name") if isinstance(entry, dict) else None
            label = repr(name[:100]) if isinstance(name, str) else f"#{i + 1} (no name)"
            why = f"not a valid tool entry ({first_error(e)[:200]})"
            log.warning("MCP server %r: tool %s left out: %s", server, label, why)
            if left_out is not None and isinstance(name, str):
                left_out[f"{server}__{name}"[:200]] = why
    cursor = raw.get("nextCursor")
    return entries, cursor if isinstance(cursor, str) and cursor else None
