"""Ed25519 signatures on what people send a run (the ``cryptography`` package): whether a
person's or a trusted signer's signature is required, and whether it verifies. Every check of a
decision's, a handoff's, a cancel's or a start's signature goes through ``signature_refusal``;
the payloads signed are ``workflows/policy.py``'s."""

from __future__ import annotations

import base64
from collections.abc import Mapping

from workflows import keys
from workflows import policy
from workflows.contract import ApprovalDecision
from workflows.policy_file import Signer, TenantPolicy
from workflows.wire import HandoffCheck, PersonCheck, Refusal, SnapshotRequest


def granted_start(ring: keys.KeyRing | None, request: SnapshotRequest) -> bool:
    """Is this start a child run's, its authority a grant in place of the requester's signature?
    The grant bears the fleet key's seal (only a parent run's workflow code makes one), names this
    run, and was made by a run of the same tenant for the same requester; the child's workflow
    code checked that the server names the grant's parent as its parent before asking."""
    grant = request.grant
    if ring is None or grant is None or not grant.seal:
        return False
    try:
        sealed = keys.grant_valid(ring, grant.seal, grant.sealed_digest())
    except keys.KeyMissing:
        return False
    return sealed and (grant.child, grant.tenant, grant.requested_by) == (request.workflow_id, request.tenant, request.requested_by)


def verify_signature(public_key_b64: str, payload: bytes, signature_b64: str | None) -> str | None:
    """Why a signature does not verify, or None when it does."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if not signature_b64:
        return "this approver's decisions must be signed (tether approve --key PATH)"
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key_b64))
        key.verify(base64.b64decode(signature_b64, validate=True), payload)
    except (InvalidSignature, ValueError):
        return "the signature does not match this decision, its request and its run"
    return None


def signature_refusal(
    tenant: TenantPolicy | None,
    person: str,
    payload: bytes,
    signature: str | None,
    *,
    what: str,
    attested_by: str | None = None,
    signers: Mapping[str, Signer] | None = None,
    tenant_name: str = "",
) -> Refusal | None:
    """Is ``person``'s signature over ``payload`` required here, and does it verify?

    Required where the tenant requires signatures, and for anyone whose key the policy lists.
    With ``attested_by`` the signature is a trusted signer's (``signers``, the policy's
    ``[signers.NAME]``): it must verify by that signer's key, and the signer must be allowed to
    attest for ``tenant_name`` (``may_attest``); then it stands in for the person's own. Every
    check of a decision's signature (on arrival, and again before writes) goes through here.
    """
    if tenant is None:
        return None
    if attested_by is not None:
        signer = (signers or {}).get(attested_by)
        if signer is None or not signer.public_key:
            return Refusal(rule="signer_not_trusted", message=f"the policy lists no signer {attested_by!r}")
        if tenant_name not in signer.may_attest:
            return Refusal(
                rule="signer_not_trusted", message=f"signer {attested_by} may not attest for tenant {tenant_name}"
            )
        if not signature:
            return Refusal(rule="signature_required", message=f"an attestation by {attested_by} must be signed")
        if verify_signature(signer.public_key, payload, signature) is not None:
            return Refusal(
                rule="bad_signature",
                message=f"{attested_by}'s signature does not match this decision, its request and its run",
            )
        return None
    member = tenant.approvers.get(person) if tenant.approvers is not None else None
    key = member.public_key if member is not None else None
    if key is None:
        if tenant.require_signatures:
            return Refusal(
                rule="signature_required",
                message=f"this tenant requires signed {what}s and the policy lists no key for {person}",
            )
        return None
    if not signature:
        return Refusal(rule="signature_required", message=f"{person}'s {what}s must be signed (--key PATH)")
    if (why := verify_signature(key, payload, signature)) is not None:
        return Refusal(rule="bad_signature", message=why)
    return None


def person_signature_refusal(
    tenant: TenantPolicy | None, check: HandoffCheck | PersonCheck, kind: str, by: str, decision_id: str,
    signature: str | None,
) -> Refusal | None:
    """A handoff's or a cancel's signature (bound to the run, its kind and its decision id),
    where the tenant requires it or the policy lists the person's key."""
    payload = policy.signature_payload(
        workflow_id=check.workflow_id, first_run_id=check.first_run_id, tenant=check.tenant, request_id="",
        plan_hash="", kind=kind, decision_id=decision_id, signer=by,
    )
    return signature_refusal(tenant, by, payload, signature, what=kind)


def decision_signature_refusal(
    tenant: TenantPolicy | None, *, workflow_id: str, first_run_id: str, tenant_name: str, kind: str,
    decision: ApprovalDecision, signers: Mapping[str, Signer] | None = None, steps_digest: str | None = None,
) -> Refusal | None:
    """The one check of a decision's signature (a person's, or a trusted signer's attestation):
    when it arrives (``policy_check_decision``) and again before every write
    (``policy_check_authority``), under the file as it is then."""
    payload = policy.decision_signature_payload(
        workflow_id=workflow_id, first_run_id=first_run_id, tenant=tenant_name, kind=kind, decision=decision,
        steps_digest=steps_digest,
    )
    return signature_refusal(
        tenant, decision.approver, payload, decision.signature, what="decision",
        attested_by=decision.attested_by, signers=signers, tenant_name=tenant_name,
    )


def has_key(tenant: TenantPolicy | None, person: str, attested_by: str | None = None) -> bool:
    """Does the policy list a key for this person, or did a trusted signer attest for them (so
    a passed signature check verified them)?"""
    if attested_by is not None:
        return True
    member = tenant.approvers.get(person) if tenant is not None and tenant.approvers else None
    return bool(member and member.public_key)
