"""The export: a tenant's TOML rules as equivalent Cedar policies (``tether policy export``), each
with an ``@id`` (``TENANT.RULE``, what records and ``tether policy explain`` name) and a ``@rule``
(the refusal rule the TOML engine names for the same decision). docs/policy.md, "Cedar"."""

from __future__ import annotations

from collections.abc import Sequence
from decimal import ROUND_FLOOR

from tether.policy.cedar_text import NS, _action, _actions, _euid, cedar_string, decimal_text
from workflows.policy_file import AmountRule, PolicyDocument, TenantPolicy



def _policy(ident: str, rule: str | None, effect: str, actions: Sequence[str], resource: str, conditions: list[str],
            unless: str | None = None, comment: str = "") -> str:
    # `in`, never `==`: an action's group counts (approve_steps is an approve).
    action = f"action in {_action(actions[0])}" if len(actions) == 1 else f"action in {_actions(actions)}"
    lines = [f"// {comment}"] if comment else []
    lines.append(f"@id({cedar_string(ident)})")
    if rule:
        lines.append(f"@rule({cedar_string(rule)})")
    lines.append(f"{effect} (principal, {action}, resource is {NS}::{resource})")
    lines.append("when { " + " && ".join(conditions) + " }")
    if unless is not None:
        lines.append(f"unless {{ {unless} }}")
    return "\n".join(lines) + ";"


def _amount_condition(rule: AmountRule) -> list[str]:
    conditions = [f"resource.tool == {cedar_string(rule.tool)}"]
    if rule.field is None:
        return conditions
    tag = cedar_string(rule.field)
    conditions.append(f"resource.hasTag({tag})")
    if rule.max is not None:
        conditions.append(f'resource.getTag({tag}).lessThanOrEqual(decimal("{decimal_text(rule.max, rounding=ROUND_FLOOR)}"))')
    if rule.above is not None:
        conditions.append(f'resource.getTag({tag}).greaterThan(decimal("{decimal_text(rule.above)}"))')
    return conditions


def export_tenant(name: str, tenant: TenantPolicy) -> str:
    """The tenant's authorization rules as Cedar policies, equivalent to the TOML engine's
    decisions on them (tests/activities/test_cedar.py compares the two on thousands of random decisions).
    What is not authorization stays in the TOML: people and their keys, risk levels, approval
    counts, TTLs, escalation timing, budgets, webhooks."""
    of_tenant = f"resource.tenant == {_euid('Tenant', name)}"
    member = f"principal in {_euid('Tenant', name)}"
    policies = [
        _policy(f"{name}.decide", None, "permit", ("approve", "reject", "revise", "hand_off", "cancel", "compensate"),
                "Run", [of_tenant], comment=f"tenant {name}: its people decide on its runs, as the rules below allow"),
    ]
    if tenant.four_eyes:
        policies.append(_policy(
            f"{name}.four_eyes", "four_eyes", "forbid", ("approve",), "Run",
            [of_tenant, "principal.skeleton == resource.requester.skeleton"],
            comment="four_eyes: the requester (or a look-alike name) does not approve her own run"))
    if not tenant.editor_may_approve:
        policies.append(_policy(
            f"{name}.editor_approval", "editor_approval", "forbid", ("approve",), "Run",
            [of_tenant, "resource.revised_by.contains(principal.skeleton)"],
            comment="editor_may_approve = false: whoever revised the plan does not approve it"))
    if tenant.approvers is not None:
        policies.append(_policy(
            f"{name}.tenant_membership", "tenant_membership", "forbid",
            ("approve", "reject", "revise", "hand_off", "cancel", "compensate"), "Run", [of_tenant], unless=member,
            comment="approvers: only the tenant's people decide on its runs"))
        policies.append(_policy(
            f"{name}.role", "role", "forbid", ("approve", "reject", "revise"), "Run", [of_tenant],
            unless="principal in resource.roles",
            comment="a decision needs one of the roles the pending request asks for"))
        undo_roles = sorted(set(tenant.approval_roles) | set(tenant.high_risk.roles if tenant.high_risk else []))
        held = "principal in [" + ", ".join(_euid("Role", r) for r in undo_roles) + "]" if undo_roles else "false"
        policies.append(_policy(
            f"{name}.compensate_role", "role", "forbid", ("compensate",), "Run", [of_tenant], unless=held,
            comment="compensating (an undo is a write) needs an approval role of the tenant"))
    policies.append(_policy(
        f"{name}.distinct_approvers", "distinct_approvers", "forbid", ("approve",), "Run",
        [of_tenant, "resource.approved_by.contains(principal.skeleton)"],
        comment="one person (or look-alike name) approves a plan once"))
    step_tenant = f"resource.tenant == {_euid('Tenant', name)}"
    policies.append(_policy(f"{name}.write", None, "permit", ("execute_write",), "Step", [step_tenant],
                            comment="a write runs when its approval (or auto-approval) holds and the rules below allow"))
    if tenant.tools is not None:
        allowed = "[" + ", ".join(cedar_string(t) for t in tenant.tools) + "]" if tenant.tools else None
        policies.append(_policy(
            f"{name}.tools", "tool_withdrawn", "forbid", ("execute_write",), "Step", [step_tenant],
            unless=f"{allowed}.contains(resource.tool)" if allowed else "false",
            comment="tools: what the tenant may use"))
    if tenant.auto_approve.read_only:
        policies.append(_policy(
            f"{name}.auto_approve.read_only", None, "permit", ("auto_approve",), "Step",
            [step_tenant, "resource.known", "!resource.requires_approval", 'resource.effect == "read_only"'],
            comment="auto_approve.read_only: read-only steps that do not ask for approval need nobody"))
    for i, rule in enumerate(tenant.auto_approve.limits, start=1):
        policies.append(_policy(
            f"{name}.auto_approve.limits.{i}", None, "permit", ("auto_approve",), "Step",
            [step_tenant, "resource.known", "resource.requires_approval", *_amount_condition(rule)],
            comment=f"auto_approve.limits[{i}]: judged on the run's sum, never one call's share"))
    if tenant.high_risk is not None:
        policies.append(_policy(
            f"{name}.high_risk", "high_risk", "forbid", ("auto_approve",), "Step",
            [step_tenant, 'resource.risk == "high"'],
            comment=f"high_risk: a high-risk plan needs {tenant.high_risk.approvals} approvals, never none"))
    return "\n\n".join(policies) + "\n"


def export_document(document: PolicyDocument) -> str:
    header = (
        "// Exported by `tether policy export` from the policy file's authorization rules.\n"
        "// The schema: tether/policy/tether.cedarschema (docs/policy.md, \"Cedar\").\n"
    )
    parts = []
    for name, t in document.tenants.items():
        note = (f"// tenant {name} is decided by its own files ({', '.join(t.cedar)}): these, its TOML rules, are not in force\n"
                if t.cedar else "")
        parts.append(f"\n{note}{export_tenant(name, t)}")
    return header + "\n".join(parts)
