"""The fleet's keys in workflow code: seals, capabilities and attestations, as pure functions.

Whoever can poll the task queue can complete a workflow task with any command and an activity
task with any result. Only the fleet's key tells our workers' work apart, so whatever a run reads
from history and then acts on with authority is either computed here by the workflow code itself
(the carried state's seal, a write's capability) or bears an attestation, a MAC by the fleet key
over exactly what it answers (``attest``), checked here on every execution, replay included.

The ring reaches workflow code as worker configuration, never through I/O: ``worker.create_worker``
registers it as an extern function of the worker (``KeyRingInterceptor``), so two workers in one
process may hold different rings.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, TypeAdapter

from workflows.contract import canonical_json, json_digest
from workflows.wire import Capability, ToolCall, args_digest

# The extern function a worker registers for its ring (worker configuration, like the code).
EXTERN = "tether_key_ring"


class KeyNotHeld(LookupError):
    """A seal, capability or attestation names a key id this worker does not hold."""

    def __init__(self, key_id: str) -> None:
        super().__init__(key_id)
        self.key_id = key_id


class Forgery(RuntimeError):
    """Something read from history does not bear the fleet key's MAC: a worker without the key
    wrote it. Raised in workflow code it fails the workflow task (never the run), so the run
    acts on nothing the forgery says and stands where it was until an operator resets it to
    before the forged task (or ends it: a forced hand-off). An attempt the forgery answered may
    have applied all the same: the answer is refused, not the attempt undone."""


class KeyMissing(RuntimeError):
    """This worker lacks a key id the run's history names: it fails the workflow task so that a
    worker of the fleet holding the key takes it (never the run)."""

    def __init__(self, message: str, key_id: str = "") -> None:
        super().__init__(message)
        self.key_id = key_id


def key_id(key: bytes) -> str:
    """A key's id: its fingerprint."""
    return hashlib.sha256(key).hexdigest()[:16]


@dataclass(frozen=True)
class KeyRing:
    keys: dict[str, bytes]  # id -> key, in file order (the last one is the newest)
    source: str = ""

    @property
    def newest(self) -> str:
        return list(self.keys)[-1]

    def mac(self, kid: str, fields: Mapping[str, Any]) -> str:
        """HMAC-SHA256 by key ``kid`` over the canonical JSON of ``fields``; KeyNotHeld if not held."""
        key = self.keys.get(kid)
        if key is None:
            raise KeyNotHeld(kid)
        return hmac.new(key, canonical_json({**fields, "key_id": kid}).encode(), hashlib.sha256).hexdigest()

    def sign(self, fields: Mapping[str, Any]) -> tuple[str, str]:
        """(key id, mac) by the newest key."""
        kid = self.newest
        return kid, self.mac(kid, fields)

    def verify(self, kid: str, fields: Mapping[str, Any], mac: str) -> bool:
        """Does ``mac`` verify under key ``kid``? KeyNotHeld when the ring lacks that id."""
        return hmac.compare_digest(self.mac(kid, fields), mac)

    def signer(self, kid: str) -> Callable[[bytes], bytes]:
        """The Ed25519 signing function that key ``kid`` derives (tether/store/keys.py's ring
        has them: the math needs a library workflow code does not import)."""
        raise KeyMissing(kid)

    def sign_statement(self, fields: Mapping[str, Any]) -> str:
        """A signature anyone holding the fleet's public keys verifies, by the newest key:
        ``"<key id>:<hex Ed25519 signature>"`` over ``statement_bytes(fields)``. Ed25519 is
        deterministic, so workflow code signs: a replay makes the same signature."""
        kid = self.newest
        return f"{kid}:{self.signer(kid)(statement_bytes(fields)).hex()}"


# ----------------------------------------------------------------------------- signed statements
# What the fleet says to people and auditors (records, views, judgement lines) is signed with
# Ed25519 keys derived from the ring's keys, and verified with their public halves alone
# (tether/store/keys.py: PublicKeys, `python -m tether.store.keys public`).


def statement_bytes(fields: Mapping[str, Any]) -> bytes:
    return canonical_json(dict(fields)).encode()


def record_statement(workflow_id: str, run_id: str, seq: int, link: str) -> dict[str, Any]:
    """What a record's signature covers: its workflow id, the run whose stream it goes to (a
    reset or a continued run writes its own), its seq and its link (states.record_link), which
    covers the record and the link before it."""
    return {"kind": "record", "workflow_id": workflow_id, "run_id": run_id, "seq": seq, "link": link}


def view_statement(workflow_id: str, run_id: str, digest: str) -> dict[str, Any]:
    """What a published view's signature covers: the run that published it and the view."""
    return {"kind": "view", "workflow_id": workflow_id, "run_id": run_id, "digest": digest}


def judgement_statement(digest: str) -> dict[str, Any]:
    """What a judgement line's signature covers: the line (it names its run and activity)."""
    return {"kind": "judgement", "digest": digest}


def view_digest(view: BaseModel) -> str:
    """The digest a view's signature covers: the view without its signature, the fields at
    their defaults left out (the packed form it is published in leaves them out too)."""
    return json_digest(view.model_dump(mode="json", exclude_defaults=True, exclude={"sig"}))


# ----------------------------------------------------------------------------- the worker's ring


def worker_ring(extern: Callable[[], Mapping[str, Callable[..., Any]]]) -> KeyRing:
    """The ring of the worker running this workflow task (``extern``: workflow.extern_functions)."""
    get: Callable[[], KeyRing] | None = extern().get(EXTERN)
    if get is None:
        raise KeyMissing(
            "this worker was built without the fleet's key ring: build workers with "
            "worker.create_worker (or pass tether.store.keys.KeyRingInterceptor(ring) to the Worker/Replayer)"
        )
    return get()


# ----------------------------------------------------------------------------- carried state


def seal_fields(workflow_id: str, run_id: str, generation: int, digest: str) -> dict[str, Any]:
    return {"kind": "carryover", "workflow_id": workflow_id, "run_id": run_id, "generation": generation, "digest": digest}


def seal(ring: KeyRing, workflow_id: str, run_id: str, generation: int, digest: str) -> str:
    """The seal of carried state: bound to the sealing run and the generation it hands on."""
    kid, mac = ring.sign(seal_fields(workflow_id, run_id, generation, digest))
    return f"{kid}:{mac}"


def seal_valid(ring: KeyRing, sealed: str | None, workflow_id: str, run_id: str, generation: int, digest: str) -> bool:
    """``run_id``: the run the server says this one continued from. Raises KeyMissing when the
    seal names a key this worker lacks."""
    kid, _, mac = (sealed or "").partition(":")
    if not mac or not run_id:
        return False
    try:
        return ring.verify(kid, seal_fields(workflow_id, run_id, generation, digest), mac)
    except KeyNotHeld:
        raise KeyMissing(missing_message(kid, "the carried state's seal"), kid) from None


# ----------------------------------------------------------------------------- grants


def grant_fields(digest: str) -> dict[str, Any]:
    return {"kind": "grant", "digest": digest}


def seal_grant(ring: KeyRing, digest: str) -> str:
    """A child run's grant, sealed by its parent's workflow code (the fleet key)."""
    kid, mac = ring.sign(grant_fields(digest))
    return f"{kid}:{mac}"


def grant_valid(ring: KeyRing, sealed: str, digest: str) -> bool:
    """Raises KeyMissing when the seal names a key this worker lacks."""
    kid, _, mac = sealed.partition(":")
    if not mac:
        return False
    try:
        return ring.verify(kid, grant_fields(digest), mac)
    except KeyNotHeld:
        raise KeyMissing(missing_message(kid, "the run's grant"), kid) from None


def outcome_fields(grant_seal: str, digest: str) -> dict[str, Any]:
    return {"kind": "child_outcome", "grant": grant_seal, "digest": digest}


def seal_outcome(ring: KeyRing, grant_seal: str, digest: str) -> str:
    """A child run's outcome, sealed by its own workflow code for the grant it ran under: the
    parent acts on no end a keyless poller wrote for the child."""
    kid, mac = ring.sign(outcome_fields(grant_seal, digest))
    return f"{kid}:{mac}"


def outcome_valid(ring: KeyRing, sealed: str, grant_seal: str, digest: str) -> bool:
    """Raises KeyMissing when the seal names a key this worker lacks."""
    kid, _, mac = sealed.partition(":")
    if not mac:
        return False
    try:
        return ring.verify(kid, outcome_fields(grant_seal, digest), mac)
    except KeyNotHeld:
        raise KeyMissing(missing_message(kid, "the child run's outcome"), kid) from None


# ----------------------------------------------------------------------------- capabilities


def mint(
    ring: KeyRing,
    call: ToolCall,
    *,
    workflow_id: str,
    run_id: str,
    activity_id: str,
    request_id: str,
    plan_hash: str,
    now: datetime,
    ttl_seconds: float,
    rerun_unknown: bool = False,
    judge_digest: str = "",
) -> Capability:
    """The capability of exactly one write attempt, minted by the run's own workflow code once
    the keyed re-check allowed it; the tool activity verifies it before calling the tool."""
    fields = Capability.model_construct(
        workflow_id=workflow_id,
        run_id=run_id,
        activity_id=activity_id,
        request_id=request_id,
        plan_hash=plan_hash,
        tool_call_id=call.tool_call_id,
        tool=call.tool,
        args_digest=args_digest(call.args),
        idempotency_key=call.idempotency_key,
        key_id="",
        expires_at=now + timedelta(seconds=ttl_seconds),
        mac="",
        rerun_unknown=rerun_unknown,
        judge_digest=judge_digest,
    )
    kid, mac = ring.sign(fields.fields())
    return Capability.model_validate({**fields.model_dump(), "key_id": kid, "mac": mac})


# ----------------------------------------------------------------------------- attestations


def clockless(activity_id: str) -> bool:
    """Whether an attestation for this activity covers its request without the request's clock
    readings: so for every activity a run of this build schedules, whose id this build writes
    with ``:`` (``plan:3:<seed digest>``, ``<tool call>:<calls>:<bounces>``). A task a worker
    rebuilds can read another time than the task read live (a retried or speculative task's
    events are written when it completes): a request built from ``workflow.now()`` would then
    differ from the one the answer was attested over, and the rebuilt run refuse its own answer
    as forged. The previous build's ids (``.``) keep covering the whole request."""
    return ":" in activity_id


def _digest(model: BaseModel, *, without_clock: bool = False) -> str:
    # The attestation itself is not part of what it covers.
    if "attestation" in type(model).model_fields:
        model = model.model_copy(update={"attestation": None})
    if not without_clock:
        return json_digest(model.model_dump(mode="json"))
    return json_digest(_JSON.dump_python(_no_clock(model.model_dump(mode="python")), mode="json"))


_JSON: TypeAdapter[Any] = TypeAdapter(Any)


def _no_clock(value: Any) -> Any:
    """The value with every datetime in it (at any depth) read as None."""
    if isinstance(value, datetime):
        return None
    if isinstance(value, dict):
        return {k: _no_clock(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_clock(v) for v in value]
    return value


def attested_call(call: ToolCall) -> ToolCall:
    """What a write's outcome is attested over: the call without its capability, which names
    the run that scheduled the attempt (a reset run replays the outcome under its own id), and
    without the records it took along to the sink."""
    return call.model_copy(update={"capability": None, "records": None})


def digest(model: BaseModel, *, activity_id: str = "") -> str:
    """What an attestation says of a request or an answer: its sha256 (the attestation aside);
    of a request to ``activity_id``, without its clock readings where ``clockless`` says so."""
    return _digest(model, without_clock=clockless(activity_id))


def attestation_fields(kind: str, workflow_id: str, activity_id: str, request: BaseModel | str, result: BaseModel) -> dict[str, Any]:
    """What an attestation covers: which activity answered (its name and id in this workflow),
    the exact request (or its digest, taken when it was sent), and the exact answer."""
    return {
        "kind": kind,
        "workflow_id": workflow_id,
        "activity_id": activity_id,
        "request": request if isinstance(request, str) else _digest(request, without_clock=clockless(activity_id)),
        "result": _digest(result),
    }


def attest(ring: KeyRing, kind: str, workflow_id: str, activity_id: str, request: BaseModel, result: BaseModel) -> str:
    """Made by the activity (it holds the ring): ``"<key id>:<mac>"``."""
    kid, mac = ring.sign(attestation_fields(kind, workflow_id, activity_id, request, result))
    return f"{kid}:{mac}"


def check_attested(
    ring: KeyRing, kind: str, workflow_id: str, activity_id: str, request: BaseModel | str, result: BaseModel
) -> None:
    """In workflow code, before the run acts on an activity's answer: Forgery when it does not
    bear the fleet key's MAC over exactly this request and answer, KeyMissing when it names a
    key this worker lacks."""
    attestation = getattr(result, "attestation", None)
    kid, _, mac = (attestation or "").partition(":")
    what = f"the {kind} answer of activity {activity_id}"
    if not mac:
        raise Forgery(forgery_message(what, workflow_id, "it bears no attestation by the fleet key"))
    try:
        good = ring.verify(kid, attestation_fields(kind, workflow_id, activity_id, request, result), mac)
    except KeyNotHeld:
        raise KeyMissing(missing_message(kid, what), kid) from None
    if not good:
        raise Forgery(forgery_message(what, workflow_id, "its attestation does not verify for this request and answer"))


def forgery_message(what: str, workflow_id: str, why: str) -> str:
    return (
        f"forgery: {what} was not written by a worker holding the fleet key ({why}). The forged "
        f"answer was refused: the run acts on nothing it says and stands where it was, but the "
        f"attempt it answered may have applied. Find and stop the worker without the key, then reset "
        f"the run to before the forged task: tether repair {workflow_id} (where that would repeat a "
        f"write not safe to repeat, end it on the record: tether handoff {workflow_id} --force)"
    )


def missing_message(kid: str, what: str) -> str:
    return (
        f"key_missing: {what} names key id {kid[:32]!r}, which this worker's key ring does not hold: "
        f"give every worker of the fleet the same ring (TETHER_STATE_KEY_FILE); a worker holding it takes the task"
    )
