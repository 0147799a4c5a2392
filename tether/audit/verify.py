"""Whether audit records and views are the fleet's: the checks the audit activities, the audit
collector and ``tether audit verify`` make.

A record or a view is the fleet's word only when the fleet's key signed it for the run it names
(workflows/keys.py): whoever completes a task can schedule audit_append with records of its own,
or write a memo. Verified with the public keys alone (tether/store/keys.PublicKeys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workflows import keys as ring_math
from workflows.run_state import RunView
from workflows.states import TransitionRecord, record_link

RECORDS_REFUSED = "tether_audit_records_refused"



def record_problem(publics: Any, workflow_id: str, run_id: str, record: TransitionRecord) -> str | None:
    """Why ``record``'s signature is not the fleet's for run ``run_id`` (None: it is)."""
    why = publics.problem(ring_math.record_statement(workflow_id, run_id, record.seq, record_link(record)), record.sig)
    return None if why is None else f"record seq {record.seq} of run {run_id}: {why}"


def batch_problem(publics: Any, workflow_id: str, run_id: str, records: list[TransitionRecord]) -> str | None:
    """Why ``records`` (a batch a run sends out, in seq order) are not the fleet's for run
    ``run_id`` (None: they are): each links to the one before it, and the last bears the fleet's
    signature, which through the chain covers the rest."""
    for before, record in zip(records, records[1:]):
        if record.seq != before.seq + 1 or record.prev != record_link(before):
            return f"record seq {record.seq} of run {run_id}: not chained to the record before it"
    return record_problem(publics, workflow_id, run_id, records[-1]) if records else None


def view_problem(publics: Any, workflow_id: str, run_id: str, view: RunView) -> str | None:
    """Why ``view`` is not what run ``run_id`` published (None: it is)."""
    why = publics.problem(ring_math.view_statement(workflow_id, run_id, ring_math.view_digest(view)), view.sig)
    return None if why is None else f"the view run {run_id} shows is not signed by the fleet ({why})"


@dataclass
class TrailCheck:
    """``tether audit verify``: every record of a workflow id's streams, signature and chain."""

    records: int = 0
    problems: list[str] = field(default_factory=list)  # the first one names the first bad record
    # The seqs of each stream (run id) a verified signature of the fleet's covers: only such a
    # record's final mark says where the stream ends (``stream_ends``).
    covered: dict[str, set[int]] = field(default_factory=dict)


def verify_streams(publics: Any, workflow_id: str, streams: dict[str, list[TransitionRecord]]) -> TrailCheck:
    """Every record of each stream (run id) links to the one before it and is covered by a
    signature of the fleet's for that stream on it or on a record chained after it (a run signs
    the last record of each batch it sends). A stream's first record links to a covered record
    of the seq before it in another stream of the workflow id (a continued or a reset run), or
    is seq 1. A record missing, out of the chain or not covered is named, first one first."""
    check = TrailCheck()
    covered: dict[str, list[TransitionRecord]] = {}
    problems: list[tuple[int, str]] = []
    for run_id, records in streams.items():
        ordered = sorted(records, key=lambda r: r.seq)
        check.records += len(ordered)
        good: list[TransitionRecord] = []
        signed = False  # walking back: a verified signature covers what chains before it
        after: TransitionRecord | None = None
        for record in reversed(ordered):
            if after is not None and (after.seq != record.seq + 1 or after.prev != record_link(record)):
                what = (f"records seq {record.seq + 1}..{after.seq - 1} are missing" if after.seq > record.seq + 1
                        else f"record seq {after.seq} is not chained to the record before it")
                problems.append((after.seq, f"run {run_id}: {what}"))
                signed = False
            if record.sig:
                why = record_problem(publics, workflow_id, run_id, record)
                if why:
                    problems.append((record.seq, why))
                signed = why is None
            if signed:
                good.append(record)
            else:
                problems.append((record.seq, f"record seq {record.seq} of run {run_id}: not covered by a signature of the fleet's"))
            after = record
        covered[run_id] = good
        check.covered[run_id] = {r.seq for r in good}
    links: dict[int, set[str]] = {}
    for records in covered.values():
        for record in records:
            links.setdefault(record.seq, set()).add(record_link(record))
    for run_id, records in covered.items():
        first = min(records, key=lambda r: r.seq, default=None)
        if first is not None and not (first.seq == 1 and first.prev == "" or first.prev in links.get(first.seq - 1, set())):
            problems.append((first.seq, f"record seq {first.seq} of run {run_id}: not chained to a record before it"))
    check.problems = [why for _, why in sorted(problems, key=lambda p: p[0])]
    return check


@dataclass
class StreamEnd:
    """Where one stream (run id) of a trail ends, as its records say: ``ended`` (its last record
    bears the run's final mark, signed with it: the state it ended in), ``continued`` (another
    stream of the workflow id goes on from one of its records: continued as new, or reset), or
    neither: open, or cut short."""

    run_id: str
    records: int
    last_seq: int
    ended: str | None = None
    continued_in: str | None = None

    @property
    def complete(self) -> bool:
        return self.ended is not None

    def words(self) -> str:
        if self.ended is not None:
            return f"complete, {self.records} record(s), ended {self.ended}"
        if self.continued_in is not None:
            return f"continued in run {self.continued_in} after seq {self.last_seq} ({self.records} record(s))"
        return f"open or cut short after seq {self.last_seq} ({self.records} record(s))"


def stream_ends(streams: dict[str, list[TransitionRecord]], check: TrailCheck) -> list[StreamEnd]:
    """Where each stream of a workflow id ends (``StreamEnd``), in the order they begin. A run's
    end is its last record, which the run marks final (``TransitionRecord.final``) and signs: a
    trail cut anywhere, even after its terminal transition, ends on an unmarked record, and no
    one without the fleet's key can mark one: a mark counts only on a record ``check``
    (``verify_streams``) found covered by the fleet's signature. A stream that another continues
    from is not an end."""
    firsts = {run_id: min(records, key=lambda r: r.seq) for run_id, records in streams.items() if records}
    ends = []
    for run_id, records in streams.items():
        ordered = sorted(records, key=lambda r: r.seq)
        if not ordered:
            continue
        end = StreamEnd(run_id=run_id, records=len(ordered), last_seq=ordered[-1].seq)
        if ordered[-1].final and ordered[-1].seq in check.covered.get(run_id, set()):
            end.ended = ordered[-1].to_state.value
        links = {record_link(r): r.seq for r in ordered}
        for other, first in firsts.items():
            if other != run_id and first.prev in links:
                end.continued_in = other
        ends.append(end)
    return sorted(ends, key=lambda e: (min(r.seq for r in streams[e.run_id]), e.run_id))
