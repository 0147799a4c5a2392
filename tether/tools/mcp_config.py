"""The MCP config file: which servers a worker starts, and the operator's word on their tools.

Read by the worker (``worker.py --mcp-config PATH`` / ``TETHER_MCP_CONFIG``) and by ``tether
tools``; the file's shape is in tether/tools/mcp.py and docs/mcp.md. Every mistake is an
:class:`McpConfigError` naming the line and key that are wrong.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tether.tools.toml_config import parse_toml
from workflows.contract import Compensation, ToolEffect

_SERVER_NAME = r"^[A-Za-z0-9][A-Za-z0-9-]*(_[A-Za-z0-9-]+)*$"  # no "__": it separates server and tool


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


def config_from_env(path: str | None = None) -> McpConfig | None:
    chosen = path or os.environ.get("TETHER_MCP_CONFIG") or None
    if not chosen:
        return None
    config = load_config(chosen)
    if importlib.util.find_spec("mcp") is None:
        raise McpConfigError(f"{chosen}: MCP servers need the `mcp` package: pip install 'tether[mcp]'")
    return config
