"""The approver's inbox over HTTP (a real uvicorn server, the session's dev server, a worker):
identities are JWTs this test mints from its own keys; decisions go through the decide Update.

Also the attestation rule itself (activities/policy_checks.signature_refusal) and the inbox's pure
choices (tether/inbox/desk.py), tested directly.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from pathlib import Path

import httpx
import jwt
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

import tether.client as tether_client
import starter
from tether.policy.files import check_policy_file, parse_policy
from tether.policy.signatures import signature_refusal
from tether.inbox import desk
from tether.inbox.app import InboxConfig, check_config, create_app
from tests.helpers.billing import Billing
from tests.helpers.runs import PLAYBOOK
from tests.helpers.inbox_stack import AUDIENCE, ISSUER, Stack, _serve, inbox_stack, raw_public
from tests.helpers.ports import free_port
from tests.helpers.round_trips import counting_proxy
from workflows import policy
from workflows.contract import ApprovalDecision
from workflows.policy_file import Signer, TenantPolicy



@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(dev_env, tmp_path_factory) -> Stack:
    async with inbox_stack(dev_env, tmp_path_factory.mktemp("inbox")) as s:
        yield s


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def waiting_run(stack: Stack, **fields) -> tuple[str, object]:
    run_id = await stack.start(**fields)
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    return run_id, snap


def body(snap, kind: str = "approve", **fields) -> dict:
    return {"kind": kind, "request_id": snap.pending_approval.request_id, "plan_hash": snap.pending_approval.plan_hash, **fields}


# ----------------------------------------------------------------------------- identity


@pytest.mark.asyncio(loop_scope="session")
async def test_without_a_verified_identity_everything_is_401_and_nothing_is_recorded(stack: Stack, billing: Billing) -> None:
    run_id, snap = await waiting_run(stack)
    sso = stack.sso
    now = int(time.time())
    stranger = ec.generate_private_key(ec.SECP256R1())
    header, payload, _ = sso.token("bob").split(".")
    unsigned = base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT","kid":"sso-1"}').rstrip(b"=").decode()
    forged_hs = jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "preferred_username": "bob", "exp": now + 300},
                           "secret", algorithm="HS256", headers={"kid": "sso-1"})
    bad = {
        "no token": {},
        "expired": bearer(sso.token("bob", exp=now - 120)),
        "not yet valid": bearer(sso.token("bob", nbf=now + 600)),
        "no expiry": bearer(sso.token("bob", exp=None)),
        "wrong audience": bearer(sso.token("bob", aud="someone-else")),
        "wrong issuer": bearer(sso.token("bob", iss="https://evil.example")),
        "wrong key": bearer(sso.token("bob", key=stranger)),
        "alg none": bearer(f"{unsigned}.{payload}."),
        "alg HS256": bearer(forged_hs),
        "tampered": bearer(f"{header}.{payload[:-4]}AAAA.{sso.token('bob').split('.')[2]}"),
        "garbage": bearer("not-a-jwt"),
        "basic auth": {"Authorization": "Basic Ym9iOmJvYg=="},
        "no name claim": bearer(sso.token("bob", preferred_username=None)),
    }
    async with httpx.AsyncClient(base_url=stack.url) as http:
        for what, headers in bad.items():
            for method, path, payload_ in (
                ("GET", "/api/approvals", None),
                ("GET", f"/api/runs/{run_id}", None),
                ("POST", f"/api/runs/{run_id}/decisions", body(snap)),
                ("GET", "/", None),
            ):
                r = await http.request(method, path, headers=headers, json=payload_)
                assert r.status_code == 401, (what, method, path, r.status_code, r.text[:200])
    after = await tether_client.snapshot(stack.client, run_id)
    assert after.state.value == "AWAITING_APPROVAL" and after.approved_by == []
    assert after.timeline_records == snap.timeline_records and after.state_version == snap.state_version
    await stack.client.get_workflow_handle(run_id).cancel(reason="test over")  # an operator's cancel


def test_dev_login_is_refused_unless_bound_to_loopback(tmp_path: Path) -> None:
    with pytest.raises(tether_client.TetherError, match="127.0.0.1"):
        check_config(InboxConfig(policy=tmp_path / "p.toml", dev_login=True, host="0.0.0.0"))
    with pytest.raises(tether_client.TetherError, match="needs an identity"):
        check_config(InboxConfig(policy=tmp_path / "p.toml"))
    assert starter.main(["inbox", "--port", "8999", "--dev-login", "--host", "0.0.0.0"]) == 2


# ----------------------------------------------------------------------------- deciding


@pytest.mark.asyncio(loop_scope="session")
async def test_bob_approves_through_the_api_and_the_run_completes_with_one_refund(
    stack: Stack, billing: Billing, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    run_id, snap = await waiting_run(stack)
    await stack.visible(run_id)
    bob, alice, dana = (stack.sso.token(n) for n in ("bob", "alice", "dana"))
    async with httpx.AsyncClient(base_url=stack.url) as http:
        listed = (await http.get("/api/approvals", headers=bearer(bob))).json()
        assert listed["person"] == "bob"
        assert run_id in [r["run_id"] for r in listed["approvals"]]
        # alice requested it (four-eyes) and dana holds no approving role: neither is offered it.
        for other in (alice, dana):
            assert run_id not in [r["run_id"] for r in (await http.get("/api/approvals", headers=bearer(other))).json()["approvals"]]
            assert (await http.get(f"/api/runs/{run_id}", headers=bearer(other))).status_code == 404
        # A forced post by alice: as for her GET, no such run among hers (nothing of its state); nothing changes.
        forced = await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(alice), json=body(snap))
        assert forced.status_code == 404 and forced.json() == {"error": "not_found", "detail": "no such run among yours"}

        run = (await http.get(f"/api/runs/{run_id}", headers=bearer(bob))).json()
        assert run["may_decide"] and run["pending"]["deciders"] == ["bob"]
        assert [(s["tool"], s["effect"]) for s in run["steps"]][:2] == [("get_order", "read_only"), ("issue_refund", "idempotent")]
        assert run["steps"][1]["summary"]  # the tool's declared summary fields

        # Who decides is the token's, never the body's: an approver field is refused.
        sneaky = await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(alice), json={**body(snap), "approver": "bob"})
        assert sneaky.status_code == 422
        ok = await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(bob), json=body(snap, comment="checked"))
        assert ok.status_code == 200, ok.text
        first = ok.json()
        assert first["outcome"] == "transition" and first["state"] == "APPROVED"
        assert first["actor"] == "user:bob via inbox"
        # The same post again (a double click): the same decision, not a second one.
        again = (await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(bob), json=body(snap, comment="checked"))).json()
        assert again["decision_id"] == first["decision_id"] and again["outcome"] == "transition" and again["repeated"]
        r = await http.get("/", headers=bearer(bob))
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert "unsafe-inline" not in r.headers["content-security-policy"]
        assert r.headers["referrer-policy"] == "no-referrer"
    done = await stack.wait(run_id, "COMPLETED")
    assert done.approved_by == ["bob"]
    async with httpx.AsyncClient(base_url=stack.url) as http:
        # Each write and where it stands (issue 31): the refund is kept, its undo named.
        ended = (await http.get(f"/api/runs/{run_id}", headers=bearer(stack.sso.token("bob")))).json()
        page = (await http.get(f"/runs/{run_id}/live", headers=bearer(stack.sso.token("bob")))).text
    assert [(w["of_tool"], w["standing"], w["undo"]) for w in ended["writes"]][:2] == [
        ("issue_refund", "kept", "void_refund"), ("post_ledger_entry", "kept", "reverse_ledger_entry")]
    assert "<h2>Writes</h2>" in page and "<strong>kept</strong>" in page
    records = await tether_client.timeline(stack.client, run_id)
    approved = [r for r in records if r.to_state.value == "APPROVED" and r.kind == "transition"]
    assert [r.actor for r in approved] == ["user:bob via inbox"]
    key = next(r.refs.idempotency_key for r in records if r.refs.idempotency_key and "issue_refund" in r.reason)
    assert len(billing.refunds(key)) == 1
    # Nothing of a token or an argument in the inbox's logs.
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith(("tether.inbox", "uvicorn")))
    for secret in (bob, alice, bob.split(".")[2], "A-1001"):
        assert secret not in logged


@pytest.mark.asyncio(loop_scope="session")
async def test_an_approval_post_asks_the_server_at_most_five_times(stack: Stack, billing: Billing) -> None:
    """Every gRPC call the inbox makes for one approval, counted on the wire by a proxy in front of
    the dev server: the run's description and its worker probe (the page's read, the one the
    decision is sent on), then the Update and its answer (no second read, no timeline query)."""
    run_id, snap = await waiting_run(stack)
    async with counting_proxy(stack.client.service_client.config.target_host) as (address, counter):
        temporal = await tether_client.connect(target_host=address, namespace=stack.client.namespace)
        app = create_app(InboxConfig(policy=stack.policy, jwks=str(stack.key_dir / "jwks.json"), issuer=ISSUER,
                                     audience=AUDIENCE, key=stack.key_dir / "inbox.pem"), temporal=temporal)
        server, task = await _serve(app, port := free_port())
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                before = counter.calls
                r = await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(stack.sso.token("bob")), json=body(snap))
                calls = counter.calls - before
        finally:
            server.should_exit = True
            await task
    assert r.status_code == 200 and r.json()["state"] == "APPROVED", r.text
    assert before >= 1 and 4 <= calls <= 5, (before, calls)  # the connection's own call counted before
    assert (await stack.wait(run_id, "COMPLETED")).approved_by == ["bob"]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_changed_plan_or_request_is_refused_as_stale_and_nothing_is_approved(stack: Stack, billing: Billing) -> None:
    run_id, snap = await waiting_run(stack)
    bob = stack.sso.token("bob")
    async with httpx.AsyncClient(base_url=stack.url) as http:
        for wrong in ({"plan_hash": "0" * 64}, {"request_id": str(uuid.uuid4())}):
            r = await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(bob), json={**body(snap), **wrong})
            assert r.status_code == 409
            assert r.json()["stale"] and r.json()["message"] == desk.CHANGED
            assert r.json()["rule"] in ("stale_plan_hash", "stale_request")
        # A rejection needs a reason; with one, it is recorded.
        assert (await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(bob), json=body(snap, "reject"))).json()["rule"] == "reason_required"
        assert (await tether_client.snapshot(stack.client, run_id)).approved_by == []
        rejected = (await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(bob), json=body(snap, "reject", comment="too much"))).json()
        assert rejected["state"] == "REJECTED" and rejected["actor"] == "user:bob via inbox"


@pytest.mark.asyncio(loop_scope="session")
async def test_browser_credentials_need_csrf_and_same_origin(stack: Stack, billing: Billing) -> None:
    run_id, snap = await waiting_run(stack)
    proxy = {"X-Forwarded-Assertion": stack.sso.token("bob")}  # an identity-aware proxy's header
    form = {"kind": "approve", "request_id": snap.pending_approval.request_id, "plan_hash": snap.pending_approval.plan_hash}
    async with httpx.AsyncClient(base_url=stack.url) as http:
        assert (await http.get("/api/approvals", headers=proxy)).status_code == 200
        assert (await http.post(f"/runs/{run_id}/decide", headers=proxy, data={**form, "csrf": "forged"})).status_code == 403
        assert (await http.post(f"/api/runs/{run_id}/decisions", headers=proxy, json=form)).status_code == 403
        cross = {**proxy, "Origin": "https://evil.example"}
        assert (await http.post(f"/runs/{run_id}/decide", headers=cross, data=form)).status_code == 403
    assert (await tether_client.snapshot(stack.client, run_id)).approved_by == []
    await stack.client.get_workflow_handle(run_id).cancel(reason="test over")  # an operator's cancel


@pytest.mark.asyncio(loop_scope="session")
async def test_with_require_signatures_a_hand_sent_name_is_refused_and_the_inbox_attestation_counts(
    stack: Stack, billing: Billing
) -> None:
    run_id = await stack.start(signed=True)
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    # bob's name, sent by hand without a signature: refused.
    with pytest.raises(tether_client.TetherError) as unsigned:
        await tether_client.decide(stack.client, run_id, "approve", tether_client.DecisionInput(by="bob"))
    assert unsigned.value.rule == "signature_required"
    # A forged attestation: "inbox" named, signed with another key (bob's own).
    with pytest.raises(tether_client.TetherError) as forged:
        await tether_client.decide(stack.client, run_id, "approve", tether_client.DecisionInput(
            by="bob", key=stack.key_dir / "bob.pem", attest_as="inbox"))
    assert forged.value.rule == "bad_signature"
    # A signer the policy does not list.
    with pytest.raises(tether_client.TetherError) as unknown:
        await tether_client.decide(stack.client, run_id, "approve", tether_client.DecisionInput(
            by="bob", key=stack.key_dir / "inbox.pem", attest_as="portal"))
    assert unknown.value.rule == "signer_not_trusted"
    assert (await tether_client.snapshot(stack.client, run_id)).approved_by == []
    async with httpx.AsyncClient(base_url=stack.url) as http:
        r = await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(stack.sso.token("bob")), json=body(snap))
    assert r.status_code == 200, r.text
    assert r.json()["actor"] == "user:bob via inbox"
    done = await stack.wait(run_id, "COMPLETED")
    assert done.approved_by == ["bob"]


# ----------------------------------------------------------------------------- the rule itself


def test_an_attestation_verifies_only_by_a_listed_signer_for_its_tenants() -> None:
    inbox, other = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    signers = {"inbox": Signer(public_key=raw_public(inbox), may_attest=["acme"])}
    tenant = TenantPolicy(require_signatures=True, approvers={"bob": {"roles": ["approver"]}})
    decision = ApprovalDecision(decision_id="d1", approver="bob", plan_hash="h", request_id="r", attested_by="inbox")
    payload = policy.decision_signature_payload(workflow_id="w", first_run_id="f", tenant="acme", kind="approve", decision=decision)
    good = base64.b64encode(inbox.sign(payload)).decode()

    def check(signature, *, tenant_name="acme", attested_by="inbox", table=signers):
        refusal = signature_refusal(tenant, "bob", payload, signature, what="decision",
                                    attested_by=attested_by, signers=table, tenant_name=tenant_name)
        return refusal.rule if refusal else None

    assert check(good) is None
    assert check(good, tenant_name="other") == "signer_not_trusted"
    assert check(good, attested_by="portal") == "signer_not_trusted"
    assert check(good, table={}) == "signer_not_trusted"
    assert check(None) == "signature_required"
    assert check(base64.b64encode(other.sign(payload)).decode()) == "bad_signature"
    # The attestation covers the signer's name: the person's own payload is another text.
    plain = policy.decision_signature_payload(workflow_id="w", first_run_id="f", tenant="acme", kind="approve",
                                              decision=decision.model_copy(update={"attested_by": None}))
    assert plain != payload
    assert check(base64.b64encode(inbox.sign(plain)).decode()) == "bad_signature"
    # Without attested_by the person's own key is what counts, as before.
    assert signature_refusal(tenant, "bob", plain, good, what="decision") is not None


def test_the_policy_file_check_names_a_bad_signer(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[signers.inbox]\npublic_key = "abc"\nmay_attest = ["nowhere"]\n\n[tenants.t]\ntools = ["get_order"]\n')
    problems = check_policy_file(path, ["get_order"])
    assert any("signers.inbox.public_key" in p and "base64" in p for p in problems)
    assert any("signers.inbox.may_attest" in p and "nowhere" in p for p in problems)
    path.write_text('[signers.inbox]\npublic_key_file = "missing.pub"\n\n[tenants.t]\ntools = ["get_order"]\n')
    assert any("signers.inbox.public_key_file" in p for p in check_policy_file(path, ["get_order"]))
    assert parse_policy('[signers.x]\nmay_attest = []\n').signers["x"].public_key is None


def test_decision_ids_are_one_per_person_request_plan_and_kind() -> None:
    ids = {desk.decision_id("run", r, h, p, k) for r in ("r1", "r2") for h in ("h1", "h2") for p in ("bob", "carol") for k in ("approve", "reject")}
    assert len(ids) == 16
    assert desk.decision_id("run", "r1", "h1", "bob", "approve") == desk.decision_id("run", "r1", "h1", "bob", "approve")


HOSTILE = "<script>alert(1)</script>\u202e\x1b[31m\"'&"


@pytest.mark.asyncio(loop_scope="session")
async def test_untrusted_text_reaches_the_page_escaped(stack: Stack, billing: Billing) -> None:
    steps = [dict(s, args=dict(s["args"])) for s in PLAYBOOK]
    steps[-1]["args"]["body"] = HOSTILE  # the email text the planner proposed
    run_id, _ = await waiting_run(stack, playbook=steps, goal=f"refund {HOSTILE}")
    async with httpx.AsyncClient(base_url=stack.url) as http:
        html = (await http.get(f"/runs/{run_id}", headers=bearer(stack.sso.token("bob")))).text
        live = (await http.get(f"/runs/{run_id}/live", headers=bearer(stack.sso.token("bob")))).text
    for text in (html, live):
        assert "<script>alert" not in text and "\u202e" not in text and "\x1b" not in text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;\\u202e\\x1b[31m" in text  # display.show_value, then HTML-escaped
    assert "<script" not in html.replace('<script src="/static/inbox.js" defer></script>', "")
    await stack.client.get_workflow_handle(run_id).cancel(reason="test over")  # an operator's cancel


def test_a_jwks_url_is_read_through_pyjwkclient() -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tether.inbox.identity import Unauthenticated, Verifier
    from tests.helpers.inbox_stack import Sso

    sso = Sso()

    class Jwks(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps(sso.jwks()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Jwks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        verifier = Verifier(jwks=f"http://127.0.0.1:{server.server_port}/jwks.json", issuer=ISSUER, audience=AUDIENCE,
                            claim="preferred_username")
        assert verifier.verify(sso.token("bob")) == "bob"
        rotated = Sso(kid="sso-2")  # a key the set does not have
        with pytest.raises(Unauthenticated):
            verifier.verify(rotated.token("bob"))
    finally:
        server.shutdown()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_policy_file_broken_while_serving_keeps_the_last_good_one(stack: Stack) -> None:
    good = stack.policy.read_text()
    try:
        stack.policy.write_text(good + "\n[tenants.broken]\nunknown_key = 1\n")
        async with httpx.AsyncClient(base_url=stack.url) as http:
            r = await http.get("/api/approvals", headers=bearer(stack.sso.token("bob")))
            health = await http.get("/healthz")
        # Serving, by the last good policy; the health page names the problem (issue 43).
        assert r.status_code == 200, r.text
        assert health.status_code == 200 and "unknown_key" in health.json()["policy_problem"], health.text
    finally:
        stack.policy.write_text(good)
