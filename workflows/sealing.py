"""What a run's workflow code does with the fleet key: sign its records and views, check the
attestations on its activities' answers, check carried state and a child's grant, mint a write's
capability. A key id this worker lacks, or a forgery, fails the workflow task (said and counted).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel
from temporalio import workflow

from workflows import keys
from workflows.contract import Grant, json_digest
from workflows.run_state import RunOutcome, RunRequest
from workflows.states import TransitionRecord, record_link
from workflows.wire import AuthorityCheck, DecisionCheck, ToolCall

# Counted where the workflow code meets a key it lacks, or a forgery (Prometheus, the worker's).
KEY_MISSING_METRIC = "tether_key_missing"
FORGERY_METRIC = "tether_forgery"


class Keyed:
    """The fleet key in the workflow code (no state of its own)."""

    def seal(self, records: list[TransitionRecord]) -> None:
        """Sign the last of ``records`` for the stream this execution writes (workflow id, run id,
        seq, link): its link covers the chain before it, so a sink, a view or an auditor takes
        them as the fleet's. One signature a batch, made by the workflow code (Ed25519 is
        deterministic: a replay signs the same)."""
        if not records:
            return
        last, info = records[-1], workflow.info()
        with self.keyed():
            last.sig = self.ring().sign_statement(
                keys.record_statement(info.workflow_id, info.run_id, last.seq, record_link(last))
            )

    def ring(self) -> keys.KeyRing:
        return keys.worker_ring(workflow.extern_functions)

    def check(self, activity_id: str, kind: str, request: BaseModel | str, result: BaseModel) -> None:
        """An activity's answer bears the fleet key's MAC over exactly this request and answer
        (workflow code; replay included), or the workflow task fails naming it."""
        with self.keyed():
            keys.check_attested(self.ring(), kind, workflow.info().workflow_id, activity_id, request, result)

    def grant_problem(self, request: RunRequest) -> str | None:
        """Why this run's grant is not one its parent's workflow code sealed for exactly this
        child (the server names the parent), or None. A client's or a keyless poller's start
        input cannot make one."""
        grant = request.grant
        if grant is None:
            return None
        info = workflow.info()
        with self.keyed():
            sealed = keys.grant_valid(self.ring(), grant.seal, grant.sealed_digest())
        if not sealed:
            return "the grant does not bear the fleet key's seal: only a parent run's workflow code makes one"
        if grant.child != info.workflow_id:
            return f"the grant was made for {grant.child}, not this run"
        parent = info.parent
        if info.continued_run_id is None and (parent is None or (parent.workflow_id, parent.run_id) != (grant.parent, grant.parent_run)):
            return f"the grant names parent {grant.parent}, but this run was not started by it"
        if (grant.tenant, grant.requested_by) != (request.tenant, request.requested_by):
            return "the grant's tenant or requester differs from the run's"
        return None

    def seal_outcome(self, request: RunRequest, outcome: RunOutcome, *, chain: bool = False) -> RunOutcome:
        """A child run's outcome, sealed for its grant: its parent acts on no other. ``chain``
        (a child this build started): for its grant as its parent's chain made it, whichever of
        the parent's executions started it (a reset parent awaits the child the one before did)."""
        if request.grant is None:
            return outcome
        with self.keyed():
            grant_seal = self.chain_seal(request.grant) if chain else request.grant.seal
            outcome.seal = keys.seal_outcome(self.ring(), grant_seal, outcome.sealed_digest())
        return outcome

    def chain_seal(self, grant: Grant) -> str:
        """The fleet key's seal over ``grant`` less the parent execution that started the child:
        the same for every execution of the parent's chain that makes it (from the same history)."""
        with self.keyed():
            return keys.seal_grant(self.ring(), grant.model_copy(update={"parent_run": "-", "seal": ""}).sealed_digest())

    def check_outcome(self, grant_seal: str, child_id: str, outcome: RunOutcome) -> None:
        """The child's end as its own workflow code sealed it for this grant, or a forgery (a
        keyless poller completed the child's task): the workflow task fails, the parent acts on
        nothing it says."""
        with self.keyed():
            if not keys.outcome_valid(self.ring(), outcome.seal, grant_seal, outcome.sealed_digest()):
                raise keys.Forgery(keys.forgery_message(
                    f"child run {child_id}'s outcome", workflow.info().workflow_id,
                    "it does not bear the seal the child's own workflow code puts on its end",
                ))

    def check_seal(self, seal: str | None, generation: int, carried: Any) -> None:
        """Carried state only from this run's own previous run: its seal names the run the server
        says this one continued from and the next generation. Anything else is a forgery."""
        info = workflow.info()
        with self.keyed():
            if not keys.seal_valid(
                self.ring(), seal, info.workflow_id, info.continued_run_id or "", generation, json_digest(carried),
            ):
                raise keys.Forgery(keys.forgery_message(
                    "the carried state", info.workflow_id,
                    "it does not bear a seal by this run's previous run: an older or another run's state, or a made-up one",
                ))

    @contextmanager
    def keyed(self) -> Iterator[None]:
        """A key id this worker lacks, or a forgery, fails the workflow task: said in the worker's
        log and counted (tether_key_missing, tether_forgery) before the task fails."""
        try:
            yield
        except keys.KeyMissing as e:
            workflow.logger.warning("%s", e)  # (the workflow logger and meter skip replays)
            workflow.metric_meter().create_counter(
                KEY_MISSING_METRIC, "Seals, capabilities and attestations naming a key id this worker lacks", "1"
            ).add(1, {"key_id": e.key_id[:32], "what": "workflow"})
            raise
        except keys.Forgery as e:
            workflow.logger.error("%s", e)
            workflow.metric_meter().create_counter(
                FORGERY_METRIC, "Answers and carried state a worker without the fleet key wrote", "1"
            ).add(1)
            raise

    def mint(self, call: ToolCall, activity_id: str, check: AuthorityCheck, *, ttl_seconds: float,
             judge: DecisionCheck | None = None) -> ToolCall:
        """The write attempt's capability for exactly this call, minted with the fleet key once
        the keyed re-check under the current file allowed it: nothing else can make a tool write.
        ``judge``: the re-check is a decision taken on the run's roster, which the call carries and
        the capability binds, for the tool worker to judge before the tool."""
        wf = workflow.info()
        if judge is not None:
            call = call.model_copy(update={"judge": judge})
        return call.model_copy(update={"capability": keys.mint(
            self.ring(), call, workflow_id=wf.workflow_id, run_id=wf.run_id, activity_id=activity_id,
            request_id=check.request_id, plan_hash=check.plan_hash, now=workflow.now(),
            ttl_seconds=ttl_seconds, rerun_unknown=check.undo is not None and check.undo.rerun,
            judge_digest=json_digest(judge.model_dump(mode="json")) if judge is not None else "",
        )})
