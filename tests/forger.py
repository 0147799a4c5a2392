"""A workflow that is not Tether's, continuing as new into AgentRun with state it made up: what
a hostile worker on the namespace could do. Its own module: the sandbox re-imports it."""

from __future__ import annotations

from typing import Any

from temporalio import workflow


@workflow.defn(name="Forger")
class Forger:
    @workflow.run
    async def run(self, forged: dict[str, Any]) -> None:
        workflow.continue_as_new(forged, workflow="AgentRun")
