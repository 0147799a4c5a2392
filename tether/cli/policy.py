"""`tether policy`: a policy file's rules exported as Cedar, a file validated, a run's Cedar
judgements explained, recorded judgements judged again under a proposed policy (what-if), the
policy file a process reads shown beside the one a run recorded."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tether.cli.base import USAGE, add_command, client
from workflows.display import escape_text as show  # the standard library's alone

if TYPE_CHECKING:
    from tether.policy.judgements import JudgementLog

# `tether policy what-if` / `explain`: the judgement log could not be read at all (a missing file,
# no permission, the database down); after 0-3 (tether.client), apart from 2 "NEW_POLICY is invalid".
LOG_UNREADABLE = 4  # tether.client.JudgementLogUnreadable.code


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


async def cmd_policy(args: argparse.Namespace) -> int:
    """Cedar (docs/policy.md, "Cedar"): export a policy file's rules, validate a file, explain a
    run's decisions, judge recorded decisions under a proposed policy."""
    from tether.policy import cedar
    from tether.policy.files import validate_file

    if args.action != "show" and not args.target:
        raise client.UsageError(f"`tether policy {args.action}` needs its TARGET (see `tether policy --help`)")
    if args.action == "validate":
        problems, checked = validate_file(Path(args.target))
        for problem in problems:
            print(show(problem), file=sys.stderr)
        if problems:
            print(f"{len(problems)} problem(s): fix them and validate again (the schema: "
                  f"tether/policy/tether.cedarschema)", file=sys.stderr)
            return USAGE
        print(f"{show(args.target)}: {checked}")
        return client.OK
    if args.action == "export":
        from tether.policy.files import PolicyFileError, parse_policy

        path = Path(args.target)
        try:
            document = parse_policy(path.read_text(), str(path))
        except OSError as e:
            raise client.UsageError(f"{path}: cannot read it ({e.strerror})") from None
        except PolicyFileError as e:
            raise client.UsageError(f"{e}; `tether policy validate {path}` lists every problem") from None
        text = cedar.export_document(document)
        if args.out:
            Path(args.out).write_text(text)
            print(f"{len(document.tenants)} tenant(s) exported to {show(args.out)}; validate it with "
                  f"`tether policy validate {show(args.out)}`")
        else:
            sys.stdout.write(text)
        return client.OK
    if args.action == "explain":
        from tether.policy.judgements import log_from_env

        log = log_from_env(args.audit_dir)
        found = read_judgements(log, workflow_id=args.target)
        if not found:
            raise client.UsageError(
                f"no judgement of run {args.target} in {log.describe()}: the run made no decision or write yet, or its "
                "worker logs elsewhere (--audit-dir, env TETHER_AUDIT_DIR or TETHER_AUDIT_DSN)")
        print(f"run {show(args.target)}: {len(found)} Cedar judgement(s), from {show(log.describe())}")
        for entry in found:
            print("\n".join(format_judgement(entry)))
        return client.OK
    if args.action == "what-if":
        return what_if(args)
    if args.action == "show":
        return await show_policy(args)
    raise client.UsageError(f"unknown policy action {args.action!r}")


async def show_policy(args: argparse.Namespace) -> int:
    """`tether policy show [--policy FILE] [--run RUN]`: the file a process would read, its hash and
    tenants; with --run, the hash the run recorded at its start and whether it is this file's
    (exit 1 when it is not: the run was judged under another policy file)."""
    from tether.policy.files import PolicyFileError, PolicyStore
    from tether.inbox.desk import recorded_policy_hash

    chosen = args.policy or args.target or os.environ.get("TETHER_POLICY") or None
    store = PolicyStore(Path(chosen) if chosen else None)
    try:
        document, digest = store.load()
    except (PolicyFileError, OSError) as e:
        raise client.UsageError(f"{e}; `tether policy validate {chosen}` lists every problem") from None
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
        raise client.UsageError(f"run {args.run} has recorded no policy hash yet (it records one when its worker takes "
                          "it): try again in a moment")
    same = recorded == digest
    print(f"run     {show(args.run)}: policy hash {recorded} (recorded at its start): "
          + ("the same file" if same else "ANOTHER policy than this file: it was judged by the worker's file, "
             "not this one (`tether policy show --policy FILE` on the worker's file names it)"))
    return client.OK if same else client.REFUSED


def what_if(args: argparse.Namespace) -> int:
    """`tether policy what-if NEW_POLICY`: every logged judgement judged again under NEW_POLICY;
    exit 0 when none changes, 1 when some do (each printed), 2 when NEW_POLICY is invalid."""
    from datetime import datetime, timedelta, timezone

    from tether.policy.judgements import ProposedPolicy, before_escalation, log_from_env, what_if as judge_again
    from workflows.policy_file import parse_duration

    since = None
    if args.since:
        try:
            since = datetime.now(timezone.utc) - timedelta(seconds=float(parse_duration(args.since)))
        except (ValueError, TypeError) as e:
            raise client.UsageError(f"--since {args.since!r}: {e}") from None
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
        entry = change.entry
        who = f" by {entry['person']}" if entry.get("person") else ""
        step = entry.get("request", {}).get("resource", {})
        what = f" step {step.get('id')}" if isinstance(step, dict) and step.get("type", "").endswith("Step") else ""
        amounts = _step_amounts(entry)
        was = "allowed" if entry.get("allowed") else f"refused ({entry.get('rule')})"
        now = "allowed" if change.allowed else f"refused ({change.rule})"
        by = ", ".join(change.policies) or "no policy"
        print(show(f"{entry.get('workflow_id')} {entry.get('at', '')[:19]} {entry.get('check')} "
                   f"{entry.get('action')}{who}{what}"
                   f"{' (' + amounts + ')' if amounts else ''}: {was} -> {now} by {by}: {change.meaning}", 600))
    if uncompared := before_escalation(recorded, proposed):
        print(f"note: {uncompared} plan(s) that needed approval were logged before judgement lines recorded their "
              "escalation stages: what-if compares their verdicts, not their escalation", file=sys.stderr)
    print(f"{len(changes)} of {len(recorded)} judgement(s) of {len(runs)} run(s) change under {show(args.target)}"
          + ("" if recorded else f" (none logged in {show(log.describe())}{' since ' + args.since if args.since else ''})"))
    return client.REFUSED if changes else client.OK


def read_judgements(log: JudgementLog, **filters: Any) -> list[dict[str, Any]]:
    """The judgement log's signed judgement lines (explain, what-if): the lines of another shape
    and those the fleet did not sign are skipped and counted on stderr (they change no exit code);
    a log that cannot be read at all is exit LOG_UNREADABLE, apart from "NEW_POLICY is invalid"."""
    from tether.policy.judgements import LogUnreadable

    try:
        found = log.read(publics=client.public_keys(), **filters)
    except LogUnreadable as e:
        raise client.JudgementLogUnreadable(f"could not read the judgement log: {e}; point at the workers' log with "
                                            "--audit-dir, env TETHER_AUDIT_DIR or TETHER_AUDIT_DSN") from None
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
    step: dict[str, Any] = next((e for e in entry.get("entities", []) if e.get("uid") == resource), {})
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
    from tether.policy.judgements import error_words, escalation_words

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
    # The plan's escalation stages (planning time), or the stage a decision stood at.
    if (stages := escalation_words(entry)) is not None:
        lines.append("  " + show(stages, 600))
    return lines


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_command(sub, "policy", "Cedar: export, validate, explain, what-if", _policy_args, cmd_policy)
