"""The tools MCP servers publish, as registry entries: each server's listing read at worker
start and checked entry by entry, its effect class decided (workflows/mcp_effects.py, the
operator's word first), and the servers' connections kept for the worker's lifetime.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import jsonschema

from tether.tools.mcp_call import _lookup_fn, _tool_fn
from tether.tools.mcp_config import McpConfig, ServerConfig, ToolOverride
from tether.tools.mcp_session import CONNECT_TIMEOUT_SECONDS, Connection, McpUnavailable, _reason, list_tools
from tether.tools.sdk import ToolRegistry, ToolSpec
from workflows.contract import ToolEffect
from workflows.mcp_effects import Hints, effect_for
from workflows.validation import schema_problem

log = logging.getLogger("tether.mcp")

# Tool listings are untrusted input that ends up in every run's catalog snapshot (one Temporal
# payload, at most 2 MiB): descriptions are cut, and a server's schemas and descriptions together
# are bounded (tools beyond the bound are left out, with a log line).
MAX_DESCRIPTION_CHARS = 2000
MAX_SERVER_CATALOG_CHARS = 256_000
# Names every model API accepts for a function (OpenAI: ^[a-zA-Z0-9_-]{1,64}$).
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


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
            if override.lookup is not None and override.lookup in published:
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
