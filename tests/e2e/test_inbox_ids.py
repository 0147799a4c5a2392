"""Ids are data, never paths: in the real Chromium, the row of a run whose id holds `..`, `/`,
`%2f`, `?`, `#` or fullwidth letters opens that run's own page, never another run's (a 1.00 EUR
run named ``t/../victim`` once opened the 99.00 EUR ``victim``)."""

from __future__ import annotations

import uuid

import pytest
import pytest_asyncio

import tether.client as tether_client
from tests.helpers.billing import Billing
from tests.helpers.runs import make_request
from tests.helpers.inbox_stack import Stack, inbox_stack

# A bound against a hang, not a margin: a loaded machine with the workflow cache off (make
# test-replay) renders a page whose run replays its history first.
EXPECT_TIMEOUT_MS = 60_000


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(chromium, dev_env, tmp_path_factory) -> Stack:
    async with inbox_stack(dev_env, tmp_path_factory.mktemp("inbox-ids"), jwks=False, dev_login=True) as s:
        yield s


def refund(cents: int) -> list[dict]:
    return [{"tool": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": cents, "reason": "ids"}}]


async def start(stack: Stack, run_id: str, cents: int) -> str:
    request = make_request(refund(cents), tenant=stack.tenant, requested_by="alice")
    await tether_client.start_run(stack.client, request, run_id=run_id, queue=stack.worker.task_queue)
    return run_id


@pytest.mark.asyncio(loop_scope="session")
async def test_a_run_whose_id_looks_like_a_path_opens_its_own_page(stack: Stack, browser_page, billing: Billing) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    page = browser_page
    u = uuid.uuid4().hex[:6]
    victim = await start(stack, f"victim-{u}", 9900)
    hostile = [
        f"tiny-{u}/../victim-{u}",
        f"tiny-{u}%2f..%2fvictim-{u}",
        f"tiny-{u}?id=victim-{u}#top",
        f"../victim-{u}",
        f"./ｖｉｃｔｉｍ-{u}/..",
    ]
    for run_id in hostile:
        await start(stack, run_id, 100)
    for run_id in (victim, *hostile):
        await stack.wait(run_id, "AWAITING_APPROVAL")
        await stack.visible(run_id)

    await page.goto(f"{stack.dev_url}/login")
    await page.click("#signin-bob")
    await page.wait_for_url(f"{stack.dev_url}/")
    rows = page.locator("tr.waiting-run")
    for run_id in hostile:
        await page.goto(f"{stack.dev_url}/")
        await expect(rows).to_have_count(len(hostile) + 1)
        # The row whose data-run is exactly this id (one id is a substring of another).
        ids = [await rows.nth(i).get_attribute("data-run") for i in range(await rows.count())]
        await rows.nth(ids.index(run_id)).locator("a").click()
        await expect(page.locator("#run-id")).to_have_text(run_id)
        await expect(page.locator("table.steps")).to_contain_text("1.00 EUR")
        assert "99.00" not in await page.locator("table.steps").inner_text()
        # The page's live fragment and its decide form name the same run.
        live = await page.get_attribute("#live", "data-live")
        action = await page.get_attribute("form.decide-form", "action")
        assert live and action and "/run/live?id=" in live and action.startswith("/run/decide?id=")
    # And the victim's own row opens the victim.
    await page.goto(f"{stack.dev_url}/")
    await page.locator(f'tr[data-run="{victim}"] a').click()
    await expect(page.locator("#run-id")).to_have_text(victim)
    await expect(page.locator("table.steps")).to_contain_text("99.00 EUR")
