"""The audit activities: every timeline record, in order, into the audit sink.

**Audit sink.** The workflow keeps a bounded window of its timeline (workflows/budgets.py); every
record also goes to the sink (tether/audit/sink.py: JSON lines or PostgreSQL), in order,
through the activity ``audit_append``, or along with a write (``execute_tool`` takes the run's
packed records and writes them here first: ``AuditActivities.write``), or, for a run's last
records, through the worker's audit collector (tether/audit/collector.py), which writes
what the run left with its end view once the run has closed. Records are keyed by workflow id,
**run id** and ``seq``; appends are idempotent per stream: a retried or repeated batch never
writes a record twice. Only the run's own records, signed by the fleet for that run, are
written (tether/audit/verify.py); anything else is refused whole.

A sink that cannot write raises ``audit_sink_unavailable``; ``audit_append`` tries a few times
in quick succession, then the workflow shows the error on the run and retries on a backoff
timer, and starts no further work until every record is in (workflows/effects.py). Each failure
is logged here and counted (``tether_audit_sink_failures``). ``tether timeline RUN --all`` reads
the sink (tether.client).
"""

from __future__ import annotations

import logging
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from tether.audit.sink import SINK_FAILURES, AuditSink, sink_from_env
from tether.audit.verify import RECORDS_REFUSED, batch_problem
from tether.store.postgres import cause as db_cause
from workflows.wire import RECORD_UNVERIFIED, SINK_UNAVAILABLE, AuditAck, AuditBatch
from workflows.states import with_links

log = logging.getLogger("tether.audit")


class AuditActivities:
    def __init__(self, sink: AuditSink | None = None, publics: Any = None) -> None:
        self.sink = sink or sink_from_env()
        self.publics = publics  # the fleet's public keys (worker.create_worker sets them)

    @activity.defn(name="audit_append")
    async def audit_append(self, batch: AuditBatch | bytes) -> AuditAck:
        return AuditAck(last_seq=await self.write(batch))

    async def write(self, batch: AuditBatch | bytes) -> int:
        """The records a run sends (``audit_append``, or along with a write: execute_tool), into
        the stream of the execution whose activity this is; the last seq written. Refused whole
        unless the fleet signed them for that run; a failing sink is an ApplicationError."""
        info = activity.info()
        if not isinstance(batch, AuditBatch):  # packed (AuditBatch.packed), as the workflow sends it
            batch = AuditBatch.model_validate(batch)
        # The execution that asks is the stream's key, and its workflow id (never the batch's);
        # its records' links, which the run leaves out after the first, are filled in again.
        batch = batch.model_copy(update={
            "run_id": info.workflow_run_id or batch.run_id,
            "records": with_links(sorted(batch.records, key=lambda r: r.seq)),
        })
        self._refuse_unsigned(info.workflow_id or "", batch)  # none: no run's, refused
        try:
            return await self.sink.append(batch)
        except Exception as e:  # any sink error: visible on the run, in the log, in a metric
            cause = db_cause(e)
            log.warning(
                "audit sink failing (%s) for workflow %s run %s, records %s-%s, attempt %s: %s",
                self.sink.describe(), batch.workflow_id[:200], batch.run_id,
                batch.records[0].seq if batch.records else "-", batch.records[-1].seq if batch.records else "-",
                info.attempt, cause,
            )
            activity.metric_meter().create_counter(
                SINK_FAILURES, "Audit sink writes that failed (the run retries them)", "1"
            ).add(1, {"sink": type(self.sink).__name__})
            raise ApplicationError(f"{self.sink.describe()}: {cause}", type=SINK_UNAVAILABLE) from None

    def _refuse_unsigned(self, workflow_id: str, batch: AuditBatch) -> None:
        """Only the run's own signed records, into its own stream: anything else is refused
        whole (nothing of the batch is written), logged and counted."""
        why: str | None
        if batch.workflow_id != workflow_id:
            why = f"the batch names workflow {batch.workflow_id[:200]!r}, not the run that asks"
        elif self.publics is None:
            why = "this worker has no public keys to verify records with"
        else:
            why = batch_problem(self.publics, workflow_id, batch.run_id, batch.records)
        if why is None:
            return
        log.error("audit sink refused a batch for workflow %s run %s: %s", workflow_id[:200], batch.run_id, why)
        activity.metric_meter().create_counter(
            RECORDS_REFUSED, "Audit records refused: not signed by the fleet for the run that asked", "1"
        ).add(len(batch.records))
        raise ApplicationError(f"audit records refused: {why}", type=RECORD_UNVERIFIED, non_retryable=True)
