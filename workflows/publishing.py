"""What a run shows: webhook notifications (started as events happen, never awaited by the
run's progress), its search attributes and Web UI details, its signed view (memo ``tether``),
and the sealed state it continues as new with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError

from workflows import keys
from workflows import metrics as run_metrics
from workflows.budgets import DETAILS_CHARS, clip
from workflows.contract import json_digest
from workflows.details import run_details
from workflows.engine import Engine
from workflows.failures import activity_failure
from workflows.published import STATE_ATTRIBUTE, TENANT_ATTRIBUTE, VIEW_MEMO
from workflows.run_state import RunData, RunRequest, RunSnapshot, RunView
from workflows.sealing import Keyed
from workflows.states import RunState, TransitionRecord, implied_links, to_publish
from workflows.wire import Notification, NotificationResult

# Webhook deliveries are retried with backoff (0.5 s, 1 s, 2 s) and never awaited by the run's
# progress; a run that ends waits for the ones in flight at most NOTIFY_BUDGET.
NOTIFY_RETRY = RetryPolicy(
    maximum_attempts=4, initial_interval=timedelta(seconds=0.5), backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
)
NOTIFY_ATTEMPT = timedelta(seconds=15)
NOTIFY_BUDGET = timedelta(seconds=75)
# The records the published view (memo "tether") carries: the latest ones; the sink has all.
VIEW_RECORDS = 5


class Publishing(Keyed):
    """The run as others see it; the state (set by ``Effects``) is what it last published."""

    engine: Engine
    data: RunData
    request: RunRequest
    snapshot: Callable[[], RunSnapshot]
    audit: list[TransitionRecord]  # records on their way to the audit sink
    audit_error: str | None
    notifying: int  # notify activities in flight
    published: str | None
    _published_checked: bool
    _tenant_published: bool
    _shown: str | None  # the current details last set
    _viewed: tuple[Any, ...] | None  # what the published view (memo) last said

    # ------------------------------------------------------------------ notifications

    def show(self) -> None:
        """Before the run awaits anything: people who take an event are being told, and the
        state is visible."""
        self.notify()
        self.publish()

    def notify(self) -> None:
        """Start a notify activity per event the policy has webhooks for; the run goes on."""
        for note in self.engine.take_notifications(workflow.info().namespace):
            self.notifying += 1
            asyncio.create_task(self._deliver(note))

    async def _deliver(self, note: Notification) -> None:
        try:
            result = await workflow.execute_activity(
                "notify",
                note.model_copy(update={"max_attempts": NOTIFY_RETRY.maximum_attempts}),
                result_type=NotificationResult,
                start_to_close_timeout=NOTIFY_ATTEMPT,
                retry_policy=NOTIFY_RETRY,
                summary=f"notify · {note.event} · {', '.join(note.webhooks)[:100]}",
            )
        except ActivityError as err:
            result = NotificationResult(dead={name: activity_failure(err).code for name in note.webhooks})
        except asyncio.CancelledError:
            self.notifying -= 1
            return  # the run is being cancelled: its own end is on the record
        self.notifying -= 1
        run_metrics.on_notification(note.event, len(result.delivered), len(result.dead))
        self.engine.notification_done(note, result, workflow.now())

    async def notified(self) -> None:
        """The ending's own event (expired, failed, handed off) and any still being retried:
        bounded by their backoff, so a dead webhook never holds the run."""
        if self.notifying:
            try:
                await workflow.wait_condition(lambda: self.notifying == 0, timeout=NOTIFY_BUDGET, timeout_summary="notifications")
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------ publishing

    def publish(self, listed_as: RunState | None = None) -> None:
        """Make the state visible before the workflow waits.

        Called before every await rather than on every move: states the run passes through
        inside one workflow task are never observable, and each upsert costs a history event.
        ``listed_as``: list the run as this state instead (RECEIVED while its first planner call
        runs is listed as PLANNING, states.first_published).
        """
        state = listed_as or self.data.lifecycle.state
        checked, self._published_checked = self._published_checked, True
        if state.value != self.published and (not checked or to_publish(self.published, state)):
            updates = [STATE_ATTRIBUTE.value_set(state.value)]
            if not self._tenant_published:
                updates.append(TENANT_ATTRIBUTE.value_set(self.request.tenant))
                self._tenant_published = True
            workflow.upsert_search_attributes(updates)
            self.published = state.value
        details = clip(self._details(), DETAILS_CHARS)
        if details != self._shown:
            workflow.set_current_details(details)
            self._shown = details

    def publish_view(self, *, ending: bool = False) -> None:
        """Where the run rests: the view ``tether status``/``list``/``timeline`` and the inbox read
        with no worker running (memo ``tether``), when it says something new. ``ending``: its
        timeline holds every record not in the audit sink yet, too."""
        data = self.data
        # Not on every refused decision (a flood would write a view each): the sink has those.
        key = (data.lifecycle.state_version, len(data.approved_by), self.audit_error,
               data.pending_approval.request_id if data.pending_approval else None)
        if key == self._viewed and not ending:
            return
        self._viewed = key
        # For people: the latest records, their links left out (the sink has them).
        timeline = [r.model_copy(update={"prev": ""}) for r in data.lifecycle.timeline[-VIEW_RECORDS:]]
        if ending and self.audit:
            # And the records the collector takes from here to the sink: chained, the last sealed.
            self.seal(self.audit)
            by_seq = {r.seq: r for r in [*timeline, *implied_links(self.audit)]}
            timeline = [by_seq[seq] for seq in sorted(by_seq)]
        workflow.upsert_memo({VIEW_MEMO: self.signed_view(timeline).packed()})

    def signed_view(self, timeline: list[TransitionRecord]) -> RunView:
        """The run's view now, signed for this run by the fleet's key: the memo's (where it rests)
        and the ``view`` query's (its live answer). Whoever completes a task can write a memo, and
        whoever polls the queue can answer a query; only this signature makes either the run's
        word (tether status, the inbox, the audit collector)."""
        info = workflow.info()
        view = RunView(
            snapshot=self.snapshot(),
            timeline=timeline,
            published_at=workflow.now(),
            continued_from=info.continued_run_id,
        )
        with self.keyed():
            view.sig = self.ring().sign_statement(keys.view_statement(info.workflow_id, info.run_id, keys.view_digest(view)))
        return view

    def live_view(self) -> RunView:
        """The ``view`` query's answer: the view as the run stands now (its latest records, their
        links left out), signed as the published one is."""
        return self.signed_view([r.model_copy(update={"prev": ""}) for r in self.data.lifecycle.timeline[-VIEW_RECORDS:]])

    def _details(self) -> str:
        return run_details(
            self.data, self.request, workflow_id=workflow.info().workflow_id,
            continued=bool(workflow.info().continued_run_id), audit_error=self.audit_error,
        )

    # ------------------------------------------------------------------ continue-as-new

    def continue_as_new(self) -> None:
        """Continue as new with the run's (folded) state, sealed: the seal binds the state to this
        run and to the generation it hands on, computed by the workflow code with the fleet key,
        right before continuing, every time."""
        data = self.data
        info = workflow.info()
        state = data.model_dump(mode="json")
        sealed = keys.seal(self.ring(), info.workflow_id, info.run_id, data.generation + 1, json_digest(state))
        workflow.continue_as_new(
            self.request.model_copy(update={"carryover": data, "carryover_seal": sealed}),
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(STATE_ATTRIBUTE, data.lifecycle.state.value),
                    SearchAttributePair(TENANT_ATTRIBUTE, self.request.tenant),
                ]
            ),
            # On Worker Versioning, the next run starts on the deployment's current build (a
            # run waiting weeks moves on at its next continue-as-new); unversioned: no effect.
            initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE,
        )
