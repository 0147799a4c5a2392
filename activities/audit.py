"""The audit sink and the carried-state seal: two worker-side guarantees behind activities.

**Audit sink.** The workflow keeps a bounded window of its timeline (workflows/budgets.py); every
record also comes here, in order, through the local activity ``audit_append``. The default sink
writes JSON lines, one file per run (workflow id and first run id), under ``TETHER_AUDIT_DIR``
(default ``.tether/audit``). Appends are keyed by the record's ``seq``: a retried or repeated
batch never writes a record twice, and a line torn by a worker killed mid-write is cut off and
written again by the retry. ``tether timeline RUN --all`` reads the file and the window.

**Seal.** A continued run trusts the state it carries only if this worker's key sealed it
(HMAC-SHA256 over the state's canonical JSON digest): a start input that carries state, or state
written by anything but a Tether worker holding the key, is refused. The key is
``TETHER_STATE_KEY_FILE`` (default ``.tether/state.key``, created on first use); workers that
share runs must share it (docker-compose mounts one).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from temporalio import activity

from workflows.models import AuditAck, AuditBatch, SealRequest
from workflows.states import TransitionRecord

DEFAULT_AUDIT_DIR = ".tether/audit"
DEFAULT_STATE_KEY = ".tether/state.key"
_TAIL = 64 * 1024  # enough to hold the last complete record line


def audit_path(root: Path, workflow_id: str, first_run_id: str) -> Path:
    # quote(): a workflow id may hold '/' or '..'; the file name must stay inside root.
    return root / f"{quote(workflow_id, safe='')}.{quote(first_run_id, safe='')}.jsonl"


@dataclass
class JsonlAuditSink:
    root: Path

    @classmethod
    def from_env(cls, path: str | None = None) -> JsonlAuditSink:
        return cls(Path(path or os.environ.get("TETHER_AUDIT_DIR") or DEFAULT_AUDIT_DIR))

    def append(self, batch: AuditBatch) -> int:
        """Append the records not written yet; returns the last seq on file."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = audit_path(self.root, batch.workflow_id, batch.first_run_id)
        with open(path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # one writer per file, across worker processes
            last = _last_seq(f)
            lines = [
                json.dumps(r.model_dump(mode="json"), sort_keys=True).encode() + b"\n"
                for r in batch.records
                if r.seq > last
            ]
            if lines:
                f.write(b"".join(lines))
                f.flush()
                os.fsync(f.fileno())
                last = max(r.seq for r in batch.records)
            return last

    def read(self, workflow_id: str, first_run_id: str) -> list[TransitionRecord]:
        path = audit_path(self.root, workflow_id, first_run_id)
        if not path.exists():
            return []
        records = []
        for line in path.read_bytes().splitlines():
            try:
                records.append(TransitionRecord.model_validate_json(line))
            except ValueError:
                continue  # a torn last line, cut off by the next append
        return records


def _last_seq(f) -> int:
    """The seq of the last complete line; a torn tail (killed mid-write) is truncated."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
        return 0
    start = max(size - _TAIL, 0)
    f.seek(start)
    tail = f.read()
    end = tail.rfind(b"\n")
    if end != len(tail) - 1:
        f.truncate(start + end + 1 if end >= 0 else start)
        f.seek(0, os.SEEK_END)
        if end < 0:
            return 0 if start == 0 else _last_seq(f)
        tail = tail[: end + 1]
    lines = tail.rstrip(b"\n").rsplit(b"\n", 1)
    try:
        return int(json.loads(lines[-1])["seq"])
    except (ValueError, KeyError, TypeError):
        return 0


def merge_timeline(sink: list[TransitionRecord], window: list[TransitionRecord]) -> list[TransitionRecord]:
    """The sink's records and the workflow's window, each record once, in seq order."""
    by_seq: dict[int, TransitionRecord] = {}
    unsequenced = []
    for record in [*sink, *window]:
        if record.seq:
            by_seq.setdefault(record.seq, record)
        elif record not in unsequenced:
            unsequenced.append(record)  # records written before records had a seq
    return unsequenced + [by_seq[k] for k in sorted(by_seq)]


def load_state_key(path: str | None = None) -> bytes:
    chosen = Path(path or os.environ.get("TETHER_STATE_KEY_FILE") or DEFAULT_STATE_KEY)
    if not chosen.exists():
        chosen.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(chosen, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    key = chosen.read_text().strip()
    if len(key) < 32:
        raise ValueError(f"state key file {chosen} holds fewer than 32 characters")
    return key.encode()


class AuditActivities:
    def __init__(self, sink: JsonlAuditSink | None = None, state_key: bytes | None = None) -> None:
        self.sink = sink or JsonlAuditSink.from_env()
        self.state_key = state_key or load_state_key()

    @activity.defn(name="audit_append")
    async def audit_append(self, batch: AuditBatch) -> AuditAck:
        return AuditAck(last_seq=self.sink.append(batch))

    def _mac(self, request: SealRequest) -> str:
        message = f"{request.workflow_id}\n{request.digest}".encode()
        return hmac.new(self.state_key, message, hashlib.sha256).hexdigest()

    @activity.defn(name="carryover_seal")
    async def carryover_seal(self, request: SealRequest) -> SealRequest:
        return request.model_copy(update={"seal": self._mac(request)})

    @activity.defn(name="carryover_verify")
    async def carryover_verify(self, request: SealRequest) -> bool:
        return request.seal is not None and hmac.compare_digest(self._mac(request), request.seal)
