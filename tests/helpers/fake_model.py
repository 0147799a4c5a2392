"""The worker's model planner pointed at a scripted OpenAI-compatible model
(examples/fake_openai.py), for the tests whose run plans with ``--planner model``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from examples.fake_openai import FakeOpenAI


@contextmanager
def fake_model(monkeypatch: pytest.MonkeyPatch, api_key: str = "sk-test") -> Iterator[FakeOpenAI]:
    """A scripted model (``fake.script(...)``) the planner of a worker in this process calls,
    up until the block ends."""
    with FakeOpenAI() as fake:
        monkeypatch.setenv("TETHER_MODEL", "tether-test-model")
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", api_key)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        yield fake
