"""What the inbox decides about a person and a run, as pure functions over the policy and the
run's snapshot: which tenants list them, may they decide this run, who else may, the id of
their decision. The runtime decides again, authoritatively; these only choose what to offer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime

from tether.client import approval_offer_problem
from workflows import policy
from workflows.policy_file import PolicyDocument, TenantPolicy
from workflows.wire import Refusal
from workflows.run_state import RunSnapshot
from workflows.states import RunState, TransitionRecord

# Refusals that mean "what you looked at is no longer what is pending".
STALE_RULES = frozenset({"stale_plan_hash", "stale_request"})
CHANGED = "this plan changed — review the new one"


def tenants_of(document: PolicyDocument | None, person: str) -> list[str]:
    """The tenants whose policy lists this person (the only ones the inbox shows them)."""
    if document is None:
        return []
    return sorted(n for n, t in document.tenants.items() if t.approvers is not None and person in t.approvers)


def attester(document: PolicyDocument | None, public_key: str | None, tenant: str) -> str | None:
    """The signer name under which the inbox (holding ``public_key``) may attest for ``tenant``."""
    if document is None or public_key is None:
        return None
    for name, signer in sorted(document.signers.items()):
        if signer.public_key == public_key and tenant in signer.may_attest:
            return name
    return None


def decide_refusal(
    tenant: TenantPolicy | None, snap: RunSnapshot, person: str, *, now: datetime, can_attest: bool
) -> Refusal | None:
    """Why this person could not approve this run now (None: the inbox offers it to them)."""
    pending = snap.pending_approval
    if snap.state != RunState.AWAITING_APPROVAL or pending is None:
        return Refusal(rule="not_awaiting_approval", message=f"run is {snap.state.value}, not AWAITING_APPROVAL")
    if now >= pending.expires_at:
        return Refusal(rule="approval_expired", message=f"approval expired at {pending.expires_at.isoformat()}")
    mismatch = approval_offer_problem(snap)
    if mismatch is not None:
        return Refusal(rule="plan_unverified", message=mismatch)
    refusal = policy.approver_refusal(
        tenant,
        approver=person,
        requested_by=snap.requested_by,
        kind="approve",
        roles=pending.roles,
        already_approved=[a.approver for a in pending.approvals],
    )
    if refusal is None and tenant is not None and tenant.require_signatures and not can_attest:
        return Refusal(
            rule="signature_required",
            message="this tenant requires signed decisions and the policy does not let this inbox attest here",
        )
    return refusal


def deciders(tenant: TenantPolicy | None, snap: RunSnapshot) -> list[str]:
    """Who may still approve the pending plan (the policy's people, by role and four-eyes)."""
    pending = snap.pending_approval
    if tenant is None or tenant.approvers is None or pending is None:
        return []
    done = [a.approver for a in pending.approvals]
    return [
        name for name in sorted(tenant.approvers)
        if policy.approver_refusal(
            tenant, approver=name, requested_by=snap.requested_by, kind="approve", roles=pending.roles,
            already_approved=done,
        ) is None
    ]


def recorded_policy_hash(records: Sequence[TransitionRecord]) -> str | None:
    """The policy file's hash a run recorded at its start (``refs.policy_hash`` of its first
    transition), from its signed records; None when the records at hand do not hold it."""
    return next((r.refs.policy_hash for r in sorted(records, key=lambda r: r.seq) if r.refs.policy_hash), None)


def has_acted(person: str, snap: RunSnapshot, records: list[TransitionRecord]) -> bool:
    """Did this person's decision count on this run (they may follow it to its end)?"""
    if person in snap.approved_by:
        return True
    mine = (f"user:{person}", f"user:{person} ")
    return any(r.kind != "refused" and (r.actor == mine[0] or r.actor.startswith(mine[1])) for r in records)


def decision_id(run_id: str, request_id: str, plan_hash: str, person: str, kind: str) -> str:
    """Made here, never by the browser: one person's one decision on one request of one plan
    has one id, so a double click (or a re-sent form) is the same decision, not a second one."""
    digest = hashlib.sha256("\n".join(["tether-inbox", run_id, request_id, plan_hash, person, kind]).encode())
    return f"inbox-{digest.hexdigest()[:40]}"


def time_left(expires_at: datetime | None, now: datetime) -> str:
    if expires_at is None:
        return ""
    seconds = int((expires_at - now).total_seconds())
    if seconds <= 0:
        return "expired"
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"
