"""The inbox web app: pages for people, the same as JSON for scripts.

    tether inbox --port 8900 --dev-login                       # local: a sign-in page
    tether inbox --port 8900 --jwks https://sso/jwks.json --issuer https://sso --audience tether

Pages: ``/`` (waiting on me), ``/run?id=ID`` (the run, and the decide form), ``/login`` (dev).
JSON: ``GET /api/approvals``, ``GET /api/runs/{id}``, ``POST /api/runs/{id}/decisions``.
Every request needs a verified identity (401 otherwise); every decision goes through
``client.decide``, signed as an attestation when the policy trusts this inbox's key.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Form, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from temporalio.client import Client

from tether.policy.files import PolicyFileError, PolicyStore
from tether.connection import TetherError, UsageError
from tether.inbox import desk, pages
from tether.inbox.guards import MAX_BODY_BYTES, SECURITY_HEADERS, BodyLimit, loopback_host, same_origin
from tether.inbox.identity import DEV_SESSION_SECONDS, SESSION_COOKIE, DevLogin, Person, Unauthenticated, Verifier, load_subjects
from tether.inbox.service import DecisionBody, Inbox, InboxConfig, NotYours, signing_key
from workflows.contract import STRICT

__all__ = ["InboxConfig", "check_config", "create_app", "serve"]
log = logging.getLogger("tether.inbox")


def check_config(config: InboxConfig) -> None:
    """Refuse what is unsafe or incomplete before serving anything (TetherError, exit code 2)."""
    if config.dev_login:
        if config.host not in ("127.0.0.1", "localhost"):
            raise UsageError(
                f"--dev-login lets anyone pick who they are: it is refused unless bound to 127.0.0.1 (not {config.host})",
                field="dev_login",
            )
        if config.jwks:
            raise UsageError("--dev-login and --jwks exclude each other", field="dev_login")
    elif not (config.jwks and config.issuer and config.audience):
        raise UsageError(
            "the inbox needs an identity: --jwks FILE|URL --issuer ISS --audience AUD (or --dev-login on 127.0.0.1)",
            field="jwks",
        )


def create_app(config: InboxConfig, temporal: Client | None = None) -> FastAPI:
    check_config(config)
    try:
        store = PolicyStore(config.policy)
        store.load()
    except PolicyFileError as e:
        raise UsageError(f"policy: {e}") from None
    dev = DevLogin() if config.dev_login else None
    if dev is not None:
        verifier = dev.verifier
    else:
        try:
            subjects = load_subjects(config.subjects) if config.subjects is not None else None
            verifier = Verifier(jwks=config.jwks or "", issuer=config.issuer or "", audience=config.audience or "",
                                claim=config.claim, subjects=subjects)
        except ValueError as e:
            raise UsageError(str(e), field="subjects" if str(e).startswith("--subjects") else "jwks") from None
    key_path, public_key = signing_key(config.key)
    inbox = Inbox(config=config, store=store, verifier=verifier, dev=dev, temporal=temporal,
                  key_path=key_path, public_key=public_key)
    if public_key is None:
        log.warning("no signing key (%s): decisions are sent unattested; tenants with require_signatures "
                    "refuse them", config.key)

    app = FastAPI(title="Tether inbox", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.inbox = inbox
    templates = pages.templates()
    app.mount("/static", StaticFiles(directory=str(pages.STATIC)), name="static")

    @app.middleware("http")
    async def security(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if dev is not None and not loopback_host(request):
            # A DNS-rebound page (its own name for 127.0.0.1) is same-origin to the browser: dev
            # sign-in answers only to the loopback names it is bound to.
            response: Response = JSONResponse(
                {"error": "host", "detail": "dev sign-in answers only at 127.0.0.1 or localhost"}, 400)
        elif request.method == "POST" and not same_origin(request):
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

    @app.exception_handler(TetherError)
    async def temporal_error(request: Request, e: TetherError) -> Response:
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

    # A run's pages take its id as data: ``/run?id=ID`` (pages.run_href, what every link says),
    # so no id (``..``, ``/``, ``%2f``, ``?``, ``#``, Unicode) opens another run. ``/runs/{id}``
    # stays for links made before; a run id may hold `/` there (`{run_id:path}`), the live
    # fragment's route first.
    async def live_fragment(request: Request, run_id: str, shown: str) -> Response:
        person = await inbox.identify(request)
        run = await inbox.run(person, run_id)
        return page(request, "_run_live.html", person=person, run=run, shown_request=shown)

    async def run_view(request: Request, run_id: str) -> Response:
        person = await inbox.identify(request)
        run = await inbox.run(person, run_id)
        return page(request, "run.html", person=person, run=run, outcome=None, shown=run["pending"])

    async def decide_posted(request: Request, run_id: str, kind: str, request_id: str, plan_hash: str,
                            comment: str, csrf: str) -> Response:
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

    @app.get("/run/live", response_class=HTMLResponse)
    async def run_live_by_id(request: Request, id: str = Query(..., max_length=4096), shown: str = "") -> Response:
        return await live_fragment(request, id, shown)

    @app.get("/run", response_class=HTMLResponse)
    async def run_page_by_id(request: Request, id: str = Query(..., max_length=4096)) -> Response:
        return await run_view(request, id)

    @app.post("/run/decide", response_class=HTMLResponse)
    async def decide_form_by_id(
        request: Request, id: str = Query(..., max_length=4096), kind: str = Form(...), request_id: str = Form(...),
        plan_hash: str = Form(...), comment: str = Form(""), csrf: str = Form(""),
    ) -> Response:
        return await decide_posted(request, id, kind, request_id, plan_hash, comment, csrf)

    @app.get("/runs/{run_id:path}/live", response_class=HTMLResponse)
    async def run_live(request: Request, run_id: str, shown: str = "") -> Response:
        return await live_fragment(request, run_id, shown)

    @app.get("/runs/{run_id:path}", response_class=HTMLResponse)
    async def run_page(request: Request, run_id: str) -> Response:
        return await run_view(request, run_id)

    @app.post("/runs/{run_id:path}/decide", response_class=HTMLResponse)
    async def decide_form(
        request: Request, run_id: str, kind: str = Form(...), request_id: str = Form(...), plan_hash: str = Form(...),
        comment: str = Form(""), csrf: str = Form(""),
    ) -> Response:
        return await decide_posted(request, run_id, kind, request_id, plan_hash, comment, csrf)

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
