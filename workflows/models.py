"""Pydantic contracts shared by the workflow, the activities and the clients.

JSON field names here are public API (see docs/architecture.md). Every workflow, signal, query and
activity takes exactly one of these models, so the pydantic data converter never has to guess.
"""

from __future__ import annotations

import hashlib

import rfc8785
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from workflows.budgets import REQUEST_BUDGET
from workflows.identity import Name, normalize_name
from workflows.states import EffectOutcome, Lifecycle, RunState, TransitionRecord

__all__ = [
    "AcceptedApproval",
    "ApprovalDecision",
    "Compensation",
    "CompensationCall",
    "ExecutedStep",
    "HandoffRequest",
    "Limits",
    "PendingApproval",
    "Plan",
    "PlanStep",
    "PlannerInput",
    "PlaybookStep",
    "RevisedStep",
    "RevisionRequest",
    "Revision",
    "NotApproved",
    "Proposal",
    "ProposedStep",
    "RunData",
    "RunOutcome",
    "RunSetup",
    "RunRequest",
    "RunSnapshot",
    "Signer",
    "ToolCall",
    "ToolCatalog",
    "ToolEffect",
    "ToolInfo",
    "ToolOutcome",
    "TransitionRecord",
    "canonical_json",
]

# Tenants end up in search attributes and the Web UI: keep them to plain identifiers.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}$"

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


# ----------------------------------------------------------------------------- run input


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
# order (COMPENSATING -> COMPENSATED). docs/architecture.md, "Recovery".
OnFailure = Literal["stop", "compensate"]


class PlaybookStep(Contract):
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)


class RunRequest(Contract):
    """The one input of the ``AgentRun`` workflow."""

    goal: str = Field(min_length=1, max_length=8000)
    tenant: str = Field("default", pattern=NAME_PATTERN)
    requested_by: Name
    planner: str = Field("playbook", max_length=64)
    playbook: list[PlaybookStep] = Field(default_factory=list, max_length=1000)
    limits: Limits = Field(default_factory=Limits)
    # None: the tenant's default (policy ``on_failure``), else "stop".
    on_failure: OnFailure | None = None
    # What a cancel does to the run's ok writes: "stop" keeps them (CANCELLED), "compensate"
    # undoes them first (COMPENSATING -> COMPENSATED). None: the tenant's ``on_cancel``.
    on_cancel: OnFailure | None = None
    # Set by ``tether compensate``: this run is the governed compensation of that (ended) run: it
    # runs the compensations the original's approvals covered, nothing else.
    compensate_run: str | None = Field(None, min_length=1, max_length=256)
    # Ed25519 signature (base64) by the requester over policy.start_signature_payload(...):
    # required where the tenant sets require_signatures, else the requester is only claimed.
    requester_signature: str | None = Field(None, max_length=200)
    # Signed with the start (tether start --key): a fresh value each time, and when it was
    # signed; the run refuses a signed start older than the tenant's start_signature_ttl.
    nonce: str | None = Field(None, min_length=8, max_length=128)
    issued_at: datetime | None = None
    # Set by the runtime only, when a run continues as new: the state it carries over, and the
    # worker's seal over it. A start input that carries state is refused (docs/architecture.md).
    carryover: RunData | None = None
    carryover_seal: str | None = Field(None, max_length=200)

    @model_validator(mode="after")
    def _within_budget(self) -> RunRequest:
        # The request rides along in every continue-as-new input, next to the carried state.
        size = len(self.model_dump_json(exclude={"carryover"}))
        if size > REQUEST_BUDGET:
            raise ValueError(f"the run request is {size} bytes, over its {REQUEST_BUDGET}-byte budget: use a smaller playbook")
        return self

    def request_digest(self) -> str:
        """sha256 over what the requester asks for (what a start signature covers)."""
        body = self.model_dump(mode="json", include={"goal", "tenant", "planner", "playbook", "limits"})
        # New fields join the signed body only when set: signatures made before them still hold.
        body.update(self.model_dump(mode="json", include={"on_failure", "on_cancel", "compensate_run"}, exclude_none=True))
        return json_digest(body)


# ----------------------------------------------------------------------------- tools


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
    timeout_seconds: float
    max_retries: int
    # Arguments worth showing an approver (the target, the amount); never secrets or personal data.
    summary_fields: list[str] = Field(default_factory=list)
    # May destroy data (MCP destructiveHint; see workflows/mcp_effects.py): shown in the risk
    # summary, and a policy's high_risk.destructive makes plans that call it high risk.
    destructive: bool = False
    # Where the tool comes from: "python" (a tool module) or "mcp:<server>".
    source: str = ""
    # How its effect is undone (None: no recovery path).
    compensate: Compensation | None = None


class ToolCatalog(BaseModel):
    tools: list[ToolInfo] = Field(default_factory=list)

    def get(self, name: str) -> ToolInfo | None:
        return next((t for t in self.tools if t.name == name), None)


# Error types the ``execute_tool`` activity reports besides the tools' own codes.
# The tool was still running a grace period after its deadline: the attempt is not over.
ATTEMPT_STILL_RUNNING = "attempt_still_running"
# The run's cancel reached the tool through its heartbeat and stopped it mid-call.
CANCELLED_MID_CALL = "cancelled_mid_call"


class Capability(BaseModel):
    """What lets one ``execute_tool`` attempt of a write run: minted by the run's own workflow
    code with the fleet key (workflows/keys.py) once the attested authority re-check allowed
    exactly that call, verified by the tool activity before the tool is called."""

    workflow_id: str
    run_id: str  # the run that scheduled the attempt (as the server says)
    activity_id: str  # the attempt's activity id
    request_id: str = ""  # the approval request in force ("" for an auto-approved plan)
    plan_hash: str
    tool_call_id: str
    tool: str
    args_digest: str  # sha256 of the arguments' canonical JSON
    idempotency_key: str
    key_id: str  # the fleet key (activities/keys.py) that made ``mac``
    expires_at: datetime  # the attempt's deadline: refused after it
    mac: str

    def fields(self) -> dict[str, Any]:
        """What the mac covers (everything but the mac; the key id is added by the ring)."""
        return self.model_dump(mode="json", exclude={"mac", "key_id"})


def args_digest(args: dict[str, Any]) -> str:
    return json_digest(args)


# Error types of ``execute_tool`` for a write's capability: refused for good (forged, wrong call),
# or the attempt never reached the tool and the run schedules it again with a fresh capability.
CAPABILITY_INVALID = "capability_invalid"
CAPABILITY_KEY_MISSING = "capability_key_missing"
CAPABILITY_EXPIRED = "capability_expired"
# A local activity found a seal naming a key id this worker does not hold.
KEY_MISSING = "key_missing"


class ToolCall(BaseModel):
    """Input of the ``execute_tool`` activity."""

    tool: str
    args: dict[str, Any]
    tool_call_id: str
    idempotency_key: str
    run_id: str
    tenant: str
    # 1 for the first call the workflow schedules, 2.. for its retries (reconcilable tools look
    # up their previous effect first when this is above 1).
    attempt: int = 1
    # Required for every tool that is not read_only (activities/tools.py refuses the call without).
    capability: Capability | None = None


class ToolOutcome(BaseModel):
    """Output of ``execute_tool``: a bounded observation, so history does not grow with results."""

    observation: str
    digest: str
    size: int
    truncated: bool = False
    # A write's: the fleet key's MAC over the request and this answer (workflows/keys.py), made by the
    # activity and checked by the workflow code before the run acts on it.
    attestation: str | None = None


# ----------------------------------------------------------------------------- planning


class ProposedStep(BaseModel):
    """A step as a planner proposes it. Untrusted: ``args`` may be anything, even a string."""

    tool: str
    args: Any = None


class Proposal(BaseModel):
    """What the planner proposes: steps to run, or an answer that finishes the run."""

    steps: list[ProposedStep] = Field(default_factory=list)
    answer: str | None = None
    # Tokens the planner call used, as the model endpoint reported them (0 for the playbook).
    usage_tokens: int = 0
    # Set at the activity boundary when the planner's answer was over budget: its size and
    # sha256, instead of the answer (validation refuses it; the run plans again).
    oversized_bytes: int | None = None
    oversized_digest: str | None = None
    # The first call of a run that plans also takes the run's setup (PlannerInput.setup): one
    # activity instead of two. Then the whole answer is attested by the fleet key.
    setup: RunSetup | None = None
    attestation: str | None = None


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


class PlannerInput(BaseModel):
    goal: str
    planner: str
    playbook: list[PlaybookStep]
    executed: list[ExecutedStep]
    feedback: str | None = None
    round: int = 1
    steps_done: int | None = None  # steps executed with status ok, in all (executed is a window)
    # Steps of the last plan a person left out when approving part of it.
    not_approved: list[NotApproved] = Field(default_factory=list)
    # A run's first call: take its setup too (the catalog and policy snapshot, as run_setup
    # would); where the policy refuses the run, nothing is planned.
    setup: SnapshotRequest | None = None


class PlanStep(BaseModel):
    tool_call_id: str
    tool: str
    args: dict[str, Any]


def first_error(err: ValidationError) -> str:
    """The first problem pydantic found, as ``where: what`` (one line, for users and timelines)."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "input"
    return f"{where}: {first['msg']}"[:200]


def canonical_json(value: Any) -> str:
    """RFC 8785 (JSON Canonicalization Scheme): one text for one value, whoever serialises it.

    Raises ValueError for what JSON cannot say exactly (NaN, infinities, integers beyond 2**53).
    """
    try:
        return rfc8785.dumps(value).decode()
    except rfc8785.CanonicalizationError as e:
        raise ValueError(f"not canonical JSON: {e}") from None


def json_digest(value: Any) -> str:
    """sha256 (hex) of the value's canonical JSON: one digest for one value, whoever computes it."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


class Plan(BaseModel):
    steps: list[PlanStep]
    plan_hash: str
    # Per step, the compensation the plan hash covers (None: no recovery path); None for plans
    # hashed before recovery existed (their hash covers no undo, so nothing of them is undone).
    undo: list[Compensation | None] | None = None
    # 1 for a run's first plan, then +1 for every plan after it, proposed or revised (not hashed).
    version: int = 1

    @staticmethod
    def hash_steps(steps: list[PlanStep], undo: list[Compensation | None] | None = None) -> str:
        """sha256 of the canonical JSON of the tools and arguments, in order, and, given
        ``undo``, of each step's compensation: an approval of the hash approves the undo too.

        Tool call ids are left out on purpose: the hash names *what* will be done, so the same
        proposal hashes the same after a replan.
        """
        payload: list[dict[str, Any]] = [{"tool": s.tool, "args": s.args} for s in steps]
        if undo is not None:
            # No key for a step without one: a plan that declares no undo hashes as before.
            for item, comp in zip(payload, undo, strict=True):
                if comp is not None:
                    item["compensate"] = comp.model_dump(mode="json")
        return json_digest(payload)


# ----------------------------------------------------------------------------- approvals


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
        return Plan.hash_steps(self.steps)  # type: ignore[arg-type]  (tool and args are all it reads)

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
    """The verdict the ``decide`` Update answers with: the record the run wrote for it."""

    decision_id: str
    outcome: Literal["transition", "accepted", "refused"]
    state: RunState
    reason: str
    rule: str | None = None


class HandoffRequest(Contract):
    """Payload of the ``handoff`` signal."""

    by: Name
    reason: str = Field(min_length=1, max_length=2000)
    # Lets the sender find the run's verdict on the timeline (refs.decision_id); optional for
    # clients that only signal.
    decision_id: str | None = Field(None, min_length=1, max_length=128)
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


class PendingApproval(BaseModel):
    plan_hash: str
    request_id: str = ""  # one per approval request (derived from the run chain and plan); decisions must name it
    expires_at: datetime
    summary: str  # the risk summary: which tools write, to what, amounts
    risk: Literal["normal", "high"] = "normal"
    approvals_required: int = 1
    roles: list[str] = Field(default_factory=list)  # roles that may approve this plan
    approvals: list[AcceptedApproval] = Field(default_factory=list)  # accepted so far
    # Who revised this plan (since the planner proposed it): under editor_may_approve = false
    # their approvals do not count.
    editors: list[str] = Field(default_factory=list)
    revisers: list[str] = Field(default_factory=list)  # of the editors, who changed its steps
    opened_at: datetime | None = None
    # The stages that fire inside this request's window, and how many have fired.
    escalation: list[EscalationStage] = Field(default_factory=list)
    stage: int = 0


class Revision(BaseModel):
    """One revision of a pending plan, as the snapshot shows it: ids, paths, never values."""

    version: int  # the plan version it made
    editor: str
    at: datetime
    previous_plan_hash: str
    plan_hash: str
    changed: list[str] = Field(default_factory=list)  # RFC 6902 "op path", e.g. "replace /1/args/x"
    partial: bool = False  # made by a partial approval


# ----------------------------------------------------------------------------- policy
#
# The organisation's rules, per tenant (the TOML policy file, read by activities/policy.py):
# who approves, which tools, what is auto-approved, what counts as high risk, approval TTLs and
# budgets. The decisions over these live in workflows/policy.py.


class Approver(Contract):
    roles: list[str] = Field(default_factory=lambda: ["approver"])
    # Raw Ed25519 public key, base64. When set, this approver's decisions must be signed.
    public_key: str | None = None
    # Or a file holding it (as `tether keygen` writes it: KEY.pem.pub), relative to the policy
    # file; read by the worker when it loads the policy.
    public_key_file: str | None = None


class Signer(Contract):
    """A trusted signer (`[signers.NAME]`): a service that verifies people itself (the inbox,
    through the organisation's SSO) and signs their decisions with its own key."""

    # Raw Ed25519 public key, base64, or a file holding it (relative to the policy file).
    public_key: str | None = None
    public_key_file: str | None = None
    # The tenants where its attestation stands in for the person's own signature.
    may_attest: list[str] = Field(default_factory=list)


class AmountRule(Contract):
    """Matches calls of ``tool``; with ``field``, only when the numeric argument is in range."""

    tool: str
    field: str | None = None
    max: float | None = None  # auto_approve: at most this
    above: float | None = None  # high_risk: more than this

    def matches(self, tool: str, args: dict) -> bool:
        if tool != self.tool:
            return False
        if self.field is None:
            return True
        value = args.get(self.field)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        if self.max is not None and value > self.max:
            return False
        if self.above is not None and value <= self.above:
            return False
        return True


class AutoApprove(Contract):
    read_only: bool = True  # steps of read_only tools that do not ask for approval themselves
    limits: list[AmountRule] = Field(default_factory=list)  # e.g. refunds up to 5000 cents


class HighRisk(Contract):
    when: list[AmountRule] = Field(default_factory=list)
    # Any step calling a destructive tool (MCP destructiveHint, or the operator's override).
    destructive: bool = False
    approvals: int = Field(2, ge=1, le=10)  # distinct approvers a high-risk plan needs
    roles: list[str] = Field(default_factory=lambda: ["approver"])


_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> Any:
    """Seconds as a number, or a text "30s" / "20m" / "2h" / "1d"; other values are left for
    pydantic to refuse with its own message."""
    if isinstance(value, str):
        text = value.strip()
        number, unit = text[:-1], text[-1:]
        digits = number.replace(".", "", 1)
        if unit not in _UNIT_SECONDS or not digits.isascii() or not digits.isdigit():
            raise ValueError(f"not a duration: {value[:40]!r} (seconds, or a number with s, m, h or d: \"2h\")")
        return float(number) * _UNIT_SECONDS[unit]
    return value


# A positive number of seconds, written as a number or as "30s" / "2h" / "1d" in the policy file.
Duration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0, le=366 * 86400)]

# What a webhook may be told about (the `events` of [notify.webhooks.NAME]).
NotifyEvent = Literal["awaiting_approval", "escalated", "expired", "revised", "handed_off", "failed"]


class EscalationStage(Contract):
    """One step up while a plan waits: ``after`` the request opened, record it, let ``roles``
    approve too, and tell the ``notify`` webhooks. A stage at or past the expiry never fires."""

    after: Duration
    roles: list[str] = Field(default_factory=list)
    notify: list[str] = Field(default_factory=list)


def _ascending(stages: list[EscalationStage]) -> list[EscalationStage]:
    for earlier, later in zip(stages, stages[1:]):
        if later.after <= earlier.after:
            raise ValueError("escalation stages must come in order of `after`, each later than the one before")
    return stages


class Escalation(Contract):
    normal: list[EscalationStage] = Field(default_factory=list, max_length=10)
    high: list[EscalationStage] = Field(default_factory=list, max_length=10)

    _order_normal = field_validator("normal")(classmethod(lambda cls, v: _ascending(v)))
    _order_high = field_validator("high")(classmethod(lambda cls, v: _ascending(v)))


class ApprovalTtl(Contract):
    normal: float | None = Field(None, gt=0)
    high: float | None = Field(None, gt=0)


class Budgets(Contract):
    max_steps: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)
    max_replans: int | None = Field(None, ge=0)


class TenantPolicy(Contract):
    tools: list[str] | None = None  # None: every tool the worker has
    # The run's on_failure and on_cancel when its request names none.
    on_failure: OnFailure = "stop"
    on_cancel: OnFailure = "stop"
    # Risk levels ("normal", "high") at which every write of a plan must have a recovery path:
    # a plan with a write that has none is refused at validation (rule recovery_required).
    require_recovery: list[Literal["normal", "high"]] = Field(default_factory=list)
    approvers: dict[str, Approver] | None = None  # None: anyone but the requester (four-eyes)
    # Decisions, handoffs and the start's requested_by must carry a valid Ed25519 signature by a
    # key listed here for that person; unsigned ones are refused (rule signature_required).
    require_signatures: bool = False
    approval_roles: list[str] = Field(default_factory=lambda: ["approver"])
    four_eyes: bool = True
    # May a person who revised a plan (or approved part of it) approve the result? Four-eyes
    # against the requester holds either way.
    editor_may_approve: bool = True
    # May the one who changed a plan's steps (a revision, not a partial approval, which only
    # narrows it) be its only approver? By default another person must approve it too.
    reviser_may_approve_alone: bool = False
    auto_approve: AutoApprove = Field(default_factory=AutoApprove)
    high_risk: HighRisk | None = None
    approval_ttl_seconds: ApprovalTtl = Field(default_factory=ApprovalTtl)
    # Per risk level, the stages a waiting plan escalates through before it expires.
    escalation: Escalation = Field(default_factory=Escalation)
    budgets: Budgets = Field(default_factory=Budgets)
    # A signed start is good for this long after its issued_at: seconds, or "90s" / "10m" / "1h".
    start_signature_ttl: float = Field(600.0, gt=0, le=7 * 24 * 3600)

    @field_validator("start_signature_ttl", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip().lower()
            units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
            scale = units.get(text[-1:], None)
            number = text[:-1] if scale else text
            try:
                return float(number) * (scale or 1)
            except ValueError:
                raise ValueError(f"expected seconds or a duration like '10m', got {value!r}") from None
        return value

    @field_validator("approvers", mode="before")
    @classmethod
    def _normalise_approver_names(cls, value: Any) -> Any:
        # Names are compared normalised everywhere: 'Bob' in the file is the bob who signs.
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for raw, approver in value.items():
            name = normalize_name(str(raw))
            if name in out:
                raise ValueError(f"approvers {raw!r} and another name normalise to the same {name!r}")
            out[name] = approver
        return out


class Webhook(Contract):
    """Where events are posted (activities/notify.py), signed with the secret in ``secret_file``
    (relative to the policy file; its content, stripped)."""

    url: str = Field(pattern=r"^https?://", max_length=2000)
    events: list[NotifyEvent] = Field(
        default_factory=lambda: ["awaiting_approval", "escalated", "expired", "revised", "handed_off", "failed"]
    )
    secret_file: str | None = None


class Notify(Contract):
    webhooks: dict[str, Webhook] = Field(default_factory=dict)


class PolicyDocument(Contract):
    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)
    signers: dict[str, Signer] = Field(default_factory=dict)
    notify: Notify = Field(default_factory=Notify)


class PolicySnapshot(BaseModel):
    """The tenant's policy as a run starts: validation and approval rules use it all run long;
    approvals and execution are re-checked against the current file by the policy activity."""

    tenant: str
    policy: TenantPolicy | None  # None: the tenant is not in the policy file
    policy_hash: str
    source: str
    # The start's requested_by, verified against its signature (None: no signature given).
    requester_refusal: Refusal | None = None
    requester_verified: bool = False
    # Webhook name -> the events it takes ([notify.webhooks]); no URLs or secrets. The run
    # schedules a notification only where a webhook (or an escalation stage) asks for it.
    webhooks: dict[str, list[str]] = Field(default_factory=dict)


class Refusal(BaseModel):
    rule: str  # which rule refused: four_eyes, role, tenant_membership, signature, ...
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


class PlanReview(BaseModel):
    """What policy says about a validated plan."""

    needs_approval: bool
    risk: Literal["none", "normal", "high"]
    approvals_required: int
    roles: list[str]
    summary: str
    ttl_seconds: float | None = None  # the policy's TTL for this risk level, if it sets one
    escalation: list[EscalationStage] = Field(default_factory=list)  # for this risk level


class SnapshotRequest(BaseModel):
    tenant: str
    # To verify the start's signature, when it has one.
    workflow_id: str = ""
    requested_by: str = ""
    request_digest: str = ""
    requester_signature: str | None = None
    nonce: str | None = None
    issued_at: datetime | None = None
    started_at: datetime | None = None  # when the run began (workflow time)


class RunSetup(BaseModel):
    """What a run snapshots as it starts, in one local activity (``run_setup``): the tool
    catalog and the tenant's policy (one marker in history instead of two)."""

    catalog: ToolCatalog
    policy: PolicySnapshot
    # The fleet key's MAC over the request and this answer (workflows/keys.py), made by the
    # activity and checked by the workflow code before the run acts on it.
    attestation: str | None = None

    @model_serializer(mode="plain")
    def _compact(self) -> dict[str, Any]:
        # Fields at their defaults are left out of the marker (read back, they are the same), and
        # so is what the workflow never reads: the tools' descriptions (the planner activity
        # takes them from its own catalog) and the schemas' ``title`` annotations (validation
        # ignores them). What the run decides with is all here.
        catalog = self.catalog.model_dump(mode="json", exclude_defaults=True, exclude={"tools": {"__all__": {"description"}}})
        for tool in catalog.get("tools", []):
            tool["args_schema"] = untitled(tool["args_schema"])
        compact = {"catalog": catalog, "policy": self.policy.model_dump(mode="json", exclude_defaults=True)}
        return compact if self.attestation is None else {**compact, "attestation": self.attestation}


def untitled(schema: Any) -> Any:
    """A JSON schema without its ``title`` annotations (a property *named* title stays: its
    value is a schema, an annotation's is a string)."""
    if isinstance(schema, dict):
        return {k: untitled(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [untitled(v) for v in schema]
    return schema


class DecisionCheck(BaseModel):
    tenant: str
    workflow_id: str
    kind: str  # approve | reject
    decision: ApprovalDecision
    requested_by: str
    roles: list[str]
    already_approved: list[str]
    first_run_id: str = ""
    requester_verified: bool = False
    editors: list[str] = Field(default_factory=list)
    # A revision: the sha256 of its revised steps, which its signature covers.
    steps_digest: str | None = None


class HandoffCheck(BaseModel):
    tenant: str
    workflow_id: str
    first_run_id: str
    handoff: HandoffRequest


class AuthorityCheck(BaseModel):
    tenant: str
    approvals: list[str]
    tools: list[str]
    roles: list[str]
    approvals_required: int
    # Auto-approved plans (no approvals): the remaining steps, their catalog entries and what
    # the run has done so far, to be reviewed again under the current policy file.
    steps: list[PlanStep] = Field(default_factory=list)
    catalog: ToolCatalog | None = None
    spent: dict[str, float] = Field(default_factory=dict)
    # The approvals in force in full (who, when, their decision and signature), to be judged
    # again under the current file: roles, membership, four-eyes, the signature rule.
    approved: list[AcceptedApproval] = Field(default_factory=list)
    # Roles the request's escalation stages had added when it was approved: they count too.
    escalated_roles: list[str] = Field(default_factory=list)
    workflow_id: str = ""
    first_run_id: str = ""
    requested_by: str = ""
    request_id: str = ""
    plan_hash: str = ""
    # Given: the attempt to mint a capability for (its activity id, its deadline in seconds).
    call: ToolCall | None = None
    activity_id: str = ""
    ttl_seconds: float = 0.0
    # A compensation (COMPENSATING): the undo to re-check instead of the plan's remaining steps,
    # under the plan hash that covered it; in a compensation run, the person who asked for it.
    undo: CompensationCall | None = None
    compensator: str = ""


class Notification(BaseModel):
    """Input of the ``notify`` activity: one event, for the named webhooks (resolved against the
    current policy file). Ids, states and the escaped risk summary; argument values only as the
    summary's declared fields."""

    event_id: str  # one per event: the receiver's idempotency key (X-Tether-Event-Id)
    event: str
    webhooks: list[str]
    run_id: str
    namespace: str = "default"
    tenant: str
    state: str
    plan_hash: str | None = None
    request_id: str | None = None
    summary: str = ""  # the risk summary, escaped (workflows/display.py)
    expires_at: datetime | None = None
    approve_command: str | None = None
    reason: str = ""  # the record's reason, escaped
    max_attempts: int = 4  # the last attempt reports dead webhooks instead of failing


class NotificationResult(BaseModel):
    delivered: list[str] = Field(default_factory=list)
    dead: dict[str, str] = Field(default_factory=dict)  # webhook -> why (status or error code)


class Verdict(BaseModel):
    refusal: Refusal | None = None
    policy_hash: str
    verified: bool = False  # the person's signature checked out against a key the policy lists
    # A request the re-check opens asks for these (the tenant's current approval rule), and the
    # run judges from then on by the current file (``tenant_policy``) instead of its snapshot.
    approvals_required: int = 0
    roles: list[str] = Field(default_factory=list)
    tenant_policy: TenantPolicy | None = None
    # The fleet key's MAC over the request and this answer (workflows/keys.py), made by the
    # activity and checked by the workflow code before the run acts on it.
    attestation: str | None = None


# ----------------------------------------------------------------------------- recovery


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

    @property
    def tool_call_id(self) -> str:
        return f"{self.of}:undo"


class RecoveryRequest(BaseModel):
    """Input of the ``recovery_source`` activity: the run a compensation run undoes."""

    run_id: str
    tenant: str


class RecoverySource(BaseModel):
    """What the original run's closed record says (its result, read from the server)."""

    run_id: str
    state: RunState | None = None
    compensations: list[CompensationCall] = Field(default_factory=list)
    refusal: Refusal | None = None
    # The fleet key's MAC over the request and this answer (workflows/keys.py), made by the
    # activity and checked by the workflow code before the run acts on it.
    attestation: str | None = None


# ----------------------------------------------------------------------------- run state


class RunData(BaseModel):
    """Everything the workflow knows, in one structure: queried, and carried by continue-as-new."""

    lifecycle: Lifecycle = Field(default_factory=Lifecycle)
    catalog: ToolCatalog | None = None
    policy: PolicySnapshot | None = None
    plan: Plan | None = None
    next_step: int = 0  # index into plan.steps of the next step to execute
    step_retries: int = 0  # retries the workflow scheduled for the current step
    # Outcome of the current step's last failed attempt (None: no attempt failed yet): what a
    # cancel, handoff or budget stop that ends the step before a retry must report.
    step_outcome: EffectOutcome | None = None
    pending_approval: PendingApproval | None = None  # only while AWAITING_APPROVAL
    approval: PendingApproval | None = None  # the approval in force while its plan executes
    approved_by: list[str] = Field(default_factory=list)
    # The last DECISIONS_WINDOW decision ids, with a count and a running digest of all of them.
    decisions_seen: list[str] = Field(default_factory=list)
    decisions_count: int = 0
    decisions_digest: str = ""
    executed: list[ExecutedStep] = Field(default_factory=list)
    # Steps folded out of ``executed`` when the run continued as new: how many, how many of them
    # ok, and a running digest of their ids, outcomes and digests (Engine.fold_for_carry).
    executed_before: int = 0
    executed_ok_before: int = 0
    executed_digest: str = ""
    # Sum of each numeric argument, per "tool.field", over executed steps that may have applied:
    # auto-approval and high-risk limits apply to these sums, so they cannot be split.
    spent: dict[str, float] = Field(default_factory=dict)
    first_run_id: str = ""
    requester_verified: bool = False
    replans: int = 0
    planning_rounds: int = 0
    tool_calls: int = 0  # execute_tool activities scheduled, retries included
    retries: int = 0
    feedback: str | None = None
    last_error: str | None = None
    answer: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    model_tokens: int = 0  # sum of Proposal.usage_tokens over the run
    # One per ok write since recovery existed, in execution order: how each is undone.
    compensations: list[CompensationCall] = Field(default_factory=list)
    generation: int = 0  # continue-as-new count: the carried state's place in the run chain
    plans: int = 0  # plans validated in all (the current plan's version)
    revisions: list[Revision] = Field(default_factory=list)  # the latest REVISIONS_KEPT
    plan_editors: list[str] = Field(default_factory=list)  # who revised the current plan
    plan_revisers: list[str] = Field(default_factory=list)  # of them, who changed its steps (not a partial approval)
    not_approved: list[NotApproved] = Field(default_factory=list)  # for the next planner call

    @property
    def steps_executed(self) -> int:
        """Steps executed in all, over every run of the chain."""
        return self.executed_before + len(self.executed)

    @property
    def steps_ok(self) -> int:
        return self.executed_ok_before + sum(1 for s in self.executed if s.status == "ok")


class RunSnapshot(BaseModel):
    """Result of the ``snapshot`` query."""

    run_id: str
    tenant: str
    state: RunState
    previous_state: RunState | None
    state_version: int
    plan: Plan | None
    pending_approval: PendingApproval | None
    step: int
    retries: int
    last_error: str | None
    approved_by: list[str]
    answer: str | None
    created_at: datetime | None
    updated_at: datetime | None
    model_tokens: int = 0
    requested_by: str = ""
    requester_verified: bool = False
    first_run_id: str = ""
    # Refused events per "rule actor", counted even where the timeline keeps only the first few.
    refusals: dict[str, int] = Field(default_factory=dict)
    timeline_records: int = 0  # records written in all (the timeline query returns a window)
    # How each ok write is undone, and whether it was (what `tether compensate` runs).
    compensations: list[CompensationCall] = Field(default_factory=list)
    # The audit sink: records written but not yet in it, and why (while it fails, the run
    # retries on a backoff timer and starts nothing new).
    audit_waiting: int = 0
    audit_error: str | None = None
    # decide Updates this execution took (Temporal allows 2,000 per run: it continues as new first).
    updates: int = 0
    # The run's catalog entries (taken at run start) for the tools its plan calls: what an
    # approver is shown about each step (effect, summary fields), as the run itself judges them.
    tools: list[ToolInfo] = Field(default_factory=list)
    revisions: list[Revision] = Field(default_factory=list)


class RunView(BaseModel):
    """What a run publishes where it rests (memo ``tether``): Tether's views read it with no
    worker running. ``published_at`` is workflow time: how fresh the view is."""

    snapshot: RunSnapshot
    timeline: list[TransitionRecord] = Field(default_factory=list)  # the latest records, bounded
    published_at: datetime


class RunOutcome(BaseModel):
    """Result of the ``AgentRun`` workflow.

    Bounded: the workflow's result carries neither the timeline (``records`` says how many the
    run wrote; the ``timeline`` query and the audit sink have them) nor the steps (``steps_executed``
    says how many; the ``steps`` query has them), so history does not grow with the run by a
    copy of its record. ``client.run_outcome`` fills both in from the queries. Runs recorded
    before (no ``records``) carried the timeline's window and the steps here.
    """

    run_id: str
    state: RunState
    answer: str | None
    steps: list[ExecutedStep] = Field(default_factory=list)
    timeline: list[TransitionRecord] = Field(default_factory=list)
    records: int = 0  # records the run wrote in all (the last one's seq)
    steps_executed: int = 0  # steps executed in all (over every run of the chain)
    # A run that continued as new carries only its latest steps: the ones before, counted, and
    # a running digest of them (RunData.executed_before / executed_digest).
    steps_before: int = 0
    steps_digest: str = ""
    # The compensations of the run's ok writes (done or not): what ``tether compensate`` runs.
    compensations: list[CompensationCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _without_empty(self, handler: Any) -> dict[str, Any]:
        # The run's result is written into its history: the fields a bounded result leaves at
        # their defaults (no steps, no timeline, nothing before, no compensations) are left out;
        # read back, they are the same.
        return {k: v for k, v in handler(self).items() if not (k in _OUTCOME_OPTIONAL and v in ([], 0, ""))}


_OUTCOME_OPTIONAL = frozenset({"steps", "timeline", "steps_before", "steps_digest", "compensations"})


RunData.model_rebuild()
RunRequest.model_rebuild()
AuthorityCheck.model_rebuild()


class AuditBatch(BaseModel):
    """Timeline records on their way to the audit sink (activities/audit.py), keyed by workflow
    id, run id and seq: each execution (a reset makes a new one) is its own stream."""

    workflow_id: str
    first_run_id: str
    records: list[TransitionRecord]
    run_id: str = ""  # the execution that wrote them (the activity fills it from its info)
    continued_from: str | None = None  # the run this one continued as new from


class AuditAck(BaseModel):
    last_seq: int
