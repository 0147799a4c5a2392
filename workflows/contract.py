"""The public contract: what people, clients and tools send a run and the records it keeps.

The names tool authors and clients use (``ToolEffect``, ``Compensation``, ``Limits``), the
signals' and the ``decide`` Update's payloads, and the records a run's queries show (plans,
executed steps, approvals, revisions, compensations). JSON field and class names here are public
API (docs/contract.md) and are written into histories: they are never renamed. Every
workflow, signal, query and activity takes exactly one model, so the pydantic data converter
never has to guess. ``workflows.models`` re-exports the models of every layer, for tool modules
and clients.
"""

from __future__ import annotations

import json

import hashlib
from collections.abc import Sequence
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal

import rfc8785
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_serializer, model_validator

from workflows.identity import Name
from workflows.states import EffectOutcome, RunState, TransitionRecord


# Tenants end up in search attributes and the Web UI: keep them to plain identifiers.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}$"

# The longest workflow id Temporal takes (its default limit): a child's id is its parent's and more.
WORKFLOW_ID_CHARS = 1000


# A trusted signer's name ([signers.NAME] in the policy file, ApprovalDecision.attested_by).
SIGNER_NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"


# Validate with this context to refuse unknown keys: client inputs and the policy file.
STRICT = {"strict_keys": True}


class Contract(BaseModel):
    """A model that crosses a trust or version boundary.

    Lenient by default: a run carried over by a newer worker version (one more field) or an
    activity result from one must still load here. Strict where a person or a client wrote it:
    validated with ``context=STRICT``, unknown keys are refused.
    """

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_keys(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, dict) and (info.context or {}).get("strict_keys"):
            known = {f.alias or name for name, f in cls.model_fields.items()} | set(cls.model_fields)
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise ValueError(f"unknown field(s): {', '.join(unknown)[:200]}")
        return value


class ToolEffect(str, Enum):
    """What a tool does to the outside world. It decides the retry rule and the approval default."""

    READ_ONLY = "read_only"  # no side effect
    IDEMPOTENT = "idempotent"  # the target system dedupes by the idempotency key
    RECONCILABLE = "reconcilable"  # not idempotent, but a previous effect can be looked up by key
    UNSAFE = "unsafe"  # neither: runs at most once


class Limits(Contract):
    max_steps: int = Field(20, ge=1, le=1000, description="tool calls a run may execute in all")
    max_replans: int = Field(3, ge=0, le=100, description="proposals that may fail validation")
    approval_ttl_seconds: float = Field(
        24 * 3600, gt=0, le=366 * 24 * 3600, description="how long an approval request stays open"
    )
    on_expiry: Literal["expire", "replan"] = "expire"
    max_model_tokens: int | None = Field(
        None, ge=1, description="model tokens (as the endpoint reports them) a run may use in all"
    )


# What a run does when a step fails with its outcome known (``failed``): "stop" ends it in
# EXECUTION_FAILED, the ok writes kept; "compensate" runs their declared compensations in reverse
# order (COMPENSATING -> COMPENSATED). docs/operations.md, "Recovery".
OnFailure = Literal["stop", "compensate"]


def omit_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A model's fields less those at the given defaults: fields added later are left out of
    what was recorded (and attested) before they existed, so old histories replay unchanged."""
    return {k: v for k, v in data.items() if k not in defaults or v != defaults[k]}


# Steps of one parallel group, at most (the policy's max_parallel says how many run at once).
GROUP_MAX = 16


class PlaybookStep(Contract):
    """One step of a playbook: a tool call; ``{"parallel": [step, ...]}``, a group of steps
    that run at once (read-only and idempotent tools and delegations only: the validator says so); or
    ``{"delegate": {...}}``, a child run with a narrowed grant."""

    tool: str = ""
    args: dict[str, Any] = Field(default_factory=dict)
    parallel: list[PlaybookStep] | None = Field(None, min_length=1, max_length=GROUP_MAX)
    delegate: Delegation | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> PlaybookStep:
        # A tool step otherwise (an empty or unknown tool: validation says so, on the record).
        kinds = [k for k, set_ in (("parallel", self.parallel is not None), ("delegate", self.delegate is not None)) if set_]
        if len(kinds) > 1 or (kinds and (self.tool or self.args)):
            raise ValueError('a playbook step is one of {"tool": ...}, {"parallel": [step, ...]} or {"delegate": {...}}')
        if self.parallel is not None and any(s.parallel is not None for s in self.parallel):
            raise ValueError("a parallel group holds tool steps and delegations, not groups")
        return self

    @model_serializer(mode="wrap")
    def _plain_when_single(self, handler: Any) -> dict[str, Any]:
        # A tool step reads (and its request signs) as it did before groups existed.
        return omit_defaults(handler(self), {"parallel": None, "delegate": None})


class Delegation(Contract):
    """What a plan step hands a child run: its goal, the tools it may use (a subset of the
    parent's), its step budget (within the parent's remaining steps) and, optionally, its own
    playbook. The parent's workflow code turns it into a signed Grant."""

    goal: str = Field(min_length=1, max_length=2000)
    tools: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(min_length=1, max_length=64)
    max_steps: int = Field(5, ge=1, le=1000)
    playbook: list[PlaybookStep] | None = Field(None, min_length=1, max_length=200)
    # The child's planner (None: "playbook" with a playbook, else the parent's).
    planner: str | None = Field(None, min_length=1, max_length=64)

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"playbook": None, "planner": None})


PlaybookStep.model_rebuild()


class Grant(Contract):
    """What a child run may do, minted by its parent's workflow code with the fleet key: never
    more than the parent holds. The child's workflow code checks the seal, that it names this
    child and that the server says this parent started it; anything else is refused."""

    root: str = Field(min_length=1, max_length=WORKFLOW_ID_CHARS)  # the root run's workflow id
    parent: str = Field(min_length=1, max_length=WORKFLOW_ID_CHARS)  # the parent's workflow id
    parent_run: str = Field(min_length=1, max_length=256)  # the parent execution's run id
    child: str = Field(min_length=1, max_length=WORKFLOW_ID_CHARS)  # this child's workflow id
    depth: int = Field(ge=1, le=16)  # 1: a child of a root run
    tenant: str = Field(min_length=1, max_length=128)
    tools: list[str] = Field(min_length=1, max_length=64)
    effects: list[ToolEffect] = Field(default_factory=list, max_length=4)
    max_steps: int = Field(ge=1, le=1000)
    requested_by: str = Field(min_length=1, max_length=128)  # the root's requester: four-eyes holds
    parent_goal: str = Field("", max_length=2000)
    # The parent's approved plan named these writes (tool and arguments): the parent's approval
    # in force (who approved, for which request and plan of the parent's, the roles and count it
    # met) covers them in the child; any other write asks its own approval.
    covered: list[PlaybookStep] = Field(default_factory=list, max_length=200)
    approved: list[AcceptedApproval] = Field(default_factory=list, max_length=20)  # delegation.GRANT_APPROVALS
    approved_roles: list[str] = Field(default_factory=list, max_length=20)
    approvals_required: int = Field(0, ge=0, le=20)
    approved_request: str = Field("", max_length=128)
    approved_plan: str = Field("", max_length=128)
    parent_first_run: str = Field("", max_length=256)
    # What the tree had done and had in flight when the parent started this child, per
    # "tool.field" (RunData.spent's sums): the child's plans are judged on these plus its own,
    # so delegation cannot split an amount rule's sum.
    spent: dict[str, float] = Field(default_factory=dict, max_length=256)
    # A sibling in flight beside it (same parallel group) may write amounts nobody named (its
    # planner proposes them): the tree's sums are not known, so no amount rule auto-approves
    # this child's writes (each asks its approval). Inherited down the tree.
    sums_unknown: bool = False
    seal: str = Field("", max_length=200)

    def sealed_digest(self) -> str:
        return json_digest(self.model_dump(mode="json", exclude={"seal"}))

    @model_serializer(mode="wrap")
    def _spent_when_set(self, handler: Any) -> dict[str, Any]:
        # Grants sealed before the field existed read (and digest) as they were.
        return omit_defaults(handler(self), {"spent": {}, "sums_unknown": False})


class Compensation(Contract):
    """How a tool's effect is undone, declared as data: the compensating tool, and its arguments
    as JSON pointers (RFC 6901) into ``{"args": <the original call's arguments>, "result": <its
    result>}``, e.g. ``{"refund_id": "/result/refund_id"}``. The workflow builds the call from
    these (workflows/recovery.py); a pointer that finds nothing is a recorded failure, never a
    guess."""

    tool: str = Field(min_length=1, max_length=128)
    args: dict[str, str] = Field(default_factory=dict, max_length=64)

    @field_validator("args")
    @classmethod
    def _pointers(cls, value: dict[str, str]) -> dict[str, str]:
        for name, pointer in value.items():
            if not (pointer.startswith("/args/") or pointer.startswith("/result/") or pointer in ("/args", "/result")):
                raise ValueError(
                    f"compensation argument {name!r}: {pointer!r} is not a JSON pointer into /args or /result"
                )
        return value


class ToolInfo(BaseModel):
    """A tool as the catalog snapshot describes it: enough to validate and to decide policy."""

    name: str
    description: str = ""
    effect: ToolEffect
    requires_approval: bool
    args_schema: dict[str, Any]
    # The tool decorator's defaults (tether/tools/sdk.py): a snapshot leaves them out.
    timeout_seconds: float = 30.0
    max_retries: int = 3
    # Arguments worth showing an approver (the target, the amount); never secrets or personal data.
    summary_fields: list[str] = Field(default_factory=list)
    # May destroy data (MCP destructiveHint; see workflows/mcp_effects.py): shown in the risk
    # summary, and a policy's high_risk.destructive makes plans that call it high risk.
    destructive: bool = False
    # Where the tool comes from: "python" (a tool module) or "mcp:<server>".
    source: str = "python"
    # How its effect is undone (None: no recovery path).
    compensate: Compensation | None = None
    # The JSON schema of what it returns, where its function declares a pydantic model as its
    # return type (None: undeclared): a read's money fields are shown in words (workflows/wording.py).
    result_schema: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _as_recorded(self, handler: Any) -> dict[str, Any]:
        # A tool that declares no result reads as it did before result schemas existed.
        return omit_defaults(handler(self), {"result_schema": None})


class ToolCatalog(BaseModel):
    tools: list[ToolInfo] = Field(default_factory=list)

    def get(self, name: str) -> ToolInfo | None:
        return next((t for t in self.tools if t.name == name), None)


# The plan step that delegates (a child run): its arguments are a Delegation.
DELEGATE = "tether.delegate"
# Its catalog entry: it writes nothing itself (the child's writes are gated in the child), so
# the parent runs it without an approval of its own.
DELEGATE_INFO = ToolInfo(
    name=DELEGATE,
    description="Hand a sub-task to a child run with a narrowed grant: "
    '{"goal": ..., "tools": [...], "max_steps": N, "playbook": [...]}',
    effect=ToolEffect.READ_ONLY,
    requires_approval=False,
    args_schema={"type": "object"},
    max_retries=0,
)


def run_catalog(catalog: ToolCatalog | None, *, delegate: bool = True) -> ToolCatalog:
    """The tools a run may plan with: its catalog snapshot's and, where it may delegate, the
    delegate step. (The snapshot itself, which the run carries, stays as the worker gave it.)"""
    tools = [t for t in (catalog.tools if catalog else []) if t.name != DELEGATE]
    return ToolCatalog(tools=[*tools, DELEGATE_INFO] if delegate else tools)


class ExecutedStep(BaseModel):
    # Older steps keep only id, tool, status and digest (args and observation emptied): the
    # state a run carries stays bounded however long it runs (workflows/budgets.py).
    tool_call_id: str
    tool: str
    args: dict[str, Any]
    status: Literal["ok", "failed"]  # did the call succeed ("failed" also when outcome is unknown)
    observation: str = ""
    digest: str = ""
    # What happened to the effect: ok, failed (known not applied) or unknown (may have applied).
    outcome: EffectOutcome

    @model_validator(mode="before")
    @classmethod
    def _outcome_from_status(cls, data: Any) -> Any:
        # Steps recorded before ``outcome`` existed (carried over, in histories) read as their status.
        if isinstance(data, dict) and "outcome" not in data and "status" in data:
            data = {**data, "outcome": data["status"]}
        return data


class NotApproved(BaseModel):
    """A step a partial approval left out: the planner is told, so it does not propose it again
    unchanged (and if it does, that is a new plan needing a new approval)."""

    step: int  # its 1-based number in the plan it was proposed in
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    by: str


class PlanStep(BaseModel):
    tool_call_id: str
    tool: str
    args: dict[str, Any]
    # Steps next to one another with the same group run at once (a playbook's "parallel"); the
    # plan hash covers it. None: on its own.
    group: int | None = None

    @model_serializer(mode="wrap")
    def _group_when_set(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"group": None})  # older plans read as they did


def first_error(err: ValidationError) -> str:
    """The first problem pydantic found, as ``where: what`` (one line, for users and timelines)."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "input"
    return f"{where}: {first['msg']}"[:200]


def canonical_json(value: Any) -> str:
    """RFC 8785 (JSON Canonicalization Scheme): one text for one value, whoever serialises it.

    Raises ValueError for what JSON cannot say exactly (NaN, infinities, integers beyond 2**53).
    """
    # Digests and MACs take it on every activity a run calls: the common values (no float
    # outside [1e-4, 1e16), no key past U+D7FF, no lone surrogate) go through the C encoder,
    # whose text is then RFC 8785's (tests/workflows/test_states.py compares the two on random values);
    # anything else through the reference implementation.
    try:
        text = json.dumps(_jcs_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        text.encode("utf-8")  # a lone surrogate: the reference says what to do
        return text
    except (_NotPlain, UnicodeEncodeError):
        pass
    try:
        return rfc8785.dumps(value).decode()
    except rfc8785.CanonicalizationError as e:
        raise ValueError(f"not canonical JSON: {e}") from None


class _NotPlain(Exception):
    pass


_JCS_INT = 2**53


def _jcs_plain(value: Any) -> Any:
    """``value`` as the C encoder writes RFC 8785's text for it: integral floats as integers
    (JCS writes 30.0 as 30); _NotPlain where the two could differ."""
    if isinstance(value, str) or value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        if -_JCS_INT <= value <= _JCS_INT:
            return int(value)
        raise _NotPlain
    if isinstance(value, float):
        magnitude = abs(value)
        if magnitude <= _JCS_INT and value == int(value):
            return int(value)
        if 1e-4 <= magnitude < _JCS_INT:  # where repr and ES6 both write the shortest digits, fixed
            return value
        raise _NotPlain
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or not (k.isascii() or max(k) < "\ue000"):
                raise _NotPlain  # JCS sorts keys by UTF-16 units: the same order below U+E000
            out[k] = _jcs_plain(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_jcs_plain(v) for v in value]
    raise _NotPlain


def json_digest(value: Any) -> str:
    """sha256 (hex) of the value's canonical JSON: one digest for one value, whoever computes it."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def derived_digest(kind: str, *parts: str) -> str:
    """What an id is made of: the run chain, the decision, the plan; never the run's random
    stream, so a reset run makes the same ids and another run never does."""
    return hashlib.sha256("\x1f".join((kind, *parts)).encode()).hexdigest()


def derived_id(kind: str, *parts: str) -> str:
    return f"{kind}-{derived_digest(kind, *parts)[:24]}"


class Plan(BaseModel):
    steps: list[PlanStep]
    plan_hash: str
    # Per step, the compensation the plan hash covers (None: no recovery path); None for plans
    # hashed before recovery existed (their hash covers no undo, so nothing of them is undone).
    undo: list[Compensation | None] | None = None
    # 1 for a run's first plan, then +1 for every plan after it, proposed or revised (not hashed).
    version: int = 1

    @staticmethod
    def hash_steps(steps: Sequence[PlanStep | RevisedStep], undo: list[Compensation | None] | None = None) -> str:
        """sha256 of the canonical JSON of the tools and arguments, in order, and, given
        ``undo``, of each step's compensation: an approval of the hash approves the undo too.

        Tool call ids are left out on purpose: the hash names *what* will be done, so the same
        proposal hashes the same after a replan.
        """
        payload: list[dict[str, Any]] = [
            {"tool": s.tool, "args": s.args} | ({"parallel": group} if (group := getattr(s, "group", None)) else {})
            for s in steps
        ]
        if undo is not None:
            # No key for a step without one: a plan that declares no undo hashes as before.
            for item, comp in zip(payload, undo, strict=True):
                if comp is not None:
                    item["compensate"] = comp.model_dump(mode="json")
        return json_digest(payload)

    def hashes_to_itself(self) -> bool:
        """Do the steps (and undos) shown hash to the plan hash shown? A page or CLI that offers
        Approve checks it, so a view that lies about the arguments offers nothing to approve."""
        try:
            return self.hash_steps(self.steps, self.undo) == self.plan_hash
        except ValueError:  # undo of another length, a value canonical JSON refuses
            return False


class ApprovalDecision(Contract):
    """Payload of the ``approve`` and ``reject`` signals."""

    decision_id: str = Field(min_length=1, max_length=128)
    approver: Name
    plan_hash: str = Field(min_length=1, max_length=128)
    # The approval request this decides (snapshot.pending_approval.request_id): a decision
    # prepared for an earlier request, even of the same plan, does not count for a later one.
    request_id: str | None = Field(None, min_length=1, max_length=128)
    comment: str | None = Field(None, max_length=2000)
    reason: str | None = Field(None, max_length=2000)
    # Ed25519 signature (base64) over policy.signature_payload(...), required where the tenant
    # requires signatures and for approvers whose public key the policy lists.
    signature: str | None = Field(None, max_length=200)
    # The trusted signer (policy `[signers.NAME]`, e.g. the inbox) whose key made `signature`,
    # attesting that it verified `approver` itself (SSO): then the signature is the signer's,
    # over the same payload plus this name, and the timeline shows `user:bob via NAME`.
    attested_by: str | None = Field(None, pattern=SIGNER_NAME)
    # Partial approval (approve only): the 1-based numbers of the steps approved; None: all.
    # The other steps are dropped from the plan (a revision) and the result is approved.
    steps: list[int] | None = Field(None, min_length=1, max_length=1000)
    # The approver did not bind the decision to a plan they reviewed (`tether approve
    # --unreviewed`): it still names the pending hash, and the record says it was not reviewed.
    unreviewed: bool = False

    @field_validator("steps")
    @classmethod
    def _distinct_steps(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if any(n < 1 for n in value):
                raise ValueError("step numbers start at 1")
            if len(set(value)) != len(value):
                raise ValueError("a step number is given twice")
        return value


class RevisedStep(Contract):
    tool: str = Field(min_length=1, max_length=128)
    args: dict[str, Any] = Field(default_factory=dict)


class RevisionRequest(Contract):
    """Payload of the ``revise`` signal (and of ``decide`` with kind ``revise``): the whole
    revised plan for the pending approval request, validated like a proposal."""

    decision_id: str = Field(min_length=1, max_length=128)
    editor: Name
    plan_hash: str = Field(min_length=1, max_length=128)  # the pending plan it edits
    request_id: str | None = Field(None, min_length=1, max_length=128)  # the pending request
    steps: list[RevisedStep] = Field(min_length=1, max_length=1000)
    reason: str = Field(min_length=1, max_length=2000)
    # Ed25519 over policy.signature_payload(kind="revise", ..., steps_digest=revised_hash()).
    signature: str | None = Field(None, max_length=200)
    attested_by: str | None = Field(None, pattern=SIGNER_NAME)  # as on ApprovalDecision

    def revised_hash(self) -> str:
        """sha256 of the revised steps (tools + arguments), as the plan hash would be."""
        return Plan.hash_steps(self.steps)

    def as_decision(self) -> ApprovalDecision:
        """The decision fields every decision has: screened and signed like an approval's."""
        return ApprovalDecision(
            decision_id=self.decision_id,
            approver=self.editor,
            plan_hash=self.plan_hash,
            request_id=self.request_id,
            reason=self.reason,
            signature=self.signature,
            attested_by=self.attested_by,
        )


class DecideRequest(ApprovalDecision):
    """Payload of the ``decide`` Update: a decision and its kind, answered at once. With kind
    ``revise`` the payload is a :class:`ReviseDecideRequest` instead."""

    kind: Literal["approve", "reject"]


class ReviseDecideRequest(RevisionRequest):
    kind: Literal["revise"]


class DecideResult(BaseModel):
    """The verdict the ``decide`` Update answers with: the record the run wrote for it (``record``,
    whole: what a client prints, with no timeline query after it)."""

    decision_id: str
    outcome: Literal["transition", "accepted", "refused"]
    state: RunState
    reason: str
    rule: str | None = None
    record: TransitionRecord | None = None


class HandoffRequest(Contract):
    """Payload of the ``handoff`` signal."""

    by: Name
    reason: str = Field(min_length=1, max_length=2000)
    # Lets the sender find the run's verdict on the timeline (refs.decision_id); optional for
    # clients that only signal.
    decision_id: str | None = Field(None, min_length=1, max_length=128)
    signature: str | None = Field(None, max_length=200)
    # A forced hand-off (`tether handoff RUN --force`, a run whose workflow tasks kept failing,
    # reset with it): the tool call ids whose attempts were in flight in the execution the
    # operator ended. They may have applied: the run never schedules them again.
    in_flight: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(default_factory=list, max_length=20)

    @model_serializer(mode="wrap")
    def _in_flight_left_out(self, handler: Any) -> dict[str, Any]:
        # Left out when empty: a hand-off (and the check it rides in) reads and hashes as it did
        # before forced ones existed, so recorded histories replay unchanged.
        return {k: v for k, v in handler(self).items() if not (k == "in_flight" and not v)}


class CancelRequest(Contract):
    """Payload of the ``cancel`` Update: a person asks the run to stop. The run judges it under
    its policy (membership of its tenant, Cedar's ``cancel``, the signature rule) and answers
    with its record of it (DecideResult)."""

    by: Name
    reason: str = Field(min_length=1, max_length=2000)
    # The sender finds the run's verdict by it (refs.decision_id); one verdict per id.
    decision_id: str = Field(min_length=1, max_length=128)
    signature: str | None = Field(None, max_length=200)


class AcceptedApproval(BaseModel):
    approver: str
    decision_id: str
    at: datetime
    # Kept so the re-check before every write can verify it again under the current file.
    signature: str | None = None
    # What the decision named (and its signature covers): for a partial approval, the plan and
    # request it was sent for and the steps it kept, not the subset plan it then approved.
    request_id: str = ""
    plan_hash: str = ""
    attested_by: str | None = None
    steps: list[int] | None = None


class Revision(BaseModel):
    """One revision of a pending plan, as the snapshot shows it: ids, paths, never values."""

    version: int  # the plan version it made
    editor: str
    at: datetime
    previous_plan_hash: str
    plan_hash: str
    changed: list[str] = Field(default_factory=list)  # RFC 6902 "op path", e.g. "replace /1/args/x"
    partial: bool = False  # made by a partial approval


_STANDING = frozenset({"undone_by", "undone_at", "rerun"})


class ReadFound(BaseModel):
    """What a read step found, as a person deciding is shown it (workflows/views.py): the step's
    arguments and the fields of its result the tool's summary fields name (its first fields when
    it names none), each bounded. Untrusted text: shown only escaped (workflows/display.py)."""

    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    fields: dict[str, Any] = Field(default_factory=dict)
    # The fields that are money, in words (``120.00 EUR``: shown beside the raw value), as the
    # tool's result schema declares them (workflows/wording.py: the same words as an argument's).
    money: dict[str, str] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _as_recorded(self, handler: Any) -> dict[str, Any]:
        # Nothing in words: it reads (and is signed) as it did before money was said here.
        return omit_defaults(handler(self), {"money": {}})


class CompensationCall(BaseModel):
    """The undo of one ok write, built when the write succeeded (workflows/recovery.py).

    ``tool`` None: the write has no recovery path (``error`` says why). ``status``: pending
    until it runs; then what its effect came to (ok, failed, unknown).
    """

    of: str  # the original step's tool call id
    of_tool: str
    tool: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: str = ""  # derived from the original call's key
    plan_hash: str = ""  # the plan (and so the approval) that covered this undo
    approved_by: list[str] = Field(default_factory=list)  # empty: the policy auto-approved it
    error: str | None = None
    status: Literal["pending", "ok", "failed", "unknown"] = "pending"
    # Where the undo ledger (tether/store/effect_ledger.py) says it stands, as a compensation run's
    # ``recovery_source`` read it: the run (workflow id) that did it (``ok``) or started it with
    # its outcome unknown (``unknown``: it may have applied), and when.
    undone_by: str = ""
    undone_at: datetime | None = None
    # An approver's recorded instruction to run an unsafe undo whose outcome is unknown again
    # (``tether compensate RUN --rerun-unknown STEP``); it is in the undo's capability.
    rerun: bool = False
    # The write's own arguments as its tool's summary fields name them (bounded:
    # workflows/budgets.py bounded_fields): what a compensation's view says it puts back.
    of_args: dict[str, Any] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _without_unset_standing(self, handler: Any) -> dict[str, Any]:
        # Left out at their defaults: an undo that is only the run's own reads (and hashes, in
        # the authority check it rides in) as it did before the ledger existed.
        return {k: v for k, v in handler(self).items()
                if not (k in _STANDING and v in ("", None, False)) and not (k == "of_args" and not v)}

    @property
    def tool_call_id(self) -> str:
        return f"{self.of}:undo"


Grant.model_rebuild()  # it names AcceptedApproval, defined after it
