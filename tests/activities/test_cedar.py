"""Cedar (tether/policy/cedar.py): the exported example tenants decide as the TOML engine does.

The heart of it is ``test_cedar_decides_as_the_toml_rules``: for every tenant of every example
policy file, and for random tenants covering every option the export reads, thousands of seeded
random decisions judged by both engines, verdict and refusal rule compared.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import cedarpy
import pytest

from tether.policy import cedar
from activities.policy_checks import cedar_approver_problem, judge_writes
from tether.policy.files import parse_policy
from tests.helpers.paths import ROOT


from workflows import policy
from workflows.contract import AcceptedApproval, Plan, PlanStep, ToolCatalog, ToolEffect, ToolInfo
from workflows.wire import AuthorityCheck
from workflows.policy_file import AmountRule, Approver, AutoApprove, HighRisk, TenantPolicy
from tests.helpers.policies import RECORDED_POLICY, refund_step, signed_lines

EXAMPLES = [ROOT / "examples/billing/policy.toml", ROOT / "examples/billing/policy.image.toml", ROOT / "examples/git/policy.toml"]
STRANGERS = ["mallory", "a1ice", "b0b", "rnallory", "zed"]  # a1ice looks like alice, rnallory like mallory
ROLES = ["approver", "finance", "support", "manager"]
AMOUNTS = [0, 1, 1999, 2000, 2001, 4999, 5000, 5000.5, 5001, 20000, 49999.75, 50000, 50001, 120000]
SEED = 32
AT = datetime(2026, 1, 1, tzinfo=timezone.utc)


def example_tenants() -> list[tuple[str, str, TenantPolicy]]:
    out = []
    for path in EXAMPLES:
        document = parse_policy(path.read_text(), str(path))
        out += [(path.name, name, tenant) for name, tenant in document.tenants.items()]
    return out


def random_tenant(rng: random.Random, tools: list[str]) -> TenantPolicy:
    """A tenant setting every option the export reads, at random."""

    def amount_rule(kind: str) -> AmountRule:
        tool = rng.choice(tools)
        if rng.random() < 0.2:
            return AmountRule(tool=tool)
        bound = float(rng.choice([2000, 5000, 5000.25, 50000]))
        return AmountRule(tool=tool, field="amount_cents", **{kind: bound})

    people = ["alice", "bob", "carol", "erin", "dana", "mallory"]
    approvers = None if rng.random() < 0.25 else {
        who: Approver(roles=rng.sample(ROLES, rng.randint(0, 2))) for who in rng.sample(people, rng.randint(0, 5))
    }
    high_risk = None if rng.random() < 0.3 else HighRisk(
        when=[amount_rule("above") for _ in range(rng.randint(0, 2))], destructive=rng.random() < 0.5,
        approvals=rng.randint(1, 3), roles=rng.sample(ROLES, rng.randint(1, 2)),
    )
    return TenantPolicy(
        tools=None if rng.random() < 0.3 else rng.sample(tools, rng.randint(0, len(tools))),
        approvers=approvers,
        approval_roles=rng.sample(ROLES, rng.randint(0, 2)),
        four_eyes=rng.random() < 0.7,
        editor_may_approve=rng.random() < 0.6,
        auto_approve=AutoApprove(
            read_only=rng.random() < 0.7, limits=[amount_rule("max") for _ in range(rng.randint(0, 2))]
        ),
        high_risk=high_risk,
    )


def random_catalog(rng: random.Random, tools: list[str]) -> ToolCatalog:
    """Each tool with a random declared effect (one is left out: a tool the worker lacks)."""
    known = tools[:-1] if rng.random() < 0.5 else tools
    return ToolCatalog(tools=[
        ToolInfo(
            name=t, effect=rng.choice(list(ToolEffect)), requires_approval=rng.random() < 0.6,
            destructive=rng.random() < 0.2, args_schema={}, timeout_seconds=10, max_retries=1,
        )
        for t in known
    ])


def names_of(tenant: TenantPolicy) -> list[str]:
    return sorted(set(tenant.approvers or {}) | {"alice", "bob", "carol"}) + STRANGERS


def cedar_verdict(j: cedar.Judgement) -> tuple[bool, str | None]:
    assert not j.errors, j.errors  # an evaluation error would be a deny for the wrong reason
    if j.entities and next(JUDGED) % 50 == 0:
        # The engine is not given the schema per call (the cost): the entities are held to it here.
        cedarpy.Entities.from_json_str(json.dumps(list(j.entities)), cedar.schema())
    return j.allowed, j.rule


JUDGED = itertools.count()


def toml_verdict(refusal: policy.Refusal | None) -> tuple[bool, str | None]:
    return refusal is None, refusal.rule if refusal else None


def compare_decisions(
    rng: random.Random, name: str, tenant: TenantPolicy, tools: list[str], n: int, seen: Counter[str]
) -> int:
    """``n`` random decisions of each kind on one tenant, judged by both engines; ``seen``
    counts the verdicts (by refusal rule) they agreed on."""
    policies = cedar.policies_for(name, tenant)
    people = names_of(tenant)
    roles_pool = sorted(set(ROLES) | {r for a in (tenant.approvers or {}).values() for r in a.roles})
    compared = 0
    for _ in range(n):
        person, requester = rng.choice(people), rng.choice(people)
        roles = rng.sample(roles_pool, rng.randint(1, 3))
        approved = rng.sample(people, rng.randint(0, 2))
        editors = rng.sample(people, rng.randint(0, 2))
        for kind, action in (("approve", "approve"), ("approve", "approve_steps"), ("reject", "reject"), ("revise", "revise")):
            expected = toml_verdict(policy.approver_refusal(
                tenant, approver=person, requested_by=requester, kind=kind, roles=roles,
                already_approved=approved, editors=editors,
            ))
            got = cedar_verdict(cedar.judge_person(
                policies, name, tenant, action=action, person=person, requested_by=requester, roles=roles,
                already_approved=approved, editors=editors,
            ))
            assert got == expected, (name, kind, action, person, requester, roles, approved, editors)
            seen[got[1] or "allowed"] += 1
        expected = toml_verdict(policy.handoff_member_refusal(tenant, person))
        assert cedar_verdict(cedar.judge_person(policies, name, tenant, action="hand_off", person=person,
                                                requested_by=requester)) == expected, (name, "hand_off", person)
        expected = toml_verdict(policy.compensator_refusal(tenant, person))
        assert cedar_verdict(cedar.judge_person(policies, name, tenant, action="compensate", person=person,
                                                requested_by=requester)) == expected, (name, "compensate", person)
        # A plan: auto-approved by both or by neither; each write allowed by both or neither.
        catalog = random_catalog(rng, tools)
        steps = [
            PlanStep(tool_call_id=f"s{i}", tool=rng.choice(tools + ["unknown_tool"]),
                     args={"amount_cents": rng.choice(AMOUNTS)} if rng.random() < 0.8 else {"note": "x"})
            for i in range(rng.randint(1, 4))
        ]
        spent = {f"{rng.choice(tools)}.amount_cents": rng.choice(AMOUNTS)} if rng.random() < 0.4 else {}
        review = policy.review_plan(Plan(steps=steps, plan_hash=""), catalog, tenant, spent)
        judged = cedar.judge_steps(policies, name, tenant, actions=["auto_approve"], steps=steps, catalog=catalog,
                                   spent=spent, risk=review.risk)
        assert all(not j.errors for j in judged)
        assert (not cedar.plan_auto_approved(judged)) == review.needs_approval, (name, steps, spent, catalog)
        seen[f"plan {review.risk}"] += 1
        writes = cedar.judge_steps(policies, name, tenant, actions=["execute_write"], steps=steps, catalog=catalog)
        for step, j in zip(steps, writes, strict=True):
            why = policy.tool_refusal(tenant, step.tool)
            assert cedar_verdict(j) == (why is None, "tool_withdrawn" if why else None), (name, step.tool)
            seen["tool_withdrawn" if why else "write allowed"] += 1
        # The activity's whole pre-write check of a plan that runs without approval, both ways.
        write_tools = [s.tool for s in steps if (i := catalog.get(s.tool)) is None or i.effect != ToolEffect.READ_ONLY]
        check = AuthorityCheck(tenant=name, approvals=[], tools=write_tools, roles=[], approvals_required=0,
                               steps=steps, catalog=catalog, spent=spent)
        expected = toml_verdict(policy.authority_refusal(
            tenant, approvals=[], tools=write_tools, roles=[], approvals_required=0, steps=steps, catalog=catalog,
            spent=spent))
        refusal, judged = judge_writes(tenant, policies, check, name)
        assert toml_verdict(refusal) == expected, (name, steps, spent, catalog)
        seen[f"pre-write {expected[1] or 'allowed'}"] += 1
        # An approved plan's check: each approval in force judged again, by Cedar and by the TOML.
        approved = [AcceptedApproval(approver=who, decision_id=f"d{k}", at=AT) for k, who in enumerate(approved)]
        terms = dict(approvals=[a.approver for a in approved], tools=write_tools, roles=roles, approvals_required=1,
                     steps=steps, catalog=catalog, spent=spent, approved=approved, requested_by=requester)
        expected = toml_verdict(policy.authority_refusal(tenant, **terms))
        problem = cedar_approver_problem(tenant, policies, name, requester, [])
        assert toml_verdict(policy.authority_refusal(tenant, **terms, approver_problem=problem)) == expected, (
            name, approved, requester, steps)
        seen[f"approvals {expected[1] or 'hold'}"] += 1
        compared += 13 + len(steps)
    return compared


def test_cedar_decides_as_the_toml_rules() -> None:
    rng = random.Random(SEED)
    compared, seen = 0, Counter[str]()
    billing = ["get_order", "issue_refund", "post_ledger_entry", "send_email", "void_refund"]
    for source, name, tenant in example_tenants():
        tools = list(tenant.tools or billing)
        compared += compare_decisions(rng, name, tenant, tools, n=200, seen=seen)
    for i in range(120):
        compared += compare_decisions(rng, f"t{i}", random_tenant(rng, billing), billing, n=10, seen=seen)
    print(f"{compared} decisions compared: {dict(seen)}")
    assert compared > 20_000
    # Every verdict the rules can give came up, each many times: the sample reaches them all.
    rules = ["allowed", "four_eyes", "editor_approval", "tenant_membership", "role", "distinct_approvers",
             "tool_withdrawn", "write allowed", "plan none", "plan normal", "plan high",
             "pre-write allowed", "pre-write approval_needed", "pre-write tool_withdrawn",
             "approvals hold", "approvals approver_revoked"]
    assert all(seen[r] >= 50 for r in rules), seen


def test_a_missing_tenant_is_refused_by_both() -> None:
    j = cedar.judge_person(None, "ghost", None, action="approve", person="bob", requested_by="alice")
    assert cedar_verdict(j) == toml_verdict(policy.approver_refusal(
        None, approver="bob", requested_by="alice", kind="approve", roles=["approver"], already_approved=[]))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_exports_validate_against_the_schema(path: Path) -> None:
    text = cedar.export_document(parse_policy(path.read_text(), str(path)))
    result = cedarpy.validate_policies(text, cedar.schema())
    assert result.validation_passed, [str(e) for e in result.errors]
    assert cedarpy.format_policies(text)  # the formatter reads it too


def test_the_deciding_policies_are_named() -> None:
    """A verdict names the policies that decided it: the forbids that refused, the permit that allowed."""
    tenant = parse_policy((ROOT / "examples/billing/policy.toml").read_text()).tenants["default"]
    policies = cedar.policies_for("default", tenant)
    ok = cedar.judge_person(policies, "default", tenant, action="approve", person="bob", requested_by="alice", roles=["approver"])
    assert (ok.allowed, ok.policies) == (True, ("default.decide",))
    own = cedar.judge_person(policies, "default", tenant, action="approve", person="a1ice", requested_by="alice",
                             roles=["finance"])
    assert (own.allowed, own.rule) == (False, "four_eyes")
    assert own.policies == ("default.four_eyes", "default.role", "default.tenant_membership")
    refund = [PlanStep(tool_call_id="s1", tool="issue_refund", args={"amount_cents": 4000})]
    catalog = ToolCatalog(tools=[ToolInfo(name="issue_refund", effect=ToolEffect.IDEMPOTENT, requires_approval=True,
                                          args_schema={}, timeout_seconds=10, max_retries=1)])
    [auto] = cedar.judge_steps(policies, "default", tenant, actions=["auto_approve"], steps=refund, catalog=catalog)
    assert (auto.allowed, auto.policies) == (True, ("default.auto_approve.limits.1",))
    # Four refunds of 49.99 are one refund of 199.96: the run's sum is the step's tag.
    [summed] = cedar.judge_steps(policies, "default", tenant, actions=["auto_approve"], steps=refund, catalog=catalog,
                                 spent={"issue_refund.amount_cents": 1001})
    assert (summed.allowed, summed.rule) == (False, "approval_needed")


def test_amounts_round_toward_needing_approval() -> None:
    assert cedar.decimal_text(5000) == "5000.0"
    assert cedar.decimal_text(0.1 + 0.2) == "0.3001"  # over 0.3, as the float is
    assert cedar.decimal_text(5000.00009, rounding="ROUND_FLOOR") == "5000.0"
    assert cedar.decimal_text(10**30) == "922337203685477.5807"


# ----------------------------------------------------------------------------- the CLI


def test_policy_export_writes_cedar_that_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import starter

    out = tmp_path / "billing.cedar"
    assert starter.main(["policy", "export", str(ROOT / "examples/billing/policy.toml"), "--out", str(out)]) == 0
    assert '@id("default.four_eyes")' in out.read_text() and '@id("acme.tools")' in out.read_text()
    assert starter.main(["policy", "validate", str(out)]) == 0
    assert "Cedar policies, valid against the schema" in capsys.readouterr().out
    # (the image's copy: the example's signed tenant names key files only `make demo` makes)
    assert starter.main(["policy", "validate", str(ROOT / "examples/billing/policy.image.toml")]) == 0


def test_policy_validate_refuses_what_the_worker_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 58: `tether policy validate` passed a file the worker refused (a key file it cannot
    read, relative to the policy file; `four_eyes = "yes"`). One check for both now: the same
    problems, the same lines, from both."""
    import starter
    from tether.policy.files import check_policy_file
    from tether.tools.sdk import REGISTRY

    folder = tmp_path / "conf"
    (folder / "keys").mkdir(parents=True)
    policy = folder / "policy.toml"
    text = ('[tenants.default]\ntools = ["get_order", "issue_refund"]\nfour_eyes = "yes"\n\n'
            '[tenants.default.auto_approve]\nread_only = 1\n\n'
            '[tenants.default.approvers.bob]\nroles = ["approver"]\npublic_key_file = "keys/bob.pub"\n')
    policy.write_text(text)
    assert starter.main(["policy", "validate", str(policy)]) == 2
    shown = capsys.readouterr().err
    worker = check_policy_file(policy, REGISTRY.tools)
    assert worker and all(line in shown for line in worker), (worker, shown)
    assert f"{policy}: line 3, key tenants.default.four_eyes: must be true or false" in shown and "'yes'" in shown
    assert "key tenants.default.auto_approve.read_only: must be true or false" in shown
    assert f"cannot read {folder / 'keys/bob.pub'}" in shown and "relative path is read from the policy file's folder" in shown
    # Fixed, both accept it: the key file found beside the policy file, whatever the caller's folder.
    from tether.store.keys import genkey  # noqa: F401 (the fleet ring's; an approver's key is `tether keygen`)

    assert starter.main(["keygen", "--out", str(folder / "keys/bob.pem")]) == 0
    (folder / "keys/bob.pem.pub").rename(folder / "keys/bob.pub")
    policy.write_text(text.replace('"yes"', "true").replace("= 1", "= true"))
    capsys.readouterr()
    assert starter.main(["policy", "validate", str(policy)]) == 0, capsys.readouterr().err
    assert check_policy_file(policy, REGISTRY.tools) == []


def test_policy_validate_names_file_line_and_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import starter

    bad = tmp_path / "bad.cedar"
    bad.write_text(
        '// a comment; with a semicolon\n'
        '@id("ok")\npermit (principal, action in Tether::Action::"approve", resource is Tether::Run)\n'
        'when { resource.tenant == Tether::Tenant::"x;y" };\n\n'
        '@id("typo")\nforbid (principal, action in Tether::Action::"revise", resource is Tether::Run)\n'
        'when { resource.requestor.skeleton == principal.skeleton };\n'
        '@id("launch")\npermit (principal, action in Tether::Action::"launch", resource);\n'
        '@id("types")\nforbid (principal, action in Tether::Action::"approve", resource is Tether::Run)\n'
        'when { resource.stage == "2" };\n'
    )
    assert starter.main(["policy", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: line 6, policy typo: attribute `requestor` on entity type `Tether::Run` not found" in err
    assert f'{bad}: line 9, policy launch: unrecognized action `Tether::Action::"launch"`' in err
    assert f"{bad}: line 11, policy types: the types Long and String are not compatible" in err
    bad.write_text('@id("a")\npermit (principal, action, resource);\n@id("b")\nforbid (principal action, resource);\n')
    assert starter.main(["policy", "validate", str(bad)]) == 2
    assert f"{bad}: line 3: unexpected token `action`" in capsys.readouterr().err


def test_a_tenants_own_cedar_files_are_checked_at_start(tmp_path: Path) -> None:
    """The worker and the inbox load the file through PolicyStore: a bad Cedar file stops them,
    naming its line; a good one decides for its tenant and is part of the policy hash."""
    from tether.policy.files import check_policy_file, PolicyFileError, PolicyStore

    toml = tmp_path / "policy.toml"
    toml.write_text('[tenants.default]\ncedar = ["default.cedar"]\n[tenants.default.approvers]\nbob = {}\n')
    own = tmp_path / "default.cedar"
    own.write_text('@id("open")\npermit (principal, action in Tether::Action::"approve", resource)\nwhen { resource.risk == 1 };\n')
    with pytest.raises(PolicyFileError, match=r"default.cedar: line 1, policy open: the types"):
        PolicyStore(toml).load()
    assert any("line 1, policy open" in p for p in check_policy_file(toml, []))
    own.write_text('@id("open")\npermit (principal, action in Tether::Action::"approve", resource);\n')
    store = PolicyStore(toml)
    tenant, policies, digest = store.policies("default")
    assert policies is not None and list(policies.ids.values()) == ["open"]
    j = cedar.judge_person(policies, "default", tenant, action="approve", person="alice", requested_by="alice")
    assert (j.allowed, j.policies) == (True, ("open",))  # this tenant's own rules: no four-eyes
    own.write_text('@id("closed")\nforbid (principal, action, resource);\n')
    assert store.policies("default")[2] != digest  # an edit to a Cedar file is a new policy


# ----------------------------------------------------------------------------- recorded runs

async def test_what_if_on_recorded_runs_lists_exactly_the_decisions_that_change(
    ts_env: Any, billing: Any, tmp_path: Path, audit_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import starter
    from tether.cli.output import format_status, format_timeline

    def cli(argv: list[str]) -> Any:  # the CLI runs its own event loop: in a thread of its own
        return asyncio.to_thread(starter.main, argv)

    from tether.policy.judgements import log_from_env
    from activities.policy_checks import PolicyActivities
    from tether.policy.files import PolicyStore
    from tether.client import run_outcome
    from tests.helpers.runs import approval_for, make_request, running_worker, start_run
    from tests.helpers.waiting import wait_for_state

    live = tmp_path / "policy.toml"
    live.write_text(RECORDED_POLICY % 5000)  # refunds up to 50.00 need nobody
    store = PolicyStore.from_env(str(live))
    judged_dir = tmp_path / "judged"  # this test's judgements only (the session's sink has others')
    rules = PolicyActivities(store, judgement_log=log_from_env(str(judged_dir)))
    async with running_worker(ts_env.client, policy=store, rules=rules) as worker:
        forty = await start_run(ts_env.client, worker, make_request([refund_step(4000)], requested_by="alice"))
        ten = await start_run(ts_env.client, worker, make_request([refund_step(1000)], requested_by="alice"))
        sixty = await start_run(ts_env.client, worker, make_request([refund_step(6000)], requested_by="alice"))
        snap = await wait_for_state(sixty, "AWAITING_APPROVAL")
        await sixty.signal("approve", approval_for(snap, "bob"))
        for handle in (forty, ten, sixty):
            await run_outcome(handle)
        import tether.client as tether_client

        status = await tether_client.status(ts_env.client, sixty.id, live=True)
        timeline = await tether_client.full_timeline(ts_env.client, sixty.id, str(audit_dir))
    # Records and `tether status` name the policies that decided (audit by reference).
    assert "[policies: default.decide]" in format_status(status)
    assert "policies=default.decide" in format_timeline(timeline)
    ours = {forty.id, ten.id, sixty.id}
    logged = log_from_env(str(judged_dir)).read()
    assert {e["workflow_id"] for e in logged} == ours
    assert {(e["workflow_id"], e["action"]) for e in logged} >= {
        (forty.id, "auto_approve"), (forty.id, "execute_write"), (ten.id, "auto_approve"),
        (sixty.id, "approve"), (sixty.id, "execute_write"),
    }
    # At planning time the 60.00 refund needed a person (Cedar's auto_approve refused, on the log:
    # what-if sees a limit raised over it); everything else was allowed.
    refused = [(e["workflow_id"], e["action"], e["check"]) for e in logged if not e["allowed"]]
    assert refused == [(sixty.id, "auto_approve", "plan")], refused
    # explain: the policies that decided each judgement, and the entity data.
    capsys.readouterr()
    assert await cli(["policy", "explain", sixty.id, "--audit-dir", str(judged_dir)]) == 0
    out = capsys.readouterr().out
    assert "decision approve by bob: allowed by default.decide" in out
    assert 'Tether::Person::"bob" skeleton=bob; in Tenant:default, Role:approver' in out
    assert "requester=alice revised_by=[] risk=normal roles=[approver]" in out
    assert "plan execute_write issue_refund (step 1): allowed by default.write" in out
    assert "amounts amount_cents=6000.0" in out

    async def what_if(policy: Path) -> tuple[int, list[str]]:
        capsys.readouterr()
        code = await cli(["policy", "what-if", str(policy), "--audit-dir", str(judged_dir)])
        lines = capsys.readouterr().out.splitlines()
        assert lines[-1].endswith(f"judgement(s) of 3 run(s) change under {policy}"), lines
        return code, lines[:-1]

    # The limit lowered to 20.00: the 40.00 refund's auto-approvals would need a person; nothing else.
    tighter = tmp_path / "tighter.toml"
    tighter.write_text(RECORDED_POLICY % 2000)
    code, changed = await what_if(tighter)
    forty_auto = [e for e in logged if (e["workflow_id"], e["action"]) == (forty.id, "auto_approve")]
    assert code == 1 and len(changed) == len(forty_auto) >= 1, changed
    assert all(line.startswith(f"{forty.id} ") and "auto_approve step 1 (issue_refund amount_cents=4000.0): allowed -> "
               "refused (approval_needed)" in line
               and "an auto-approval that would need a person" in line for line in changed), changed
    # The limit raised to 100.00 (loosening): the 60.00 refund bob had to approve would need nobody.
    looser = tmp_path / "looser.toml"
    looser.write_text(RECORDED_POLICY % 10000)
    code, changed = await what_if(looser)
    assert code == 1 and len(changed) == 1 and changed[0].startswith(f"{sixty.id} "), changed
    assert "auto_approve" in changed[0] and "would need nobody" in changed[0], changed
    # The same policy changes nothing.
    code, changed = await what_if(live)
    assert (code, changed) == (0, [])
    # A Cedar file: four-eyes widened to bob approving anything (the live rules, plus one forbid).
    proposal = tmp_path / "proposal.cedar"
    proposal.write_text(cedar.export_tenant("default", parse_policy(live.read_text()).tenants["default"])
                        + '\n@id("default.not_bob")\nforbid (principal == Tether::Person::"bob", '
                        'action in Tether::Action::"approve", resource);\n')
    code, changed = await what_if(proposal)
    # bob's approval: the decision, and its judgement again before each write (plan, attempt).
    bobs = [e for e in logged if (e["workflow_id"], e["action"], e.get("person", "bob")) == (sixty.id, "approve", "bob")]
    assert code == 1 and len(changed) == len(bobs) >= 2 and all(c.startswith(f"{sixty.id} ") for c in changed), changed
    assert [c.split(" ", 3)[2] for c in changed] == [e["check"] for e in bobs] and bobs[0]["check"] == "decision"
    assert all("approve by bob: allowed -> refused (default.not_bob) by default.not_bob" in c
               and "the run would have needed another approver" in c for c in changed), changed
    # An invalid proposal: exit 2, naming the line.
    proposal.write_text('@id("x")\npermit (principal, action in Tether::Action::"launch", resource);\n')
    capsys.readouterr()
    assert await cli(["policy", "what-if", str(proposal), "--audit-dir", str(judged_dir)]) == 2
    assert "line 1, policy x: unrecognized action" in capsys.readouterr().err


def test_the_action_groups_are_the_schemas() -> None:
    """Evaluation skips the schema (its cost per call): the action groups it would add are given."""
    import re

    groups = re.findall(r"action (\w+) in \[(\w+)\]", cedar.schema_text())
    assert [(g["uid"]["id"], g["parents"][0]["id"]) for g in cedar.ACTION_GROUPS] == groups
    assert set(re.findall(r"action (\w+)", cedar.schema_text())) == set(cedar.ACTIONS)


def test_the_policy_bench_prints_both_engines(capsys: pytest.CaptureFixture[str]) -> None:
    """`make bench-policy` runs and prints its table (tiny parameters; never timings)."""
    from bench import policy as bench_policy

    bench_policy.main(["--decisions", "20", "--policy", str(ROOT / "examples/billing/policy.toml")])
    out = capsys.readouterr().out
    labels = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "decision " not in line[:12]]
    assert labels == ["decision: TOML rules", "decision: Cedar, uncached", "decision: Cedar",
                      "decision: the activity's (lookup, Cedar, wording)", "pre-write check, 3 steps: TOML rules",
                      "pre-write check, 3 steps: Cedar, uncached", "pre-write check, 3 steps: the activity's (Cedar)"], out
    assert "CPU p99 µs" in out


async def test_a_shadow_policy_is_judged_beside_the_live_one_and_enforces_nothing(
    ts_env: Any, billing: Any, tmp_path: Path, audit_dir: Path
) -> None:
    """A tighter shadow (refunds up to 20.00) on a live policy (up to 50.00): a 40.00 refund
    still runs without a person; its auto-approvals' disagreements are logged and counted."""
    from tether.policy.judgements import ProposedPolicy, log_from_env
    from activities.policy_checks import PolicyActivities
    from tether.policy.files import PolicyStore
    from tether.client import run_outcome
    from tests.helpers.runs import make_request, running_worker, start_run

    live = tmp_path / "policy.toml"
    live.write_text(RECORDED_POLICY % 5000)
    shadow = tmp_path / "shadow.toml"
    shadow.write_text(RECORDED_POLICY % 2000)
    store = PolicyStore.from_env(str(live))
    rules = PolicyActivities(store, shadow=ProposedPolicy(shadow))
    async with running_worker(ts_env.client, policy=store, rules=rules) as worker:
        forty = await start_run(ts_env.client, worker, make_request([refund_step(4000)], requested_by="alice"))
        outcome = await run_outcome(forty)
    assert all(r.to_state.value != "AWAITING_APPROVAL" for r in outcome.timeline)  # enforced nothing
    logged = [e for e in log_from_env(str(audit_dir)).read() if e["workflow_id"] == forty.id]
    disagreeing = [e for e in logged if not e["shadow"]["agrees"]]
    assert disagreeing and all(e["action"] == "auto_approve" and e["allowed"] for e in disagreeing)
    assert all(e["shadow"] == {"allowed": False, "rule": "approval_needed", "policies": [], "agrees": False}
               for e in disagreeing)
    assert all(e["shadow"]["agrees"] for e in logged if e["action"] == "execute_write")
    assert rules.shadow_disagreements == {"auto_approve": len(disagreeing)}
    # An invalid shadow policy stops the worker at start, naming the line.
    shadow.write_text("[tenants.default]\nfour_eyes = 3\n")
    with pytest.raises(ValueError, match="line 2, key tenants.default.four_eyes"):
        ProposedPolicy(shadow)


async def test_a_handoff_names_the_policies_that_let_it_through(ts_env: Any, billing: Any, tmp_path: Path) -> None:
    from tether.policy.files import PolicyStore
    from tether.client import run_outcome
    from tests.helpers.runs import make_request, running_worker, start_run
    from tests.helpers.waiting import wait_for_state
    from workflows.contract import HandoffRequest

    live = tmp_path / "policy.toml"
    live.write_text(RECORDED_POLICY % 5000)
    async with running_worker(ts_env.client, policy=PolicyStore.from_env(str(live))) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund_step(6000)], requested_by="alice"))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("handoff", HandoffRequest(by="bob", reason="a person takes it", decision_id="h-1"))
        outcome = await run_outcome(handle)
    handed = next(r for r in outcome.timeline if r.to_state.value == "HANDED_OFF")
    assert (handed.refs.decision_id, handed.refs.policies) == ("h-1", ["default.decide"])


def test_what_if_reads_the_log_since_and_for_a_tenant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--since and --tenant choose the judgements; a retried activity's lines count once; none
    logged is no change (exit 0), saying where it looked."""
    import starter
    from tether.policy.judgements import JsonlJudgementLog, entries

    tenant = parse_policy(RECORDED_POLICY % 5000).tenants["default"]
    policies = cedar.policies_for("default", tenant)
    judged = [cedar.judge_person(policies, "default", tenant, action="approve", person="bob", requested_by="alice",
                                 roles=["approver"])]
    log = JsonlJudgementLog(tmp_path)
    old = datetime.now(timezone.utc) - timedelta(days=10)
    for at, name, run in [(old, "default", "old"), (datetime.now(timezone.utc), "default", "new"),
                          (datetime.now(timezone.utc), "acme", "other"), (datetime.now(timezone.utc), "default", "new")]:
        log.write(signed_lines(entries(judged, at=at.isoformat(), tenant=name, workflow_id=run, run_id="r",
                                       activity_id="1", check="decision")))
    assert sorted(e["workflow_id"] for e in log.read()) == ["new", "old", "other"]  # "new" written twice: once
    assert {e["workflow_id"] for e in log.read(since=datetime.now(timezone.utc) - timedelta(days=7))} == {"new", "other"}
    proposal = tmp_path / "proposal.cedar"
    proposal.write_text('@id("nobody")\nforbid (principal, action, resource);\n')
    assert starter.main(["policy", "what-if", str(proposal), "--since", "7d", "--tenant", "default",
                         "--audit-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("1 of 1 judgement(s) of 1 run(s) change under"), out
    assert "new " in out and "decision approve by bob: allowed -> refused (nobody) by nobody" in out
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "judgements.jsonl").write_text("")
    assert starter.main(["policy", "what-if", str(proposal), "--audit-dir", str(tmp_path / "empty")]) == 0
    assert "0 of 0 judgement(s) of 0 run(s) change" in capsys.readouterr().out
    # No log there at all: "could not read the log" (4), not "no change" (0) nor "invalid" (2).
    assert starter.main(["policy", "what-if", str(proposal), "--audit-dir", str(tmp_path / "none")]) == 4
    assert starter.main(["policy", "what-if", str(proposal), "--since", "soon", "--audit-dir", str(tmp_path)]) == 2


def test_the_judgement_log_in_postgres_is_read_like_the_json_lines(
    postgres: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With TETHER_AUDIT_DSN the judgements go where the records go (table tether_judgements):
    a retried activity's row is its last attempt's; explain and what-if read it."""
    import starter
    from tether.policy.judgements import PostgresJudgementLog, entries, log_from_env

    monkeypatch.setenv("TETHER_AUDIT_DSN", postgres)
    log = log_from_env()
    assert isinstance(log, PostgresJudgementLog) and "tether_judgements" in log.describe()
    tenant = parse_policy(RECORDED_POLICY % 5000).tenants["default"]
    policies = cedar.policies_for("default", tenant)
    judged = [cedar.judge_person(policies, "default", tenant, action="approve", person="bob", requested_by="alice",
                                 roles=["approver"])]
    run = f"pg-{tmp_path.name}"
    now = datetime.now(timezone.utc)
    for at, name, ident in [(now - timedelta(days=10), "default", f"{run}-old"), (now, "default", run),
                            (now, "default", run), (now, "acme", f"{run}-acme")]:
        log.write(signed_lines(entries(judged, at=at.isoformat(), tenant=name, workflow_id=ident, run_id="r",
                                       activity_id="1", check="decision")))
    mine = [e for e in log.read() if e["workflow_id"].startswith(run)]
    assert sorted(e["workflow_id"] for e in mine) == sorted([run, f"{run}-old", f"{run}-acme"])
    assert [e["workflow_id"] for e in log.read(since=now - timedelta(days=7), tenant="default") if e["workflow_id"].startswith(run)] == [run]
    assert starter.main(["policy", "explain", run]) == 0
    assert "decision approve by bob: allowed by default.decide" in capsys.readouterr().out
    proposal = tmp_path / "proposal.cedar"
    proposal.write_text('@id("nobody")\nforbid (principal, action, resource);\n')
    assert starter.main(["policy", "what-if", str(proposal), "--since", "7d", "--tenant", "acme"]) == 1
    out = capsys.readouterr().out
    assert f"{run}-acme " in out and f"{run} " not in out.replace(f"{run}-acme ", "")


def _validate(path: Path) -> subprocess.CompletedProcess:
    """`tether policy validate` in a process of its own: a parser that overflows its stack kills
    the process (SIGSEGV), which must never be the test's own."""
    from tests.helpers.paths import BIN

    return subprocess.run([str(BIN / "tether"), "policy", "validate", str(path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_a_deeply_nested_condition_is_one_line_of_problem_not_a_crash(tmp_path: Path) -> None:
    """Issue 43's finding: 2,000 nested parentheses (4 KB) overflowed the Rust parser's stack in
    every process that read the file. Bounded before any parser sees it."""
    path = tmp_path / "nested.cedar"
    path.write_text('@id("deep")\npermit(principal, action, resource)\nwhen { ' + "(" * 2000 + "true" + ")" * 2000 + " };\n")
    done = _validate(path)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    first = done.stderr.splitlines()[0]
    assert str(path) in first and "line 3" in first and f"deeper than {cedar.MAX_NESTING}" in first, done.stderr
    with pytest.raises(ValueError, match="deeper than"):
        cedar.Policies.from_text(path.read_text())
    # As deep as people write is fine.
    path.write_text('permit(principal, action, resource) when { ' + "(" * 20 + "true" + ")" * 20 + " };\n")
    assert _validate(path).returncode == 0


def test_a_valid_deny_list_of_500_terms_loads_and_judges(tmp_path: Path) -> None:
    """Issue 43's finding: the policy's JSON form of a 500-term `||` chain is deeper than Python's
    recursion limit, so a valid file could not be loaded. Ids are read from the text now."""
    people = [f"p{i}" for i in range(500)]
    text = ('@id("deny-list")\nforbid(principal, action, resource) when { '
            + " || ".join(f'principal == Tether::Person::"{p}"' for p in people) + " };\n"
            + '@id("everyone")\npermit(principal, action, resource);\n')
    path = tmp_path / "deny.cedar"
    path.write_text(text)
    done = _validate(path)
    assert done.returncode == 0, done.stderr
    policies = cedar.Policies.from_text(text)
    assert sorted(policies.ids.values()) == ["deny-list", "everyone"]
    request = {"principal": 'Tether::Person::"p499"', "action": 'Tether::Action::"approve"',
               "resource": 'Tether::Run::"r"', "context": {}}
    result = cedarpy.is_authorized(request, policies.policy_set, "[]")
    assert result.decision == cedarpy.Decision.Deny


# ----------------------------------------------------------------------------- caches


def uncached_person(tenant_name: str, tenant: TenantPolicy, action: str, person: str, requested_by: str,
                    **run: Any) -> cedar.Judgement:
    """A person's decision judged as before any cache: the policy text parsed, the entities whole."""
    policies = cedar.Policies.from_text(cedar.export_tenant(tenant_name, tenant))
    entities = cedar.run_entities(tenant_name, tenant, person=person, requested_by=requested_by, **run)
    return cedar.judge_request(policies, cedar.person_request(action, person), entities, tenant)


def same(a: cedar.Judgement, b: cedar.Judgement) -> bool:
    """Two judgements say and record the same: verdict, policies, rule, errors, request, entities."""
    return (a.allowed, a.policies, a.rule, a.errors, a.request, a.entities) == (
        b.allowed, b.policies, b.rule, b.errors, b.request, b.entities)


def test_the_cached_path_judges_as_the_uncached_one() -> None:
    """Each decision judged by the caches (parsed policy sets, people and plans parsed once per
    tenant version, the run's entities added, only the policies that can apply to its actions)
    equals the same judged with nothing cached and by every policy: verdict, deciding policies,
    rule, errors, and the request and entities it records."""
    rng = random.Random(SEED + 1)
    billing = ["get_order", "issue_refund", "post_ledger_entry", "send_email", "void_refund"]
    tenants = [(name, t) for _, name, t in example_tenants()] + [(f"t{i}", random_tenant(rng, billing)) for i in range(40)]
    compared = 0
    for name, tenant in tenants:
        policies = cedar.policies_for(name, tenant)
        people, tools = names_of(tenant), list(tenant.tools or billing)
        for _ in range(25):
            person, requester = rng.choice(people), rng.choice(people)
            run = dict(roles=rng.sample(ROLES, rng.randint(0, 3)), already_approved=rng.sample(people, rng.randint(0, 2)),
                       editors=rng.sample(people, rng.randint(0, 2)), risk=rng.choice(["none", "normal", "high"]),
                       stage=rng.randint(0, 2))
            action = rng.choice(cedar.PERSON_ACTIONS)
            cached = cedar.judge_person(policies, name, tenant, action=action, person=person, requested_by=requester, **run)
            whole = uncached_person(name, tenant, action, person, requester, **run)
            assert same(cached, whole), (cached, whole)
            catalog = random_catalog(rng, tools)
            steps = [PlanStep(tool_call_id=f"s{i}", tool=rng.choice(tools + ["unknown_tool"]),
                              args={"amount_cents": rng.choice(AMOUNTS)}) for i in range(rng.randint(1, 4))]
            spent = {f"{rng.choice(tools)}.amount_cents": rng.choice(AMOUNTS)} if rng.random() < 0.4 else {}
            writes = [i for i in range(1, len(steps) + 1) if rng.random() < 0.7]
            cached_steps = cedar.judge_steps(policies, name, tenant, actions=list(cedar.STEP_ACTIONS), steps=steps,
                                             catalog=catalog, spent=spent, risk="normal", writes=writes)
            whole = cedar.judge_requests(
                cedar.Policies.from_text(cedar.export_tenant(name, tenant)),
                cedar.step_requests(cedar.STEP_ACTIONS, len(steps), writes),
                cedar.step_entities(name, steps, catalog, spent=spent, risk="normal"), tenant)
            assert len(cached_steps) == len(whole)
            for a, b in zip(cached_steps, whole):
                assert same(a, b), (a, b)
            compared += 1 + len(whole)
    assert compared > 2_000


def test_an_erroring_policy_reports_the_same_errors_cached_and_not() -> None:
    """A tenant's own policy that errors at evaluation (a Long overflow, issue 43): the errors the
    engine reports, and which policy they name, are the same on the cached path."""
    text = ('@id("overflow")\nforbid (principal, action, resource) when { resource.stage * 9223372036854775807 > 1 };\n'
            '@id("everyone")\npermit (principal, action, resource);\n')
    tenant = TenantPolicy(approvers=None)
    cached = cedar.judge_person(cedar.policies_of("default", tenant, text), "default", tenant, action="approve",
                                person="bob", requested_by="alice", stage=2)
    entities = cedar.run_entities("default", tenant, person="bob", requested_by="alice", stage=2)
    whole = cedar.judge_request(cedar.Policies.from_text(text), cedar.person_request("approve", "bob"), entities, tenant)
    assert same(cached, whole), (cached, whole)
    assert cached.errors and "policy0" in cached.errors[0], cached.errors


def test_a_changed_policy_file_gives_the_new_answer_at_once(tmp_path: Path) -> None:
    """An edit to a tenant's Cedar file, or to its TOML rules (exported, and who holds which role),
    is a new content hash: the very next decision is judged by the new policy, nothing stale."""
    import os

    from tether.policy.files import PolicyStore

    toml, own = tmp_path / "policy.toml", tmp_path / "own.cedar"
    toml.write_text('[tenants.own]\ncedar = ["own.cedar"]\n[tenants.own.approvers]\nbob = { roles = ["approver"] }\n'
                    '[tenants.rules]\n[tenants.rules.approvers]\nbob = { roles = ["approver"] }\n')
    own.write_text('@id("open")\npermit (principal, action, resource);\n')
    store = PolicyStore(toml)
    stamp = [1_700_000_000_000_000_000]

    def edit(path: Path, text: str) -> None:
        path.write_text(text)
        stamp[0] += 10**9  # a new modification time, whatever the file system's clock resolution
        os.utime(path, ns=(stamp[0], stamp[0]))

    def judge(name: str, **run: Any) -> tuple[bool, str | None, tuple[str, ...], str]:
        tenant, policies, digest = store.policies(name)
        j = cedar.judge_person(policies, name, tenant, action="approve", person="bob", requested_by="alice", **run)
        return j.allowed, j.rule, j.policies, digest

    first = judge("own")
    assert first[:3] == (True, None, ("open",))
    edit(own, '@id("closed")\nforbid (principal, action, resource);\n@id("open")\npermit (principal, action, resource);\n')
    second = judge("own")
    assert second[:3] == (False, "closed", ("closed",)) and second[3] != first[3]
    edit(own, '@id("open")\npermit (principal, action, resource);\n')
    assert judge("own")[:3] == first[:3]  # back to the first text: its answer again

    assert judge("rules", roles=["approver"])[:2] == (True, None)
    # bob loses the role: the person's entity (cached per tenant version) is the new one.
    edit(toml, toml.read_text().replace('[tenants.rules.approvers]\nbob = { roles = ["approver"] }',
                                        '[tenants.rules.approvers]\nbob = { roles = ["support"] }'))
    assert judge("rules", roles=["approver"])[:2] == (False, "role")
    # four_eyes off: alice may approve her own run (an exported rule of the new version).
    edit(toml, toml.read_text().replace("[tenants.rules]\n", "[tenants.rules]\nfour_eyes = false\n")
         .replace('bob = { roles = ["support"] }', 'bob = { roles = ["approver"] }\nalice = { roles = ["approver"] }'))
    tenant, policies, _ = store.policies("rules")
    mine = cedar.judge_person(policies, "rules", tenant, action="approve", person="alice", requested_by="alice",
                              roles=["approver"])
    assert (mine.allowed, mine.rule) == (True, None)


def test_a_tenant_at_a_freed_ones_address_is_not_taken_for_it() -> None:
    """The tenant's hash is remembered by the object's identity: a new TenantPolicy at the address
    of a freed one (CPython reuses them) is hashed afresh, never judged by the old one's rules."""
    addresses: set[int] = set()
    for i in range(200):
        four_eyes = i % 2 == 0
        tenant = TenantPolicy(four_eyes=four_eyes)
        addresses.add(id(tenant))
        j = cedar.judge_person(cedar.policies_for("t", tenant), "t", tenant, action="approve", person="alice",
                               requested_by="alice", roles=["approver"])
        assert (j.allowed, j.rule) == ((False, "four_eyes") if four_eyes else (True, None)), i
        del tenant, j
    assert len(addresses) < 200  # the hostile case happened: addresses were reused


def cache_sizes() -> dict[str, tuple[int, int]]:
    """Each cache of tether/policy/cedar.py: (entries, bound)."""
    info = cedar._skeleton.cache_info()
    return {
        "policy sets": (len(cedar.POLICY_SETS), cedar.POLICY_SETS.size),
        "text digests": (len(cedar._TEXT_DIGESTS), cedar._TEXT_DIGESTS.size),
        "tenant keys": (len(cedar._TENANT_KEYS), cedar._TENANT_KEYS.size),
        "people": (len(cedar._PEOPLE), cedar._PEOPLE.size),
        "entity bases": (len(cedar._BASES), cedar._BASES.size),
        "skeletons": (info.currsize, info.maxsize or 0),
    }


def test_many_distinct_policies_and_people_do_not_grow_the_caches_without_bound() -> None:
    """Hostile: a stream of distinct policy versions (each a new hash: tenants' rules and Cedar
    texts) and of distinct people. Every cache stays within its bound, and an evicted policy,
    asked again, is parsed again and answers as before."""
    first = TenantPolicy(tools=["t0"], approvers={"bob": Approver(roles=["approver"])})
    before = cedar.judge_person(cedar.policies_for("x", first), "x", first, action="approve", person="bob",
                                requested_by="alice", roles=["approver"])
    tenants = []
    for i in range(cedar.POLICY_SETS.size * 3):
        tenant = TenantPolicy(tools=[f"t{i}"], approvers={f"p{i}": Approver(roles=["approver"])})
        tenants.append(tenant)  # alive: none of their identities is freed and reused
        text = f'@id("v{i}")\npermit (principal, action, resource) when {{ resource.stage == {i} }};\n'
        for name in (f"p{i}", f"q{i}", "bob"):
            cedar.judge_person(cedar.policies_for("x", tenant), "x", tenant, action="approve", person=name,
                               requested_by=f"r{i}", roles=["approver"])
            cedar.judge_person(cedar.policies_of("x", tenant, text), "x", tenant, action="approve", person=name,
                               requested_by=f"r{i}", stage=i)
        steps = [PlanStep(tool_call_id=f"s{k}", tool=f"t{i}", args={}) for k in range(1 + i % 40)]
        cedar.judge_steps(cedar.policies_for("x", tenant), "x", tenant, actions=["execute_write"], steps=steps,
                          catalog=ToolCatalog())
    for i in range(5000):
        cedar.judge_person(cedar.policies_for("x", first), "x", first, action="approve", person=f"someone{i}",
                           requested_by=f"else{i}", already_approved=[f"a{i}"], editors=[f"e{i}"])
    huge = "permit (principal, action, resource);\n" * (cedar.MAX_POLICY_BYTES // 30)
    for _ in range(3):
        with pytest.raises(ValueError, match="bytes"):
            cedar.policies_of("x", first, huge)
    assert all(text is not huge for text in cedar._TEXT_DIGESTS._items)  # an oversized text is never a key
    sizes = cache_sizes()
    assert all(n <= bound for n, bound in sizes.values()), sizes
    assert sizes["policy sets"][0] == cedar.POLICY_SETS.size and sizes["skeletons"][0] == sizes["skeletons"][1], sizes
    again = cedar.judge_person(cedar.policies_for("x", first), "x", first, action="approve", person="bob",
                               requested_by="alice", roles=["approver"])
    assert same(again, before), (again, before)


def test_threads_judging_at_once_through_small_caches_agree_with_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker judges in several threads: with caches small enough to evict all the time,
    judgements made concurrently equal the same made one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    for lru in (cedar.POLICY_SETS, cedar._TENANT_KEYS, cedar._PEOPLE, cedar._BASES):
        monkeypatch.setattr(lru, "size", 3)
    rng = random.Random(SEED + 2)
    billing = ["get_order", "issue_refund", "send_email"]
    tenants = [(f"t{i}", random_tenant(rng, billing)) for i in range(12)]
    cases = []
    for k in range(600):
        name, tenant = tenants[k % len(tenants)]
        people = names_of(tenant)
        cases.append((name, tenant, rng.choice(["approve", "reject", "compensate"]), rng.choice(people),
                      rng.choice(people), rng.sample(ROLES, 2)))

    def judge(case: tuple[Any, ...]) -> tuple[bool, str | None, tuple[str, ...]]:
        name, tenant, action, person, requester, roles = case
        j = cedar.judge_person(cedar.policies_for(name, tenant), name, tenant, action=action, person=person,
                               requested_by=requester, roles=roles)
        return j.allowed, j.rule, j.policies

    alone = [judge(c) for c in cases]
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(judge, cases))
    assert together == alone
    assert all(len(lru) <= 3 for lru in (cedar.POLICY_SETS, cedar._TENANT_KEYS, cedar._PEOPLE, cedar._BASES))


SCOPES = """
@id("eq-approve") forbid (principal, action == Tether::Action::"approve", resource) when { resource.stage == 1 };
@id("in-approve") forbid (principal, action in Tether::Action::"approve", resource) when { resource.stage == 2 };
@id("in-list") forbid (principal, action in [Tether::Action::"reject", Tether::Action::"execute_write"], resource)
  when { resource has stage && resource.stage == 3 };
@id("any") forbid (principal, action, resource) when { resource has stage && resource.stage == 4 };
@id("errs") forbid (principal, action in Tether::Action::"approve_steps", resource)
  when { resource has stage && resource.stage * 9223372036854775807 > 9223372036854775807 };
@id("elsewhere") forbid (principal, action == Other::Action::"approve", resource);
@id("everyone") permit (principal, action, resource);
"""


@pytest.mark.parametrize("text", [SCOPES, "\n".join([
    '@id("deny-list") forbid (principal, action == Tether::Action::"approve", resource) when { '
    + " || ".join(f'principal == Tether::Person::"p{i}"' for i in range(500)) + " };",
    '@id("everyone") permit (principal, action, resource);']), "\n".join([
    *(f'@id("n{i}") forbid (principal, action == Tether::Action::"{cedar.PERSON_ACTIONS[i % 7]}", resource) '
      f'when {{ resource.stage == {i % 6} && principal == Tether::Person::"p499" }};' for i in range(cedar.SUBSET_MAX_POLICIES)),
    '@id("everyone") permit (principal, action, resource);'])], ids=["scopes", "deny-list-500", "many"])
def test_only_the_policies_an_action_can_meet_are_evaluated_with_the_same_answer(text: str) -> None:
    """Each action of the schema on each stage, judged by the policies whose scope admits it
    (`==` is that action alone, `in` its groups too: approve_steps is an approve; another
    namespace's action is none of ours) equals the judgement of the whole set, errors included.
    A set too deep for the engine's nodes (a 500-term deny list) is judged whole."""
    tenant = TenantPolicy(approvers=None)
    policies = cedar.policies_of("default", tenant, text)
    seen: Counter[str] = Counter()
    for action in cedar.PERSON_ACTIONS:
        for stage in range(6):
            for person in ("bob", "p499"):
                cached = cedar.judge_person(policies, "default", tenant, action=action, person=person,
                                            requested_by="alice", stage=stage)
                entities = cedar.run_entities("default", tenant, person=person, requested_by="alice", stage=stage)
                whole = cedar.judge_request(policies, cedar.person_request(action, person), entities, tenant)
                assert same(cached, whole), (cached, whole)
                seen[",".join(cached.policies) + ("!" if cached.errors else "")] += 1
    steps = [PlanStep(tool_call_id="s1", tool="x", args={})]
    for action in cedar.STEP_ACTIONS:
        [cached] = cedar.judge_steps(policies, "default", tenant, actions=[action], steps=steps, catalog=ToolCatalog())
        [whole] = cedar.judge_requests(policies, cedar.step_requests([action], 1),
                                       cedar.step_entities("default", steps, ToolCatalog()), tenant)
        assert same(cached, whole), (cached, whole)
    if text == SCOPES:
        # Each scope decided some of them, and only where Cedar says it applies.
        # An error where nothing else refuses: the erroring policy refuses (fails closed).
        assert {"eq-approve", "in-approve", "in-list", "any", "errs!"} <= set(seen), seen
        def verdict(action: str, stage: int) -> tuple[bool, tuple[str, ...], bool]:
            j = cedar.judge_person(policies, "default", tenant, action=action, person="bob", requested_by="alice",
                                   stage=stage)
            return j.allowed, j.policies, bool(j.errors)

        assert verdict("approve", 1) == (False, ("eq-approve",), False)
        assert verdict("approve_steps", 1) == (True, ("everyone",), False)  # `==` approve is approve alone
        assert verdict("approve_steps", 2) == (False, ("in-approve",), True)  # `in` approve: its group too
        assert verdict("reject", 3) == (False, ("in-list",), False)
        assert 0 < len(policies.for_actions(["approve"])) < len(policies.policy_set)
    elif text.startswith('@id("deny-list")'):
        assert seen["deny-list"] > 0 and policies.for_actions(["approve"]) is policies.policy_set
    else:  # more policies than are worth a subset: the whole set
        assert len(policies.ids) > cedar.SUBSET_MAX_POLICIES and policies.for_actions(["approve"]) is policies.policy_set
        assert sum(n for k, n in seen.items() if k.startswith("n")) > 0, seen


OVERFLOWING = ('@id("overflow")\nforbid (principal, action == Tether::Action::"approve", resource)\n'
               '  when { resource.stage * 9223372036854775807 > 1 };\n'
               '@id("everyone")\npermit (principal, action, resource);\n')


def test_a_forbid_that_overflows_is_a_validate_problem_and_refuses_live(tmp_path: Path) -> None:
    """Issue 43's finding: a forbid whose condition overflows a Long at evaluation passed
    `validate`, and Cedar skipped it, so the decision was allowed. `validate` now judges every
    policy on the inputs a run gives it and names one that errors (exit 2, one line); a condition
    that still errors live refuses (policy_error, naming the policy) instead of allowing."""
    path = tmp_path / "overflow.cedar"
    path.write_text(OVERFLOWING)
    done = _validate(path)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    first = done.stderr.splitlines()[0]
    assert str(path) in first and "line 1, policy overflow" in first and "integer overflow" in first, done.stderr
    # Live (a condition the samples did not meet): the erroring forbid refuses, it never allows.
    tenant = TenantPolicy(approvers=None)
    judged = cedar.judge_person(cedar.policies_of("default", tenant, OVERFLOWING), "default", tenant, action="approve",
                                person="bob", requested_by="alice", stage=2)
    assert (judged.allowed, judged.rule, judged.policies) == (False, "policy_error", ("overflow",)), judged
    from activities.policy_checks import cedar_refusal

    refusal = cedar_refusal(judged, None, "bob", "approve", "default")
    assert refusal is not None and refusal.rule == "policy_error" and "overflow errored" in refusal.message, refusal
    # Where it does not error (stage 0: no overflow, the forbid does not apply), as written.
    fine = cedar.judge_person(cedar.policies_of("default", tenant, OVERFLOWING), "default", tenant, action="approve",
                              person="bob", requested_by="alice", stage=0)
    assert fine.allowed and not fine.errors, fine
