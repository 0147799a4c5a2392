"""The run's state (``RunData``: everything the workflow knows, queried and carried by
continue-as-new), the input that carries it over (``RunRequest``, the ``AgentRun`` workflow's
one input) and the run as it shows itself: the ``snapshot`` query, the view it publishes and
its result.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_serializer, model_validator

from workflows.budgets import FOUND_STEPS, REQUEST_BUDGET, bounded_fields
from workflows.contract import (
    AcceptedApproval,
    Grant,
    CompensationCall,
    Contract,
    ExecutedStep,
    NAME_PATTERN,
    Limits,
    NotApproved,
    OnFailure,
    Plan,
    PlaybookStep,
    ReadFound,
    Revision,
    ToolCatalog,
    ToolEffect,
    ToolInfo,
    omit_defaults,
    json_digest,
)
from workflows.identity import Name
from workflows.policy_file import EscalationStage
from workflows.states import EffectOutcome, Lifecycle, RunState, TransitionRecord, Packed
from workflows.wording import money
from workflows.wire import PolicySnapshot


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
    # A compensation run only: the undos of unsafe tools whose outcome is unknown (they may have
    # applied) that the requester, an approver, instructs it to run again (``tether compensate
    # RUN --rerun-unknown STEP``: the original step's tool call id); the rest are listed for a person.
    rerun_unknown: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=64)
    # Ed25519 signature (base64) by the requester over policy.start_signature_payload(...):
    # required where the tenant sets require_signatures, else the requester is only claimed.
    requester_signature: str | None = Field(None, max_length=200)
    # Signed with the start (tether start --key): a fresh value each time, and when it was
    # signed; the run refuses a signed start older than the tenant's start_signature_ttl.
    nonce: str | None = Field(None, min_length=8, max_length=128)
    issued_at: datetime | None = None
    # Set by the runtime only, when a run continues as new: the state it carries over, and the
    # worker's seal over it. A start input that carries state is refused (docs/contract.md).
    carryover: RunData | None = None
    carryover_seal: str | None = Field(None, max_length=200)
    # Set by a parent run's workflow code only: this run is its child, and may do what the grant
    # says, no more. A grant the fleet key did not seal for this child is refused (FAILED).
    grant: Grant | None = None

    @model_serializer(mode="wrap")
    def _without_unset_rerun(self, handler: Any) -> dict[str, Any]:
        # Left out when empty: a request reads (and sizes) as it did before it existed.
        return {k: v for k, v in handler(self).items()
                if not ((k == "rerun_unknown" and v == []) or (k == "grant" and v is None))}

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
        if self.rerun_unknown:
            body["rerun_unknown"] = list(self.rerun_unknown)
        return json_digest(body)


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
    # A child run's: which of its grant's covered writes (an index into Grant.covered) each of
    # its writes spent, by tool call id. The parent's approval named each once: spent, it covers
    # no other write (carried by continue-as-new; a reset replays it).
    cover_spent: dict[str, int] = Field(default_factory=dict)
    first_run_id: str = ""
    requester_verified: bool = False
    replans: int = 0
    planning_rounds: int = 0
    tool_calls: int = 0  # execute_tool activities scheduled, retries included
    retries: int = 0
    feedback: str | None = None
    last_error: str | None = None
    # The worker's policy file changed and did not load: why (the verdicts came from its last
    # good policy), as the latest verdict said; None again once one comes from the file.
    policy_problem: str | None = None
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

    @model_serializer(mode="wrap")
    def _new_fields_when_set(self, handler: Any) -> dict[str, Any]:
        # Carried state sealed before a field existed reads (and digests) as it was.
        return omit_defaults(handler(self), {"cover_spent": {}})

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
    policy_problem: str | None = None  # RunData.policy_problem
    # decide Updates this execution took (Temporal allows 2,000 per run: it continues as new first).
    updates: int = 0
    # The run's catalog entries (taken at run start) for the tools its plan calls: what an
    # approver is shown about each step (effect, summary fields), as the run itself judges them.
    tools: list[ToolInfo] = Field(default_factory=list)
    # What the run's latest ok read steps found (bounded: workflows/views.py): what the plan an
    # approver decides depends on.
    found: list[ReadFound] = Field(default_factory=list)
    # A compensation run (``tether compensate``): the run whose writes it puts back
    # (``compensations`` names each, with its arguments).
    compensates: str | None = None
    revisions: list[Revision] = Field(default_factory=list)
    # A child run: its parent, the parent's goal, its depth and the tools its grant gives; a
    # parent: the child runs its delegate steps started (their workflow ids).
    parent: str | None = None
    parent_goal: str = ""
    depth: int = 0
    grant_tools: list[str] = Field(default_factory=list)
    children: list[str] = Field(default_factory=list)
    # In a tree: the writes the parent's approval named for this child, and how many of them its
    # writes have spent; and what the run's writes (its children's, charged back) may have
    # applied, per "tool.field" (RunData.spent), next to what the tree had done when it started.
    covered: int = 0
    covered_spent: int = 0
    spent: dict[str, float] = Field(default_factory=dict)
    tree_spent: dict[str, float] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _tree_when_set(self, handler: Any) -> dict[str, Any]:
        # Left out for a run outside any tree (or with no read found): snapshots and views read as they did.
        return omit_defaults(handler(self), {"found": [], "compensates": None, "parent": None, "parent_goal": "", "depth": 0, "grant_tools": [], "children": [],
                                             "covered": 0, "covered_spent": 0, "spent": {}, "tree_spent": {}})


class RunView(Packed):
    """What a run publishes where it rests (memo ``tether``): Tether's views read it with no
    worker running. ``published_at`` is workflow time: how fresh the view is."""

    snapshot: RunSnapshot
    # The latest records, bounded; at the run's end also every record the audit sink lacks
    # (the worker's audit collector writes them from here).
    timeline: list[TransitionRecord] = Field(default_factory=list)
    published_at: datetime
    continued_from: str | None = None  # the run this one continued as new from (the sink's stream says so)
    # The fleet's signature over this view for the run that published it (workflows/keys.py,
    # ``view_statement``): a view without one that verifies is a claim, never the run's state.
    sig: str = ""


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
    # What the run's writes (its children's included) may have applied, per "tool.field"
    # (RunData.spent): a child's is charged back to its parent.
    spent: dict[str, float] = Field(default_factory=dict)
    # A child run's: its workflow code's seal (the fleet key) over this outcome and its grant,
    # which the parent checks before it acts on the child's end (``sealing.Keyed.check_outcome``).
    seal: str = ""

    def sealed_digest(self) -> str:
        return json_digest(self.model_dump(mode="json", exclude={"seal"}))

    @model_serializer(mode="wrap")
    def _without_empty(self, handler: Any) -> dict[str, Any]:
        # The run's result is written into its history: the fields a bounded result leaves at
        # their defaults (no steps, no timeline, nothing before, no compensations) are left out;
        # read back, they are the same.
        return {k: v for k, v in handler(self).items() if not (k in _OUTCOME_OPTIONAL and v in ([], 0, "", {}))}


_OUTCOME_OPTIONAL = frozenset({"steps", "timeline", "steps_before", "steps_digest", "compensations", "spent", "seal"})


RunData.model_rebuild()
RunRequest.model_rebuild()


def found_steps(executed: list[ExecutedStep], catalog: Any) -> list[ReadFound]:
    """What the latest ok read steps (FOUND_STEPS) found: their results as the tools' summary
    fields say, bounded to a few hundred characters a step (``bounded_fields``). Pure: the view
    (workflows/views.py) and the Web UI's details (workflows/details.py) read the same."""
    found = []
    for step in executed:
        info = catalog.get(step.tool) if catalog is not None else None
        if step.status != "ok" or info is None or info.effect != ToolEffect.READ_ONLY or not step.observation:
            continue
        try:
            result: Any = json.loads(step.observation)  # the tool's JSON (cut short: shown as text)
        except ValueError:
            result = {"result": step.observation}
        if not isinstance(result, dict):
            result = {"result": result}
        fields = bounded_fields(result, info.summary_fields)
        declared = (info.result_schema or {}).get("properties") or {}
        words = {k: shown for k, v in fields.items() if (shown := money(v, declared.get(k), result)) is not None}
        found.append(ReadFound(
            tool=step.tool,
            args=bounded_fields(step.args, info.summary_fields),
            fields=fields,
            money=words,
        ))
    return found[-FOUND_STEPS:]


def shown_openly(found: ReadFound, info: ToolInfo | None) -> ReadFound:
    """What a surface outside the signed view shows of a read (the Web UI's details, which are
    not encoded, and a webhook's body, posted to a third party): the arguments and result fields
    the tool's summary fields name, and the result's money fields, in words. The rest (a
    customer's email) stays in the signed view, read by ``tether status`` and the inbox."""
    named = info.summary_fields if info is not None else []
    return ReadFound(
        tool=found.tool,
        args={k: v for k, v in found.args.items() if k in named},
        fields={k: v for k, v in found.fields.items() if k in named or k in found.money},
        money=found.money,
    )
