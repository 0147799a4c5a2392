"""Signed decisions, as `tether approve --key` sends them: the approvers' keys, a policy that
requires signatures, and a decision signed by whom a test names."""

from __future__ import annotations

import base64
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.helpers.runs import approval_for
from workflows import policy
from workflows.contract import ApprovalDecision
from workflows.run_state import RunSnapshot


def sign(key: Ed25519PrivateKey, workflow_id: str, snap: RunSnapshot, kind: str, decision: ApprovalDecision) -> str:
    """What `tether approve --key` sends: a signature over policy.signature_payload."""
    payload = policy.decision_signature_payload(
        workflow_id=workflow_id, first_run_id=snap.first_run_id, tenant=snap.tenant, kind=kind, decision=decision
    )
    return base64.b64encode(key.sign(payload)).decode()


KEYS = {name: Ed25519PrivateKey.generate() for name in ("alice", "bob", "carol", "erin")}


def public(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


# The "secure" tenant requires signatures; refunds over 100.00 are high risk (two finance
# approvers); refunds are auto-approved up to 50.00 in all.
POLICY = f"""
[tenants.secure]
require_signatures = true
tools = ["get_order", "issue_refund", "post_ledger_entry", "send_email", "hold_then_fail"]
[tenants.secure.approvers]
alice = {{ roles = ["approver"], public_key = "{public(KEYS['alice'])}" }}
bob = {{ roles = ["approver"], public_key = "{public(KEYS['bob'])}" }}
carol = {{ roles = ["approver", "finance"], public_key = "{public(KEYS['carol'])}" }}
erin = {{ roles = ["finance"], public_key = "{public(KEYS['erin'])}" }}
[tenants.secure.high_risk]
approvals = 2
roles = ["finance"]
when = [{{ tool = "issue_refund", field = "amount_cents", above = 10000 }}]

[tenants.shop]
tools = ["get_order", "issue_refund", "hold_then_fail"]
[tenants.shop.approvers]
bob = {{ roles = ["approver"] }}
dana = {{ roles = ["approver"] }}
[tenants.shop.auto_approve]
limits = [{{ tool = "issue_refund", field = "amount_cents", max = 5000 }}]
"""


def signed(who: str, snap: RunSnapshot, kind: str = "approve", *, as_name: str | None = None, **fields: Any) -> ApprovalDecision:
    """A decision by ``as_name`` (default: who), signed with ``who``'s key."""
    decision = approval_for(snap, as_name or who, **fields)
    decision.signature = sign(KEYS[who], snap.run_id, snap, kind, decision)
    return decision
