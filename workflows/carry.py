"""Carrying the run over: what continue-as-new writes (the folded state) and its size.
"""

from __future__ import annotations

import hashlib

from workflows.budgets import CARRY_TIMELINE_TAIL, EXECUTED_WINDOW
from workflows.run_model import RunModel
from workflows.run_state import RunData


class Carry(RunModel):
    """What the run carries over when it continues as new."""

    def fold_for_carry(self) -> None:
        """Before continue-as-new: the next run gets the latest EXECUTED_WINDOW steps (older
        ones as a count and a running digest) and the timeline's head and latest records (the
        audit sink has every one): the carried state stops growing with the run."""
        _fold(self.data)

    def carried_bytes(self) -> int:
        """What continue-as-new would write now (the folded state and the request), without
        folding the run's own state: the live timeline keeps its window until the run goes."""
        folded = self.data.model_copy(deep=True)
        _fold(folded)
        return len(folded.model_dump_json()) + len(self.request.model_dump_json(exclude={"carryover"}))


def _fold(data: RunData) -> None:
    """Engine.fold_for_carry, on any state."""
    old = data.executed[: max(len(data.executed) - EXECUTED_WINDOW, 0)]
    digest = data.executed_digest
    for done in old:
        digest = hashlib.sha256(f"{digest}|{done.tool_call_id}|{done.outcome}|{done.digest}".encode()).hexdigest()
    data.executed_digest = digest
    data.executed_before += len(old)
    data.executed_ok_before += sum(1 for done in old if done.status == "ok")
    del data.executed[: len(old)]
    data.lifecycle.fold(CARRY_TIMELINE_TAIL)
