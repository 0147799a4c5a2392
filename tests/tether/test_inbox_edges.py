"""The inbox's edges over HTTP (a real uvicorn server, the session's dev server, a worker): the
dev sign-in's Host and sessions, malformed tokens, oversized bodies, one visibility rule for
GET and POST, run ids with `/`, and what an approver reads (money, effects, approvals left)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from pathlib import Path
from urllib.parse import quote, urlsplit

import httpx
import jwt
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ec, rsa

import tether.client as tether_client
from tether.inbox.app import InboxConfig, create_app
from tether.inbox.identity import SESSION_COOKIE
from tests.helpers.billing import Billing
from tests.helpers.runs import make_request
from tests.helpers.inbox_stack import AUDIENCE, ISSUER, Stack, _serve, inbox_stack
from tests.helpers.ports import free_port


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(dev_env, tmp_path_factory) -> Stack:
    async with inbox_stack(dev_env, tmp_path_factory.mktemp("inbox-edges"), dev_login=True) as s:
        yield s


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def body(snap, kind: str = "approve", **fields) -> dict:
    return {"kind": kind, "request_id": snap.pending_approval.request_id, "plan_hash": snap.pending_approval.plan_hash, **fields}


async def sign_in(http: httpx.AsyncClient, name: str) -> str:
    r = await http.post("/login", data={"name": name})
    assert r.status_code == 303, r.text
    return r.cookies[SESSION_COOKIE]


@pytest.mark.asyncio(loop_scope="session")
async def test_dev_sign_in_answers_only_at_loopback_names_and_logout_ends_the_session(stack: Stack) -> None:
    port = urlsplit(stack.dev_url).port
    async with httpx.AsyncClient(base_url=stack.dev_url) as http:
        # A DNS-rebound page: its own host name for 127.0.0.1, same-origin to the browser.
        rebound = {"Host": f"rebind.example:{port}", "Origin": f"http://rebind.example:{port}", "Sec-Fetch-Site": "same-origin"}
        r = await http.post("/login", data={"name": "bob"}, headers=rebound)
        assert r.status_code == 400 and SESSION_COOKIE not in r.cookies
        assert (await http.get("/login", headers=rebound)).status_code == 400

        session = await sign_in(http, "bob")
        http.cookies.clear()
        cookie = {"Cookie": f"{SESSION_COOKIE}={session}"}
        assert (await http.get("/api/approvals", headers=cookie)).json()["person"] == "bob"
        assert (await http.get("/api/approvals", headers={**cookie, "Host": f"localhost:{port}"})).status_code == 200
        assert (await http.get("/api/approvals", headers={**cookie, "Host": f"rebind.example:{port}"})).status_code == 400
        # The session token is never a Bearer token.
        assert (await http.get("/api/approvals", headers=bearer(session))).status_code == 401
        # Signed out: the same cookie (a copy kept anywhere) is refused from now on.
        assert (await http.post("/logout", headers=cookie)).status_code == 303
        assert (await http.get("/api/approvals", headers=cookie)).status_code == 401
        signed_out = await http.get("/", headers=cookie)  # the dev root leads to the sign-in again
        assert signed_out.status_code in (303, 401) and "bob" not in signed_out.text
        other = await sign_in(http, "bob")  # a new session still works
        assert other != session
        assert (await http.get("/api/approvals", headers={"Cookie": f"{SESSION_COOKIE}={other}"})).status_code == 200


@pytest.mark.asyncio(loop_scope="session")
async def test_every_malformed_token_is_401_never_500(stack: Stack, dev_env, tmp_path: Path) -> None:
    # A JWKS with the SSO's EC key and an RSA key: a token naming the one key with the other
    # key's algorithm is malformed, as are broken headers of every kind.
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    jwks = stack.sso.jwks()
    jwks["keys"].append({**rsa_jwk, "kid": "rsa-1", "use": "sig"})
    (tmp_path / "jwks.json").write_text(json.dumps(jwks))
    app = create_app(InboxConfig(policy=stack.policy, jwks=str(tmp_path / "jwks.json"), issuer=ISSUER, audience=AUDIENCE),
                     temporal=dev_env.client)
    port = free_port()
    server, task = await _serve(app, port)
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": AUDIENCE, "preferred_username": "bob", "exp": now + 300}

    def raw(header: object, payload: object = claims, signature: bytes = b"sig") -> str:
        part = lambda v: base64.urlsafe_b64encode(v if isinstance(v, bytes) else json.dumps(v).encode()).rstrip(b"=").decode()  # noqa: E731
        return f"{part(header)}.{part(payload)}.{part(signature)}"

    ec_other = ec.generate_private_key(ec.SECP256R1())
    malformed = {
        "ES256 with an RSA key's kid": jwt.encode(claims, ec_other, algorithm="ES256", headers={"kid": "rsa-1"}),
        "RS256 with the EC key's kid": jwt.encode(claims, rsa_key, algorithm="RS256", headers={"kid": "sso-1"}),
        "kid a list": raw({"alg": "ES256", "kid": ["sso-1"]}),
        "kid an object": raw({"alg": "ES256", "kid": {"a": 1}}),
        "header a list": raw(["ES256"]),
        "header not JSON": raw(b"\xff\xfe not json"),
        "payload not JSON": raw({"alg": "ES256", "kid": "sso-1"}, b"\x00\x01"),
        "payload a list": raw({"alg": "ES256", "kid": "sso-1"}, [1, 2]),
        "alg a number": raw({"alg": 256, "kid": "sso-1"}),
        "two parts": "abc.def",
        "not base64": "!!!.@@@.###",
        "non-ASCII": "ünïcödé.tökén.sïg",
        "oversized": "a" * 20_000,
        "name claim a list": stack.sso.token("bob", preferred_username=["bob"]),
        "name not usable": stack.sso.token("\u202ebob"),
    }
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for what, token in malformed.items():
                for path in ("/api/approvals", "/"):
                    r = await http.get(path, headers={"Authorization": b"Bearer " + token.encode()})
                    assert r.status_code == 401, (what, path, r.status_code, r.text[:200])
            assert (await http.get("/api/approvals", headers=bearer(stack.sso.token("bob")))).status_code == 200
    finally:
        server.should_exit = True
        await task


async def _status_after_sending(url: str, head: bytes, chunks: int, chunk: bytes) -> tuple[bytes, int]:
    """Send ``head`` and then up to ``chunks`` chunks while reading the answer; the status line
    and how many body bytes went out before the answer came."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    sent = 0

    async def send() -> None:
        nonlocal sent
        writer.write(head)
        for _ in range(chunks):
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)

    sender = asyncio.create_task(send())
    try:
        status = await asyncio.wait_for(reader.readline(), 120)
    finally:
        sender.cancel()
        writer.close()
    return status, sent


@pytest.mark.asyncio(loop_scope="session")
async def test_a_huge_body_is_refused_before_it_is_read(stack: Stack, billing: Billing) -> None:
    run_id = await stack.start()
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    token = stack.sso.token("bob")
    size = 150 * 1024 * 1024
    path = f"/api/runs/{run_id}/decisions"
    host = urlsplit(stack.url).netloc
    common = f"Host: {host}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n"
    # Declared: refused at once, before a byte of it is read.
    status, _ = await _status_after_sending(
        stack.url, f"POST {path} HTTP/1.1\r\n{common}Content-Length: {size}\r\n\r\n".encode(), 0, b"")
    assert status.startswith(b"HTTP/1.1 413"), status
    # Chunked (no length): refused once the cap is passed; the sender is stopped long before 150 MB.
    chunk = b"%x\r\n%s\r\n" % (1024 * 1024, b'"' + b"a" * (1024 * 1024 - 1))
    status, sent = await _status_after_sending(
        stack.url, f"POST {path} HTTP/1.1\r\n{common}Transfer-Encoding: chunked\r\n\r\n".encode() + b'1\r\n[\r\n', 150, chunk)
    assert status.startswith(b"HTTP/1.1 413"), status
    assert sent < size, "the inbox read all of it"
    async with httpx.AsyncClient(base_url=stack.url) as http:  # a normal decision still goes through
        r = await http.post(path, headers=bearer(token), json=body(snap, "reject", comment="too much"))
    assert r.status_code == 200 and r.json()["state"] == "REJECTED", r.text


@pytest.mark.asyncio(loop_scope="session")
async def test_post_answers_like_get_for_who_may_see_the_run(stack: Stack, billing: Billing) -> None:
    run_id = await stack.start()
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    async with httpx.AsyncClient(base_url=stack.url) as http:
        for name in ("alice", "dana"):  # the requester (four-eyes); a support role
            token = stack.sso.token(name)
            assert (await http.get(f"/api/runs/{run_id}", headers=bearer(token))).status_code == 404
            for kind, fields in (("approve", {}), ("reject", {"comment": "no"})):
                r = await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(token), json=body(snap, kind, **fields))
                assert r.status_code == 404, (name, kind, r.text)
                assert snap.pending_approval.plan_hash[:12] not in r.text and "AWAITING" not in r.text
        bob = bearer(stack.sso.token("bob"))
        for junk in ("h", "0" * 11, "not-a-hash-at-all"):  # refused as malformed, never sent
            r = await http.post(f"/api/runs/{run_id}/decisions", headers=bob, json={**body(snap), "plan_hash": junk})
            assert r.status_code == 422, (junk, r.text)
        unknown = f"/api/runs/no-such-{uuid.uuid4().hex[:6]}/decisions"
        r = await http.post(unknown, headers=bearer(stack.sso.token("bob")), json=body(snap))
        assert r.status_code == 404
    after = await tether_client.snapshot(stack.client, run_id)
    assert after.approved_by == [] and after.timeline_records == snap.timeline_records
    await stack.client.get_workflow_handle(run_id).cancel(reason="test over")  # an operator's cancel


@pytest.mark.asyncio(loop_scope="session")
async def test_a_run_id_with_slashes_is_listed_opened_and_decided(stack: Stack, billing: Billing) -> None:
    run_id = f"team/refunds/{uuid.uuid4().hex[:8]}"
    await tether_client.start_run(stack.client, make_request(tenant=stack.tenant), run_id=run_id, queue=stack.worker.task_queue)
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    await stack.visible(run_id)
    bob = bearer(stack.sso.token("bob"))
    async with httpx.AsyncClient(base_url=stack.url) as http:
        assert run_id in [r["run_id"] for r in (await http.get("/api/approvals", headers=bob)).json()["approvals"]]
        listed = (await http.get("/", headers=bob)).text
        link = f'href="/run?id={quote(run_id, safe="")}"'
        assert link in listed, listed
        for path in (f"/runs/{run_id}", f"/runs/{quote(run_id, safe='')}"):
            page = await http.get(path, headers=bob)
            assert page.status_code == 200 and "issue_refund" in page.text, (path, page.status_code)
        live = await http.get(f"/runs/{run_id}/live", headers=bob)
        assert live.status_code == 200 and 'id="plan-hash"' in live.text
        assert (await http.get(f"/api/runs/{run_id}", headers=bob)).json()["run_id"] == run_id
        r = await http.post(f"/api/runs/{run_id}/decisions", headers=bob, json=body(snap))
        assert r.status_code == 200 and r.json()["state"] == "APPROVED", r.text
    assert (await stack.wait(run_id, "COMPLETED")).approved_by == ["bob"]


@pytest.mark.asyncio(loop_scope="session")
async def test_an_approver_reads_money_effects_in_words_and_the_approvals_left(stack: Stack, billing: Billing) -> None:
    run_id = await stack.start()
    await stack.wait(run_id, "AWAITING_APPROVAL")
    await stack.visible(run_id)
    bob = bearer(stack.sso.token("bob"))
    async with httpx.AsyncClient(base_url=stack.url) as http:
        run = (await http.get(f"/api/runs/{run_id}", headers=bob)).json()
        listed = (await http.get("/", headers=bob)).text
        page = (await http.get(f"/runs/{run_id}", headers=bob)).text
    assert [s["does"] for s in run["steps"]] == [
        "read-only", "can be undone by void_refund", "can be undone by reverse_ledger_entry", "cannot be undone; unsafe: never re-run"]
    assert run["steps"][1]["money"] == {"amount_cents": "49.99 EUR"} and run["steps"][2]["money"] == {"amount_cents": "-49.99 EUR"}
    assert run["pending"]["approvals_needed"] == "0 of 1 approval(s); 1 more needed from someone with role approver"
    # No markup characters where the plan is shown (the timeline quotes the run's own records).
    plan = page.split('<table class="steps">', 1)[1].split("</table>", 1)[0]
    rows = listed.split('<table class="runs">', 1)[1].split("</table>", 1)[0]
    for html in (plan, rows):
        assert "49.99 EUR" in html and "`" not in html, html
    assert "<strong class=\"money\">49.99 EUR</strong> (4999)" in page and "cannot be undone" in page
    assert "1 more needed from someone with role approver" in listed
    await stack.client.get_workflow_handle(run_id).cancel(reason="test over")  # an operator's cancel
