"""The `tether` command: the parser, assembled from the command modules, and the dispatch that
turns every outcome into one exit code: 0 done; 1 the run refused it (or a waited-for run ended
other than COMPLETED, or the person answered no to the plan shown); 2 usage error (a script's
decision naming no plan, too), unknown run, Temporal unreachable; 3 accepted, verdict pending.

    .venv/bin/tether start --goal "Refund A-1001" --playbook examples/billing/refund.playbook.json \\
        --requested-by alice --wait
    .venv/bin/tether status RUN
    .venv/bin/tether approve RUN --by bob
    .venv/bin/tether timeline RUN
    .venv/bin/tether list --state AWAITING_APPROVAL

``python starter.py ...`` runs the same code. The operations themselves live in ``tether.client``;
this package only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tether.cli import decisions, inbox, keys, operations, policy, runs, tools
from tether.cli.base import USAGE, client, temporal
from tether.cli.output import PROG, error_line
from workflows.display import escape_text as show  # the standard library's alone

# The one list of command groups, in the order `--help` and the README's table show them.
GROUPS = (runs, decisions, operations, tools, keys, inbox, policy)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("tether")
    except PackageNotFoundError:  # `python starter.py` from a checkout that was never installed
        return "(not installed: run `make install`)"


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE, f"error: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None) -> argparse.Namespace:  # type: ignore[override]
        # A misspelt option after a subcommand belongs to that subcommand: point to its help.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            prog = f"{self.prog} {command}" if command else self.prog
            self.exit(USAGE, f"error: unrecognized arguments: {' '.join(extras)} (see `{prog} --help`)\n")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Tether: governed, durable AI-agent runs on Temporal.")
    parser.add_argument("--version", action="version", version=f"{PROG} {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(sub)
    return parser


def cli_table(parser: argparse.ArgumentParser | None = None) -> str:
    """The README's CLI table, generated from the parser (tests/docs/test_docs.py keeps them equal)."""
    parser = parser or build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    rows = ["| Command | Arguments | What it does |", "|---|---|---|"]
    for name, p in sub.choices.items():
        args = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            if not a.option_strings:
                args.append(a.dest.upper())
                continue
            flag = a.option_strings[0]
            if a.nargs == 0:
                text = flag
            elif a.choices:
                text = f"{flag} " + "\\|".join(a.choices)
            else:
                text = f"{flag} {a.metavar or a.dest.upper()}"
            args.append(text if a.required else f"[{text}]")
        rows.append(f"| `{name}` | {' '.join(f'`{x}`' for x in args)} | {p.description} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import asyncio

    # Every command goes through the client: imported once the arguments parse (not for --help).
    failed, run_failed = client.TetherError, temporal.WorkflowFailureError
    try:
        code: int = asyncio.run(args.fn(args))  # every command's body returns its exit code
        return code
    except failed as e:
        print(error_line(e), file=sys.stderr)
        return e.code
    except run_failed as e:
        print(f"error: {show(str(e))}", file=sys.stderr)
        return client.REFUSED
    except BrokenPipeError:
        # The reader stopped early (`tether timeline RUN | head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return client.OK
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug or an unforeseen failure: still one line, the trace on demand
        if os.environ.get("TETHER_DEBUG"):
            raise
        print(f"error: unexpected {type(e).__name__}: {show(str(e))} (TETHER_DEBUG=1 shows the traceback)", file=sys.stderr)
        return USAGE


def run() -> None:
    """The `tether` console script ([project.scripts] in pyproject.toml)."""
    try:
        code: int | str | None = main()
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        code = e.code
    code = code if isinstance(code, int) or code is None else USAGE
    if "tether.client" in sys.modules:  # Temporal's native threads may be running: no interpreter teardown
        client.exit_process(code)
    sys.exit(code)  # --help, a usage error: nothing was imported that needs more
