"""Runs whose ``cancel`` Update is refused before history, as a real AgentRun's is once it has
taken UPDATES_CONTINUE_AT Updates and not yet continued (a flood of 1,500 Updates that never
pauses is too slow for a test). The refusal is AgentRun's own (policy.updates_refusal, raised as
its validator raises it); ``OlderRun`` stands for an older build whose validator raised a plain
error. Their own module: the sandbox re-imports it."""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import policy
    from workflows.budgets import UPDATES_CONTINUE_AT
    from workflows.contract import DecideResult


@workflow.defn(name="FloodedRun")
class FloodedRun:
    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.update(name="cancel")
    async def cancel(self, *args: Any) -> DecideResult:
        raise AssertionError("the validator refuses every cancel")

    @cancel.validator
    def _validate_cancel(self, *args: Any) -> None:
        refusal = policy.updates_refusal(UPDATES_CONTINUE_AT)
        assert refusal is not None
        raise ApplicationError(f"cancel refused [{refusal.rule}]: {refusal.message}", type=refusal.rule)


@workflow.defn(name="OlderRun")
class OlderRun:
    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.update(name="cancel")
    async def cancel(self, *args: Any) -> DecideResult:
        raise AssertionError("the validator refuses every cancel")

    @cancel.validator
    def _validate_cancel(self, *args: Any) -> None:
        raise ValueError("this build takes no cancel request")
