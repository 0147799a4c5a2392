"""What a person approves in the inbox is what the page showed them, in the real Chromium
(dev sign-in): a long argument shown in full, money and effects in words, and a plan swapped
under an open page refused as stale with nothing approved."""

from __future__ import annotations

import pytest
import pytest_asyncio

import tether.client as tether_client
from tether.inbox import desk
from tests.helpers.billing import Billing
from tests.helpers.runs import PLAYBOOK
from tests.helpers.browser import SCREENSHOT_DIR
from tests.helpers.browser import EXPECT_TIMEOUT_MS, sign_in
from tests.helpers.inbox_stack import Stack, inbox_stack

# 648 characters: what matters is at the end.
TAIL = "…wire the refund to IBAN DE00 ATTACKER"
LONG_BODY = "A" * (648 - len(TAIL)) + TAIL


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(chromium, dev_env, tmp_path_factory) -> Stack:
    async with inbox_stack(dev_env, tmp_path_factory.mktemp("inbox-review"), jwks=False, dev_login=True) as s:
        yield s


def playbook(body: str) -> list[dict]:
    steps = [dict(s, args=dict(s["args"])) for s in PLAYBOOK]
    steps[-1]["args"]["body"] = body
    return steps


@pytest.mark.asyncio(loop_scope="session")
async def test_a_long_argument_money_and_effects_are_shown_in_full(stack: Stack, browser_page, billing: Billing) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    page = browser_page
    run_id = await stack.start(playbook=playbook(LONG_BODY))
    await stack.wait(run_id, "AWAITING_APPROVAL")
    await stack.visible(run_id)
    await sign_in(page, stack, "bob")
    row = page.locator(f'tr[data-run="{run_id}"]')
    await expect(row.locator("td.what")).to_contain_text("issue_refund (order_id: \"A-1001\", amount_cents: 49.99 EUR (4999))")
    await expect(row.locator("td.approvals")).to_have_text("0 of 1 approval(s); 1 more needed from someone with role approver")
    await row.locator("a").click()

    steps = page.locator("table.steps tbody tr")
    await expect(steps).to_have_count(4)
    for n, does in enumerate(["read-only", "can be undone by void_refund", "can be undone by reverse_ledger_entry",
                              "cannot be undone; unsafe: never re-run"]):
        await expect(steps.nth(n).locator("td.effect .does")).to_have_text(does)
    await expect(steps.nth(1).locator("td.args")).to_contain_text("amount_cents: 49.99 EUR (4999)")
    await expect(steps.nth(2).locator("td.args")).to_contain_text("amount_cents: -49.99 EUR (-4999)")
    # The whole email body is on the page, its end visible where Approve is offered.
    body = steps.nth(3).locator("td.args .value").last
    await expect(body).to_contain_text(TAIL)
    assert (await body.inner_text()).count("A") >= 648 - len(TAIL)
    # Measured in one go: the live part may be re-rendered between two calls.
    right, width, scrolled = await page.evaluate("""() => {
      const values = document.querySelectorAll("table.steps tbody tr:nth-child(4) td.args .value");
      const box = values[values.length - 1].getBoundingClientRect();
      return [box.right, window.innerWidth, document.documentElement.scrollWidth];
    }""")
    assert right <= width and scrolled <= width, (right, width, scrolled)
    await expect(page.locator("#approvals")).to_have_text("0 of 1 approval(s); 1 more needed from someone with role approver")
    await expect(page.locator("#deciders")).to_have_text("bob")
    assert "`" not in await page.locator("table.steps").inner_text()
    await expect(page.locator("#approve")).to_be_visible()
    await page.screenshot(path=str(SCREENSHOT_DIR / "inbox-long-argument.png"), full_page=True)
    await stack.client.get_workflow_handle(run_id).cancel(reason="test over")  # an operator's cancel


@pytest.mark.asyncio(loop_scope="session")
async def test_a_plan_swapped_under_the_open_page_is_refused_as_stale(stack: Stack, browser_page, billing: Billing) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    page = browser_page
    run_id = await stack.start()
    snap = await stack.wait(run_id, "AWAITING_APPROVAL")
    await sign_in(page, stack, "bob")
    await page.goto(f"{stack.dev_url}/runs/{run_id}")
    await expect(page.locator('input[name="plan_hash"]')).to_have_value(snap.pending_approval.plan_hash)
    await expect(page.locator("table.steps")).to_contain_text("49.99 EUR")

    # The requester revises her own run while bob's page is open: 490.00 EUR, to mallory.
    steps = tether_client.revised_steps(snap.plan, [(2, "amount_cents", 49000), (4, "to", "mallory@evil.example")])
    verdict = await tether_client.revise(stack.client, run_id, tether_client.DecisionInput(by="alice", reason="correction"), steps)
    assert verdict.record is not None and verdict.record.to_state.value == "VALIDATED"
    await expect(page.locator("#changed")).to_contain_text("This plan changed — review the new one")

    await page.click("#approve")  # the form posts the plan the page showed
    await expect(page.locator("#changed-outcome")).to_have_text(desk.CHANGED)
    await expect(page.locator("#outcome")).to_contain_text("Nothing was approved")
    await page.screenshot(path=str(SCREENSHOT_DIR / "inbox-swapped.png"), full_page=True)
    after = await stack.wait(run_id, "AWAITING_APPROVAL")
    assert after.approved_by == [] and after.plan.version == 2
    assert after.pending_approval.plan_hash != snap.pending_approval.plan_hash
    records = await tether_client.timeline(stack.client, run_id)
    assert [r.rule for r in records if r.kind == "refused"] in (["stale_plan_hash"], ["stale_request"])
    assert not [r for r in billing.refunds() if r["order_id"] == "A-1001"]
    # Opened again, the page shows the new plan: bob sees what he would approve now.
    await page.goto(f"{stack.dev_url}/runs/{run_id}")
    await expect(page.locator("table.steps")).to_contain_text("490.00 EUR (49000)")
    await expect(page.locator("table.steps")).to_contain_text("mallory@evil.example")
    await expect(page.get_by_text("version 2, hash")).to_be_visible()  # the plan's own version
    await stack.client.get_workflow_handle(run_id).cancel(reason="test over")  # an operator's cancel
