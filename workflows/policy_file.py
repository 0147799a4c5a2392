"""The policy file's shapes: the organisation's rules, per tenant (the TOML file read by
tether/policy/files.py): who approves, which tools, what is auto-approved, what counts as high
risk, approval TTLs, escalation, budgets and webhooks. The decisions over them live in
workflows/policy.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator, Field, field_validator, model_serializer

from workflows.contract import Contract, OnFailure, omit_defaults
from workflows.identity import normalize_name


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

    def matches(self, tool: str, args: dict[str, Any]) -> bool:
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
    # Steps of a parallel group that run at once (None: 8).
    max_parallel: int | None = Field(None, ge=1, le=16)
    # How deep child runs may nest (None: 2; 0: no delegation).
    max_depth: int | None = Field(None, ge=0, le=8)

    @model_serializer(mode="wrap")
    def _parallel_when_set(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"max_parallel": None, "max_depth": None})  # older snapshots read as they did


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
    # The tenant's own Cedar policies (files, relative to the policy file; schema:
    # tether/policy/tether.cedarschema): they decide who may do what in place of the rules above,
    # which `tether policy export` writes as Cedar to start from (docs/policy.md, "Cedar").
    cedar: list[str] | None = Field(None, min_length=1)
    # A signed start is good for this long after its issued_at: seconds, or "90s" / "10m" / "1h".
    start_signature_ttl: float = Field(600.0, gt=0, le=7 * 24 * 3600)

    @model_serializer(mode="wrap")
    def _new_fields_when_set(self, handler: Any) -> dict[str, Any]:
        return omit_defaults(handler(self), {"cedar": None})  # see omit_defaults

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
    events: list[NotifyEvent] = Field(default_factory=lambda: list(get_args(NotifyEvent)))  # every event
    secret_file: str | None = None


class Notify(Contract):
    webhooks: dict[str, Webhook] = Field(default_factory=dict)


class PolicyDocument(Contract):
    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)
    signers: dict[str, Signer] = Field(default_factory=dict)
    notify: Notify = Field(default_factory=Notify)
