"""The inbox web app: pages for people, the same as JSON for scripts.

    tether inbox --port 8900 --dev-login                       # local: a sign-in page
    tether inbox --port 8900 --jwks https://sso/jwks.json --issuer https://sso --audience tether

Pages: ``/`` (waiting on me), ``/runs/{id}`` (the run, and the decide form), ``/login`` (dev).
JSON: ``GET /api/approvals``, ``GET /api/runs/{id}``, ``POST /api/runs/{id}/decisions``.
Every request needs a verified identity (401 otherwise); every decision goes through
``client.decide``, signed as an attestation when the policy trusts this inbox's key.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit

import jinja2
from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import Field
from temporalio.client import Client

import client as tether
from activities.policy_file import PolicyFileError, PolicyStore
from inbox import desk
from inbox.identity import SESSION_COOKIE, DEV_SESSION_SECONDS, DevLogin, Person, Unauthenticated, Verifier
from workflows import wording
from workflows.display import escape_text, show_value
from workflows.contract import STRICT, Contract
from workflows.run_state import RunSnapshot
from workflows.states import TERMINAL, RunState, TransitionRecord

log = logging.getLogger("tether.inbox")
HERE = Path(__file__).resolve().parent
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
SECURITY_HEADERS = {
    # No inline script or style anywhere: only the inbox's own static files.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
}
MAX_RUNS_LISTED = 200
# A decision is a few fields and a comment of at most 2,000 characters.
MAX_BODY_BYTES = 64 * 1024


@dataclass
class InboxConfig:
    policy: Path
    dev_login: bool = False
    jwks: str | None = None
    issuer: str | None = None
    audience: str | None = None
    claim: str = "preferred_username"
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

    def document(self):  # noqa: ANN201
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
        if same is False:
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
        for tenant_name in desk.tenants_of(document, person.name):
            tenant = document.tenants[tenant_name]
            runs = await tether.list_runs(
                temporal, state=RunState.AWAITING_APPROVAL.value, tenant=tenant_name, limit=MAX_RUNS_LISTED
            )
            # What each run published where it waits (no worker, nothing reaches the run); a run
            # that has published nothing yet is asked.
            snaps = await asyncio.gather(*(self._published(r) for r in runs))
            can_attest = desk.attester(document, self.public_key, tenant_name) is not None
            for snap, published_at in snaps:
                if snap is None or snap.tenant != tenant_name:
                    continue
                if desk.decide_refusal(tenant, snap, person.name, now=now, can_attest=can_attest) is None:
                    rows.append({**self._row(snap, now), "as_of": self._as_of(published_at, now)})
        rows.sort(key=lambda r: r["expires_at"])
        return rows

    async def _published(self, row: tether.RunSummary) -> tuple[RunSnapshot | None, datetime | None]:
        if row.view is not None:
            return row.view.snapshot, row.view.published_at
        if row.view_unverified:
            return None, None  # only runs whose view the fleet signed are listed
        try:
            return await tether.snapshot(await self.client(), row.run_id), None
        except tether.TetherError:
            return None, None  # ended or gone since the list was made, or nobody serves it

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

    async def _member_snapshot(self, person: Person, run_id: str, live: bool = False):  # noqa: ANN202
        """The policy, the run's status as it published it (``live``: as the run answers now)
        and its latest records, when the policy lists the person in its tenant."""
        document = self.document()
        try:
            snap, records = await tether.read_run(await self.client(), run_id, live=live)
        except tether.TetherError as e:
            if e.rule == "unknown_run":
                raise NotYours() from None
            raise
        if snap.tenant not in desk.tenants_of(document, person.name):
            raise NotYours()
        return document, snap, records

    async def _visible(self, person: Person, run_id: str, live: bool = False):  # noqa: ANN202
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
                "done": view.n <= snap.step,
            })
        pending = snap.pending_approval
        # Each ok write and where it stands (kept, undone by which run, may have applied): the
        # undo ledger's word for an ended run (client.undo_standing), one wording for every view.
        compensations = await tether.undo_standing(snap.compensations) if snap.state in TERMINAL else snap.compensations
        writes = [
            {"of": c.of, "of_tool": c.of_tool, "undo": c.tool, "status": c.status, "standing": wording.standing(c),
             "by": c.undone_by or None, "at": c.undone_at.isoformat() if c.undone_at else None}
            for c in compensations
        ]
        return {
            "run_id": snap.run_id,
            "tenant": snap.tenant,
            "state": snap.state.value,
            "state_version": snap.state_version,
            "ended": snap.state in TERMINAL,
            "requested_by": snap.requested_by,
            "requester_verified": snap.requester_verified,
            "plan_hash": snap.plan.plan_hash if snap.plan else None,
            "plan_version": snap.plan.version if snap.plan else 0,
            "steps": steps,
            "writes": writes,
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
            "stuck": None if snap.stuck is None else f"its workflow task keeps failing (attempt {snap.stuck.attempt}): {snap.stuck.error}",
            "web_ui": f"{self.config.web_ui.rstrip('/')}/namespaces/{quote(self.config.namespace)}/workflows/{quote(snap.run_id)}",
        }

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
            if e.code != tether.REFUSED:
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


# ----------------------------------------------------------------------------- the app


def _public_key(path: Path | None) -> tuple[Path | None, str | None]:
    if path is None or not path.exists():
        return None, None
    from cryptography.hazmat.primitives import serialization

    key = tether.load_private_key(path)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return path, base64.b64encode(raw).decode()


def check_config(config: InboxConfig) -> None:
    """Refuse what is unsafe or incomplete before serving anything (TetherError, exit code 2)."""
    if config.dev_login:
        if config.host not in ("127.0.0.1", "localhost"):
            raise tether.TetherError(
                f"--dev-login lets anyone pick who they are: it is refused unless bound to 127.0.0.1 (not {config.host})",
                field="dev_login",
            )
        if config.jwks:
            raise tether.TetherError("--dev-login and --jwks exclude each other", field="dev_login")
    elif not (config.jwks and config.issuer and config.audience):
        raise tether.TetherError(
            "the inbox needs an identity: --jwks FILE|URL --issuer ISS --audience AUD (or --dev-login on 127.0.0.1)",
            field="jwks",
        )


def create_app(config: InboxConfig, temporal: Client | None = None) -> FastAPI:
    check_config(config)
    try:
        store = PolicyStore(config.policy)
        store.load()
    except PolicyFileError as e:
        raise tether.TetherError(f"policy: {e}") from None
    dev = DevLogin() if config.dev_login else None
    if dev is not None:
        verifier = dev.verifier
    else:
        try:
            verifier = Verifier(jwks=config.jwks or "", issuer=config.issuer or "", audience=config.audience or "",
                                claim=config.claim)
        except ValueError as e:
            raise tether.TetherError(str(e), field="jwks") from None
    key_path, public_key = _public_key(config.key)
    inbox = Inbox(config=config, store=store, verifier=verifier, dev=dev, temporal=temporal,
                  key_path=key_path, public_key=public_key)
    if public_key is None:
        log.warning("no signing key (%s): decisions are sent unattested; tenants with require_signatures "
                    "refuse them", config.key)

    app = FastAPI(title="Tether inbox", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.inbox = inbox
    # Autoescape on for every template (HTML); untrusted text also goes through workflows/display.py
    # (filters t and v), which shows controls, bidi overrides and invisible characters as escapes.
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(HERE / "templates")), autoescape=True)
    templates = Jinja2Templates(env=env)
    env.filters["t"] = lambda v, limit=None: escape_text("" if v is None else v, limit)
    env.filters["v"] = lambda v, limit=None: show_value(v, limit)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")

    @app.middleware("http")
    async def security(request: Request, call_next):  # noqa: ANN001, ANN202
        if dev is not None and not _loopback_host(request):
            # A DNS-rebound page (its own name for 127.0.0.1) is same-origin to the browser: dev
            # sign-in answers only to the loopback names it is bound to.
            response: Response = JSONResponse(
                {"error": "host", "detail": "dev sign-in answers only at 127.0.0.1 or localhost"}, 400)
        elif request.method == "POST" and not _same_origin(request):
            response = JSONResponse({"error": "cross_origin", "detail": "cross-site post refused"}, 403)
        else:
            response = await call_next(request)
        for k, v in SECURITY_HEADERS.items():
            response.headers.setdefault(k, v)
        return response

    def page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        context.setdefault("dev_login", dev is not None)
        context.setdefault("poll_ms", config.poll_ms)
        try:
            context.setdefault("inbox_policy", inbox.policy())
        except PolicyFileError:
            context.setdefault("inbox_policy", {"policy": store.source, "policy_hash": "invalid"})
        if isinstance(context.get("person"), Person):
            context.setdefault("csrf", inbox.csrf_token(context["person"]))
        return templates.TemplateResponse(request, name, context, status_code=status)

    @app.exception_handler(Unauthenticated)
    async def unauthenticated(request: Request, e: Unauthenticated) -> Response:
        log.info("401 %s %s: %s", request.method, request.url.path, e)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": "unauthenticated", "detail": str(e)}, 401,
                                headers={"WWW-Authenticate": 'Bearer realm="tether-inbox"'})
        if dev is not None and request.method == "GET":
            return RedirectResponse("/login", status_code=303)  # the dev sign-in is here: go there
        return page(request, "signin_needed.html", 401, person=None)

    @app.exception_handler(NotYours)
    async def not_found(request: Request, e: NotYours) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": "not_found", "detail": "no such run among yours"}, 404)
        return page(request, "error.html", 404, person=None, message="No such run among the runs you may decide.")

    @app.exception_handler(PolicyFileError)
    async def policy_broken(request: Request, e: PolicyFileError) -> Response:
        # Edited into an invalid state while serving: nobody is shown anything until it is fixed.
        log.error("503 %s %s: %s", request.method, request.url.path, e)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": "policy", "detail": str(e)}, 503)
        return page(request, "error.html", 503, person=None, message=f"The policy file is invalid: {e}")

    @app.exception_handler(tether.TetherError)
    async def temporal_error(request: Request, e: tether.TetherError) -> Response:
        log.warning("502 %s %s: %s", request.method, request.url.path, e)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": "temporal", "detail": str(e)}, 502)
        return page(request, "error.html", 502, person=None, message=str(e))

    @app.get("/healthz")
    async def healthz() -> Response:
        # Which policy file this inbox reads, and its hash: the workers' should be the same. A
        # change that did not load: serving by the last good one, and saying why.
        try:
            found = {"status": "ok", **inbox.policy()}
        except PolicyFileError as e:
            return JSONResponse({"status": "policy_invalid", "policy": store.source, "detail": str(e)}, 503)
        if inbox.store.problem is not None:
            found["policy_problem"] = inbox.store.problem
        return JSONResponse(found)

    # ------------------------------------------------------------------ sign-in (dev only)

    @app.get("/login", response_class=HTMLResponse)
    async def login_page(request: Request) -> Response:
        if dev is None:
            return page(request, "error.html", 404, person=None, message="Sign in through your organisation's sign-in.")
        document = inbox.document()
        people = sorted({p for t in (document.tenants.values() if document else []) for p in (t.approvers or {})})
        return page(request, "login.html", person=None, people=people)

    @app.post("/login")
    async def login(request: Request, name: str = Form(...)) -> Response:
        if dev is None:
            return page(request, "error.html", 404, person=None, message="No dev sign-in here.")
        document = inbox.document()
        people = {p for t in (document.tenants.values() if document else []) for p in (t.approvers or {})}
        if name not in people:
            return page(request, "login.html", 400, person=None, people=sorted(people), error="not a person the policy lists")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(SESSION_COOKIE, dev.mint(name), max_age=DEV_SESSION_SECONDS, httponly=True,
                            samesite="strict", path="/")
        return response

    @app.post("/logout")
    async def logout(request: Request) -> Response:
        if dev is not None and (token := request.cookies.get(SESSION_COOKIE)):
            dev.revoke(token)  # a copy of the cookie dies with it
        response = RedirectResponse("/login" if dev else "/", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    # ------------------------------------------------------------------ pages

    @app.get("/", response_class=HTMLResponse)
    async def waiting_page(request: Request) -> Response:
        person = await inbox.identify(request)
        rows = await inbox.waiting(person)
        return page(request, "waiting.html", person=person, rows=rows,
                    tenants=desk.tenants_of(inbox.document(), person.name))

    @app.get("/live/waiting", response_class=HTMLResponse)
    async def waiting_live(request: Request) -> Response:
        person = await inbox.identify(request)
        rows = await inbox.waiting(person)
        return page(request, "_waiting_rows.html", person=person, rows=rows)

    # The live fragment before the page: a run id may hold `/` (`{run_id:path}`).
    @app.get("/runs/{run_id:path}/live", response_class=HTMLResponse)
    async def run_live(request: Request, run_id: str, shown: str = "") -> Response:
        person = await inbox.identify(request)
        run = await inbox.run(person, run_id)
        return page(request, "_run_live.html", person=person, run=run, shown_request=shown)

    @app.get("/runs/{run_id:path}", response_class=HTMLResponse)
    async def run_page(request: Request, run_id: str) -> Response:
        person = await inbox.identify(request)
        run = await inbox.run(person, run_id)
        return page(request, "run.html", person=person, run=run, outcome=None, shown=run["pending"])

    @app.post("/runs/{run_id:path}/decide", response_class=HTMLResponse)
    async def decide_form(
        request: Request,
        run_id: str,
        kind: str = Form(...),
        request_id: str = Form(...),
        plan_hash: str = Form(...),
        comment: str = Form(""),
        csrf: str = Form(""),
    ) -> Response:
        person = await inbox.identify(request)
        if not inbox.csrf_ok(person, csrf):
            log.info("403 decide on %s by %s: bad CSRF token", run_id, person.name)
            return page(request, "error.html", 403, person=person, message="This form expired: open the run again.")
        try:
            body = DecisionBody.model_validate(
                {"kind": kind, "request_id": request_id, "plan_hash": plan_hash, "comment": comment or None},
                context=STRICT,
            )
        except ValueError:
            return page(request, "error.html", 400, person=person, message="That decision form was not complete.")
        outcome = await inbox.decide(person, run_id, body)
        try:
            run = await inbox.run(person, run_id, live=True)
        except NotYours:
            run = None  # e.g. refused, and not a run this person could decide
        status = 409 if outcome["outcome"] == "refused" else 200
        if run is None:
            return page(request, "outcome.html", status, person=person, outcome=outcome, run_id=run_id)
        return page(request, "run.html", status, person=person, run=run, outcome=outcome, shown=run["pending"])

    # ------------------------------------------------------------------ JSON

    @app.get("/api/approvals")
    async def api_approvals(request: Request) -> Response:
        person = await inbox.identify(request)
        rows = await inbox.waiting(person)
        return JSONResponse({"person": person.name, "approvals": rows})

    @app.get("/api/runs/{run_id:path}")
    async def api_run(request: Request, run_id: str) -> Response:
        person = await inbox.identify(request)
        return JSONResponse(await inbox.run(person, run_id))

    @app.post("/api/runs/{run_id:path}/decisions")
    async def api_decide(request: Request, run_id: str) -> Response:
        person = await inbox.identify(request)
        if person.ambient and not inbox.csrf_ok(person, request.headers.get("x-csrf-token")):
            return JSONResponse({"error": "csrf", "detail": "a post with browser credentials needs X-CSRF-Token"}, 403)
        try:
            body = DecisionBody.model_validate(await request.json(), context=STRICT)
        except ValueError as e:
            return JSONResponse({"error": "invalid", "detail": str(e).splitlines()[0][:300]}, 422)
        outcome = await inbox.decide(person, run_id, body)
        return JSONResponse(outcome, 409 if outcome["outcome"] == "refused" else 200)

    # Outermost: a body over the cap is refused before anything reads or parses it.
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    return app


class BodyLimit:
    """Refuse a request body over ``limit`` bytes (413) before the app reads it: by its
    Content-Length at once, and by counting as it streams in (chunked, or a lying length), when
    the app is told the client went away and whatever it answers is dropped."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            return await self._refuse(send)
        seen, started, refused = 0, False, False

        async def counted() -> dict:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                refused = True
                if not started:
                    await self._refuse(send)
                return {"type": "http.disconnect"}
            return message

        async def tracked(message: dict) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out: the app's own answer is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, send: Any) -> None:
        response = JSONResponse({"error": "too_large", "detail": f"request body over {self.limit} bytes"}, 413,
                                headers={"Connection": "close"})
        await response({"type": "http"}, None, send)  # type: ignore[arg-type]


def _loopback_host(request: Request) -> bool:
    host = request.headers.get("host", "")
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name.lower() in ("127.0.0.1", "localhost")


def _same_origin(request: Request) -> bool:
    """A post from a page of another site is refused (CSRF tokens are the second line).

    Browsers say where a request comes from in ``Sec-Fetch-Site``; ``Origin`` is ``null`` for
    our own form posts (Referrer-Policy no-referrer), so only a named other origin refuses.
    Scripts send neither.
    """
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return True
    return urlsplit(origin).netloc == request.headers.get("host", "")


# ----------------------------------------------------------------------------- serving


async def serve(config: InboxConfig, port: int) -> int:
    """``tether inbox``: serve until interrupted."""
    import uvicorn

    app = create_app(config)
    await app.state.inbox.client()  # Temporal reachable before anyone is told the address
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    banner = "  (dev sign-in: not for production)" if config.dev_login else ""
    print(f"Tether inbox: http://{config.host}:{port}/{banner}", flush=True)
    # No access log: request lines are ours to log (without tokens or arguments), not uvicorn's.
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=port, log_level="info", access_log=False, proxy_headers=False)
    )
    await server.serve()
    return 0


def default_key() -> Path:
    return Path(os.environ.get("TETHER_INBOX_KEY") or ".tether/keys/inbox.pem")
