"""An operator's hands on runs: `tether handoff`, `cancel`, `repair` (a stuck run), `compensate`
(undo an ended run's writes) and `drain` (what an older worker build still holds)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from tether.cli.base import add_command, client, published, states
from tether.cli.output import format_list, format_status, invoked_as, print_json, print_verdict
from workflows.display import escape_text as show  # the standard library's alone


def _handoff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--by", required=True, metavar="NAME", help="a member of the run's tenant")
    p.add_argument("--reason", required=True, metavar="TEXT")
    p.add_argument("--decision-id", metavar="ID", help="unique id of this handoff (default: random)")
    p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the handoff (see keygen)")
    p.add_argument("--force", action="store_true",
                   help="a stuck run (its workflow tasks keep failing): reset it with the hand-off to its last task "
                        "that replays; writes in flight are named on the record, never run again")


async def cmd_handoff(args: argparse.Namespace) -> int:
    # The run and its delegation tree: with --force, each stuck run of it first (a stuck child
    # takes no cancel, and its parent's hand-off would wait on it).
    # A forced hand-off's reset is the worker's side (a replay on this build): handed to the client.
    from tether.repair import HandoffReset

    verdicts = await client.handoff_tree(
        await client.connect(), args.run, by=args.by, reason=args.reason, decision_id=args.decision_id,
        key=Path(args.key) if args.key else None, force=args.force, forced=HandoffReset() if args.force else None,
    )
    for run_id, verdict in verdicts:
        if run_id != args.run:
            print(f"child {show(run_id)}:")
        if (done := verdict.reset) is not None:
            if done.failure is not None:
                print(f"run {show(done.run_id)} was stuck: workflow task attempt {done.failure.attempt} failing since event "
                      f"{done.failure.event_id} ({show(done.failure.cause)}): {show(done.failure.error, 400)}")
            print(f"reset run {show(done.from_run_id)} to the workflow task completed at event {done.event_id}, the "
                  f"hand-off applied again: new run {show(done.to_run_id)}")
            print(f"in flight, may have applied, not run again: {', '.join(show(t) for t in done.in_flight) or 'none'}")
        print_verdict(verdict)
    return client.OK


def _cancel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--by", required=True, metavar="NAME", help="who cancels: a member of the run's tenant (on the record)")
    p.add_argument("--reason", required=True, metavar="TEXT")
    p.add_argument("--key", metavar="PEM", help="Ed25519 private key: sign the cancel (where the tenant requires it)")


async def cmd_cancel(args: argparse.Namespace) -> int:
    client.person_name(args.by)  # a usage error before connecting
    # The run and its delegation tree: a child whose parent has ended is sent the cancel itself.
    done = await client.cancel_tree(await client.connect(), args.run, reason=args.reason, by=args.by,
                                    key=Path(args.key) if args.key else None)
    for run_id, verdict in done:
        who = f"child {show(run_id)}: " if run_id != args.run else ""
        print(f"{who}{verdict.state.value}: {show(verdict.reason)} (decision {show(verdict.decision_id)})")
    return client.OK


def _repair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    p.add_argument("--reason", metavar="TEXT", help="recorded with the reset (default: the failure's cause)")
    p.add_argument("--event-id", type=int, metavar="N",
                   help="reset to this completed workflow task (default: the last before the failure that replays)")
    p.add_argument("--json", action="store_true")


async def cmd_repair(args: argparse.Namespace) -> int:
    # The run and its delegation tree: each stuck run of it (a parent waits on a stuck child).
    from tether.repair import repair_tree

    repaired = await repair_tree(
        await client.connect(), args.run, reason=args.reason, event_id=args.event_id,
    )
    if args.json:  # one repair: its object (as ever); a tree's several: a list of them
        shown = [done.model_dump(mode="json") for done in repaired]
        print_json(shown[0] if len(shown) == 1 else shown)
        return client.OK
    for done in repaired:
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


async def cmd_compensate(args: argparse.Namespace) -> int:
    conn = await client.connect()
    policy_path = args.policy or os.environ.get("TETHER_POLICY") or None
    # The run and its delegation tree: a child's writes its parent did not take are undone too.
    handles = await client.compensate_tree(
        conn, args.run, by=args.by, key=Path(args.key) if args.key else None, rerun_unknown=args.rerun_unknown or (),
        policy_path=Path(policy_path) if policy_path else None,
    )
    for handle in handles:
        of = handle.id.removesuffix("-compensate")
        print(f"started {show(handle.id)}: the compensation of {show(of)}"
              + (f" (a child of {show(args.run)})" if of != args.run else ""))
    if not args.wait:
        return client.OK
    codes = [await _compensated(conn, handle.id, args.wait_timeout) for handle in handles]
    return client.REFUSED if client.REFUSED in codes else max(codes)


async def _compensated(conn: Any, run_id: str, wait_timeout: float) -> int:
    """Wait for one compensation run to settle: done (0), ended otherwise (1), still waiting (3)."""
    status = await client.wait_settled(conn, run_id, wait_timeout)
    print(format_status(status))
    if status.state == states.RunState.COMPENSATED:
        return client.OK  # the undos are done
    if status.ended:
        why = f": {show(status.end_reason)}" if status.end_reason else ""
        print(f"error: compensation {show(run_id)} ended in {status.state.value}{why}", file=sys.stderr)
        return client.REFUSED
    pending = status.pending_approval
    if status.state == states.RunState.AWAITING_APPROVAL and pending is not None:
        waits = (f"its approval ({client.approvals_needed(pending)}; request expires "
                 f"{pending.expires_at.isoformat(timespec='seconds')}): "
                 f"{invoked_as()} approve {show(shlex.quote(run_id))} --by NAME")
    else:
        waits = f"{status.state.value} after {wait_timeout:g}s"
    print(f"error: compensation {show(run_id)} is not done, nothing is undone yet; it waits on {waits}", file=sys.stderr)
    return client.PENDING


def _drain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")


async def cmd_drain(args: argparse.Namespace) -> int:
    conn = await client.connect()
    rows = await client.drain(conn)
    deployment = os.environ.get(client.DEPLOYMENT_ENV) or None
    state = await client.deployment_status(conn, client.deployment_name(deployment)) if deployment else None
    waiting = bool(rows) or (state is not None and any(not v.retirable and not v.routed for v in state.versions))
    if args.json:
        if state is None:
            print_json([r.model_dump(mode="json") for r in rows])
        else:  # the deployment's builds, and the older builds' runs (`runs`)
            print_json({**state.model_dump(mode="json"), "runs": [r.model_dump(mode="json") for r in rows]})
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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_command(sub, "handoff", "hand a run to a human: HANDED_OFF", _handoff_args, cmd_handoff)
    add_command(sub, "cancel", "cancel a run, its tree too", _cancel_args, cmd_cancel)
    add_command(sub, "repair", "reset a stuck run to its last task that replays", _repair_args, cmd_repair)
    add_command(sub, "compensate", "undo an ended tree's kept writes", _compensate_args, cmd_compensate)
    add_command(sub, "drain", "runs an older worker build still holds (exit 1 while any)", _drain_args, cmd_drain)
