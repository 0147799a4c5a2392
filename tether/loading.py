"""Loading the code a worker is configured with: tool modules (``--tools``) and planners
(``--planner NAME=MODULE:ATTR``), the same way in the worker and in the ``tether`` command.

A module is looked up on the interpreter's path and then in the current directory: a module
in the checkout (``my_tools.py`` beside ``worker.py``) loads whether the worker is started as
``python worker.py``, by the dev stack or through the installed ``tether`` entry point, which
alone would not see the checkout. The current directory comes last, so a file there never
shadows a module the process already relies on.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any


class LoadError(Exception):
    """Configured code that cannot be loaded: one line naming it and what to do."""


def import_named(name: str, what: str) -> ModuleType:
    """Import module ``name`` (``what`` says what it is for, e.g. "tool module")."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise LoadError(
                f"no {what} {name!r}: no module of that name in the installed packages or {here}; "
                f"check the spelling, or start from the directory that holds it"
            ) from None
        raise LoadError(f"cannot import {what} {name!r}: {e}") from None
    except Exception as e:  # a syntax error, a failing import-time statement: one line, not a trace
        raise LoadError(f"cannot import {what} {name!r}: {type(e).__name__}: {e}") from None


def load_object(spec: str, what: str) -> Any:
    """``MODULE:ATTR`` -> the attribute (``what`` names it in errors)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise LoadError(f"{what} {spec!r} is not MODULE:ATTR, e.g. examples.agents.refund_agent:planner")
    module = import_named(module_name.strip(), what)
    try:
        return getattr(module, attr.strip())
    except AttributeError:
        raise LoadError(f"{what} {spec!r}: module {module_name.strip()!r} has no {attr.strip()!r}") from None
