"""The approver's inbox, used the way a person uses it, in the real Chromium (dev sign-in).

1. bob signs in, sees the waiting run, opens it, approves, and sees it COMPLETED without a reload;
2. alice (the requester) is not offered the run, and a forced post is refused with four-eyes;
3. the plan's request changes while bob's page is open: the page says so, and his approval is
   refused as stale, with nothing approved.

Screenshots land in TETHER_SCREENSHOT_DIR (``make screenshots`` puts them in docs/, inbox-*.png).
"""

from __future__ import annotations

import pytest
import pytest_asyncio

import tether.client as tether_client
from tests.helpers.billing import Billing
from tests.helpers.browser import SCREENSHOT_DIR
from tether.inbox import desk
from tests.helpers.inbox_stack import Stack, inbox_stack
from tests.helpers.browser import EXPECT_TIMEOUT_MS, sign_in

# What a person could type into the browser's console (Playwright's evaluate is not an inline
# script: the page's CSP does not apply to it).
FORCED_FORM = """([action, fields]) => {
  const form = document.createElement("form");
  form.method = "post"; form.action = action;
  for (const [name, value] of Object.entries(fields)) {
    const input = document.createElement("input");
    input.type = "hidden"; input.name = name; input.value = value; form.appendChild(input);
  }
  document.body.appendChild(form); form.submit();
}"""
FORCED_FETCH = """async ([url, body]) => (await fetch(url, {method: "POST",
  headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)})).status"""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(chromium, dev_env, tmp_path_factory) -> Stack:
    async with inbox_stack(dev_env, tmp_path_factory.mktemp("inbox-e2e"), jwks=False, dev_login=True) as s:
        yield s


@pytest.mark.asyncio(loop_scope="session")
async def test_bob_approves_in_the_browser_and_alice_cannot(stack: Stack, browser_page, billing: Billing) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    page = browser_page
    run_id = await stack.start()
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    await stack.visible(run_id)

    # alice requested it: it is not offered to her, and its page is not hers to open.
    await sign_in(page, stack, "alice")
    await expect(page.locator("#person")).to_have_text("alice")
    await expect(page.locator(f'tr[data-run="{run_id}"]')).to_have_count(0)
    await page.goto(f"{stack.dev_url}/runs/{run_id}")
    await expect(page.locator("#message")).to_contain_text("No such run")
    # A forced post, as she could make one: a form of her own, with her own CSRF token. As for
    # her GET: no such run among hers, nothing of its state shown.
    fields = {"kind": "approve", "request_id": snap.pending_approval.request_id,
              "plan_hash": snap.pending_approval.plan_hash}
    await page.goto(f"{stack.dev_url}/")
    token = await page.get_attribute('meta[name="csrf-token"]', "content")
    await page.evaluate(FORCED_FORM, [f"/runs/{run_id}/decide", {**fields, "csrf": token}])
    await expect(page.locator("#message")).to_contain_text("No such run")
    assert snap.pending_approval.plan_hash[:12] not in await page.content()
    await page.screenshot(path=str(SCREENSHOT_DIR / "inbox-four-eyes.png"), full_page=True)
    # The JSON API with the browser's cookie but without the CSRF token: refused before anything.
    status = await page.evaluate(FORCED_FETCH, [f"/api/runs/{run_id}/decisions", fields])
    assert status == 403
    assert (await tether_client.snapshot(stack.client, run_id)).approved_by == []
    await page.goto(f"{stack.dev_url}/")
    await page.click("text=Sign out")

    # bob: the run waits on him; he opens it, approves, and sees the outcome and then COMPLETED.
    await sign_in(page, stack, "bob")
    row = page.locator(f'tr[data-run="{run_id}"]')
    await expect(row).to_be_visible()
    await page.screenshot(path=str(SCREENSHOT_DIR / "inbox-waiting.png"), full_page=True)
    await row.locator("a").click()
    await expect(page.locator("#state")).to_have_text("AWAITING_APPROVAL")
    await expect(page.locator("#request-id")).to_have_text(snap.pending_approval.request_id)
    await expect(page.locator("table.steps")).to_contain_text("issue_refund")
    await page.screenshot(path=str(SCREENSHOT_DIR / "inbox-run.png"), full_page=True)
    await page.fill("#comment", "checked the order")
    await page.click("#approve")
    await expect(page.locator("#outcome")).to_contain_text("user:bob via inbox")
    await expect(page.locator("#state")).to_have_text("COMPLETED")  # live, without a reload
    await page.screenshot(path=str(SCREENSHOT_DIR / "inbox-approved.png"), full_page=True)
    done = await tether_client.snapshot(stack.client, run_id)
    assert done.state.value == "COMPLETED" and done.approved_by == ["bob"]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_plan_that_changes_while_the_page_is_open_is_not_approved(stack: Stack, browser_page, billing: Billing) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    page = browser_page
    # The request expires after a few seconds and the run asks again: a new request.
    run_id = await stack.start(limits={"approval_ttl_seconds": 5, "on_expiry": "replan", "max_replans": 3})
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    await sign_in(page, stack, "bob")
    await page.goto(f"{stack.dev_url}/runs/{run_id}")
    shown = await page.locator('input[name="request_id"]').get_attribute("value")
    if shown != snap.pending_approval.request_id:
        pytest.skip("the machine was too slow to open the page within the first request's 5 s")
    # The page notices by itself that the plan changed.
    await expect(page.locator("#changed")).to_contain_text("This plan changed — review the new one")
    await page.click("#approve")
    await expect(page.locator("#changed-outcome")).to_have_text(desk.CHANGED)
    await expect(page.locator("#outcome")).to_contain_text("Nothing was approved")
    await page.screenshot(path=str(SCREENSHOT_DIR / "inbox-stale.png"), full_page=True)
    after = await tether_client.snapshot(stack.client, run_id)
    assert after.approved_by == [] and after.state.value in ("AWAITING_APPROVAL", "PLANNING", "VALIDATED")
    await stack.client.get_workflow_handle(run_id).cancel(reason="test over")  # an operator's cancel
