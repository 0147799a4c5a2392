"""Ed25519 keys and signatures: ``keygen`` and ``ensure_keys`` make key pairs, ``sign`` is the one
way a start, decision, revision, hand-off or cancel is signed, ``sign_request`` signs a start.
"""

from __future__ import annotations

import base64
import os
import secrets
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from workflows import policy
from workflows.run_state import RunRequest
from tether.connection import UsageError


def sign_request(request: RunRequest, run_id: str, key: Path) -> RunRequest:
    """The request with the requester's Ed25519 signature over policy.start_signature_payload:
    where the tenant requires signatures, a run starts only with it."""
    # A fresh nonce and the time of signing: a captured start goes stale after the tenant's
    # start_signature_ttl.
    request = request.model_copy(
        update={"nonce": secrets.token_hex(16), "issued_at": datetime.now(timezone.utc).replace(microsecond=0)}
    )
    payload = policy.start_signature_payload(
        workflow_id=run_id,
        tenant=request.tenant,
        requested_by=request.requested_by,
        request_digest=request.request_digest(),
        nonce=request.nonce,
        issued_at=request.issued_at,
    )
    return request.model_copy(update={"requester_signature": sign(key, payload)})


def keygen(path: Path, *, force: bool = False) -> str:
    """Write a new Ed25519 private key (PEM, 0600) to ``path`` and its public key (raw, base64)
    to ``path.pub``; returns the public key, as the policy file lists it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if path.exists() and not force:
        raise UsageError(f"{path} exists; pass --force to overwrite")
    key = Ed25519PrivateKey.generate()
    public = base64.b64encode(
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Each file whole or not at all (written aside, then renamed), the public one first: a
        # reader never sees half a key, nor a private key without its public one.
        for target, data, mode in ((path.with_name(path.name + ".pub"), (public + "\n").encode(), 0o644),
                                   (path, private, 0o600)):
            aside = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
            fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(aside, target)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}") from None
    return public


def ensure_keys(folder: Path, names: Sequence[str]) -> None:
    """Key pairs for these people under ``folder`` (NAME.pem, NAME.pem.pub), made if missing:
    what `make demo` signs with, and what the example policy's signed tenant lists. Processes
    that ask at once (the demo, the inbox, parallel tests) take turns: one makes each pair."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".ensure.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in names:
            if not (folder / f"{name}.pem").exists():
                keygen(folder / f"{name}.pem")


def sign(key: Path, payload: bytes) -> str:
    """The Ed25519 signature (base64) of ``payload`` with the private key in ``key`` (PEM): the one
    way a start, decision, revision, hand-off or cancel is signed."""
    return base64.b64encode(load_private_key(key).sign(payload)).decode()


def load_private_key(path: Path) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        key = load_pem_private_key(path.read_bytes(), password=None)
    except (FileNotFoundError, IsADirectoryError):
        raise UsageError(f"key file not found: {path}") from None
    except (ValueError, TypeError) as e:
        raise UsageError(f"{path} is not a PEM private key ({e}); make one with `tether keygen`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"{path} is not an Ed25519 key; make one with `tether keygen`")
    return key
