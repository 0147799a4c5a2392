"""A workflow that is not Tether's, continuing as new into AgentRun with state it made up: what
a hostile worker on the namespace could do. Its own module: the sandbox re-imports it."""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import keys


@workflow.defn(name="Forger")
class Forger:
    @workflow.run
    async def run(self, forged: dict[str, Any]) -> None:
        workflow.continue_as_new(forged, workflow="AgentRun")


@workflow.defn(name="NewerWorker")
class NewerWorker:
    """Stands for a newer worker version's AgentRun (worker code, trusted): it seals the state it
    carries with the fleet's key, in its workflow code, and continues as new."""

    @workflow.run
    async def run(self, carried: dict[str, Any]) -> None:
        info = workflow.info()
        # Trusted worker code: it seals with the fleet key the worker hands its workflow code.
        sealed = keys.seal(keys.worker_ring(workflow.extern_functions), info.workflow_id, info.run_id, 1, carried["digest"])
        workflow.continue_as_new(
            {**carried["request"], "carryover_seal": sealed}, workflow="AgentRun", task_queue=carried.get("task_queue")
        )
