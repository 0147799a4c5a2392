"""Builds before and after this checkout's (workflows.published.BUILD), for the tests of two
builds side by side."""

from __future__ import annotations

from workflows.published import BUILD


def other_build(step: int) -> str:
    """The build ``step`` builds after (or, negative, before) this one. This build replays the
    previous one's runs (published.PREVIOUS_BUILD): an older build it does not replay is -2."""
    prefix, number = BUILD.rsplit("-", 1)
    return f"{prefix}-{int(number) + step}"
