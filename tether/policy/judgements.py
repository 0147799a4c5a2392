"""The judgement log: every Cedar judgement the policy activities made (a person's decision, a
write's pre-check), with the entities and request it was judged on and the policies that decided.

Where the audit sink is: JSON lines, ``judgements.jsonl`` beside its folders (``TETHER_AUDIT_DIR``,
default ``.tether/audit``), or PostgreSQL (``TETHER_AUDIT_DSN``: table ``tether_judgements``). Records on the run's timeline name the deciding policy ids (audit by
reference); this log holds what they were judged on, for ``tether policy explain RUN`` and for
``tether policy what-if NEW_POLICY``, which judges each one again under a proposed policy. A
retried activity writes its lines again: readers keep the last line of each judgement's key.
A line that cannot be written is logged and counted, never a reason to refuse a decision.
A line of another shape (or torn by a worker killed mid-write) is skipped and counted in
``skipped``; a log that cannot be read at all raises :class:`LogUnreadable`.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from tether.policy import cedar
from tether.store.keys import PublicKeys
from tether.policy.files import PolicyFileError, load_cedar_files, parse_policy
from tether.store.postgres import PostgresSync, Table, cause, dsn_from_env
from tether.store.tables import DEFAULT_AUDIT_DIR, JUDGEMENT_SCHEMA as PG_SCHEMA, JUDGEMENT_TABLE as PG_TABLE
from workflows import keys as ring_math
from workflows.timers import duration_words
from workflows.contract import json_digest
from workflows.policy_file import TenantPolicy

FILE = "judgements.jsonl"
logger = logging.getLogger("tether.judgements")


def key(entry: dict[str, Any]) -> tuple[str, ...]:
    """One judgement: the run, the activity that judged, and which of its judgements."""
    return (entry.get("workflow_id", ""), entry.get("run_id", ""), entry.get("activity_id", ""), str(entry.get("index", 0)))


def sign(ring: Any, entry: dict[str, Any]) -> dict[str, Any]:
    """The line, signed by the fleet (the policy activity holds the ring): an auditor verifies it
    with the public keys alone, and a hand-written line is skipped by explain and what-if."""
    return {**entry, "sig": ring.sign_statement(ring_math.judgement_statement(_line_digest(entry)))}


def _line_digest(entry: dict[str, Any]) -> str:
    return json_digest({k: v for k, v in entry.items() if k != "sig"})


class LogUnreadable(Exception):
    """The judgement log could not be read at all (a missing file, no permission, the database
    down): not the same as a log with no judgement in it."""


def judgement_line(entry: Any) -> bool:
    """Is this a line shaped as ``entries`` writes one (what explain and what-if read)?"""
    return (
        isinstance(entry, dict)
        and all(isinstance(entry.get(k), str) for k in ("workflow_id", "at", "action"))
        and all(isinstance(entry.get(k, ""), str) for k in ("run_id", "activity_id", "tenant", "person", "check"))
        and isinstance(entry.get("index", 0), int)
        and isinstance(entry.get("allowed"), bool)
        and isinstance(entry.get("request"), dict)
        and isinstance(entry.get("entities"), list)
        and all(isinstance(e, dict) and isinstance(e.get("uid"), dict) for e in entry["entities"])
        and isinstance(entry.get("policies", []), list)
        and isinstance(entry.get("errors", []), list)
    )


def unsigned_problem(publics: PublicKeys, entry: Any) -> str | None:
    """Why this line is not one the fleet signed (None: it is)."""
    if not isinstance(entry, dict):
        return "not a judgement line"
    try:
        return publics.problem(ring_math.judgement_statement(_line_digest(entry)), entry.get("sig") or "")
    except (TypeError, ValueError) as e:  # a value canonical JSON refuses
        return f"unreadable ({e})"


class JudgementLog(Protocol):
    """Where judgements are logged: JSON lines beside the audit sink's folders, or PostgreSQL.
    ``read`` skips the lines of another shape and counts them in ``skipped``; ``read(publics=...)``
    skips the lines the fleet did not sign and counts them in ``unverified``; it raises
    :class:`LogUnreadable` when the log cannot be read at all."""

    failures: int
    unverified: int
    skipped: int

    def describe(self) -> str: ...

    def write(self, entries: list[dict[str, Any]]) -> None: ...

    def read(self, *, since: datetime | None = None, tenant: str | None = None,
             workflow_id: str | None = None, publics: Any = None) -> list[dict[str, Any]]: ...


def log_from_env(audit_dir: str | None = None, dsn: str | None = None) -> JudgementLog:
    """The audit sink's choice: PostgreSQL with ``TETHER_AUDIT_DSN`` (table ``tether_judgements``),
    else JSON lines under ``TETHER_AUDIT_DIR``. An explicit ``audit_dir`` picks JSON lines."""
    dsn = dsn_from_env(audit_dir, dsn)
    if dsn:
        return PostgresJudgementLog(dsn)
    return JsonlJudgementLog(Path(audit_dir or os.environ.get("TETHER_AUDIT_DIR") or DEFAULT_AUDIT_DIR))


async def append(log: JudgementLog, entries: list[dict[str, Any]]) -> None:
    """Write in a thread (the worker's event loop never waits for the disk or the database); a
    failure is logged and counted, never raised: the decision stands without its log line."""
    if not entries:
        return
    try:
        await asyncio.to_thread(log.write, entries)
    except Exception as e:
        log.failures += 1
        logger.warning("judgement log %s not written (%s): explain and what-if miss %d judgement(s)",
                       log.describe(), cause(e), len(entries))


@dataclass
class JsonlJudgementLog:
    root: Path
    failures: int = 0
    unverified: int = 0
    skipped: int = 0

    @property
    def path(self) -> Path:
        return self.root / FILE

    def describe(self) -> str:
        return str(self.path)

    def write(self, entries: list[dict[str, Any]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        body = b"".join(json.dumps(e, sort_keys=True, ensure_ascii=False).encode() + b"\n" for e in entries)
        with open(self.path, "ab") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # whole lines, across worker processes
            f.write(body)
            f.flush()

    def read(self, *, since: datetime | None = None, tenant: str | None = None,
             workflow_id: str | None = None, publics: Any = None) -> list[dict[str, Any]]:
        """The judgements (the last signed line of each), oldest first, filtered."""
        self.unverified = self.skipped = 0
        latest: dict[tuple[str, ...], dict[str, Any]] = {}
        try:
            with open(self.path, "rb") as f:
                for raw in f:
                    try:
                        entry = json.loads(raw)
                    except ValueError:  # a line torn by a worker killed mid-write, or not JSON
                        entry = None
                    if not judgement_line(entry):
                        self.skipped += 1
                        continue
                    if publics is not None and unsigned_problem(publics, entry) is not None:
                        self.unverified += 1  # before it could stand in for a signed line of its key
                        continue
                    latest[key(entry)] = entry
        except OSError as e:
            raise LogUnreadable(f"{self.path}: cannot read it ({e.strerror or e})") from None
        return [e for e in sorted(latest.values(), key=lambda e: (e.get("at", ""), key(e))) if _matches(e, since, tenant, workflow_id)]


@dataclass
class PostgresJudgementLog:
    """The fleet's judgement log, beside the PostgreSQL audit sink: one row per judgement,
    append-only (a worker may INSERT, never UPDATE: tether/store/db_roles.py; a retried activity's
    row is its first attempt's, which judged the same request)."""

    dsn: str
    failures: int = 0
    unverified: int = 0
    # One connection per process (tether/store/postgres.py), its statements one at a time.
    skipped: int = 0
    db: PostgresSync = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.db = PostgresSync(self.dsn, [Table(PG_TABLE, PG_SCHEMA)])

    def describe(self) -> str:
        return f"{self.db.describe()} (table {PG_TABLE})"

    def write(self, entries: list[dict[str, Any]]) -> None:
        def insert(conn: Any) -> None:
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO {PG_TABLE} (workflow_id, run_id, activity_id, idx, tenant, at, line) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (workflow_id, run_id, activity_id, idx) "
                    "DO NOTHING",
                    [(e.get("workflow_id", ""), e.get("run_id", ""), e.get("activity_id", ""), e.get("index", 0),
                      e.get("tenant", ""), e.get("at"), json.dumps(e, ensure_ascii=False)) for e in entries],
                )

        self.db.run(insert)

    def read(self, *, since: datetime | None = None, tenant: str | None = None,
             workflow_id: str | None = None, publics: Any = None) -> list[dict[str, Any]]:
        self.unverified = self.skipped = 0

        def select(conn: Any) -> list[dict[str, Any]]:
            cur = conn.execute(
                f"SELECT line::text FROM {PG_TABLE} WHERE (%s::timestamptz IS NULL OR at >= %s) "
                "AND (%s::text IS NULL OR tenant = %s) AND (%s::text IS NULL OR workflow_id = %s) "
                "ORDER BY at, workflow_id, run_id, activity_id, idx",
                (since, since, tenant, tenant, workflow_id, workflow_id),
            )
            rows = [json.loads(line) for (line,) in cur.fetchall()]
            conn.rollback()
            return rows

        try:
            rows = self.db.run(select)
        except Exception as e:  # psycopg's errors, and the driver not installed
            raise LogUnreadable(f"{self.describe()}: cannot read it ({' '.join(str(e).split())[:300]})") from None
        shaped = [e for e in rows if judgement_line(e)]
        self.skipped = len(rows) - len(shaped)
        rows = shaped
        if publics is None:
            return rows
        signed = [e for e in rows if unsigned_problem(publics, e) is None]
        self.unverified = len(rows) - len(signed)
        return signed


def _matches(entry: dict[str, Any], since: datetime | None, tenant: str | None, workflow_id: str | None) -> bool:
    if tenant is not None and entry.get("tenant") != tenant:
        return False
    if workflow_id is not None and entry.get("workflow_id") != workflow_id:
        return False
    if since is not None:
        try:
            return datetime.fromisoformat(entry["at"]) >= since
        except (KeyError, ValueError):
            return False
    return True


def entries(judgements: Iterable[Any], *, ids: Mapping[str, str] | None = None, **common: Any) -> list[dict[str, Any]]:
    """Log lines for Cedar judgements (tether.policy.cedar.Judgement), numbered within their activity.
    ``ids``: the policies' positional ids to their ``@id`` (``Policies.ids``), so that an
    evaluation error names the policy as records do."""
    return [
        {
            # Who decided, for a person's action (a pre-write check judges approvals again too).
            "person": _person_of(j.request),
            **common,
            "index": i,
            "action": cedar.action_name(j.request),
            "allowed": j.allowed,
            "rule": j.rule,
            "policies": list(j.policies),
            "request": j.request,
            "entities": list(j.entities),
            # Cedar's evaluation errors (a policy that errored is skipped by Cedar): explain shows them.
            **({"errors": [_named_error(str(e), ids or {}) for e in j.errors]} if j.errors else {}),
        }
        for i, j in enumerate(judgements)
    ]


_ERROR_POLICY = re.compile(r"^error while evaluating policy `([^`]*)`: (.*)$", re.S)


def _named_error(error: str, ids: Mapping[str, str]) -> str:
    """Cedar's ``error while evaluating policy `policy11`: ...`` naming the policy by its @id."""
    m = _ERROR_POLICY.match(error)
    return f"error while evaluating policy `{ids.get(m[1], m[1])}`: {m[2]}" if m else error


def error_words(error: str) -> tuple[str, str]:
    """An evaluation error as (the policy it names, what went wrong), for a person."""
    m = _ERROR_POLICY.match(error)
    return (m[1], m[2]) if m else ("?", error)


def _person_of(request: dict[str, Any]) -> str:
    principal = request.get("principal")
    return principal.get("id", "") if isinstance(principal, dict) and principal.get("type") == f"{cedar.NS}::Person" else ""


# ----------------------------------------------------------------------------- what-if


@dataclass(frozen=True)
class Change:
    """A recorded judgement that a proposed policy decides otherwise, or escalates otherwise."""

    entry: dict[str, Any]
    allowed: bool
    rule: str | None
    policies: tuple[str, ...]
    # The escalation the proposal sets otherwise, in words (None: the same, or not comparable).
    escalation: str | None = None

    @property
    def meaning(self) -> str:
        decided = self._decided()
        if self.escalation is None:
            return decided or "the same verdict"
        return self.escalation if decided is None else f"{decided}; {self.escalation}"

    def _decided(self) -> str | None:
        """The change of verdict in words (None: the same verdict, by the same rule)."""
        action, was = self.entry.get("action", ""), self.entry.get("allowed")
        if (was, self.entry.get("rule")) == (self.allowed, self.rule):
            return None
        if was and not self.allowed:
            return {
                "approve": "an approval that would be refused: the run would have needed another approver",
                "approve_steps": "a partial approval that would be refused: the run would have needed another approver",
                "auto_approve": "an auto-approval that would need a person",
                "execute_write": "a write that would have been stopped",
            }.get(action, f"a {action} that would be refused")
        if not was and self.allowed:
            if action == "auto_approve":
                roles = self.entry.get("roles")
                named = f" (roles {', '.join(map(str, roles))})" if isinstance(roles, list) and roles else ""
                return f"needed approval{named}, would need nobody"
            return {
                "approve": "refused -> allowed: an approval that was refused would count",
                "approve_steps": "refused -> allowed: a partial approval that was refused would count",
                "execute_write": "refused -> allowed: a write that was stopped would run",
            }.get(action, f"refused -> allowed: this {action} would be allowed")
        return f"refused by another rule ({self.entry.get('rule')} -> {self.rule})"


class ProposedPolicy:
    """A proposed policy to judge recorded judgements by: a policy file (TOML, its tenants' people
    and rules, and their own Cedar files) or a Cedar file (for every tenant, on the people as
    they were judged). Raises ValueError naming each problem (file, line) when it is invalid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.document = None
        self.own: dict[str, str] = {}
        self.cedar_policies = None
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
        if path.suffix == ".cedar":
            if problems := cedar.cedar_problems(text, str(path)):
                raise ValueError("\n".join(problems))
            self.cedar_policies = cedar.Policies.from_text(text)
            return
        try:
            self.document = parse_policy(text, str(path))
            self.own = load_cedar_files(self.document, path)
        except PolicyFileError as e:
            raise ValueError(str(e)) from None

    def judge(self, entry: dict[str, Any]) -> tuple[bool, str | None, tuple[str, ...]]:
        """The entry's request judged again under this policy."""
        name = entry.get("tenant", "")
        entities = entry.get("entities", [])
        if self.cedar_policies is not None:
            policies, tenant = self.cedar_policies, object()  # a Cedar file speaks for every tenant
        else:
            assert self.document is not None
            tenant = self.document.tenants.get(name)
            if tenant is None:
                return False, "tenant", ()
            policies = cedar.policies_of(name, tenant, self.own.get(name))
            # Who holds which roles is the proposed file's: people are judged as it lists them.
            entities = [
                cedar.person_entity(e["uid"]["id"], name, tenant) if e.get("uid", {}).get("type") == f"{cedar.NS}::Person" else e
                for e in entities
            ]
            # A decision under an escalated request: the roles its stages added are the proposal's.
            if (fired := _fired(entry, tenant)) is not None:
                entities = [_escalated_run(e, entry["escalated"], fired) for e in entities]
        if not entities:
            return False, "tenant", ()
        j = cedar.judge_request(policies, entry.get("request", {}), entities, tenant)
        return j.allowed, j.rule, j.policies

    def escalation(self, entry: dict[str, Any], allowed: bool) -> str | None:
        """How the proposed file escalates otherwise than the line records, in words (None: the
        same, or nothing to compare: a line from before escalation was recorded, a Cedar file,
        which sets no stages, a tenant the proposal does not have). ``allowed``: the proposal's
        verdict on the line (a plan it would let run alone waits for nobody: its change says so)."""
        if self.document is None or (tenant := self.document.tenants.get(entry.get("tenant", ""))) is None:
            return None
        risk = _risk(entry)
        if "escalation" in entry:  # the plan's stages, judged at planning time
            was = _stages(entry["escalation"])
            if was is None or entry.get("allowed") or allowed:
                return None
            now = _stages(escalation_stages(tenant, risk))
            if now == was:
                return None
            return f"escalates to {_stage_words(was)}, would {_would(now)}"
        fired = _fired(entry, tenant)
        if fired is None:
            return None
        stood = entry["escalated"]
        was_roles = _strings(stood.get("roles"))
        if set(r for _, rs in fired for r in rs) == set(was_roles):
            return None
        at = f"{', '.join(was_roles) or 'no new role'} after {duration_words(stood['after'])} (stage {stood.get('stage')})"
        return f"escalated to {at}, would {_would(fired)}"


def _fired(entry: dict[str, Any], tenant: TenantPolicy) -> list[tuple[float, tuple[str, ...]]] | None:
    """For a line under an escalated request: the stages the proposed ``tenant`` would have fired
    by the time the stage the line stood at fired (None: not such a line, or one without it)."""
    stood = entry.get("escalated")
    if not isinstance(stood, dict) or not isinstance(after := stood.get("after"), int | float):
        return None
    return [(a, rs) for a, rs in _stages(escalation_stages(tenant, _risk(entry))) or [] if a <= after]


def _escalated_run(entity: dict[str, Any], stood: dict[str, Any], fired: list[tuple[float, tuple[str, ...]]]) -> dict[str, Any]:
    """The run of a decision under an escalated request, with the roles its stages ``added`` (as
    recorded) in place of those the proposal's ``fired`` stages add. Other entities as they are."""
    attrs = entity.get("attrs")
    if entity.get("uid", {}).get("type") != f"{cedar.NS}::Run" or not isinstance(attrs, dict):
        return entity
    added = set(_strings(stood.get("added")))
    kept = [r["__entity"]["id"] for r in attrs.get("roles", []) if isinstance(r, dict) and isinstance(r.get("__entity"), dict)
            and r["__entity"].get("id") not in added]
    roles = sorted({*kept, *(r for _, rs in fired for r in rs)})
    return {**entity, "attrs": {**attrs, "roles": [{"__entity": {"type": f"{cedar.NS}::Role", "id": r}} for r in roles]}}


def _strings(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def escalation_stages(tenant: TenantPolicy | None, risk: str) -> list[dict[str, Any]]:
    """The escalation stages a tenant's file sets for a request of this risk level, as judgement
    lines record them: seconds ``after`` the request opened, the ``roles`` it adds. The list
    ``workflows.policy.review_plan`` picks for the level, less the stages at or past the file's
    approval TTL for it (they never fire; a run's own shorter limit may drop more)."""
    if tenant is None or risk not in ("normal", "high"):
        return []
    high = risk == "high"
    stages = tenant.escalation.high if high else tenant.escalation.normal
    ttl = tenant.approval_ttl_seconds.high if high else tenant.approval_ttl_seconds.normal
    return [{"after": s.after, "roles": list(s.roles)} for s in stages if ttl is None or s.after < ttl]


def stood_at(tenant: TenantPolicy | None, risk: str, asked: list[str], *, stage: int | None = None,
             roles: list[str] | None = None) -> dict[str, Any]:
    """The escalation stage a judgement under an escalated request stood at, as its line records
    it: the ``stage`` (1-based; the run's count of stages fired, or else the first of the file's
    stages whose roles so far are the request's escalated ``roles``), when it fired (``after``;
    None where the file sets no such stage), the ``roles`` the stages so far added, and those of
    them the request did not ask for itself (``added``: not in ``asked``)."""
    stages = escalation_stages(tenant, risk)
    if stage is None and roles is not None:
        stage = next((k for k in range(1, len(stages) + 1)
                      if [r for s in stages[:k] for r in s["roles"]] == list(roles)), None)
    known = stage is not None and 1 <= stage <= len(stages)
    if roles is None:
        roles = [r for s in stages[:stage] for r in s["roles"]] if known and stage else []
    return {"stage": stage, "after": stages[stage - 1]["after"] if known and stage else None, "roles": list(roles),
            "added": sorted(set(roles) - set(asked))}


def _stages(value: Any) -> list[tuple[float, tuple[str, ...]]] | None:
    """Recorded stages as (after, roles), None when they are not a list of stages."""
    if not isinstance(value, list):
        return None
    out = []
    for stage in value:
        if not isinstance(stage, dict) or not isinstance(after := stage.get("after"), int | float):
            return None
        roles = stage.get("roles")
        out.append((float(after), tuple(str(r) for r in roles) if isinstance(roles, list) else ()))
    return out


def _stage_words(stages: list[tuple[float, tuple[str, ...]]]) -> str:
    return ", then ".join(f"{', '.join(roles) or 'no new role'} after {duration_words(after)}" for after, roles in stages)


def _would(stages: list[tuple[float, tuple[str, ...]]] | None) -> str:
    return f"escalate to {_stage_words(stages)}" if stages else "not escalate"


def _risk(entry: dict[str, Any]) -> str:
    """The risk level the line's request was judged at (its run's, or its step's)."""
    for entity in entry.get("entities", []):
        attrs = entity.get("attrs") if isinstance(entity, dict) else None
        if isinstance(attrs, dict) and isinstance(attrs.get("risk"), str):
            return str(attrs["risk"])
    return "none"


def escalation_words(entry: dict[str, Any]) -> str | None:
    """What the line records of escalation, for ``tether policy explain`` (None: nothing)."""
    if "escalation" in entry:
        stages = _stages(entry["escalation"])
        return f"escalation  {_stage_words(stages) if stages else 'none'}" if stages is not None else None
    stood = entry.get("escalated")
    if isinstance(stood, dict):
        roles = _strings(stood.get("roles"))
        after = stood.get("after")
        when = f" after {duration_words(after)}" if isinstance(after, int | float) else ""
        return f"escalated   stage {stood.get('stage')}: {', '.join(map(str, roles)) or 'no new role'}{when}"
    return None


def what_if(recorded: list[dict[str, Any]], proposed: ProposedPolicy) -> list[Change]:
    """The recorded judgements a proposed policy decides otherwise (allowed or not, or by
    another refusal rule) or escalates otherwise (the plan's stages, or the stage a decision
    stood at), oldest first."""
    changes = []
    for entry in recorded:
        allowed, rule, policies = proposed.judge(entry)
        escalation = proposed.escalation(entry, allowed)
        if (allowed, rule) != (entry.get("allowed"), entry.get("rule")) or escalation is not None:
            changes.append(Change(entry=entry, allowed=allowed, rule=rule, policies=policies, escalation=escalation))
    return changes


def before_escalation(recorded: list[dict[str, Any]], proposed: ProposedPolicy) -> int:
    """Planning-time lines logged before lines recorded the plan's escalation stages, of tenants
    the proposal escalates: what-if cannot tell whether their escalation changes (0: none such)."""
    if proposed.document is None:
        return 0
    escalating = {name for name, t in proposed.document.tenants.items() if t.escalation.normal or t.escalation.high}
    return sum(
        1 for e in recorded
        if e.get("check") == "plan" and e.get("action") == "auto_approve" and not e.get("allowed")
        and "escalation" not in e and e.get("tenant") in escalating
        and isinstance(e.get("request", {}).get("resource"), dict) and e["request"]["resource"].get("id") == "1"
    )
