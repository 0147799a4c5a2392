"""The audit sink: every timeline record, in order, behind an activity.

**Audit sink.** The workflow keeps a bounded window of its timeline (workflows/budgets.py); every
record also comes here, in order, through the local activity ``audit_append``. The default sink
writes JSON lines, one file per run (workflow id and first run id), under ``TETHER_AUDIT_DIR``
(default ``.tether/audit``). Appends are keyed by the record's ``seq``: a retried or repeated
batch never writes a record twice, and a line torn by a worker killed mid-write is cut off and
written again by the retry. ``tether timeline RUN --all`` reads the file and the window.

The carried-state seal lives in ``activities/keys.py``.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from temporalio import activity

from workflows.models import AuditAck, AuditBatch
from workflows.states import TransitionRecord

DEFAULT_AUDIT_DIR = ".tether/audit"
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


class AuditActivities:
    def __init__(self, sink: JsonlAuditSink | None = None) -> None:
        self.sink = sink or JsonlAuditSink.from_env()

    @activity.defn(name="audit_append")
    async def audit_append(self, batch: AuditBatch) -> AuditAck:
        return AuditAck(last_seq=self.sink.append(batch))
