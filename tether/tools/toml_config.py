"""TOML configuration files validated by a pydantic model, with errors that name the file, the
line and the key (``line 5, key servers.git.tools.git_add.effect: Input should be ...``).

Used by the MCP config (tether/tools/mcp_config.py); the policy file's ``parse_policy`` has the same
steps and can be a call of :func:`parse_toml` (``_locate`` would then move here).
"""

from __future__ import annotations

import tomllib
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from tether.policy.files import _locate  # the one line-locating helper for TOML config errors

M = TypeVar("M", bound=BaseModel)


def parse_toml(text: str, model: type[M], source: str, error: type[ValueError]) -> M:
    """``text`` parsed and validated as ``model``; any problem raises ``error`` with one line."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{source}: not valid TOML: {e}") from None
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        line = _locate(text, tuple(first["loc"]))
        raise error(f"{source}: {f'line {line}, ' if line else ''}key {key}: {first['msg']}") from None
