"""The recovery plan (a refund, its ledger entry, an email that cannot be undone) approved and
run, and what the billing service was asked to undo."""

from __future__ import annotations

from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, start_run
from tests.helpers.waiting import wait_for_state
from workflows.run_state import RunOutcome

REFUND = {"tool": "issue_refund", "args": {"order_id": "A-1002", "amount_cents": 1500, "reason": "damaged"}}
LEDGER = {"tool": "post_ledger_entry", "args": {"order_id": "A-1002", "amount_cents": -1500, "memo": "refund A-1002"}}
EMAIL = {"tool": "send_email", "args": {"to": "grace@example.com", "subject": "Your refund", "body": "refunded"}}
PLAN = [REFUND, LEDGER, EMAIL]


async def approved_run(env: WorkflowEnvironment, worker, **request) -> RunOutcome:
    handle = await start_run(env.client, worker, make_request(PLAN, **request))
    snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    # The approver sees how each write is undone, and which cannot be.
    summary = snap.pending_approval.summary
    assert 'issue_refund (can be undone by void_refund; order_id="A-1002", amount_cents=15.00 EUR (1500))' in summary
    assert 'post_ledger_entry (can be undone by reverse_ledger_entry; order_id="A-1002", amount_cents=-15.00 EUR (-1500))' in summary
    assert 'send_email (cannot be undone; unsafe: never re-run; subject="Your refund")' in summary
    await handle.signal("approve", approval_for(snap, "bob"))
    return await tether_client.run_outcome(handle)


VOIDS, REVERSALS = "POST /refunds/{id}/void", "POST /ledger/{id}/reverse"


def requests_to(billing: Billing, *labels: str) -> list[int]:
    counts = billing.get("/admin/stats")["requests"]
    return [counts.get(label, 0) for label in labels]
