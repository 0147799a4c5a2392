"""Tools from MCP (Model Context Protocol) servers, governed like every other tool.

The worker reads a TOML file (``worker.py --mcp-config PATH`` / ``TETHER_MCP_CONFIG``; example:
``examples/git/mcp.toml``; guide: ``docs/mcp.md``)::

    [servers.git]
    command = "mcp-server-git"       # stdio; or url = "http://..." for streamable HTTP
    args = ["--repository", "."]
    cwd = "../../.tether/git-demo"   # relative paths: from the config file's directory
    trust_annotations = true         # default false: annotations of untrusted servers are ignored
    [servers.git.tools.git_commit]
    effect = "unsafe"                # the operator's word always beats the server's hints
    summary_fields = ["message"]

At worker start every server's tools are listed (all pages) and registered as
``<server>__<tool>`` with the server's JSON schema, description and an effect class
(``workflows/mcp_effects.py``). From there they are ordinary tools: catalog snapshot, validation,
plan hash, approval and policy treat them the same. A server that cannot be reached at start is
left out (its tools are absent from new runs' catalogs) and the log says why.

One MCP session per worker per server, started on first use, restarted after a failure, closed
at shutdown. A call sends the run's idempotency key in the request ``_meta``
(``io.tether/idempotency-key``). An ``isError`` result is a permanent tool error unless the result's
``_meta`` says ``io.tether/retryable: true``; a lost connection, a crash or a timeout is
"outcome unknown" (a transient error), so an ``unsafe`` tool goes to HANDED_OFF, never a second
call.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from activities.toml_config import parse_toml
from activities.loading import LoadError
from activities.tools import REGISTRY, ToolContext, ToolError, ToolRegistry, ToolSpec, load_tool_modules
from workflows.display import escape_text
from workflows.mcp_effects import Hints, effect_for
from workflows.contract import Compensation, ToolEffect, first_error
from workflows.validation import schema_problem

log = logging.getLogger("tether.mcp")

IDEMPOTENCY_META_KEY = "io.tether/idempotency-key"
# What a server may put in an isError result's _meta: the error code the timeline shows, and
# whether the failure is transient (the tool's effect class then decides about a retry).
ERROR_CODE_META_KEY = "io.tether/error-code"
RETRYABLE_META_KEY = "io.tether/retryable"

# Tool listings are untrusted input that ends up in every run's catalog snapshot (one Temporal
# payload, at most 2 MiB): descriptions are cut, and a server's schemas and descriptions together
# are bounded (tools beyond the bound are left out, with a log line).
MAX_DESCRIPTION_CHARS = 2000
MAX_SERVER_CATALOG_CHARS = 256_000
CONNECT_TIMEOUT_SECONDS = 20.0
PING_TIMEOUT_SECONDS = 5.0
# Names every model API accepts for a function (OpenAI: ^[a-zA-Z0-9_-]{1,64}$).
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ERROR_CODE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # a server's error code, as the timeline shows it
_SERVER_NAME = r"^[A-Za-z0-9][A-Za-z0-9-]*(_[A-Za-z0-9-]+)*$"  # no "__": it separates server and tool


# ----------------------------------------------------------------------------- configuration


class McpConfigError(ValueError):
    """An invalid MCP config file, with the line and key that are wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolOverride(_Strict):
    """The operator's word on one tool; every field left out falls back to the server's."""

    effect: ToolEffect | None = None
    destructive: bool | None = None
    requires_approval: bool | None = None
    summary_fields: list[str] = Field(default_factory=list)
    timeout: float | None = Field(None, gt=0, le=3600)
    max_retries: int | None = Field(None, ge=0, le=100)
    # reconcilable only: a tool of the same server that finds a previous effect by idempotency
    # key (called with {lookup_arg: key}; an empty result or `null` means "not found").
    lookup: str | None = None
    lookup_arg: str = "idempotency_key"
    # How the tool's effect is undone: a tool of the same server (its name as the server
    # publishes it) and its arguments as JSON pointers into the call's arguments and result,
    # e.g. compensate = { tool = "delete_branch", args = { name = "/args/branch_name" } }.
    compensate: Compensation | None = None

    @model_validator(mode="after")
    def _lookup(self) -> ToolOverride:
        if self.effect == ToolEffect.RECONCILABLE and not self.lookup:
            raise ValueError('effect "reconcilable" needs lookup = "<tool>" (a tool taking the idempotency key)')
        if self.lookup and self.effect != ToolEffect.RECONCILABLE:
            raise ValueError('lookup is only used with effect = "reconcilable"')
        return self


class ServerConfig(_Strict):
    command: str | None = None  # stdio: the executable (looked up next to this Python, then PATH)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)  # added to a minimal safe environment
    cwd: str | None = None
    url: str | None = None  # streamable HTTP endpoint
    trust_annotations: bool = False
    timeout: float = Field(30.0, gt=0, le=3600, description="seconds per call (the activity's timeout)")
    max_retries: int = Field(3, ge=0, le=100)
    tools: dict[str, ToolOverride] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _transport(self) -> ServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError('set exactly one of command = "..." (stdio) or url = "http://..."')
        if self.url is not None and not re.match(r"^https?://", self.url):
            raise ValueError("url must start with http:// or https://")
        return self


class McpConfig(_Strict):
    servers: dict[str, ServerConfig] = Field(default_factory=dict)

    @field_validator("servers")
    @classmethod
    def _names(cls, servers: dict[str, ServerConfig]) -> dict[str, ServerConfig]:
        for name in servers:
            if not re.match(_SERVER_NAME, name) or len(name) > 30:
                raise ValueError(
                    f"server name {name!r}: letters, digits, '-' and single '_' only (at most 30), "
                    "since tools are named <server>__<tool>"
                )
        return servers


def parse_config(text: str, source: str = "mcp config", base: Path | None = None) -> McpConfig:
    """The config, validated; relative ``cwd`` paths resolved against ``base``."""
    config = parse_toml(text, McpConfig, source, McpConfigError)
    for server in config.servers.values():
        if server.cwd is not None and base is not None:
            server.cwd = str((base / server.cwd).resolve())
    return config


def load_config(path: str | Path) -> McpConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise McpConfigError(f"MCP config file not found: {path}") from None
    return parse_config(text, str(path), base=path.parent)


# ----------------------------------------------------------------------------- sessions


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
        self._task: asyncio.Task | None = None
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

    async def _own(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
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
            if self._session is not None and not self._task.done():
                try:
                    # Cheap on a live session; a dead one is found here, before the call is sent.
                    await asyncio.wait_for(self._session.send_ping(), PING_TIMEOUT_SECONDS)
                    return self._session
                except Exception as e:  # noqa: BLE001
                    log.warning("MCP server %r stopped answering (%s); reconnecting", self.name, _reason(e))
                    await self._close()
            self._stop = asyncio.Event()
            ready: asyncio.Future = asyncio.get_running_loop().create_future()
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


# ----------------------------------------------------------------------------- calls


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


# ----------------------------------------------------------------------------- the catalog


def _tool_fn(connection: Connection, tool: str, timeout: float):
    async def fn(args: dict[str, Any], ctx: ToolContext) -> Any:
        return await call_tool(connection, tool, args, ctx, timeout)

    return fn


def _lookup_fn(connection: Connection, tool: str, arg: str, timeout: float):
    async def lookup(ctx: ToolContext) -> Any:
        found = await call_tool(connection, tool, {arg: ctx.idempotency_key}, ctx, timeout)
        return None if found in (None, "", "null", [], {}) else found

    return lookup


def tool_specs(
    name: str, config: ServerConfig, connection: Connection, tools: Sequence[Any],
    left_out: dict[str, str] | None = None,
) -> list[ToolSpec]:
    """The registry entries for one server's listed tools (``mcp`` ``Tool`` objects).

    A listing is untrusted input: an entry that cannot be a catalog entry (a name listed twice,
    an invalid name or schema, a pattern the workflow cannot run in bounded time, over the
    server's size budget) is left out on its own, with a log line naming server and tool, and
    ``left_out[<server>__<tool>]`` says why. The server's other tools stay.
    """
    left_out = {} if left_out is None else left_out
    published = {t.name for t in tools}
    for missing in sorted(set(config.tools) - published):
        log.warning("MCP server %r: the config names tool %r, which the server does not publish", name, missing)
    listed = [t.name for t in tools]
    twice = {n for n in listed if listed.count(n) > 1}
    specs, budget = [], MAX_SERVER_CATALOG_CHARS
    for t in tools:
        full = f"{name}__{t.name}"
        description = (t.description or t.title or "").strip()[:MAX_DESCRIPTION_CHARS]
        size = len(json.dumps(t.input_schema)) + len(description)
        problem = (
            f"{full!r} is not a valid tool name" if not _TOOL_NAME.match(full)
            # Which of two entries is the real one is not ours to guess: neither is offered.
            else f"the server lists {t.name!r} {listed.count(t.name)} times" if t.name in twice
            else _schema_problem(t.input_schema)
            or (f"the server's tools exceed {MAX_SERVER_CATALOG_CHARS} characters of schemas" if size > budget else None)
        )
        if problem:
            if full[:200] not in left_out:
                log.warning("MCP server %r: tool %r left out: %s", name, str(t.name)[:100], problem)
            left_out[full[:200]] = problem
            continue
        budget -= size
        override = config.tools.get(t.name, ToolOverride())
        a = t.annotations
        hints = None if a is None else Hints(a.read_only_hint, a.idempotent_hint, a.destructive_hint)
        decision = effect_for(
            hints, trusted=config.trust_annotations, override=override.effect,
            destructive_override=override.destructive,
        )
        effect, why = decision.effect, decision.why
        timeout = override.timeout or config.timeout
        lookup = None
        if effect == ToolEffect.RECONCILABLE:
            if override.lookup in published:
                lookup = _lookup_fn(connection, override.lookup, override.lookup_arg, timeout)
            else:
                effect, why = ToolEffect.UNSAFE, f"override reconcilable, but lookup tool {override.lookup!r} is not published: unsafe"
        compensate = None
        if override.compensate is not None:
            if override.compensate.tool in published:
                compensate = override.compensate.model_copy(update={"tool": f"{name}__{override.compensate.tool}"})
            else:
                log.warning(
                    "MCP server %r: tool %r: compensating tool %r is not published: no recovery path",
                    name, t.name, override.compensate.tool,
                )
        specs.append(
            ToolSpec(
                name=full,
                fn=_tool_fn(connection, t.name, timeout),
                args_model=None,
                args_schema=t.input_schema,
                effect=effect,
                requires_approval=(
                    override.requires_approval
                    if override.requires_approval is not None
                    else effect != ToolEffect.READ_ONLY
                ),
                timeout_seconds=timeout,
                max_retries=override.max_retries if override.max_retries is not None else config.max_retries,
                description=description,
                summary_fields=tuple(override.summary_fields),
                lookup_fn=lookup,
                source=f"mcp:{name}",
                why=why,
                destructive=decision.destructive,
                compensate=compensate,
            )
        )
    return specs


def _schema_problem(schema: dict[str, Any]) -> str | None:
    """Why a server's input schema cannot be a catalog entry: the workflow validates proposals
    against it deterministically, so it must be a valid JSON schema that refers only to itself."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        return f"invalid input schema: {e.message[:200]}"
    if (bounded := schema_problem(schema)) is not None:
        return bounded

    def refs(node: Any) -> Iterator[Any]:
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    outside = next((r for r in refs(schema) if not (isinstance(r, str) and r.startswith("#"))), None)
    return f"input schema refers outside itself ($ref {str(outside)[:100]!r})" if outside is not None else None


MAX_LISTED_TOOLS = 1000  # entries beyond this many are not read (one server, all pages)


async def list_tools(session: Any, server: str = "?", left_out: dict[str, str] | None = None) -> list[Any]:
    """Every tool the server publishes, all pages; an entry the protocol's ``Tool`` type refuses
    is left out on its own (log line naming server and entry), not the whole listing."""
    from mcp_types import ListToolsRequest, ListToolsResult, PaginatedRequestParams

    tools, cursor = [], None
    for _ in range(1000):  # a server that never stops paginating is not followed forever
        params = PaginatedRequestParams(cursor=cursor) if cursor else None
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

    The SDK (``mcp`` 2.x, pinned) validates a page whole; this sends the request as its
    ``send_request`` does, without that step.
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


class McpServers:
    """The worker's MCP servers: their connections and the tools they add to a registry."""

    def __init__(self, config: McpConfig) -> None:
        self.config = config
        self.connections = {name: Connection(name, cfg) for name, cfg in config.servers.items()}
        self.unavailable: dict[str, str] = {}  # server -> why its tools are absent
        self.invalid: dict[str, dict[str, str]] = {}  # server -> entries the protocol refused, why

    async def register(self, registry: ToolRegistry) -> ToolRegistry:
        """List every server's tools and add them to ``registry``. A server that cannot be
        reached is left out, with a log line saying why; the worker starts anyway."""
        # All servers start at once; their tools register in the config's order.
        listed = await asyncio.gather(*(self._list(c) for c in self.connections.values()))
        for (name, connection), tools in zip(self.connections.items(), listed):
            if tools is None:
                continue
            left_out: dict[str, str] = dict(self.invalid.get(name, {}))
            specs = tool_specs(name, self.config.servers[name], connection, tools, left_out)
            for full, why in left_out.items():
                registry.refuse(full, why, source=f"mcp:{name}", logged=True)
            registered = 0
            for spec in specs:
                if spec.name in registry.tools:
                    # Another source already has the name: that one stays, this one is left out.
                    registry.refuse(spec.name, f"the name is taken by a {registry.tools[spec.name].source} tool", source=spec.source)
                    continue
                registry.register(spec)
                registered += spec.name in registry.tools
            log.info("MCP server %r: %d tool(s) registered", name, registered)
        registry.check()
        return registry

    async def _list(self, connection: Connection) -> list[Any] | None:
        try:
            session = await connection.session()
            invalid = self.invalid.setdefault(connection.name, {})
            return await asyncio.wait_for(list_tools(session, connection.name, invalid), CONNECT_TIMEOUT_SECONDS)
        except Exception as e:  # noqa: BLE001
            why = str(e) if isinstance(e, McpUnavailable) else _reason(e)
            self.unavailable[connection.name] = why
            await connection.reset()
            log.error(
                "MCP server %r unavailable at worker start (%s): its tools are absent from new runs' catalogs",
                connection.name, why,
            )
            return None

    async def aclose(self) -> None:
        for connection in self.connections.values():
            await connection.aclose()


async def start_servers(config: McpConfig | None, registry: ToolRegistry) -> McpServers | None:
    """Start the configured servers and register their tools; the caller closes them."""
    if config is None:
        return None
    servers = McpServers(config)
    await servers.register(registry)
    return servers


@asynccontextmanager
async def mcp_tools(config: McpConfig | None, registry: ToolRegistry) -> AsyncIterator[McpServers | None]:
    """Register the configured servers' tools into ``registry`` for the block; sessions close
    after it. ``None``: no MCP servers."""
    servers = await start_servers(config, registry)
    try:
        yield servers
    finally:
        if servers is not None:
            await servers.aclose()


def config_from_env(path: str | None = None) -> McpConfig | None:
    chosen = path or os.environ.get("TETHER_MCP_CONFIG") or None
    if not chosen:
        return None
    config = load_config(chosen)
    if importlib.util.find_spec("mcp") is None:
        raise McpConfigError(f"{chosen}: MCP servers need the `mcp` package: pip install 'tether[mcp]'")
    return config


# ----------------------------------------------------------------------------- `tools` listing


def describe_tools(registry: ToolRegistry) -> list[dict[str, Any]]:
    """Every registered tool: name, source, effect, approval, destructive, and why that effect;
    then every tool left out at load (effect ``left out``), with why."""
    return [
        {
            "name": spec.name,
            "source": spec.source,
            "effect": spec.effect.value,
            "approval": "yes" if spec.requires_approval else "no",
            "destructive": spec.destructive,
            "why": spec.why,
            "undo": spec.compensate.tool if spec.compensate else None,
        }
        for spec in sorted(registry.tools.values(), key=lambda s: (s.source, s.name))
    ] + [
        # Left out at load: never in a catalog; the reason says why (the worker's log too).
        {
            "name": name,
            "source": why.split(": ", 1)[0],
            "effect": "left out",
            "approval": "-",
            "destructive": False,
            "why": why.split(": ", 1)[-1],
        }
        for name, why in sorted(registry.refused.items())
    ]


def format_tools(rows: list[dict[str, Any]]) -> str:
    head = ["TOOL", "SOURCE", "EFFECT", "APPROVAL", "UNDO", "WHY"]
    # Names and reasons can carry a server's text: shown through the one escaping function.
    table = [
        [escape_text(r["name"], 200), escape_text(r["source"], 100), r["effect"] + (" (destructive)" if r["destructive"] else ""),
         r["approval"], escape_text(r["undo"], 64) if r.get("undo") else "-", escape_text(r["why"], 400)]
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in [head, *table]) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)) + "  " + str(row[-1]) for row in [head, *table]
    )


async def print_tools(config: McpConfig, modules: Sequence[str] = ()) -> int:
    """The `tools` listing (table on stdout); 1 when a server was unavailable."""
    # Tool modules register into the global registry as they are imported.
    registry = load_tool_modules(modules, REGISTRY) if modules else ToolRegistry()
    async with mcp_tools(config, registry) as servers:
        print(format_tools(describe_tools(registry)))
        # An unreachable server was logged (with why) and its tools are missing: exit 1.
        return 1 if servers and servers.unavailable else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m activities.mcp", description="Tools from MCP servers.")
    sub = parser.add_subparsers(dest="command", required=True)
    tools = sub.add_parser("tools", help="list the tools a worker with this config gets, with their effect and why")
    tools.add_argument("--mcp-config", default=None, help="TOML file (env TETHER_MCP_CONFIG)")
    tools.add_argument("--tools", default="", help="comma-separated Python tool modules to list as well")
    args = parser.parse_args(argv)
    try:
        config = config_from_env(args.mcp_config)
    except McpConfigError as e:
        print(f"invalid MCP config: {e}", file=sys.stderr)
        return 1
    if config is None:
        print("no MCP config: pass --mcp-config PATH or set TETHER_MCP_CONFIG", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    modules = [m for m in args.tools.split(",") if m.strip()]
    try:
        return asyncio.run(print_tools(config, modules))
    except LoadError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
