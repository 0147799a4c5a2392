"""What the workers' audit sink and effect ledger hold, as a client reads them: one execution's
records, and where each write's undo stands.
"""

from __future__ import annotations

from workflows.contract import CompensationCall
from workflows.states import TransitionRecord


async def _sink_records(workflow_id: str, run_id: str) -> list[TransitionRecord]:
    """The records of this execution the audit sink (the workers', TETHER_AUDIT_DSN /
    TETHER_AUDIT_DIR) holds; none when this client cannot read it."""
    from tether.audit.sink import sink_from_env

    try:
        sink = sink_from_env()
        try:
            streams = await sink.read(workflow_id)
        finally:
            await sink.aclose()
    except Exception:  # noqa: BLE001 (not this client's sink to read: the view alone is shown)
        return []
    return streams.get(run_id, [])


async def undo_standing(compensations: list[CompensationCall]) -> list[CompensationCall]:
    """Each write's undo as the workers' effect ledger (beside their audit sink: TETHER_AUDIT_DSN /
    TETHER_AUDIT_DIR) says it stands: undone by which run and when, or started with its outcome
    unknown (it may have applied). ``unknown`` where this client cannot read the ledger (the
    ledger is the witness: never "pending" for want of it); ``ledger_standing`` says why."""
    return (await ledger_standing(compensations))[0]


async def ledger_standing(compensations: list[CompensationCall]) -> tuple[list[CompensationCall], str | None]:
    """``undo_standing``, and why the ledger could not be read (None when it was)."""
    if not any(c.tool and c.status != "ok" for c in compensations):
        return compensations, None
    from tether.audit.sink import sink_from_env
    from tether.store.effect_ledger import ledger_for, standing_in

    try:
        ledger = ledger_for(sink_from_env())
        try:
            return await standing_in(ledger, compensations), None
        finally:
            await ledger.aclose()
    except Exception as e:  # noqa: BLE001 (any reason: where each write stands is unknown)
        unread = [c.model_copy(update={"status": "unknown"}) if c.tool and c.status != "ok" else c for c in compensations]
        return unread, f"the effect ledger cannot be read ({type(e).__name__}: {str(e)[:300]})"
