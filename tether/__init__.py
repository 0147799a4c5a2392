"""Tether for programs: connect to Temporal, configure a worker or a replayer, repair a stuck run.

    from tether import connect, TetherError, TetherPlugin
    from tether.repair import repair
    from tether import tool, ToolContext, ToolError, ToolEffect   # for tool authors

Modules: ``tether.connection`` (connect, TetherError and its exit codes, task queue and Worker
Deployment names), ``tether.plugin`` (TetherPlugin: what a worker and a replayer are),
``tether.runs`` (one run as Temporal holds it), ``tether.repair`` (a stuck run's reset),
``tether.client`` (the client API: start, read, decide, cancel, list; it names these too).
"""

from tether.connection import (
    DEFAULT_TASK_QUEUE,
    OK,
    PENDING,
    REFUSED,
    USAGE,
    TetherError,
    connect,
    deployment_name,
    task_queue,
)

__all__ = [
    "DEFAULT_TASK_QUEUE",
    "OK",
    "PENDING",
    "REFUSED",
    "USAGE",
    "TetherError",
    "TetherPlugin",
    "ToolContext",
    "ToolEffect",
    "ToolError",
    "connect",
    "create_replayer",
    "deployment_name",
    "task_queue",
    "tool",
]

# What a tool author imports, and where it lives (loaded on first use, as the worker's parts are).
_TOOLS = {"tool": "activities.tools", "ToolContext": "activities.tools", "ToolError": "activities.tools",
          "ToolEffect": "workflows.contract"}


def __getattr__(name: str) -> object:
    """The worker's configuration (it imports the workflow and the activities) on first use: a
    program that only connects, or the CLI, starts without it."""
    if name in ("TetherPlugin", "create_replayer"):
        from tether import plugin

        return getattr(plugin, name)
    if name in _TOOLS:
        import importlib

        return getattr(importlib.import_module(_TOOLS[name]), name)
    raise AttributeError(f"module 'tether' has no attribute {name!r}")
