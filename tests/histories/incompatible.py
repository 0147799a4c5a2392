"""An incompatible change to AgentRun, for the replay test to catch: a timer before the run's
first activity. (Its own module: the workflow sandbox re-imports the module a workflow lives in.)"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.agent_run import AgentRun
    from workflows.run_state import RunOutcome


@workflow.defn(name="AgentRun")
class ReorderedAgentRun(AgentRun):
    @workflow.run
    async def run(self, *args: Any) -> RunOutcome:
        await workflow.sleep(1)
        return await super().run(*args)
