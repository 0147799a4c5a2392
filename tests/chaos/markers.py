"""Marker file names shared by the chaos tools (worker side) and the harness (test side)."""

from __future__ import annotations

import re


def marker_name(key: str, attempt: int, point: str) -> str:
    """``<idempotency key>.<attempt>.<checkpoint>``, safe as a file name."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.{attempt}.{point}"


def gate_name(key: str, attempt: int) -> str:
    """The file that releases one attempt's held response (CHAOS_HOLD=during), one per call:
    the harness lets each response go as soon as it has done what that call waits for."""
    return "release-" + marker_name(key, attempt, "during")
