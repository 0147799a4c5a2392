"""The `tether` command: start runs, decide approvals, hand off, cancel, inspect.

    .venv/bin/tether start --goal "Refund A-1001" --playbook examples/billing/refund.playbook.json \\
        --requested-by alice --wait
    .venv/bin/tether status RUN
    .venv/bin/tether approve RUN --by bob
    .venv/bin/tether timeline RUN
    .venv/bin/tether list --state AWAITING_APPROVAL

``python starter.py ...`` runs the same code. The operations themselves live in ``client.py``;
this module only parses arguments and prints. Exit codes: 0 done; 1 the run refused it (or a
waited-for run ended other than COMPLETED); 2 usage error, unknown run, Temporal unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

try:
    from pydantic import ValidationError
    from temporalio.client import WorkflowFailureError

    import client
    from client import OK, REFUSED, USAGE, TetherError, exit_process, start_run  # noqa: F401  (start_run: public re-export)
    from workflows.display import escape_text
    from workflows.models import Limits, PlaybookStep, RunRequest
    from workflows.states import RunState, TransitionRecord
except ModuleNotFoundError as e:  # `python starter.py` with a Python outside the virtualenv
    print(f"error: {e.name} is not installed for {sys.executable}; run `make install`, then use "
          ".venv/bin/tether", file=sys.stderr)
    sys.exit(2)

PROG = "tether"

# Model fields as the options that set them, so a validation error names what the user typed.
OPTIONS = {
    "goal": "--goal", "tenant": "--tenant", "requested_by": "--requested-by", "planner": "--planner",
    "max_steps": "--max-steps", "max_replans": "--max-replans", "approval_ttl_seconds": "--approval-ttl",
    "on_expiry": "--on-expiry", "max_model_tokens": "--max-model-tokens", "approver": "--by", "by": "--by",
    "decision_id": "--decision-id", "plan_hash": "--plan-hash", "comment": "--comment", "reason": "--reason",
    "state": "--state", "limit": "--limit", "on_failure": "--on-failure", "on_cancel": "--on-cancel",
}


def invoked_as() -> str:
    """The command as the user typed it (`.venv/bin/tether`), for hints that paste."""
    typed = sys.argv[0] if sys.argv else ""
    return typed if os.path.basename(typed) == PROG else PROG


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE, f"error: {message} (see `{self.prog} --help`)\n")


# ----------------------------------------------------------------------------- output


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=str))


def _steps(plan: object) -> list[str]:
    steps = getattr(plan, "steps", None) or []
    return [f"  {i}. {s.tool} {json.dumps(s.args, sort_keys=True)}" for i, s in enumerate(steps, start=1)]


def format_status(s: client.RunStatus) -> str:
    lines = [
        f"run        {s.run_id}",
        f"state      {s.state.value} (version {s.state_version}, was "
        f"{s.previous_state.value if s.previous_state else '-'})",
        f"tenant     {s.tenant}",
        f"steps      {s.step} executed, {s.retries} retries",
    ]
    if s.end_reason and s.state != RunState.COMPLETED:
        lines.append(f"why        {s.end_reason}" + (f" [rule: {s.end_rule}]" if s.end_rule else "")
                     + (f" ({s.end_actor})" if s.end_actor else ""))
    if s.approved_by:
        lines.append(f"approved   by {', '.join(s.approved_by)}")
    if s.last_error:
        lines.append(f"last error {s.last_error}")
    if s.plan is not None:
        lines.append(f"plan       {s.plan.plan_hash}")
        lines.extend(_steps(s.plan))
    if s.pending_approval is not None:
        p = s.pending_approval
        lines.append(f"pending    approval until {p.expires_at.isoformat()}: {p.summary}")
        lines.append(f"           approve: {invoked_as()} approve {s.run_id} --by NAME")
    for c in s.compensations:
        # Each ok write and its undo: what `compensate` would run (ids and names, escaped).
        undo = f"{escape_text(c.tool, 64)} {c.status}" if c.tool else f"no recovery path ({escape_text(c.error, 200)})"
        lines.append(f"undo       {c.of} {escape_text(c.of_tool, 64)}: {undo}")
    if s.ended and s.state in (RunState.HANDED_OFF, RunState.EXECUTION_FAILED) and any(
        c.status != "ok" and c.tool for c in s.compensations
    ):
        lines.append(f"           undo them: {invoked_as()} compensate {s.run_id} --by NAME")
    if s.answer:
        lines.append(f"answer     {s.answer}")
    return "\n".join(lines)


def format_timeline(records: Sequence[TransitionRecord]) -> str:
    lines = []
    for r in records:
        # Hashes shortened for reading; `timeline --json` has them in full.
        refs = ", ".join(
            f"{k}={v[:12] if k.endswith('_hash') else v}"
            for k, v in r.refs.model_dump(exclude_none=True).items()
        )
        arrow = (
            f"{r.from_state.value} -> {r.to_state.value}"
            if r.kind == "transition"
            else f"{r.kind.upper()} in {r.from_state.value}"
        )
        lines.append(
            f"v{r.state_version:<3} {r.at.strftime('%H:%M:%S.%f')[:-3]}  {arrow:<42} "
            f"{r.actor:<18} {r.reason}" + (f"  [{r.rule}]" if r.rule else "") + (f"  [{refs}]" if refs else "")
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- commands


def _load_playbook(path: str | None) -> list[PlaybookStep]:
    if path is None:
        return []
    try:
        raw = json.loads(Path(path).read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise TetherError(f"playbook file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TetherError(f"playbook {path} is not valid JSON: {getattr(e, 'msg', e)}") from None
    steps = raw.get("steps") if isinstance(raw, dict) else raw
    if not isinstance(steps, list):
        raise TetherError(f"playbook {path} must be a JSON list of {{\"tool\", \"args\"}} steps")
    try:
        return [PlaybookStep.model_validate(s) for s in steps]
    except ValidationError as e:
        raise client.invalid(f"playbook {path}", e) from None


async def cmd_start(args: argparse.Namespace) -> int:
    playbook = _load_playbook(args.playbook)
    if args.planner == "playbook" and not playbook:
        raise TetherError("the playbook planner needs steps: pass --playbook PATH")
    try:
        request = RunRequest(
            goal=args.goal,
            tenant=args.tenant,
            requested_by=args.requested_by,
            planner=args.planner,
            playbook=playbook,
            limits=Limits(
                approval_ttl_seconds=args.approval_ttl,
                on_expiry=args.on_expiry,
                max_steps=args.max_steps,
                max_replans=args.max_replans,
                max_model_tokens=args.max_model_tokens,
            ),
            on_failure=args.on_failure,
            on_cancel=args.on_cancel,
        )
    except ValidationError as e:
        raise client.invalid("run request", e) from None
    run_id = args.id or f"run-{uuid.uuid4().hex[:12]}"
    if args.key:
        request = client.sign_request(request, run_id, Path(args.key))
    conn = await client.connect()
    await client.start_run(conn, request, run_id=run_id, allow_id_reuse=args.allow_id_reuse)
    if not args.wait:
        if args.json:
            _print_json({"run_id": run_id})
        else:
            print(f"started {run_id}")
        return OK
    status = await client.wait_settled(conn, run_id, args.wait_timeout)
    if args.json:
        _print_json(status.model_dump(mode="json"))
    else:
        print(f"started {run_id}")
        print(format_status(status))
    if status.ended and status.state != RunState.COMPLETED:
        why = f": {status.end_reason}" if status.end_reason else ""
        print(f"error: run {run_id} ended in {status.state.value}{why}", file=sys.stderr)
        return REFUSED
    if not status.ended and status.state != RunState.AWAITING_APPROVAL:
        print(f"note: run {run_id} is still {status.state.value} after {args.wait_timeout:g}s", file=sys.stderr)
    return OK


async def _decide(args: argparse.Namespace, kind: str) -> int:
    given = client.DecisionInput(
        by=args.by, plan_hash=args.plan_hash, decision_id=args.decision_id,
        comment=getattr(args, "comment", None), reason=getattr(args, "reason", None),
        key=Path(args.key) if args.key else None,
    )
    verdict = await client.decide(await client.connect(), args.run, kind, given)  # type: ignore[arg-type]
    verb = "approved" if kind == "approve" else "rejected"
    print(f"{verb} plan {verdict.pending.plan_hash if verdict.pending else '-'} of run {args.run}:")
    if verdict.pending:
        print(f"  {verdict.pending.summary}")
    for line in _steps(verdict.plan):
        print(line)
    return _print_verdict(verdict)


def _print_verdict(verdict: client.Verdict) -> int:
    r = verdict.record
    if r is None:
        print(f"decision {verdict.decision_id} sent; the run has not recorded it yet "
              f"(check `{invoked_as()} timeline {verdict.run_id}`)")
    elif r.kind == "accepted":
        print(f"accepted: {r.reason} (decision {verdict.decision_id})")
    else:
        print(f"{r.to_state.value}: {r.reason} (decision {verdict.decision_id})")
    return OK


async def cmd_approve(args: argparse.Namespace) -> int:
    return await _decide(args, "approve")


async def cmd_reject(args: argparse.Namespace) -> int:
    return await _decide(args, "reject")


async def cmd_handoff(args: argparse.Namespace) -> int:
    verdict = await client.handoff(
        await client.connect(), args.run, by=args.by, reason=args.reason, decision_id=args.decision_id,
        key=Path(args.key) if args.key else None,
    )
    return _print_verdict(verdict)


async def cmd_cancel(args: argparse.Namespace) -> int:
    await client.cancel(await client.connect(), args.run, reason=args.reason)
    print(f"cancellation requested for {args.run}: the run ends in CANCELLED once any tool "
          f"in flight has settled")
    return OK


async def cmd_status(args: argparse.Namespace) -> int:
    status = await client.status(await client.connect(), args.run)
    print(status.model_dump_json(indent=2) if args.json else format_status(status))
    return OK


async def cmd_timeline(args: argparse.Namespace) -> int:
    conn = await client.connect()
    if getattr(args, "all", False):
        records = await client.full_timeline(conn, args.run, args.audit_dir)
    else:
        records = await client.timeline(conn, args.run)
    if args.json:
        _print_json([r.model_dump(mode="json") for r in records])
    else:
        print(format_timeline(records))
    return OK


async def cmd_tools(args: argparse.Namespace) -> int:
    """The tools a worker with these options would serve, with each one's effect and why."""
    from activities import mcp
    from activities.tools import REGISTRY, load_tool_modules

    modules = [m for m in args.tools.split(",") if m.strip()]
    try:
        config = mcp.config_from_env(args.mcp_config)
    except mcp.McpConfigError as e:
        raise client.TetherError(f"invalid MCP config: {e}", client.USAGE) from None
    if config is None:
        print(mcp.format_tools(mcp.describe_tools(load_tool_modules(modules, REGISTRY))))
        return OK
    return await mcp.print_tools(config, modules)


async def cmd_compensate(args: argparse.Namespace) -> int:
    conn = await client.connect()
    handle = await client.compensate(conn, args.run, by=args.by, key=Path(args.key) if args.key else None)
    print(f"started {handle.id}: the compensation of {args.run}")
    if not args.wait:
        return OK
    status = await client.wait_settled(conn, handle.id, args.wait_timeout)
    print(format_status(status))
    if status.ended and status.state != RunState.COMPENSATED:
        why = f": {status.end_reason}" if status.end_reason else ""
        print(f"error: compensation {handle.id} ended in {status.state.value}{why}", file=sys.stderr)
        return REFUSED
    return OK


async def cmd_list(args: argparse.Namespace) -> int:
    client.list_query(args.state, args.tenant)  # bad filters are usage errors, before connecting
    rows = await client.list_runs(await client.connect(), state=args.state, tenant=args.tenant, limit=args.limit)
    if args.json:
        _print_json([r.model_dump(mode="json") for r in rows])
    else:
        for row in rows:
            started = row.started.isoformat() if row.started else "-"
            print(f"{row.run_id:<28} {row.state or '-':<18} {row.tenant or '-':<12} {started}")
    return OK


async def cmd_keygen(args: argparse.Namespace) -> int:
    path = Path(args.out)
    encoded = client.keygen(path, force=args.force)
    public_path = path.with_name(path.name + ".pub")
    print(f"private key written to {path} (keep it secret); public key to {public_path}")
    print("add the public key to the approver in the policy file:")
    print(f'public_key = "{encoded}"   # or: public_key_file = "{public_path}"')
    return OK


# ----------------------------------------------------------------------------- parser


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Awaitable[int]]


def _start_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--goal", required=True, metavar="TEXT", help="what the run should achieve")
    p.add_argument("--requested-by", required=True, metavar="NAME", help="who asks (four-eyes: may not approve it)")
    p.add_argument("--playbook", metavar="PATH", help="JSON file of {tool, args} steps (needed by the playbook planner)")
    p.add_argument("--planner", default="playbook", metavar="NAME", help="playbook or model (default: playbook)")
    p.add_argument("--tenant", default="default", metavar="NAME")
    p.add_argument("--id", metavar="RUN", help="run (workflow) id (default: run-<random>)")
    p.add_argument("--allow-id-reuse", action="store_true",
                   help="start even if a finished run had this id (default: refused)")
    p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the request as --requested-by")
    p.add_argument("--approval-ttl", type=float, default=24 * 3600, metavar="SECONDS",
                   help="how long an approval request stays open (default: a day)")
    p.add_argument("--on-expiry", choices=["expire", "replan"], default="expire")
    p.add_argument("--max-steps", type=int, default=20, metavar="N")
    p.add_argument("--max-replans", type=int, default=3, metavar="N")
    p.add_argument("--max-model-tokens", type=int, default=None, metavar="N",
                   help="model tokens the run may use in all (default: no limit)")
    p.add_argument("--on-failure", choices=["stop", "compensate"], default=None,
                   help="when a step fails for good: stop, or undo the ok writes (default: the tenant's, else stop)")
    p.add_argument("--on-cancel", choices=["stop", "compensate"], default=None,
                   help="when the run is cancelled: stop, or undo the ok writes first (default: the tenant's, else stop)")
    p.add_argument("--wait", action="store_true",
                   help="wait until the run needs an approval or has ended; exit 1 if it ended other than COMPLETED")
    p.add_argument("--wait-timeout", type=float, default=60.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true")


def _decision_args(kind: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("run")
        p.add_argument("--by", required=True, metavar="NAME", help="who decides")
        if kind == "reject":
            p.add_argument("--reason", required=True, metavar="TEXT")
        p.add_argument("--plan-hash", metavar="HASH", help="the plan you reviewed (default: the pending one)")
        p.add_argument("--decision-id", metavar="ID", help="unique id of this decision (default: random)")
        p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the decision (see keygen)")
        if kind == "approve":
            p.add_argument("--comment", metavar="TEXT")
    return add


def _handoff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--by", required=True, metavar="NAME", help="a member of the run's tenant")
    p.add_argument("--reason", required=True, metavar="TEXT")
    p.add_argument("--decision-id", metavar="ID", help="unique id of this handoff (default: random)")
    p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the handoff (see keygen)")


def _cancel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--reason", required=True, metavar="TEXT")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--json", action="store_true")


def _timeline_args(p: argparse.ArgumentParser) -> None:
    _run_args(p)
    p.add_argument("--all", action="store_true",
                   help="every record, from the audit sink and the run (the run keeps a window)")
    p.add_argument("--audit-dir", metavar="DIR", help="the worker's audit sink (env TETHER_AUDIT_DIR; default .tether/audit)")


def _tools_args(p: argparse.ArgumentParser) -> None:
    import os

    p.add_argument("--tools", default=os.environ.get("TETHER_TOOLS", "examples.billing.tools"), metavar="MODULES",
                   help="comma-separated tool modules (env TETHER_TOOLS)")
    p.add_argument("--mcp-config", metavar="PATH", help="MCP servers' config (env TETHER_MCP_CONFIG)")


def _compensate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--by", required=True, metavar="NAME", help="who asks: an approver of the run's tenant")
    p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the request (see keygen)")
    p.add_argument("--wait", action="store_true", help="wait until it has ended; exit 1 unless COMPENSATED")
    p.add_argument("--wait-timeout", type=float, default=60.0, metavar="SECONDS")


def _list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state", metavar="STATE", help="e.g. AWAITING_APPROVAL")
    p.add_argument("--tenant", metavar="NAME")
    p.add_argument("--limit", type=int, default=50, metavar="N")
    p.add_argument("--json", action="store_true")


def _keygen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="PATH", help="where to write the private key (PEM)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")


# The one list of subcommands: the parser, `--help` and the README's table come from it.
COMMANDS: list[Command] = [
    Command("start", "start a run", _start_args, cmd_start),
    Command("status", "a run's state, plan, pending approval, and why it ended", _run_args, cmd_status),
    Command("timeline", "a run's audit timeline", _timeline_args, cmd_timeline),
    Command("list", "find runs by state and tenant", _list_args, cmd_list),
    Command("approve", "approve a run's pending plan", _decision_args("approve"), cmd_approve),
    Command("reject", "reject a run's pending plan", _decision_args("reject"), cmd_reject),
    Command("handoff", "hand a run to a human (ends in HANDED_OFF)", _handoff_args, cmd_handoff),
    Command("cancel", "cancel a run (ends in CANCELLED)", _cancel_args, cmd_cancel),
    Command("compensate", "undo an ended run's ok writes, as its approvals covered (a run of its own)",
            _compensate_args, cmd_compensate),
    Command("tools", "the tools a worker serves: source, effect, undo and why", _tools_args, cmd_tools),
    Command("keygen", "make an Ed25519 key pair for signed approvals", _keygen_args, cmd_keygen),
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Tether: governed, durable AI-agent runs on Temporal.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.arguments(p)
        p.set_defaults(fn=command.run)
    return parser


def cli_table(parser: argparse.ArgumentParser | None = None) -> str:
    """The README's CLI table, generated from the parser (tests/test_docs.py keeps them equal)."""
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


# ----------------------------------------------------------------------------- entry points


def _error_line(e: TetherError) -> str:
    if e.field in OPTIONS:
        return f"error: {OPTIONS[e.field]}: {e.detail}"
    return f"error: {e}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(args.fn(args))
    except TetherError as e:
        print(_error_line(e), file=sys.stderr)
        return e.code
    except WorkflowFailureError as e:
        print(f"error: {e}", file=sys.stderr)
        return REFUSED
    except BrokenPipeError:
        # The reader stopped early (`tether timeline RUN | head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug or an unforeseen failure: still one line, the trace on demand
        if os.environ.get("TETHER_DEBUG"):
            raise
        print(f"error: unexpected {type(e).__name__}: {e} (TETHER_DEBUG=1 shows the traceback)", file=sys.stderr)
        return USAGE


def run() -> None:
    """The `tether` console script ([project.scripts] in pyproject.toml)."""
    try:
        code: int | str | None = main()
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        code = e.code
    exit_process(code if isinstance(code, int) or code is None else USAGE)


if __name__ == "__main__":
    run()
