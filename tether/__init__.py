"""Tether for programs: connect to Temporal, configure a worker or a replayer, repair a stuck run.

    from tether import connect, TetherError, create_replayer   # TetherError: Refused, UsageError, Pending, ...
    from activities.plugin import TetherPlugin                  # a worker: Worker(client, plugins=[TetherPlugin(...)])
    from tether.repair import repair
    from tether import tool, ToolContext, ToolError, ToolEffect   # for tool authors

Modules: ``tether.connection`` (connect, TetherError and its exit codes, task queue and Worker
Deployment names), ``tether.replay`` (a replayer: the worker's workflow side),
``tether.runs`` (one run as Temporal holds it), ``tether.repair`` (a stuck run's reset),
``tether.client`` (the client API: start, read, decide, cancel, list; it names these too).
``tether.cli`` is the `tether` command (a program over the client, not part of this API).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tether.connection import (
        DEFAULT_TASK_QUEUE,
        OK,
        PENDING,
        REFUSED,
        USAGE,
        NoWorker,
        Pending,
        Refused,
        TetherError,
        Unreachable,
        UsageError,
        connect,
        deployment_name,
        task_queue,
    )
    from tether.replay import create_replayer
    from tether.tools.sdk import ToolContext, ToolError, tool
    from workflows.contract import ToolEffect

__all__ = [
    "DEFAULT_TASK_QUEUE",
    "OK",
    "PENDING",
    "REFUSED",
    "USAGE",
    "NoWorker",
    "Pending",
    "Refused",
    "TetherError",
    "ToolContext",
    "ToolEffect",
    "ToolError",
    "Unreachable",
    "UsageError",
    "connect",
    "create_replayer",
    "deployment_name",
    "task_queue",
    "tool",
]

# The connection's names (tether.connection imports Temporal): loaded on first use, so that the CLI
# (tether.cli) prints its help and its usage errors without Temporal.
_CONNECTION = ("DEFAULT_TASK_QUEUE", "OK", "PENDING", "REFUSED", "USAGE", "TetherError", "UsageError", "Refused",
               "Pending", "NoWorker", "Unreachable", "connect", "deployment_name", "task_queue")
# What a tool author imports, and where it lives (loaded on first use, as the worker's parts are).
_TOOLS = {"tool": "tether.tools.sdk", "ToolContext": "tether.tools.sdk", "ToolError": "tether.tools.sdk",
          "ToolEffect": "workflows.contract"}


def __getattr__(name: str) -> object:
    """The connection on first use, and the worker's configuration (it imports the workflow and the
    activities) on first use: a program that only connects starts without the worker, and the CLI
    without either until a command runs."""
    if name in _CONNECTION:
        from tether import connection

        return getattr(connection, name)
    if name == "create_replayer":
        from tether import replay

        return replay.create_replayer
    if name in _TOOLS:
        import importlib

        return getattr(importlib.import_module(_TOOLS[name]), name)
    raise AttributeError(f"module 'tether' has no attribute {name!r}")
