"""The run judges cancel and compensate (issue 43): a person's cancel is a request the run's
policy decides (the ``cancel`` Update, the policy activity, on the record), never a Temporal
cancel sent by whoever runs the CLI; a compensation request is judged before `tether
compensate` says "started", and `--wait` exits 0 only once the undos are done. Real dev
server, real worker, the installed `tether` script with no policy file in its shell."""

from __future__ import annotations

import asyncio
import base64
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from worker import create_replayer

import tether.client as tether_client
from tether.store.keys import KeyRing
from activities.policy_checks import PolicyActivities, PolicyStore
from tests.helpers.billing import Billing
from tests.helpers.paths import ROOT
from tests.helpers.queries import timeline
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.cli import Cli
from tests.helpers.effect_tools import DONE, REGISTRY, _event, approved_run, emails
from tests.helpers.recovery import LEDGER, REFUND
from workflows import policy
from workflows.commands import Call
from workflows.contract import CancelRequest
from workflows.engine import Engine
from workflows.run_state import RunData, RunRequest
from workflows.wire import PersonCheck, Refusal, Verdict

POLICY = PolicyStore(ROOT / "examples/billing/policy.toml")
SMALL_REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 7000, "reason": "cancel"}}]
# Two refunds of A-1001 (49.99): the second is over what is left (fails for good), the first stays.
OVER_REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 3000, "reason": "cancel"}}] * 2
NO_POLICY = {"TETHER_POLICY": ""}  # the shell knows no policy: the run's is the only word


def expecting(cli: Cli):
    """`tether ARGS` with no policy in the shell, asserting its exit code: (stdout, stderr)."""

    async def tether(code: int, *args: str) -> tuple[str, str]:
        done, out, err = await cli(*args, env=NO_POLICY)
        assert done == code and "Traceback" not in err, (args, done, out, err)
        return out, err

    return tether


async def test_the_run_judges_a_cancel(dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path) -> None:
    playbook = tmp_path / "small.json"
    playbook.write_text(json.dumps(SMALL_REFUND))
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        tether = expecting(Cli(dev_env, worker))
        async def waiting() -> str:
            run_id = unique("cancel")
            await tether(0, "start", "--goal", "Refund (cancel test)", "--playbook", str(playbook),
                         "--requested-by", "alice", "--id", run_id, "--wait")
            return run_id

        # A non-member: refused by the run, exit 1 with the rule; the run goes on and completes.
        run_id = await waiting()
        _, err = await tether(1, "cancel", run_id, "--by", "mallory", "--reason", "not mine to stop")
        assert "[rule: tenant_membership]" in err and "mallory" in err, err
        records = json.loads((await tether(0, "timeline", run_id, "--json"))[0])
        refused = records[-1]
        assert refused["kind"] == "refused" and refused["rule"] == "tenant_membership", refused
        assert refused["actor"] == "user:mallory" and refused["refs"]["decision_id"], refused
        handle = dev_env.client.get_workflow_handle(run_id)
        assert (await wait_for_state(handle, "AWAITING_APPROVAL")).state.value == "AWAITING_APPROVAL"
        await tether(0, "approve", run_id, "--by", "bob", "--unreviewed")
        await wait_for_state(handle, "COMPLETED")
        # An ended run takes no cancel: 1, and nothing changes.
        _, err = await tether(1, "cancel", run_id, "--by", "bob", "--reason", "too late")
        assert "already finished" in err

        # A member: cancelled by the run's verdict, exit 0, CANCELLED with user:bob and the reason.
        run_id = await waiting()
        out, _ = await tether(0, "cancel", run_id, "--by", "bob", "--reason", "customer withdrew")
        assert out.startswith("CANCELLED: cancellation requested: customer withdrew"), out
        handle = dev_env.client.get_workflow_handle(run_id)
        assert (await wait_for_state(handle, "CANCELLED")).state.value == "CANCELLED"
        final = json.loads((await tether(0, "timeline", run_id, "--json"))[0])[-1]
        assert final["to_state"] == "CANCELLED" and final["actor"] == "user:bob", final
        assert "customer withdrew" in final["reason"] and final["refs"]["decision_id"], final
        status = json.loads((await tether(0, "status", run_id, "--json"))[0])
        assert status["state"] == "CANCELLED" and status["end_actor"] == "user:bob", status

        # Forged: a raw Update with a bad payload, and the name as a raw signal, are refused on
        # the record; the run goes on untouched.
        run_id = await waiting()
        handle = dev_env.client.get_workflow_handle(run_id)
        with pytest.raises(WorkflowUpdateFailedError) as refused_update:
            await handle.execute_update("cancel", {"by": "bob", "decision_id": "forged-1"})  # no reason
        assert "malformed" in str(refused_update.value.cause)
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update("cancel", {"by": "bob", "reason": "r", "decision_id": "x", "admin": True})
        await handle.signal("cancel", {"by": "bob", "reason": "r", "decision_id": "forged-2"})
        await tether(1, "cancel", run_id, "--by", "mallory", "--reason", "again")  # the run is still there to refuse
        records = json.loads((await tether(0, "timeline", run_id, "--json"))[0])
        rules = [r["rule"] for r in records if r["kind"] == "refused"]
        assert rules == ["malformed_signal", "malformed_signal", "unknown_signal", "tenant_membership"], rules
        assert all(r["to_state"] != "CANCELLED" for r in records)
        assert (await wait_for_state(handle, "AWAITING_APPROVAL")).state.value == "AWAITING_APPROVAL"
        out, _ = await tether(0, "cancel", run_id, "--by", "bob", "--reason", "now for real")
        assert out.startswith("CANCELLED"), out


async def test_the_compensation_run_judges_before_started(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    playbooks = {}
    for name, steps in (("small", SMALL_REFUND), ("over", OVER_REFUND)):
        playbooks[name] = tmp_path / f"{name}.json"
        playbooks[name].write_text(json.dumps(steps))
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        tether = expecting(Cli(dev_env, worker))
        async def ended(playbook: str, state: str) -> str:
            run_id = unique("comp")
            await tether(0, "start", "--goal", "Refund (compensate test)", "--playbook", str(playbooks[playbook]),
                         "--requested-by", "alice", "--id", run_id, "--wait")
            await tether(0, "approve", run_id, "--by", "bob", "--unreviewed")
            await wait_for_state(dev_env.client.get_workflow_handle(run_id), state)
            return run_id

        # dana (support, no approval role): the compensation run refuses her, and the CLI says so
        # before anything is said to have started: exit 1 with the rule; refused on its record.
        failed = await ended("over", "EXECUTION_FAILED")
        out, err = await tether(1, "compensate", failed, "--by", "dana")
        assert "started" not in out and "[rule: role]" in err and "compensation refused" in err, (out, err)
        records = json.loads((await tether(0, "timeline", f"{failed}-compensate", "--json"))[0])
        assert records[-1]["to_state"] == "FAILED" and records[-1]["refs"]["error_code"] == "role", records[-1]
        # bob may: started, and --wait exits 0 once the undo is done.
        out, _ = await tether(0, "compensate", failed, "--by", "bob", "--wait")
        assert out.startswith(f"started {failed}-compensate") and "COMPENSATED" in out, out

        # A COMPLETED run's undos are a plan to approve: --wait does not say done while that
        # approval is pending; it says what it waits on, exit 3.
        completed = await ended("small", "COMPLETED")
        out, err = await tether(3, "compensate", completed, "--by", "bob", "--wait")
        assert out.startswith(f"started {completed}-compensate"), out
        assert "nothing is undone yet" in err and "its approval" in err and "expires" in err, err
        assert f"approve {completed}-compensate" in err, err


async def test_a_cancel_the_run_takes_between_states_honours_on_cancel_and_takes_one_at_a_time(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    # The run waits in a retry backoff (the read after two writes keeps failing): a cancel taken
    # there puts the writes back first (on_cancel=compensate), named as bob's on the record. Two
    # cancels at once: one is taken, the other refused (cancel_pending), never two cancels.
    billing.fail_next("orders", 10, status=503)
    plan = [REFUND, LEDGER, {"tool": "get_order", "args": {"order_id": "A-1002"}}]
    async with running_worker(dev_env.client) as worker:
        handle = await start_run(dev_env.client, worker, make_request(plan, on_cancel="compensate"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        await handle.signal("approve", approval_for(snap, "bob"))
        await wait_for_state(handle, "RETRY_WAIT")
        answers = await asyncio.gather(
            tether_client.cancel(dev_env.client, handle.id, by="bob", reason="customer called back"),
            tether_client.cancel(dev_env.client, handle.id, by="carol", reason="me too"),
            return_exceptions=True,
        )
        taken = [a for a in answers if not isinstance(a, Exception)]
        refused = [a for a in answers if isinstance(a, tether_client.TetherError)]
        assert len(taken) == 1 and len(refused) == 1, answers
        assert refused[0].code == tether_client.REFUSED and refused[0].rule == "cancel_pending", refused[0]
        assert taken[0].state.value == "COMPENSATING", taken[0]
        outcome = await tether_client.run_outcome(handle)
        records = await timeline(handle)
    assert outcome.state.value == "COMPENSATED", records[-1].reason
    entered = next(r for r in records if r.to_state is not None and r.to_state.value == "COMPENSATING")
    assert entered.from_state.value == "RETRY_WAIT" and entered.refs.decision_id == taken[0].decision_id
    who = "bob" if "customer called back" in entered.reason else "carol"
    assert entered.actor == f"user:{who}", entered
    assert [r.rule for r in records if r.kind == "refused"] == ["cancel_pending"]


async def test_the_policy_activity_judges_a_cancel_and_a_compensation_request(tmp_path: Path) -> None:
    # policy_check_person under a file that requires signatures: membership, Cedar, and a
    # signature bound to the run, the kind and the decision id; a compensation's requester needs
    # an approval role (its start's signature is the policy snapshot's business).
    bob_key, dana_key = tmp_path / "bob.pem", tmp_path / "dana.pem"
    keys = {name: tether_client.keygen(path) for name, path in (("bob", bob_key), ("dana", dana_key))}
    file = tmp_path / "policy.toml"
    file.write_text(
        '[tenants.t]\nrequire_signatures = true\napproval_roles = ["approver"]\n[tenants.t.approvers]\n'
        f'bob = {{ roles = ["approver"], public_key = "{keys["bob"]}" }}\n'
        f'dana = {{ roles = ["support"], public_key = "{keys["dana"]}" }}\n'
    )
    rules = PolicyActivities(PolicyStore(file), keys=KeyRing.from_env())

    def signed(by: Path, name: str, decision_id: str) -> str:
        payload = policy.signature_payload(workflow_id="w", first_run_id="r", tenant="t", request_id="", plan_hash="",
                                           kind="cancel", decision_id=decision_id, signer=name)
        return base64.b64encode(tether_client.load_private_key(by).sign(payload)).decode()

    async def judged(action: str, by: str, signature: str | None = None, tenant: str = "t") -> tuple[str | None, bool]:
        check = PersonCheck(tenant=tenant, workflow_id="w", first_run_id="r", action=action, by=by, decision_id="d-1",
                            signature=signature, requested_by="alice")
        verdict = await ActivityEnvironment().run(rules.check_person, check)  # attested: in an activity's context
        return (verdict.refusal.rule if verdict.refusal else None), verdict.verified

    assert await judged("cancel", "mallory") == ("tenant_membership", False)
    assert await judged("cancel", "bob") == ("signature_required", False)
    assert await judged("cancel", "bob", signed(bob_key, "bob", "d-2")) == ("bad_signature", False)  # another decision's
    assert await judged("cancel", "bob", signed(dana_key, "bob", "d-1")) == ("bad_signature", False)  # another's key
    assert await judged("cancel", "bob", signed(bob_key, "bob", "d-1")) == (None, True)
    assert await judged("cancel", "dana", signed(dana_key, "dana", "d-1")) == (None, True)  # a member may stop it
    assert await judged("compensate", "dana") == ("role", False)  # an undo is a write
    assert await judged("compensate", "mallory") == ("tenant_membership", False)
    assert await judged("compensate", "bob") == (None, False)
    assert await judged("cancel", "bob", signed(bob_key, "bob", "d-1"), tenant="other") == ("tenant", False)


async def test_a_cancel_the_run_takes_while_a_tool_runs_waits_for_its_outcome(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    # The email went out and the tool is still running: the run's verdict stops it the way a
    # Temporal cancel does (the cancel reaches the tool, its outcome is kept on the step and the
    # record), and the answer comes once CANCELLED is written. The history replays as it ran.
    tag = unique("mail")
    async with running_worker(dev_env.client, registry=REGISTRY) as worker:
        handle, key, call_id = await approved_run(dev_env, worker, "patient_email", tag)
        assert await asyncio.to_thread(_event(DONE, tag).wait, 30)  # the email went out
        done = await tether_client.cancel(dev_env.client, handle.id, by="bob", reason="customer withdrew")
        outcome = await tether_client.run_outcome(handle)
        records = await timeline(handle)
        history = await handle.fetch_history()
    assert (await create_replayer().replay_workflow(history, raise_on_replay_failure=False)).replay_failure is None
    assert emails(billing, key) == 1
    last = records[-1]
    assert outcome.state.value == "CANCELLED" and done.state.value == "CANCELLED"
    assert done.record is not None and (done.record.seq, done.record.reason) == (last.seq, last.reason)
    assert last.from_state.value == "EXECUTING_TOOL" and last.actor == "user:bob" and last.refs.decision_id == done.decision_id
    assert "customer withdrew" in last.reason and call_id in last.reason and "outcome ok" in last.reason
    assert last.refs.tool_call_id == call_id and last.refs.outcome == "ok"


def test_the_engine_decides_a_cancel_request_and_the_table_moves_it() -> None:
    # The pure phase: what a cancel request meets (a run that ended, another cancel, a refusal
    # from the policy check, an allowed one), every answer the run's own record.
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    engine = Engine(RunData(), RunRequest(goal="g", requested_by="alice"), workflow_id="w", first_run_id="r")
    first = CancelRequest(by="bob", reason="withdrawn", decision_id="c-1")
    check = engine.receive_cancel(first, at)
    assert isinstance(check, Call) and check.name == "policy_check_person" and check.catch
    assert (check.arg.action, check.arg.by, check.arg.decision_id) == ("cancel", "bob", "c-1")
    # The same id again while it is judged: answered at once, on no record; another id: refused.
    assert engine.receive_cancel(first, at).rule == "duplicate_decision"
    second = engine.receive_cancel(CancelRequest(by="carol", reason="me too", decision_id="c-2"), at)
    assert (second.outcome, second.rule, second.record.actor) == ("refused", "cancel_pending", "user:carol")
    # The policy refused: on the record with its rule and the policies that decided; nothing moves.
    refused = Verdict(refusal=Refusal(rule="tenant_membership", message="bob is not a member"), policy_hash="h",
                      policies=["t.membership"])
    assert engine.take_cancel(first, refused, at) is False
    verdict = engine.take_verdict("c-1")
    assert (verdict.outcome, verdict.rule, verdict.state.value) == ("refused", "tenant_membership", "RECEIVED")
    assert verdict.record.refs.policies == ["t.membership"] and engine.cancel_taken is None
    # Allowed (signed): taken; the cancel, once the program stopped, names who and why.
    again = CancelRequest(by="bob", reason="withdrawn", decision_id="c-3")
    assert isinstance(engine.receive_cancel(again, at), Call)
    assert engine.take_cancel(again, Verdict(policy_hash="h", verified=True), at) is True
    engine.cancelled(None, at)
    verdict = engine.take_verdict("c-3")
    assert (verdict.outcome, verdict.state.value) == ("transition", "CANCELLED")
    assert verdict.record.actor == "user:bob (signed)" and verdict.record.refs.decision_id == "c-3"
    assert "withdrawn" in verdict.reason
    # Ended: refused (run_ended) on the record, answered at once.
    late = engine.receive_cancel(CancelRequest(by="bob", reason="again", decision_id="c-4"), at)
    assert (late.outcome, late.rule) == ("refused", "run_ended")
