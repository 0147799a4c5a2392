"""A newcomer's approval of the demo refund, on every surface, in the real Chromium: the inbox's
list and run page, the CLI (`tether status` and the approve prompt, on a terminal), and the
Temporal Web UI's User Metadata, all on one dev server (its UI on) with the run waiting on bob.

Each shows the goal, who asked, what the lookup found (where the surface shows it) and the money
in words; the screenshots land in TETHER_SCREENSHOT_DIR/screenshots (``make screenshots``:
docs/screenshots/, shown in docs/approving.md).
"""

from __future__ import annotations

import asyncio
import html

import pytest
import pytest_asyncio

from tests.helpers.billing import Billing
from tests.helpers.paths import BIN
from tests.helpers.browser import SCREENSHOT_DIR, UiEnv
from tests.helpers.browser import rendered
from tests.helpers.cli import Cli
from tests.helpers.inbox_stack import Stack, inbox_stack
from tests.helpers.terminal import in_terminal
from tests.helpers.demo_refund import GOAL, a_model_looks_up_then_refunds

EXPECT_TIMEOUT_MS = 15_000
SHOTS = SCREENSHOT_DIR / "screenshots"
# The CLI's text as a terminal shows it, for a screenshot (the text itself is escaped: html.escape).
TERMINAL_PAGE = """<!doctype html><meta charset="utf-8"><style>
body {{ margin: 0; background: #1e1e1e; }}
pre {{ margin: 0; padding: 16px; color: #e6e6e6; font: 13px/1.45 "DejaVu Sans Mono", monospace; white-space: pre-wrap; }}
b {{ color: #8ae234; font-weight: normal; }}
</style><pre>{text}</pre>"""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(ui_env: UiEnv, tmp_path_factory) -> Stack:
    async with inbox_stack(ui_env.env, tmp_path_factory.mktemp("screens"), jwks=False, dev_login=True) as s:
        yield s


async def terminal_shot(page, text: str, name: str) -> None:
    """``text`` (what the terminal showed) as a dark terminal, screenshot to ``name``."""
    lines = text.replace("\r\n", "\n").rstrip("\n").split("\n")
    body = "\n".join(f"<b>{html.escape(line)}</b>" if line.startswith("$ ") else html.escape(line) for line in lines)
    await page.set_viewport_size({"width": 1100, "height": 200})
    await page.goto("about:blank")  # not under the inbox's CSP, which refuses an inline style
    await page.set_content(TERMINAL_PAGE.format(text=body))
    await page.locator("pre").screenshot(path=str(SHOTS / name))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_newcomers_approval_of_the_demo_refund_on_every_surface(
    stack: Stack, ui_env: UiEnv, browser_page, billing: Billing, monkeypatch: pytest.MonkeyPatch
) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser_page
    run_id = await a_model_looks_up_then_refunds(stack, monkeypatch)

    # ------------------------------------------------------------------ the inbox
    await page.set_viewport_size({"width": 1280, "height": 720})
    await page.goto(f"{stack.dev_url}/login")
    await page.click("#signin-bob")
    await page.wait_for_url(f"{stack.dev_url}/")
    row = page.locator(f'tr[data-run="{run_id}"]')
    await expect(row.locator("td.goal")).to_have_text(GOAL)
    await expect(row.locator("td.requested-by")).to_have_text("alice (claimed)")
    await expect(row.locator("td.what")).to_contain_text("49.99 EUR (4999)")
    await expect(row.locator("td.what")).to_contain_text("unsafe: never re-run")
    await page.screenshot(path=str(SHOTS / "approval-inbox-list.png"))
    await row.locator("a").first.click()
    await expect(page.locator("#goal")).to_have_text(GOAL)
    await expect(page.locator("#requested-by")).to_have_text("alice (claimed)")
    await expect(page.locator("#found")).to_contain_text("ada@example.com")
    await expect(page.locator("table.steps")).to_contain_text("49.99 EUR")
    await expect(page.locator("table.steps")).to_contain_text("Refund (part of) an order")
    await page.screenshot(path=str(SHOTS / "approval-inbox-run.png"), full_page=True)

    # ------------------------------------------------------------------ the CLI
    cli = Cli(ui_env.env, stack.worker)
    code, status, err = await cli("status", run_id)
    assert code == 0, err
    for expected in (f"goal       {GOAL}", "asked by   alice (claimed)", 'customer_email: "ada@example.com"',
                     "amount_cents: 49.99 EUR (4999)", "send_email: cannot be undone; unsafe: never re-run"):
        assert expected in status, (expected, status)
    argv = [str(BIN / "tether"), "approve", run_id, "--by", "bob"]
    code, prompt = await asyncio.to_thread(in_terminal, argv, cli.env, "n")
    assert code == 1 and f"asked by alice (claimed): {GOAL}" in prompt and "49.99 EUR (4999)" in prompt, prompt
    await terminal_shot(page, f"$ tether status {run_id}\n{status}", "approval-cli-status.png")
    await terminal_shot(page, f"$ tether approve {run_id} --by bob\n{prompt}", "approval-cli-approve.png")

    # ------------------------------------------------------------------ the Temporal Web UI
    await page.set_viewport_size({"width": 1280, "height": 1100})
    await page.goto(f"{ui_env.ui_url}/namespaces/default/workflows/{run_id}")
    await page.get_by_role("tab", name="User Metadata").click()
    await expect(rendered(page, "summary")).to_contain_text(GOAL.split(" (")[0])
    details = rendered(page, "current-details")
    for expected in ("Goal:", "requested by alice (claimed)", "What the run found:", "get_order",
                     "49.99 EUR (4999)", "unsafe: never re-run",
                     "can be undone by void_refund", "Waiting for approval"):
        await expect(details, f"current details lack {expected!r}").to_contain_text(expected)
    await page.screenshot(path=str(SHOTS / "approval-webui.png"))
    await stack.client.get_workflow_handle(run_id).cancel(reason="screenshots taken")
