"""The activities that apply the policy file (their verdicts attested), and the judging they do:
Cedar's verdicts on a decision, a handoff, a cancel and the writes, worded as refusals.

The file itself (reading, checking, the store that keeps it in force) is
``tether/policy/files.py``; signatures are ``tether/policy/signatures.py``; the log of judgements
and what-if are ``tether/policy/judgements.py``; the decisions are the pure functions in
``workflows/policy.py``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from tether.policy import cedar, judgements
from tether.store.keys import KeyRing, attest
from tether.policy.files import PolicyFileError, PolicyStore
from tether.policy.signatures import decision_signature_refusal, granted_start, has_key, person_signature_refusal, signature_refusal
from workflows import policy
from workflows.identity import same_person
from workflows.contract import AcceptedApproval, ApprovalDecision, Plan, ToolCatalog, ToolEffect
from workflows.policy_file import Signer, TenantPolicy
from workflows.wire import (
    ApproverRoster,
    AuthorityCheck,
    DecisionCheck,
    HandoffCheck,
    PersonCheck,
    PlanReview,
    PolicySnapshot,
    Refusal,
    SnapshotRequest,
    Verdict,
)

SHADOW_DISAGREEMENTS = "tether_policy_shadow_disagreements"
log = logging.getLogger("tether.policy")


def decision_action(check: DecisionCheck) -> str:
    """The Cedar action of a decision: a partial approval is ``approve_steps`` (an ``approve``)."""
    if check.kind == "approve" and check.decision.steps is not None:
        return "approve_steps"
    return check.kind


def judge_decision(
    tenant: TenantPolicy | None, policies: cedar.Policies | None, check: DecisionCheck
) -> tuple[Refusal | None, cedar.Judgement]:
    """May this person take this decision? Cedar decides (the tenant's own policies, or its TOML
    rules exported: tests/activities/test_cedar.py holds the two equal); the refusal is worded as the TOML
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


ROSTER_PEOPLE = 64  # a tenant listing more approvers gets no roster: its decisions take the policy activity
ROSTER_PROBE = "tether.roster.anyone"  # judged for anyone the tenant does not list
ROSTER_CACHE = 1024  # rosters a policy worker keeps (a tenant's requesters under one file version)


def approver_rosters(
    tenant: TenantPolicy | None, policies: cedar.Policies | None, tenant_name: str, requested_by: str,
) -> list[ApproverRoster]:
    """Who may approve this requester's plans, for a request at each risk level as it opens
    (its roles before any escalation, no approval yet, no reviser): Cedar's ``approve``, as the
    policy activity judges a decision. Only people whose decisions need no signature (the tenant
    does not require them and lists no key for them). Empty where none can be made."""
    if tenant is None or policies is None or tenant.require_signatures:
        return []
    listed = tenant.approvers or {}
    if len(listed) > ROSTER_PEOPLE:
        return []
    rosters = []
    # A tenant with no high-risk rule asks nothing at that level: no roster for it.
    for risk in ("normal", "high") if tenant.high_risk is not None else ("normal",):
        roles = request_roles(tenant, risk)

        def judged(person: str) -> cedar.Judgement:
            return cedar.judge_person(policies, tenant_name, tenant, action="approve", person=person,
                                      requested_by=requested_by, roles=roles, already_approved=[], editors=[],
                                      risk=risk, stage=0)

        people = {name: list(j.policies) for name, member in sorted(listed.items())
                  if not member.public_key and (j := judged(name)).allowed}
        anyone = None
        if tenant.approvers is None and tenant.cedar is None and not same_person(ROSTER_PROBE, requested_by):
            # The tenant's rules (exported to Cedar) judge every unlisted person alike, the
            # requester aside (four-eyes, by skeleton): one judgement stands for them all.
            probe = judged(ROSTER_PROBE)
            anyone = list(probe.policies) if probe.allowed else None
        if people or anyone is not None:
            rosters.append(ApproverRoster(risk=risk, roles=roles, people=people, anyone=anyone))
    return rosters


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
    tenant: TenantPolicy | None, policies: cedar.Policies | None, check: AuthorityCheck, tenant_name: str,
    review: PlanReview | None = None,
) -> tuple[Refusal | None, list[cedar.Judgement]]:
    """The pre-write check in Cedar: may each remaining step write (``execute_write``), and, for
    a plan that runs without approval, is each still auto-approved (``auto_approve``)? The TOML
    engine's check (approvals in force, counts, signatures) runs beside it; the stricter wins.
    ``review``: the remaining steps' review under ``tenant`` (:func:`remaining_review`), if made."""
    if not check.steps or tenant is None:
        return None, []
    catalog = check.catalog or ToolCatalog()
    review = review or remaining_review(tenant, check)
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


def request_roles(tenant: TenantPolicy | None, risk: str) -> list[str]:
    """The roles a request of this risk level asks for before any escalation stage fired (the
    review's, through ``request_terms``)."""
    high = tenant.high_risk if tenant is not None and risk == "high" else None
    roles = high.roles if high is not None else (tenant or policy.DEFAULT_TENANT_POLICY).approval_roles
    review = PlanReview(needs_approval=True, risk="high" if high else "normal", approvals_required=1, roles=roles, summary="")
    return policy.request_terms(review, tenant)[1]


def remaining_review(tenant: TenantPolicy | None, check: AuthorityCheck) -> PlanReview:
    """What the file says about the check's remaining steps (approval, risk, escalation)."""
    return policy.review_plan(Plan(steps=check.steps, plan_hash=""), check.catalog or ToolCatalog(), tenant, check.spent)


def escalation_fields(tenant: TenantPolicy | None, check: AuthorityCheck, review: PlanReview | None,
                      judged: list[cedar.Judgement], approvals: int) -> dict[int, dict[str, Any]]:
    """What the check's judgement lines record of escalation, by their place in ``judged`` (the
    ``approvals`` re-judged approvals first): at planning time (auto-approval judged), the plan's
    first ``auto_approve`` line carries the stages the file sets for the plan; under an escalated
    request, each re-judged approval the stage it stood at. what-if compares them."""
    risk = review.risk if review is not None else "none"
    fields: dict[int, dict[str, Any]] = {}
    if check.escalated_roles:
        # The roles the approvals were judged on are the review's and the stages' (authority_refusal).
        asked = list(review.roles) if review is not None else []
        stood = judgements.stood_at(tenant, risk, asked, roles=list(check.escalated_roles))
        fields.update({i: {"escalated": stood} for i in range(approvals)})
    first = next((i for i, j in enumerate(judged) if cedar.action_name(j.request) == "auto_approve"), None)
    if first is not None:
        fields[first] = {"escalation": judgements.escalation_stages(tenant, risk)}
    return fields


def _where() -> dict[str, str]:
    """The run and activity a judgement is logged under."""
    try:
        info = activity.info()
    except RuntimeError:  # called outside an activity (tests, tools)
        return {"workflow_id": "", "run_id": "", "activity_id": ""}
    return {"workflow_id": info.workflow_id or "", "run_id": info.workflow_run_id or "", "activity_id": info.activity_id}




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
        # Rosters by (file digest, tenant, requester), oldest out first past ROSTER_CACHE.
        self.roster_cache: dict[tuple[str, str, str], list[ApproverRoster]] = {}

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

    def _rosters(self, name: str, requested_by: str, digest: str) -> list[ApproverRoster]:
        """The roster of this tenant's runs by this requester under the file of ``digest``, judged
        once per file version (every run's setup and request ask for it). A speed-up only: a file
        that will not judge (it changed since ``digest``, its Cedar does not load) gives none, and
        the run's decisions take the policy activity."""
        key = (digest, name, requested_by)
        if key not in self.roster_cache:
            try:
                tenant, policies, judged_under = self.store.policies(name)
            except PolicyFileError:
                return []
            if judged_under != digest:
                return []
            if len(self.roster_cache) >= ROSTER_CACHE:
                self.roster_cache.pop(next(iter(self.roster_cache)))
            self.roster_cache[key] = approver_rosters(tenant, policies, name, requested_by)
        return self.roster_cache[key]

    def _signers(self) -> dict[str, Signer]:
        try:
            return self.store.signers()
        except PolicyFileError as e:
            raise ApplicationError(f"{e}; fix the policy file", type="policy_file_invalid") from None

    async def policy_snapshot(self, request: SnapshotRequest) -> PolicySnapshot:
        tenant, digest = self._tenant(request.tenant)
        refusal, verified = None, False
        if request.workflow_id and tenant is not None and not granted_start(self.keys, request):
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
            verified = refusal is None and has_key(tenant, request.requested_by)
        document, _ = self.store.load()
        webhooks: dict[str, list[str]] = (
            {name: list(hook.events) for name, hook in document.notify.webhooks.items()} if document else {})
        rosters: list[ApproverRoster] = []
        if refusal is None and request.workflow_id:
            rosters = self._rosters(request.tenant, request.requested_by, digest)
        return PolicySnapshot(
            tenant=request.tenant,
            policy=tenant,
            policy_hash=digest,
            source=self.store.recorded_source,
            webhooks=webhooks,
            requester_refusal=refusal,
            requester_verified=verified,
            rosters=rosters,
        )

    @activity.defn(name="policy_check_decision")
    async def check_decision(self, check: DecisionCheck) -> Verdict:
        return self._attested(check, await self.judge_decision(check))

    async def judge_decision(self, check: DecisionCheck) -> Verdict:
        """The decision (and the approved plan's re-check, ``then``) under the current file, its
        judgements logged: the policy activity's verdict before it is attested, and the tool
        worker's judgement of a decision the run took on its roster (``ToolCall.judge``)."""
        tenant, policies, digest = self._policies(check.tenant)
        refusal, judgement = judge_decision(tenant, policies, check)
        # A decision on an escalated request: the stage it stood at (what-if compares it).
        stood = {0: {"escalated": judgements.stood_at(tenant, check.risk, request_roles(tenant, check.risk), stage=check.stage)}} if check.stage else None
        await self._log([judgement], check.tenant, digest, ids=policies.ids if policies else None, check="decision", kind=check.kind,
                        decision_id=check.decision.decision_id, person=check.decision.approver, extra=stood)
        if refusal is None:
            refusal = decision_signature_refusal(
                tenant, workflow_id=check.workflow_id, first_run_id=check.first_run_id, tenant_name=check.tenant,
                kind=check.kind, decision=check.decision, signers=self._signers(), steps_digest=check.steps_digest,
            )
        verified = refusal is None and has_key(tenant, check.decision.approver, check.decision.attested_by)
        verdict = Verdict(refusal=refusal, policy_hash=digest, verified=verified, policies=list(judgement.policies))
        if refusal is None and check.then is not None:
            # The approval puts the plan in force: its re-check before the first write, here, so
            # the run goes from the decision to the write with no other activity between.
            verdict.then = await self._authority(check.then, first=1)
        verdict.policy_problem = self.store.problem
        return verdict

    async def _log(
        self, judged: list[cedar.Judgement], tenant: str, digest: str, *, first: int = 0,
        ids: Mapping[str, str] | None = None, extra: Mapping[int, Mapping[str, Any]] | None = None, **what: Any,
    ) -> None:
        """``first``: the index of the first of these among the activity's judgements (a decision's
        activity logs the approved plan's re-check after the decision). ``extra``: fields of some
        lines only, by their place in ``judged`` (escalation)."""
        if not judged or (self.judgements is None and self.shadow is None):
            return
        at = datetime.now(timezone.utc).isoformat()
        lines = judgements.entries(judged, ids=ids, at=at, tenant=tenant, policy_hash=digest, **_where(), **what)
        for i, line in enumerate(lines):
            line.update((extra or {}).get(i, {}))
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
        verified = refusal is None and has_key(tenant, handoff.by)
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
        verified = refusal is None and not compensate and has_key(tenant, check.by)
        # The Cedar policies that decided, where Cedar's verdict is the run's.
        decided = list(judgement.policies) if judgement.allowed == (refusal is None) else []
        return self._attested(check, Verdict(refusal=refusal, policy_hash=digest, verified=verified, policies=decided))

    @activity.defn(name="policy_check_authority")
    async def check_authority(self, check: AuthorityCheck) -> Verdict:
        """The current file in full over the approvals in force (and a plan's auto-approval),
        just before a write (``check.call``) or before the steps that lead to one."""
        return self._attested(check, await self._authority(check))

    async def judge_plan(self, check: AuthorityCheck) -> Verdict:
        """``policy_check_authority``'s verdict on a plan's check, for the planner call that
        brought the plan to answer with it (attested there, with the run's setup)."""
        verdict = await self._authority(check)
        verdict.policy_problem = self.store.problem
        return verdict

    async def _authority(self, check: AuthorityCheck, *, first: int = 0) -> Verdict:
        tenant, policies, digest = self._policies(check.tenant)

        def signature_problem(approval: AcceptedApproval) -> Refusal | None:
            decision = ApprovalDecision.model_construct(
                decision_id=approval.decision_id, approver=approval.approver, plan_hash=approval.plan_hash or check.plan_hash,
                request_id=approval.request_id or check.request_id or None, signature=approval.signature,
                attested_by=approval.attested_by, steps=approval.steps,
            )
            return decision_signature_refusal(
                tenant, workflow_id=check.approved_in or check.workflow_id,
                first_run_id=check.approved_in_run or check.first_run_id, tenant_name=check.tenant,
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
        review = remaining_review(tenant, check) if check.steps and tenant is not None else None
        written, judged = judge_writes(tenant, policies, check, check.tenant, review)
        judged = approvals_judged + judged
        refusal = refusal or written
        # "plan": before the steps (planning time, an approved plan, the next step); "write": the
        # check just before a write attempt.
        await self._log(judged, check.tenant, digest, ids=policies.ids if policies else None, first=first, check="write" if check.call else "plan", plan_hash=check.plan_hash,
                        tool_call_id=check.call.tool_call_id if check.call else "",
                        extra=escalation_fields(tenant, check, review, judged, len(approvals_judged)))
        deciding = sorted({p for j in judged for p in j.policies if refusal is None or not j.allowed})
        verdict = Verdict(refusal=refusal, policy_hash=digest, policies=deciding)
        if check.roster:
            verdict.rosters = self._rosters(check.tenant, check.requested_by, digest)
        if refusal is not None:
            # A new request asks for what the current file asks, and for someone who can give it.
            review = review or remaining_review(tenant, check)
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
