"""The Temporal side of a run: what the engine's decisions turn into. Activities (their ids,
options and the fleet key's attestation of their answers), a tool call (shielded from the run's
cancel, which then waits for the attempt to end), the audit sink (in order, on a backoff timer
while it fails), webhook notifications (never awaited by the run's progress), what the run
publishes (search attributes, details, the view memo) and continue-as-new (the seal over the
carried state).

Decisions are not made here: what to call, with what, and what an answer means is the engine's
(``workflows/engine.py``); this module only carries it out, in the order it is asked to.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, ChildWorkflowError, WorkflowAlreadyStartedError
from temporalio.workflow import ActivityCancellationType

from workflows import keys
from workflows import metrics as run_metrics
from workflows.budgets import clip
from workflows.contract import derived_digest
from workflows.commands import (
    Call,
    Checkpoint,
    Command,
    ContinueAsNew,
    HandlersDone,
    Mint,
    Notified,
    Notify,
    Probe,
    Publish,
    Landed,
    Readings,
    RunChild,
    RunGroup,
    RunTool,
    Show,
    Sleep,
    Wait,
    Wake,
)
from workflows.engine import Engine
from workflows.failures import activity_failure, log_failure
from workflows.published import COLLECT_EXTERN, STATE_ATTRIBUTE, TENANT_ATTRIBUTE
from workflows.publishing import Publishing
from workflows.run_model import ToolFailure
from workflows.run_state import RunOutcome, RunSnapshot
from workflows.states import TransitionRecord, first_published, implied_links
from workflows.wire import (
    CHILD_CANCELLED,
    CHILD_EXISTS,
    CHILD_WOKEN,
    HANDOFF_NOT_STARTED,
    AuditAck,
    AuditBatch,
    Proposal,
    ToolCall,
    ToolOutcome,
)

T = TypeVar("T", bound=BaseModel)  # what an activity answers: a pydantic model (attested: its MAC covers it)

SETUP_TIMEOUT = timedelta(seconds=30)
PLANNER_TIMEOUT = timedelta(minutes=2)
PLANNER_RETRY = RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=1))
# An activity's options by the kind the engine names: (timeout, retry policy).
SETUP = (SETUP_TIMEOUT, None)
PLANNER = (PLANNER_TIMEOUT, PLANNER_RETRY)
# Tools run exactly as scheduled: the workflow owns their retries, so each one is a
# EXECUTING_TOOL -> RETRY_WAIT -> EXECUTING_TOOL hop on the timeline and an unsafe tool is never
# re-run behind our back.
TOOL_RETRY = RetryPolicy(maximum_attempts=1)
# Records per audit_append call: each call's input stays far below the payload limit.
AUDIT_BATCH = 200
# Records a write takes along to the sink, at most (more are written on their own first).
WRITE_RECORDS = 50
# audit_append tries a few times in quick succession, then the run shows the error and retries on
# a timer: 1 s, 2 s, 4 s, ... up to a minute.
AUDIT_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200), maximum_interval=timedelta(seconds=1), maximum_attempts=3
)
AUDIT_BACKOFF_MAX = 60.0
# At its end a run leaves up to this many records for the audit collector, with its view
# (their packed size stays far below the memo's limit); more are written by the run first.
END_RECORDS = 200
# Live patches: fixes that reached runs of the previous build (published.PREVIOUS_BUILD) while
# they were open, each where its marker stands in the run's history; this build's runs have every
# one without a marker (Effects.fixed). They go when the previous build's runs do
# (docs/changing-workflows.md).
# The patch under which a parent checks its child's sealed outcome.
CHILD_OUTCOME_SEALED = "tether-child-outcome-sealed"
# The patch under which a hand-off of the run wakes a parallel group with children.
GROUP_HANDOFF_WAKES = "tether-group-handoff-wakes"
# The patch under which a child is started once (its id never reused) and a child's ids derive
# from its parent's chain and step.
CHILD_ONCE = "tether-child-once"
# The patch under which a sender's decisions past budgets.QUEUED_PER_SENDER are refused unjudged.
QUEUE_CAP = "tether-queue-cap"


class Effects(Publishing):
    """One run's Temporal calls, and what they need to remember between them: the activities
    scheduled (their ids), the records not yet in the audit sink, the notifications in flight
    and what the run last published."""

    def __init__(self, engine: Engine, *, snapshot: Callable[[], RunSnapshot]) -> None:
        info = workflow.info()
        self.engine = engine
        self.data = engine.data
        self.request = engine.request
        self.snapshot = snapshot  # the snapshot query's answer, for the published view
        # Records on their way to the audit sink.
        self.audit: list[TransitionRecord] = []
        self.audit_error: str | None = None
        self.notifying = 0  # notify activities in flight
        self.calls = 0  # activities this execution scheduled: their ids, which attestations bind
        # Whether this build started the run (published.BUILD): its activity ids derive from
        # history alone and every live patch's fix is on without a marker. False only for a run
        # of PREVIOUS_BUILD (agent_run sets it as the run begins).
        self.this_build = True
        # A run of the previous build that made its activity ids from the seed (HISTORY_IDS).
        self.history_ids = False
        self._settled: tuple[ToolOutcome | None, ToolFailure | None] | None = None
        self._landed: list[Landed] | None = None
        # The parallel group under way: its command, its attempts' tasks, what has landed, and
        # whether a hand-off wakes it (kept across the commands a wake takes, as ``_children`` is).
        self._group: tuple[RunGroup, list[asyncio.Future[None]], list[Landed], bool] | None = None
        self._children: dict[str, Any] = {}  # child runs started and not yet ended, by id
        self._child_seals: dict[str, str] = {}  # the grant each child was started with, by id
        start_attributes = info.typed_search_attributes
        self.published: str | None = start_attributes.get(STATE_ATTRIBUTE)
        # A first run's attribute is what its client set (states.first_published): checked
        # against the run's state once, at its first publish. A continued run's is our own.
        self._published_checked = info.continued_run_id is not None
        self._shown: str | None = None  # the current details last set
        self._viewed: tuple[Any, ...] | None = None  # what the published view (memo) last said
        # start_run sets the tenant and continue-as-new carries it: upsert it only when missing.
        self._tenant_published = start_attributes.get(TENANT_ATTRIBUTE) == self.request.tenant

    def fixed(self, patch: str) -> bool:
        """Whether a live patch's fix is on for this run: always for a run this build started (no
        marker written); for a run of the previous build, where its history says (the marker, or
        written now where the run meets the fix for the first time)."""
        return self.this_build or workflow.patched(patch)

    async def perform(self, command: Command) -> Any:
        """Carry out one command of the engine's; its result goes back to the engine. A cancel
        of the run reaches the child runs still open and the parallel group under way (one a
        hand-off woke the wait on) and waits for each to settle."""
        try:
            return await self._perform(command)
        except asyncio.CancelledError as err:
            # A group a hand-off woke runs on while the engine judges it: the cancel reaches it too.
            await self.settle_group()
            if self._children:
                await self.settle_children(err.args)
            raise

    async def _perform(self, command: Command) -> Any:
        match command:
            case Call():
                options = PLANNER if command.options == "planner" else SETUP
                try:
                    return await self.activity(
                        command.name, command.arg, command.result_type, command.summary,
                        timeout=options[0], retry=options[1], attested=command.attested, show=command.show,
                    )
                except ActivityError as err:
                    if not command.catch:
                        raise
                    return activity_failure(err)
            case RunTool():
                try:
                    return await self.tool(
                        command.call, activity_id=command.activity_id, start_to_close=command.start_to_close,
                        heartbeat=command.heartbeat, summary=command.summary, records=command.records,
                    )
                except ActivityError as err:
                    failure = activity_failure(err)
                    log_failure(command.call.tool_call_id, failure)
                    return failure
            case RunGroup():
                return await self.group(command)
            case RunChild():
                return await self.child(command)
            case Mint():
                return self.mint(command.call, command.activity_id, command.check, ttl_seconds=command.ttl_seconds,
                                 judge=command.judge)
            case Checkpoint():
                await self.checkpoint(end=command.end)
            case Show():
                self.show()
            case Publish():
                self.publish(listed_as=command.listed_as)
            case Notify():
                self.notify()
            case Notified():
                await self.notified()
            case Sleep():
                await workflow.sleep(timedelta(seconds=command.seconds), summary=command.summary)
            case Wait():
                try:
                    await workflow.wait_condition(
                        lambda: self._woken(command.until),
                        timeout=timedelta(seconds=command.seconds),
                        timeout_summary=command.summary,
                    )
                except asyncio.TimeoutError:
                    pass
            case Probe():
                return self.readings()
            case ContinueAsNew():
                self.continue_as_new()
            case HandlersDone():
                await workflow.wait_condition(workflow.all_handlers_finished)
            case _:
                raise TypeError(f"not a command: {type(command).__name__}")
        return None

    def readings(self) -> Readings:
        info = workflow.info()
        return Readings(
            suggested=info.is_continue_as_new_suggested(),
            history_bytes=info.get_current_history_size(),
            history_events=info.get_current_history_length(),
            handlers_finished=workflow.all_handlers_finished(),
            notifying=self.notifying,
        )

    def _woken(self, until: tuple[Wake, ...]) -> bool:
        engine = self.engine
        return (
            ("inbox" in until and bool(engine.inbox))
            or ("handoff" in until and engine.pending_handoff is not None)
            or ("continue" in until and engine.wants_continue(self.readings()))
            or ("audit" in until and bool(self.audit))
            or ("updates" in until and engine.updates_exhausted(workflow.all_handlers_finished()))
        )

    def take_settled(self) -> tuple[ToolOutcome | None, ToolFailure | None] | None:
        """What a tool attempt the run's cancel met came to (None: the cancel met none)."""
        settled, self._settled = self._settled, None
        return settled

    def on_record(self, record: TransitionRecord) -> None:
        self.audit.append(record)
        if record.kind == "refused":
            run_metrics.on_refusal(record)
        elif record.kind == "transition":
            run_metrics.on_transition(self.data.lifecycle, record)

    # ------------------------------------------------------------------ activities

    async def activity(
        self,
        name: str,
        arg: Any,
        result_type: type[T],
        summary: str,
        *,
        timeout: timedelta = SETUP_TIMEOUT,
        retry: RetryPolicy | None = None,
        attested: bool = True,
        show: bool = True,
    ) -> T:
        """One activity (never a local one: sdk-core hands a local activity's result over at a
        different point live and on replay when a query is answered meanwhile, and signals that
        came in between then land on another side of it). ``attested``: its answer carries the
        fleet key's MAC, checked before the run uses it. ``show``: publish the state first (not
        while RECEIVED: a start lists the run as the state its first task moves it to)."""
        if show:
            self.show()
        self.calls += 1
        # This build's ids say so with ':' (keys.clockless); the previous build's replay with '.'.
        sep = ":" if self.this_build else "."
        activity_id = f"{name}{sep}{self.calls}{sep}{self.execution_binding()}"
        # What was asked, as it was sent (the run may change a model it holds meanwhile).
        asked = keys.digest(arg, activity_id=activity_id) if attested else ""
        try:
            result: T = await workflow.execute_activity(
                name,
                arg,
                activity_id=activity_id,
                result_type=result_type,
                start_to_close_timeout=timeout,
                retry_policy=retry,
                summary=summary or None,
            )
        except ActivityError as err:
            # An activity the run's own cancellation cancelled: the run is being cancelled, not
            # failing (this surfaces as ActivityError when the activity had not started yet).
            if isinstance(err.cause, CancelledError):
                raise asyncio.CancelledError() from err
            raise
        if attested:
            self.check(activity_id, name, asked, result)
        if isinstance(result, Proposal) and result.judged is not None and not attested:
            # Only an attested answer (the first, with the setup) judges in advance: a later
            # planner answer is untrusted input, whoever wrote it.
            result = result.model_copy(update={"judged": None})
        return result

    def execution_binding(self) -> str:
        """What binds an activity id to this execution, from a value every replay path sees
        alike (docs/architecture.md "Ids"): the run's random seed, read without drawing, which
        Temporal derives from the run id in force at this point of the history (the original's
        for a reset run's copied prefix, the reset run's own from the reset point on). Never the
        task's clock or the history's length (a worker rebuilding the run to answer a query saw
        both differ) nor a draw from the random stream (any other reader of it moves it)."""
        if not self.this_build and not self.history_ids:
            # A run an earlier build started: its ids as that build made them, so it replays.
            drawn = f"{workflow.random().getrandbits(64):016x}:{workflow.now().isoformat()}"
            return hashlib.sha256(drawn.encode()).hexdigest()[:12]
        seed = f"{workflow.random_seed():x}"
        return derived_digest("activity", seed)[:12]

    async def tool(
        self,
        call: ToolCall,
        *,
        activity_id: str | None,
        start_to_close: float,
        heartbeat: float,
        summary: str,
        records: bool = False,
    ) -> ToolOutcome:
        """One ``execute_tool`` attempt. A write's (``activity_id`` given) answer is attested.
        The run's cancel is not let to lose the attempt: it is cancelled and waited for, what it
        did is kept (``take_settled``), and the cancel goes on. A failure raises ActivityError.

        ``records``: the records not yet in the audit sink go with the call, and the tool worker
        appends them before it calls the tool: no write starts while the records before it are not
        in the sink, and no activity of their own stands before it. They leave the run's queue
        once the attempt has answered; until then (and after a failure) they are sent again, and
        the sink keeps each seq once."""
        writes = activity_id is not None
        sent: list[TransitionRecord] = []
        if records and self.audit:
            if len(self.audit) > WRITE_RECORDS:
                await self.flush_audit()  # a long backlog: first on its own
            sent = list(self.audit)
            if sent:
                self.seal(sent)
                info = workflow.info()
                batch = AuditBatch(
                    workflow_id=info.workflow_id, first_run_id=self.data.first_run_id, records=implied_links(sent),
                    run_id=info.run_id, continued_from=info.continued_run_id,
                )
                call = call.model_copy(update={"records": base64.b64encode(batch.packed()).decode("ascii")})
        handle = workflow.start_activity(
            "execute_tool",
            call,
            activity_id=activity_id,
            result_type=ToolOutcome,
            # The tool's deadline is its declared timeout; the grace period on top lets the
            # activity report a tool that overran instead of leaving the attempt in doubt.
            start_to_close_timeout=timedelta(seconds=start_to_close),
            # A dead worker is noticed within seconds, and a cancel reaches the tool.
            heartbeat_timeout=timedelta(seconds=heartbeat),
            # A cancel waits until the attempt has ended, so its outcome is known.
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            retry_policy=TOOL_RETRY,
            summary=summary,
        )
        outcome: ToolOutcome | None = None
        try:
            # Shielded: the run's cancellation is handled below, not by losing the handle.
            answered: ToolOutcome = await asyncio.shield(handle)
        except asyncio.CancelledError:
            failure: ToolFailure | None = None
            # The attempt may have ended in the very workflow task the cancel came in: let
            # its handle take that result first (the SDK drops the result of a handle
            # cancelled after its result arrived).
            await asyncio.sleep(0)
            if not handle.done():
                handle.cancel()
            try:
                outcome = await handle
            except ActivityError as err:
                failure = activity_failure(err)
                log_failure(call.tool_call_id, failure)
            except asyncio.CancelledError:
                # Its result was dropped after all: what the attempt did is not known.
                failure = ToolFailure("cancelled", "the attempt's result was lost to the cancel", False)
            if outcome is not None and writes:
                self.check(activity_id or "", "execute_tool", keys.attested_call(call), outcome)
            if outcome is not None:
                self._written(sent)
            self._settled = (outcome, failure)
            raise
        if writes:
            # What a write did decides what gets undone: only the fleet's tool worker says so.
            self.check(activity_id or "", "execute_tool", keys.attested_call(call), answered)
        self._written(sent)
        return answered

    async def group(self, command: RunGroup) -> list[Landed] | ToolFailure:
        """A parallel group's attempts, ``limit`` at a time, each as ``tool`` runs one; the
        answers in the order they landed. A cancel reaches each attempt in flight and waits for
        it; what every attempt that ended did is kept (``take_landed``), and the cancel goes on.

        A group with children (this build's: GROUP_HANDOFF_WAKES) is woken by a hand-off of this
        run while one of them is open, as ``child``'s wait is (CHILD_WOKEN): the attempts and the
        children run on, and the same RunGroup again waits for them, cancelling the open children
        first when the engine took the hand-off (``child_cancel``); a member that has not started
        by then does not start."""
        running = self._group
        if running is None or running[0] is not command:
            slots = asyncio.Semaphore(command.limit)
            landed: list[Landed] = []
            self._landed = landed
            wakes = any(isinstance(run, RunChild) for run in command.members) and self.fixed(GROUP_HANDOFF_WAKES)

            async def one(index: int, run: RunTool | RunChild) -> None:
                async with slots:
                    if wakes and self.engine.child_cancel is not None:
                        landed.append(Landed(index, ToolFailure(
                            HANDOFF_NOT_STARTED, "not started: a hand-off of this run was taken", True, started=False,
                        ), workflow.now()))
                        return
                    if isinstance(run, RunChild):  # a child run: this run's cancel reaches it (``child``)
                        landed.append(Landed(index, await self.child(run, wake=False), workflow.now()))
                        return
                    try:
                        answer: Any = await self.tool(
                            run.call, activity_id=run.activity_id, start_to_close=run.start_to_close,
                            heartbeat=run.heartbeat, summary=run.summary,
                        )
                    except ActivityError as err:
                        answer = activity_failure(err)
                        log_failure(run.call.tool_call_id, answer)
                    except asyncio.CancelledError:
                        settled = self.take_settled()  # what ``tool`` kept of the attempt the cancel met
                        if settled is not None:
                            landed.append(Landed(index, settled[0] or settled[1], workflow.now()))
                        raise
                    landed.append(Landed(index, answer, workflow.now()))

            running = (command, [asyncio.ensure_future(one(i, run)) for i, run in enumerate(command.members)], landed, wakes)
            self._group = running
        elif self.engine.child_cancel is not None:
            # The engine took the hand-off that woke the group: its open children are cancelled
            # with its reason (each settles, on its own record); its tool attempts end on their own.
            for run in command.members:
                handle = self._children.get(run.child_id) if isinstance(run, RunChild) else None
                if handle is not None and not handle.done():
                    handle.cancel(self.engine.child_cancel)
        _, tasks, landed, wakes = running
        try:
            if wakes:
                await workflow.wait_condition(lambda: self._group_woken(command, tasks))
                if not all(task.done() for task in tasks) and not self._group_failed(tasks):
                    return ToolFailure(CHILD_WOKEN, "a hand-off of this run is pending; the group runs on", False)
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            await self.settle_group()
            raise
        self._group, self._landed = None, None
        return landed

    def _group_woken(self, command: RunGroup, tasks: list[asyncio.Future[None]]) -> bool:
        """Every attempt of the group has ended (or one failed the task), or a hand-off of this
        run is pending, not yet judged, while a child of the group is open."""
        if all(task.done() for task in tasks) or self._group_failed(tasks):
            return True
        engine = self.engine
        return engine.pending_handoff is not None and engine.child_cancel is None and any(
            isinstance(run, RunChild) and run.child_id in self._children and not self._children[run.child_id].done()
            for run in command.members
        )

    @staticmethod
    def _group_failed(tasks: list[asyncio.Future[None]]) -> bool:
        """An attempt raised (a child's outcome not sealed, ...): the task fails as ``gather`` says."""
        return any(task.done() and not task.cancelled() and task.exception() is not None for task in tasks)

    async def settle_group(self) -> None:
        """This run's cancel reaches every attempt and child of the open group and waits for each
        (what each did is kept: ``take_landed``)."""
        running, self._group = self._group, None
        if running is None:
            return
        tasks = running[1]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def child(self, command: RunChild, *, wake: bool = True) -> RunOutcome | ToolFailure:
        """A child run, its grant sealed here with the fleet key for exactly this parent execution
        and child; its end (a cancel of this run reaches it, and waits for it to settle).
        ``wake``: a hand-off of this run wakes the wait while the child runs on (CHILD_WOKEN); the
        next RunChild for it waits again, cancelling it first when the engine took the hand-off
        (``child_cancel``, the reason the child's record names)."""
        # Children started by this build seal their outcome (a recorded history of an earlier
        # build replays without the check).
        sealed = self.fixed(CHILD_OUTCOME_SEALED)
        handle = self._children.get(command.child_id)
        if handle is None:
            once = self.fixed(CHILD_ONCE)
            info = workflow.info()
            grant = command.request.grant.model_copy(update={"parent_run": info.run_id})
            with self.keyed():
                grant.seal = keys.seal_grant(self.ring(), grant.sealed_digest())
            request = command.request.model_copy(update={"grant": grant})
            try:
                handle = await workflow.start_child_workflow(
                    "AgentRun",
                    request,
                    id=command.child_id,
                    result_type=RunOutcome,
                    task_queue=info.task_queue,
                    parent_close_policy=workflow.ParentClosePolicy.REQUEST_CANCEL,
                    # A child runs once: its id is its parent's chain and step, and a reset or
                    # repaired parent meets the one its first start made (closed ones too).
                    id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE if once else WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                    cancellation_type=workflow.ChildWorkflowCancellationType.WAIT_CANCELLATION_COMPLETED,
                    search_attributes=TypedSearchAttributes([
                        SearchAttributePair(TENANT_ATTRIBUTE, request.tenant),
                        SearchAttributePair(STATE_ATTRIBUTE, first_published(compensation=False).value),
                    ]),
                    static_summary=command.summary,
                )
            except WorkflowAlreadyStartedError:
                return ToolFailure(CHILD_EXISTS, f"child run {command.child_id} exists already (a reset of this run?)", True)
            self._children[command.child_id] = handle
            # Its outcome is sealed for the grant as this run's chain makes it (a reset of this run
            # awaits the child an earlier execution started, under that execution's run id).
            self._child_seals[command.child_id] = self.chain_seal(command.request.grant) if once else grant.seal
        elif self.engine.child_cancel is not None:
            handle.cancel(self.engine.child_cancel)
        engine = self.engine
        try:
            if wake:
                await workflow.wait_condition(
                    lambda: handle.done() or (engine.pending_handoff is not None and engine.child_cancel is None)
                )
                if not handle.done():
                    return ToolFailure(CHILD_WOKEN, f"a hand-off of this run is pending; child run {command.child_id} runs on", False)
            outcome: RunOutcome = await asyncio.shield(handle)
            if sealed:
                self.check_outcome(self._child_seals[command.child_id], command.child_id, outcome)
            return outcome
        except asyncio.CancelledError as err:
            # This run's cancel reaches the child (at once, beside a group's attempts) and waits
            # for it to settle.
            await self.settle_children(err.args, [command.child_id])
            raise
        except ChildWorkflowError as err:
            cause = err.cause
            if isinstance(cause, CancelledError):
                # Cancelled (as this run's hand-off asked, or by someone else): the child has settled.
                return ToolFailure(CHILD_CANCELLED, f"child run {command.child_id} was cancelled", True)
            if isinstance(cause, ApplicationError) and cause.details:
                # A run that ends failed says its outcome in the failure's details.
                try:
                    ended = RunOutcome.model_validate(cause.details[0])
                except ValueError:
                    ended = None
                if ended is not None:
                    if sealed:
                        self.check_outcome(self._child_seals[command.child_id], command.child_id, ended)
                    return ended
            kind = (cause.type if isinstance(cause, ApplicationError) else type(cause).__name__) if cause else "unknown"
            return ToolFailure("child_failed", f"child run {command.child_id} failed: {kind}", True)
        finally:
            if handle.done():
                self._children.pop(command.child_id, None)

    async def settle_children(self, reason: tuple[Any, ...], ids: list[str] | None = None) -> None:
        """This run's cancel reaches the child runs still open (``ids``: those; else every one)
        and waits for each to settle."""
        ids = list(self._children) if ids is None else [i for i in ids if i in self._children]
        handles = [self._children.pop(i) for i in ids]
        for handle in handles:
            handle.cancel(*reason)
        await asyncio.gather(*handles, return_exceptions=True)

    def take_landed(self) -> list[Landed] | None:
        """What a group's attempts the run's cancel met came to (None: the cancel met no group)."""
        landed, self._landed = self._landed, None
        return landed

    def _written(self, sent: list[TransitionRecord]) -> None:
        """The tool worker appended ``sent`` (the attempt answered): off the run's queue."""
        if sent and self.audit[: len(sent)] == sent:
            del self.audit[: len(sent)]

    # ------------------------------------------------------------------ the audit sink

    async def flush_audit(self) -> None:
        """Every record written so far, to the audit sink, in order (keyed by workflow id, run id
        and seq: a retry never writes one twice). While the sink fails, the run says so and
        retries on a backoff timer; nothing else starts until every record is in."""
        info = workflow.info()
        failures = 0
        while self.audit:
            batch = self.audit[:AUDIT_BATCH]
            self.seal(batch)
            try:
                await self.activity(
                    "audit_append",
                    AuditBatch(
                        workflow_id=info.workflow_id, first_run_id=self.data.first_run_id, records=implied_links(batch),
                        run_id=info.run_id, continued_from=info.continued_run_id,
                    ).packed(),
                    AuditAck,
                    f"audit · {len(batch)} record(s)",
                    retry=AUDIT_RETRY,
                    attested=False,  # what it answers decides nothing
                    # The state is published once its records are in (the checkpoint shows it
                    # after): a run listed as waiting has its request on the record.
                    show=False,
                )
            except ActivityError as err:
                failures += 1
                delay = min(2.0 ** (failures - 1), AUDIT_BACKOFF_MAX)
                failure = err.cause
                cause = failure.message if isinstance(failure, ApplicationError) else str(failure or err)
                self.audit_error = clip(
                    f"audit sink failing, {len(self.audit)} record(s) from seq {batch[0].seq} not written "
                    f"(attempt {failures}, next in {delay:g}s): {cause}",
                    600,
                )
                workflow.logger.warning("%s", self.audit_error)
                self.publish()
                self.publish_view()  # the backoff is a rest: Tether's views say the sink fails
                await workflow.sleep(timedelta(seconds=delay), summary="audit sink retry")
                continue
            del self.audit[: len(batch)]
        if self.audit_error is not None:
            workflow.logger.info("audit sink writes again after %d failed attempt(s)", failures)
            self.audit_error = None

    async def checkpoint(self, *, end: bool = False) -> None:
        """Where the run rests (a wait, a timer, continue-as-new, the end): the audit sink has
        every record, people who take an event are being told, the state is visible, and so is
        the view Tether's own tools read without a worker. (A write takes its records along:
        ``tool``.)

        At the ``end`` the records not in the sink yet go with the published view, and the
        worker's audit collector (activities/audit.py) writes them from there once the run has
        closed: nothing after the end acts on them, so the run need not wait for the sink (an
        activity and a workflow task less per run). Past END_RECORDS they are written first."""
        if end and self.audit:
            # Marked before it is sealed: the signature covers where the trail ends.
            self.audit[-1].final = True
        if end and len(self.audit) <= END_RECORDS:
            self.show()
            self.publish_view(ending=True)
            collect = workflow.extern_functions().get(COLLECT_EXTERN)
            if collect is not None:  # a worker's; a Replayer has none
                info = workflow.info()
                collect(info.workflow_id, info.run_id)
            return
        await self.flush_audit()
        self.show()
        self.publish_view()

