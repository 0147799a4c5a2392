"""Browser fixtures: a dev server with its Web UI on free ports, and the system Chromium.

Nothing is downloaded. The browser is the one the system has (Debian's ``chromium``, or
``TETHER_CHROMIUM=/path/to/chrome``), driven by Playwright's Python package, whose bundled driver
needs no browser download when it gets ``executable_path``. Never run ``playwright install``.

Without a Chromium (or without Playwright) the browser tests skip, unless ``CI`` is set: in CI a
missing browser is a failure, because `.ci/run` installs one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from tests.helpers.ports import free_port
from tests.helpers.browser import CHROMIUM_ARGS, UiEnv, find_chromium
from tests.helpers.parts import unavailable
from tests.helpers.paths import BIN
from workflows.published import SEARCH_ATTRIBUTES

@pytest.fixture(scope="session")
def chromium() -> str:
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        unavailable("Playwright for Python is not installed (pip install -e '.[dev]')")
    path = find_chromium()
    if path is None:
        unavailable(
            "no Chromium found (apt-get install chromium, or set TETHER_CHROMIUM=/path/to/chrome)"
        )
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ui_env(chromium: str) -> AsyncIterator[UiEnv]:
    """A dev server of our own with the Web UI on: never the demo's ports 7233/8233."""
    ui_port = free_port()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        ui=True,
        ui_port=ui_port,
        search_attributes=SEARCH_ATTRIBUTES,
        data_converter=pydantic_data_converter,
        dev_server_extra_args=["--ui-disable-news-fetch"],
    )
    try:
        yield UiEnv(
            env=env,
            ui_url=f"http://127.0.0.1:{ui_port}",
            address=env.client.service_client.config.target_host,
        )
    finally:
        await env.shutdown()


@pytest_asyncio.fixture(loop_scope="session")
async def browser_page(chromium: str, tmp_path: Path) -> AsyncIterator["object"]:
    """A fresh Chromium profile and one page, 1440x1000 (the size of the docs/ screenshots)."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            user_data_dir=str(tmp_path / "chromium-profile"),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 1000},
            timezone_id="UTC",
            locale="en-US",
        )
        try:
            context.set_default_timeout(60_000)  # a bound against a hang (EXPECT_TIMEOUT_MS)
            page = context.pages[0] if context.pages else await context.new_page()
            yield page
        finally:
            await context.close()
