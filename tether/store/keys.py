"""The fleet's key ring: what seals carried state and mints the capability of every write.

``TETHER_STATE_KEY_FILE`` (default ``.tether/state.key``) holds one key a line (at least 32
characters, e.g. ``secrets.token_hex(32)``; ``#`` starts a comment). A key's id is its
fingerprint (the first 16 hex digits of its sha256), so a file written by an earlier version
keeps working and nothing needs naming. The **last** line is the newest key: new seals and
capabilities use it, every other key still verifies (rotation: append a key, roll the workers,
drop the old line once no run can carry a seal by it).

A worker never creates a key: ``make demo``, ``make dev-server``, ``make worker`` and the tests
create the dev key up front (``python -m tether.store.keys genkey --if-missing PATH``). Every
worker that may take a run's tasks must hold the key ids its seals and capabilities name; one
that lacks an id fails the *workflow task* (another worker takes it), never the run.

Each key also derives an Ed25519 key pair (``signing_seed``): the workflow code signs records,
published views and the policy activities' judgement lines with it, and anyone verifies them
with the public halves alone (``PublicKeys``): an auditor needs no secret. ``genkey`` writes them
beside the ring (``PATH.pub``, one ``<key id> <base64 public key>`` a line).

    python -m tether.store.keys genkey [--if-missing] [--public PUB] PATH  # a new newest key
    python -m tether.store.keys public PATH                  # (re)write PATH.pub from the ring
    python -m tether.store.keys ids PATH                     # the ids in a ring, newest last
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pydantic import BaseModel
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import Interceptor, WorkflowInboundInterceptor, WorkflowInterceptorClassInput

from workflows import keys as ring_math
from workflows.keys import EXTERN, KeyNotHeld, key_id
from workflows.wire import (
    CAPABILITY_EXPIRED,
    CAPABILITY_INVALID,
    CAPABILITY_KEY_MISSING,
    ToolCall,
    args_digest,
)

DEFAULT_STATE_KEY = ".tether/state.key"
KEY_SETTING = "TETHER_STATE_KEY_FILE"
# The fleet's public keys, for processes that verify and hold no secret (the CLI, the inbox,
# an auditor); default: the ring's file name + ".pub", else derived from the ring itself.
PUBLIC_SETTING = "TETHER_PUBLIC_KEYS"
PUBLIC_SUFFIX = ".pub"
MIN_KEY_CHARS = 32
_SIGNING_LABEL = b"tether statement signing key v1"

__all__ = ["KeyRing", "KeyRingError", "KeyRingInterceptor", "KeyNotHeld", "PublicKeys", "key_id", "attest", "genkey"]


class KeyRingError(ValueError):
    """No usable key ring: the message names the setting and the file."""


def _signing_key(key: bytes) -> Ed25519PrivateKey:
    # Derived, never stored: the ring stays one file of secrets, and its public half is a view.
    return Ed25519PrivateKey.from_private_bytes(hmac.new(key, _SIGNING_LABEL, hashlib.sha256).digest())


_SIGNERS: dict[bytes, Any] = {}  # key -> its Ed25519 sign function (derivation costs ~50 µs)


class KeyRing(ring_math.KeyRing):
    """The fleet's ring as read from its file (the MAC math is workflows/keys.py's)."""

    def signer(self, kid: str) -> Any:
        key = self.keys.get(kid)
        if key is None:
            raise KeyNotHeld(kid)
        sign = _SIGNERS.get(key)
        if sign is None:
            sign = _SIGNERS[key] = _signing_key(key).sign
        return sign

    def public_keys(self) -> PublicKeys:
        return PublicKeys(
            {kid: _signing_key(key).public_key() for kid, key in self.keys.items()}, f"the ring {self.source}".strip()
        )

    @classmethod
    def of(cls, *keys: bytes, source: str = "") -> KeyRing:
        if not keys:
            raise KeyRingError("a key ring needs at least one key")
        return cls({key_id(k): k for k in keys}, source)

    @classmethod
    def parse(cls, text: str, source: str) -> KeyRing:
        keys = []
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if len(line) < MIN_KEY_CHARS:
                raise KeyRingError(f"{source}: line {number}: a key holds at least {MIN_KEY_CHARS} characters")
            keys.append(line.encode())
        if not keys:
            raise KeyRingError(f"{source}: holds no key; add one with `python -m tether.store.keys genkey {source}`")
        return cls.of(*keys, source=source)

    @classmethod
    def from_env(cls, path: str | None = None) -> KeyRing:
        """The ring at ``path`` / ``TETHER_STATE_KEY_FILE`` / the default; never created here."""
        chosen = Path(path or os.environ.get(KEY_SETTING) or DEFAULT_STATE_KEY)
        try:
            text = chosen.read_text()
        except FileNotFoundError:
            raise KeyRingError(
                f"no state key ring at {chosen} (set {KEY_SETTING}): every worker that shares runs needs "
                f"the fleet's key file; a worker never creates one (create it once with "
                f"`python -m tether.store.keys genkey {chosen}` and give every worker the same file)"
            ) from None
        except OSError as e:
            raise KeyRingError(f"cannot read the state key ring {chosen} ({KEY_SETTING}): {e.strerror}") from None
        return cls.parse(text, str(chosen))


class PublicKeys:
    """The fleet's Ed25519 public keys by key id: verify what the fleet signed, holding no secret."""

    def __init__(self, keys: dict[str, Ed25519PublicKey], source: str = "") -> None:
        self.keys = keys
        self.source = source

    @classmethod
    def parse(cls, text: str, source: str) -> PublicKeys:
        keys: dict[str, Ed25519PublicKey] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            kid, _, b64 = line.partition(" ")
            try:
                keys[kid] = Ed25519PublicKey.from_public_bytes(base64.b64decode(b64.strip(), validate=True))
            except ValueError:
                raise KeyRingError(f"{source}: line {number}: not '<key id> <base64 Ed25519 public key>'") from None
        if not keys:
            raise KeyRingError(f"{source}: holds no public key")
        return cls(keys, source)

    @classmethod
    def from_env(cls, path: str | None = None) -> PublicKeys:
        """``path`` / ``TETHER_PUBLIC_KEYS``; else the ring's ``.pub`` file beside it; else the
        ring itself (a process that holds it). KeyRingError naming the settings when none is there."""
        chosen = path or os.environ.get(PUBLIC_SETTING)
        ring_path = Path(os.environ.get(KEY_SETTING) or DEFAULT_STATE_KEY)
        candidates = [Path(chosen)] if chosen else [ring_path.with_name(ring_path.name + PUBLIC_SUFFIX)]
        for candidate in candidates:
            try:
                return cls.parse(candidate.read_text(), str(candidate))
            except FileNotFoundError:
                if chosen:
                    raise KeyRingError(f"no public keys at {candidate} ({PUBLIC_SETTING})") from None
            except OSError as e:
                raise KeyRingError(f"cannot read the public keys {candidate}: {e.strerror}") from None
        try:
            return KeyRing.from_env(str(ring_path)).public_keys()
        except KeyRingError:
            raise KeyRingError(
                f"no public keys to verify the fleet's signatures: set {PUBLIC_SETTING} to the fleet's "
                f"public key file (`python -m tether.store.keys public RING` writes RING{PUBLIC_SUFFIX})"
            ) from None

    def text(self) -> str:
        return "".join(
            f"{kid} {base64.b64encode(key.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()}\n"
            for kid, key in self.keys.items()
        )

    def problem(self, fields: Any, signature: str) -> str | None:
        """Why ``signature`` is not the fleet's over ``fields`` (None: it is)."""
        kid, _, sig = (signature or "").partition(":")
        if not sig:
            return "unsigned"
        key = self.keys.get(kid)
        if key is None:
            return f"signed by key id {kid[:32]!r}, not one of the fleet's public keys ({self.source})"
        try:
            key.verify(bytes.fromhex(sig), ring_math.statement_bytes(fields))
        except (InvalidSignature, ValueError):
            return "its signature does not verify"
        return None


def write_public(path: Path, out: Path | None = None) -> Path:
    """Write the ring's public keys to ``out`` (default beside it, ``PATH.pub``); returns it."""
    out = out or path.with_name(path.name + PUBLIC_SUFFIX)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(KeyRing.from_env(str(path)).public_keys().text())
    return out


class KeyRingInterceptor(Interceptor):
    """Hands a worker's ring to its workflow code as worker configuration (an extern function
    of this worker only), so the workflow seals, mints and checks attestations itself."""

    def __init__(self, ring: ring_math.KeyRing) -> None:
        self.ring = ring

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor] | None:
        ring = self.ring
        input.unsafe_extern_functions[EXTERN] = lambda: ring
        return None


# An activity answer (a pydantic model with an ``attestation`` field), given back attested.
Answer = TypeVar("Answer", bound=BaseModel)


def attest(ring: ring_math.KeyRing, request: Any, result: Answer) -> Answer:
    """An activity's answer, attested for the run that asked (its workflow id and this activity's
    id come from the server's task, never from the request)."""
    info = activity.info()
    return result.model_copy(
        update={"attestation": ring_math.attest(ring, info.activity_type, info.workflow_id or "", info.activity_id, request, result)}
    )


# ----------------------------------------------------------------------------- missing keys

KEY_MISSING_METRIC = "tether_key_missing"
_KEY_LABELS: set[str] = set()
_KEY_LABELS_MAX = 16  # key ids come from payloads: a bounded label set (then "other")


def report_missing(kid: str, what: str) -> str:
    """Log and count a key id this worker lacks; returns the message (it names the id)."""
    label = kid if kid in _KEY_LABELS or len(_KEY_LABELS) < _KEY_LABELS_MAX else "other"
    _KEY_LABELS.add(label)
    message = (
        f"{what} names key id {kid[:32]!r}, which this worker's key ring ({KEY_SETTING}) does not hold: "
        f"give every worker of the fleet the same ring; a worker holding it takes the task"
    )
    activity.logger.warning(message)
    activity.metric_meter().create_counter(
        KEY_MISSING_METRIC, "Seals and capabilities naming a key id this worker lacks", "1"
    ).add(1, {"key_id": label, "what": what})
    return message


def capability_refusal(keys: KeyRing | None, call: ToolCall) -> ApplicationError | None:
    """Why this attempt of a write may not run (None: its capability is for exactly this call).

    ``execute_tool`` asks before calling the tool; the error is non-retryable either way, and
    its type says whether the run schedules the attempt again (key missing, expired).
    """
    cap = call.capability

    def invalid(why: str) -> ApplicationError:
        activity.logger.warning("execute_tool %s refused: %s", call.tool_call_id[:64], why)
        return ApplicationError(f"write refused: {why}", type=CAPABILITY_INVALID, non_retryable=True)

    if cap is None:
        return invalid(f"no capability for {call.tool!r} (a write is scheduled only by the governed run)")
    if keys is None:
        return invalid("this worker has no key ring to verify capabilities")
    info = activity.info()
    expected = {
        "workflow_id": info.workflow_id,
        "run_id": info.workflow_run_id,
        "activity_id": info.activity_id,
        "tool_call_id": call.tool_call_id,
        "tool": call.tool,
        "args_digest": args_digest(call.args),
        "idempotency_key": call.idempotency_key,
    }
    wrong = [k for k, v in expected.items() if getattr(cap, k) != v]
    if wrong:
        return invalid(f"the capability is for another call ({', '.join(wrong)} differ)")
    try:
        good = keys.verify(cap.key_id, cap.fields(), cap.mac)
    except KeyNotHeld:
        message = report_missing(cap.key_id, "capability")
        return ApplicationError(message, cap.key_id, type=CAPABILITY_KEY_MISSING, non_retryable=True)
    if not good:
        return invalid("the capability's mac does not verify")
    if datetime.now(timezone.utc) > cap.expires_at:
        return ApplicationError(
            f"capability expired at {cap.expires_at.isoformat()}", type=CAPABILITY_EXPIRED, non_retryable=True
        )
    return None


def genkey(path: Path, *, if_missing: bool = False, public: Path | None = None) -> str:
    """Append a new newest key to the ring at ``path`` (0600), and write its public keys (to
    ``public``, else beside it); returns its id."""
    if if_missing and path.exists():
        if not (public or path.with_name(path.name + PUBLIC_SUFFIX)).exists():
            write_public(path, public)
        return KeyRing.from_env(str(path)).newest
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(key + "\n")
    write_public(path, public)
    return key_id(key.encode())


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["genkey"]:
        words, public = args[1:], None
        if "--public" in words[:-1]:
            at = words.index("--public")
            public = Path(words[at + 1])
            del words[at : at + 2]
        if len(words) in (1, 2) and (len(words) == 1 or words[0] == "--if-missing"):
            print(genkey(Path(words[-1]), if_missing=len(words) == 2, public=public))
            return 0
    if args[:1] == ["public"] and len(args) == 2:
        try:
            print(write_public(Path(args[1])))
        except KeyRingError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    if args[:1] == ["ids"] and len(args) == 2:
        try:
            ring = KeyRing.from_env(args[1])
        except KeyRingError as e:
            print(e, file=sys.stderr)
            return 1
        print("\n".join(ring.keys))
        return 0
    print("\n".join(line.strip() for line in __doc__.strip().splitlines()[-3:]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
