"""`tether revise` and `tether approve --steps` through the installed script against a real dev
server: the person sees the values they change; exit codes and one-line errors are product."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.runs import running_worker, unique
from tests.helpers.cli import POLICY, one_line
from tests.helpers.cli import Cli
from workflows.run_state import RunOutcome

PLAN = [
    {"tool": "get_order", "args": {"order_id": "A-1002"}},
    {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 9000, "reason": "late"}},
    {"tool": "send_email", "args": {"to": "grace@example.com", "subject": "Refund", "body": "Refunded."}},
]


async def test_revise_then_approve_part_through_the_cli(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    playbook = tmp_path / "plan.json"
    playbook.write_text(json.dumps(PLAN))
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)
        run = unique("cli-revise")
        code, out, err = await cli("start", "--goal", "g", "--playbook", str(playbook), "--requested-by", "alice",
                                   "--id", run, "--wait")
        assert code == 0, (out, err)

        code, out, err = await cli("revise", run, "--by", "carol", "--reason", "customer agreed to 10.00",
                                   "--step", "2", "amount_cents=1000")
        assert code == 0, (out, err)
        assert "replace /1/args/amount_cents: 9000 -> 1000" in out, "the editor sees the values"
        assert "VALIDATED: plan revised by carol" in out and "1000" not in out.split("VALIDATED:")[1]

        code, out, _ = await cli("status", run)
        assert code == 0 and "plan       v2 " in out and "revision   v2 revised by carol" in out
        assert "replace /1/args/amount_cents" in out and "revise:  " in out

        # Refused by the run (exit 1, one line, the rule) or before sending (exit 1 / 2).
        code, _, err = await cli("revise", run, "--by", "carol", "--reason", "r", "--step", "2", 'amount_cents="ten"')
        assert code == 1 and "[rule: invalid_revision]" in one_line(err) and "wrong type" in err
        code, _, err = await cli("revise", run, "--by", "carol", "--reason", "r", "--step", "9", "x=1")
        assert code == 1 and "has 3 step(s)" in one_line(err)
        code, _, err = await cli("revise", run, "--by", "carol", "--reason", "r")
        assert code == 2 and "--steps-file" in one_line(err)
        code, _, err = await cli("revise", run, "--by", "carol", "--reason", "r", "--steps-file", str(tmp_path / "none.json"))
        assert code == 2 and "not found" in one_line(err)
        code, _, err = await cli("approve", run, "--by", "bob", "--unreviewed", "--steps", "1,x")
        assert code == 2 and "--steps" in one_line(err)
        code, _, err = await cli("approve", run, "--by", "bob", "--unreviewed", "--steps", "1,4")
        assert code == 1 and "invalid_steps" in one_line(err)

        code, out, err = await cli("approve", run, "--by", "bob", "--unreviewed", "--steps", "1,2")
        assert code == 0 and "APPROVED" in out, (out, err)
        handle = dev_env.client.get_workflow_handle(run, result_type=RunOutcome)
        outcome = await run_outcome(handle)
    assert outcome.state.value == "COMPLETED"
    assert [s.tool for s in outcome.steps] == ["get_order", "issue_refund"]
    keys = [f"{run}:{s.tool_call_id}" for s in outcome.steps if s.tool == "issue_refund"]
    assert [r["amount_cents"] for r in billing.refunds(keys[0])] == [1000]
