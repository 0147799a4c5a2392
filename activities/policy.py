"""The policy file and the activities that apply it.

The file is TOML (``TETHER_POLICY`` or ``worker.py --policy PATH``; example:
``examples/billing/policy.toml``). It is read here, never in workflow code; the decisions are the
pure functions in ``workflows/policy.py``. The file is re-read when it changes, so revoking an
approver takes effect for runs already under way (approvals are re-checked before writes run).

Ed25519 signatures on decisions are verified here too (the ``cryptography`` package).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import tomllib
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from pathlib import Path

from pydantic import ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from workflows import policy
from activities import cedar, judgements
from activities.keys import KeyRing, attest
from workflows.identity import skeleton
from workflows.contract import SIGNER_NAME, STRICT, AcceptedApproval, ApprovalDecision, Plan, ToolCatalog, ToolEffect
from workflows.policy_file import Approver, PolicyDocument, Signer, TenantPolicy
from workflows.wire import (
    AuthorityCheck,
    DecisionCheck,
    HandoffCheck,
    PersonCheck,
    PolicySnapshot,
    Refusal,
    SnapshotRequest,
    Verdict,
)

SHADOW_DISAGREEMENTS = "tether_policy_shadow_disagreements"
RELOAD_FAILURES = "tether_policy_reload_failures"
log = logging.getLogger("tether.policy")

DEFAULT_SOURCE = "built-in default (no policy file): every write needs one approval from someone other than the requester"


class PolicyFileError(ValueError):
    """An invalid policy file, with the line and key that are wrong."""


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-\"'.]+)\s*=")


def _locate(text: str, loc: tuple) -> int | None:
    """The line (1-based) where the key at ``loc`` is written, best effort."""
    wanted = [str(p) for p in loc if not isinstance(p, int)]
    best, best_len = None, 0
    table: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if m := _HEADER.match(line):
            table = [p.strip().strip('"') for p in m.group(1).split(".")]
            path = table
        elif m := _KEY.match(line):
            path = table + [p.strip().strip('"') for p in m.group(1).split(".")]
        else:
            continue
        common = 0
        for a, b in zip(path, wanted):
            if a != b:
                break
            common += 1
        if common > best_len or (common == best_len and common == len(path) and best is None):
            best, best_len = number, common
    return best


def parse_policy(text: str, source: str = "policy") -> PolicyDocument:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyFileError(f"{source}: not valid TOML: {e}") from None
    try:
        return PolicyDocument.model_validate(raw, context=STRICT)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err["loc"])
        if (unknown := re.search(r"unknown field\(s\): ([^,\s]+)", err["msg"])) is not None:
            loc += (unknown.group(1),)  # point at the unknown key itself
        key = ".".join(str(p) for p in loc)
        line = _locate(text, loc)
        where = f"line {line}, " if line else ""
        raise PolicyFileError(f"{source}: {where}key {key}: {err['msg']}") from None


@dataclass
class PolicyStore:
    """The policy file, re-read when its modification time changes. A change that does not load
    (invalid TOML or Cedar, past the size bounds) leaves the last good policy in force: it is
    logged and counted once per version of the file, and ``problem`` says so (the verdicts carry
    it to the run, ``tether status`` and the inbox show it) until a good version replaces it."""

    path: Path | None
    _cache: tuple[tuple[Any, ...], PolicyDocument, str] | None = field(default=None, repr=False)
    _cedar: dict[str, str] = field(default_factory=dict, repr=False)  # tenant -> its own Cedar text
    # The last change that did not load: (its version, why). None: the file in force is the file.
    _bad: tuple[tuple[Any, ...], str] | None = field(default=None, repr=False)
    # Key files the file names that were not there (keygen still to run): looked for at each load.
    _missing_keys: tuple[Path, ...] = field(default=(), repr=False)
    reload_failures: int = 0

    @property
    def problem(self) -> str | None:
        """Why the file on disk is not the policy in force (the last good one is), or None."""
        if self._bad is None or self._cache is None:
            return None
        return f"{self._bad[1]} (kept the last good policy, hash {self._cache[2][:12]})"

    @classmethod
    def from_env(cls, path: str | None = None) -> PolicyStore:
        chosen = path or os.environ.get("TETHER_POLICY") or None
        store = cls(Path(chosen) if chosen else None)
        store.load()  # fail at worker start on a bad file, naming the line and the key
        return store

    def load(self) -> tuple[PolicyDocument | None, str]:
        """The document (None: no file, the built-in default applies) and its content hash (the
        TOML's, and the Cedar files' its tenants name)."""
        if self.path is None:
            return None, hashlib.sha256(DEFAULT_SOURCE.encode()).hexdigest()
        try:
            stat = self.path.stat()
            version: tuple[Any, ...] = (stat.st_mtime_ns, stat.st_size, stat.st_ino, *self._cedar_versions(),
                                        *(p.exists() for p in self._missing_keys))
        except FileNotFoundError:
            stat, version = None, ("missing",)
        if self._cache is None or self._cache[0] != version:
            if self._cache is not None and self._bad is not None and self._bad[0] == version:
                return self._cache[1], self._cache[2]  # that change did not load: said once already
            try:
                if stat is None:
                    raise PolicyFileError(f"policy file not found: {self.path}")
                self._read(stat)
            except (PolicyFileError, OSError, UnicodeDecodeError) as e:
                if self._cache is None:
                    if isinstance(e, PolicyFileError):
                        raise  # nothing good to keep: a worker does not start on it
                    raise PolicyFileError(f"{self.path}: cannot be read: {e}") from None
                self._bad = (version, str(e))
                self.reload_failures += 1
                try:
                    activity.metric_meter().create_counter(
                        RELOAD_FAILURES, "Policy file changes that did not load (the last good policy stays)", "1"
                    ).add(1)
                except RuntimeError:  # outside an activity (the inbox counts it on its health page)
                    pass
                log.error("policy file %s changed and does not load: %s; the last good policy (hash %s) stays in "
                          "force until the file is fixed", self.path, e, self._cache[2][:12])
                return self._cache[1], self._cache[2]
            self._bad = None
        return self._cache[1], self._cache[2]

    def _read(self, stat: os.stat_result) -> None:
        assert self.path is not None
        text = self.path.read_text()
        document = parse_policy(text, str(self.path))
        resolve_key_files(document, self.path, strict=False)
        cedar_texts = load_cedar_files(document, self.path)
        digest = hashlib.sha256(text.encode())
        for name in sorted(cedar_texts):
            digest.update(cedar_texts[name].encode())
        self._cedar = cedar_texts
        # A key file that is not there yet (keygen still to run): its appearing is a new version.
        self._missing_keys = tuple(
            (self.path.parent / holder.public_key_file).resolve()
            for holder in [*document.signers.values(),
                           *(a for tenant in document.tenants.values() for a in (tenant.approvers or {}).values())]
            if holder.public_key_file is not None and holder.public_key is None
        )
        version = (stat.st_mtime_ns, stat.st_size, stat.st_ino, *self._cedar_versions(document),
                   *(p.exists() for p in self._missing_keys))
        self._cache = (version, document, digest.hexdigest())

    def _cedar_versions(self, document: PolicyDocument | None = None) -> tuple[tuple[int, int], ...]:
        """The Cedar files' versions: an edit to one is read like an edit to the TOML."""
        if document is None:
            document = self._cache[1] if self._cache is not None else None
        if document is None or self.path is None:
            return ()
        out = []
        for tenant in document.tenants.values():
            for path in cedar.tenant_files(tenant, self.path.parent):
                try:
                    st = path.stat()
                    out.append((st.st_mtime_ns, st.st_size))
                except OSError:
                    out.append((0, 0))
        return tuple(out)

    def policies(self, name: str) -> tuple[TenantPolicy | None, cedar.Policies | None, str]:
        """The tenant, the Cedar policies that decide for it (its own files', else its TOML rules
        exported) and the file's hash; None, None when the tenant is not in the file."""
        tenant, digest = self.tenant(name)
        if tenant is None:
            return None, None, digest
        return tenant, cedar.policies_of(name, tenant, self._cedar.get(name)), digest

    def tenant(self, name: str) -> tuple[TenantPolicy | None, str]:
        document, digest = self.load()
        if document is None:
            return policy.DEFAULT_TENANT_POLICY, digest
        return document.tenants.get(name), digest

    def signers(self) -> dict[str, Signer]:
        """The trusted signers (``[signers.NAME]``; none without a policy file)."""
        document, _ = self.load()
        return document.signers if document is not None else {}

    @property
    def source(self) -> str:
        return str(self.path) if self.path else DEFAULT_SOURCE

    @property
    def recorded_source(self) -> str:
        """The file as runs record it (with its hash beside it, in refs.policy_hash): relative to
        the worker's directory, never the machine's absolute path; a file elsewhere by its last
        two path parts."""
        if self.path is None:
            return DEFAULT_SOURCE
        resolved = self.path.resolve()
        try:
            return resolved.relative_to(Path.cwd().resolve()).as_posix()
        except ValueError:
            return Path(*resolved.parts[-2:]).as_posix()


def load_cedar_files(document: PolicyDocument, path: Path) -> dict[str, str]:
    """Each tenant's own Cedar files (``cedar = [...]``) as one text, checked against the schema;
    a problem is a :class:`PolicyFileError` naming the file, the line and the problem."""
    texts, problems = {}, []
    for name, tenant in document.tenants.items():
        if tenant.cedar is None:
            continue
        try:
            texts[name] = cedar.read_tenant_cedar(name, tenant, path.parent)
        except cedar.CedarFileError as e:
            problems += e.problems
    if problems:
        raise PolicyFileError("\n".join(problems))
    return texts


def resolve_key_files(document: PolicyDocument, path: Path, *, strict: bool = True) -> bool:
    """Fill in ``public_key`` from each approver's and signer's ``public_key_file`` (relative to
    the policy file). A file that cannot be read raises (``strict``: the worker's start check) or
    leaves the key unset (at run time: their signatures cannot verify). True when all were read."""
    complete = True
    holders: list[tuple[str, Approver | Signer]] = [(f"signers.{n}", s) for n, s in document.signers.items()]
    holders += [
        (f"tenants.{t}.approvers.{who}", a)
        for t, tenant in document.tenants.items()
        for who, a in (tenant.approvers or {}).items()
    ]
    for where, holder in holders:
        if holder.public_key_file is None or holder.public_key is not None:
            continue
        key_path = (path.parent / holder.public_key_file).resolve()
        try:
            holder.public_key = key_path.read_text().strip()
        except OSError as e:
            complete = False
            if strict:
                raise PolicyFileError(
                    f"{path}: key {where}.public_key_file: cannot read {key_path} ({e.strerror}); "
                    "make it with `tether keygen --out KEY.pem`"
                ) from None
    return complete


def _public_key_problem(value: str) -> str | None:
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return "not valid base64"
    if len(raw) != 32:
        return f"decodes to {len(raw)} bytes; a raw Ed25519 public key is 32 (`tether keygen` prints one)"
    return None


def check_policy_file(path: Path, tool_names: Collection[str]) -> list[str]:
    """Everything wrong with a policy file as a whole, one line each (file, line, key), for
    the worker to refuse to start on. Runtime reads (``PolicyStore``) only check the schema.

    ``tool_names``: every tool the worker serves (its registry, and any other tool sources).
    """
    try:
        text = path.read_text()
    except (FileNotFoundError, IsADirectoryError):
        return [f"policy file not found: {path}"]
    try:
        document = parse_policy(text, str(path))
        resolve_key_files(document, path)
        load_cedar_files(document, path)
    except PolicyFileError as e:
        return str(e).splitlines()

    problems: list[str] = []

    def problem(loc: tuple, message: str) -> None:
        line = _locate(text, loc)
        problems.append(f"{path}: {f'line {line}, ' if line else ''}key {'.'.join(map(str, loc))}: {message}")

    if not document.tenants:
        problems.append(f"{path}: line 1, key tenants: no [tenants.NAME] table: every run would be refused (a missing "
                        "file, not an empty one, means the built-in default)")
    for name, signer in document.signers.items():
        at = ("signers", name)
        if not re.match(SIGNER_NAME, name):
            problem(at, f"a signer's name is lowercase letters, digits, '_', '.', '-' ({SIGNER_NAME})")
        if signer.public_key is None:
            problem(at, "no public_key or public_key_file: its attestations could never verify")
        elif why := _public_key_problem(signer.public_key):
            problem(at + ("public_key",), why)
        for tenant_name in signer.may_attest:
            if tenant_name not in document.tenants:
                problem(at + ("may_attest",), f"unknown tenant {tenant_name!r}")
    raw_tenants = tomllib.loads(text).get("tenants", {})
    known = set(tool_names)
    for hook_name, hook in document.notify.webhooks.items():
        if hook.secret_file is not None and not (path.parent / hook.secret_file).is_file():
            problem(("notify", "webhooks", hook_name, "secret_file"), f"no such file: {path.parent / hook.secret_file}")
    for name, tenant in document.tenants.items():
        at = ("tenants", name)
        if not raw_tenants.get(name):
            problem(at, "empty tenant: set tools and approvers (or remove it)")
            continue
        for level in ("normal", "high"):
            for i, stage in enumerate(getattr(tenant.escalation, level)):
                for hook_name in stage.notify:
                    if hook_name not in document.notify.webhooks:
                        problem(
                            at + ("escalation", level),
                            f"stage {i + 1} notifies {hook_name!r}: no [notify.webhooks.{hook_name}]",
                        )
        named = [(at + ("tools",), t) for t in tenant.tools or []]
        named += [(at + ("auto_approve", "limits"), r.tool) for r in tenant.auto_approve.limits]
        named += [(at + ("high_risk", "when"), r.tool) for r in (tenant.high_risk.when if tenant.high_risk else [])]
        for loc, tool in named:
            if tool not in known:
                problem(loc, f"unknown tool {tool!r}; the worker has {', '.join(sorted(known)) or 'no tools'}")
        if tenant.tools == []:
            problem(at + ("tools",), "empty: this tenant may use no tool")
        if tenant.approvers is None:
            continue
        for who, approver in tenant.approvers.items():
            if approver.public_key is not None and (why := _public_key_problem(approver.public_key)):
                problem(at + ("approvers", who, "public_key"), why)
        # Two approvers people cannot tell apart (one UTS #39 skeleton): 'alice' and 'a1ice'.
        by_skeleton: dict[str, list[str]] = {}
        for who in tenant.approvers:
            by_skeleton.setdefault(skeleton(who), []).append(who)
        for alike in (names for names in by_skeleton.values() if len(names) > 1):
            problem(at + ("approvers", alike[1]), f"looks like approver {alike[0]!r}: people could not tell "
                    f"{' and '.join(map(repr, alike))} apart; rename one")
        held = {role for a in tenant.approvers.values() for role in a.roles}
        wanted = [("approval_roles", r) for r in tenant.approval_roles]
        wanted += [("high_risk", r) for r in (tenant.high_risk.roles if tenant.high_risk else [])]
        wanted += [
            ("escalation", r) for level in (tenant.escalation.normal, tenant.escalation.high) for st in level for r in st.roles
        ]
        for key, role in wanted:
            if role not in held:
                loc = at + (key,) if key in ("approval_roles", "escalation") else at + ("high_risk", "roles")
                problem(loc, f"role {role!r} is held by no approver: no plan needing it could be approved")
    return problems


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


def decision_action(check: DecisionCheck) -> str:
    """The Cedar action of a decision: a partial approval is ``approve_steps`` (an ``approve``)."""
    if check.kind == "approve" and check.decision.steps is not None:
        return "approve_steps"
    return check.kind


def judge_decision(
    tenant: TenantPolicy | None, policies: cedar.Policies | None, check: DecisionCheck
) -> tuple[Refusal | None, cedar.Judgement]:
    """May this person take this decision? Cedar decides (the tenant's own policies, or its TOML
    rules exported: tests/test_cedar.py holds the two equal); the refusal is worded as the TOML
    rule that refused it words it, or names the Cedar policies. Also the ids that decided."""
    judgement = cedar.judge_person(
        policies, check.tenant, tenant, action=decision_action(check), person=check.decision.approver,
        requested_by=check.requested_by, roles=check.roles, already_approved=check.already_approved,
        editors=check.editors, risk=check.risk, stage=check.stage,
    )
    worded = None if judgement.allowed else policy.approver_refusal(
        tenant, approver=check.decision.approver, requested_by=check.requested_by, kind=check.kind,
        roles=check.roles, already_approved=check.already_approved, editors=check.editors,
    )
    return cedar_refusal(judgement, worded, check.decision.approver, check.kind, check.tenant), judgement


def cedar_refusal(judgement: cedar.Judgement, worded: Refusal | None, who: str, what: str, tenant: str) -> Refusal | None:
    """Cedar's verdict as a refusal: in the TOML rule's words when that rule refused it too (the
    exported rules), else naming the Cedar policies (a tenant's own)."""
    if judgement.allowed:
        return None
    if worded is not None and worded.rule == judgement.rule:
        return worded
    ids = ", ".join(judgement.policies)
    if judgement.rule == cedar.POLICY_ERROR:
        return Refusal(rule=cedar.POLICY_ERROR, message=_errored(judgement))
    if ids:
        message = f"{who} may not {what} this run: Cedar policy {ids} forbids it"
    else:
        message = f"no Cedar policy of tenant {tenant} permits {who} to {what} this run"
    return Refusal(rule=judgement.rule or "not_permitted", message=message)


def _errored(judgement: cedar.Judgement) -> str:
    """A refusal's words for a policy that errored at evaluation (fail closed)."""
    what = judgements.error_words(str(judgement.errors[0]))[1] if judgement.errors else "an evaluation error"
    return (f"Cedar policy {', '.join(judgement.policies) or '?'} errored at evaluation ({what[:200]}): refused, as "
            f"any request a policy errors on is (fix the policy: guard the condition)")


def cedar_approver_problem(
    tenant: TenantPolicy | None, policies: cedar.Policies | None, tenant_name: str, requested_by: str,
    judged: list[cedar.Judgement],
) -> Callable[[str, list[str], list[str], str], Refusal | None]:
    """How the pre-write check judges each approval in force again (``authority_refusal``'s
    ``approver_problem``): by Cedar, as a decision is judged when it arrives; each judgement is
    appended to ``judged``."""

    def approver_problem(approver: str, roles: list[str], already: list[str], risk: str) -> Refusal | None:
        judgement = cedar.judge_person(policies, tenant_name, tenant, action="approve", person=approver,
                                       requested_by=requested_by, roles=roles, already_approved=already, risk=risk)
        judged.append(judgement)
        worded = None if judgement.allowed else policy.approver_refusal(
            tenant, approver=approver, requested_by=requested_by, kind="approve", roles=roles, already_approved=already)
        return cedar_refusal(judgement, worded, approver, "approve", tenant_name)

    return approver_problem


def judge_writes(
    tenant: TenantPolicy | None, policies: cedar.Policies | None, check: AuthorityCheck, tenant_name: str
) -> tuple[Refusal | None, list[cedar.Judgement]]:
    """The pre-write check in Cedar: may each remaining step write (``execute_write``), and, for
    a plan that runs without approval, is each still auto-approved (``auto_approve``)? The TOML
    engine's check (approvals in force, counts, signatures) runs beside it; the stricter wins."""
    if not check.steps or tenant is None:
        return None, []
    catalog = check.catalog or ToolCatalog()
    review = policy.review_plan(Plan(steps=check.steps, plan_hash=""), catalog, tenant, check.spent)
    actions = ["execute_write", "auto_approve"] if check.approvals_required == 0 else ["execute_write"]
    # The writes among the remaining steps (the TOML check judges the tools of these, ``tools``).
    writes = [i for i, s in enumerate(check.steps, start=1)
              if (info := catalog.get(s.tool)) is None or info.effect != ToolEffect.READ_ONLY]
    judged = cedar.judge_steps(policies, tenant_name, tenant, actions=actions, steps=check.steps, catalog=catalog,
                               spent=check.spent, risk=review.risk, writes=writes)
    for j in judged:
        if j.rule == cedar.POLICY_ERROR:
            step = check.steps[int(j.request["resource"]["id"]) - 1]
            return Refusal(rule=cedar.POLICY_ERROR, message=f"{step.tool}: {_errored(j)}"), judged
        if not j.allowed:
            step = check.steps[int(j.request["resource"]["id"]) - 1]
            by = f"Cedar policy {', '.join(j.policies)}" if j.policies else "no Cedar policy permitting it"
            if cedar.action_name(j.request) == "execute_write":
                return Refusal(rule=j.rule or "not_permitted", message=f"{step.tool} may not write: {by}"), judged
            # Whichever policy denied it (a high-risk forbid, no limit permitting it), the run asks a person.
            return Refusal(rule="approval_needed", message=f"{step.tool} may not run without approval: {by}"), judged
    return None, judged


def _where() -> dict[str, str]:
    """The run and activity a judgement is logged under."""
    try:
        info = activity.info()
    except RuntimeError:  # called outside an activity (tests, tools)
        return {"workflow_id": "", "run_id": "", "activity_id": ""}
    return {"workflow_id": info.workflow_id or "", "run_id": info.workflow_run_id or "", "activity_id": info.activity_id}


def _has_key(tenant: TenantPolicy | None, person: str, attested_by: str | None = None) -> bool:
    """Does the policy list a key for this person, or did a trusted signer attest for them (so
    a passed signature check verified them)?"""
    if attested_by is not None:
        return True
    member = tenant.approvers.get(person) if tenant is not None and tenant.approvers else None
    return bool(member and member.public_key)


# ----------------------------------------------------------------------------- activities


class PolicyActivities:
    def __init__(self, store: PolicyStore, keys: KeyRing | None = None,
                 judgement_log: judgements.JudgementLog | None = None,
                 shadow: judgements.ProposedPolicy | None = None) -> None:
        self.store = store
        self.keys = keys  # the fleet's key ring: mints the capability of every write
        # Where each Cedar judgement is logged with what it was judged on (explain, what-if).
        self.judgements = judgement_log
        # A proposed policy judged beside the live one on every judgement, enforcing nothing: its
        # disagreements are logged (``shadow`` on the judgement's line) and counted.
        self.shadow = shadow
        self.shadow_disagreements: Counter[str] = Counter()

    def _tenant(self, name: str) -> tuple[TenantPolicy | None, str]:
        try:
            return self.store.tenant(name)
        except PolicyFileError as e:
            # Retryable on purpose: runs wait (and the worker logs why) until the file is fixed.
            raise ApplicationError(f"{e}; fix the policy file", type="policy_file_invalid") from None

    def _policies(self, name: str) -> tuple[TenantPolicy | None, cedar.Policies | None, str]:
        try:
            return self.store.policies(name)
        except PolicyFileError as e:
            raise ApplicationError(f"{e}; fix the policy file", type="policy_file_invalid") from None

    def _signers(self) -> dict[str, Signer]:
        try:
            return self.store.signers()
        except PolicyFileError as e:
            raise ApplicationError(f"{e}; fix the policy file", type="policy_file_invalid") from None

    async def policy_snapshot(self, request: SnapshotRequest) -> PolicySnapshot:
        tenant, digest = self._tenant(request.tenant)
        refusal, verified = None, False
        if request.workflow_id and tenant is not None:
            payload = policy.start_signature_payload(
                workflow_id=request.workflow_id,
                tenant=request.tenant,
                requested_by=request.requested_by,
                request_digest=request.request_digest,
                nonce=request.nonce,
                issued_at=request.issued_at,
            )
            refusal = signature_refusal(
                tenant, request.requested_by, payload, request.requester_signature, what="run request"
            )
            if refusal is None and request.requester_signature:
                # A signed start is fresh only for the tenant's window: a captured one goes stale.
                # The run's start time (the server's), or now if that is earlier (a test server's
                # clock may run ahead).
                now = datetime.now(timezone.utc)
                started = min(request.started_at, now) if request.started_at else now
                refusal = policy.start_freshness_refusal(request.issued_at, started, tenant.start_signature_ttl)
            # Verified only by a signature that checked out, never by the absence of a rule.
            verified = refusal is None and _has_key(tenant, request.requested_by)
        document, _ = self.store.load()
        webhooks = {name: list(hook.events) for name, hook in document.notify.webhooks.items()} if document else {}
        return PolicySnapshot(
            tenant=request.tenant,
            policy=tenant,
            policy_hash=digest,
            source=self.store.recorded_source,
            webhooks=webhooks,
            requester_refusal=refusal,
            requester_verified=verified,
        )

    @activity.defn(name="policy_check_decision")
    async def check_decision(self, check: DecisionCheck) -> Verdict:
        tenant, policies, digest = self._policies(check.tenant)
        refusal, judgement = judge_decision(tenant, policies, check)
        await self._log([judgement], check.tenant, digest, ids=policies.ids if policies else None, check="decision", kind=check.kind,
                        decision_id=check.decision.decision_id, person=check.decision.approver)
        if refusal is None:
            refusal = decision_signature_refusal(
                tenant, workflow_id=check.workflow_id, first_run_id=check.first_run_id, tenant_name=check.tenant,
                kind=check.kind, decision=check.decision, signers=self._signers(), steps_digest=check.steps_digest,
            )
        verified = refusal is None and _has_key(tenant, check.decision.approver, check.decision.attested_by)
        verdict = Verdict(refusal=refusal, policy_hash=digest, verified=verified, policies=list(judgement.policies))
        if refusal is None and check.then is not None:
            # The approval puts the plan in force: its re-check before the first write, here, so
            # the run goes from the decision to the write with no other activity between.
            verdict.then = await self._authority(check.then, first=1)
        return self._attested(check, verdict)

    async def _log(
        self, judged: list[cedar.Judgement], tenant: str, digest: str, *, first: int = 0,
        ids: Mapping[str, str] | None = None, **what: Any,
    ) -> None:
        """``first``: the index of the first of these among the activity's judgements (a decision's
        activity logs the approved plan's re-check after the decision)."""
        if not judged or (self.judgements is None and self.shadow is None):
            return
        at = datetime.now(timezone.utc).isoformat()
        lines = judgements.entries(judged, ids=ids, at=at, tenant=tenant, policy_hash=digest, **_where(), **what)
        for line in lines:
            line["index"] += first
        if self.shadow is not None:
            for line in lines:
                self._shadow(line)
        if self.judgements is not None:
            if self.keys is not None:
                lines = [judgements.sign(self.keys, line) for line in lines]
            await judgements.append(self.judgements, lines)

    def _shadow(self, line: dict[str, Any]) -> None:
        """The shadow policy's verdict beside the live one's, on the line; a disagreement is
        logged and counted (``tether_policy_shadow_disagreements{action}``). Never enforced."""
        assert self.shadow is not None
        try:
            allowed, rule, ids = self.shadow.judge(line)
        except Exception as e:  # a shadow's failure never touches the live decision
            log.warning("shadow policy %s could not judge %s of run %s: %s", self.shadow.path, line["action"],
                        line.get("workflow_id"), e)
            return
        agrees = (allowed, rule) == (line["allowed"], line["rule"])
        line["shadow"] = {"allowed": allowed, "rule": rule, "policies": list(ids), "agrees": agrees}
        if agrees:
            return
        self.shadow_disagreements[line["action"]] += 1
        log.warning("shadow policy %s disagrees on %s %s of run %s: live %s, shadow %s", self.shadow.path,
                    line.get("check"), line["action"], line.get("workflow_id"),
                    "allowed" if line["allowed"] else f"refused ({line['rule']})",
                    "allowed" if allowed else f"refused ({rule})")
        try:
            activity.metric_meter().create_counter(
                SHADOW_DISAGREEMENTS, "Judgements the shadow policy decides otherwise than the live one", "1"
            ).add(1, {"action": line["action"]})
        except RuntimeError:  # outside an activity (tests calling the checks directly)
            pass

    @activity.defn(name="policy_check_handoff")
    async def check_handoff(self, check: HandoffCheck) -> Verdict:
        """Screened again when the run takes the handoff: membership and signature, under the
        current file (a handoff that arrived before the run's policy snapshot was not)."""
        tenant, policies, digest = self._policies(check.tenant)
        handoff = check.handoff
        judgement = cedar.judge_person(policies, check.tenant, tenant, action="hand_off", person=handoff.by,
                                       requested_by=check.requested_by or handoff.by)
        await self._log([judgement], check.tenant, digest, ids=policies.ids if policies else None, check="handoff", decision_id=handoff.decision_id or "",
                        person=handoff.by)
        refusal = cedar_refusal(judgement, policy.handoff_member_refusal(tenant, handoff.by), handoff.by, "hand off",
                                check.tenant)
        if tenant is None:
            refusal = Refusal(rule="tenant", message="the run's tenant is not in the policy file")
        if refusal is None:
            refusal = person_signature_refusal(tenant, check, "handoff", handoff.by, handoff.decision_id or "",
                                               handoff.signature)
        verified = refusal is None and _has_key(tenant, handoff.by)
        return self._attested(check, Verdict(refusal=refusal, policy_hash=digest, verified=verified,
                                             policies=list(judgement.policies)))

    @activity.defn(name="policy_check_person")
    async def check_person(self, check: PersonCheck) -> Verdict:
        """A person's request the run judges, like a handoff, under the current file: a cancel
        (membership of the run's tenant, Cedar's ``cancel``, the signature rule), or the first
        judgement of a compensation run (Cedar's ``compensate``: membership and an approval
        role; its requester's signature was checked with the run's policy snapshot)."""
        tenant, policies, digest = self._policies(check.tenant)
        compensate = check.action == "compensate"
        member = (policy.compensator_refusal if compensate else policy.handoff_member_refusal)(tenant, check.by)
        judgement = cedar.judge_person(policies, check.tenant, tenant, action=check.action, person=check.by,
                                       requested_by=check.requested_by or check.by)
        await self._log([judgement], check.tenant, digest, check=check.action, decision_id=check.decision_id,
                        person=check.by)
        refusal = cedar_refusal(judgement, member, check.by, check.action, check.tenant)
        if tenant is None:
            refusal = Refusal(rule="tenant", message="the run's tenant is not in the policy file")
        if not compensate:
            # Only the tenant's people stop its runs, whatever its Cedar permits.
            refusal = refusal or member
        if refusal is None and not compensate:
            refusal = person_signature_refusal(tenant, check, "cancel", check.by, check.decision_id, check.signature)
        verified = refusal is None and not compensate and _has_key(tenant, check.by)
        # The Cedar policies that decided, where Cedar's verdict is the run's.
        decided = list(judgement.policies) if judgement.allowed == (refusal is None) else []
        return self._attested(check, Verdict(refusal=refusal, policy_hash=digest, verified=verified, policies=decided))

    @activity.defn(name="policy_check_authority")
    async def check_authority(self, check: AuthorityCheck) -> Verdict:
        """The current file in full over the approvals in force (and a plan's auto-approval),
        just before a write (``check.call``) or before the steps that lead to one."""
        return self._attested(check, await self._authority(check))

    async def _authority(self, check: AuthorityCheck, *, first: int = 0) -> Verdict:
        tenant, policies, digest = self._policies(check.tenant)

        def signature_problem(approval: AcceptedApproval) -> Refusal | None:
            decision = ApprovalDecision.model_construct(
                decision_id=approval.decision_id, approver=approval.approver, plan_hash=approval.plan_hash or check.plan_hash,
                request_id=approval.request_id or check.request_id or None, signature=approval.signature,
                attested_by=approval.attested_by, steps=approval.steps,
            )
            return decision_signature_refusal(
                tenant, workflow_id=check.workflow_id, first_run_id=check.first_run_id, tenant_name=check.tenant,
                kind="approve", decision=decision, signers=self._signers(),
            )

        if check.undo is not None:
            # A compensation: its own re-check (the plan hash that covered it, the undo tool).
            refusal = policy.undo_refusal(tenant, undo=check.undo, call=check.call)
            ids: list[str] = []
            if refusal is None and check.compensator:
                # The person who asked for a compensation run: Cedar's `compensate`.
                judgement = cedar.judge_person(policies, check.tenant, tenant, action="compensate",
                                               person=check.compensator, requested_by=check.requested_by or check.compensator)
                await self._log([judgement], check.tenant, digest, ids=policies.ids if policies else None, first=first, check="compensate", person=check.compensator)
                refusal = cedar_refusal(judgement, policy.compensator_refusal(tenant, check.compensator),
                                        check.compensator, "compensate", check.tenant)
                ids = list(judgement.policies)
            return Verdict(refusal=refusal, policy_hash=digest, policies=ids)
        approvals_judged: list[cedar.Judgement] = []
        approver_problem = cedar_approver_problem(tenant, policies, check.tenant, check.requested_by, approvals_judged)
        refusal = policy.authority_refusal(
            tenant,
            approvals=check.approvals,
            tools=check.tools,
            roles=check.roles,
            approvals_required=check.approvals_required,
            steps=check.steps,
            catalog=check.catalog,
            spent=check.spent,
            approved=check.approved,
            escalated_roles=check.escalated_roles,
            requested_by=check.requested_by,
            signature_problem=signature_problem,
            approver_problem=approver_problem,
        )
        written, judged = judge_writes(tenant, policies, check, check.tenant)
        judged = approvals_judged + judged
        refusal = refusal or written
        # "plan": before the steps (planning time, an approved plan, the next step); "write": the
        # check just before a write attempt.
        await self._log(judged, check.tenant, digest, ids=policies.ids if policies else None, first=first, check="write" if check.call else "plan", plan_hash=check.plan_hash,
                        tool_call_id=check.call.tool_call_id if check.call else "")
        deciding = sorted({p for j in judged for p in j.policies if refusal is None or not j.allowed})
        verdict = Verdict(refusal=refusal, policy_hash=digest, policies=deciding)
        if refusal is not None:
            # A new request asks for what the current file asks, and for someone who can give it.
            review = policy.review_plan(
                Plan(steps=check.steps, plan_hash=""), check.catalog or ToolCatalog(), tenant, check.spent
            )
            verdict.approvals_required, verdict.roles = policy.request_terms(review, tenant)
            verdict.tenant_policy = tenant
        return verdict

    def _attested(self, check: Any, verdict: Verdict) -> Verdict:
        """The verdict, with the fleet key's MAC over the check and itself: the run acts on no
        verdict a keyless poller wrote (its workflow code checks this), and the run's own code
        mints a write's capability only after an attested verdict allowed it."""
        if self.keys is None:
            raise ApplicationError("this worker has no key ring to attest its verdicts", type="key_missing", non_retryable=True)
        # A file that changed and did not load: judged by the last good one, and the run says so.
        verdict.policy_problem = self.store.problem
        return attest(self.keys, check, verdict)
