"""The `tether` command: start runs, decide approvals, hand off, cancel, inspect.

    .venv/bin/tether start --goal "Refund A-1001" --playbook examples/billing/refund.playbook.json \\
        --requested-by alice --wait
    .venv/bin/tether status RUN
    .venv/bin/tether approve RUN --by bob
    .venv/bin/tether timeline RUN
    .venv/bin/tether list --state AWAITING_APPROVAL

``python starter.py ...`` runs the same code. The operations themselves live in ``client.py``;
this module only parses arguments and prints. Exit codes: 0 done; 1 the run refused it (or a
waited-for run ended other than COMPLETED, or the person answered no to the plan shown); 2 usage
error (a script's decision naming no plan, too), unknown run, Temporal unreachable.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workflows.display import escape_text as show  # the standard library's alone

if TYPE_CHECKING:
    import client
    import pydantic
    from temporalio import client as temporal
    from workflows import contract, policy, published, run_state, states, wording


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
    client, pydantic, temporal = _OnUse("client"), _OnUse("pydantic"), _OnUse("temporalio.client")
    contract, policy, published = _OnUse("workflows.contract"), _OnUse("workflows.policy"), _OnUse("workflows.published")
    run_state, states, wording = _OnUse("workflows.run_state"), _OnUse("workflows.states"), _OnUse("workflows.wording")

PROG = "tether"
# `tether policy what-if` / `explain`: the judgement log could not be read at all (a missing file,
# no permission, the database down); after 0-3 (client.py), apart from 2 "NEW_POLICY is invalid".
LOG_UNREADABLE = 4
# client.USAGE (argparse's own code too): a usage error is told before anything is imported.
USAGE = 2

# Model fields as the options that set them, so a validation error names what the user typed.
OPTIONS = {
    "goal": "--goal", "tenant": "--tenant", "requested_by": "--requested-by", "planner": "--planner",
    "max_steps": "--max-steps", "max_replans": "--max-replans", "approval_ttl_seconds": "--approval-ttl",
    "on_expiry": "--on-expiry", "max_model_tokens": "--max-model-tokens", "approver": "--by", "by": "--by",
    "decision_id": "--decision-id", "plan_hash": "--plan-hash", "comment": "--comment", "reason": "--reason",
    "state": "--state", "limit": "--limit", "port": "--port", "dev_login": "--dev-login", "jwks": "--jwks",
    "editor": "--by", "steps": "--steps", "on_failure": "--on-failure", "on_cancel": "--on-cancel",
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("tether")
    except PackageNotFoundError:  # `python starter.py` from a checkout that was never installed
        return "(not installed: run `make install`)"


def script_path() -> str:
    """The installed `tether` script next to this Python, relative to the current directory when
    under it (`.venv/bin/tether`): a bare `tether` is on PATH only in an activated virtualenv."""
    script = Path(sys.executable).parent / PROG
    if not script.exists():
        return PROG
    try:
        relative = os.path.relpath(script)
    except ValueError:
        return str(script)
    return relative if not relative.startswith("..") else str(script)


def invoked_as() -> str:
    """The command as the user typed it (`.venv/bin/tether`), for hints that paste; called
    in-process (the demo, `python starter.py`), the installed script."""
    typed = sys.argv[0] if sys.argv else ""
    return typed if os.path.basename(typed) == PROG else script_path()


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


# ----------------------------------------------------------------------------- output


def _print_json(value: object) -> None:
    # ASCII only: every control, bidi and invisible character a sender wrote is a \u escape.
    print(json.dumps(value, indent=2, default=str, ensure_ascii=True))


def _steps(plan: object, tools: Sequence[object] = ()) -> list[str]:
    """Every step of a plan, every argument in full (escaped), money as amount and currency,
    and what the step does in plain words."""
    lines = []
    for v in client.step_views(plan, tools):  # type: ignore[arg-type]
        lines.append(f"  {v.n}. {show(v.tool)}: {v.effect}")
        lines.extend(f"       {client.shown_arg(a)}" for a in v.args)
    return lines


def format_status(s: client.RunStatus) -> str:
    """A run's status for a terminal. Everything a requester, model, tool or signal sender could
    have written (ids, reasons, summaries, arguments, answers) goes through workflows/display.py."""
    lines = [
        f"run        {show(s.run_id)}",
        f"state      {s.state.value} (version {s.state_version}, was "
        f"{s.previous_state.value if s.previous_state else '-'})",
        f"tenant     {show(s.tenant)}",
        f"steps      {s.step} executed, {s.retries} retries",
    ]
    if s.published_at is not None:
        moved = f"; listed as {show(s.listed_state)} since (--live for now)" if s.listed_state else ""
        lines.append(f"view       {client.freshness(s.published_at)}{moved}")
    if s.view_unverified:
        lines.append(f"view       {show(s.view_unverified, 400)} (read live instead)")
    if s.worker_serving is False and s.task_queue is not None:
        lines.append(f"worker     {client.no_worker_message(s.task_queue)}")
    if s.unanswered:
        lines.append(f"worker     {s.unanswered}")
    if s.stuck is not None:
        lines.append(f"stuck      its workflow task keeps failing (attempt {s.stuck.attempt}, {show(s.stuck.cause)}): "
                     f"{show(s.stuck.error, 400)}")
        lines.append(f"           repair:  {invoked_as()} repair {show(shlex.quote(s.run_id))}")
    if s.closed_by_temporal:
        lines.append(f"closed     {s.closed_by_temporal}")
    if s.end_reason and s.state != states.RunState.COMPLETED:
        lines.append(f"why        {show(s.end_reason)}" + (f" [rule: {show(s.end_rule)}]" if s.end_rule else "")
                     + (f" ({show(s.end_actor)})" if s.end_actor else ""))
    if s.approved_by and s.pending_approval is None:  # while pending: the `pending` line counts them
        lines.append(f"approved   by {', '.join(show(a) for a in s.approved_by)}")
    if s.last_error:
        lines.append(f"last error {show(s.last_error)}")
    if s.audit_error:
        lines.append(f"audit      {show(s.audit_error, 600)}")
    if s.policy_problem:
        lines.append(f"policy     {show(s.policy_problem, 600)}")
    if s.last_decision is not None:
        d = s.last_decision
        verdict = d.kind if d.kind != "transition" else d.to_state.value
        lines.append(f"decision   {show(d.refs.decision_id, 128)} by {show(d.actor, 120)}: {verdict}: "
                     f"{show(d.reason, 300)}" + (f" [rule: {d.rule}]" if d.rule else "")
                     + (f" [policies: {show(', '.join(d.refs.policies), 300)}]" if d.refs.policies else ""))
    if s.plan is not None:
        lines.append(f"plan       v{s.plan.version} {show(s.plan.plan_hash)}")
        lines.extend(_steps(s.plan, s.tools))
    for r in s.revisions:
        what = "partial approval" if r.partial else "revised"
        lines.append(f"revision   v{r.version} {what} by {show(r.editor, 128)} at {r.at.isoformat()}: "
                     f"{show(', '.join(r.changed) or '-', 500)} (was {r.previous_plan_hash[:12]})")
    if s.pending_approval is not None:
        p = s.pending_approval
        lines.append(f"pending    {p.risk} risk approval until {p.expires_at.isoformat()}: {client.approvals_needed(p)}")
        if p.request_id:
            lines.append(f"request    {show(p.request_id)}")
        refused = client.approval_offer_problem(s)
        if refused:
            lines.append(f"           approve: not offered: {refused}")
        else:
            lines.append(f"           approve: {invoked_as()} approve {show(shlex.quote(s.run_id))} --by NAME "
                         f"--plan-hash {show(p.plan_hash[:client.HASH_PREFIX])}")
        if p.escalation:
            lines.append(f"escalation stage {p.stage} of {len(p.escalation)}"
                         + (f"; roles {show(', '.join(p.roles), 300)}" if p.roles else ""))
        lines.append(f"           revise:  {invoked_as()} revise {show(shlex.quote(s.run_id))} --by NAME --reason TEXT --step N KEY=VALUE")
    for c in s.compensations:
        # Each ok write and where its undo stands (ids and names, escaped).
        standing = wording.write_standing(c)
        if s.ledger_error and c.tool and c.status == "unknown" and not c.undone_by:
            standing = f"unknown (the ledger cannot be read); undo: {show(c.tool, 64)}"
        lines.append(f"write      {show(c.of, 128)} {show(c.of_tool, 64)}: {standing}")
    if s.ledger_error:
        lines.append(f"ledger     {show(s.ledger_error, 400)}: where each write stands is unknown")
    elif s.ended and s.state in policy.COMPENSABLE_STATES | {states.RunState.COMPLETED} and any(
        c.status != "ok" and c.tool for c in s.compensations
    ):
        approved = " (kept by design: the undos need an approval first)" if s.state == states.RunState.COMPLETED else ""
        lines.append(f"           undo them: {invoked_as()} compensate {show(shlex.quote(s.run_id))} --by NAME{approved}")
    if not s.ledger_error and any(c.status == "unknown" for c in s.compensations):
        lines.append(f"           check the target, then: {invoked_as()} compensate {show(shlex.quote(s.run_id))} "
                     "--by NAME --rerun-unknown STEP")
    if s.answer:
        lines.append(f"answer     {show(s.answer)}")
    return "\n".join(lines)


def format_timeline(records: Sequence[states.TransitionRecord]) -> str:
    lines = []
    for r in records:
        # Hashes shortened for reading; `timeline --json` has them in full.
        refs = ", ".join(
            f"{k}={show(v[:12] if k.endswith('_hash') else ' '.join(v) if k == 'policies' else v)}"
            for k, v in r.refs.model_dump(exclude_none=True).items()
        )
        arrow = (
            f"{r.from_state.value} -> {r.to_state.value}"
            if r.kind == "transition"
            else f"{r.kind.upper()} in {r.from_state.value}"
        )
        lines.append(
            f"v{r.state_version:<3} {r.at.strftime('%H:%M:%S.%f')[:-3]}  {arrow:<42} "
            f"{show(r.actor):<18} {show(r.reason)}" + (f"  [{show(r.rule)}]" if r.rule else "")
            + (f"  [{refs}]" if refs else "")
        )
    return "\n".join(lines)


def format_list(rows: Sequence[client.RunSummary]) -> str:
    if not rows:
        return "no runs match"
    lines = [f"{'RUN':<28} {'STATE':<18} {'TEMPORAL':<11} {'TENANT':<12} {'PUBLISHED':<11} STARTED"]
    for row in rows:
        started = row.started.isoformat() if row.started else "-"
        closed = f"  (closed by Temporal: {row.status})" if row.closed_by_temporal else ""
        lines.append(f"{show(row.run_id):<28} {show(row.state or '-'):<18} {row.status or '-':<11} "
                     f"{show(row.tenant or '-'):<12} {(client.age(row.published_at) + ' ago') if row.published_at else '-':<11} {started}{closed}")
        if row.stuck is not None:
            lines.append(f"  stuck: workflow task attempt {row.stuck.attempt}, {show(row.stuck.cause)}: "
                         f"{show(row.stuck.error, 300)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- commands


# ----------------------------------------------------------------------------- plans from the command line


def parse_edits(edits: Sequence[Sequence[str]]) -> list[tuple[int, str, Any]]:
    """``--step N KEY=VALUE ...`` as (step, key, value); a value that is JSON is taken as JSON
    (``1000``, ``true``, ``"1000"``), anything else as text."""
    out: list[tuple[int, str, Any]] = []
    for edit in edits:
        if len(edit) < 2 or not edit[0].isdigit() or int(edit[0]) < 1:
            raise client.TetherError("--step: expected a step number (1, 2, ...) and KEY=VALUE pairs, e.g. --step 2 amount_cents=1000")
        for pair in edit[1:]:
            key, sep, text = pair.partition("=")
            if not sep or not key:
                raise client.TetherError(f"--step: {pair[:60]!r} is not KEY=VALUE")
            try:
                value: Any = json.loads(text)
            except json.JSONDecodeError:
                value = text
            out.append((int(edit[0]), key, value))
    return out


def load_steps_file(path: Path, what: str = "steps file", model: type[pydantic.BaseModel] | None = None) -> list[Any]:
    """A JSON list of ``{tool, args}`` steps (or ``{"steps": [...]}``), each validated as
    ``model``: a playbook, or (by default) the whole revised plan of ``tether revise --steps-file``."""
    model = model or contract.RevisedStep
    try:
        raw = json.loads(path.read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise client.TetherError(f"{what if what.endswith(' file') else what + ' file'} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise client.TetherError(f"{what} {path} is not valid JSON: {getattr(e, 'msg', e)}") from None
    raw = raw.get("steps") if isinstance(raw, dict) else raw
    if not isinstance(raw, list):
        raise client.TetherError(f"{what} {path} must be a JSON list of {{\"tool\", \"args\"}} steps")
    try:
        return [model.model_validate(s) for s in raw]
    except pydantic.ValidationError as e:
        raise client.invalid(f"{what} {path}", e) from None


def revision_diff(plan: contract.Plan, steps: Sequence[dict[str, Any]]) -> list[str]:
    """What a revision changes, for the person making it: RFC 6902 operations with their values
    (escaped), e.g. ``replace /1/args/amount_cents: 9000 -> 1000``. Never recorded."""
    from workflows.display import escape_text, show_value
    from workflows.revision import patch

    old = [{"tool": s.tool, "args": s.args} for s in plan.steps]
    lines = []
    for op in patch(plan.steps, [contract.RevisedStep.model_validate(s) for s in steps]):
        path = op["path"]
        if op["op"] == "replace":
            before = _pointer(old, path)
            lines.append(f"replace {escape_text(path, 200)}: {show_value(before, 200)} -> {show_value(op['value'], 200)}")
        elif op["op"] == "remove":
            lines.append(f"remove {escape_text(path, 200)}: {show_value(_pointer(old, path), 200)}")
        else:
            lines.append(f"{op['op']} {escape_text(path, 200)}: {show_value(op.get('value', op.get('from')), 200)}")
    return lines


def _pointer(document: Any, path: str) -> Any:
    import jsonpointer

    try:
        return jsonpointer.resolve_pointer(document, path)
    except jsonpointer.JsonPointerException:
        return None


def _load_playbook(path: str | None) -> list[contract.PlaybookStep]:
    return load_steps_file(Path(path), "playbook", contract.PlaybookStep) if path is not None else []


async def cmd_start(args: argparse.Namespace) -> int:
    playbook = _load_playbook(args.playbook)
    if args.planner == "playbook" and not playbook:
        raise client.TetherError("the playbook planner needs steps: pass --playbook PATH")
    try:
        request = run_state.RunRequest(
            goal=args.goal,
            tenant=args.tenant,
            requested_by=args.requested_by,
            planner=args.planner,
            playbook=playbook,
            limits=contract.Limits(
                approval_ttl_seconds=args.approval_ttl,
                on_expiry=args.on_expiry,
                max_steps=args.max_steps,
                max_replans=args.max_replans,
                max_model_tokens=args.max_model_tokens,
            ),
            on_failure=args.on_failure,
            on_cancel=args.on_cancel,
        )
    except pydantic.ValidationError as e:
        raise client.invalid("run request", e) from None
    if (unknown := client.tenant_refusal(request.tenant, client.policy_file())) is not None:
        raise unknown  # a typo'd tenant: nothing started
    run_id = args.id or f"run-{uuid.uuid4().hex[:12]}"
    if args.key:
        request = client.sign_request(request, run_id, Path(args.key))
    conn = await client.connect()
    await client.start_run(conn, request, run_id=run_id, allow_id_reuse=args.allow_id_reuse)
    # The run exists now, whatever follows: say so first (--json --wait prints the status instead).
    if not args.json:
        print(f"started {show(run_id)}", flush=True)
    elif not args.wait:
        _print_json({"run_id": run_id})
    queue = client.task_queue()
    if await client.worker_serving(conn, queue) is False:
        # Started, but nothing will move it: say so now, not after a query times out.
        if args.json and args.wait:
            _print_json({"run_id": run_id})
        print(f"{'error' if args.wait else 'note'}: {client.no_worker_message(queue)}; run {show(run_id)} "
              f"stays in RECEIVED until one does", file=sys.stderr)
        return client.REFUSED if args.wait else client.OK
    if not args.wait:
        return client.OK
    progress = _progress_line(run_id) if sys.stderr.isatty() and not args.json else None
    try:
        status = await client.wait_settled(conn, run_id, args.wait_timeout, progress=progress)
    except client.TetherError as e:
        if e.rule != "no_worker":
            raise
        if args.json:
            _print_json({"run_id": run_id})
        print(_error_line(e), file=sys.stderr)
        return client.REFUSED  # the run was started; the wait for it failed
    finally:
        if progress is not None:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
    if args.json:
        _print_json(status.model_dump(mode="json"))
    else:
        print(format_status(status))
    if status.ended and status.state != states.RunState.COMPLETED:
        why = f": {show(status.end_reason)}" if status.end_reason else ""
        print(f"error: run {show(run_id)} ended in {status.state.value}{why}", file=sys.stderr)
        return client.REFUSED
    if not status.ended and status.state != states.RunState.AWAITING_APPROVAL:
        print(f"note: run {show(run_id)} is still {status.state.value} after {args.wait_timeout:g}s", file=sys.stderr)
    return client.OK


def _progress_line(run_id: str) -> Callable[[object, float], None]:
    """One line on a terminal, rewritten in place while --wait waits."""

    def show_progress(snap: object, seconds: float) -> None:
        state = getattr(getattr(snap, "state", None), "value", "?")
        print(f"\r\x1b[Kwaiting for {show(run_id)}: {state} ({seconds:.0f}s)", end="", file=sys.stderr, flush=True)

    return show_progress


def _step_numbers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        numbers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise client.TetherError(f"--steps: expected step numbers like 1,2, got {text[:60]!r}") from None
    if not numbers:
        raise client.TetherError("--steps: name at least one step")
    return numbers


async def _decide(args: argparse.Namespace, kind: str) -> int:
    """A decision bound to the plan the person saw: the plan hash they name (``--plan-hash``),
    or, on a terminal, the plan shown here and confirmed; ``--unreviewed`` says neither."""
    steps = _step_numbers(getattr(args, "steps", None))
    if args.plan_hash is not None and args.unreviewed:
        raise client.TetherError("--plan-hash and --unreviewed exclude each other: name the plan you reviewed, or say you did not")
    asks = args.plan_hash is None and not args.unreviewed
    if asks and not sys.stdin.isatty():
        raise client.TetherError(
            f"{kind}: name the plan you reviewed with --plan-hash HASH (its first {client.HASH_PREFIX} characters "
            f"will do: `{invoked_as()} status {shlex.quote(args.run)}` prints it), or pass --unreviewed to {kind} "
            f"whatever plan is pending (the run's record says so); on a terminal, tether shows the plan and asks"
        )
    conn = await client.connect()
    snap, pending = await client.pending_request(conn, args.run)
    plan_hash = client.resolve_plan_hash(args.plan_hash, pending.plan_hash)
    shown = plan_hash == pending.plan_hash and snap.plan is not None
    if shown:
        assert snap.plan is not None
        print(f"{kind} plan v{snap.plan.version} {show(plan_hash)} of run {show(args.run)}, request "
              f"{show(pending.request_id)} ({client.approvals_needed(pending)}):")
        for line in _steps(snap.plan, snap.tools):
            print(line)
        if steps:
            dropped = [n for n in range(1, len(snap.plan.steps) + 1) if n not in steps]
            print(f"  only step(s) {', '.join(map(str, steps))}; dropped from the plan: "
                  f"{', '.join(map(str, dropped)) or 'none'}")
    if asks:
        try:
            answer = input(f"{kind.capitalize()} exactly this plan ({plan_hash[:client.HASH_PREFIX]})? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print(f"not sent: nothing was decided on run {show(args.run)}", file=sys.stderr)
            return client.REFUSED
    given = client.DecisionInput(
        by=args.by, plan_hash=plan_hash, request_id=pending.request_id or None, decision_id=args.decision_id,
        comment=getattr(args, "comment", None), reason=getattr(args, "reason", None),
        key=Path(args.key) if args.key else None, steps=steps, unreviewed=args.unreviewed,
    )
    try:
        # The request read above is the one decided: no second read, no second worker probe.
        verdict = await client.decide(conn, args.run, kind, given, held=snap)  # type: ignore[arg-type]
    except client.TetherError as e:
        if e.code != client.PENDING:
            raise
        print(e)  # accepted, not judged yet: not an error, and not a verdict (exit 3)
        return e.code
    code = _print_verdict(verdict)
    if kind == "approve" and verdict.record is not None and verdict.record.kind != "refused":
        await _print_plan_to_run(conn, verdict, plan_hash, steps, snap.tools)
    return code


async def _print_plan_to_run(
    conn: object, verdict: client.Verdict, decided: str, steps: list[int] | None, tools: Sequence[object]
) -> None:
    """The plan the approval lets run: the one shown, or, for --steps, the narrowed one; as the
    run's record of the approval names it, else (a record that does not tell) as the run answers."""
    plan, pending = client.plan_to_run(verdict, steps), None
    if plan is None:
        try:
            after = await client.snapshot(conn, verdict.run_id)  # type: ignore[arg-type]
        except client.TetherError:
            return  # no worker that replays the run answered (another build's did): the verdict above stands
        plan, pending, tools = after.plan, after.pending_approval, after.tools
    if plan is None or plan.plan_hash == decided:
        print(f"the plan that runs is the one shown ({show(decided[:client.HASH_PREFIX])})")
        return
    print(f"the plan that runs: v{plan.version} {show(plan.plan_hash)}"
          + (f" ({client.approvals_needed(pending)})" if pending else "") + ":")
    for line in _steps(plan, tools):
        print(line)


def _print_verdict(verdict: client.Verdict) -> int:
    r = verdict.record
    decision = show(verdict.decision_id)
    if r is None:
        print(f"decision {decision} sent; the run has not recorded it yet "
              f"(check `{invoked_as()} timeline {show(shlex.quote(verdict.run_id))}`)")
    elif r.kind == "accepted":
        print(f"{show(r.reason)} (decision {decision})")
    else:
        print(f"{r.to_state.value}: {show(r.reason)} (decision {decision})")
    return client.OK


async def cmd_approve(args: argparse.Namespace) -> int:
    return await _decide(args, "approve")


async def cmd_revise(args: argparse.Namespace) -> int:
    if bool(args.step) == bool(args.steps_file):
        raise client.TetherError("revise: give --step N KEY=VALUE (repeatable) or --steps-file PATH")
    conn = await client.connect()
    snap, _ = await client.pending_request(conn, args.run)  # read once: the revision is of this request
    assert snap.plan is not None  # a pending request binds a plan (client.held_request)
    steps = (
        [s.model_dump() for s in load_steps_file(Path(args.steps_file))] if args.steps_file
        else client.revised_steps(snap.plan, parse_edits(args.step))
    )
    given = client.DecisionInput(
        by=args.by, plan_hash=args.plan_hash, decision_id=args.decision_id, reason=args.reason,
        key=Path(args.key) if args.key else None,
    )
    # The person sees the values they change; the run records only the paths.
    print(f"revising plan v{snap.plan.version} {snap.plan.plan_hash} of run {args.run}:")
    for line in revision_diff(snap.plan, steps) or ["(no change)"]:
        print(f"  {line}")
    verdict = await client.revise(conn, args.run, given, steps, held=snap)
    return _print_verdict(verdict)


async def cmd_reject(args: argparse.Namespace) -> int:
    return await _decide(args, "reject")


async def cmd_handoff(args: argparse.Namespace) -> int:
    verdict = await client.handoff(
        await client.connect(), args.run, by=args.by, reason=args.reason, decision_id=args.decision_id,
        key=Path(args.key) if args.key else None, force=args.force,
    )
    if (done := verdict.reset) is not None:
        if done.failure is not None:
            print(f"run {show(done.run_id)} was stuck: workflow task attempt {done.failure.attempt} failing since event "
                  f"{done.failure.event_id} ({show(done.failure.cause)}): {show(done.failure.error, 400)}")
        print(f"reset run {show(done.from_run_id)} to the workflow task completed at event {done.event_id}, the "
              f"hand-off applied again: new run {show(done.to_run_id)}")
        print(f"in flight, may have applied, not run again: {', '.join(show(t) for t in done.in_flight) or 'none'}")
    return _print_verdict(verdict)


async def cmd_cancel(args: argparse.Namespace) -> int:
    client.person_name(args.by)  # a usage error before connecting
    done = await client.cancel(await client.connect(), args.run, reason=args.reason, by=args.by,
                               key=Path(args.key) if args.key else None)
    print(f"{done.state.value}: {show(done.reason)} (decision {show(done.decision_id)})")
    return client.OK


async def cmd_repair(args: argparse.Namespace) -> int:
    done = await client.repair(
        await client.connect(), args.run, reason=args.reason, event_id=args.event_id,
    )
    if args.json:
        _print_json(done.model_dump(mode="json"))
        return client.OK
    if done.failure is not None:
        print(f"run {show(done.run_id)} was stuck: workflow task attempt {done.failure.attempt} failing since event "
              f"{done.failure.event_id} ({show(done.failure.cause)}): {show(done.failure.error, 400)}")
    if done.skipped:
        print(f"later completed tasks that do not replay on this code: events {', '.join(map(str, done.skipped))}")
    print(f"reset run {show(done.from_run_id)} to the workflow task completed at event {done.event_id}: "
          f"new run {show(done.to_run_id)}")
    print(f"signals and Updates applied again: {done.reapplied}; tool calls run again under their own "
          f"idempotency keys: {', '.join(show(t) for t in done.rerun) or 'none'}")
    print(f"follow it: {invoked_as()} status {show(shlex.quote(done.run_id))}")
    return client.OK


async def cmd_status(args: argparse.Namespace) -> int:
    status = await client.status(await client.connect(), args.run, live=args.live)
    if args.json:
        _print_json(status.model_dump(mode="json"))
    else:
        print(format_status(status))
    return client.OK


def format_branch(b: client.AuditBranch) -> str:
    """The header of one execution's records in `timeline --all`."""
    what = f"run {b.run_id}"
    if b.origin == "reset":
        by = f", by {show(b.identity, 120)}" if b.identity else ""
        why = show(b.reason, 200) if b.reason else "no reason given"
        what = f"reset at seq {b.at_seq} ({why}{by}) of run {b.parent_run_id}: {what}"
    elif b.origin == "continued":
        what = f"continued as new after seq {b.at_seq} from run {b.parent_run_id}: {what}"
    elif b.origin == "first":
        what += " (first run)"
    tags = [t for t in (b.status and b.status.lower(), "current" if b.current else None) if t]
    return f"== {what}" + (f" [{', '.join(tags)}]" if tags else "")


def audit_warnings(trail: client.AuditTrail) -> list[str]:
    """What `timeline --all` must not hide: a sink that lacks records, a sink that fails."""
    warnings = []
    if trail.unchecked:
        warnings.append(f"{trail.unchecked}; whether it holds every record was not checked")
    if trail.audit_error:
        warnings.append(f"the run cannot write to its audit sink: {show(trail.audit_error, 400)}")
    if trail.missing:
        shown = ", ".join(map(str, trail.missing[:10])) + (" ..." if len(trail.missing) > 10 else "")
        warnings.append(
            f"the audit sink ({trail.sink}) holds {trail.written - trail.waiting - len(trail.missing)} of the "
            f"{trail.written - trail.waiting} records the run wrote; missing seq {shown} (is this the workers' "
            f"TETHER_AUDIT_DIR / TETHER_AUDIT_DSN?"
            + (" A run that has just ended leaves its last records to the workers' audit collector: "
               "if a worker is running, try again in a moment)" if trail.closed else ")")
        )
    if trail.waiting:
        warnings.append(f"{trail.waiting} record(s) not yet written to the sink by the run")
    if trail.unverified:
        warnings.append(f"{len(trail.unverified)} record(s) in the audit sink are not the fleet's (signature or "
                        f"chain); the first: {show(trail.unverified[0], 400)} (tether audit verify {show(trail.workflow_id)})")
    return warnings


async def _undone_later(conn: Any, run_id: str) -> str:
    """After an ended run's own records: what compensation runs did to its writes since (the undo
    ledger's word), each naming the run, so the timeline links them."""
    try:
        status = await client.status(conn, run_id)
    except client.TetherError:
        return ""
    return "".join(
        f"later      {show(c.of, 128)} {show(c.of_tool, 64)}: {wording.write_standing(c)}\n"
        for c in status.compensations if c.undone_by
    )


async def cmd_timeline(args: argparse.Namespace) -> int:
    conn = await client.connect()
    if args.live:
        await client.require_worker(conn, args.run)
        records = await client.timeline(conn, args.run)
        if args.json:
            _print_json([r.model_dump(mode="json") for r in records])
        else:
            print(format_timeline(records))
        return client.OK
    trail = await client.audit_trail(conn, args.run, args.audit_dir)
    if not args.all:
        # The run's line from the audit sink, the published view filling what it lacks: no
        # worker needed, nothing reaches the run.
        records = trail.line()
        if not records and trail.unchecked:
            raise client.TetherError(trail.unchecked)  # it has published nothing, and nobody can ask it
        if args.json:
            _print_json([r.model_dump(mode="json") for r in records])
        else:
            print(format_timeline(records))
            print(await _undone_later(conn, args.run), end="")
        if trail.published_at is not None:
            print(f"note: the run's own records {client.freshness(trail.published_at)}; the audit sink's "
                  f"as of now", file=sys.stderr)
        for warning in audit_warnings(trail):
            print(f"warning: {warning}", file=sys.stderr)
        return client.OK
    if args.json:
        _print_json(trail.model_dump(mode="json"))
    else:
        for branch in trail.branches:
            print(format_branch(branch))
            if branch.records:
                print(format_timeline(branch.records))
    warnings = audit_warnings(trail)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return client.REFUSED if trail.missing or trail.audit_error or trail.unverified else client.OK


async def cmd_audit(args: argparse.Namespace) -> int:
    """`tether audit verify RUN | --all`: every record in the audit sink, its signature and its
    chain link, with the public keys alone; names the first that fails and exits 1."""
    from activities.audit import sink_from_env, verify_streams

    if bool(args.run) == bool(args.all):
        raise client.TetherError("name one run, or --all", USAGE)
    publics = client.public_keys()
    sink = sink_from_env(args.audit_dir)
    try:
        ids = [args.run] if args.run else await sink.workflow_ids()
        checked, bad = 0, 0
        for workflow_id in ids:
            streams = await sink.read(workflow_id)
            if args.run and not streams:
                raise client.TetherError(f"unknown run {args.run!r}: the audit sink ({sink.describe()}) holds no record of it",
                                         USAGE, rule="unknown_run")
            check = verify_streams(publics, workflow_id, streams)
            checked += check.records
            if check.problems:
                bad += 1
                print(f"{show(workflow_id)}: {len(check.problems)} problem(s); first: {show(check.problems[0], 400)}")
    finally:
        await sink.aclose()
    print(f"{checked} record(s) of {len(ids)} run(s) checked against {show(publics.source)}: "
          + (f"{bad} run(s) with records that are not the fleet's" if bad else "every signature and chain link verifies"))
    return client.REFUSED if bad else client.OK


def _audit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["verify"], help="verify: signatures and chain links of the sink's records")
    p.add_argument("run", nargs="?", help="the run (workflow id); or --all")
    p.add_argument("--all", action="store_true", help="every run the audit sink holds")
    p.add_argument("--audit-dir", metavar="DIR", help="the workers' audit sink (env TETHER_AUDIT_DIR / TETHER_AUDIT_DSN)")


async def cmd_tools(args: argparse.Namespace) -> int:
    """The tools a worker with these options would serve, with each one's effect and why."""
    from activities import mcp
    from activities.loading import LoadError
    from activities.tools import REGISTRY, load_tool_modules

    modules = [m for m in args.tools.split(",") if m.strip()]
    try:
        config = mcp.config_from_env(args.mcp_config)
    except mcp.McpConfigError as e:
        raise client.TetherError(f"invalid MCP config: {e}", USAGE) from None
    try:  # resolved as the worker resolves them (activities/loading.py)
        registry = load_tool_modules(modules, REGISTRY)
    except LoadError as e:
        raise client.TetherError(str(e), USAGE) from None
    if config is None:
        print(mcp.format_tools(mcp.describe_tools(registry)))
        return client.OK
    return await mcp.print_tools(config, modules)


async def cmd_compensate(args: argparse.Namespace) -> int:
    conn = await client.connect()
    policy_path = args.policy or os.environ.get("TETHER_POLICY") or None
    handle = await client.compensate(
        conn, args.run, by=args.by, key=Path(args.key) if args.key else None, rerun_unknown=args.rerun_unknown or (),
        policy_path=Path(policy_path) if policy_path else None,
    )
    print(f"started {show(handle.id)}: the compensation of {show(args.run)}")
    if not args.wait:
        return client.OK
    status = await client.wait_settled(conn, handle.id, args.wait_timeout)
    print(format_status(status))
    if status.state == states.RunState.COMPENSATED:
        return client.OK  # the undos are done
    if status.ended:
        why = f": {show(status.end_reason)}" if status.end_reason else ""
        print(f"error: compensation {show(handle.id)} ended in {status.state.value}{why}", file=sys.stderr)
        return client.REFUSED
    pending = status.pending_approval
    if status.state == states.RunState.AWAITING_APPROVAL and pending is not None:
        waits = (f"its approval ({client.approvals_needed(pending)}; request expires "
                 f"{pending.expires_at.isoformat(timespec='seconds')}): "
                 f"{invoked_as()} approve {show(shlex.quote(handle.id))} --by NAME")
    else:
        waits = f"{status.state.value} after {args.wait_timeout:g}s"
    print(f"error: compensation {show(handle.id)} is not done, nothing is undone yet; it waits on {waits}", file=sys.stderr)
    return client.PENDING


async def cmd_list(args: argparse.Namespace) -> int:
    client.list_query(args.state, args.tenant)  # bad filters are usage errors, before connecting
    rows = await client.list_runs(
        await client.connect(), state=args.state, tenant=args.tenant, limit=args.limit, stuck=args.stuck
    )
    if args.json:
        _print_json([r.model_dump(mode="json") for r in rows])
    else:
        print(format_list(rows))
    return client.OK


async def cmd_drain(args: argparse.Namespace) -> int:
    conn = await client.connect()
    rows = await client.drain(conn)
    deployment = os.environ.get(client.DEPLOYMENT_ENV) or None
    state = await client.deployment_status(conn, client.deployment_name(deployment)) if deployment else None
    waiting = bool(rows) or (state is not None and any(not v.retirable and not v.routed for v in state.versions))
    if args.json:
        if state is None:
            _print_json([r.model_dump(mode="json") for r in rows])
        else:  # the deployment's builds, and the older builds' runs (`runs`)
            _print_json({**state.model_dump(mode="json"), "runs": [r.model_dump(mode="json") for r in rows]})
        return client.REFUSED if waiting else client.OK
    if state is not None:
        print(f"Worker Deployment {show(state.deployment)}: new runs start on {show(state.current or 'unversioned workers')}"
              + (f", {state.ramp_percent:g}% on {show(state.ramping)}" if state.ramping else ""))
        for v in state.versions:
            what = ("new runs start here" if v.routed else "can be retired: stop its workers" if v.retirable
                    else "keep its workers until its runs end")
            print(f"  {show(v.build)}  {v.status}  {v.open_runs} open run(s): {what}")
        if state.unversioned_runs:
            print(f"  unversioned  {state.unversioned_runs} open run(s) in the namespace no versioned worker has taken yet")
    if not rows:
        print(f"no open run needs an older build than {published.BUILD}: its workers can be stopped")
    else:
        print(f"{len(rows)} open run(s) started by a build older than {published.BUILD}: keep its workers until they end")
        print(format_list(rows))
    return client.REFUSED if waiting else client.OK


async def cmd_keygen(args: argparse.Namespace) -> int:
    path = Path(args.out)
    if args.if_missing and path.exists():
        print(f"{path} exists: kept")
        return client.OK
    encoded = client.keygen(path, force=args.force)
    public_path = path.with_name(path.name + ".pub")
    print(f"private key written to {path} (keep it secret); public key to {public_path}")
    print("add the public key to the approver in the policy file:")
    print(f'public_key = "{encoded}"   # or: public_key_file = "{public_path}"')
    return client.OK


async def cmd_policy(args: argparse.Namespace) -> int:
    """Cedar (docs/policy.md, "Cedar"): export a policy file's rules, validate a file, explain a
    run's decisions, judge recorded decisions under a proposed policy."""
    from activities import cedar
    from activities.policy_file import validate_file

    if args.action != "show" and not args.target:
        raise client.TetherError(f"`tether policy {args.action}` needs its TARGET (see `tether policy --help`)", USAGE)
    if args.action == "validate":
        problems, checked = validate_file(Path(args.target))
        for problem in problems:
            print(show(problem), file=sys.stderr)
        if problems:
            print(f"{len(problems)} problem(s): fix them and validate again (the schema: "
                  f"activities/tether.cedarschema)", file=sys.stderr)
            return USAGE
        print(f"{show(args.target)}: {checked}")
        return client.OK
    if args.action == "export":
        from activities.policy_file import PolicyFileError, parse_policy

        path = Path(args.target)
        try:
            document = parse_policy(path.read_text(), str(path))
        except OSError as e:
            raise client.TetherError(f"{path}: cannot read it ({e.strerror})", USAGE) from None
        except PolicyFileError as e:
            raise client.TetherError(f"{e}; `tether policy validate {path}` lists every problem", USAGE) from None
        text = cedar.export_document(document)
        if args.out:
            Path(args.out).write_text(text)
            print(f"{len(document.tenants)} tenant(s) exported to {show(args.out)}; validate it with "
                  f"`tether policy validate {show(args.out)}`")
        else:
            sys.stdout.write(text)
        return client.OK
    if args.action == "explain":
        from activities.judgements import log_from_env

        log = log_from_env(args.audit_dir)
        found = read_judgements(log, workflow_id=args.target)
        if not found:
            raise client.TetherError(
                f"no judgement of run {args.target} in {log.describe()}: the run made no decision or write yet, or its "
                "worker logs elsewhere (--audit-dir, env TETHER_AUDIT_DIR or TETHER_AUDIT_DSN)", USAGE)
        print(f"run {show(args.target)}: {len(found)} Cedar judgement(s), from {show(log.describe())}")
        for entry in found:
            print("\n".join(format_judgement(entry)))
        return client.OK
    if args.action == "what-if":
        return what_if(args)
    if args.action == "show":
        return await show_policy(args)
    raise client.TetherError(f"unknown policy action {args.action!r}", USAGE)


async def show_policy(args: argparse.Namespace) -> int:
    """`tether policy show [--policy FILE] [--run RUN]`: the file a process would read, its hash and
    tenants; with --run, the hash the run recorded at its start and whether it is this file's
    (exit 1 when it is not: the run was judged under another policy file)."""
    from activities.policy_file import PolicyFileError, PolicyStore
    from inbox.desk import recorded_policy_hash

    chosen = args.policy or args.target or os.environ.get("TETHER_POLICY") or None
    store = PolicyStore(Path(chosen) if chosen else None)
    try:
        document, digest = store.load()
    except (PolicyFileError, OSError) as e:
        raise client.TetherError(f"{e}; `tether policy validate {chosen}` lists every problem", USAGE) from None
    print(f"policy  {show(store.source)}")
    print(f"hash    {digest}")
    for name, tenant in sorted((document.tenants if document else {}).items()):
        people = ", ".join(sorted(tenant.approvers)) if tenant.approvers is not None else "anyone"
        own = f"; own Cedar: {', '.join(tenant.cedar)}" if tenant.cedar else ""
        print(show(f"tenant  {name}: approvers {people}; approval roles {', '.join(tenant.approval_roles)}{own}", 600))
    if not args.run:
        return client.OK
    temporal = await client.connect()
    _, records = await client.read_run(temporal, args.run)
    recorded = recorded_policy_hash(records) or recorded_policy_hash(await client.timeline(temporal, args.run))
    if recorded is None:
        raise client.TetherError(f"run {args.run} has recorded no policy hash yet (it records one when its worker takes "
                          "it): try again in a moment", USAGE)
    same = recorded == digest
    print(f"run     {show(args.run)}: policy hash {recorded} (recorded at its start): "
          + ("the same file" if same else "ANOTHER policy than this file: it was judged by the worker's file, "
             "not this one (`tether policy show --policy FILE` on the worker's file names it)"))
    return client.OK if same else client.REFUSED


def what_if(args: argparse.Namespace) -> int:
    """`tether policy what-if NEW_POLICY`: every logged judgement judged again under NEW_POLICY;
    exit 0 when none changes, 1 when some do (each printed), 2 when NEW_POLICY is invalid."""
    from datetime import datetime, timedelta, timezone

    from activities.judgements import ProposedPolicy, log_from_env, what_if as judge_again
    from workflows.policy_file import parse_duration

    since = None
    if args.since:
        try:
            since = datetime.now(timezone.utc) - timedelta(seconds=float(parse_duration(args.since)))
        except (ValueError, TypeError) as e:
            raise client.TetherError(f"--since {args.since!r}: {e}", USAGE) from None
    try:
        proposed = ProposedPolicy(Path(args.target))
    except ValueError as e:
        for problem in str(e).splitlines():
            print(show(problem), file=sys.stderr)
        print("the proposed policy is invalid: fix it, then run what-if again", file=sys.stderr)
        return USAGE
    log = log_from_env(args.audit_dir)
    recorded = read_judgements(log, since=since, tenant=args.tenant)
    changes = judge_again(recorded, proposed)
    runs = {e.get("workflow_id") for e in recorded}
    for change in changes:
        e = change.entry
        who = f" by {e['person']}" if e.get("person") else ""
        step = e.get("request", {}).get("resource", {})
        what = f" step {step.get('id')}" if isinstance(step, dict) and step.get("type", "").endswith("Step") else ""
        amounts = _step_amounts(e)
        was = "allowed" if e.get("allowed") else f"refused ({e.get('rule')})"
        now = "allowed" if change.allowed else f"refused ({change.rule})"
        by = ", ".join(change.policies) or "no policy"
        print(show(f"{e.get('workflow_id')} {e.get('at', '')[:19]} {e.get('check')} {e.get('action')}{who}{what}"
                   f"{' (' + amounts + ')' if amounts else ''}: {was} -> {now} by {by}: {change.meaning}", 600))
    print(f"{len(changes)} of {len(recorded)} judgement(s) of {len(runs)} run(s) change under {show(args.target)}"
          + ("" if recorded else f" (none logged in {show(log.describe())}{' since ' + args.since if args.since else ''})"))
    return client.REFUSED if changes else client.OK


def read_judgements(log: Any, **filters: Any) -> list[dict[str, Any]]:
    """The judgement log's signed judgement lines (explain, what-if): the lines of another shape
    and those the fleet did not sign are skipped and counted on stderr (they change no exit code);
    a log that cannot be read at all is exit LOG_UNREADABLE, apart from "NEW_POLICY is invalid"."""
    from activities.judgements import LogUnreadable

    try:
        found = log.read(publics=client.public_keys(), **filters)
    except LogUnreadable as e:
        raise client.TetherError(f"could not read the judgement log: {e}; point at the workers' log with --audit-dir, "
                          "env TETHER_AUDIT_DIR or TETHER_AUDIT_DSN", LOG_UNREADABLE) from None
    if log.skipped:
        print(f"warning: {show(log.describe())}: {log.skipped} line(s) skipped: not a judgement line", file=sys.stderr)
    if log.unverified:
        print(f"warning: {log.unverified} line(s) of {show(log.describe())} are not signed by the fleet: "
              f"skipped", file=sys.stderr)
    return found


def _step_amounts(entry: dict[str, Any]) -> str:
    """The tool and amounts of the step a runtime judgement was on (``issue_refund amount_cents=12500.0``)."""
    resource = entry.get("request", {}).get("resource")
    if not isinstance(resource, dict) or not str(resource.get("type", "")).endswith("Step"):
        return ""
    step = next((e for e in entry.get("entities", []) if e.get("uid") == resource), {})
    tool = step.get("attrs", {}).get("tool") if isinstance(step.get("attrs"), dict) else None
    return " ".join(str(w) for w in (tool, _amount_words(step)) if w)


def _attr_value(v: Any) -> str:
    """An entity attribute's value as explain shows it: an entity by its id, a decimal by its text."""
    if isinstance(v, dict) and "__entity" in v:
        return str(v["__entity"].get("id", ""))
    if isinstance(v, dict) and "__extn" in v:
        return str(v["__extn"].get("arg", ""))
    if isinstance(v, list):
        return "[" + ", ".join(_attr_value(x) for x in v) + "]"
    return json.dumps(v) if isinstance(v, bool) else str(v)


def _amount_words(entity: dict[str, Any]) -> str:
    """A step's amounts (its tags: the run's sums per numeric argument): ``amount_cents=12500.0``."""
    tags = entity.get("tags")
    return " ".join(f"{k}={_attr_value(v)}" for k, v in tags.items()) if isinstance(tags, dict) else ""


def _entity_words(entity: dict[str, Any]) -> str:
    """One entity as `tether policy explain` shows it: its uid, attributes, groups and amounts."""
    uid = entity.get("uid", {})
    attrs = " ".join(f"{k}={_attr_value(v)}" for k, v in entity.get("attrs", {}).items())
    parents = ", ".join(f"{p.get('type', '').split('::')[-1]}:{p.get('id', '')}" for p in entity.get("parents", []))
    tags = _amount_words(entity)
    words = f"{uid.get('type', '')}::{json.dumps(uid.get('id', ''), ensure_ascii=False)} {attrs}".rstrip()
    words += f"; in {parents}" if parents else ""
    words += f"; amounts {tags}" if tags else ""
    return show(words, 600)


def format_judgement(entry: dict[str, Any]) -> list[str]:
    """A logged Cedar judgement: what was decided, by which policies, on which entity data."""
    from activities.judgements import error_words

    request = entry.get("request", {})
    by = ", ".join(entry.get("policies", [])) or "no policy"
    verdict = f"allowed by {by}" if entry.get("allowed") else f"refused ({entry.get('rule')}) by {by}"
    entities = {json.dumps(e.get("uid"), sort_keys=True): e for e in entry.get("entities", [])}
    resource = entities.get(json.dumps(request.get("resource"), sort_keys=True), {})
    tool = resource.get("attrs", {}).get("tool")
    who = f" by {entry['person']}" if entry.get("person") else f" {tool} (step {resource['uid']['id']})" if tool else ""
    head = f"{entry.get('at', '')[:19]} {entry.get('check', '')} {entry.get('action', '')}{who}: {verdict}"
    lines = [show(head, 400)]
    # Cedar skips a policy whose condition errors (an overflow, a missing attribute): say so.
    outcome = f"refused: {entry.get('rule')}" if not entry.get("allowed") else "allowed without it"
    for error in entry.get("errors", []):
        policy_id, what = error_words(str(error))
        lines.append("  " + show(f"policy {policy_id} errored: {what}; {outcome}", 400))
    for role in ("principal", "resource"):
        uid = request.get(role)
        entity = entities.get(json.dumps(uid, sort_keys=True)) if isinstance(uid, dict) else None
        if entity is not None:
            lines.append(f"  {role:9} {_entity_words(entity)}")
        if role == "resource" and entity is not None:
            for key in ("requester",):
                ref = entity.get("attrs", {}).get(key, {})
                other = entities.get(json.dumps(ref.get("__entity"), sort_keys=True)) if isinstance(ref, dict) else None
                if other is not None and other is not entities.get(json.dumps(request.get("principal"), sort_keys=True)):
                    lines.append(f"  {key:9} {_entity_words(other)}")
    return lines


async def cmd_inbox(args: argparse.Namespace) -> int:
    from inbox.app import InboxConfig, serve

    if args.port < 1 or args.port > 65535:
        raise client.TetherError(f"--port must be 1-65535, not {args.port}", field="port")
    config = InboxConfig(
        policy=Path(args.policy or os.environ.get("TETHER_POLICY") or "examples/billing/policy.toml"),
        dev_login=args.dev_login,
        jwks=args.jwks,
        issuer=args.issuer,
        audience=args.audience,
        claim=args.claim,
        header=args.header or None,
        key=Path(args.key),
        web_ui=args.web_ui,
        namespace=client.connect_config()["namespace"],
        host=args.host,
    )
    return await serve(config, args.port)


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
    p.add_argument("--planner", default="playbook", metavar="NAME", help="playbook, model, or one the worker is configured with (default: playbook)")
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
        p.add_argument("--plan-hash", metavar="HASH", help="the plan you reviewed (its first 12 characters will "
                       "do); without it, a terminal shows the pending plan and asks")
        p.add_argument("--unreviewed", action="store_true", help="decide whatever plan is pending, unseen (scripts; "
                       "the run's record says so)")
        p.add_argument("--decision-id", metavar="ID", help="unique id of this decision (default: random)")
        p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the decision (see keygen)")
        if kind == "approve":
            p.add_argument("--comment", metavar="TEXT")
            p.add_argument("--steps", metavar="N,N", help="approve only these steps (1-based, e.g. 1,2); the rest "
                           "are dropped from the plan (default: all)")
    return add


def _revise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--by", required=True, metavar="NAME", help="who revises (someone who may approve)")
    p.add_argument("--reason", required=True, metavar="TEXT")
    p.add_argument("--step", nargs="+", action="append", metavar="N K=V",
                   help="set arguments of step N (1-based); repeatable; JSON values (1000, true) or text")
    p.add_argument("--steps-file", metavar="F", help="the whole revised plan: a JSON list of {tool, args}")
    p.add_argument("--plan-hash", metavar="HASH", help="the plan you reviewed (default: the pending one)")
    p.add_argument("--decision-id", metavar="ID", help="unique id of this revision (default: random)")
    p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the revision (see keygen)")


def _handoff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--by", required=True, metavar="NAME", help="a member of the run's tenant")
    p.add_argument("--reason", required=True, metavar="TEXT")
    p.add_argument("--decision-id", metavar="ID", help="unique id of this handoff (default: random)")
    p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the handoff (see keygen)")
    p.add_argument("--force", action="store_true",
                   help="a stuck run (its workflow tasks keep failing): reset it with the hand-off to its last task "
                        "that replays; writes in flight are named on the record, never run again")


def _cancel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--by", required=True, metavar="NAME", help="who cancels: a member of the run's tenant (on the record)")
    p.add_argument("--reason", required=True, metavar="TEXT")
    p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the cancel (where the tenant requires it)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--json", action="store_true")


def _status_args(p: argparse.ArgumentParser) -> None:
    _run_args(p)
    p.add_argument("--live", action="store_true",
                   help="ask the run itself (a query, through a worker) instead of reading what it published")


def _timeline_args(p: argparse.ArgumentParser) -> None:
    _status_args(p)
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
    p.add_argument("--policy", metavar="PATH",
                   help="the policy file, to refuse a name it does not let compensate before starting (default TETHER_POLICY)")
    p.add_argument("--rerun-unknown", action="append", metavar="STEP",
                   help="run again the unsafe undo of this step (tool call id) that may have applied (repeatable)")
    p.add_argument("--wait", action="store_true",
                   help="wait until its undos are done (0); ended otherwise: 1; still waiting (its approval): 3")
    p.add_argument("--wait-timeout", type=float, default=60.0, metavar="SECONDS")


def _list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state", metavar="STATE", help="e.g. AWAITING_APPROVAL")
    p.add_argument("--tenant", metavar="NAME")
    p.add_argument("--limit", type=int, default=50, metavar="N")
    p.add_argument("--stuck", action="store_true",
                   help="only running runs whose workflow task keeps failing, with the error")
    p.add_argument("--json", action="store_true")


def _repair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--reason", metavar="TEXT", help="recorded with the reset (default: the failure's cause)")
    p.add_argument("--event-id", type=int, metavar="N",
                   help="reset to this completed workflow task (default: the last before the failure that replays)")
    p.add_argument("--json", action="store_true")


def _drain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")


def _keygen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="PATH", help="where to write the private key (PEM)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument("--if-missing", action="store_true", help="keep an existing key (exit 0), else make one")


def _policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["export", "validate", "show", "explain", "what-if"],
                   help="export: a policy file's rules as Cedar; validate: a policy file or .cedar file "
                   "against the schema (exit 2 naming file, line and problem); show: a policy file, its hash "
                   "and tenants (--run: is it the one the run recorded; exit 1 when not); explain: a run's "
                   "judgements, the policies that decided each, their errors and the entity data; what-if: every "
                   "logged judgement judged again under a proposed policy (exit 0 no change, 1 changes, 2 invalid, "
                   "4 the judgement log could not be read; lines of another shape are skipped and counted)")
    p.add_argument("target", metavar="TARGET", nargs="?",
                   help="the policy file (TOML) or a .cedar file; explain: the run; what-if: the proposed policy; "
                   "show: the policy file (or --policy)")
    p.add_argument("--policy", metavar="PATH", help="show: the policy file (default TETHER_POLICY)")
    p.add_argument("--run", metavar="RUN", help="show: compare with the policy hash this run recorded")
    p.add_argument("--out", metavar="PATH", help="export: write the Cedar here instead of printing it")
    p.add_argument("--since", metavar="AGE", help="what-if: only judgements this recent (\"7d\", \"12h\")")
    p.add_argument("--tenant", metavar="NAME", help="what-if: only this tenant's judgements")
    p.add_argument("--audit-dir", metavar="DIR",
                   help="explain, what-if: where workers log judgements (env TETHER_AUDIT_DIR; default .tether/audit)")


def _inbox_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", required=True, type=int, metavar="PORT", help="port to serve on")
    p.add_argument("--host", default="127.0.0.1", metavar="HOST", help="address to bind (default 127.0.0.1)")
    p.add_argument("--dev-login", action="store_true",
                   help="a sign-in page listing the policy's people (only on 127.0.0.1; not for production)")
    p.add_argument("--jwks", default=os.environ.get("TETHER_INBOX_JWKS") or None, metavar="JWKS",
                   help="the sign-in layer's JWKS, a file or an https URL: JWTs are verified against it (env TETHER_INBOX_JWKS)")
    p.add_argument("--issuer", default=os.environ.get("TETHER_INBOX_ISSUER") or None, metavar="ISS",
                   help="the JWTs' required iss (env TETHER_INBOX_ISSUER)")
    p.add_argument("--audience", default=os.environ.get("TETHER_INBOX_AUDIENCE") or None, metavar="AUD",
                   help="the JWTs' required aud (env TETHER_INBOX_AUDIENCE)")
    p.add_argument("--claim", default="preferred_username", metavar="CLAIM",
                   help="the claim naming the person as the policy file does (default preferred_username)")
    p.add_argument("--header", default="X-Forwarded-Assertion", metavar="NAME",
                   help="an identity-aware proxy's assertion header (default X-Forwarded-Assertion; '' for none)")
    p.add_argument("--policy", metavar="PATH", help="the policy file (default TETHER_POLICY, else the example's)")
    p.add_argument("--key", default=os.environ.get("TETHER_INBOX_KEY") or ".tether/keys/inbox.pem", metavar="PEM",
                   help="the inbox's Ed25519 key: it signs what it verified (policy [signers.NAME])")
    p.add_argument("--web-ui", default=os.environ.get("TETHER_WEB_UI", "http://localhost:8233"), metavar="URL",
                   help="the Temporal Web UI, for links to runs")


# The one list of subcommands: the parser, `--help` and the README's table come from it.
COMMANDS: list[Command] = [
    Command("start", "start a run", _start_args, cmd_start),
    Command("status", "a run's state, plan, approval, why it ended", _status_args, cmd_status),
    Command("timeline", "a run's audit timeline", _timeline_args, cmd_timeline),
    Command("list", "find runs by state and tenant", _list_args, cmd_list),
    Command("audit", "check the audit sink's signatures and chain", _audit_args, cmd_audit),
    Command("approve", "approve a run's pending plan", _decision_args("approve"), cmd_approve),
    Command("reject", "reject a run's pending plan", _decision_args("reject"), cmd_reject),
    Command("revise", "revise a run's pending plan", _revise_args, cmd_revise),
    Command("handoff", "hand a run to a human: HANDED_OFF", _handoff_args, cmd_handoff),
    Command("cancel", "cancel a run (ends in CANCELLED)", _cancel_args, cmd_cancel),
    Command("repair", "reset a stuck run to its last task that replays",
            _repair_args, cmd_repair),
    Command("compensate", "undo an ended run's kept writes",
            _compensate_args, cmd_compensate),
    Command("drain", "runs an older worker build still holds (exit 1 while any)", _drain_args, cmd_drain),
    Command("tools", "a worker's tools: source, effect, undo", _tools_args, cmd_tools),
    Command("keygen", "make an Ed25519 key pair for signed approvals", _keygen_args, cmd_keygen),
    Command("inbox", "serve the approvers' web inbox (docs/inbox.md)", _inbox_args, cmd_inbox),
    Command("policy", "Cedar: export, validate, explain, what-if", _policy_args, cmd_policy),
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Tether: governed, durable AI-agent runs on Temporal.")
    parser.add_argument("--version", action="version", version=f"{PROG} {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.arguments(p)
        p.set_defaults(fn=command.run)
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


# ----------------------------------------------------------------------------- entry points


def _error_line(e: client.TetherError) -> str:
    # Errors quote what the run or the user sent (reasons, ids): one escaped line.
    if e.field in OPTIONS:
        return f"error: {OPTIONS[e.field]}: {show(e.detail)}"
    return f"error: {show(str(e))}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import asyncio

    # Every command goes through the client: imported once the arguments parse (not for --help).
    failed, run_failed = client.TetherError, temporal.WorkflowFailureError
    try:
        return asyncio.run(args.fn(args))
    except failed as e:
        print(_error_line(e), file=sys.stderr)
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
    if "client" in sys.modules:  # Temporal's native threads may be running: no interpreter teardown
        client.exit_process(code)
    sys.exit(code)  # --help, a usage error: nothing was imported that needs more


def __getattr__(name: str) -> Any:
    """``starter.start_run``, as before the client was imported on first use."""
    if name == "start_run":
        return client.start_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    run()
