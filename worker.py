"""Run a Tether worker: the AgentRun workflow, the planner and tool activities, and the
configured tool modules.

    python worker.py [--tools examples.billing.tools] [--planner NAME=MODULE:ATTR] [--task-queue tether]
                     [--metrics-port 9000]

Connection settings come from Temporal's environment configuration (TEMPORAL_ADDRESS,
TEMPORAL_NAMESPACE, TLS and API-key variables, profiles); the defaults are localhost:7233 and
namespace ``default``. Payload encryption: set ``TETHER_ENCRYPTION_KEY_FILE`` (see
``tether/store/codec.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path
import signal
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.worker import Worker, WorkerDeploymentConfig

from activities.audit import AuditActivities
from tether.store.codec import EncryptionCodec
from tether.store.keys import KeyRing, KeyRingError
from tether.tools.mcp_catalog import start_servers
from tether.tools.mcp_config import McpConfigError, config_from_env
from tether.metrics import policy_info, prometheus_runtime, tracing_interceptors
from tether.policy.judgements import ProposedPolicy
from activities.policy_checks import PolicyActivities
from tether.policy.files import PolicyFileError, PolicyStore, check_policy_file
from tether.loading import LoadError
from tether.planners.planning import Planner, load_planners
from tether.tools.sdk import REGISTRY, ToolRegistry, load_tool_modules
from tether.store.effect_ledger import LedgerUnavailable, check_ledger, ledger_for, local_ledger_id
from tether.connection import DEFAULT_TASK_QUEUE, DEPLOYMENT_ENV, TetherError, connect, deployment_name, exit_process, task_queue
from tether.pollers import LEDGER_MARK, live_pollers
from activities.plugin import TetherPlugin
from tether.replay import WORKFLOW_RUNNER, create_replayer  # noqa: F401  (the replayer of this worker's histories)
from workflows.agent_run import AgentRun
from workflows.display import escape_text
from workflows.published import BUILD

DEFAULT_TOOLS = "examples.billing.tools"
CACHE_SETTING = "TETHER_MAX_CACHED_WORKFLOWS"
# The metrics endpoint answers anyone who can reach it: this machine only, unless told.
DEFAULT_METRICS_HOST = "127.0.0.1"


def deployment_config(deployment: str | None, build: str = BUILD) -> WorkerDeploymentConfig | None:
    """The worker as version ``build`` (the build marker its runs write) of Worker Deployment
    ``deployment``; its runs are pinned to it, activities included, so a build's runs meet only
    that build's workers. None: ``deployment`` is empty (an unversioned worker)."""
    if not deployment:
        return None
    return WorkerDeploymentConfig(
        version=WorkerDeploymentVersion(deployment_name=deployment, build_id=build),
        use_worker_versioning=True,
        default_versioning_behavior=VersioningBehavior.PINNED,
    )


def create_worker(
    client: Client,
    *,
    task_queue: str = DEFAULT_TASK_QUEUE,
    deployment: str | None = None,
    registry: ToolRegistry = REGISTRY,
    policy: PolicyStore | None = None,
    audit: AuditActivities | None = None,
    keys: KeyRing | None = None,
    rules: PolicyActivities | None = None,
    extra_workflows: Sequence[type] = (),
    new_ledger: bool = False,
    planners: Mapping[str, Planner] | None = None,
    **options: Any,
) -> Worker:
    """A Tether worker (the CLI, tests and benchmarks all use it): ``Worker(client, task_queue=...,
    plugins=[TetherPlugin(...)])``, the plugin building the activities from the arguments
    (activities/plugin.py says each), with a Worker Deployment version and the cache setting.

    ``deployment``: the Worker Deployment this worker is a version of (build id: the build
    marker, ``BUILD``); None: unversioned.
    """
    plugin = TetherPlugin(policy=policy, rules=rules, tools=registry, audit=audit, planners=planners, keys=keys,
                          new_ledger=new_ledger, workflows=[AgentRun, *extra_workflows],
                          workflow_runner=options.pop("workflow_runner", None))
    return Worker(
        client,
        task_queue=task_queue,
        plugins=[plugin, *options.pop("plugins", ())],
        graceful_shutdown_timeout=options.pop("graceful_shutdown_timeout", timedelta(seconds=10)),
        deployment_config=options.pop("deployment_config", deployment_config(deployment)),
        **cache_option(options),
    )


def cache_option(options: dict[str, Any]) -> dict[str, Any]:
    """TETHER_MAX_CACHED_WORKFLOWS=0: no run is kept between its workflow tasks, so every task
    and every query rebuilds the run from its history, as a fresh worker does (`make
    test-replay` runs the whole suite so; a worker short of memory can run so too)."""
    cached = os.environ.get(CACHE_SETTING, "").strip()
    if cached and "max_cached_workflows" not in options:
        if not cached.isdigit():
            raise SystemExit(f"{CACHE_SETTING}={cached!r}: give a number of runs (0: keep none between tasks)")
        options["max_cached_workflows"] = int(cached)
    return options


async def ledger_conflict(client: Client, queue: str, ledger_id: str, where: str) -> str | None:
    """Why a worker keeping the local ledger ``ledger_id`` must not serve ``queue`` (None: it may):
    a live worker polls it that keeps another ledger (or does not say which). Two ledgers on one
    queue each start again what the other did: a reset run taken by the other worker sends an
    approved email a second time."""
    pollers = await live_pollers(client, queue)
    others = [p for p in pollers or [] if not p.endswith(f"{LEDGER_MARK}{ledger_id}")]
    if not others:
        return None
    return (
        f"task queue {queue!r} is served by another worker with another effect ledger "
        f"({escape_text(', '.join(others), 300)}), and this worker's ledger is local ({where}): two ledgers on one "
        "queue would each start a write the other already made. Give every worker of the queue the fleet's "
        "ledger: set TETHER_AUDIT_DSN=postgresql://... on all of them (docs/production.md, \"Scaling workers\"), "
        "or stop the other worker first"
    )


async def serve(
    tool_modules: Sequence[str],
    queue: str,
    *,
    metrics_port: int | None = None,
    metrics_host: str = DEFAULT_METRICS_HOST,
    policy_path: str | None = None,
    mcp_config_path: str | None = None,
    shadow_policy_path: str | None = None,
    new_ledger: bool = False,
    planner_specs: Sequence[str] = (),
    deployment: str | None = None,
) -> None:
    try:
        registry = load_tool_modules(tool_modules)
        planners = load_planners(planner_specs)
    except LoadError as e:
        raise SystemExit(str(e)) from None
    try:
        keys = KeyRing.from_env()  # refuses to start without the fleet's ring, naming the setting
    except KeyRingError as e:
        raise SystemExit(f"invalid key ring: {e}") from None
    try:
        policy = PolicyStore.from_env(policy_path)
    except PolicyFileError as e:
        raise SystemExit(f"invalid policy: {e}") from None
    shadow_path = shadow_policy_path or os.environ.get("TETHER_SHADOW_POLICY") or None
    try:
        shadow = ProposedPolicy(Path(shadow_path)) if shadow_path else None
    except ValueError as e:
        raise SystemExit(f"invalid shadow policy:\n{e}") from None
    try:
        mcp_config = config_from_env(mcp_config_path)
    except McpConfigError as e:
        raise SystemExit(f"invalid MCP config: {e}") from None
    try:
        audit = AuditActivities()  # TETHER_AUDIT_DSN or TETHER_AUDIT_DIR
    except ValueError as e:
        raise SystemExit(f"invalid audit sink: {e}") from None
    ledger_id = None
    try:
        # A ledger lost where one was, or older than the fleet's: refuse to start (unless
        # --new-ledger), not every write.
        await check_ledger(audit.sink, new_ledger=new_ledger)
        # Which effect ledger this worker keeps, for its identity; a local one serves its queue alone.
        ledger_id = local_ledger_id(audit.sink, new_ledger=new_ledger)
    except LedgerUnavailable as e:
        raise SystemExit(f"effect ledger: {e}") from None
    except Exception as e:  # noqa: BLE001 (not reachable now: each write waits for it, the error on the run)
        logging.warning("effect ledger %s not readable now: %s", audit.sink.describe(), e)
    # MCP servers' tools join the registry before the worker is built (a server that is down is
    # logged and left out); their sessions close after the worker has finished its tasks.
    mcp_servers = await start_servers(mcp_config, registry)
    # The whole file against the tools this worker serves, MCP catalogs included: a typo must
    # not wait for a run. A down server's tools are only warned about (it may come back).
    down = [f"{name}__" for name in (mcp_servers.unavailable if mcp_servers else {})]
    problems = check_policy_file(policy.path, registry.tools) if policy.path else []
    for unserved in [p for p in problems if any(prefix in p for prefix in down)]:
        logging.warning("policy names a tool of an MCP server that is down: %s", unserved)
    problems = [p for p in problems if not any(prefix in p for prefix in down)]
    if problems:
        if mcp_servers is not None:
            await mcp_servers.aclose()
        raise SystemExit("invalid policy:\n" + "\n".join(problems))
    # Only now Temporal: a configuration error is reported whether or not the server is up.
    extra: dict[str, Any] = {}
    # Which policy this worker reads, said in its ready line and its metrics: one file for the fleet.
    _, policy_digest = policy.load()
    if metrics_port:
        # Temporal's SDK metrics and Tether's own, at http://HOST:PORT/metrics.
        extra["runtime"] = prometheus_runtime(f"{metrics_host}:{metrics_port}")
        policy_info(extra["runtime"], policy.source, policy_digest)
    interceptors = tracing_interceptors()
    if interceptors:
        extra["interceptors"] = interceptors
    try:
        client = await connect(**extra)
    except TetherError as e:
        if mcp_servers is not None:
            await mcp_servers.aclose()
        raise SystemExit(str(e)) from None
    try:
        problem = await ledger_conflict(client, queue, ledger_id, ledger_for(audit.sink).describe()) if ledger_id else None
    except TetherError as e:
        problem = str(e)
    if problem:
        if mcp_servers is not None:
            await mcp_servers.aclose()
        raise SystemExit(problem)
    rules = PolicyActivities(policy, keys, shadow=shadow)
    worker = create_worker(client, task_queue=queue, registry=registry, policy=policy, keys=keys, audit=audit, rules=rules,
                           planners=planners, new_ledger=new_ledger, deployment=deployment,
                           identity=f"{client.identity}{LEDGER_MARK}{ledger_id or 'shared'}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    codec = client.data_converter.payload_codec
    async with worker:
        print(
            f"worker ready on task queue {queue!r} with tools: "
            f"{', '.join(sorted(registry.tools)) or 'none'}"
            # Left out at load (bad listing entries, unbounded patterns): the log and `tools` say why.
            + (f" ({len(registry.refused)} left out: {escape_text(', '.join(sorted(registry.refused)), 300)})"
               if registry.refused else "")
            + f"; planners: {', '.join(sorted(planners))}"
            + f"; policy {policy.source} (sha256 {policy_digest})"
            + (f" (shadow: {shadow.path}, enforcing nothing)" if shadow else "")
            + f"; audit sink {audit.sink.describe()}; payload encryption "
            + (f"on (active key {codec.keyring.active})" if isinstance(codec, EncryptionCodec) else "off")
            + f"; state keys {', '.join(keys.keys)} (newest {keys.newest})"
            + (f"; version {BUILD} of Worker Deployment {deployment!r} (its runs are pinned to it; new runs come "
               f"once it is current: `temporal worker deployment set-current-version --deployment-name {deployment} "
               f"--build-id {BUILD}`)" if deployment else f"; unversioned (build {BUILD})")
            + (f"; metrics on http://{metrics_host}:{metrics_port}/metrics" if metrics_port else ""),
            flush=True,
        )
        await stop.wait()
        print("worker shutting down: finishing tasks in flight", flush=True)
    if mcp_servers is not None:
        await mcp_servers.aclose()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tools",
        default=os.environ.get("TETHER_TOOLS", DEFAULT_TOOLS),
        help="comma-separated tool modules to load (env TETHER_TOOLS)",
    )
    parser.add_argument(
        "--planner",
        action="append",
        default=[p for p in os.environ.get("TETHER_PLANNERS", "").split(",") if p.strip()],
        metavar="NAME=MODULE:ATTR",
        help="a planner of your own that runs may name (--planner NAME), e.g. "
        "refunds=examples.agents.refund_agent:planner; repeatable (env TETHER_PLANNERS, comma-separated)",
    )
    parser.add_argument("--task-queue", default=task_queue(), help="env TETHER_TASK_QUEUE")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("TETHER_METRICS_PORT") or 0) or None,
        help="serve Prometheus metrics on this port (env TETHER_METRICS_PORT; default: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default=os.environ.get("TETHER_METRICS_HOST") or DEFAULT_METRICS_HOST,
        help="address the metrics endpoint binds (env TETHER_METRICS_HOST; default 127.0.0.1, "
        "this machine only: set 0.0.0.0 for a scraper elsewhere)",
    )
    parser.add_argument(
        "--policy",
        default=None,
        help="TOML policy file (env TETHER_POLICY; default: every write needs one approval "
        "from someone other than the requester)",
    )
    parser.add_argument(
        "--shadow-policy",
        default=None,
        help="a proposed policy (TOML or .cedar) judged beside the live one on every decision and "
        "pre-write check, enforcing nothing: disagreements are logged and counted (env TETHER_SHADOW_POLICY)",
    )
    parser.add_argument(
        "--mcp-config",
        default=None,
        help="TOML file of MCP servers whose tools this worker offers (env TETHER_MCP_CONFIG; "
        "see docs/mcp.md)",
    )
    parser.add_argument(
        "--new-ledger",
        action="store_true",
        help="begin an empty effect ledger where one was created and is gone (what it recorded, writes "
        "and undos, may then be started again); without it the worker refuses to start there",
    )
    parser.add_argument(
        "--deployment",
        default=os.environ.get(DEPLOYMENT_ENV) or None,
        help=f"run as version {BUILD} of this Worker Deployment: its runs stay on this build's workers "
        f"(env {DEPLOYMENT_ENV}; default: unversioned; docs/changing-workflows.md)",
    )
    args = parser.parse_args(argv)
    if args.deployment:
        try:
            deployment_name(args.deployment)
        except TetherError as e:
            raise SystemExit(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(
        serve(
            args.tools.split(","),
            args.task_queue,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            policy_path=args.policy,
            mcp_config_path=args.mcp_config,
            shadow_policy_path=args.shadow_policy,
            new_ledger=args.new_ledger,
            planner_specs=args.planner,
            deployment=args.deployment,
        )
    )


if __name__ == "__main__":
    status: int | str | None = None
    try:
        main()
    except SystemExit as e:  # configuration errors: one line, exit 1
        status = e.code
    if isinstance(status, str):
        print(status, file=sys.stderr)
        status = 1
    exit_process(status)
