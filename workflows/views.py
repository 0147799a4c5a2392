"""The run as it shows itself: its bounded result and its executed steps.
"""

from __future__ import annotations

from workflows.contract import ExecutedStep
from workflows.run_model import RunModel
from workflows.run_state import RunOutcome


class Views(RunModel):
    """The run's result and steps as its queries show them."""

    def outcome(self, run_id: str) -> RunOutcome:
        """The run's result: bounded, without the steps and the timeline (the queries and the
        audit sink have them), with their counts."""
        data = self.data
        return RunOutcome(
            run_id=run_id,
            state=data.lifecycle.state,
            answer=data.answer,
            records=data.lifecycle.records,
            steps_executed=data.steps_executed,
            steps_before=data.executed_before,
            steps_digest=data.executed_digest,
            compensations=data.compensations,
        )

    def steps(self) -> list[ExecutedStep]:
        """The executed steps: ids, outcomes and digests, no arguments or observations."""
        return [s.model_copy(update={"observation": "", "args": {}}) for s in self.data.executed]
