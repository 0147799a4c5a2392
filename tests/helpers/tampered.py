"""A bad build of AgentRun, for `tether repair` to heal (tests/tether/test_repair.py): once the run is
approved it starts a timer today's code never starts (its history no longer replays on today's
code), and the workflow task that would end the run, after its write, fails every time. (Its own module: the workflow
sandbox re-imports the module a workflow lives in.)"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.agent_run import AgentRun
    from workflows.run_state import RunOutcome

BROKEN = "deliberately broken build: the task that ends the run fails"


@workflow.defn(name="AgentRun")
class TamperedAgentRun(AgentRun):
    @workflow.run
    async def run(self, *args: Any) -> RunOutcome:
        async def extra_timer() -> None:
            await workflow.wait_condition(lambda: bool(self.data.approved_by))
            await workflow.sleep(timedelta(hours=1))

        timer = asyncio.create_task(extra_timer())
        main = asyncio.create_task(super().run(*args))
        await workflow.wait_condition(lambda: main.done() or self.data.lifecycle.terminal)
        timer.cancel()
        raise RuntimeError(BROKEN)


STUCK_AFTER_WRITE = "deliberately broken build: the task after the first write fails"


@workflow.defn(name="AgentRun")
class StuckAfterFirstWrite(AgentRun):
    """A bad build whose workflow task fails every time from the one that takes the plan's
    first step's result on: its history up to there replays on today's code, so `tether repair`
    resets to the task that scheduled the write (a refund: idempotent, safe to run again)."""

    @workflow.run
    async def run(self, *args: Any) -> RunOutcome:
        main = asyncio.create_task(super().run(*args))
        await workflow.wait_condition(lambda: main.done() or bool(self.data.executed))
        raise RuntimeError(STUCK_AFTER_WRITE)
