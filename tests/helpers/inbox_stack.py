"""The inbox as tests run it: a real uvicorn server in the test's event loop, on a free port,
over the session's dev server (search attributes), with a worker and a policy file of its own.

Tenants get names of their own per module, so runs other tests leave waiting on the shared dev
server never show up in this inbox.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

import tether.client as tether_client
from tether.policy.files import PolicyStore
from tether.inbox.app import InboxConfig, create_app
from tether.tools.sdk import REGISTRY, ToolRegistry
from tests.helpers.ports import free_port
from tests.helpers.runs import make_request, running_worker

ISSUER = "https://sso.example.test"
AUDIENCE = "tether-inbox"


def raw_public(key: ed25519.Ed25519PrivateKey) -> str:
    return base64.b64encode(key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()


def write_pem(key: Any, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return path


@dataclass
class Sso:
    """The organisation's sign-in, as a test plays it: its own EC key, a JWKS file, tokens."""

    key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    kid: str = "sso-1"

    def jwks(self) -> dict[str, Any]:
        jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.key.public_key()))
        return {"keys": [{**jwk, "kid": self.kid, "alg": "ES256", "use": "sig"}]}

    def token(self, name: str, *, key: Any = None, alg: str = "ES256", **claims: Any) -> str:
        now = int(time.time())
        body = {"iss": ISSUER, "aud": AUDIENCE, "preferred_username": name, "iat": now, "exp": now + 300, **claims}
        body = {k: v for k, v in body.items() if v is not None}
        return jwt.encode(body, key or self.key, algorithm=alg, headers={"kid": self.kid})


@dataclass
class Stack:
    tenant: str
    signed_tenant: str
    policy: Path
    people: dict[str, ed25519.Ed25519PrivateKey]
    worker: Any
    client: Any
    sso: Sso
    url: str = ""
    dev_url: str = ""
    key_dir: Path | None = None
    dev_app: Any = None

    async def start(self, requested_by: str = "alice", *, signed: bool = False, **fields: Any) -> str:
        tenant = self.signed_tenant if signed else self.tenant
        run_id = f"inbox-run-{uuid.uuid4().hex[:10]}"
        request = make_request(tenant=tenant, requested_by=requested_by, **fields)
        if signed:
            assert self.key_dir is not None
            request = tether_client.sign_request(request, run_id, self.key_dir / f"{requested_by}.pem")
        await tether_client.start_run(self.client, request, run_id=run_id, queue=self.worker.task_queue)
        return run_id

    async def wait(self, run_id: str, *states: str, timeout: float = 30.0) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            snap = await tether_client.snapshot(self.client, run_id)
            # As its answer says and as it published (signed), which the inbox and the CLI read:
            # a query can answer from a task whose view is not written yet.
            if snap.state.value in states and await self._published(run_id, snap.state.value):
                return snap
            if loop.time() > deadline:
                raise AssertionError(f"{run_id} is {snap.state.value}, expected {states}")
            await asyncio.sleep(0.1)

    async def _published(self, run_id: str, state: str) -> bool:
        from workflows.states import PUBLISHED

        if state not in {s.value for s in PUBLISHED}:
            return True  # a state passed through is not published: the answer is all there is
        view = await tether_client.published_view(await self.client.get_workflow_handle(run_id).describe())
        return view is not None and view.snapshot.state.value == state

    async def visible(self, run_id: str, timeout: float = 15.0) -> None:
        """Visibility is eventually consistent: wait until the list shows the run waiting."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = await tether_client.list_runs(self.client, state="AWAITING_APPROVAL", tenant=None, limit=200)
            if any(r.run_id == run_id and r.state == "AWAITING_APPROVAL" for r in rows):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"{run_id} never listed as AWAITING_APPROVAL")


POLICY = """
[signers.inbox]
public_key = "{inbox}"
may_attest = ["{tenant}", "{signed}"]

[tenants.{tenant}]
four_eyes = true
[tenants.{tenant}.approvers]
alice = {{ roles = ["approver"] }}
bob   = {{ roles = ["approver"] }}
dana  = {{ roles = ["support"] }}

[tenants.{signed}]
require_signatures = true
[tenants.{signed}.approvers]
alice = {{ roles = ["approver"], public_key = "{alice}" }}
bob   = {{ roles = ["approver"], public_key = "{bob}" }}
"""


async def _serve(app: Any, port: int) -> tuple[Any, asyncio.Task]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.025)
    assert server.started, "the inbox did not start"
    return server, task


@asynccontextmanager
async def inbox_stack(dev_env: Any, tmp: Path, *, jwks: bool = True, dev_login: bool = False,
                      registry: ToolRegistry = REGISTRY) -> AsyncIterator[Stack]:
    """``registry``: the tools its worker serves (a registry of one's own: tests/helpers/own_tool.py)."""
    suffix = uuid.uuid4().hex[:8]
    people = {n: ed25519.Ed25519PrivateKey.generate() for n in ("alice", "bob", "inbox")}
    for name, key in people.items():
        write_pem(key, tmp / f"{name}.pem")
    tenant, signed = f"desk-{suffix}", f"desk-signed-{suffix}"
    policy = tmp / "policy.toml"
    policy.write_text(POLICY.format(inbox=raw_public(people["inbox"]), alice=raw_public(people["alice"]),
                                    bob=raw_public(people["bob"]), tenant=tenant, signed=signed))
    sso = Sso()
    (tmp / "jwks.json").write_text(json.dumps(sso.jwks()))
    async with running_worker(dev_env.client, policy=PolicyStore.from_env(str(policy)), registry=registry) as worker:
        stack = Stack(tenant=tenant, signed_tenant=signed, policy=policy, people=people, worker=worker,
                      client=dev_env.client, sso=sso, key_dir=tmp)
        servers = []
        try:
            if jwks:
                app = create_app(InboxConfig(policy=policy, jwks=str(tmp / "jwks.json"), issuer=ISSUER, audience=AUDIENCE,
                                             key=tmp / "inbox.pem", poll_ms=300), temporal=dev_env.client)
                port = free_port()
                servers.append(await _serve(app, port))
                stack.url = f"http://127.0.0.1:{port}"
            if dev_login:
                app = create_app(InboxConfig(policy=policy, dev_login=True, key=tmp / "inbox.pem", poll_ms=300),
                                 temporal=dev_env.client)
                port = free_port()
                servers.append(await _serve(app, port))
                stack.dev_url = f"http://127.0.0.1:{port}"
                stack.dev_app = app
            yield stack
        finally:
            for server, task in servers:
                server.should_exit = True
                await task
