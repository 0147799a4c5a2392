"""One person per sign-in, over HTTP (a real uvicorn inbox, the session's dev server, a worker):
a name claim that is not written as the policy names people ("Bob", fullwidth "ＢＯＢ", "ｂｏｂ")
is refused, never folded onto bob; with a subjects file, bob is the sign-in whose ``sub`` is his,
and another subject naming itself "bob" is nobody."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from tether.inbox.app import InboxConfig, create_app
from tests.helpers.inbox_stack import AUDIENCE, ISSUER, Stack, _serve, inbox_stack
from tests.helpers.ports import free_port


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(dev_env, tmp_path_factory) -> Stack:
    async with inbox_stack(dev_env, tmp_path_factory.mktemp("inbox-identity")) as s:
        yield s


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


VARIANTS = ("Bob", "ＢＯＢ", "ｂｏｂ", "BOB")


@pytest.mark.asyncio(loop_scope="session")
async def test_case_and_width_variants_of_a_name_with_other_subjects_cannot_act_as_bob(stack: Stack, tmp_path: Path) -> None:
    run_id = await stack.start(requested_by="alice")
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    await stack.visible(run_id)
    decision = {"kind": "approve", "request_id": snap.pending_approval.request_id,
                "plan_hash": snap.pending_approval.plan_hash}

    # Without a subjects file: the name claim exactly as the policy writes it, or nobody.
    async with httpx.AsyncClient(base_url=stack.url) as http:
        for n, name in enumerate(VARIANTS):
            token = stack.sso.token(name, sub=f"other-{n}")
            r = await http.get("/api/approvals", headers=bearer(token))
            assert r.status_code == 401, (name, r.text)
            r = await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(token), json=decision)
            assert r.status_code == 401, (name, r.text)
        r = await http.get("/api/approvals", headers=bearer(stack.sso.token("bob", sub="bob-1")))
        assert r.status_code == 200 and r.json()["person"] == "bob"

    # With one: bob is the subject bound to him, whatever the name claim says; "bob" from another
    # subject is refused.
    subjects = tmp_path / "subjects.toml"
    subjects.write_text('[people.bob]\noidc_subject = "bob-1"\n')
    app = create_app(InboxConfig(policy=stack.policy, jwks=str(stack.key_dir / "jwks.json"), issuer=ISSUER,
                                 audience=AUDIENCE, key=stack.key_dir / "inbox.pem", subjects=subjects),
                     temporal=stack.client)
    port = free_port()
    server, task = await _serve(app, port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for n, name in enumerate(("bob", *VARIANTS)):
                token = stack.sso.token(name, sub=f"other-{n}")
                r = await http.get("/api/approvals", headers=bearer(token))
                assert r.status_code == 401, (name, r.text)
                r = await http.post(f"/api/runs/{run_id}/decisions", headers=bearer(token), json=decision)
                assert r.status_code == 401, (name, r.text)
            mine = bearer(stack.sso.token("Robert", sub="bob-1"))
            r = await http.get("/api/approvals", headers=mine)
            assert r.status_code == 200 and r.json()["person"] == "bob"
            assert run_id in [a["run_id"] for a in r.json()["approvals"]]
            alice = bearer(stack.sso.token("alice", sub="alice-1"))  # unbound: her name claim, exactly
            assert (await http.get("/api/approvals", headers=alice)).json()["person"] == "alice"
    finally:
        server.should_exit = True
        await task

    # Nothing reached the run from any of them.
    assert (await stack.wait(run_id, "AWAITING_APPROVAL")).pending_approval.approvals == []


def test_a_subjects_file_that_folds_or_shares_is_refused(tmp_path: Path) -> None:
    from tether.inbox.identity import load_subjects

    for text, words in (
        ('[people.Bob]\noidc_subject = "s"\n', "normal form"),
        ('[people.bob]\noidc_subject = "s"\n[people.carol]\noidc_subject = "s"\n', "bound to both"),
        ('[people.bob]\nsub = "s"\n', "expected oidc_subject"),
    ):
        path = tmp_path / "subjects.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=words):
            load_subjects(path)
    path.write_text('[people.bob]\noidc_subject = ["s1", "s2"]\n')
    assert load_subjects(path) == {"s1": "bob", "s2": "bob"}
