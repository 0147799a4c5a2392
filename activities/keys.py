"""The fleet's key ring: what seals carried state and mints the capability of every write.

``TETHER_STATE_KEY_FILE`` (default ``.tether/state.key``) holds one key a line (at least 32
characters, e.g. ``secrets.token_hex(32)``; ``#`` starts a comment). A key's id is its
fingerprint (the first 16 hex digits of its sha256), so a file written by an earlier version
keeps working and nothing needs naming. The **last** line is the newest key: new seals and
capabilities use it, every other key still verifies (rotation: append a key, roll the workers,
drop the old line once no run can carry a seal by it).

A worker never creates a key: ``make demo``, ``make dev-server``, ``make worker`` and the tests
create the dev key up front (``python -m activities.keys genkey --if-missing PATH``). Every
worker that may take a run's tasks must hold the key ids its seals and capabilities name; one
that lacks an id fails the *workflow task* (another worker takes it), never the run.

    python -m activities.keys genkey [--if-missing] PATH   # append a new newest key to PATH
    python -m activities.keys ids PATH                     # the ids in a ring, newest last
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import Interceptor, WorkflowInboundInterceptor, WorkflowInterceptorClassInput

from workflows import keys as ring_math
from workflows.keys import EXTERN, MissingKey, key_id
from workflows.wire import (
    CAPABILITY_EXPIRED,
    CAPABILITY_INVALID,
    CAPABILITY_KEY_MISSING,
    ToolCall,
    args_digest,
)

DEFAULT_STATE_KEY = ".tether/state.key"
KEY_SETTING = "TETHER_STATE_KEY_FILE"
MIN_KEY_CHARS = 32

__all__ = ["KeyRing", "KeyRingError", "KeyRingInterceptor", "MissingKey", "key_id", "attest", "genkey"]


class KeyRingError(ValueError):
    """No usable key ring: the message names the setting and the file."""


class KeyRing(ring_math.KeyRing):
    """The fleet's ring as read from its file (the MAC math is workflows/keys.py's)."""

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
            raise KeyRingError(f"{source}: holds no key; add one with `python -m activities.keys genkey {source}`")
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
                f"`python -m activities.keys genkey {chosen}` and give every worker the same file)"
            ) from None
        except OSError as e:
            raise KeyRingError(f"cannot read the state key ring {chosen} ({KEY_SETTING}): {e.strerror}") from None
        return cls.parse(text, str(chosen))


class KeyRingInterceptor(Interceptor):
    """Hands a worker's ring to its workflow code as worker configuration (an extern function
    of this worker only), so the workflow seals, mints and checks attestations itself."""

    def __init__(self, ring: ring_math.KeyRing) -> None:
        self.ring = ring

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor] | None:
        ring = self.ring
        input.unsafe_extern_functions[EXTERN] = lambda: ring
        return None


def attest(ring: ring_math.KeyRing, request: Any, result: Any) -> Any:
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
    except MissingKey:
        message = report_missing(cap.key_id, "capability")
        return ApplicationError(message, cap.key_id, type=CAPABILITY_KEY_MISSING, non_retryable=True)
    if not good:
        return invalid("the capability's mac does not verify")
    if datetime.now(timezone.utc) > cap.expires_at:
        return ApplicationError(
            f"capability expired at {cap.expires_at.isoformat()}", type=CAPABILITY_EXPIRED, non_retryable=True
        )
    return None


def genkey(path: Path, *, if_missing: bool = False) -> str:
    """Append a new newest key to the ring at ``path`` (0600); returns its id."""
    if if_missing and path.exists():
        return KeyRing.from_env(str(path)).newest
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(key + "\n")
    return key_id(key.encode())


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["genkey"] and len(args) in (2, 3) and (len(args) == 2 or args[1] == "--if-missing"):
        print(genkey(Path(args[-1]), if_missing=len(args) == 3))
        return 0
    if args[:1] == ["ids"] and len(args) == 2:
        try:
            ring = KeyRing.from_env(args[1])
        except KeyRingError as e:
            print(e, file=sys.stderr)
            return 1
        print("\n".join(ring.keys))
        return 0
    print(__doc__.strip().splitlines()[-2].strip() + "\n" + __doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
