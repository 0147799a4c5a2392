"""The inbox's reading and deciding: which runs wait on a person, one run as they may see it,
and their decision sent through ``client.decide`` (signed as an attestation when the policy
trusts this inbox's key). The web app (``tether.inbox.app``) serves these as pages and JSON.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from fastapi import Request
from pydantic import Field
from temporalio.client import Client

import tether.client as tether
from tether.policy.files import PolicyStore
from tether.inbox import desk
from tether.inbox.identity import SESSION_COOKIE, DevLogin, Person, Unauthenticated, Verifier
from workflows import wording
from workflows.contract import Contract
from workflows.policy_file import PolicyDocument
from workflows.run_state import RunSnapshot
from workflows.states import TERMINAL, RunState, TransitionRecord
from workflows.wire import Refusal

log = logging.getLogger("tether.inbox")
MAX_RUNS_LISTED = 200
MAX_GOALS_KEPT = 1000  # goals kept in memory (the oldest read goes first)


@dataclass
class InboxConfig:
    policy: Path
    dev_login: bool = False
    jwks: str | None = None
    issuer: str | None = None
    audience: str | None = None
    claim: str = "preferred_username"
    subjects: Path | None = None  # the subjects file: each person's sign-in subject (identity.load_subjects)
    header: str | None = "X-Forwarded-Assertion"
    key: Path | None = None  # the inbox's Ed25519 signing key (PEM), for attestations
    web_ui: str = "http://localhost:8233"
    namespace: str = "default"
    poll_ms: int = 1500
    host: str = "127.0.0.1"


class DecisionBody(Contract):
    """``POST /api/runs/{id}/decisions``: what the person saw and decides (never who they are)."""

    kind: Literal["approve", "reject"]
    request_id: str = Field(min_length=1, max_length=128)
    plan_hash: str = Field(pattern=r"^[0-9a-fA-F]{12,128}$")  # as the page showed it (client.HASH_PREFIX or more)
    comment: str | None = Field(None, max_length=2000)


class NotYours(Exception):
    """A run the person may not see (404: not even whether it exists)."""


@dataclass
class Inbox:
    config: InboxConfig
    store: PolicyStore
    verifier: Verifier
    dev: DevLogin | None
    temporal: Client | None = None
    csrf_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    key_path: Path | None = None
    public_key: str | None = None
    goals: dict[str, str] = field(default_factory=dict)  # run id -> its goal (``_goal``)
    roots: dict[str, str] = field(default_factory=dict)  # child run id -> its tree's root (``_root``)

    # ------------------------------------------------------------------ identity

    async def identify(self, request: Request) -> Person:
        """The verified person behind this request, or Unauthenticated (401)."""
        auth = request.headers.get("authorization")
        header = self.config.header
        if self.dev is not None:
            # Dev sign-in: its session cookie only, never as a Bearer token (which a script or
            # another page could replay), and refused once signed out.
            if auth is not None:
                raise Unauthenticated("dev sign-in takes its session cookie only, not Authorization")
            token = request.cookies.get(SESSION_COOKIE) or ""
            if not token:
                raise Unauthenticated("no credentials")
            return Person(self.dev.verify(token.strip()), "cookie")
        if auth is not None:
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer":
                raise Unauthenticated("only Bearer authorization is accepted")
            source = "bearer"
        elif header and (token := request.headers.get(header) or ""):
            source = "header"
        else:
            raise Unauthenticated("no credentials")
        return Person(await self.verifier.averify(token.strip()), source)

    def csrf_token(self, person: Person) -> str:
        return hmac.new(self.csrf_secret, f"csrf\n{person.name}".encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, person: Person, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(self.csrf_token(person), token or "")

    # ------------------------------------------------------------------ reading

    def document(self) -> PolicyDocument | None:
        """The policy file's document (None: no file, the built-in default applies)."""
        document, _ = self.store.load()
        return document

    def policy(self) -> dict[str, str]:
        """The policy file this inbox reads and its sha256 (pages' footer, /healthz)."""
        _, digest = self.store.load()
        return {"policy": self.store.source, "policy_hash": digest}

    def policy_note(self, run_hash: str | None) -> dict[str, Any]:
        """The run's policy (the hash it recorded at its start) beside this inbox's: the roles a run
        needs are the run's own (its signed view); this inbox's file says only who a person is."""
        mine = self.policy()["policy_hash"]
        same = None if run_hash is None else run_hash == mine
        note = None
        if same is False and run_hash is not None:
            note = (f"this run was judged under policy {run_hash[:12]}, not this inbox's file "
                    f"{self.store.source} ({mine[:12]}): the roles it needs are the run's own; who you are (your "
                    "roles) is this inbox's file; the run decides")
        return {"run": run_hash, "inbox": mine, "same": same, "note": note}

    async def client(self) -> Client:
        if self.temporal is None:
            self.temporal = await tether.connect()
        return self.temporal

    async def waiting(self, person: Person) -> list[dict[str, Any]]:
        """AWAITING_APPROVAL runs of the person's tenants that they may decide, soonest expiry first."""
        document = self.document()
        temporal = await self.client()
        now = datetime.now(timezone.utc)
        rows: list[dict[str, Any]] = []
        served: dict[str, frozenset[str] | None] = {}  # per task queue, asked once per listing
        if document is None:
            return rows  # no policy file: the built-in default lists no approvers
        for tenant_name in desk.tenants_of(document, person.name):
            tenant = document.tenants[tenant_name]
            runs = await tether.list_runs(
                temporal, state=RunState.AWAITING_APPROVAL.value, tenant=tenant_name, limit=MAX_RUNS_LISTED
            )
            # What each run published where it waits, signed by the fleet (no worker, nothing
            # reaches the run). A run that has published nothing yet, or whose view does not
            # verify, is never listed nor asked: whoever started it may answer its queries.
            snaps = [(r.view.snapshot, r.view.published_at, r.task_queue) for r in runs if r.view is not None]
            can_attest = desk.attester(document, self.public_key, tenant_name) is not None
            for snap, published_at, queue in snaps:
                if snap.tenant != tenant_name:
                    continue
                if desk.decide_refusal(tenant, snap, person.name, now=now, can_attest=can_attest) is None:
                    # Tools no live worker on its queue serves: listed all the same, with a warning.
                    if queue and queue not in served:
                        served[queue] = await tether.served_tools(temporal, queue)
                    missing = tether.unserved(snap, served.get(queue)) if queue else []
                    rows.append({**self._row(snap, now), **await self._why(snap), "as_of": self._as_of(published_at, now),
                                 "waits_for": tether.unserved_message(queue, missing) if missing and queue else None})
        rows.sort(key=lambda r: r["expires_at"])
        return rows

    @staticmethod
    def _as_of(published_at: datetime | None, now: datetime) -> str:
        return tether.freshness(published_at, now) if published_at is not None else "live"

    @staticmethod
    def _row(snap: RunSnapshot, now: datetime) -> dict[str, Any]:
        pending = snap.pending_approval
        assert pending is not None
        return {
            "run_id": snap.run_id,
            "tenant": snap.tenant,
            "requested_by": snap.requested_by,
            "request_id": pending.request_id,
            "plan_hash": pending.plan_hash,
            "risk": pending.risk,
            "summary": pending.summary,
            # What it will do, for a person: no markup, money with its currency (escaped here).
            "what": tether.plan_summary(snap.plan, snap.tools),
            "approvals_needed": tether.approvals_needed(pending),
            "expires_at": pending.expires_at.isoformat(),
            "seconds_left": max(0, int((pending.expires_at - now).total_seconds())),
            "time_left": desk.time_left(pending.expires_at, now),
        }

    async def _member_snapshot(
        self, person: Person, run_id: str, live: bool = False
    ) -> tuple[PolicyDocument, tether.RunStatus, list[TransitionRecord]]:
        """The policy, the run's status as it published it (``live``: as the run answers now)
        and its latest records, when the policy lists the person in its tenant."""
        document = self.document()
        try:
            snap, records = await tether.read_run(await self.client(), run_id, live=live)
        except tether.TetherError as e:
            if e.rule == "unknown_run":
                raise NotYours() from None
            raise
        if document is None or snap.tenant not in desk.tenants_of(document, person.name) or snap.unpublished:
            raise NotYours()  # a run that has published nothing is no one's to decide (its tenant is a claim)
        return document, snap, records

    async def _visible(
        self, person: Person, run_id: str, live: bool = False
    ) -> tuple[PolicyDocument, tether.RunStatus, list[TransitionRecord], str | None, Refusal | None]:
        """The run, when the person may see it: they may decide it now, or a decision of theirs
        counted on it; or, a member of its tenant, they are told why not when the run was judged
        under another policy file than this inbox's. GET and POST answer the same (404 otherwise:
        not even whether it exists)."""
        document, snap, records = await self._member_snapshot(person, run_id, live)
        signer = desk.attester(document, self.public_key, snap.tenant)
        refusal = desk.decide_refusal(document.tenants[snap.tenant], snap, person.name,
                                      now=datetime.now(timezone.utc), can_attest=signer is not None)
        note = self.policy_note(desk.recorded_policy_hash(records))
        if refusal is not None and note["note"] is not None and snap.pending_approval is not None:
            refusal = refusal.model_copy(update={"message": f"{refusal.message} ({note['note']})"})
        elif refusal is not None and not desk.has_acted(person.name, snap, records):
            raise NotYours()
        return document, snap, records, signer, refusal

    async def run(self, person: Person, run_id: str, live: bool = False) -> dict[str, Any]:
        """The run as the person may see it, or NotYours. ``live``: right after a decision, as
        the run answers now (its published view follows where it next rests)."""
        document, snap, records, signer, refusal = await self._visible(person, run_id, live)
        acted = desk.has_acted(person.name, snap, records)
        tenant = document.tenants[snap.tenant]
        now = datetime.now(timezone.utc)
        tools = {t.name: t for t in snap.tools}
        steps = []
        for view, step in zip(tether.step_views(snap.plan, snap.tools), snap.plan.steps if snap.plan else []):
            info = tools.get(step.tool)
            steps.append({
                "n": view.n,
                "tool": step.tool,
                "tool_call_id": step.tool_call_id,
                "effect": info.effect.value if info else "unknown",
                "does": view.effect,  # the effect in words: read-only, can be undone by X, cannot be undone
                "destructive": bool(info and info.destructive),
                "args": step.args,
                "money": {a.name: a.money for a in view.args if a.money},
                "summary": {a.name: a.value for a in view.summary},
                "description": " ".join(view.description.split("\n\n")[0].split()),  # the tool's own words
                "done": view.n <= snap.step,
            })
        pending = snap.pending_approval
        # Each ok write and where it stands (kept, undone by which run, may have applied): the
        # undo ledger's word for an ended run (client.undo_standing), one wording for every view.
        compensations = await tether.undo_standing(snap.compensations) if snap.state in TERMINAL else snap.compensations
        writes = [
            {"of": c.of, "of_tool": c.of_tool, "undo": c.tool, "status": c.status, "standing": wording.standing(c),
             "args": c.of_args, "money": {a.name: a.money for a in tether.write_args(c, snap.tools) if a.money},
             "by": c.undone_by or None, "at": c.undone_at.isoformat() if c.undone_at else None}
            for c in compensations
        ]
        return {
            "run_id": snap.run_id,
            "tenant": snap.tenant,
            **await self._why(snap),
            "state": snap.state.value,
            "state_version": snap.state_version,
            "ended": snap.state in TERMINAL,
            "plan_hash": snap.plan.plan_hash if snap.plan else None,
            "plan_version": snap.plan.version if snap.plan else 0,
            "steps": steps,
            # What the read steps found (the signed view's; escaped by the page): what the plan depends on.
            "found": [f.model_dump(mode="json") for f in snap.found],
            "writes": writes,
            "compensates": snap.compensates,  # a compensation run: the run whose writes it puts back
            "pending": None if pending is None else {
                **self._row(snap, now),
                "approvals_required": pending.approvals_required,
                "roles": pending.roles,
                "approvals": [{"approver": a.approver, "at": a.at.isoformat()} for a in pending.approvals],
                "approvals_left": max(pending.approvals_required - len(pending.approvals), 0),
                "deciders": desk.deciders(tenant, snap),
            },
            "policy": self.policy_note(desk.recorded_policy_hash(records)),
            "may_decide": refusal is None,
            "why_not": None if refusal is None else {"rule": refusal.rule, "message": refusal.message},
            "acted": acted,
            "attests_as": signer,
            "approved_by": snap.approved_by,
            "answer": snap.answer,
            "last_error": snap.last_error,
            "timeline": [self._record(r) for r in records],
            "as_of": self._as_of(snap.published_at, now),
            "published_at": snap.published_at.isoformat() if snap.published_at else None,
            "worker": None if snap.worker_serving is not False or snap.task_queue is None
            else tether.no_worker_message(snap.task_queue),
            # Tools no live worker on the run's queue serves: Approve is still offered (the approval
            # is kept, its writes wait), with this said beside it.
            "waits_for": None if not snap.waits_for_tools or snap.task_queue is None
            else tether.unserved_message(snap.task_queue, snap.waits_for_tools),
            "stuck": None if snap.stuck is None else f"its workflow task keeps failing (attempt {snap.stuck.attempt}): {snap.stuck.error}",
            "web_ui": f"{self.config.web_ui.rstrip('/')}/namespaces/{quote(self.config.namespace)}/workflows/{quote(snap.run_id)}",
        }

    async def _why(self, snap: RunSnapshot) -> dict[str, Any]:
        """Why the run asks, beside what it will do: its goal, who asked (signed or claimed)
        and, for a child, its parent's goal and the root it acts for (from signed views)."""
        return {
            "goal": await self._goal(snap.run_id),
            "requested_by": snap.requested_by,
            "requester_verified": snap.requester_verified,
            "parent": snap.parent,
            "parent_goal": snap.parent_goal,
            "root": await self._root(snap),
        }

    async def _root(self, snap: RunSnapshot) -> str | None:
        """A child run's root (``client.root_of``), read once per run: a tree's root never changes."""
        if not snap.parent:
            return None
        if snap.run_id not in self.roots:
            root = await tether.root_of(await self.client(), snap)
            if root is None:
                return None  # read again next time
            if len(self.roots) >= MAX_GOALS_KEPT:
                self.roots.pop(next(iter(self.roots)))
            self.roots[snap.run_id] = root
        return self.roots[snap.run_id]

    async def _goal(self, run_id: str) -> str | None:
        """The run's goal (``client.run_goal``), read once per run: a run's start never changes."""
        if run_id not in self.goals:
            goal = await tether.run_goal(await self.client(), run_id)
            if goal is None:
                return None  # read again next time (it may be readable then)
            if len(self.goals) >= MAX_GOALS_KEPT:
                self.goals.pop(next(iter(self.goals)))
            self.goals[run_id] = goal
        return self.goals[run_id]

    @staticmethod
    def _record(r: TransitionRecord) -> dict[str, Any]:
        return {
            "seq": r.seq, "at": r.at.isoformat(), "kind": r.kind, "from": r.from_state.value,
            "to": r.to_state.value, "actor": r.actor, "reason": r.reason, "rule": r.rule,
            "decision_id": r.refs.decision_id,
        }

    # ------------------------------------------------------------------ deciding

    async def decide(self, person: Person, run_id: str, body: DecisionBody) -> dict[str, Any]:
        """Send the decision through client.decide; the outcome as the run recorded (or refused) it."""
        document, snap, records, signer, refusal = await self._visible(person, run_id)
        temporal = await self.client()
        decision_id = desk.decision_id(run_id, body.request_id, body.plan_hash, person.name, body.kind)
        if refusal is not None and not desk.has_acted(person.name, snap, records):
            # Shown only to say why not (a run judged under another policy file): nothing is sent.
            return self._outcome(decision_id, "refused", rule=refusal.rule, reason=refusal.message)
        comment = body.comment.strip() if body.comment and body.comment.strip() else None
        if body.kind == "reject" and comment is None:
            return self._outcome(decision_id, "refused", rule="reason_required", reason="a rejection needs a reason")
        given = tether.DecisionInput(
            by=person.name,
            plan_hash=body.plan_hash,
            request_id=body.request_id,
            decision_id=decision_id,
            comment=comment if body.kind == "approve" else None,
            reason=comment if body.kind == "reject" else None,
            key=self.key_path if signer else None,
            attest_as=signer,
        )
        try:
            # The run as read above (its worker probed) holds the request decided: not read again.
            verdict = await tether.decide(temporal, run_id, body.kind, given, held=snap)
        except tether.TetherError as e:
            if e.code == tether.PENDING:  # accepted, the run is still checking it: not an error
                return self._outcome(decision_id, "sent", reason=str(e))
            if not isinstance(e, tether.Refused):
                raise
            # The same decision again (a double click, a re-sent form): show what the first got.
            waits = 25 if e.rule == "duplicate_decision" else 1  # the first may still be in flight
            record = await self._record_of(run_id, decision_id, tries=waits)
            if record is not None and record.kind != "refused":
                return self._from_record(decision_id, record, repeated=True)
            outcome = self._outcome(decision_id, "refused", rule=e.rule, reason=str(e))
            log.info("decision %s on %s by %s: refused (%s)", decision_id, run_id, person.name, e.rule)
            return outcome
        log.info("decision %s on %s by %s: %s", decision_id, run_id, person.name,
                 verdict.record.kind if verdict.record else "sent")
        if verdict.record is None:
            return self._outcome(decision_id, "sent", reason="sent; the run has not recorded it yet")
        return self._from_record(decision_id, verdict.record)

    async def _record_of(self, run_id: str, decision_id: str, *, tries: int) -> TransitionRecord | None:
        for attempt in range(tries):
            records = await tether.timeline(await self.client(), run_id)
            for record in reversed(records):
                if record.refs.decision_id == decision_id:
                    return record
            if attempt + 1 < tries:
                await asyncio.sleep(0.2)
        return None

    def _from_record(self, decision_id: str, record: TransitionRecord, repeated: bool = False) -> dict[str, Any]:
        return self._outcome(
            decision_id, record.kind, state=record.to_state.value, actor=record.actor, reason=record.reason,
            rule=record.rule, repeated=repeated,
        )

    @staticmethod
    def _outcome(decision_id: str, outcome: str, **fields: Any) -> dict[str, Any]:
        result = {"decision_id": decision_id, "outcome": outcome, "state": None, "actor": None, "reason": "",
                  "rule": None, "repeated": False, **fields}
        result["stale"] = result["rule"] in desk.STALE_RULES
        if result["stale"]:
            result["message"] = desk.CHANGED
        return result


def signing_key(path: Path | None) -> tuple[Path | None, str | None]:
    """The inbox's key file and its raw Ed25519 public key (base64), or (None, None) without one."""
    if path is None or not path.exists():
        return None, None
    from cryptography.hazmat.primitives import serialization

    key = tether.load_private_key(path)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return path, base64.b64encode(raw).decode()

