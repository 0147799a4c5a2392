"""Policy operations (issue 43): what-if and explain read a log that may be messy, what-if sees
loosening, explain shows policy errors, and every process says which policy file it reads.

The judgement lines here are made the way the policy activity makes them (``cedar.judge_*``,
``judgements.entries``, signed with the fleet's ring) and read by the real CLI.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import starter
from tether.policy import cedar
from tether.policy.judgements import JsonlJudgementLog, PostgresJudgementLog, entries
from tether.policy.files import parse_policy
from tether.cli.policy import LOG_UNREADABLE
from tests.helpers.policies import RECORDED_POLICY, signed_lines
from workflows.contract import PlanStep, ToolCatalog, ToolEffect, ToolInfo

CATALOG = ToolCatalog(tools=[ToolInfo(name="issue_refund", effect=ToolEffect.IDEMPOTENT, requires_approval=True,
                                      args_schema={}, timeout_seconds=10, max_retries=1)])
NOBODY = '@id("nobody")\nforbid (principal, action, resource);\n'


def tenant_of(limit: int = 5000) -> Any:
    return parse_policy(RECORDED_POLICY % limit).tenants["default"]


def auto_approvals(run: str, amount: int, *, at: datetime, limit: int = 5000, **common: Any) -> list[dict[str, Any]]:
    """The ``auto_approve`` judgement of a plan's one refund, as the runtime logs it at planning
    time (check ``plan``): allowed under the limit, refused (``approval_needed``) above it."""
    tenant = tenant_of(limit)
    judged = cedar.judge_steps(cedar.policies_for("default", tenant), "default", tenant, actions=["auto_approve"],
                               steps=[PlanStep(tool_call_id="s1", tool="issue_refund", args={"amount_cents": amount})],
                               catalog=CATALOG)
    return signed_lines(entries(judged, at=at.isoformat(), tenant="default", workflow_id=run, run_id="r",
                                activity_id="1", check="plan", **common))


def bobs_approval(run: str, at: datetime) -> list[dict[str, Any]]:
    tenant = tenant_of()
    judged = [cedar.judge_person(cedar.policies_for("default", tenant), "default", tenant, action="approve",
                                 person="bob", requested_by="alice", roles=["approver"])]
    return signed_lines(entries(judged, at=at.isoformat(), tenant="default", workflow_id=run, run_id="r",
                                activity_id="2", check="decision"))


def policy(tmp_path: Path, name: str, limit: int) -> Path:
    path = tmp_path / name
    path.write_text(RECORDED_POLICY % limit)
    return path


# ----------------------------------------------------------------------------- a messy log

OTHER_SHAPES = [
    b"[]\n",
    b'"a string"\n',
    b"42\n",
    b"null\n",
    b'{"not": "a judgement"}\n',
    b'{"workflow_id": 7, "at": "2026-01-01", "action": "approve", "allowed": true, "request": {}, "entities": []}\n',
    b'{"workflow_id": "w", "at": "2026-01-01", "action": "approve", "allowed": "yes", "request": {}, "entities": []}\n',
    b'{"workflow_id": "w", "at": "2026-01-01", "action": "approve", "allowed": true, "request": [], "entities": []}\n',
    b'{"workflow_id": "w", "at": "2026-01-01", "action": "approve", "allowed": true, "request": {}, "entities": ["x"]}\n',
    b'{"workflow_id": "w", "at": "2026-01-01", "action": "approve", "allowed": true, "request": {}, "entities": [{"uid": "x"}]}\n',
    b'{"workflow_id": "w", "run_id": ["r"], "at": "x", "action": "a", "allowed": true, "request": {}, "entities": []}\n',
    b'{"workflow_id": "w", "at": "2026', # torn by a worker killed mid-write
    b"\n",
    b"\xff\xfe not even text\n",
    b"{" * 5000 + b"\n",  # deeper than the JSON decoder recurses
]


def test_lines_of_another_shape_are_skipped_and_counted_never_changing_the_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    now = datetime.now(timezone.utc)
    log = JsonlJudgementLog(tmp_path)
    log.write(bobs_approval("run-messy", now))
    with open(log.path, "ab") as f:
        for line in OTHER_SHAPES:
            f.write(line)
    log.write(auto_approvals("run-messy", 4000, at=now))
    # A hand-made line of the right shape that the fleet did not sign: not counted as a shape problem.
    forged = {**auto_approvals("run-messy", 4000, at=now)[0], "allowed": False, "index": 9}
    with open(log.path, "ab") as f:
        f.write(json.dumps(forged).encode() + b"\n")
    read = log.read()
    assert sorted(e["action"] for e in read) == ["approve", "auto_approve", "auto_approve"] and log.skipped == len(OTHER_SHAPES) - 1
    capsys.readouterr()
    # The same policy: nothing changes, exit 0, the skipped lines said on stderr.
    same = policy(tmp_path, "same.toml", 5000)
    assert starter.main(["policy", "what-if", str(same), "--audit-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("0 of 2 judgement(s) of 1 run(s) change"), out
    assert f"{len(OTHER_SHAPES) - 1} line(s) skipped: not a judgement line" in err, err
    assert "1 line(s) of" in err and "not signed by the fleet" in err, err
    # A change: exit 1 as on a clean log.
    proposal = tmp_path / "nobody.cedar"
    proposal.write_text(NOBODY)
    assert starter.main(["policy", "what-if", str(proposal), "--audit-dir", str(tmp_path)]) == 1
    assert "2 of 2 judgement(s) of 1 run(s) change" in capsys.readouterr().out
    assert starter.main(["policy", "explain", "run-messy", "--audit-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "run run-messy: 2 Cedar judgement(s)" in out and "line(s) skipped: not a judgement line" in err


def test_a_log_that_cannot_be_read_has_its_own_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    proposal = tmp_path / "nobody.cedar"
    proposal.write_text(NOBODY)
    missing = tmp_path / "no-such-dir"
    assert starter.main(["policy", "what-if", str(proposal), "--audit-dir", str(missing)]) == LOG_UNREADABLE == 4
    err = capsys.readouterr().err
    assert "could not read the judgement log" in err and "judgements.jsonl" in err and "--audit-dir" in err, err
    assert starter.main(["policy", "explain", "any-run", "--audit-dir", str(missing)]) == LOG_UNREADABLE
    # Not a file: a folder where the log should be.
    (tmp_path / "folder" / "judgements.jsonl").mkdir(parents=True)
    assert starter.main(["policy", "what-if", str(proposal), "--audit-dir", str(tmp_path / "folder")]) == LOG_UNREADABLE
    # An invalid proposal is still 2, whatever the log.
    bad = tmp_path / "bad.cedar"
    bad.write_text('@id("x")\npermit (principal, action in Tether::Action::"launch", resource);\n')
    capsys.readouterr()
    assert starter.main(["policy", "what-if", str(bad), "--audit-dir", str(missing)]) == 2
    assert "the proposed policy is invalid" in capsys.readouterr().err


def test_a_judgement_table_that_cannot_be_reached_has_its_own_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.helpers.ports import free_port

    # Nothing listens there: the database is down.
    monkeypatch.setenv("TETHER_AUDIT_DSN", f"postgresql://tether@127.0.0.1:{free_port()}/tether")
    proposal = tmp_path / "nobody.cedar"
    proposal.write_text(NOBODY)
    assert starter.main(["policy", "what-if", str(proposal)]) == LOG_UNREADABLE
    assert "could not read the judgement log: PostgreSQL" in capsys.readouterr().err
    assert starter.main(["policy", "explain", "any-run"]) == LOG_UNREADABLE


def test_rows_of_another_shape_in_postgres_are_skipped_and_counted(
    postgres: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TETHER_AUDIT_DSN", postgres)
    log = PostgresJudgementLog(postgres)
    run = f"pg-messy-{tmp_path.name}"
    now = datetime.now(timezone.utc)
    log.write(bobs_approval(run, now))
    log.write([{"workflow_id": run, "run_id": "r", "activity_id": "x", "index": 0, "tenant": "default",
                "at": now.isoformat(), "request": "not a request"}])
    assert starter.main(["policy", "explain", run]) == 0
    out, err = capsys.readouterr()
    assert "decision approve by bob: allowed by default.decide" in out
    assert "1 line(s) skipped: not a judgement line" in err, err


# ----------------------------------------------------------------------------- loosening


def test_a_raised_auto_approval_limit_names_the_runs_that_needed_an_approver(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The live limit is 50.00: a 125.00 and an 80.00 refund needed bob, a 40.00 one ran alone.
    Raised to 1000.00, what-if reports both runs that would need nobody, with their amounts."""
    now = datetime.now(timezone.utc)
    log = JsonlJudgementLog(tmp_path)
    log.write(auto_approvals("run-125", 12500, at=now - timedelta(minutes=3), roles=["approver"], approvals_required=1))
    log.write(bobs_approval("run-125", now - timedelta(minutes=2)))
    log.write(auto_approvals("run-80", 8000, at=now - timedelta(minutes=1)))
    log.write(auto_approvals("run-40", 4000, at=now))
    recorded = log.read()
    assert [(e["workflow_id"], e["allowed"], e["rule"]) for e in recorded if e["action"] == "auto_approve"] == [
        ("run-125", False, "approval_needed"), ("run-80", False, "approval_needed"), ("run-40", True, None)]
    capsys.readouterr()
    raised = policy(tmp_path, "raised.toml", 100000)
    assert starter.main(["policy", "what-if", str(raised), "--audit-dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"2 of 4 judgement(s) of 3 run(s) change under {raised}", lines
    assert lines[0].startswith("run-125 ") and lines[1].startswith("run-80 "), lines
    assert ("plan auto_approve step 1 (issue_refund amount_cents=12500.0): refused (approval_needed) -> allowed "
            "by default.auto_approve.limits.1: needed approval (roles approver), would need nobody") in lines[0], lines
    assert ("plan auto_approve step 1 (issue_refund amount_cents=8000.0): refused (approval_needed) -> allowed "
            "by default.auto_approve.limits.1: needed approval, would need nobody") in lines[1], lines
    # Lowered to 20.00 instead: the 40.00 refund would need a person (tightening, as before).
    lowered = policy(tmp_path, "lowered.toml", 2000)
    assert starter.main(["policy", "what-if", str(lowered), "--audit-dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("run-40 ") and "an auto-approval that would need a person" in lines[0]
    # A refused approval that a proposal would allow: "refused -> allowed" in general.
    tenant = tenant_of()
    refused = [cedar.judge_person(cedar.policies_for("default", tenant), "default", tenant, action="approve",
                                  person="dana", requested_by="alice", roles=["approver"])]
    other = tmp_path / "other"
    JsonlJudgementLog(other).write(signed_lines(entries(refused, at=now.isoformat(), tenant="default",
                                                        workflow_id="run-dana", run_id="r", activity_id="1",
                                                        check="decision")))
    everyone = tmp_path / "everyone.cedar"
    everyone.write_text('@id("open")\npermit (principal, action, resource);\n')
    assert starter.main(["policy", "what-if", str(everyone), "--audit-dir", str(other)]) == 1
    out = capsys.readouterr().out
    assert ("decision approve by dana: refused (tenant_membership) -> allowed by open: refused -> allowed: "
            "an approval that was refused would count") in out, out


# ----------------------------------------------------------------------------- policy errors


OVERFLOW = ('\n@id("default.overflow")\n@rule("overflow")\nforbid (principal, action in Tether::Action::"approve", '
            'resource is Tether::Run)\nwhen { resource.stage + 9223372036854775807 > 0 };\n')


def test_explain_shows_the_policies_that_errored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A forbid whose condition overflows a Long: Cedar skips it, and the judgement fails closed
    (refused, ``policy_error``, naming the policy). The line carries the error, naming the policy
    by its @id; explain shows it."""
    tenant = tenant_of()
    policies = cedar.Policies.from_text(cedar.export_tenant("default", tenant) + OVERFLOW)
    judged = cedar.judge_person(policies, "default", tenant, action="approve", person="bob", requested_by="alice",
                                roles=["approver"], stage=1)
    assert (judged.allowed, judged.rule, judged.policies) == (False, "policy_error", ("default.overflow",)), judged
    assert judged.errors
    clean = cedar.judge_person(policies, "default", tenant, action="approve", person="bob", requested_by="alice",
                               roles=["approver"], stage=0)
    assert not clean.errors
    now = datetime.now(timezone.utc).isoformat()
    lines = entries([judged, clean], ids=policies.ids, at=now, tenant="default", workflow_id="run-err",
                    run_id="r", activity_id="1", check="decision")
    assert [len(line.get("errors", [])) for line in lines] == [1, 0] and "errors" not in lines[1]
    assert lines[0]["errors"][0].startswith("error while evaluating policy `default.overflow`: integer overflow")
    JsonlJudgementLog(tmp_path).write(signed_lines(lines))
    capsys.readouterr()
    assert starter.main(["policy", "explain", "run-err", "--audit-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    errored = [line.strip() for line in out if "errored" in line]
    assert len(errored) == 1, out
    assert errored[0].startswith("policy default.overflow errored: integer overflow while attempting to add")
    assert errored[0].endswith("; refused: policy_error")
    assert "decision approve by bob: refused (policy_error) by default.overflow" in "\n".join(out)


# ----------------------------------------------------------------------------- one policy, each says which

WORKER_POLICY = """
[tenants.{tenant}]
approval_roles = ["finance"]
[tenants.{tenant}.approvers]
alice = {{ roles = ["approver"] }}
carol = {{ roles = ["finance"] }}
"""

INBOX_POLICY = """
[tenants.{tenant}]
approval_roles = ["approver"]
[tenants.{tenant}.approvers]
alice = {{ roles = ["approver"] }}
bob   = {{ roles = ["approver"] }}
carol = {{ roles = ["approver", "finance"] }}
"""


@pytest.mark.asyncio(loop_scope="session")
async def test_the_inbox_reads_the_roles_a_run_needs_from_the_run_not_from_its_own_file(
    dev_env: Any, billing: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker started with another policy file than the inbox's: its runs need role finance
    (the worker's file), the inbox's file asks for approver. The inbox shows the run to carol
    (finance), not to bob (approver only), tells bob why on the run's page, names both policies,
    and says its own file and hash on every page and on /healthz."""
    import uuid

    import httpx

    import tether.client as tether_client
    from tether.policy.files import PolicyStore
    from tether.inbox.app import InboxConfig, create_app
    from tests.helpers.runs import make_request, running_worker
    from tests.helpers.inbox_stack import AUDIENCE, ISSUER, Sso, _serve
    from tests.helpers.ports import free_port

    tenant = f"fleet-{uuid.uuid4().hex[:8]}"
    worker_file, inbox_file = tmp_path / "worker.toml", tmp_path / "inbox.toml"
    worker_file.write_text(WORKER_POLICY.format(tenant=tenant))
    inbox_file.write_text(INBOX_POLICY.format(tenant=tenant))
    worker_hash, inbox_hash = PolicyStore(worker_file).load()[1], PolicyStore(inbox_file).load()[1]
    assert worker_hash != inbox_hash
    sso = Sso()
    (tmp_path / "jwks.json").write_text(json.dumps(sso.jwks()))
    app = create_app(InboxConfig(policy=inbox_file, jwks=str(tmp_path / "jwks.json"), issuer=ISSUER,
                                 audience=AUDIENCE, key=tmp_path / "none.pem", poll_ms=300), temporal=dev_env.client)
    port = free_port()
    server, task = await _serve(app, port)
    url = f"http://127.0.0.1:{port}"

    def who(name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {sso.token(name)}"}

    try:
        async with running_worker(dev_env.client, policy=PolicyStore.from_env(str(worker_file))) as worker, \
                httpx.AsyncClient(base_url=url, timeout=30) as http:
            run_id = f"fleet-run-{uuid.uuid4().hex[:10]}"
            await tether_client.start_run(dev_env.client, make_request(tenant=tenant, requested_by="alice"),
                                          run_id=run_id, queue=worker.task_queue)
            while (snap := await tether_client.snapshot(dev_env.client, run_id)).state.value != "AWAITING_APPROVAL":
                assert snap.state.value not in ("FAILED", "COMPLETED", "CANCELLED"), snap
                await asyncio.sleep(0.1)
            assert snap.pending_approval.roles == ["finance"]  # the worker's file, on the run's signed view
            # Carol holds finance (this inbox's file says who she is): the run waits on her.
            while not [r for r in (await http.get("/api/approvals", headers=who("carol"))).json()["approvals"]
                       if r["run_id"] == run_id]:
                await asyncio.sleep(0.2)
            page = (await http.get(f"/api/runs/{run_id}", headers=who("carol"))).json()
            assert page["may_decide"] is True and page["pending"]["roles"] == ["finance"]
            assert page["pending"]["deciders"] == ["carol"]  # bob holds approver only
            assert page["policy"]["run"] == worker_hash and page["policy"]["inbox"] == inbox_hash
            assert page["policy"]["same"] is False and worker_hash[:12] in page["policy"]["note"]
            # Bob (approver, what the inbox's own file asks for) is not offered it, and told why.
            assert [r for r in (await http.get("/api/approvals", headers=who("bob"))).json()["approvals"]
                    if r["run_id"] == run_id] == []
            bobs = (await http.get(f"/api/runs/{run_id}", headers=who("bob"))).json()
            assert bobs["may_decide"] is False and bobs["why_not"]["rule"] == "role", bobs
            assert "needs one of ['finance']" in bobs["why_not"]["message"]
            assert f"judged under policy {worker_hash[:12]}" in bobs["why_not"]["message"]
            html = (await http.get(f"/runs/{run_id}", headers=who("bob"))).text
            assert 'id="why-not"' in html and 'id="run-policy"' in html
            assert f"sha256 <code title=\"{inbox_hash}\">{inbox_hash[:12]}</code>" in html  # the footer
            # Shown to say why not, and nothing more: bob's decision is not sent to the run.
            tried = await http.post(f"/api/runs/{run_id}/decisions", headers=who("bob"), json={
                "kind": "approve", "request_id": bobs["pending"]["request_id"], "plan_hash": bobs["pending"]["plan_hash"]})
            assert tried.status_code == 409 and tried.json()["rule"] == "role", tried.json()
            assert not [r for r in await tether_client.timeline(dev_env.client, run_id) if "bob" in r.actor]
            # Someone this inbox's file does not list in the tenant: nothing, not even whether it exists.
            assert (await http.get(f"/api/runs/{run_id}", headers=who("dana"))).status_code == 404
            health = (await http.get("/healthz")).json()
            assert health == {"status": "ok", "policy": str(inbox_file), "policy_hash": inbox_hash}
            # Carol's approval goes through; the run (the worker's file) accepts it.
            decided = await http.post(f"/api/runs/{run_id}/decisions", headers=who("carol"), json={
                "kind": "approve", "request_id": page["pending"]["request_id"], "plan_hash": page["pending"]["plan_hash"]})
            assert decided.status_code == 200 and decided.json()["outcome"] != "refused", decided.json()
            # `tether policy show --run`: the run's recorded hash against each file.
            monkeypatch.setenv("TEMPORAL_ADDRESS", dev_env.client.service_client.config.target_host)
            monkeypatch.setenv("TEMPORAL_NAMESPACE", dev_env.client.namespace)
            capsys.readouterr()
            assert await asyncio.to_thread(starter.main, ["policy", "show", "--policy", str(worker_file),
                                                          "--run", run_id]) == 0
            assert await asyncio.to_thread(starter.main, ["policy", "show", "--policy", str(inbox_file),
                                                          "--run", run_id]) == 1
            out = capsys.readouterr().out
            assert f"hash    {worker_hash}" in out and f"hash    {inbox_hash}" in out
            assert f"policy hash {worker_hash} (recorded at its start): the same file" in out
            assert "ANOTHER policy than this file" in out
    finally:
        server.should_exit = True
        await task


def test_policy_show_names_the_file_its_hash_and_tenants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tether.policy.files import PolicyStore

    path = policy(tmp_path, "fleet.toml", 5000)
    digest = PolicyStore(path).load()[1]
    monkeypatch.setenv("TETHER_POLICY", str(path))
    assert starter.main(["policy", "show"]) == 0  # TETHER_POLICY, as every process reads it
    out = capsys.readouterr().out.splitlines()
    assert out == [f"policy  {path}", f"hash    {digest}", "tenant  default: approvers alice, bob; approval roles approver"]
    # An edit is another hash; --policy wins over the environment.
    other = policy(tmp_path, "other.toml", 2000)
    assert starter.main(["policy", "show", "--policy", str(other)]) == 0
    assert f"hash    {PolicyStore(other).load()[1]}" in capsys.readouterr().out and PolicyStore(other).load()[1] != digest
    # No file: the built-in default, with its own hash.
    monkeypatch.delenv("TETHER_POLICY")
    assert starter.main(["policy", "show"]) == 0
    assert "built-in default" in capsys.readouterr().out
    # An invalid or missing file: exit 2, naming it.
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants.default]\nfour_eyes = 3\n")
    assert starter.main(["policy", "show", "--policy", str(bad)]) == 2
    assert "line 2, key tenants.default.four_eyes" in capsys.readouterr().err
    assert starter.main(["policy", "show", "--policy", str(tmp_path / "none.toml")]) == 2
    assert "policy file not found" in capsys.readouterr().err


# ----------------------------------------------------------------------------- escalation

ESCALATING = """
[tenants.default]
tools = ["get_order", "issue_refund"]
[tenants.default.approvers]
alice = { roles = ["approver"] }
bob = { roles = ["approver"] }
fay = { roles = ["finance"] }
lee = { roles = ["legal"] }
[tenants.default.escalation]
normal = [%s]
"""
FINANCE_1H = '{ after = "1h", roles = ["finance"] }'


async def test_what_if_sees_a_recorded_runs_escalation_change(
    ts_env: Any, billing: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 60.00 refund needs a person; an hour on, the request escalates to finance and fay
    (finance) approves it. The judgement log records the plan's stages and the stage fay's
    approvals stood at. what-if: the same file changes nothing (exit 0); a file without the
    stage, or with it later, reports the plan's escalation and fay's approvals as refused (exit
    1); a stage with another role added (loosening) and one earlier are reported too."""
    from tether.policy.judgements import log_from_env
    from activities.policy_checks import PolicyActivities
    from tether.policy.files import PolicyStore
    from tether.client import run_outcome
    from tests.helpers.runs import approval_for, make_request, running_worker, start_run
    from tests.helpers.waiting import wait_for_state
    from tests.helpers.policies import refund_step
    from workflows.run_state import RunSnapshot

    def cli(argv: list[str]) -> Any:  # the CLI runs its own event loop: in a thread of its own
        return asyncio.to_thread(starter.main, argv)

    live = tmp_path / "policy.toml"
    live.write_text(ESCALATING % FINANCE_1H)
    store = PolicyStore.from_env(str(live))
    judged_dir = tmp_path / "judged"
    rules = PolicyActivities(store, judgement_log=log_from_env(str(judged_dir)))
    async with running_worker(ts_env.client, policy=store, rules=rules) as worker:
        handle = await start_run(ts_env.client, worker, make_request([refund_step(6000)], requested_by="alice"))
        await wait_for_state(handle, "AWAITING_APPROVAL")
        await ts_env.sleep(3600 + 60)
        while True:  # the stage's timer fired on the skipped hour: the request escalated
            snap = await handle.query("snapshot", result_type=RunSnapshot)
            if snap.pending_approval is not None and snap.pending_approval.stage == 1:
                break
            await asyncio.sleep(0.05)
        assert snap.pending_approval.roles == ["approver", "finance"]
        await handle.signal("approve", approval_for(snap, "fay"))
        await run_outcome(handle)
    logged = log_from_env(str(judged_dir)).read()
    plan = [e for e in logged if (e["check"], e["action"]) == ("plan", "auto_approve")]
    assert len(plan) == 1 and not plan[0]["allowed"], plan
    assert plan[0]["escalation"] == [{"after": 3600.0, "roles": ["finance"]}], plan[0]
    fays = [e for e in logged if (e["action"], e.get("person")) == ("approve", "fay")]
    assert fays[0]["check"] == "decision" and len(fays) >= 2 and all(e["allowed"] for e in fays), fays
    stood = {"stage": 1, "after": 3600.0, "roles": ["finance"], "added": ["finance"]}
    assert all(e["escalated"] == stood for e in fays), fays
    assert not any("escalated" in e for e in logged if e not in fays), "only a decision under the stage records it"

    # explain shows the plan's stages and the stage a decision stood at.
    capsys.readouterr()
    assert await cli(["policy", "explain", handle.id, "--audit-dir", str(judged_dir)]) == 0
    out = capsys.readouterr().out
    assert "  escalation  finance after 1h" in out and "  escalated   stage 1: finance after 1h" in out, out

    async def what_if(stages: str) -> tuple[int, list[str]]:
        proposal = tmp_path / "proposal.toml"
        proposal.write_text(ESCALATING % stages)
        capsys.readouterr()
        code = await cli(["policy", "what-if", str(proposal), "--audit-dir", str(judged_dir)])
        lines = capsys.readouterr().out.splitlines()
        assert lines[-1].endswith(f"of {len(logged)} judgement(s) of 1 run(s) change under {proposal}"), lines
        return code, lines[:-1]

    assert await what_if(FINANCE_1H) == (0, [])
    # The stage removed (tightening): the plan would not escalate, and fay could not have approved.
    code, changed = await what_if("")
    assert code == 1 and len(changed) == 1 + len(fays), changed
    assert "plan auto_approve step 1" in changed[0] and changed[0].endswith(
        "refused (approval_needed) -> refused (approval_needed) by no policy: "
        "escalates to finance after 1h, would not escalate"), changed[0]
    for line in changed[1:]:
        assert "approve by fay: allowed -> refused (role)" in line and line.endswith(
            "an approval that would be refused: the run would have needed another approver; "
            "escalated to finance after 1h (stage 1), would not escalate"), line
    # Later: at the hour the stage fired, the proposal had not escalated yet.
    code, changed = await what_if('{ after = "2h", roles = ["finance"] }')
    assert code == 1 and len(changed) == 1 + len(fays), changed
    assert changed[0].endswith("escalates to finance after 1h, would escalate to finance after 2h"), changed[0]
    assert all("allowed -> refused (role)" in c and c.endswith("would not escalate") for c in changed[1:]), changed
    # Earlier: the plan escalates otherwise; fay's approvals stood on the same roles.
    code, changed = await what_if('{ after = "30m", roles = ["finance"] }')
    assert code == 1 and len(changed) == 1, changed
    assert changed[0].endswith("escalates to finance after 1h, would escalate to finance after 30m"), changed
    # Loosening: legal too at the same stage; fay's approvals still count, on wider roles.
    code, changed = await what_if('{ after = "1h", roles = ["finance", "legal"] }')
    assert code == 1 and len(changed) == 1 + len(fays), changed
    assert changed[0].endswith("would escalate to finance, legal after 1h"), changed[0]
    assert all("approve by fay: allowed -> allowed" in c and c.endswith(
        "escalated to finance after 1h (stage 1), would escalate to finance, legal after 1h") for c in changed[1:]), changed


def test_lines_from_before_escalation_was_recorded_count_as_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A planning-time line without the plan's stages, a decision without the stage it stood at,
    and a malformed escalation field (signed all the same) are unchanged under any stages: the
    note on stderr says the plans' escalation was not compared where the proposal escalates."""
    now = datetime.now(timezone.utc)
    log = JsonlJudgementLog(tmp_path)
    old = auto_approvals("run-old", 12500, at=now - timedelta(minutes=2))
    assert "escalation" not in old[0] and not old[0]["allowed"]
    log.write(old)
    log.write(bobs_approval("run-old", now - timedelta(minutes=1)))
    mangled = auto_approvals("run-odd", 12500, at=now, escalation="soon")
    log.write(mangled + signed_lines([{**bobs_approval("run-odd", now)[0], "escalated": {"stage": 1, "after": "1h"}}]))
    # Forged: a signed line whose stages were edited afterwards is not the fleet's, and is skipped.
    log.write([{**mangled[0], "escalation": [{"after": 60, "roles": ["cfo"]}]}])
    capsys.readouterr()
    unchanged = policy(tmp_path, "same.toml", 5000)
    with_stage = tmp_path / "staged.toml"
    with_stage.write_text(unchanged.read_text() + '[tenants.default.escalation]\nnormal = [{ after = "1h", roles = ["cfo"] }]\n')
    assert starter.main(["policy", "what-if", str(with_stage), "--audit-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1] == f"0 of 4 judgement(s) of 2 run(s) change under {with_stage}", captured.out
    assert "note: 1 plan(s) that needed approval were logged before judgement lines recorded their escalation" in captured.err
    assert "1 line(s) of" in captured.err and "not signed by the fleet: skipped" in captured.err, captured.err
    # Without stages in the proposal the note has nothing to say.
    assert starter.main(["policy", "what-if", str(unchanged), "--audit-dir", str(tmp_path)]) == 0
    assert "note:" not in capsys.readouterr().err
