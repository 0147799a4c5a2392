"""``run_setup``: what a run snapshots as it starts, in one local activity.

The tool catalog (activities/tools.py) and the tenant's policy with the start's signature check
(activities/policy.py), answered together: one marker in the run's history and one activation of
the workflow instead of two of each (docs/performance.md). Runs recorded before it still call
``tool_catalog`` and ``policy_snapshot``, which stay registered.
"""

from __future__ import annotations

from temporalio import activity

from activities.policy import PolicyActivities
from activities.tools import ToolActivities
from workflows.models import RunSetup, SnapshotRequest


class SetupActivities:
    def __init__(self, tools: ToolActivities, rules: PolicyActivities) -> None:
        self.tools = tools
        self.rules = rules

    @activity.defn(name="run_setup")
    async def run_setup(self, request: SnapshotRequest) -> RunSetup:
        return RunSetup(
            catalog=self.tools.registry.catalog(),
            policy=await self.rules.policy_snapshot(request),
        )
