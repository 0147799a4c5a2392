"""A Worker Deployment's versions: their routing, their open runs, and which can be retired.
"""

from __future__ import annotations

from pydantic import BaseModel
from temporalio.api.deployment.v1 import WorkerDeploymentVersion
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from workflows.display import escape_text
from tether.connection import DEPLOYMENT_ENV, QUERY_TIMEOUT, TetherError, UsageError, rpc_error
from tether.client.listing import build_order


class DeployedVersion(BaseModel):
    """One build of a Worker Deployment: its routing, its open runs, whether it can be retired."""

    build: str
    status: str  # current, ramping, draining, drained, inactive, created
    ramp_percent: float | None = None
    open_runs: int = 0  # open runs pinned to it (its workers must serve them until they end)
    routed: bool = False  # current or ramping: new runs start on it
    retirable: bool = False  # not routed, and no open run: its workers can stop


class DeploymentStatus(BaseModel):
    deployment: str
    current: str | None = None  # the build new runs start on (None: unversioned workers)
    ramping: str | None = None
    ramp_percent: float | None = None
    versions: list[DeployedVersion] = []
    unversioned_runs: int = 0  # open runs on unversioned workers (from before versioning)


def _deployment_error(err: RPCError, deployment: str) -> TetherError:
    if err.status == RPCStatusCode.NOT_FOUND:
        return UsageError(
            f"Temporal knows no Worker Deployment {escape_text(deployment)!r}: its workers register it with their first "
            f"poll (start them with {DEPLOYMENT_ENV}={escape_text(deployment)})"
        )
    return rpc_error(err, deployment)


def _routed_build(version: WorkerDeploymentVersion | None, legacy: str) -> str | None:
    """The build a routing field names (None: unversioned workers, or nothing)."""
    if version is not None and version.build_id:
        return version.build_id
    if legacy and legacy != "__unversioned__":
        return legacy.split(".", 1)[-1]
    return None


async def _count_open(client: Client, clause: str) -> int:
    query = f"WorkflowType = 'AgentRun' AND ExecutionStatus = 'Running' AND {clause}"
    try:
        return (await client.count_workflows(query, rpc_timeout=QUERY_TIMEOUT)).count
    except RPCError as e:
        raise UsageError(f"counting runs failed: {e.message}") from None


async def deployment_status(client: Client, deployment: str) -> DeploymentStatus:
    """The deployment's versions with their open runs: which can be retired (no open run pinned
    to it, neither current nor ramping), which must keep their workers. Routing new runs is
    Temporal's own CLI (`temporal worker deployment set-current-version`, `set-ramping-version`)."""
    from temporalio.api.enums.v1 import WorkerDeploymentVersionStatus
    from temporalio.api.workflowservice.v1 import DescribeWorkerDeploymentRequest

    try:
        info = (await client.workflow_service.describe_worker_deployment(
            DescribeWorkerDeploymentRequest(namespace=client.namespace, deployment_name=deployment), timeout=QUERY_TIMEOUT,
        )).worker_deployment_info
    except RPCError as e:
        raise _deployment_error(e, deployment) from None
    routing = info.routing_config
    result = DeploymentStatus(
        deployment=deployment,
        current=_routed_build(routing.current_deployment_version if routing.HasField("current_deployment_version") else None,
                              routing.current_version),
        ramping=_routed_build(routing.ramping_deployment_version if routing.HasField("ramping_deployment_version") else None,
                              routing.ramping_version),
    )
    if result.ramping:
        result.ramp_percent = routing.ramping_version_percentage
    for summary in info.version_summaries:
        build = summary.deployment_version.build_id or summary.version.split(".", 1)[-1]
        status = WorkerDeploymentVersionStatus.Name(summary.status).removeprefix("WORKER_DEPLOYMENT_VERSION_STATUS_").lower()
        open_runs = await _count_open(client, f"TemporalWorkerDeploymentVersion = '{deployment}:{build}'")
        result.versions.append(DeployedVersion(
            build=build, status=status, open_runs=open_runs,
            ramp_percent=result.ramp_percent if build == result.ramping else None,
            routed=build in (result.current, result.ramping),
            retirable=build not in (result.current, result.ramping) and open_runs == 0,
        ))
    result.versions.sort(key=lambda v: (build_order(v.build), v.build))
    result.unversioned_runs = await _count_open(client, "TemporalWorkerDeploymentVersion IS NULL")
    return result
