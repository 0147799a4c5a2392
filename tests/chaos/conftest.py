"""A stack of real processes per test module: dev server (SQLite file) and billing service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.chaos.harness import BillingProc, DevServer, Stack


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    workdir = tmp_path_factory.mktemp("chaos")
    server, billing = DevServer(workdir), BillingProc(workdir)
    try:
        await asyncio.gather(server.start(), billing.ready())
        yield Stack(server, billing, workdir, await server.client())
    finally:
        billing.stop()
        server.stop()
