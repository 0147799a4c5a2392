"""``run_setup``: what a run snapshots as it starts, in one activity.

The tool catalog (activities/tools.py) and the tenant's policy with the start's signature check
(activities/policy.py), answered together (one activity instead of two) and attested with the
fleet key: validation and every policy decision of the run rest on it.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.keys import attest
from activities.policy import PolicyActivities
from activities.tools import ToolActivities
from workflows.models import RunSetup, SnapshotRequest


class SetupActivities:
    def __init__(self, tools: ToolActivities, rules: PolicyActivities) -> None:
        self.tools = tools
        self.rules = rules

    @activity.defn(name="run_setup")
    async def run_setup(self, request: SnapshotRequest) -> RunSetup:
        setup = RunSetup(
            catalog=self.tools.registry.catalog(),
            policy=await self.rules.policy_snapshot(request),
        )
        if self.rules.keys is None:
            raise ApplicationError("this worker has no key ring to attest the run's setup", type="key_missing", non_retryable=True)
        return attest(self.rules.keys, request, setup)
