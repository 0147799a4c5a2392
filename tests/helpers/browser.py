"""The system's Chromium for the browser tests (Debian's ``chromium``, or
``TETHER_CHROMIUM=/path/to/chrome``), driven by Playwright with no browser download, and the dev
server with its Web UI the ``ui_env`` fixture (tests/e2e/conftest.py) starts."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from tests.helpers.inbox_stack import Stack
from tests.helpers.paths import ROOT

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# What a browser on a closed network needs: no sandbox (we run as root in CI), no GPU, and no
# background traffic to Google (updates, sync, field trials, QUIC probes, proxy auto-detection).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-quic",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--no-proxy-server",
]
# Where the test writes its screenshots; `make screenshots` points it at docs/.
SCREENSHOT_DIR = Path(os.environ.get("TETHER_SCREENSHOT_DIR") or ROOT / "build" / "e2e-screenshots")


def find_chromium() -> str | None:
    explicit = os.environ.get("TETHER_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class UiEnv:
    env: WorkflowEnvironment
    ui_url: str
    address: str


# A bound against a hang, not a margin: a loaded machine with the workflow cache off (make
# test-replay) renders a page whose run replays its history first.
EXPECT_TIMEOUT_MS = 60_000


async def sign_in(page, stack: Stack, name: str) -> None:
    await page.goto(f"{stack.dev_url}/login")
    await page.click(f"#signin-{name}")
    await page.wait_for_url(f"{stack.dev_url}/")


def rendered(page, panel: str):
    """A User Metadata panel: the UI renders each markdown field in an iframe of its own."""
    return page.frame_locator(f"#user-metadata-{panel}").locator("body")
