"""The run lifecycle: states, the transition table as data, and the one guarded move.

This module is the single source of truth for what a run may do next. It has no Temporal
imports so it can be unit-tested directly and reused by tests, docs and the CLI. The workflow
changes state only through :meth:`Lifecycle.move`.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from datetime import datetime
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer, model_validator

from workflows.budgets import REASON_CHARS, REFUSAL_KEYS, REFUSALS_RECORDED, TIMELINE_HEAD, TIMELINE_WINDOW, clip


class RunState(str, Enum):
    RECEIVED = "RECEIVED"
    PLANNING = "PLANNING"
    VALIDATED = "VALIDATED"
    VALIDATION_FAILED = "VALIDATION_FAILED"
    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    APPROVED = "APPROVED"
    EXECUTING_TOOL = "EXECUTING_TOOL"
    RETRY_WAIT = "RETRY_WAIT"
    OBSERVING_RESULT = "OBSERVING_RESULT"
    COMPENSATING = "COMPENSATING"
    COMPLETED = "COMPLETED"
    REJECTED = "REJECTED"
    EXPIRED = "EXPIRED"
    EXECUTION_FAILED = "EXECUTION_FAILED"
    HANDED_OFF = "HANDED_OFF"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    COMPENSATED = "COMPENSATED"


S = RunState

# The table from docs/contract.md. Everything not listed here is denied.
TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    # COMPENSATING: a compensation run (`tether compensate`) starts undoing at once; VALIDATED:
    # one of a COMPLETED run, whose undos are a plan of their own to approve first.
    S.RECEIVED: frozenset({S.PLANNING, S.VALIDATED, S.COMPENSATING, S.CANCELLED, S.FAILED}),
    # COMPENSATING, from here on: a cancel of a run with on_cancel=compensate and ok writes.
    S.PLANNING: frozenset(
        {S.VALIDATED, S.VALIDATION_FAILED, S.COMPLETED, S.HANDED_OFF, S.CANCELLED, S.COMPENSATING, S.FAILED}
    ),
    # Back to PLANNING only while the replan budget lasts (the workflow checks the budget).
    S.VALIDATION_FAILED: frozenset({S.PLANNING, S.FAILED}),
    # EXECUTING_TOOL directly when policy says the plan needs no approval.
    S.VALIDATED: frozenset({S.AWAITING_APPROVAL, S.EXECUTING_TOOL, S.CANCELLED, S.COMPENSATING}),
    # PLANNING when the approval expired and the run asked for on_expiry=replan; VALIDATED when
    # a person revised the pending plan (or approved part of it): a new plan version.
    S.AWAITING_APPROVAL: frozenset(
        {S.APPROVED, S.REJECTED, S.EXPIRED, S.PLANNING, S.VALIDATED, S.HANDED_OFF, S.CANCELLED, S.COMPENSATING}
    ),
    # AWAITING_APPROVAL when the approvals no longer hold at execution time (an approver lost
    # the role, a tool was withdrawn from the tenant): the step does not run.
    S.APPROVED: frozenset({S.EXECUTING_TOOL, S.AWAITING_APPROVAL, S.CANCELLED, S.COMPENSATING}),
    # COMPENSATING instead of EXECUTION_FAILED when the run asked for on_failure=compensate
    # (or after a cancel, with on_cancel=compensate).
    # EXECUTING_TOOL again for each step of a parallel group that ends (its result on the record
    # as it lands); the group's barrier then moves on.
    # AWAITING_APPROVAL when a decision the run took on its roster does not hold under the
    # current file, judged again before the plan's first call: the call does not start.
    S.EXECUTING_TOOL: frozenset(
        {S.EXECUTING_TOOL, S.OBSERVING_RESULT, S.RETRY_WAIT, S.EXECUTION_FAILED, S.COMPENSATING, S.HANDED_OFF, S.CANCELLED,
         S.AWAITING_APPROVAL}
    ),
    S.RETRY_WAIT: frozenset({S.EXECUTING_TOOL, S.EXECUTION_FAILED, S.CANCELLED, S.COMPENSATING}),
    # EXECUTING_TOOL for the next step of the plan that was already approved.
    S.OBSERVING_RESULT: frozenset({S.PLANNING, S.EXECUTING_TOOL, S.COMPLETED, S.CANCELLED, S.COMPENSATING}),
    # The ok writes' compensations, newest first; each one done (or retried) is a step on the
    # record (COMPENSATING -> COMPENSATING). One that fails or whose outcome is unknown, or a
    # write with no recovery path, hands off: never a blind re-run.
    S.COMPENSATING: frozenset({S.COMPENSATING, S.COMPENSATED, S.HANDED_OFF, S.CANCELLED}),
    # Terminal states: no outgoing edge.
    S.COMPLETED: frozenset(),
    S.REJECTED: frozenset(),
    S.EXPIRED: frozenset(),
    S.EXECUTION_FAILED: frozenset(),
    S.HANDED_OFF: frozenset(),
    S.CANCELLED: frozenset(),
    S.FAILED: frozenset(),
    S.COMPENSATED: frozenset(),
}

TERMINAL: frozenset[RunState] = frozenset(s for s, out in TRANSITIONS.items() if not out)
WORKING: frozenset[RunState] = frozenset(RunState) - TERMINAL
# The states a run rests in (it waits for a person or a timer), and its endings: published to
# the AgentRunState search attribute (each upsert is a history event). The states a run passes
# through while it works (PLANNING, EXECUTING_TOOL, APPROVED, ...) stay on the snapshot query and
# the timeline, except the first one after a rest (or after RECEIVED): a run that has left
# AWAITING_APPROVAL must never still be listed as waiting for a person.
PUBLISHED: frozenset[RunState] = TERMINAL | {RunState.AWAITING_APPROVAL, RunState.RETRY_WAIT}


def first_published(*, compensation: bool) -> RunState:
    """What a start sets AgentRunState to: the state the run's first workflow task moves it to
    from RECEIVED (the table allows it nothing else but an ending, and an ending is published),
    so that task needs no upsert of its own. A start that sets anything else is corrected by it."""
    return RunState.COMPENSATING if compensation else RunState.PLANNING


def to_publish(published: str | None, state: RunState) -> bool:
    """Whether the run upserts AgentRunState=``state`` now, the attribute saying ``published``."""
    if published == state.value:
        return False
    # A rest or an ending; or leaving a rest (or the start's RECEIVED, or a value that is no
    # state at all): say the run works, once. Only while it already says so, stay quiet.
    return state in PUBLISHED or published not in _QUIET


_QUIET = frozenset(s.value for s in RunState if s not in PUBLISHED and s != RunState.RECEIVED)

# How each final state ends the Temporal execution, so the Web UI's status badge, `temporal
# workflow list --query "ExecutionStatus='Failed'"` and Temporal's failure metrics tell the
# outcome: a run that failed is Failed, a cancelled one Canceled, every other ending (a
# decision, an expiry, a handoff: the run did what it should) Completed.
TEMPORAL_STATUS: dict[RunState, str] = {
    s: "Failed" if s in (RunState.FAILED, RunState.EXECUTION_FAILED)
    else "Canceled" if s == RunState.CANCELLED
    else "Completed"
    for s in TERMINAL
}


def is_allowed(from_state: RunState, to_state: RunState) -> bool:
    return to_state in TRANSITIONS[from_state]


class IllegalTransition(Exception):
    """A move the table denies. The workflow turns this into a non-retryable failure."""

    def __init__(self, from_state: RunState, to_state: RunState, reason: str) -> None:
        super().__init__(
            f"illegal transition {from_state.value} -> {to_state.value} ({reason}); "
            f"allowed from {from_state.value}: "
            f"{sorted(s.value for s in TRANSITIONS[from_state]) or 'nothing (terminal)'}"
        )
        self.from_state = from_state
        self.to_state = to_state


# What a step's side effect came to: ``ok`` (the call succeeded), ``failed`` (known not applied:
# the tool refused, a read failed, the call never started) or ``unknown`` (it may have applied:
# a timeout, a lost worker, a cancel mid-call, a transient error of a write).
EffectOutcome = Literal["ok", "failed", "unknown"]


class Refs(BaseModel):
    """Identifiers a record points at. Never prompts, tool arguments or tool results."""

    plan_hash: str | None = None
    tool_call_id: str | None = None
    idempotency_key: str | None = None
    decision_id: str | None = None
    error_code: str | None = None
    policy_hash: str | None = None
    # The approval request a record is about (a request opened, a decision on it, a revision of it).
    request_id: str | None = None
    # A revision: the plan it replaced and the RFC 6902 "op path" entries that changed (no values).
    previous_plan_hash: str | None = None
    changed: list[str] | None = None
    # Set on every record that ends a tool step (success, failure, retry wait, handoff, cancel,
    # budget): what happened to the step's effect.
    outcome: EffectOutcome | None = None
    # A decision judged by Cedar: the @id of each policy that decided it (docs/policy.md, "Cedar").
    policies: list[str] | None = None

    @model_serializer(mode="wrap")
    def _set_only(self, handler: Any) -> dict[str, Any]:
        # Only the ids a record has: most are unset, and every record is written to the audit
        # sink, carried across continue-as-new and answered by the timeline query.
        return {k: v for k, v in handler(self).items() if v is not None}


class TransitionRecord(BaseModel):
    """One line of the audit timeline.

    ``kind="transition"`` is a state change. ``kind="refused"`` records an event the runtime
    turned down (a stale approval, a signal for a finished run), with the ``rule`` that refused
    it; ``kind="accepted"`` records a decision that counted but did not change state yet (the
    first of two required approvals); ``kind="escalated"`` an escalation stage of a waiting
    plan (its timer fired: more roles may approve, people were told); ``kind="notify_failed"`` a
    webhook that never took an event (``rule``: the event). None of these changes state: they carry the current state as
    both ends and do not bump ``state_version``.
    """

    from_state: RunState
    to_state: RunState
    at: datetime
    actor: str
    reason: str
    state_version: int
    refs: Refs = Field(default_factory=Refs)
    kind: Literal["transition", "refused", "accepted", "escalated", "notify_failed"] = "transition"
    rule: str | None = None
    # 1, 2, 3, ... over the whole run (across continue-as-new): the audit sink's key, and how a
    # reader merges the workflow's window with the sink.
    seq: int = 0
    # The chain: the link (``record_link``) of the record before this one in its workflow id's
    # chain, across continue-as-new ("" for the first); a reset branch chains from its reset point.
    prev: str = ""
    # The fleet's signature (workflows/keys.py, ``record_statement``) over the workflow id, the
    # run that wrote it to the sink, the seq and this record's link, made by the workflow code on
    # the last record of each batch it sends out: through the chain it covers the records before.
    sig: str = ""
    # The run's last record: nothing of this run follows it (workflows/effects.py, the end's
    # checkpoint). Covered by the record's link, so by the signature over it: a trail cut short
    # cannot end on a marked record, and an auditor knows an end without Temporal's copy of the run.
    final: bool = False


def record_link(record: TransitionRecord) -> str:
    """A record's link in its chain: the sha256 (128 bits of it, hex) of its JSON without its
    signature, the fields at their defaults left out (so a field a later build adds does not
    change an older record's link). It covers ``prev``, so a signature over one record's link
    covers every record chained before it. Pure: an auditor's verifier computes the same."""
    body = record.model_dump(mode="json", exclude_defaults=True, exclude={"sig"})
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def implied_links(records: list[TransitionRecord]) -> list[TransitionRecord]:
    """Records as a run sends them (a batch, its end view): each after the first with its
    ``prev`` left out, which the receiver fills in again (``with_links``): a batch is a run of
    consecutive records of one chain."""
    return records[:1] + [r.model_copy(update={"prev": ""}) for r in records[1:]]


def with_links(records: list[TransitionRecord]) -> list[TransitionRecord]:
    """The ``prev`` of each record after the first, from the record before it (``implied_links``
    left them out); a record that names one keeps it."""
    for before, record in zip(records, records[1:]):
        if not record.prev and record.seq == before.seq + 1:
            record.prev = record_link(before)
    return records


# What a run sends for itself alone (the audit batch, the published view): JSON without the
# fields left at their defaults, deflated, as bytes (a binary payload: no JSON string around it).
# Internal payloads, not meant to be read in the Web UI: the timeline query, `tether status` /
# `timeline` and the audit sink show what they carry. One helper, deterministic (the same value
# gives the same bytes); what is not bytes is read as it is (what older builds sent).
# Unpacked at most this much: packed bytes never inflate past it.
PACKED_MAX_BYTES = 16 * 1024 * 1024


# Deflated with a preset dictionary: Tether's own vocabulary (field names, states, the runtime's
# reasons), which every packed value repeats and a small payload would otherwise spell out once
# each (the end's view: 1,276 -> ~630 B). The stream names its dictionary (zlib's FDICT id), so a
# dictionary is never edited, only added to PACK_DICTS: what was packed with one stays readable.
PACK_DICT = (
    '"workflow_id":"","first_run_id":"","run_id":"","continued_from":"","published_at":"",'
    '"snapshot":{"tenant":"","state":"","previous_state":"","state_version":,"plan":{"steps":'
    '[{"tool_call_id":"tc-001-","tool":"","args":{}}],"plan_hash":"","undo":[null,null,null,null],'
    '"version":},"pending_approval":{"request_id":"","approvals_required":1,"approvals":[],'
    '"expires_at":"","roles":[],"stage":},"step":,"retries":0,"last_error":null,"approved_by":[],'
    '"answer":"Done: ","created_at":"","updated_at":"","model_tokens":,"requested_by":"",'
    '"requester_verified":true,"refusals":{},"timeline_records":,"compensations":[],'
    '"audit_waiting":,"audit_error":"","updates":[],"revisions":[],"tools":[{"name":"",'
    '"effect":"read_only","idempotent","reconcilable","unsafe","requires_approval":false,'
    '"args_schema":{"properties":{"":{"type":"string","number","integer"}},"required":[""],'
    '"type":"object"},"timeout_seconds":30.0,"max_retries":3,"source":"python"}]},'
    '"records":[{"kind":"decision","rule":"","from_state":"RECEIVED","to_state":"PLANNING","at":"",'
    '"actor":"runtime","reason":"run received; policy built-in default (no policy file): every '
    'write needs one approval from someone other than the requester","state_version":1,'
    '"refs":{"policy_hash":""},"seq":1},{"from_state":"AWAITING_APPROVAL","to_state":"APPROVED",'
    '"reason":"approval 1 of 1 accepted","refs":{"decision_id":"","request_id":"","approver":""}},'
    '"REJECTED","EXPIRED","CANCELLED","FAILED","HANDED_OFF","COMPENSATING","COMPENSATED",'
    '"VALIDATION_FAILED","approved plan: executing","approval needed: ",'
    '{"from_state":"PLANNING","to_state":"VALIDATED","reason":"plan of 5 step(s) validated",'
    '"refs":{"plan_hash":""}},{"from_state":"VALIDATED","to_state":"EXECUTING_TOOL","reason":'
    '"policy needs no approval: 5 step(s), all read-only","refs":{"plan_hash":"","tool_call_id":'
    '"tc-001-","idempotency_key":":tc-001-"}},{"from_state":"EXECUTING_TOOL","to_state":'
    '"OBSERVING_RESULT","reason":"tool call tc-001- () succeeded","outcome":"ok"},'
    '{"from_state":"OBSERVING_RESULT","to_state":"EXECUTING_TOOL","reason":"next step of the plan"},'
    '{"from_state":"OBSERVING_RESULT","to_state":"PLANNING","reason":"plan executed: planning what '
    'is next"},{"from_state":"PLANNING","to_state":"COMPLETED","reason":"planner finished with an '
    'answer"},"timeline":[{"from_state":"'
).encode("utf-8")
PACK_DICTS = {zlib.adler32(PACK_DICT): PACK_DICT}


def pack_json(value: Any) -> bytes:
    """A JSON-able value as compact bytes (``unpack_json`` reads it back)."""
    deflate = zlib.compressobj(9, zdict=PACK_DICT)
    raw = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return deflate.compress(raw) + deflate.flush()


def unpack_json(value: Any) -> Any:
    """What ``pack_json`` wrote, as the value; anything but bytes as it is."""
    if not isinstance(value, (bytes, bytearray)):
        return value
    try:
        value = bytes(value)
        if len(value) >= 6 and value[1] & 0x20:  # FDICT: the id of the dictionary it was packed with
            zdict = PACK_DICTS.get(int.from_bytes(value[2:6], "big"))
            if zdict is None:
                raise ValueError("packed with a dictionary this build does not know")
            inflate = zlib.decompressobj(zdict=zdict)
        else:
            inflate = zlib.decompressobj()
        raw = inflate.decompress(value, PACKED_MAX_BYTES)
        if inflate.unconsumed_tail or not inflate.eof:
            raise ValueError(f"past {PACKED_MAX_BYTES} bytes, or cut short")
        return json.loads(raw)
    except (zlib.error, ValueError) as e:
        raise ValueError(f"packed bytes unreadable: {e}") from None


class Packed(BaseModel):
    """A model a run sends for itself alone (the audit batch, the published view): ``packed()``
    is its wire form (``pack_json``, the fields at their defaults left out), and it validates
    from that form or from plain JSON (what older builds sent)."""

    def packed(self) -> bytes:
        return pack_json(self.model_dump(mode="json", exclude_defaults=True))

    @model_validator(mode="before")
    @classmethod
    def _unpacked(cls, data: Any) -> Any:
        return unpack_json(data)


class Lifecycle(BaseModel):
    """A run's state and its timeline: one serializable structure, carried across continue-as-new.

    The timeline kept here is bounded: the first TIMELINE_HEAD records and the latest ones, up
    to TIMELINE_WINDOW; refusals of one rule from one actor past REFUSALS_RECORDED are counted in
    ``refusals``, with one record saying so. Every record also goes to the audit sink.
    """

    state: RunState = RunState.RECEIVED
    previous_state: RunState | None = None
    state_version: int = 0
    timeline: list[TransitionRecord] = Field(default_factory=list)
    records: int = 0  # records written in all; the last one's seq
    omitted: int = 0  # records dropped from the window (still in the audit sink)
    refusals: dict[str, int] = Field(default_factory=dict)  # "rule actor" -> count
    chain: str = ""  # the link of the last record written: the next one's ``prev``

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def can_move(self, to_state: RunState) -> bool:
        return is_allowed(self.state, to_state)

    def move(
        self, to_state: RunState, *, at: datetime, actor: str, reason: str, refs: Refs | None = None
    ) -> TransitionRecord:
        """The only way a run changes state: deny by default, bump the version, record it."""
        if not is_allowed(self.state, to_state):
            raise IllegalTransition(self.state, to_state, reason)
        self.state_version += 1
        record = TransitionRecord(
            from_state=self.state,
            to_state=to_state,
            at=at,
            actor=actor,
            reason=reason,
            state_version=self.state_version,
            refs=refs or Refs(),
        )
        self.previous_state, self.state = self.state, to_state
        return self._append(record)

    def refuse(
        self, *, at: datetime, actor: str, reason: str, refs: Refs | None = None, rule: str = "other"
    ) -> TransitionRecord | None:
        """Record an event that was turned down, and the rule that refused it. No state change.

        A flood is counted, not stored: past REFUSALS_RECORDED refusals of one rule from one
        actor, one record says so and the rest only count (None is returned for those).
        """
        key = f"{rule} {actor}"
        if key not in self.refusals and len(self.refusals) >= REFUSAL_KEYS:
            key = f"{rule} *"  # many distinct senders: counted together
        count = self.refusals.get(key, 0) + 1
        self.refusals[key] = count
        if count > REFUSALS_RECORDED + 1:
            return None
        if count == REFUSALS_RECORDED + 1:
            reason = (
                f"further refusals [{rule}] from {key.split(' ', 1)[1]} are counted, not recorded "
                f"(snapshot.refusals); this one: {reason}"
            )
        return self._note("refused", at=at, actor=actor, reason=reason, refs=refs, rule=rule)

    def accept(
        self, *, at: datetime, actor: str, reason: str, refs: Refs | None = None
    ) -> TransitionRecord:
        """Record a decision that counted without changing state (more approvals needed)."""
        return self._note("accepted", at=at, actor=actor, reason=reason, refs=refs, rule=None)

    def escalate(
        self, *, at: datetime, reason: str, refs: Refs | None = None
    ) -> TransitionRecord:
        """Record an escalation stage of a waiting plan (no state change)."""
        return self._note("escalated", at=at, actor="timer", reason=reason, refs=refs, rule=None)

    def notify_failed(self, *, at: datetime, reason: str, event: str, refs: Refs | None = None) -> TransitionRecord:
        """Record a notification no webhook retry could deliver (the run went on regardless)."""
        return self._note("notify_failed", at=at, actor="runtime", reason=reason, refs=refs, rule=event)

    def _note(
        self,
        kind: Literal["refused", "accepted", "escalated", "notify_failed"],
        *,
        at: datetime,
        actor: str,
        reason: str,
        refs: Refs | None,
        rule: str | None,
    ) -> TransitionRecord:
        record = TransitionRecord(
            from_state=self.state,
            to_state=self.state,
            at=at,
            actor=actor,
            reason=reason,
            state_version=self.state_version,
            refs=refs or Refs(),
            kind=kind,
            rule=rule,
        )
        return self._append(record)

    def fold(self, tail: int) -> int:
        """Keep the head and the latest ``tail`` records (every record is in the audit sink);
        returns how many were dropped from the window."""
        drop = len(self.timeline) - TIMELINE_HEAD - tail
        if drop <= 0:
            return 0
        del self.timeline[TIMELINE_HEAD : TIMELINE_HEAD + drop]
        self.omitted += drop
        return drop

    def _append(self, record: TransitionRecord) -> TransitionRecord:
        self.records += 1
        record.seq = self.records
        record.reason = clip(record.reason, REASON_CHARS)
        record.prev = self.chain
        self.chain = record_link(record)
        self.timeline.append(record)
        if len(self.timeline) > TIMELINE_WINDOW:
            del self.timeline[TIMELINE_HEAD]  # the oldest after the head; the sink has it
            self.omitted += 1
        return record


def is_legal_path(timeline: list[TransitionRecord]) -> bool:
    """True when the transitions form one connected path through the table from RECEIVED,
    with strictly increasing versions. Used by tests and by ``starter.py timeline`` checks."""
    state, version = RunState.RECEIVED, 0
    for record in timeline:
        if record.kind != "transition":
            continue
        if record.from_state != state or not is_allowed(state, record.to_state):
            return False
        if record.state_version <= version:
            return False
        state, version = record.to_state, record.state_version
    return True


def mermaid() -> str:
    """The state diagram, generated from the table (the README embeds it; a test keeps them equal)."""
    lines = ["stateDiagram-v2", "    [*] --> RECEIVED"]
    for from_state in RunState:
        for to_state in sorted(TRANSITIONS[from_state], key=lambda s: list(RunState).index(s)):
            lines.append(f"    {from_state.value} --> {to_state.value}")
    for state in RunState:
        if state in TERMINAL:
            lines.append(f"    {state.value} --> [*]")
    return "\n".join(lines)
