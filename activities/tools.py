"""The ``execute_tool`` activity: a registry's tools exposed to the workflow, each call run under
its deadline while heartbeating, its write claimed in the effect ledger first and its outcome
attested with the fleet key.

The tool SDK (``@tool``, ``ToolContext``, ``ToolError``, the registry) is tether/tools/sdk.py; what
an attempt does past its deadline, on a cancel and on a lost answer is said here.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from pydantic import BaseModel, ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from tether.store.keys import KeyRing, attest, capability_refusal
from tether.store.effect_ledger import EffectLedger, LedgerUnavailable
from workflows.keys import attested_call
from tether.metrics import tool_call_metrics
from workflows.contract import ToolEffect, first_error, json_digest
from workflows.wire import (
    ATTEMPT_STILL_RUNNING, CANCELLED_MID_CALL, CAPABILITY_INVALID, DECISION_NOT_HELD, JUDGE_UNAVAILABLE, LEDGER_UNAVAILABLE,
    RECORD_UNVERIFIED, SINK_UNAVAILABLE, UNKNOWN_TOOL, DecisionCheck, ToolCall, ToolOutcome, Verdict,
)
from workflows.recovery import UNDO_KEY_SUFFIX
from workflows.retries import ToolTimeouts, tool_timeouts

from tether.tools.sdk import REGISTRY, ToolContext, ToolError, ToolRegistry, ToolSpec

# Why the policy file did not load, as this attempt's judgement of a roster's decision found it.
_JUDGED_UNDER_PROBLEM: contextvars.ContextVar[str | None] = contextvars.ContextVar("judged_under_problem", default=None)

# Writes a run's packed records to the audit sink (activities/audit.py AuditActivities.write).
RecordWriter = Callable[[bytes], Awaitable[int]]

log = logging.getLogger("tether.tools")

# Observations are cut to this many characters before they enter workflow history, so history
# does not grow with the size of tool results. The digest covers the full result.
MAX_OBSERVATION_CHARS = 4000

# A write (an undo) of an unsafe tool whose earlier start never settled: not run again, its
# outcome unknown; the run treats it as any attempt whose outcome is unknown (HANDED_OFF).
MAY_HAVE_APPLIED = "may_have_applied"
UNDO_MAY_HAVE_APPLIED = "undo_may_have_applied"
# A write (an undo) another attempt may be running right now: tried again after a backoff.
IN_FLIGHT = "write_in_flight"
UNDO_IN_FLIGHT = "undo_in_flight"


class _Attempt:
    """One attempt of a tool call: runs the tool's functions while heartbeating, until they end.

    A sync function runs in a thread, which nothing can stop: on a cancel the attempt sets
    ``ctx.cancelled`` and keeps waiting, so the activity never reports an attempt as over while
    its tool still runs. An async function is cancelled. Past the deadline plus half the grace
    period (the other half lets the report reach the server before start_to_close), the attempt
    gives up and says the tool is still running.
    """

    def __init__(self, ctx: ToolContext, timeouts: ToolTimeouts, started: float) -> None:
        self.ctx = ctx
        self.timeouts = timeouts
        self.give_up = started + timeouts.run + timeouts.grace / 2
        self.cancel_seen = False

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        if inspect.iscoroutinefunction(fn):
            work: asyncio.Future[Any] = asyncio.ensure_future(fn(*args))
        else:
            # Sync tools (most HTTP clients) run in a thread so they never block the worker's loop.
            call = functools.partial(contextvars.copy_context().run, fn, *args)
            work = asyncio.ensure_future(loop.run_in_executor(None, call))
        while True:
            activity.heartbeat()
            left = self.give_up - time.monotonic()
            if left <= 0:
                if isinstance(work, asyncio.Task):
                    work.cancel()
                raise ApplicationError(
                    f"{self.ctx.tool_call_id}: the tool was still running "
                    f"{self.timeouts.grace / 2:g}s after its deadline",
                    type=ATTEMPT_STILL_RUNNING,
                )
            try:
                # asyncio.wait never cancels ``work``: the tool ends on its own terms.
                await asyncio.wait({work}, timeout=min(self.timeouts.heartbeat / 4, left))
            except asyncio.CancelledError:
                # The run was cancelled (it arrives with a heartbeat) or the worker shuts down.
                self.cancel_seen = True
                self._stop(work)
                continue
            if work.done():
                if work.cancelled():
                    raise ApplicationError(
                        f"{self.ctx.tool_call_id}: cancelled while the tool ran", type=CANCELLED_MID_CALL
                    )
                return work.result()

    def _stop(self, work: asyncio.Future[Any]) -> None:
        self.ctx.cancelled.set()
        if not isinstance(work, asyncio.Task):
            return  # a thread: it sees ctx.cancelled, and we wait for it
        work.cancel()

    def stop_if_cancelled(self) -> None:
        """Between the lookup and the write: a cancelled attempt does not start writing."""
        if self.cancel_seen:
            raise ApplicationError(
                f"{self.ctx.tool_call_id}: cancelled before the tool ran", type=CANCELLED_MID_CALL
            )


def bounded_observation(result: Any) -> ToolOutcome:
    if isinstance(result, BaseModel):
        result = result.model_dump(mode="json")
    text = json.dumps(result, sort_keys=True, default=str)
    return ToolOutcome(
        observation=text[:MAX_OBSERVATION_CHARS],
        digest=hashlib.sha256(text.encode()).hexdigest(),
        size=len(text),
        truncated=len(text) > MAX_OBSERVATION_CHARS,
    )


class ToolActivities:
    """The activities that expose a registry's tools to the workflow."""

    def __init__(
        self, registry: ToolRegistry = REGISTRY, keys: KeyRing | None = None, ledger: EffectLedger | None = None,
        records: RecordWriter | None = None, judge: Callable[[DecisionCheck], Awaitable[Verdict]] | None = None,
    ) -> None:
        self.registry = registry
        # The policy activities' judging of a decision (PolicyActivities.judge_decision), where
        # this process has the policy file: the first call after a roster's decision is judged here.
        self.judge = judge
        self.keys = keys  # verifies the capability every write attempt must carry
        self.ledger = ledger  # each write (undos too) started at most once, whoever asks (tether/store/effect_ledger.py)
        # The audit sink's writer (AuditActivities.write): the records a write takes along go in
        # before the tool is called.
        self.records = records

    @activity.defn(name="execute_tool")
    async def execute_tool(self, call: ToolCall) -> ToolOutcome:
        spec = self.registry.get(call.tool)
        effect = spec.effect.value if spec is not None else "unknown"
        # Counts the call (and the retry, for attempt > 1) by tool, effect and outcome.
        with tool_call_metrics(call.tool, effect, call.attempt):
            if spec is None:
                raise ApplicationError(
                    f"tool {call.tool!r} is not registered on this worker; start the worker with "
                    f"the module that defines it (--tools / TETHER_TOOLS)",
                    type=UNKNOWN_TOOL,
                    non_retryable=True,
                )
            if spec.effect != ToolEffect.READ_ONLY:
                # Nothing writes unless the governed run's own worker minted this call's capability.
                refused = capability_refusal(self.keys, call)
                if refused is not None:
                    raise refused
            if call.judge is not None or (call.capability is not None and call.capability.judge_digest):
                await self._judged(call)
            if call.records is not None:
                await self._write_records(call.records)
            try:
                args = spec.parse_args(call.args)
            except ValidationError as e:
                raise ApplicationError(
                    f"invalid arguments for {spec.name}: {first_error(e)}",
                    type="invalid_arguments",
                    non_retryable=True,
                ) from None
            timeouts = tool_timeouts(spec.timeout_seconds)
            started = time.monotonic()
            ctx = ToolContext(
                run_id=call.run_id,
                tenant=call.tenant,
                tool_call_id=call.tool_call_id,
                idempotency_key=call.idempotency_key,
                attempt=call.attempt,
                deadline=datetime.now(timezone.utc) + timedelta(seconds=timeouts.run),
            )
            attempt = _Attempt(ctx, timeouts, started)
            key = self._ledger_key(spec, call)
            look_up_first = call.attempt > 1
            if key is not None:
                held = await self._claim(spec, call, key)
                if isinstance(held, ToolOutcome):
                    return self._outcome(spec, call, held)
                look_up_first = look_up_first or held
            try:
                if spec.effect == ToolEffect.RECONCILABLE and look_up_first and spec.lookup_fn:
                    # A previous attempt (of this run, a reset run, a repair) may have acted before
                    # its answer was lost: find it first. Nothing else runs under the key now.
                    previous = await attempt.run(spec.lookup_fn, ctx)
                    if previous is not None:
                        activity.logger.info("reconciled %s by key %s", spec.name, ctx.idempotency_key)
                        return await self._settled(spec, call, key, bounded_observation(previous))
                    attempt.stop_if_cancelled()
                result = await attempt.run(spec.fn, args, ctx)
            except ToolError as e:
                # Refused by the target: known not applied. Else the attempt is over (not racing
                # anyone now) and it may have applied.
                await self._settle(key, "released" if e.permanent else "unknown")
                raise ApplicationError(str(e), type=e.code, non_retryable=e.permanent) from None
            except ApplicationError as e:
                if e.type != ATTEMPT_STILL_RUNNING:  # still running: it stays claimed
                    await self._settle(key, "unknown")
                raise
            except Exception:
                await self._settle(key, "unknown")
                raise
            return await self._settled(spec, call, key, bounded_observation(result))

    async def _judged(self, call: ToolCall) -> None:
        """The first call after a decision the run took on its roster: the decision, and the
        approved plan's re-check, judged under the current file as the policy activity judges
        them (and logged as it logs them), before anything else of the call happens. Raises
        (non-retryable, the tool not called) when they do not hold, or this worker cannot judge:
        the run then judges the decision again through the policy activity."""
        cap = call.capability
        if cap is not None and cap.judge_digest and (call.judge is None or json_digest(call.judge.model_dump(mode="json")) != cap.judge_digest):
            raise ApplicationError("write refused: the capability names a decision check the call does not carry",
                                   type=CAPABILITY_INVALID, non_retryable=True)
        assert call.judge is not None
        if self.judge is None:
            raise ApplicationError(
                "this worker does not judge decisions (no policy file in this process): the run judges it through "
                "the policy activity", type=JUDGE_UNAVAILABLE, non_retryable=True)
        try:
            verdict = await self.judge(call.judge)
        except Exception as e:  # the file cannot be judged by here: the policy activity waits for it
            raise ApplicationError(f"this worker cannot judge the decision now ({e}): the run judges it through the "
                                   "policy activity", type=JUDGE_UNAVAILABLE, non_retryable=True) from None
        _JUDGED_UNDER_PROBLEM.set(verdict.policy_problem)
        refusal = verdict.refusal or (verdict.then.refusal if verdict.then is not None else None)
        if refusal is not None:
            raise ApplicationError(f"not started: the decision does not hold under the current policy file: {refusal}",
                                   type=DECISION_NOT_HELD, non_retryable=True)

    async def _write_records(self, records: str) -> None:
        """The run's records before this write, into the audit sink before the tool is called
        (refused whole unless the fleet signed them for this run: activities/audit.py). Any
        failure is the sink's: the tool is not called, and the run writes them itself."""
        if self.records is None:
            raise ApplicationError(
                "this worker has no audit sink for the records before a write (worker.create_worker wires it)",
                type=SINK_UNAVAILABLE,
            )
        try:
            packed = base64.b64decode(records, validate=True)
        except ValueError:
            raise ApplicationError("the records before this write are not base64", type=RECORD_UNVERIFIED,
                                   non_retryable=True) from None
        await self.records(packed)

    def _ledger_key(self, spec: ToolSpec, call: ToolCall) -> str | None:
        """The ledger key of a write (an undo included): its idempotency key, which the call's
        capability (minted by the run's workflow code) covers. None for a read."""
        if self.ledger is None or spec.effect == ToolEffect.READ_ONLY:
            return None
        return call.idempotency_key

    async def _claim(self, spec: ToolSpec, call: ToolCall, key: str) -> ToolOutcome | bool:
        """Claim the write before the tool is called. Its recorded outcome when some call already
        did it (the tool is not called again); True when an earlier claim never settled (it may
        have applied) and the tool's effect allows running it again; False when it was free;
        else refused."""
        assert self.ledger is not None
        info = activity.info()
        undo = key.endswith(UNDO_KEY_SUFFIX)
        what = "undo" if undo else "write"
        try:
            held = await self.ledger.claim(key, tool=spec.name, workflow_id=info.workflow_id or "", run_id=info.workflow_run_id or "")
        except Exception as e:  # noqa: BLE001 (any ledger error: the tool is not called)
            log.warning("effect ledger %s unavailable for %s: %s", self.ledger.describe(), key[:200], e)
            # Our own words for a lost ledger (what to do: --new-ledger); else only the error's
            # type on the run (a driver's text stays in the worker log).
            why = f"{type(e).__name__}: {str(e)[:300]}" if isinstance(e, LedgerUnavailable) else type(e).__name__
            raise ApplicationError(
                f"the effect ledger ({self.ledger.describe()}) is unavailable: {why}; "
                f"the {what} was not started, and is scheduled again",
                type=LEDGER_UNAVAILABLE, non_retryable=True,
            ) from None
        if held is None:
            return False
        if held.state == "done":
            log.info("%s %s already done by %s at %s: not started again", what, key[:200], held.by_workflow[:200], held.at)
            return ToolOutcome.model_validate_json(held.outcome)
        rerun = call.capability is not None and call.capability.rerun_unknown
        if spec.effect == ToolEffect.UNSAFE and not rerun:
            raise ApplicationError(
                f"the {what} {call.tool_call_id} ({spec.name}) may have applied: run {held.by_workflow} started it at "
                f"{held.at.isoformat(timespec='seconds')} and its outcome is unknown; {spec.name} is unsafe, so it "
                + ("is re-run only on an approver's recorded instruction (tether compensate RUN --rerun-unknown STEP)"
                   if undo else "is not run again: a person decides (the run hands it off)"),
                type=UNDO_MAY_HAVE_APPLIED if undo else MAY_HAVE_APPLIED,
            )
        if held.state == "claimed" and datetime.now(timezone.utc) - held.at < timedelta(
            seconds=tool_timeouts(spec.timeout_seconds).start_to_close
        ):
            # Another attempt (another run's, a reset run's, a replayed capability's) may still be
            # running it: a run's own next attempt starts only once its last is over, which is
            # later than this. Not a second request now; tried again after a backoff, by then
            # done (or its outcome unknown).
            raise ApplicationError(
                f"the {what} {call.tool_call_id} ({spec.name}) is being run by run {held.by_workflow} "
                f"(started at {held.at.isoformat(timespec='seconds')}): not started twice at once",
                type=UNDO_IN_FLIGHT if undo else IN_FLIGHT,
            )
        await self.ledger.reclaim(key, workflow_id=info.workflow_id or "", run_id=info.workflow_run_id or "")
        return True  # idempotent: the target dedupes on the same key; reconcilable: look it up first

    async def _settle(self, key: str | None, state: str) -> None:
        """Record how an attempt that did not succeed ended (released, unknown). A ledger that
        fails now leaves the claim ``claimed``: a later call treats it as may-have-applied."""
        if key is None or self.ledger is None:
            return
        try:
            await (self.ledger.release(key) if state == "released" else self.ledger.unknown(key))
        except Exception as e:  # noqa: BLE001 (the attempt's own error is what the run must see)
            log.warning("effect ledger %s: could not record %s as %s: %s", self.ledger.describe(), key[:200], state, e)

    async def _settled(self, spec: ToolSpec, call: ToolCall, key: str | None, outcome: ToolOutcome) -> ToolOutcome:
        if key is not None and self.ledger is not None:
            info = activity.info()
            try:
                await self.ledger.done(key, outcome.model_dump_json(), workflow_id=info.workflow_id or "", run_id=info.workflow_run_id or "")
            except Exception as e:  # noqa: BLE001 (the write happened: the run gets its outcome)
                # The claim stays ``claimed``: a later call under the key looks up, re-runs an
                # idempotent tool, or refuses an unsafe one (may have applied); never blind.
                log.warning("effect ledger %s: could not record %s as done: %s", self.ledger.describe(), key[:200], e)
        return self._outcome(spec, call, outcome)

    def _outcome(self, spec: ToolSpec, call: ToolCall, outcome: ToolOutcome) -> ToolOutcome:
        """A write's outcome decides what gets undone: attested with the fleet key (the run checks
        it); a read's is only an observation for the planner."""
        if spec.effect == ToolEffect.READ_ONLY or self.keys is None:
            return outcome
        if call.judge is not None:
            # The file this worker judged the decision by did not load: the run says so, as a
            # policy activity's verdict would have made it (attested with the outcome).
            outcome = outcome.model_copy(update={"policy_problem": _JUDGED_UNDER_PROBLEM.get()})
        return attest(self.keys, attested_call(call), outcome)
