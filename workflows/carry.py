"""Carrying the run over: when it continues as new, what that writes (the folded state) and
its size.
"""

from __future__ import annotations

import hashlib

from workflows.budgets import (
    CARRY_AMORTIZE,
    CARRY_BUDGET,
    CARRY_CONTINUE_AT,
    CARRY_TIMELINE_TAIL,
    EXECUTED_WINDOW,
    REQUEST_BUDGET,
    UPDATES_CONTINUE_AT,
    continue_due,
    continue_wanted,
)
from workflows.commands import Checkpoint, ContinueAsNew, Probe, Readings
from workflows.run_model import Program, RunFailed, RunModel, S
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

    def wants_continue(self, seen: Readings) -> bool:
        """The server suggests continue-as-new, and the run has not put it off (or its history
        has got where it put it off to)."""
        return seen.suggested and continue_wanted(
            history_bytes=seen.history_bytes,
            history_events=seen.history_events,
            deferred_to=self.continue_at,
        )

    def updates_exhausted(self, handlers_finished: bool) -> bool:
        """Near Temporal's per-run Update limit, with no Update in flight: time to continue."""
        return self.updates >= UPDATES_CONTINUE_AT and handlers_finished

    def _quiet(self, seen: Readings) -> bool:
        """Nothing accepted but not yet acted on, and nothing in flight that continuing would lose."""
        return not self.inbox and self.pending_handoff is None and not seen.notifying and seen.handlers_finished

    def _maybe_continue_as_new(self) -> Program[None]:
        data = self.data
        self.loops += 1
        seen = yield Probe()
        suggested = self.wants_continue(seen) or self.updates_exhausted(seen.handlers_finished)
        if suggested and self.early:
            # Not carried: refused on the record here, so their Updates end and the run continues.
            self.apply(lambda now: self.refuse_early(now))
            seen = yield Probe()
        if not suggested and self.loops % 16:
            return
        # Only between steps: no tool in flight and nothing accepted but not yet acted on.
        if data.lifecycle.state not in (S.PLANNING, S.AWAITING_APPROVAL, S.OBSERVING_RESULT) or not self._quiet(seen):
            return
        # The carried state is measured only here (it costs a serialisation), not every loop.
        size = len(data.model_dump_json())
        if not suggested and size < CARRY_CONTINUE_AT:
            return
        carried = None  # what continuing writes (the folded state and the request), once measured
        if suggested and size < CARRY_CONTINUE_AT and not self.updates_exhausted(seen.handlers_finished):
            carried = self.carried_bytes()
            if not continue_due(history_bytes=seen.history_bytes, history_events=seen.history_events, carry_bytes=carried):
                self.continue_at = CARRY_AMORTIZE * carried  # asked again once history is there
                return
        # Held early decisions are not carried (a continue for size, not suggested, reaches here
        # with some): refused on the record first, never lost.
        if self.early:
            self.apply(lambda now: self.refuse_early(now))
        # Every record to the sink and the view published first; then nothing is awaited until
        # the run continues, so the state sealed is the state carried (signals that come in
        # meanwhile wait for the next loop).
        yield Checkpoint()
        seen = yield Probe()
        if not self._quiet(seen):
            return  # a decision or handoff came in meanwhile: act on it first
        self.fold_for_carry()  # the next run gets the latest steps and records
        size = carried if carried is not None else (
            len(data.model_dump_json()) + len(self.request.model_dump_json(exclude={"carryover"}))
        )
        if size > CARRY_BUDGET + REQUEST_BUDGET:
            # Cleanly, with the reason: a payload over the limit would fail every workflow task.
            raise RunFailed(
                f"carried state and request are {size} bytes, over their "
                f"{CARRY_BUDGET + REQUEST_BUDGET}-byte budget",
                "carry_budget",
            )
        yield ContinueAsNew()


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
