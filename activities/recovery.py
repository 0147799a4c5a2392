"""The ``recovery_source`` activity: what an ended run's record says its compensations are.

A compensation run (``tether compensate RUN``) reads the original run from the Temporal server,
never from its own input: the compensations, their idempotency keys and the plan hashes that
covered them are the original workflow's own state (its ``snapshot`` query, which a worker
answers by replaying its history), so a client cannot forge what gets undone.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from tether.store.keys import KeyRing, attest
from tether.store.effect_ledger import EffectLedger, LedgerUnavailable, standing_in
from workflows.contract import CompensationCall
from workflows.wire import RecoveryRequest, RecoverySource, Refusal
from workflows.run_state import RunSnapshot


class RecoveryActivities:
    def __init__(self, client: Client, keys: KeyRing, ledger: EffectLedger | None = None) -> None:
        self.client = client
        self.keys = keys  # attests the answer: a keyless poller cannot say what gets undone
        self.ledger = ledger  # what any run already undid, or started (tether/store/effect_ledger.py)

    @activity.defn(name="recovery_source")
    async def recovery_source(self, request: RecoveryRequest) -> RecoverySource:
        return attest(self.keys, request, await self._source(request))

    async def _source(self, request: RecoveryRequest) -> RecoverySource:
        def refused(rule: str, message: str) -> RecoverySource:
            return RecoverySource(run_id=request.run_id, refusal=Refusal(rule=rule, message=message))

        handle = self.client.get_workflow_handle(request.run_id)
        try:
            description = await handle.describe()
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                return refused("unknown_run", f"no run {request.run_id!r} in this namespace")
            raise
        if description.workflow_type != "AgentRun":
            return refused("unknown_run", f"{request.run_id!r} is not a Tether run")
        if description.status == WorkflowExecutionStatus.RUNNING:
            return refused("still_running", f"run {request.run_id} is still running: it must end (hand it off) first")
        snap = await handle.query("snapshot", result_type=RunSnapshot)
        if snap.tenant != request.tenant:
            # Same answer as an unknown run: one tenant does not learn about another's runs.
            return refused("unknown_run", f"no run {request.run_id!r} in tenant {request.tenant!r}")
        try:
            standing = await self.standing(snap.compensations)
        except LedgerUnavailable as e:
            # The ledger is the witness of what was undone: without it nothing is, and the run
            # says why (a ledger that is only unreachable for now raises instead: read again).
            return refused("ledger_unavailable", f"{e}; nothing was undone: restore it, then tether compensate again")
        return RecoverySource(run_id=request.run_id, state=snap.state, compensations=standing, spent=snap.spent)

    async def standing(self, compensations: list[CompensationCall]) -> list[CompensationCall]:
        """The original's compensations as the undo ledger says they stand now: done by a
        compensation run (``ok``), or started with the outcome unknown (``unknown``: it may
        have applied). The original's record is closed; its compensation runs wrote here."""
        if self.ledger is None:
            return compensations
        return await standing_in(self.ledger, compensations)
