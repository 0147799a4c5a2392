"""Deciding a run's pending plan: `tether approve`, `reject` and `revise`, each bound to the plan
the person saw."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tether.cli.base import add_command, client
from tether.cli.output import asked_by, found_lines, invoked_as, print_verdict, step_lines
from tether.cli.plans import load_steps_file, parse_edits, revision_diff
from workflows.display import escape_text as show  # the standard library's alone


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


def _step_numbers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        numbers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise client.UsageError(f"--steps: expected step numbers like 1,2, got {text[:60]!r}") from None
    if not numbers:
        raise client.UsageError("--steps: name at least one step")
    return numbers


async def _decide(args: argparse.Namespace, kind: str) -> int:
    """A decision bound to the plan the person saw: the plan hash they name (``--plan-hash``),
    or, on a terminal, the plan shown here and confirmed; ``--unreviewed`` says neither."""
    steps = _step_numbers(getattr(args, "steps", None))
    if args.plan_hash is not None and args.unreviewed:
        raise client.UsageError("--plan-hash and --unreviewed exclude each other: name the plan you reviewed, or say you did not")
    asks = args.plan_hash is None and not args.unreviewed
    if asks and not sys.stdin.isatty():
        raise client.UsageError(
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
        if asks:  # the why beside the what, before the person is asked
            goal = await client.run_goal(conn, args.run)
            root = await client.root_of(conn, snap) if snap.parent else None
            print(f"run {show(args.run)}: asked by {asked_by(snap, root)}: {show(goal or '(goal not readable here)', 600)}")
            if snap.parent:  # a child: the parent's goal it works toward
                print(f"child of {show(snap.parent)}: {show(snap.parent_goal, 300)}")
        print(f"{kind} plan v{snap.plan.version} {show(plan_hash)} of run {show(args.run)}, request "
              f"{show(pending.request_id)} ({client.approvals_needed(pending)}):")
        for line in [*found_lines(snap.found), *step_lines(snap.plan, snap.tools)]:
            print(line)
        if steps:
            dropped = [n for n in range(1, len(snap.plan.steps) + 1) if n not in steps]
            print(f"  only step(s) {', '.join(map(str, steps))}; dropped from the plan: "
                  f"{', '.join(map(str, dropped)) or 'none'}")
        queue = snap.task_queue if isinstance(snap, client.RunStatus) else None
        missing = client.unserved(snap, await client.served_tools(conn, queue)) if kind == "approve" and queue else []
        if missing and queue:  # as the inbox says beside Approve: the approval is kept, its writes wait
            print(f"warning: {client.unserved_message(queue, missing)}")
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
    except client.Pending as e:
        print(e)  # accepted, not judged yet: not an error, and not a verdict (exit 3)
        return e.code
    code = print_verdict(verdict)
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
    for line in step_lines(plan, tools):
        print(line)


async def cmd_approve(args: argparse.Namespace) -> int:
    return await _decide(args, "approve")


async def cmd_reject(args: argparse.Namespace) -> int:
    return await _decide(args, "reject")


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


async def cmd_revise(args: argparse.Namespace) -> int:
    if bool(args.step) == bool(args.steps_file):
        raise client.UsageError("revise: give --step N KEY=VALUE (repeatable) or --steps-file PATH")
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
    return print_verdict(verdict)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_command(sub, "approve", "approve a run's pending plan", _decision_args("approve"), cmd_approve)
    add_command(sub, "reject", "reject a run's pending plan", _decision_args("reject"), cmd_reject)
    add_command(sub, "revise", "revise a run's pending plan", _revise_args, cmd_revise)
