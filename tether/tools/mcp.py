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

The parts: the config file (tether/tools/mcp_config.py); a server's session and its tool listing
(tether/tools/mcp_session.py); a call (tether/tools/mcp_call.py); the catalog the listings make and
the servers a worker keeps (tether/tools/mcp_catalog.py). Here: what ``tether tools`` and
``python -m tether.tools.mcp tools --mcp-config PATH`` print.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from tether.loading import LoadError
from tether.tools.mcp_catalog import mcp_tools
from tether.tools.mcp_config import McpConfig, McpConfigError, config_from_env
from tether.tools.sdk import REGISTRY, ToolRegistry, load_tool_modules
from workflows.display import escape_text


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
    parser = argparse.ArgumentParser(prog="python -m tether.tools.mcp", description="Tools from MCP servers.")
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
