"""A workflow that is not Tether's, continuing as new into AgentRun with state it made up: what
a hostile worker on the namespace could do. Its own module: the sandbox re-imports it."""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.models import SealRequest


@workflow.defn(name="Forger")
class Forger:
    @workflow.run
    async def run(self, forged: dict[str, Any]) -> None:
        workflow.continue_as_new(forged, workflow="AgentRun")


@workflow.defn(name="NewerWorker")
class NewerWorker:
    """Stands for a newer worker version's AgentRun (worker code, trusted): it seals the state it
    carries with the fleet's key, through the run's own local activity, and continues as new."""

    @workflow.run
    async def run(self, carried: dict[str, Any]) -> None:
        from datetime import timedelta

        sealed = await workflow.execute_local_activity(
            "carryover_seal",
            SealRequest(workflow_id=workflow.info().workflow_id, digest=carried["digest"], generation=1),
            result_type=SealRequest,
            start_to_close_timeout=timedelta(seconds=10),
        )
        workflow.continue_as_new(
            {**carried["request"], "carryover_seal": sealed.seal}, workflow="AgentRun", task_queue=carried.get("task_queue")
        )
