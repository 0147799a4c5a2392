"""``run_setup``: what a run snapshots as it starts, in one activity.

The tool catalog (tether/tools/sdk.py) and the tenant's policy with the start's signature check
(activities/policy_checks.py), answered together (one activity instead of two) and attested with the
fleet key: validation and every policy decision of the run rest on it. A run that plans takes
it with its first planner call (``plan`` here wraps the planner activity).
"""

from __future__ import annotations

from collections.abc import Mapping

from temporalio import activity
from temporalio.exceptions import ApplicationError

from tether.planners import planning
from tether.store.keys import KeyRing, attest
from activities.policy_checks import PolicyActivities
from activities.tools import ToolActivities
from workflows.contract import ToolCatalog
from workflows.plan_check import check_digest, first_check, proposes_writes
from workflows.wire import PlanJudged, PlannerInput, Proposal, RunSetup, SnapshotRequest


class SetupActivities:
    def __init__(
        self, tools: ToolActivities, rules: PolicyActivities, planners: Mapping[str, planning.Planner] | None = None
    ) -> None:
        self.tools = tools
        self.rules = rules
        # The built-in planners and this worker's own (worker.py --planner), by name.
        self.planners = planners if planners is not None else planning.BUILTIN_PLANNERS

    async def snapshot(self, request: SnapshotRequest) -> RunSetup:
        return RunSetup(catalog=self.tools.registry.catalog(), policy=await self.rules.policy_snapshot(request))

    @activity.defn(name="run_setup")
    async def run_setup(self, request: SnapshotRequest) -> RunSetup:
        """A run that does not plan (a compensation run) takes its setup alone."""
        return attest(self._ring(), request, await self.snapshot(request))

    @activity.defn(name="plan")
    async def plan(self, request: PlannerInput) -> Proposal:
        """The planner; a run's first call takes the run's setup with it (one activity less per
        run). Where the setup refuses the run (its tenant is not in the policy, its requester's
        signature does not hold), nothing is planned: no model is asked for a run that fails."""
        if request.setup is None:
            return await self._propose(request)
        setup = await self.snapshot(request.setup)
        judged = None
        if setup.policy.requester_refusal is None and setup.policy.policy is not None:
            budgets = setup.policy.policy.budgets
            asked = request.model_copy(update={"setup": None, "max_depth": budgets.max_depth, "max_steps": None, "max_model_tokens": None})
            proposal = await self._propose(asked, setup.catalog)
            judged = await self._judged(request, setup, proposal)
        else:
            proposal = Proposal()
        return attest(self._ring(), request, proposal.model_copy(update={"setup": setup, "judged": judged}))

    async def _judged(self, request: PlannerInput, setup: RunSetup, proposal: Proposal) -> PlanJudged | None:
        """The plan's planning-time re-check, judged now under the current file, for a plan the
        run will check so (one activity less for the run). Only a speed-up: where it cannot be
        judged here, the run asks the policy activity, which says why."""
        try:
            if not proposes_writes(proposal, setup.catalog):
                return None  # nothing to check (the common case): said before any copy is made
            # Built from what the run will read: the answer as it arrives (the setup's catalog
            # compacted on the way), so both build the same check.
            seen = RunSetup.model_validate_json(setup.model_dump_json())
            proposed = Proposal.model_validate_json(proposal.model_dump_json())
            check = first_check(request, seen, proposed, first_run_id=activity.info().workflow_run_id or "")
            if check is None:
                return None
            return PlanJudged(check=check_digest(check), verdict=await self.rules.judge_plan(check))
        except Exception as e:
            activity.logger.warning("the first plan's re-check was not judged in advance (the run asks the policy "
                                    "activity): %s", " ".join(f"{type(e).__name__}: {e}".split())[:300])
            return None

    async def _propose(self, request: PlannerInput, catalog: ToolCatalog | None = None) -> Proposal:
        """The run's planner, offered the tools this worker serves."""
        return await planning.plan(request, catalog or self.tools.registry.catalog(), self.planners)

    def _ring(self) -> KeyRing:
        if self.rules.keys is None:
            raise ApplicationError("this worker has no key ring to attest the run's setup", type="key_missing", non_retryable=True)
        return self.rules.keys
