"""`tether tools`: the tools a worker with these options would serve, each with its effect and undo."""

from __future__ import annotations

import argparse

from tether.cli.base import USAGE, add_command, client


def _tools_args(p: argparse.ArgumentParser) -> None:
    import os

    p.add_argument("--tools", default=os.environ.get("TETHER_TOOLS", "examples.billing.tools"), metavar="MODULES",
                   help="comma-separated tool modules (env TETHER_TOOLS)")
    p.add_argument("--mcp-config", metavar="PATH", help="MCP servers' config (env TETHER_MCP_CONFIG)")


async def cmd_tools(args: argparse.Namespace) -> int:
    """The tools a worker with these options would serve, with each one's effect and why."""
    from tether.tools import mcp
    from tether.tools.mcp_config import McpConfigError, config_from_env
    from tether.loading import LoadError
    from tether.tools.sdk import REGISTRY, load_tool_modules

    modules = [m for m in args.tools.split(",") if m.strip()]
    try:
        config = config_from_env(args.mcp_config)
    except McpConfigError as e:
        raise client.UsageError(f"invalid MCP config: {e}") from None
    try:  # resolved as the worker resolves them (tether/loading.py)
        registry = load_tool_modules(modules, REGISTRY)
    except LoadError as e:
        raise client.UsageError(str(e)) from None
    if config is None:
        print(mcp.format_tools(mcp.describe_tools(registry)))
        return client.OK
    return await mcp.print_tools(config, modules)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_command(sub, "tools", "a worker's tools: source, effect, undo", _tools_args, cmd_tools)
