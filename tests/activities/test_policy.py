"""The policy layer, through real signals on real runs (time-skipping server, real billing
service, a real policy file the worker re-reads)."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tether.policy.files import check_policy_file, parse_policy, PolicyFileError, PolicyStore
from tether.tools.sdk import REGISTRY
from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.paths import ROOT
from tests.helpers.queries import snapshot
from tests.helpers.runs import approval_for, cancel_and_settle, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from workflows import policy
from workflows.contract import ApprovalDecision, HandoffRequest
from workflows.run_state import RunSnapshot, RunOutcome
from workflows.states import TransitionRecord
from workflows.states import RunState, is_legal_path
from tests.helpers.signing import sign
from tests.helpers.policies import refund

S = RunState

POLICY = """
[tenants.default]
tools = ["get_order", "issue_refund", "post_ledger_entry", "send_email"]
approval_roles = ["approver"]
[tenants.default.approvers]
alice = {{ roles = ["approver"] }}
bob = {{ roles = ["approver"] }}
carol = {{ roles = ["approver", "finance"] }}
erin = {{ roles = ["finance"] }}
dana = {{ roles = ["support"] }}
frank = {{ roles = ["approver"], public_key = "{frank_key}" }}
[tenants.default.auto_approve]
limits = [{{ tool = "issue_refund", field = "amount_cents", max = 5000 }}]
[tenants.default.high_risk]
approvals = 2
roles = ["finance"]
when = [{{ tool = "issue_refund", field = "amount_cents", above = 50000 }}]
[tenants.default.approval_ttl_seconds]
high = 3600
[tenants.default.budgets]
max_tool_calls = {max_tool_calls}

[tenants.acme]
tools = ["get_order", "issue_refund"]
[tenants.acme.approvers]
gus = {{ roles = ["approver"] }}
"""

FRANK = Ed25519PrivateKey.generate()
FRANK_PUBLIC = base64.b64encode(
    FRANK.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
).decode()


GET = {"tool": "get_order", "args": {"order_id": "A-1001"}}


def write_policy(path: Path, **overrides: object) -> Path:
    values = {"frank_key": FRANK_PUBLIC, "max_tool_calls": 40, **overrides}
    path.write_text(POLICY.format(**values))
    return path


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    return write_policy(tmp_path / "policy.toml")


@asynccontextmanager
async def policy_worker(env: WorkflowEnvironment, path: Path) -> AsyncIterator[Worker]:
    async with running_worker(env.client, policy=PolicyStore.from_env(str(path))) as worker:
        yield worker


def decide(approver: str, target: RunSnapshot | str, decision_id: str | None = None, **kw: object) -> ApprovalDecision:
    return approval_for(target, approver, decision_id, **kw)


async def records_for(handle: WorkflowHandle, decision_id: str) -> list[TransitionRecord]:
    timeline = await handle.query("timeline", result_type=list[TransitionRecord])
    return [r for r in timeline if r.refs.decision_id == decision_id]


async def settled(handle: WorkflowHandle, decision_id: str) -> TransitionRecord:
    """The record the run made for a decision (decisions pass a policy activity first)."""
    import asyncio

    for _ in range(200):
        found = await records_for(handle, decision_id)
        if found:
            return found[-1]
        await asyncio.sleep(0.02)
    raise AssertionError(f"decision {decision_id} never settled")


async def test_each_approval_rule_refuses_and_accepts(ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path) -> None:
    async with policy_worker(ts_env, policy_file) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund(6000)], requested_by="alice"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        cases = [
            ("mallory", "tenant_membership", "not an approver of this tenant"),
            ("dana", "role", "needs one of ['approver']"),
            ("alice", "four_eyes", "requested this run and may not approve it"),
            ("frank", "signature_required", "must be signed"),
        ]
        for approver, rule, text in cases:
            decision = decide(approver, snap)
            await handle.signal("approve", decision)
            record = await settled(handle, decision.decision_id)
            assert record.kind == "refused" and record.rule == rule, record
            assert text in record.reason
            # The Cedar policies that decided it are on the record (a signature is no policy's).
            assert f"default.{rule}" in record.refs.policies if rule != "signature_required" else (
                record.refs.policies == ["default.decide"]
            ), record.refs
        bad = decide("frank", snap, signature=base64.b64encode(b"x" * 64).decode())
        await handle.signal("approve", bad)
        assert (await settled(handle, bad.decision_id)).rule == "bad_signature"
        after = await snapshot(handle)
        assert (after.state, after.state_version) == (S.AWAITING_APPROVAL, snap.state_version)
        # A valid signature over the run, its request and plan, the decision and its signer counts.
        good = decide("frank", snap)
        good.signature = sign(FRANK, handle.id, snap, "approve", good)
        await handle.signal("approve", good)
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED
    approved = next(r for r in outcome.timeline if r.to_state == S.APPROVED)
    assert approved.actor == "user:frank (signed)"
    assert approved.refs.policies == ["default.decide"]
    assert is_legal_path(outcome.timeline)


async def test_high_risk_needs_two_distinct_finance_approvers(
    ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path
) -> None:
    async with policy_worker(ts_env, policy_file) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund(60000, "A-9999")]))
        # A-9999 does not exist: nothing is refunded whatever happens.
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        pending = snap.pending_approval
        assert (pending.risk, pending.approvals_required, pending.roles) == ("high", 2, ["finance"])
        assert "HIGH RISK" in pending.summary and "amount_cents=600.00 EUR (60000)" in pending.summary
        assert (pending.expires_at - snap.updated_at).total_seconds() == pytest.approx(3600, abs=1)
        bob = decide("bob", snap)
        await handle.signal("approve", bob)
        assert (await settled(handle, bob.decision_id)).rule == "role"
        first = decide("carol", snap)
        await handle.signal("approve", first)
        assert (await settled(handle, first.decision_id)).kind == "accepted"
        middle = await snapshot(handle)
        assert middle.state == S.AWAITING_APPROVAL
        assert [a.approver for a in middle.pending_approval.approvals] == ["carol"]
        again = decide("carol", snap)
        await handle.signal("approve", again)
        assert (await settled(handle, again.decision_id)).rule == "distinct_approvers"
        await handle.signal("approve", decide("erin", snap))
        outcome = await run_outcome(handle)
    assert outcome.state == S.EXECUTION_FAILED  # the order does not exist: a permanent 404
    approved = next(r for r in outcome.timeline if r.to_state == S.APPROVED)
    assert approved.actor == "user:erin"


async def test_auto_approval_under_the_limit(ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path) -> None:
    async with policy_worker(ts_env, policy_file) as worker:
        small = await start_run(ts_env.client, worker, make_request([refund(4000)]))
        outcome = await run_outcome(small)
        large = await start_run(ts_env.client, worker, make_request([refund(5001)]))
        await wait_for_state(large, "AWAITING_APPROVAL")
        await cancel_and_settle(large)
    assert outcome.state == S.COMPLETED
    assert S.AWAITING_APPROVAL not in [r.to_state for r in outcome.timeline]


async def test_tenant_isolation(ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path) -> None:
    async with policy_worker(ts_env, policy_file) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund(6000)], tenant="acme", requested_by="zoe"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        for signal in ("approve", "reject"):
            d = decide("bob", snap, reason="no")
            await handle.signal(signal, d)
            record = await settled(handle, d.decision_id)
            assert record.rule == "tenant_membership" and record.reason.startswith(f"{signal} refused")
        await handle.signal("handoff", HandoffRequest(by="bob", reason="not mine"))
        await handle.signal("approve", decide("gus", snap))
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED
    handoffs = [r for r in outcome.timeline if r.reason.startswith("handoff refused")]
    assert len(handoffs) == 1 and handoffs[0].rule == "tenant_membership"


async def test_tool_withdrawn_after_approval_sends_the_run_back_to_approval(
    ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path
) -> None:
    async with policy_worker(ts_env, policy_file) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund(6000)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        # Withdraw the tool from the tenant while the plan waits; the approver still may approve.
        policy_file.write_text(policy_file.read_text().replace('"issue_refund", "post_ledger_entry"', '"post_ledger_entry"', 1))
        ok = decide("bob", snap)
        await handle.signal("approve", ok)
        # bob is on the run's roster: the approval is taken, and the write's tool worker (then the
        # policy activity) refuses it before the tool: back to approval from the step it entered.
        for _ in range(200):
            timeline = await handle.query("timeline", result_type=list[TransitionRecord])
            if any(r.from_state == S.EXECUTING_TOOL and r.to_state == S.AWAITING_APPROVAL for r in timeline):
                break
        else:
            raise AssertionError("the run did not go back to AWAITING_APPROVAL")
        back = next(r for r in timeline if r.from_state == S.EXECUTING_TOOL)
        assert "tool_withdrawn" in back.reason
        assert back.refs.policies == ["default.tools"]  # the Cedar policy that stopped the write
        assert billing.refunds(f"{handle.id}:{snap.plan.steps[0].tool_call_id}") == []
        current = await snapshot(handle)
        assert current.state == S.AWAITING_APPROVAL and current.pending_approval.approvals == []
        await cancel_and_settle(handle)


async def test_revoking_an_approver_between_approval_and_execution_stops_the_write(
    ts_env: WorkflowEnvironment, billing: Billing, policy_file: Path
) -> None:
    billing.fail_next("orders", 1, status=503)  # park the read step in RETRY_WAIT
    async with policy_worker(ts_env, policy_file) as worker:
        handle = await start_run(ts_env.client, worker, make_request([GET, refund(6000)]))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", decide("bob", snap))
        await wait_for_state(handle, "RETRY_WAIT")
        policy_file.write_text(policy_file.read_text().replace('bob = { roles = ["approver"] }', 'bob = { roles = ["retired"] }'))
        await ts_env.sleep(10)  # the backoff passes; the read step succeeds
        again = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert again != snap  # the remaining step, planned again
        timeline = await handle.query("timeline", result_type=list[TransitionRecord])
        stopped = next(r for r in timeline if "approver_revoked" in r.reason)
        assert stopped.from_state == S.OBSERVING_RESULT and "bob" in stopped.reason
        refund_ids = [s.tool_call_id for s in snap.plan.steps if s.tool == "issue_refund"]
        assert billing.refunds(f"{handle.id}:{refund_ids[0]}") == []
        await handle.signal("approve", decide("carol", again))
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED
    assert [s.tool for s in outcome.steps] == ["get_order", "issue_refund"]
    assert is_legal_path(outcome.timeline)


async def test_budgets_and_policy_hash_on_the_timeline(
    ts_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    path = write_policy(tmp_path / "p.toml", max_tool_calls=1)
    async with policy_worker(ts_env, path) as worker:
        handle = await start_run(ts_env.client, worker, make_request([GET, GET]))
        outcome: RunOutcome = await run_outcome(handle)
        stranger = await start_run(ts_env.client, worker, make_request([GET], tenant="nobody"))
        unknown: RunOutcome = await run_outcome(stranger)
    assert outcome.timeline[0].refs.policy_hash == hashlib.sha256(path.read_bytes()).hexdigest()
    # The record names the file by its hash and a short path, never the worker's absolute one.
    received = next(r for r in outcome.timeline if r.reason.startswith("run received; policy "))
    assert received.reason == f"run received; policy {path.parent.name}/p.toml" and str(tmp_path) not in received.reason
    assert outcome.state == S.EXECUTION_FAILED
    assert "tool call budget exhausted" in outcome.timeline[-1].reason
    assert [s.status for s in outcome.steps] == ["ok", "failed"]
    assert unknown.state == S.FAILED and "tenant 'nobody' is not in the policy file" in unknown.timeline[-1].reason


def test_the_recorded_policy_path_is_relative_to_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert PolicyStore(ROOT / "examples/billing/policy.toml").recorded_source == "examples/billing/policy.toml"
    assert PolicyStore(Path("examples/billing/policy.toml")).recorded_source == "examples/billing/policy.toml"


def test_default_policy_is_four_eyes_for_every_write() -> None:
    tenant = policy.DEFAULT_TENANT_POLICY
    kw = dict(requested_by="alice", kind="approve", roles=tenant.approval_roles, already_approved=[])
    assert policy.approver_refusal(tenant, approver="alice", **kw).rule == "four_eyes"
    assert policy.approver_refusal(tenant, approver="anyone", **kw) is None


def test_invalid_policy_names_line_and_key(tmp_path: Path) -> None:
    text = '[tenants.default]\ntools = ["get_order"]\n\n[tenants.default.approvers]\nbob = { roles = "approver" }\n'
    with pytest.raises(PolicyFileError, match=r"line 5, key tenants.default.approvers.bob.roles"):
        parse_policy(text, "p.toml")
    with pytest.raises(PolicyFileError, match=r"line 2.*key tenants.default.four_eye"):
        parse_policy("[tenants.default]\nfour_eye = true\n", "p.toml")
    with pytest.raises(PolicyFileError, match=r"not valid TOML.*line 1"):
        parse_policy("[tenants.default\n", "p.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    # The worker refuses to start, before it even connects, with a one-line reason.
    proc = subprocess.run(
        [sys.executable, "worker.py", "--policy", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "invalid policy" in proc.stderr and "line 5" in proc.stderr and "approvers.bob.roles" in proc.stderr


def test_example_policy_is_valid() -> None:
    document = parse_policy((ROOT / "examples/billing/policy.toml").read_text())
    assert document.tenants["default"].four_eyes
    assert "bob" in document.tenants["default"].approvers


WHOLE_FILE_PROBLEMS = """[tenants.default]
tools = ["get_order", "wire_money"]
approval_roles = ["approver", "cfo"]
[tenants.default.approvers]
bob = { roles = ["approver"], public_key = "bm90IGEga2V5" }
eve = { roles = ["approver"], public_key = "%%%" }
[tenants.ghost]
"""


def test_policy_checked_whole_against_the_workers_tools(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(WHOLE_FILE_PROBLEMS)
    problems = check_policy_file(path, REGISTRY.tools)
    expected = [
        ("line 2, key tenants.default.tools", "unknown tool 'wire_money'"),
        ("line 5, key tenants.default.approvers.bob.public_key", "decodes to 9 bytes"),
        ("line 6, key tenants.default.approvers.eve.public_key", "not valid base64"),
        ("line 3, key tenants.default.approval_roles", "role 'cfo' is held by no approver"),
        ("line 7, key tenants.ghost", "empty tenant"),
    ]
    assert len(problems) == len(expected), problems
    for (where, what), line in zip(expected, problems):
        assert line.startswith(f"{path}: {where}: ") and what in line, line
    # The tool set is the caller's: a tool from another source (an MCP catalog) is known once passed.
    assert not any("wire_money" in p for p in check_policy_file(path, {*REGISTRY.tools, "wire_money"}))
    path.write_text("# nothing yet\n")
    assert check_policy_file(path, REGISTRY.tools) == [
        f"{path}: line 1, key tenants: no [tenants.NAME] table: every run would be refused (a missing file, "
        "not an empty one, means the built-in default)"
    ]
    from tether.client import ensure_keys
    from examples.devstack import DEMO_SIGNERS, KEYS_DIR

    ensure_keys(KEYS_DIR, DEMO_SIGNERS)  # the signed tenant's key files, as `make demo` makes them
    assert check_policy_file(ROOT / "examples/billing/policy.toml", REGISTRY.tools) == []
    # The worker does not start (before connecting: the address is unreachable on purpose).
    path.write_text(WHOLE_FILE_PROBLEMS)
    proc = subprocess.run(
        [sys.executable, "worker.py", "--policy", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TEMPORAL_ADDRESS": "127.0.0.1:1"},
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["invalid policy:", *problems]


def test_the_policy_file_check_refuses_look_alike_names(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[tenants.default]\n[tenants.default.approvers]\nalice = { roles = ["approver"] }\n'
                    'bob = { roles = ["approver"] }\n"a1ice" = { roles = ["approver"] }\n'
                    '"rnallory" = { roles = ["approver"] }\nmallory = { roles = ["approver"] }\n')
    problems = check_policy_file(path, REGISTRY.tools)
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{path}: line 5, key tenants.default.approvers.a1ice: looks like approver 'alice'")
    assert "line 7, key tenants.default.approvers.mallory: looks like approver 'rnallory'" in problems[1]
    # A name that mixes scripts is no name at all: the file does not parse.
    path.write_text('[tenants.default]\n[tenants.default.approvers]\n"\u0430lice" = { roles = ["approver"] }\n')
    (problem,) = check_policy_file(path, REGISTRY.tools)
    assert "mixes scripts" in problem and "U+0430" in problem, problem


@pytest.mark.parametrize("name", ["alice", "josé", "müller", "łukasz", "søren", "zoë", "иван", "алиса", "山田たろう",
                                  "δημήτρης", "li.wei@example.com", "jean-luc", "o'brien", "ＡＬＩＣＥ"])
def test_real_names_in_one_script_are_names(name: str) -> None:
    from workflows.identity import normalize_name

    assert normalize_name(name)


@pytest.mark.parametrize("name, why", [
    ("\u0430lice", "mixes scripts (cyrillic, latin; U+0430 is cyrillic) and reads as 'alice'"),
    ("alic\u0435", "U+0435 is cyrillic"),
    ("p\u0430ypal", "reads as 'paypal'"),
    ("\u0251lice", "reads as 'alice' (U+0251 looks like 'a')"),  # Latin alpha: one script, still alice
    ("\u0430\u0455\u0435", "reads as 'ase'"),  # all Cyrillic, every letter an ASCII look-alike
    ("bοb", "mixes scripts"),  # Greek omicron
])
def test_look_alike_names_are_refused_with_why(name: str, why: str) -> None:
    from workflows.identity import normalize_name

    with pytest.raises(ValueError) as refused:
        normalize_name(name)
    assert "a name people could not tell from another one" in str(refused.value) and why in str(refused.value)


def test_four_eyes_and_distinct_approvers_compare_skeletons() -> None:
    from workflows.identity import same_person

    assert same_person("alice", "a1ice") and same_person("mallory", "rnallory") and not same_person("bob", "carol")
    tenant = parse_policy("[tenants.default]\n").tenants["default"]
    refusal = policy.approver_refusal(tenant, approver="a1ice", requested_by="alice", kind="approve",
                                      roles=["approver"], already_approved=[])
    assert refusal is not None and refusal.rule == "four_eyes" and "looks like alice" in refusal.message
    refusal = policy.approver_refusal(tenant, approver="rnallory", requested_by="zed", kind="approve",
                                      roles=["approver"], already_approved=["mallory"])
    assert refusal is not None and refusal.rule == "distinct_approvers" and "looks like mallory" in refusal.message
    assert policy.approver_refusal(tenant, approver="bob", requested_by="alice", kind="approve",
                                   roles=["approver"], already_approved=["carol"]) is None
