"""A run from start to record: `tether start`, `status`, `timeline`, `list`, and `audit verify`
of the audit sink's records."""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether.cli.base import USAGE, add_command, client, contract, pydantic, run_state, states, wording
from tether.cli.output import error_line, format_list, format_status, format_timeline, print_json
from tether.cli.plans import load_steps_file
from workflows.display import escape_text as show  # the standard library's alone


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


def _load_playbook(path: str | None) -> list[contract.PlaybookStep]:
    return load_steps_file(Path(path), "playbook", contract.PlaybookStep) if path is not None else []


async def cmd_start(args: argparse.Namespace) -> int:
    playbook = _load_playbook(args.playbook)
    if args.planner == "playbook" and not playbook:
        raise client.UsageError("the playbook planner needs steps: pass --playbook PATH")
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
    if (unknown := client.planner_refusal(request.planner)) is not None:
        raise unknown  # a typo'd planner: nothing started, the run's id not used up
    run_id = args.id or f"run-{uuid.uuid4().hex[:12]}"
    if args.key:
        request = client.sign_request(request, run_id, Path(args.key))
    import asyncio  # (not at import: `tether --help` imports nothing heavy)

    conn = await client.connect()
    await client.start_run(conn, request, run_id=run_id, allow_id_reuse=args.allow_id_reuse)
    try:
        return await _follow_start(args, conn, run_id)
    except asyncio.CancelledError:  # Ctrl-C: this command stops, the run it started does not
        clear = "\r\x1b[K" if sys.stderr.isatty() else ""  # the --wait progress line, if any
        print(f"{clear}interrupted: run {show(run_id)} goes on (stopping this command does not stop it); follow it "
              f"with `tether status {show(run_id)}` or `tether timeline {show(run_id)}`, stop it with "
              f"`tether cancel {show(run_id)} --by NAME --reason ...`", file=sys.stderr, flush=True)
        raise


async def _follow_start(args: argparse.Namespace, conn: Any, run_id: str) -> int:
    """What `start` says once the run exists: its id, whether a worker serves it, and with
    --wait where it settled."""
    # The run exists now, whatever follows: say so first (--json --wait prints the status instead).
    if not args.json:
        print(f"started {show(run_id)}", flush=True)
    elif not args.wait:
        print_json({"run_id": run_id})
    queue = client.task_queue()
    if await client.worker_serving(conn, queue) is False:
        # Started, but nothing will move it: say so now, not after a query times out.
        if args.json and args.wait:
            print_json({"run_id": run_id})
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
            print_json({"run_id": run_id})
        print(error_line(e), file=sys.stderr)
        return client.REFUSED  # the run was started; the wait for it failed
    finally:
        if progress is not None:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
    if args.json:
        print_json(status.model_dump(mode="json"))
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


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--json", action="store_true")


def _status_args(p: argparse.ArgumentParser) -> None:
    _run_args(p)
    p.add_argument("--live", action="store_true",
                   help="ask the run itself (a query, through a worker) instead of reading what it published")


async def cmd_status(args: argparse.Namespace) -> int:
    status = await client.status(await client.connect(), args.run, live=args.live)
    if args.json:
        print_json(status.model_dump(mode="json"))
    else:
        print(format_status(status))
    return client.OK


def _timeline_args(p: argparse.ArgumentParser) -> None:
    _status_args(p)
    p.add_argument("--all", action="store_true",
                   help="every record, from the audit sink and the run (the run keeps a window)")
    p.add_argument("--audit-dir", metavar="DIR", help="the worker's audit sink (env TETHER_AUDIT_DIR; default .tether/audit)")


async def cmd_timeline(args: argparse.Namespace) -> int:
    conn = await client.connect()
    if args.live:
        await client.require_worker(conn, args.run)
        records = await client.timeline(conn, args.run)
        if args.json:
            print_json([r.model_dump(mode="json") for r in records])
        else:
            print(format_timeline(records))
        return client.OK
    trail = await client.audit_trail(conn, args.run, args.audit_dir)
    if not args.all:
        # The run's line from the audit sink, the published view filling what it lacks: no
        # worker needed, nothing reaches the run.
        records = trail.line()
        if not records and trail.unchecked:
            raise client.UsageError(trail.unchecked)  # it has published nothing, and nobody can ask it
        if args.json:
            print_json([r.model_dump(mode="json") for r in records])
        else:
            print(format_timeline(records))
            print(await _undone_later(conn, args.run), end="")
        if trail.published_at is not None:
            print(f"note: the run's own records {client.freshness(trail.published_at)}; the audit sink's "
                  f"as of now", file=sys.stderr)
        for warning in audit_warnings(trail):
            print(f"warning: {warning}", file=sys.stderr)
        return client.OK
    # A delegation tree: each child's records after its parent's, marked with the child's id.
    children = await _tree_trails(conn, args.run, args.audit_dir)
    if args.json:
        print_json({**trail.model_dump(mode="json"), "children": {c: t.model_dump(mode="json") for c, t in children}})
    else:
        for branch in trail.branches:
            print(format_branch(branch))
            if branch.records:
                print(format_timeline(branch.records))
        for child_id, child in children:
            for branch in child.branches:
                print(f"[child {show(child_id)}] {format_branch(branch)}")
                if branch.records:
                    print("\n".join(f"[child {show(child_id)}] {line}" for line in format_timeline(branch.records).splitlines()))
    bad = False
    for label, each in [("", trail), *((f"child {show(c)}: ", t) for c, t in children)]:
        for warning in audit_warnings(each):
            print(f"warning: {label}{warning}", file=sys.stderr)
        bad = bad or bool(each.missing or each.audit_error or each.unverified)
    return client.REFUSED if bad else client.OK


# How far `timeline --all` follows a delegation tree (runs in all).
TREE_RUNS = 100


async def _tree_trails(conn: Any, root: str, audit_dir: str | None) -> list[tuple[str, Any]]:
    """The audit trails of a run's children, their children's, ..., parents first (their ids from
    each run's view: the children its delegate steps started)."""
    found: list[tuple[str, Any]] = []
    todo = [root]
    while todo and len(found) < TREE_RUNS:
        run_id = todo.pop(0)
        try:
            children = (await client.status(conn, run_id, goal=False)).children
        except client.TetherError:
            continue  # a child whose view cannot be read: its own `timeline` says why
        for child_id in children:
            found.append((child_id, await client.audit_trail(conn, child_id, audit_dir)))
            todo.append(child_id)
    return found[:TREE_RUNS]


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
        status = await client.status(conn, run_id, goal=False)
    except client.TetherError:
        return ""
    return "".join(
        f"later      {show(c.of, 128)} {show(c.of_tool, 64)}: {wording.write_standing(c)}\n"
        for c in status.compensations if c.undone_by
    )


def _list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state", metavar="STATE", help="e.g. AWAITING_APPROVAL")
    p.add_argument("--tenant", metavar="NAME")
    p.add_argument("--limit", type=int, default=50, metavar="N")
    p.add_argument("--stuck", action="store_true",
                   help="only running runs whose workflow task keeps failing, with the error")
    p.add_argument("--json", action="store_true")


async def cmd_list(args: argparse.Namespace) -> int:
    client.list_query(args.state, args.tenant)  # bad filters are usage errors, before connecting
    rows = await client.list_runs(
        await client.connect(), state=args.state, tenant=args.tenant, limit=args.limit, stuck=args.stuck
    )
    if args.json:
        print_json([r.model_dump(mode="json") for r in rows])
    else:
        print(format_list(rows))
    return client.OK


def _audit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["verify"], help="verify: signatures, chain links and where each trail ends")
    p.add_argument("run", nargs="?", help="the run (workflow id); or --all")
    p.add_argument("--all", action="store_true", help="every run the audit sink holds")
    p.add_argument("--audit-dir", metavar="DIR", help="the workers' audit sink (env TETHER_AUDIT_DIR / TETHER_AUDIT_DSN)")
    p.add_argument("--complete", action="store_true",
                   help="every trail must have reached its run's end, even one Temporal says still runs (default: "
                   "each whose run has ended, or that Temporal does not hold or cannot be asked about)")


async def _run_ended(conn: Any, workflow_id: str) -> tuple[bool, int | None, str | None]:
    """Whether Temporal says the run has ended (True too where it no longer holds it: retention
    follows the end), how many records its signed final view says it wrote, and its run id."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    if conn is None:
        return True, None, None
    try:
        description = await conn.get_workflow_handle(workflow_id).describe()
    except RPCError:
        return True, None, None  # not held (any more): its retention began at its end
    if description.status == WorkflowExecutionStatus.RUNNING:
        return False, None, description.run_id
    try:
        view = await client.published_view(description)
    except client.TetherError:
        view = None
    return True, (view.snapshot.timeline_records if view else None), description.run_id


async def cmd_audit(args: argparse.Namespace) -> int:
    """`tether audit verify RUN | --all`: every record in the audit sink, its signature and its
    chain link, with the public keys alone; and where each stream ends ("complete, N records,
    ended STATE" or "open or cut short after seq N"), checked against Temporal where it still
    holds the run. A trail that does not verify, or that is cut short where its run has ended
    (or with ``--complete``), exits 1."""
    from tether.audit.sink import sink_from_env
    from tether.audit.verify import stream_ends, verify_streams

    if bool(args.run) == bool(args.all):
        raise client.UsageError("name one run, or --all")
    publics = client.public_keys()
    try:
        conn = await client.connect()
    except client.TetherError as e:
        conn = None  # checked from the sink alone: each trail must then have reached its end
        print(f"note: {show(str(e), 300)}: every trail must have reached its end", file=sys.stderr)
    sink = sink_from_env(args.audit_dir)
    try:
        ids = [args.run] if args.run else await sink.workflow_ids()
        checked, bad, complete, still_open, cut = 0, 0, 0, 0, 0
        for workflow_id in ids:
            streams = await sink.read(workflow_id)
            if args.run and not streams:
                raise client.UsageError(f"unknown run {args.run!r}: the audit sink ({sink.describe()}) holds no record of it", rule="unknown_run")
            check = verify_streams(publics, workflow_id, streams)
            checked += check.records
            if check.problems:
                bad += 1
                print(f"{show(workflow_id)}: {len(check.problems)} problem(s); first: {show(check.problems[0], 400)}")
            ended, written, current = await _run_ended(conn, workflow_id)
            must_end = ended or args.complete
            short = False
            for end in stream_ends(streams, check):
                words = end.words()
                if end.run_id == current and written is not None and end.last_seq < written:
                    end.ended = None
                    words = (f"open or cut short after seq {end.last_seq} ({end.records} record(s); its run's signed "
                             f"final view says it wrote {written})")
                if end.ended is None and end.continued_in is None:
                    short = short or must_end
                    if must_end:
                        words += ": its run has ended" if ended else ": --complete"
                    else:
                        words += ": its run is still running"
                print(f"{show(workflow_id)} run {show(end.run_id)}: {words}")
            if short:
                cut += 1
            elif any(e.ended for e in stream_ends(streams, check)):
                complete += 1
            else:
                still_open += 1
    finally:
        await sink.aclose()
    print(f"{checked} record(s) of {len(ids)} run(s) checked against {show(publics.source)}: "
          + (f"{bad} run(s) with records that are not the fleet's" if bad else "every signature and chain link verifies")
          + f"; {complete} trail(s) complete, {still_open} open (still running), {cut} cut short")
    return client.REFUSED if bad or cut else client.OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_command(sub, "start", "start a run", _start_args, cmd_start)
    add_command(sub, "status", "a run's state, plan, approval, why it ended", _status_args, cmd_status)
    add_command(sub, "timeline", "a run's audit timeline", _timeline_args, cmd_timeline)
    add_command(sub, "list", "find runs by state and tenant", _list_args, cmd_list)
    add_command(sub, "audit", "verify the audit sink's trails", _audit_args, cmd_audit)
