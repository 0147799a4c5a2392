"""A system part the suite needs (PostgreSQL, Chromium) is missing: skip locally with the one line
saying how to install it, fail in CI (which installs everything)."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """CI sets CI=true: there everything the suite needs is installed (.ci/run), so a missing
    part is a failure, never a skip."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> None:
    """A system part the suite needs (PostgreSQL, Chromium) is missing: skip locally, with the
    one line saying how to install it; fail in CI, which installs it."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so this is a failure, not a skip)", pytrace=False)
    pytest.skip(reason)
