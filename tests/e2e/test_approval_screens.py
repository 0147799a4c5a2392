"""A newcomer's approval, on every surface, in the real Chromium: the inbox's list and run page,
the CLI (`tether status` and the approve prompt, on a terminal), and the Temporal Web UI's User
Metadata, all on one dev server (its UI on) with the run waiting on bob. Twice: the demo refund,
and a tool of one's own (docs/writing-tools.md's ``goodwill.py``, loaded into a registry of its
own, served by a worker of its own), whose compensation's page then names the run it undoes.

Each shows the goal, who asked, what the lookup found (where the surface shows it) and the money
in words; the screenshots land in TETHER_SCREENSHOT_DIR/screenshots (``make screenshots``:
docs/screenshots/, shown in docs/approving.md).
"""

from __future__ import annotations

import asyncio
import html
import re
from dataclasses import dataclass

import pytest
import pytest_asyncio

from tests.helpers.billing import Billing
from tests.helpers.paths import BIN
from tests.helpers.browser import SCREENSHOT_DIR, UiEnv
from tests.helpers.browser import rendered, sign_in
from tests.helpers.cli import Cli
from tests.helpers.inbox_stack import Stack, inbox_stack
from tests.helpers.terminal import in_terminal
from tests.helpers.demo_refund import GOAL, a_model_looks_up_then_refunds
from tests.helpers import own_tool
from tests.helpers.own_tool import a_model_looks_up_then_credits, goodwill_tools

# A bound against a hang, not a margin: a loaded machine with the workflow cache off (make
# test-replay) renders a page whose run replays its history first.
EXPECT_TIMEOUT_MS = 60_000
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


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def own_stack(ui_env: UiEnv, tmp_path_factory) -> Stack:
    """An inbox stack whose worker serves only the page's goodwill tools (a registry of its own)."""
    with goodwill_tools(tmp_path_factory.mktemp("goodwill")) as registry:
        async with inbox_stack(ui_env.env, tmp_path_factory.mktemp("own-screens"), jwks=False, dev_login=True,
                               registry=registry) as s:
            yield s


async def terminal_shot(page, text: str, name: str) -> None:
    """``text`` (what the terminal showed) as a dark terminal, screenshot to ``name``."""
    lines = text.replace("\r\n", "\n").rstrip("\n").split("\n")
    body = "\n".join(f"<b>{html.escape(line)}</b>" if line.startswith("$ ") else html.escape(line) for line in lines)
    await page.set_viewport_size({"width": 1100, "height": 200})
    await page.goto("about:blank")  # not under the inbox's CSP, which refuses an inline style
    await page.set_content(TERMINAL_PAGE.format(text=body))
    await page.locator("pre").screenshot(path=str(SHOTS / name))


@dataclass(frozen=True)
class Expected:
    """What each surface must show of one run (besides its goal and who asked)."""

    shots: str  # the screenshots' name prefix
    listed: tuple[str, ...]  # the inbox list's "what it will do"
    found: tuple[str, ...]  # the run page's "what the run found"
    steps: tuple[str, ...]  # the run page's plan
    status: tuple[str, ...]  # `tether status`
    prompt: tuple[str, ...]  # the approve prompt
    details: tuple[str, ...]  # the Web UI's current details


async def every_surface(page, stack: Stack, ui_env: UiEnv, run_id: str, goal: str, expected: Expected) -> None:
    """bob's view of ``run_id`` on the inbox (list, run page), the CLI and the Web UI: each shows
    the goal, who asked and what ``expected`` says; a screenshot of each."""
    from playwright.async_api import expect

    # ------------------------------------------------------------------ the inbox
    await page.set_viewport_size({"width": 1280, "height": 720})
    await page.goto(f"{stack.dev_url}/login")
    await page.click("#signin-bob")
    await page.wait_for_url(f"{stack.dev_url}/")
    row = page.locator(f'tr[data-run="{run_id}"]')
    await expect(row.locator("td.goal")).to_have_text(goal)
    await expect(row.locator("td.requested-by")).to_have_text("alice (claimed)")
    for text in expected.listed:
        await expect(row.locator("td.what")).to_contain_text(text)
    await page.screenshot(path=str(SHOTS / f"{expected.shots}-inbox-list.png"))
    await row.locator("a").first.click()
    await expect(page.locator("#goal")).to_have_text(goal)
    await expect(page.locator("#requested-by")).to_have_text("alice (claimed)")
    for text in expected.found:
        await expect(page.locator("#found")).to_contain_text(text)
    for text in expected.steps:
        await expect(page.locator("table.steps")).to_contain_text(text)
    await page.screenshot(path=str(SHOTS / f"{expected.shots}-inbox-run.png"), full_page=True)

    # ------------------------------------------------------------------ the CLI
    cli = Cli(ui_env.env, stack.worker)
    code, status, err = await cli("status", run_id)
    assert code == 0, err
    for text in (f"goal       {goal}", "asked by   alice (claimed)", *expected.status):
        assert text in status, (text, status)
    argv = [str(BIN / "tether"), "approve", run_id, "--by", "bob"]
    code, prompt = await asyncio.to_thread(in_terminal, argv, cli.env, "n")
    assert code == 1, prompt
    for text in (f"asked by alice (claimed): {goal}", *expected.prompt):
        assert text in prompt, (text, prompt)
    await terminal_shot(page, f"$ tether status {run_id}\n{status}", f"{expected.shots}-cli-status.png")
    await terminal_shot(page, f"$ tether approve {run_id} --by bob\n{prompt}", f"{expected.shots}-cli-approve.png")

    # ------------------------------------------------------------------ the Temporal Web UI
    await page.set_viewport_size({"width": 1280, "height": 1100})
    await page.goto(f"{ui_env.ui_url}/namespaces/default/workflows/{run_id}")
    await page.get_by_role("tab", name="User Metadata").click()
    await expect(rendered(page, "summary")).to_contain_text(goal.split(" (")[0])
    details = rendered(page, "current-details")
    for text in ("Goal:", "requested by alice (claimed)", "What the run found:", *expected.details, "Waiting for approval"):
        await expect(details, f"current details lack {text!r}").to_contain_text(text)
    await page.screenshot(path=str(SHOTS / f"{expected.shots}-webui.png"))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_newcomers_approval_of_the_demo_refund_on_every_surface(
    stack: Stack, ui_env: UiEnv, browser_page, billing: Billing, monkeypatch: pytest.MonkeyPatch
) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    SHOTS.mkdir(parents=True, exist_ok=True)
    run_id = await a_model_looks_up_then_refunds(stack, monkeypatch)
    await every_surface(browser_page, stack, ui_env, run_id, GOAL, Expected(
        shots="approval",
        listed=("49.99 EUR (4999)", "unsafe: never re-run"),
        found=("ada@example.com", "49.99 EUR"),
        steps=("49.99 EUR", "Refund (part of) an order"),
        status=('customer_email: "ada@example.com"', "total_cents: 49.99 EUR (4999)", "amount_cents: 49.99 EUR (4999)",
                "send_email: cannot be undone; unsafe: never re-run"),
        prompt=("49.99 EUR (4999)",),
        details=("get_order found: total_cents 49.99 EUR (4999)", "unsafe: never re-run", "can be undone by void_refund",
                 "Refund (part of) an order"),
    ))
    await stack.client.get_workflow_handle(run_id).cancel(reason="screenshots taken")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_newcomers_approval_of_a_tool_of_their_own_on_every_surface(
    own_stack: Stack, ui_env: UiEnv, browser_page, billing: Billing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/writing-tools.md's goodwill credit, its two steps as a model runs them: the lookup's
    result (the order's total, money declared on what the tool returns) and the credit in words,
    the tool's own description; then, approved and done, its compensation's page names the run
    it undoes."""
    from playwright.async_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    SHOTS.mkdir(parents=True, exist_ok=True)
    stack, page, goal = own_stack, browser_page, own_tool.GOAL
    async with a_model_looks_up_then_credits(stack, monkeypatch) as run_id:
        await every_surface(page, stack, ui_env, run_id, goal, Expected(
            shots="approval-own",
            listed=("5.00 EUR (500)", "can be undone by take_back_credit"),
            found=("120.00 EUR", "(12000)", '"paid"'),
            steps=("5.00 EUR", "Credit a customer for a bad experience"),
            status=('order_balance (order_id: "A-1002"): total_cents: 120.00 EUR (12000), status: "paid"',
                    "amount_cents: 5.00 EUR (500)", "can be undone by take_back_credit",
                    "Credit a customer for a bad experience"),
            prompt=("total_cents: 120.00 EUR (12000)", "amount_cents: 5.00 EUR (500)"),
            details=("order_balance", "120.00 EUR (12000)", "5.00 EUR (500)", "can be undone by take_back_credit",
                     "Credit a customer for a bad experience"),
        ))

        # bob approves; the credit is written; he asks to take it back: the compensation's page.
        cli = Cli(ui_env.env, stack.worker)
        code, out, err = await cli("approve", run_id, "--by", "bob", "--unreviewed")
        assert code == 0, out + err
        await stack.wait(run_id, "COMPLETED")
        code, out, err = await cli("compensate", run_id, "--by", "bob")
        assert code == 0, out + err
        undo = f"{run_id}-compensate"
        await stack.wait(undo, "AWAITING_APPROVAL")
        await stack.visible(undo)
        # bob asked for it: alice decides (four eyes), from her list.
        await page.set_viewport_size({"width": 1280, "height": 720})
        await sign_in(page, stack, "alice")
        await page.locator(f'tr[data-run="{undo}"] a').first.click()
        await expect(page.locator("#compensates")).to_contain_text(run_id)
        await expect(page.locator("#compensates a")).to_have_attribute("href", re.compile(re.escape(run_id)))
        await expect(page.locator("body")).to_contain_text("5.00 EUR")
        await expect(page.locator("body")).to_contain_text("take_back_credit")
        await page.screenshot(path=str(SHOTS / "approval-own-compensation.png"), full_page=True)
        await stack.client.get_workflow_handle(undo).cancel(reason="screenshots taken")
