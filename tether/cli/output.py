"""What the `tether` command prints: a run's status, its timeline, a list of runs, a verdict, an
error line. Everything a requester, model, tool or signal sender could have written goes through
the one escaping function (workflows/display.py)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from tether.cli.base import client, policy, states, wording
from workflows.display import escape_text as show  # the standard library's alone
from workflows.display import show_value

PROG = "tether"
# Model fields as the options that set them, so a validation error names what the user typed.
OPTIONS = {
    "goal": "--goal", "tenant": "--tenant", "requested_by": "--requested-by", "planner": "--planner",
    "max_steps": "--max-steps", "max_replans": "--max-replans", "approval_ttl_seconds": "--approval-ttl",
    "on_expiry": "--on-expiry", "max_model_tokens": "--max-model-tokens", "approver": "--by", "by": "--by",
    "decision_id": "--decision-id", "plan_hash": "--plan-hash", "comment": "--comment", "reason": "--reason",
    "state": "--state", "limit": "--limit", "port": "--port", "dev_login": "--dev-login", "jwks": "--jwks",
    "editor": "--by", "steps": "--steps", "on_failure": "--on-failure", "on_cancel": "--on-cancel",
}


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


def print_json(value: object) -> None:
    # ASCII only: every control, bidi and invisible character a sender wrote is a \u escape.
    print(json.dumps(value, indent=2, default=str, ensure_ascii=True))


def step_lines(plan: object, tools: Sequence[object] = ()) -> list[str]:
    """Every step of a plan, every argument in full (escaped), money as amount and currency,
    and what the step does in plain words."""
    lines = []
    for v in client.step_views(plan, tools):  # type: ignore[arg-type]
        lines.append(f"  {v.n}. {show(v.tool)}: {v.effect}")
        if v.description:  # the tool's own words (its docstring), its first paragraph
            lines.append(f"       ({show(' '.join(v.description.split(chr(10) * 2)[0].split()), 300)})")
        lines.extend(f"       {client.shown_arg(a)}" for a in v.args)
    return lines


def found_lines(found: Sequence[object]) -> list[str]:
    """What the run's read steps found (its view's ``found``): the tool, its arguments, the
    result's fields as the tool's summary fields say, every name and value escaped."""
    lines = []
    for f in found:
        args = ", ".join(f"{show(k, 64)}: {show_value(v, 120)}" for k, v in f.args.items())  # type: ignore[attr-defined]
        # Money in words beside the raw value, as an argument is shown (client.shown_arg).
        fields = ", ".join(client.shown_arg(client.ArgView(k, v, f.money.get(k)), 120) for k, v in f.fields.items())  # type: ignore[attr-defined]
        lines.append(f"found      {show(f.tool, 64)} ({args}): {fields or '-'}")  # type: ignore[attr-defined]
    return lines


def _sums(sums: dict[str, float]) -> str:
    """A run's sums per "tool.field", as the amount rules judge them."""
    return ", ".join(f"{show(key)} {value:g}" for key, value in sorted(sums.items()))


def _tree_lines(tree: list[client.ChildSpend]) -> list[str]:
    """A delegation tree, one child a line (indented by depth): its state, what it spent of the
    approval lent to it and of the budgets."""
    lines = []
    for c in tree:
        head = f"child      {'  ' * (c.depth - 1)}{show(c.run_id)}"
        if c.error is not None or c.state is None:
            lines.append(f"{head}  unread: {show(c.error or 'no view', 300)}")
            continue
        what = [c.state.value]
        if c.covered:
            what.append(f"approval {c.covered_spent} of {c.covered} named write(s) spent")
        what.append(f"spent {_sums(c.spent)}" if c.spent else "spent nothing")
        lines.append(f"{head}  {'; '.join(what)}  ({invoked_as()} status {show(shlex.quote(c.run_id))})")
    return lines


def asked_by(snap: object, root: str | None) -> str:
    """Who asked (signed or claimed) and, for a child run, on whose behalf: its delegation tree's
    root (a child's requester is its root's); escaped."""
    who = f"{show(snap.requested_by)} ({'signed' if snap.requester_verified else 'claimed'})"  # type: ignore[attr-defined]
    if not snap.parent:  # type: ignore[attr-defined]
        return who
    if root is None:
        return f"{who}, on behalf of the root of its tree (not readable from a signed view here)"
    return f"{who}, on behalf of root run {show(root)}"


def format_status(s: client.RunStatus) -> str:
    """A run's status for a terminal. Everything a requester, model, tool or signal sender could
    have written (ids, reasons, summaries, arguments, answers) goes through workflows/display.py."""
    state = f"{s.state.value} (version {s.state_version}, was {s.previous_state.value if s.previous_state else '-'})"
    if s.unpublished:  # what Temporal lists, or the run answers, is a claim: never shown as its state
        state = "not published yet" + (f" (its live answer, unsigned: {state})" if s.state_version else "")
    lines = [
        f"run        {show(s.run_id)}",
        f"state      {state}",
        f"tenant     {show(s.tenant)}",
        f"steps      {s.step} executed, {s.retries} retries",
    ]
    if not s.unpublished:  # who asked, and for what: the why beside the what
        if s.goal is not None:
            lines.append(f"goal       {show(s.goal, 600)}")
        if s.requested_by:
            lines.append(f"asked by   {asked_by(s, s.root)}")
    if s.parent:  # a child run: whose, and what its grant gives it
        lines.append(f"child of   {show(s.parent)} (depth {s.depth}): {show(s.parent_goal, 200)}")
        lines.append(f"grant      tools {', '.join(show(t) for t in s.grant_tools)}")
        if s.covered:
            lines.append(f"approval   the parent's approval named {s.covered} write(s): {s.covered_spent} spent, "
                         f"{s.covered - s.covered_spent} left")
        if s.tree_spent:
            lines.append(f"tree had   {_sums(s.tree_spent)} (when its parent started it: its plans are judged on these too)")
    if s.spent:  # a child: what its writes (its own children's included) may have applied
        lines.append(f"spent      {_sums(s.spent)}")
    if s.tree:  # the tree below it, each child as its own signed view says
        lines.extend(_tree_lines(s.tree))
    else:
        for child in s.children:
            lines.append(f"child      {show(child)}  ({invoked_as()} status {show(shlex.quote(child))})")
    if s.live_signed is True and s.published_at is not None:
        lines.append(f"view       its live answer, signed by the fleet's key ({client.freshness(s.published_at).replace('published', 'answered')})")
    elif s.live_signed is False:
        lines.append("view       its live answer, UNSIGNED (its build has no signed `view` query): not the fleet's word; "
                     "nothing pending is shown (without --live: its signed published view)")
    elif s.published_at is not None:
        moved = f"; listed as {show(s.listed_state)} since (--live for now)" if s.listed_state else ""
        lines.append(f"view       {client.freshness(s.published_at)}{moved}")
    if s.unpublished:
        lines.append(f"view       {show(s.unpublished, 600)}")
    if s.worker_serving is False and s.task_queue is not None:
        lines.append(f"worker     {client.no_worker_message(s.task_queue)}")
    if s.waits_for_tools and s.task_queue is not None:
        lines.append(f"waits      {client.unserved_message(s.task_queue, s.waits_for_tools)}")
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
    lines.extend(found_lines(s.found))
    if s.plan is not None:
        lines.append(f"plan       v{s.plan.version} {show(s.plan.plan_hash)}")
        lines.extend(step_lines(s.plan, s.tools))
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
    if s.compensates:  # a compensation run: whose writes it puts back (each below, with its amounts)
        lines.append(f"undoes     run {show(s.compensates, 256)}: its write(s) below, newest first")
    for c in s.compensations:
        # Each ok write and where its undo stands (ids and names, escaped), with what it wrote.
        standing = wording.write_standing(c)
        if s.ledger_error and c.tool and c.status == "unknown" and not c.undone_by:
            standing = f"unknown (the ledger cannot be read); undo: {show(c.tool, 64)}"
        wrote = ", ".join(client.shown_arg(a, 120) for a in client.write_args(c, s.tools))
        lines.append(f"write      {show(c.of, 128)} {show(c.of_tool, 64)}" + (f" ({wrote})" if wrote else "") + f": {standing}")
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
        # Its state is what Temporal lists (a claim) unless the fleet signed what it published.
        if row.view_unverified:
            closed += "  UNVERIFIED: its published view is not the fleet's; nothing of it is the run's word"
        elif row.view is None and row.published_at is None:
            closed += "  not published yet: its state is a claim until it publishes"
        lines.append(f"{show(row.run_id):<28} {show(row.state or '-'):<18} {row.status or '-':<11} "
                     f"{show(row.tenant or '-'):<12} {(client.age(row.published_at) + ' ago') if row.published_at else '-':<11} {started}{closed}")
        if row.parent:
            lines.append(f"  child of {show(row.parent)}")
        if row.stuck is not None:
            lines.append(f"  stuck: workflow task attempt {row.stuck.attempt}, {show(row.stuck.cause)}: "
                         f"{show(row.stuck.error, 300)}")
    return "\n".join(lines)


def print_verdict(verdict: client.Verdict) -> int:
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


def error_line(e: client.TetherError) -> str:
    # Errors quote what the run or the user sent (reasons, ids): one escaped line.
    if e.field in OPTIONS:
        return f"error: {OPTIONS[e.field]}: {show(e.detail)}"
    return f"error: {show(str(e))}"
