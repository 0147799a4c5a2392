"""The Temporal Web UI, used the way a person uses it, in a real Chromium.

Against a dev server of its own (UI on), with a worker in this process and the billing service:

1. one run finishes on its own (read-only plan), one waits for approval (the refund playbook);
   a rejected run shows Completed in the list, a run that failed validation and one whose refund
   failed for good show Failed (the status badge, without a click), and with the AgentRunState
   column added each shows its Tether state;
2. the workflow list filtered by ``AgentRunState="AWAITING_APPROVAL"`` shows the waiting run and
   not the finished one;
3. the run page shows the static summary (goal, tenant) and the current details: state, the plan
   as tool calls with their effect, the plan hash, who requested it, when approval expires and
   the exact ``tether approve`` and ``temporal workflow signal`` commands; the timeline shows
   the planner's activity summary and the approval-expiry timer;
4. the approval goes out from the UI's "Send a Signal" dialog (from the CLI if this UI version
   has no such dialog), and the page shows the run COMPLETED, with a summary
   ``tool · effect · step n`` on every write's activity (``tool · step n`` on a read's) and the ``retry backoff`` timer of the
   refund, which fails once on purpose.

Screenshots of the list with failures, the filtered list, the run page and its timeline land in ``TETHER_SCREENSHOT_DIR``
(default ``build/e2e-screenshots``; ``TETHER_SCREENSHOT_DIR=docs`` refreshes docs/web-ui.md's).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.parse
from datetime import timezone

from temporalio.client import Client

from tether.client import run_outcome
from tests.helpers.billing import Billing
from tests.helpers.paths import BIN
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.browser import SCREENSHOT_DIR, UiEnv
from workflows.run_state import RunOutcome
from workflows.states import RunState
from tests.helpers.browser import rendered

WAITING_QUERY = 'AgentRunState="AWAITING_APPROVAL"'
LOOKUP = [{"tool": "get_order", "args": {"order_id": "A-1001"}}]
# The refund playbook: tool, effect, step.
REFUND_STEPS = [
    ("get_order", "read_only"),
    ("issue_refund", "idempotent"),
    ("post_ledger_entry", "reconcilable"),
    ("send_email", "unsafe"),
]
APPROVER = "bob"
# A 2-core CI box runs the dev server, the UI and Chromium at once: be patient, not flaky.
# A bound against a hang, not a margin: a loaded machine with the workflow cache off (make
# test-replay) renders a page whose run replays its history first.
EXPECT_TIMEOUT_MS = 60_000


async def wait_visible(client: Client, query: str, run_id: str, timeout: float = 10.0) -> bool:
    """Visibility is eventually consistent: give the list a moment before the browser asks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async for wf in client.list_workflows(query):
            if wf.id == run_id:
                return True
        await asyncio.sleep(0.2)
    return False


async def test_inspect_and_approve_in_the_web_ui(ui_env: UiEnv, browser_page, billing: Billing) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    page = browser_page
    client = ui_env.env.client
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    tenant = "acme"  # the dev server is this test's own: nothing else lists here

    async with running_worker(client) as worker:
        # A run that needs nobody: it must not show up among the runs waiting for a person.
        finished = await start_run(
            client, worker, make_request(LOOKUP, goal="Look up order A-1001", tenant=tenant),
            run_id=unique("lookup"),
        )
        assert (await run_outcome(finished)).state == RunState.COMPLETED
        handle = await start_run(client, worker, make_request(tenant=tenant), run_id=unique("refund"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert snap.plan is not None and snap.pending_approval is not None
        plan_hash = snap.plan.plan_hash
        expires = snap.pending_approval.expires_at.astimezone(timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC"
        )
        await wait_visible(client, WAITING_QUERY, handle.id)

        # ---------------------------------------------------------------- endings in the list
        # A rejected run completes; a run that failed validation and one whose refund failed
        # for good fail their Temporal execution: the list's status badges tell them apart.
        failed = await start_run(client, worker, make_request(
            [{"tool": "wire_money", "args": {}}], goal="Wire money", tenant=tenant, limits={"max_replans": 0}),
            run_id=unique("unknown-tool"))
        too_much = await start_run(client, worker, make_request(
            [{"tool": "issue_refund", "args": {"order_id": "A-1003", "amount_cents": 999_999, "reason": "r"}}],
            goal="Refund more than order A-1003 cost", tenant=tenant), run_id=unique("refund-too-much"))
        rejected = await start_run(client, worker, make_request(goal="Refund order A-1001 twice", tenant=tenant),
                                   run_id=unique("refund-rejected"))
        for run, decision in ((too_much, "approve"), (rejected, "reject")):
            pending = await wait_for_state(run, "AWAITING_APPROVAL")
            await run.signal(decision, approval_for(pending, APPROVER, reason="already refunded"))
        endings = {
            failed.id: ("FAILED", "Failed"), too_much.id: ("EXECUTION_FAILED", "Failed"),
            rejected.id: ("REJECTED", "Completed"), finished.id: ("COMPLETED", "Completed"),
        }
        for run_id, (state, _) in endings.items():
            await wait_visible(client, f'AgentRunState="{state}"', run_id)
        await page.goto(f"{ui_env.ui_url}/namespaces/default/workflows?query="
                        + urllib.parse.quote(f'AgentTenant="{tenant}"'))
        for run_id, (state, status) in endings.items():
            row = page.get_by_role("row").filter(has=page.get_by_role("link", name=run_id, exact=True))
            await eventually(page, lambda: expect(row).to_contain_text(status, ignore_case=True),
                             f"{run_id} ({state}) does not show Temporal status {status}")
            # Without a click the list has no AgentRunState column (Configure Columns adds it).
            if state != status.upper():
                await expect(row).not_to_contain_text(state)
        await show_run_columns(page)
        for run_id, (state, status) in endings.items():
            row = page.get_by_role("row").filter(has=page.get_by_role("link", name=run_id, exact=True))
            await expect(row).to_contain_text(state)
        await page.screenshot(path=str(SCREENSHOT_DIR / "webui-list-failures.png"))

        # ---------------------------------------------------------------- the filtered list
        list_url = (
            f"{ui_env.ui_url}/namespaces/default/workflows?query="
            + urllib.parse.quote(WAITING_QUERY)
        )
        await page.goto(list_url)
        waiting_link = page.get_by_role("link", name=handle.id, exact=True)
        await eventually(
            page, expect(waiting_link).to_be_visible,
            f"the waiting run {handle.id} is not in the Web UI's list filtered by {WAITING_QUERY}: "
            f"is the AgentRunState search attribute upserted?",
        )
        assert await page.get_by_role("link", name=finished.id, exact=True).count() == 0, (
            f"the finished run {finished.id} shows up among runs awaiting approval"
        )
        await show_run_columns(page)
        row = page.get_by_role("row").filter(has=waiting_link)
        await expect(row).to_contain_text("AWAITING_APPROVAL")
        await expect(row).to_contain_text(tenant)
        await page.screenshot(path=str(SCREENSHOT_DIR / "webui-awaiting-approval.png"))

        # ---------------------------------------------------------------- the run page
        await waiting_link.click()
        await expect(page.get_by_role("heading", name=handle.id)).to_be_visible()
        # Timeline (the default tab): the planner activity and the expiry timer carry summaries.
        await expect(page.get_by_text("plan · playbook · round 1").first).to_be_visible()
        await expect(page.get_by_text("approval expiry").first).to_be_visible()
        # The summary and the current details (state, how to approve) are only on the User
        # Metadata tab: the page does not show them until it is clicked (docs/web-ui.md).
        await expect(page.locator("#user-metadata-current-details")).to_have_count(0)

        await page.get_by_role("tab", name="User Metadata").click()
        summary = rendered(page, "summary")
        await expect(summary).to_contain_text(f"Refund order A-1001 · tenant {tenant}")
        details = rendered(page, "current-details")
        for expected in (
            "AWAITING_APPROVAL",
            plan_hash,
            "requested by alice",
            expires,
            f".venv/bin/tether approve {handle.id} --by NAME --plan-hash {plan_hash[:12]}",
            snap.pending_approval.request_id,
            f"temporal workflow signal --workflow-id {handle.id} --name approve --input",
            *(f"{tool} · {effect}" for tool, effect in REFUND_STEPS),
        ):
            await expect(details, f"current details lack {expected!r}").to_contain_text(expected)
        # What an approver must not read in the summaries: tool arguments (here an email address).
        await expect(summary).not_to_contain_text("ada@example.com")
        await expect(details).not_to_contain_text("ada@example.com")
        # Tall enough for the whole of the current details.
        await page.set_viewport_size({"width": 1440, "height": 1350})
        await page.screenshot(path=str(SCREENSHOT_DIR / "webui-run-awaiting-approval.png"))
        await page.set_viewport_size({"width": 1440, "height": 1000})

        # ---------------------------------------------------------------- approve
        # The refund fails once (503 before the write): the run retries it after a backoff timer.
        billing.fail_next("refunds", 1, status=503)
        decision = {
            "decision_id": unique("ui"),
            "approver": APPROVER,
            "plan_hash": plan_hash,
            "request_id": snap.pending_approval.request_id,
            "comment": "approved in the Web UI",
        }
        via = await signal_from_ui(page, "approve", decision)
        if via is None:
            via = "CLI"
            subprocess.run(
                [str(BIN / "temporal"), "workflow", "signal", "--address", ui_env.address,
                 "--workflow-id", handle.id, "--name", "approve", "--input", json.dumps(decision)],
                check=True, capture_output=True, timeout=30,
            )
        print(f"approval sent from the {via}")

        outcome = await asyncio.wait_for(run_outcome(handle), timeout=30)
        assert isinstance(outcome, RunOutcome) and outcome.state == RunState.COMPLETED, outcome
        approvals = [r for r in outcome.timeline if r.refs.decision_id == decision["decision_id"]]
        assert approvals and approvals[0].actor == f"user:{APPROVER}", approvals

        # ---------------------------------------------------------------- completed, in the UI
        await page.reload()
        await eventually(
            page, lambda: expect(details).to_contain_text("COMPLETED"),
            "the current details never showed COMPLETED",
        )
        await expect(details).to_contain_text(f"Approved by {APPROVER}")
        await page.get_by_role("tab", name="Timeline").click()
        status = page.get_by_text(re.compile(r"^\s*completed\s*$", re.I)).filter(visible=True)
        await expect(status.first, "the run page does not show the run completed").to_be_visible()
        await expect(page.get_by_text("retry backoff").first, "no retry backoff timer").to_be_visible()
        # The timeline renders only the rows in view: a tall window shows the whole run.
        await page.set_viewport_size({"width": 1440, "height": 6000})
        for i, (tool, effect) in enumerate(REFUND_STEPS, 1):
            await expect(
                page.get_by_text(f"{tool} · step {i}" if effect == "read_only" else f"{tool} · {effect} · step {i}").first,
                f"no activity summary for step {i} ({tool})",
            ).to_be_visible()
        # The timeline panel only: the Input/Result panes above it show tool observations, which
        # may hold personal data (the example's customer email), and do not belong in docs.
        await page.set_viewport_size({"width": 1440, "height": 1350})
        heading = page.get_by_role("heading", name="Timeline", exact=True)
        await heading.scroll_into_view_if_needed()
        box = await heading.bounding_box()
        assert box is not None
        top, left = max(box["y"] - 16, 0), max(box["x"] - 24, 0)
        await page.screenshot(
            path=str(SCREENSHOT_DIR / "webui-run-timeline.png"),
            clip={"x": left, "y": top, "width": 1440 - left, "height": min(1350 - top, 600)},
        )


async def eventually(page, check, message: str, tries: int = 3) -> None:
    """Run a Playwright expectation; the UI does not poll everything, so reload between tries."""
    for attempt in range(tries):
        try:
            await check()
            return
        except AssertionError as e:
            if attempt == tries - 1:
                raise AssertionError(f"{message}\n{e}") from None
            await page.reload()


async def show_run_columns(page) -> None:
    """Show AgentRunState and AgentTenant in the list, as a person would (Configure Columns).

    Cosmetic for the screenshot and for the row check below; the filter is what is tested.
    """
    from playwright.async_api import expect

    configure = page.get_by_role("button", name="Configure Columns")
    await configure.click()
    for name in ("AgentRunState", "AgentTenant"):
        add = page.get_by_role("button", name=f"Add {name} column")
        if await add.count():
            await add.click()
    for name in ("Run ID", "Type"):  # room for the Tether columns in a 1440-wide screenshot
        remove = page.get_by_role("button", name=f"Remove {name} column")
        if await remove.count():
            await remove.click()
    await page.get_by_role("button", name="Close Workflows Table configuration").click()
    await expect(page.get_by_role("heading", name="Configure Workflows Table")).to_be_hidden()
    await page.wait_for_timeout(500)  # the drawer fades out


async def signal_from_ui(page, name: str, payload: dict) -> str | None:
    """Send a signal from the run page's More Actions menu; None if this UI has no such dialog."""
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    more = page.get_by_role("button", name="More Actions")
    item = page.get_by_role("menuitem", name=re.compile(r"^\s*Send a Signal\s*$"))
    try:
        await more.click(timeout=EXPECT_TIMEOUT_MS)
        await item.wait_for(state="visible", timeout=5_000)
    except PlaywrightTimeout:
        await page.keyboard.press("Escape")
        return None
    await item.click()
    dialog = page.get_by_role("dialog").filter(has_text="Send a Signal")
    await dialog.get_by_test_id("signal-select-button").click()
    option = dialog.get_by_role("option").filter(has_text=re.compile(rf"^\s*{name}\b"))
    # The dialog lists the workflow's signals with their descriptions (from the SDK's metadata).
    await expect_text(option.first, "the pending plan")
    await option.first.click()
    await dialog.locator(".cm-content").click()
    # insert_text: no key events, so the editor's bracket auto-closing stays out of it.
    await page.keyboard.insert_text(json.dumps(payload))
    # The editor reformats the JSON when it loses focus, which moves the Submit button: blur it
    # first, then submit and wait for the signal request itself.
    await dialog.get_by_text("Single JSON payload supported.").click()
    await page.wait_for_timeout(300)
    async with page.expect_response(
        lambda r: f"/signal/{name}" in r.url and r.request.method == "POST", timeout=EXPECT_TIMEOUT_MS
    ) as response:
        await dialog.get_by_test_id("confirm-modal-button").click()
    assert (await response.value).ok, f"the UI's signal request failed: {(await response.value).status}"
    return "Web UI signal dialog"


async def expect_text(locator, text: str) -> None:
    from playwright.async_api import expect

    await expect(locator).to_contain_text(text)
