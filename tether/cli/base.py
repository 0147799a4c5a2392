"""What every command module shares: the modules a command imports on first use (the one place
the client is named), the usage exit code, and how a command joins the parser."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether import client
    import pydantic
    from temporalio import client as temporal
    from workflows import contract, policy, published, run_state, states, wording

# The command modules import these from here (the modules, on first use).
__all__ = [
    "USAGE", "add_command", "client", "contract", "policy", "published", "pydantic", "run_state", "states",
    "temporal", "wording",
]

# client.USAGE (argparse's own code too): a usage error is told before anything is imported.
USAGE = 2


class _OnUse:
    """A module imported when a command first uses it, not when ``tether --help`` parses: the
    client, Temporal, pydantic and the workflow models take most of a second to import."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        try:
            module = importlib.import_module(self._name)
        except ModuleNotFoundError as e:  # `python starter.py` with a Python outside the virtualenv
            print(f"error: {e.name} is not installed for {sys.executable}; run `make install`, then use "
                  ".venv/bin/tether", file=sys.stderr)
            raise SystemExit(USAGE) from None
        return getattr(module, attr)


if not TYPE_CHECKING:
    client, pydantic, temporal = _OnUse("tether.client"), _OnUse("pydantic"), _OnUse("temporalio.client")
    contract, policy, published = _OnUse("workflows.contract"), _OnUse("workflows.policy"), _OnUse("workflows.published")
    run_state, states, wording = _OnUse("workflows.run_state"), _OnUse("workflows.states"), _OnUse("workflows.wording")


def add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str,
    arguments: Callable[[argparse.ArgumentParser], None], run: Callable[[argparse.Namespace], Awaitable[int]],
) -> None:
    """One subcommand: its options (``arguments``) and the body it runs (``run``); its help is its
    description too (the README's table shows it)."""
    p = sub.add_parser(name, help=help, description=help)
    arguments(p)
    p.set_defaults(fn=run)
