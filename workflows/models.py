"""Pydantic contracts shared by the workflow, the activities and the clients.

JSON field names here are public API (see ARCHITECTURE.md). Every workflow, signal, query and
activity takes exactly one of these models, so the pydantic data converter never has to guess.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from workflows.states import EffectOutcome, Lifecycle, RunState, TransitionRecord

__all__ = [
    "AcceptedApproval",
    "ApprovalDecision",
    "CatalogRequest",
    "ExecutedStep",
    "HandoffRequest",
    "Limits",
    "PendingApproval",
    "Plan",
    "PlanStep",
    "PlannerInput",
    "PlaybookStep",
    "Proposal",
    "ProposedStep",
    "RunData",
    "RunOutcome",
    "RunRequest",
    "RunSnapshot",
    "ToolCall",
    "ToolCatalog",
    "ToolEffect",
    "ToolInfo",
    "ToolOutcome",
    "TransitionRecord",
    "canonical_json",
]

# Tenant and names end up in search attributes and the Web UI: keep them to plain identifiers.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}$"


class ToolEffect(str, Enum):
    """What a tool does to the outside world. It decides the retry rule and the approval default."""

    READ_ONLY = "read_only"  # no side effect
    IDEMPOTENT = "idempotent"  # the target system dedupes by the idempotency key
    RECONCILABLE = "reconcilable"  # not idempotent, but a previous effect can be looked up by key
    UNSAFE = "unsafe"  # neither: runs at most once


# ----------------------------------------------------------------------------- run input


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(20, ge=1, le=1000, description="tool calls a run may execute in all")
    max_replans: int = Field(3, ge=0, le=100, description="proposals that may fail validation")
    approval_ttl_seconds: float = Field(
        24 * 3600, gt=0, le=366 * 24 * 3600, description="how long an approval request stays open"
    )
    on_expiry: Literal["expire", "replan"] = "expire"
    max_model_tokens: int | None = Field(
        None, ge=1, description="model tokens (as the endpoint reports them) a run may use in all"
    )


class PlaybookStep(BaseModel):
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)


class RunRequest(BaseModel):
    """The one input of the ``AgentRun`` workflow."""

    goal: str = Field(min_length=1, max_length=8000)
    tenant: str = Field("default", pattern=NAME_PATTERN)
    requested_by: str = Field(pattern=NAME_PATTERN)
    planner: str = "playbook"
    playbook: list[PlaybookStep] = Field(default_factory=list, max_length=1000)
    limits: Limits = Field(default_factory=Limits)
    # Set by the runtime only, when a run continues as new: the state it carries over.
    carryover: RunData | None = None


# ----------------------------------------------------------------------------- tools


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


class CatalogRequest(BaseModel):
    tenant: str = "default"


class ToolCatalog(BaseModel):
    tools: list[ToolInfo] = Field(default_factory=list)

    def get(self, name: str) -> ToolInfo | None:
        return next((t for t in self.tools if t.name == name), None)


# Error types the ``execute_tool`` activity reports besides the tools' own codes.
# The tool was still running a grace period after its deadline: the attempt is not over.
ATTEMPT_STILL_RUNNING = "attempt_still_running"
# The run's cancel reached the tool through its heartbeat and stopped it mid-call.
CANCELLED_MID_CALL = "cancelled_mid_call"


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


class ToolOutcome(BaseModel):
    """Output of ``execute_tool``: a bounded observation, so history does not grow with results."""

    observation: str
    digest: str
    size: int
    truncated: bool = False


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


class ExecutedStep(BaseModel):
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


class PlannerInput(BaseModel):
    goal: str
    planner: str
    playbook: list[PlaybookStep]
    executed: list[ExecutedStep]
    feedback: str | None = None
    round: int = 1


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
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class Plan(BaseModel):
    steps: list[PlanStep]
    plan_hash: str

    @staticmethod
    def hash_steps(steps: list[PlanStep]) -> str:
        """sha256 of the canonical JSON of the tools and arguments, in order.

        Tool call ids are left out on purpose: the hash names *what* will be done, so the same
        proposal hashes the same after a replan.
        """
        payload = [{"tool": s.tool, "args": s.args} for s in steps]
        return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


# ----------------------------------------------------------------------------- approvals


class ApprovalDecision(BaseModel):
    """Payload of the ``approve`` and ``reject`` signals."""

    decision_id: str = Field(min_length=1, max_length=128)
    approver: str = Field(min_length=1, max_length=128)
    plan_hash: str = Field(min_length=1, max_length=128)
    comment: str | None = Field(None, max_length=2000)
    reason: str | None = Field(None, max_length=2000)
    # Ed25519 signature (base64) over policy.signature_payload(...), required for approvers whose
    # public key the policy lists.
    signature: str | None = Field(None, max_length=200)


class HandoffRequest(BaseModel):
    """Payload of the ``handoff`` signal."""

    by: str = Field(min_length=1, max_length=128)
    reason: str = Field(min_length=1, max_length=2000)
    # Lets the sender find the run's verdict on the timeline (refs.decision_id); optional for
    # clients that only signal.
    decision_id: str | None = Field(None, min_length=1, max_length=128)


class AcceptedApproval(BaseModel):
    approver: str
    decision_id: str
    at: datetime


class PendingApproval(BaseModel):
    plan_hash: str
    expires_at: datetime
    summary: str  # the risk summary: which tools write, to what, amounts
    risk: Literal["normal", "high"] = "normal"
    approvals_required: int = 1
    roles: list[str] = Field(default_factory=list)  # roles that may approve this plan
    approvals: list[AcceptedApproval] = Field(default_factory=list)  # accepted so far


# ----------------------------------------------------------------------------- policy
#
# The organisation's rules, per tenant (the TOML policy file, read by activities/policy.py):
# who approves, which tools, what is auto-approved, what counts as high risk, approval TTLs and
# budgets. The decisions over these live in workflows/policy.py.


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Approver(_Strict):
    roles: list[str] = Field(default_factory=lambda: ["approver"])
    # Raw Ed25519 public key, base64. When set, this approver's decisions must be signed.
    public_key: str | None = None


class AmountRule(_Strict):
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


class AutoApprove(_Strict):
    read_only: bool = True  # steps of read_only tools that do not ask for approval themselves
    limits: list[AmountRule] = Field(default_factory=list)  # e.g. refunds up to 5000 cents


class HighRisk(_Strict):
    when: list[AmountRule] = Field(default_factory=list)
    approvals: int = Field(2, ge=1, le=10)  # distinct approvers a high-risk plan needs
    roles: list[str] = Field(default_factory=lambda: ["approver"])


class ApprovalTtl(_Strict):
    normal: float | None = Field(None, gt=0)
    high: float | None = Field(None, gt=0)


class Budgets(_Strict):
    max_steps: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)
    max_replans: int | None = Field(None, ge=0)


class TenantPolicy(_Strict):
    tools: list[str] | None = None  # None: every tool the worker has
    approvers: dict[str, Approver] | None = None  # None: anyone but the requester (four-eyes)
    approval_roles: list[str] = Field(default_factory=lambda: ["approver"])
    four_eyes: bool = True
    auto_approve: AutoApprove = Field(default_factory=AutoApprove)
    high_risk: HighRisk | None = None
    approval_ttl_seconds: ApprovalTtl = Field(default_factory=ApprovalTtl)
    budgets: Budgets = Field(default_factory=Budgets)


class PolicyDocument(_Strict):
    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)


class PolicySnapshot(BaseModel):
    """The tenant's policy as a run starts: validation and approval rules use it all run long;
    approvals and execution are re-checked against the current file by the policy activity."""

    tenant: str
    policy: TenantPolicy | None  # None: the tenant is not in the policy file
    policy_hash: str
    source: str


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


class SnapshotRequest(BaseModel):
    tenant: str


class DecisionCheck(BaseModel):
    tenant: str
    workflow_id: str
    kind: str  # approve | reject
    decision: ApprovalDecision
    requested_by: str
    roles: list[str]
    already_approved: list[str]


class AuthorityCheck(BaseModel):
    tenant: str
    approvals: list[str]
    tools: list[str]
    roles: list[str]
    approvals_required: int


class Verdict(BaseModel):
    refusal: Refusal | None = None
    policy_hash: str


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
    decisions_seen: list[str] = Field(default_factory=list)
    executed: list[ExecutedStep] = Field(default_factory=list)
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


class RunOutcome(BaseModel):
    """Result of the ``AgentRun`` workflow."""

    run_id: str
    state: RunState
    answer: str | None
    steps: list[ExecutedStep]
    timeline: list[TransitionRecord]


RunData.model_rebuild()
RunRequest.model_rebuild()
