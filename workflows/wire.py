"""The wire types of the run's activities: what the workflow code sends each activity and what
it answers (tool calls and outcomes, planning, setup, the policy checks and their verdicts,
notifications, recovery, the audit sink), and the error types activities report.
"""

from __future__ import annotations

import functools

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializationInfo, SerializerFunctionWrapHandler, model_serializer

from workflows.contract import (
    AcceptedApproval,
    ApprovalDecision,
    CompensationCall,
    ExecutedStep,
    Grant,
    HandoffRequest,
    Limits,
    NotApproved,
    PlanStep,
    PlaybookStep,
    ReadFound,
    ToolCatalog,
    json_digest,
)
from workflows.budgets import clip
from workflows.contract import omit_defaults
from workflows.policy_file import EscalationStage, TenantPolicy
from workflows.states import Packed, RunState, TransitionRecord


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
    key_id: str  # the fleet key (tether/store/keys.py) that made ``mac``
    expires_at: datetime  # the attempt's deadline: refused after it
    mac: str
    # An undo of an unsafe tool whose earlier start may have applied, run again on an approver's
    # recorded instruction (``tether compensate RUN --rerun-unknown STEP``).
    rerun_unknown: bool = False
    # The sha256 of the decision check the tool worker must judge allowed before this write
    # (``ToolCall.judge``): a capability minted on a roster's decision is good only with it.
    judge_digest: str = ""

    @model_serializer(mode="wrap")
    def _without_unset_rerun(self, handler: Any) -> dict[str, Any]:
        # The re-run instruction and the judge only when given: a capability without them reads
        # (and is MAC'd, and is scheduled) as before they existed.
        return omit_defaults(handler(self), {"rerun_unknown": False, "judge_digest": ""})

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


# The tool worker could not reach its undo ledger (tether/store/effect_ledger.py) to claim an undo:
# the tool was not called, and the run schedules the attempt again as for a capability that bounced.
LEDGER_UNAVAILABLE = "ledger_unavailable"
# The worker that took the attempt does not serve the tool (started with other tool modules):
# the tool was not called; the run waits for a worker that serves it and schedules it again.
UNKNOWN_TOOL = "unknown_tool"
# The audit sink failed, or refused the records a write took along (activities/audit.py): the
# tool was not called; the run writes them itself (audit backoff) and schedules the write again.
SINK_UNAVAILABLE = "audit_sink_unavailable"
RECORD_UNVERIFIED = "record_unverified"
RECORDS_NOT_WRITTEN = (SINK_UNAVAILABLE, RECORD_UNVERIFIED)
# A child run's wait, woken by a hand-off of its parent (the child runs on): not its end.
CHILD_WOKEN = "child_woken"
# A child run cancelled (as a hand-off of its parent asked, or by someone else): it has settled.
CHILD_CANCELLED = "child_cancelled"
# A member of a parallel group that did not start: a hand-off of the run was taken first.
HANDOFF_NOT_STARTED = "handoff_not_started"
# A child run that handed off: a write of it may have applied (its parent is handed off too).
CHILD_HANDED_OFF = "child_handed_off"
# The child run of a delegate step exists already (this run was reset, or repaired, after it
# started it): it is never started again.
CHILD_EXISTS = "child_exists"
# A child run this run can neither start nor read the end of (it runs on, or its record does
# not say): what it wrote is not known, and a person takes this run.
CHILD_UNREACHABLE = "child_unreachable"


# An activity found a seal or capability naming a key id this worker does not hold.
KEY_MISSING = "key_missing"

# A decision the run took on its roster (``PolicySnapshot.rosters``) is judged again by the tool
# worker of the first call after it (``ToolCall.judge``), before the tool: refused under the
# current file, or that worker cannot judge. The tool was not called; the run judges the decision
# again through the policy activity.
DECISION_NOT_HELD = "decision_not_held"
JUDGE_UNAVAILABLE = "judge_unavailable"


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
    # Required for every tool that is not read_only (tether/tools/sdk.py refuses the call without).
    capability: Capability | None = None
    # A write's: the run's records not yet in the audit sink (AuditBatch, packed, base64). The
    # tool worker appends them before it calls the tool, so they travel with the write instead of
    # costing an activity of their own; neither the capability nor the attestation covers them
    # (the sink checks their chain and signature itself).
    records: str | None = None
    # The first call after a decision the run took on its roster: the decision's check (with the
    # approved plan's re-check, ``then``), judged by the tool worker under the current file before
    # the tool, as the policy activity would have judged it (a write's capability names its digest).
    judge: DecisionCheck | None = None

    @model_serializer(mode="wrap")
    def _judge_when_set(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"judge": None})


class ToolOutcome(BaseModel):
    """Output of ``execute_tool``: a bounded observation, so history does not grow with results."""

    observation: str
    digest: str
    size: int
    truncated: bool = False
    # A write's: the fleet key's MAC over the request and this answer (workflows/keys.py), made by the
    # activity and checked by the workflow code before the run acts on it.
    attestation: str | None = None
    # A write that judged a roster's decision (``ToolCall.judge``): why the policy file did not load.
    policy_problem: str | None = None

    @model_serializer(mode="wrap")
    def _problem_when_set(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"policy_problem": None})


class ProposedStep(BaseModel):
    """A step as a planner proposes it. Untrusted: ``args`` may be anything, even a string."""

    tool: str
    args: Any = None
    # Steps next to one another with the same group run at once (a playbook's "parallel").
    group: int | None = None

    @model_serializer(mode="wrap")
    def _group_when_set(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"group": None})  # attested answers read as they did


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
    # With the setup: the planning-time re-check of this very plan, judged as the planner
    # answered (the run takes it for exactly the check it would send: PlanJudged).
    judged: PlanJudged | None = None
    attestation: str | None = None

    @model_serializer(mode="wrap")
    def _judged_when_set(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"judged": None})  # recorded answers read as they did


class PlanJudged(BaseModel):
    """The planning-time re-check of a run's first plan, judged by the policy in the planner call
    that brought the plan and the run's setup (workflows/plan_check.py): the digest of the
    AuthorityCheck the run builds for that plan, and the verdict on it under the file as it was
    when the planner answered. The run takes the verdict only for a check of that digest, and only
    from that attested answer; any other plan is checked by ``policy_check_authority``."""

    check: str
    verdict: Verdict


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
    # How deep the run is, and the tenant's max_depth (None: not set, or on the first call not
    # known yet: its setup says): a run that may not delegate is not offered the delegate step.
    depth: int = 0
    max_depth: int | None = None
    # With ``setup``: the start's limits that validating the plan depends on, where they are not
    # the defaults (the run's first plan is validated and judged in advance: PlanJudged).
    max_steps: int | None = None
    max_model_tokens: int | None = None

    @model_serializer(mode="wrap")
    def _depth_when_set(self, handler: Any) -> dict[str, Any]:
        # Recorded inputs read (and are attested) as they were.
        return omit_defaults(handler(self), {"depth": 0, "max_depth": None, "max_steps": None, "max_model_tokens": None})

    def limits(self) -> Limits:
        """The start's limits as far as validating a plan goes (the rest at their defaults)."""
        return Limits(max_steps=self.max_steps or Limits().max_steps, max_model_tokens=self.max_model_tokens)


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
    # Who may approve the run's plans, judged with the snapshot (Cedar, under ``policy_hash``):
    # a decision that matches a roster is taken at once, and judged again before its first tool.
    rosters: list[ApproverRoster] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _rosters_when_set(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"rosters": []})


class ApproverRoster(BaseModel):
    """Who may take the one approval a request of this risk and these roles asks for, as the
    first approver, with nobody having revised the plan (Cedar's ``approve``, judged by the policy
    activity for each person the tenant lists without a key, and once for anyone it does not list
    where the tenant's rules judge them all alike)."""

    risk: str
    roles: list[str]
    people: dict[str, list[str]] = Field(default_factory=dict)  # approver -> the policies that permit
    # The policies that permit anyone the tenant does not list, other than the requester; None: not
    # judged alike (the tenant lists its approvers, or has Cedar policies of its own).
    anyone: list[str] | None = None

    @model_serializer(mode="wrap")
    def _compact(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"people": {}, "anyone": None})  # in every run's setup


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
    # A child run's grant (its workflow code checked it): the start's authority in place of the
    # requester's signature (tether/policy/signatures.py, granted_start).
    grant: Grant | None = None

    @model_serializer(mode="wrap")
    def _unsigned_left_out(self, handler: Any) -> dict[str, Any]:
        # With every planner call's first: a start without a signature says nothing of one.
        return omit_defaults(handler(self), {"requester_signature": None, "nonce": None, "issued_at": None, "grant": None})


# A tool's description as a run keeps it (its catalog, its view): what an approver reads beside
# the step, bounded so a long docstring or an MCP server's prose does not grow every history.
DESCRIPTION_CHARS = 240


class RunSetup(BaseModel):
    """What a run snapshots as it starts, with its first planner call or in one activity
    (``run_setup``): the tool catalog and the tenant's policy."""

    catalog: ToolCatalog
    policy: PolicySnapshot
    # The fleet key's MAC over the request and this answer (workflows/keys.py), made by the
    # activity and checked by the workflow code before the run acts on it.
    attestation: str | None = None

    @model_serializer(mode="plain")
    def _compact(self) -> dict[str, Any]:
        # Fields at their defaults are left out of the marker (read back, they are the same), and
        # so are the schemas' ``title`` annotations (validation ignores them). Each tool's
        # description stays, its first paragraph on one line, bounded (DESCRIPTION_CHARS): the
        # run's view shows it to an approver beside the step (the planner activity takes the
        # full one from its own catalog).
        catalog = self.catalog.model_dump(mode="json", exclude_defaults=True)
        for tool in catalog.get("tools", []):
            tool["args_schema"] = untitled(tool["args_schema"])
            if "description" in tool:
                tool["description"] = clip(" ".join(tool["description"].split("\n\n")[0].split()), DESCRIPTION_CHARS)
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
    # The pending request's risk level and the escalation stages that fired (Cedar's Run).
    risk: str = "normal"
    stage: int = 0
    # An approval that would put the plan in force: the re-check of its remaining writes under the
    # current file (the approval included), judged in the same activity when the decision is
    # allowed, so no activity stands between the decision and the first write but this one.
    then: AuthorityCheck | None = None

    @model_serializer(mode="wrap")
    def _new_fields_when_set(self, handler: Any) -> dict[str, Any]:
        # Left out at their defaults: a check is attested as sent, and one recorded before these
        # fields existed replays with the same digest.
        return omit_defaults(handler(self), {"risk": "normal", "stage": 0, "then": None})


class HandoffCheck(BaseModel):
    tenant: str
    workflow_id: str
    first_run_id: str
    handoff: HandoffRequest
    requested_by: str = ""  # the run's requester (Cedar's Run.requester)


class PersonCheck(BaseModel):
    """A person's request the run judges under the current file (``policy_check_person``): a
    cancel, or the first judgement of a compensation run (its requester)."""

    tenant: str
    workflow_id: str
    first_run_id: str
    action: Literal["cancel", "compensate"]
    by: str
    decision_id: str = ""
    signature: str | None = None  # a cancel's, where the tenant requires it
    requested_by: str = ""  # the run's requester (Cedar's Run.requester)


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
    # A child run whose writes its parent's approval covers: the parent run (workflow id, first
    # run id) whose decisions the approvals' signatures name.
    approved_in: str = ""
    approved_in_run: str = ""
    # Given: the attempt to mint a capability for (its activity id, its deadline in seconds).
    call: ToolCall | None = None
    activity_id: str = ""
    ttl_seconds: float = 0.0
    # A compensation (COMPENSATING): the undo to re-check instead of the plan's remaining steps,
    # under the plan hash that covered it; in a compensation run, the person who asked for it.
    undo: CompensationCall | None = None
    compensator: str = ""
    # A plan that asks for approval: the verdict brings the run's roster again, judged under the
    # current file as the request opens (``Verdict.rosters``).
    roster: bool = False

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        # Sent before every write: the fields at their defaults are left out, and so are the
        # catalog entries' (read back, they are the same; the attestation covers this form).
        out: dict[str, Any] = handler(self)
        for name, default in _optional_defaults(type(self)).items():
            if name in out and out[name] == default:
                del out[name]
        if self.catalog is not None:
            # Descriptions included (bounded, as the run keeps them): the attestations of runs
            # recorded before cover them (a delegating run's tether.delegate entry has one).
            out["catalog"] = self.catalog.model_dump(mode=info.mode, exclude_defaults=True)
        if isinstance(out.get("undo"), dict):
            # The written arguments an undo keeps are for people (a compensation's view), not
            # for the check: left out, as in the checks runs recorded before attested.
            out["undo"].pop("of_args", None)
        return out


@functools.cache
def _optional_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """A model's optional fields and their defaults, worked out once (asking pydantic for a default
    factory's default inspects its signature every time). The defaults here are None, "", 0, []
    and {}: each dumps as itself, and they are only compared, never handed out."""
    return {
        name: field.get_default(call_default_factory=True)
        for name, field in model.model_fields.items() if not field.is_required()
    }


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
    # Why the run asks (an approval request's): its goal (bounded; escaped in the body), who asked (signed or
    # claimed) and, for a child run, its parent's goal and its tree's root (on whose behalf).
    goal: str = ""
    requested_by: str = ""
    requester_verified: bool = False
    parent: str | None = None
    parent_goal: str = ""
    root: str | None = None
    # And what the plan depends on: what its read steps found, as a surface outside the signed
    # view shows it (run_state.shown_openly), and what each planned tool says it does.
    found: list[ReadFound] = Field(default_factory=list)
    tools: dict[str, str] = Field(default_factory=dict)
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
    # The Cedar policies that decided (their @id): the permits that allowed it, or the forbids
    # that refused it (none: nothing permitted it). Recorded as refs.policies.
    policies: list[str] = Field(default_factory=list)
    # The fleet key's MAC over the request and this answer (workflows/keys.py), made by the
    # activity and checked by the workflow code before the run acts on it.
    attestation: str | None = None
    # The verdict on a DecisionCheck's ``then``: the approved plan's re-check (given only when the
    # decision itself was allowed).
    then: Verdict | None = None
    # The policy file changed and did not load: why (the last good policy judged this).
    policy_problem: str | None = None
    # Asked for (``AuthorityCheck.roster``): the run's roster under the file that judged this.
    rosters: list[ApproverRoster] | None = None

    @model_serializer(mode="wrap")
    def _new_fields_when_set(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"policies": [], "then": None, "policy_problem": None, "rosters": None})


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
    # A child run's sums (RunSnapshot.spent): a parent that adopts it charges them to its own.
    spent: dict[str, float] = Field(default_factory=dict)
    # The fleet key's MAC over the request and this answer (workflows/keys.py), made by the
    # activity and checked by the workflow code before the run acts on it.
    attestation: str | None = None

    @model_serializer(mode="wrap")
    def _spent_when_set(self, handler: Any) -> dict[str, Any]:
        # Answers recorded (and attested) before the field existed read as they were.
        return omit_defaults(handler(self), {"spent": {}})


class AuditBatch(Packed):
    """Timeline records on their way to the audit sink (activities/audit.py), keyed by workflow
    id, run id and seq: each execution (a reset makes a new one) is its own stream."""

    workflow_id: str
    first_run_id: str
    records: list[TransitionRecord]
    run_id: str = ""  # the execution that wrote them (the activity fills it from its info)
    continued_from: str | None = None  # the run this one continued as new from


class AuditAck(BaseModel):
    last_seq: int


AuthorityCheck.model_rebuild()
DecisionCheck.model_rebuild()
Verdict.model_rebuild()
ToolCall.model_rebuild()
PolicySnapshot.model_rebuild()
