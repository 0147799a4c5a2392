"""What a Tether worker is, in one place, beside the activities it registers (as the anchors'
plugins live with theirs): :class:`TetherPlugin` builds a worker's activities from its arguments (the policy, the tools, the audit sink, the planners) over the worker's stores, and configures the worker with them and with the workflow side a replayer has too
(:class:`tether.replay.WorkflowPlugin`: the workflow, the sandbox, the fleet's key ring, the
converter). The whole recipe::

    Worker(client, task_queue="tether", plugins=[TetherPlugin(policy=PolicyStore.from_env(None))])

The activities are built when the worker is (they need its client: the audit collector reads
closed runs, the recovery activity reads the original run), one set per worker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from temporalio.client import Client
from temporalio.converter import DataConverter
from temporalio.worker import Worker, WorkerConfig, WorkflowRunner

from activities.audit import AuditActivities
from activities.notify import NotifyActivities
from activities.policy_checks import PolicyActivities
from activities.recovery import RecoveryActivities
from activities.setup import SetupActivities
from activities.tools import ToolActivities
from tether.audit.collector import AuditCollector
from tether.planners.planning import Planner
from tether.policy.files import PolicyStore
from tether.policy.judgements import log_from_env
from tether.pollers import LEDGER_MARK, tools_mark
from tether.replay import WorkflowPlugin
from tether.store.effect_ledger import ledger_for
from tether.store.keys import KeyRing
from tether.tools.sdk import REGISTRY, ToolRegistry


class TetherPlugin(WorkflowPlugin):
    """A Tether worker's configuration, for ``Worker(plugins=[...])``; a replayer takes its
    workflow side alone (:func:`tether.replay.create_replayer`).

    ``policy``: the policy file in force (default: the built-in safe default, no file); ``rules``:
    the policy activities over it, given where they judge a shadow policy too. ``tools``: the tool
    registry (default: the tools ``@tool`` registered). ``audit``: the audit activities over the
    sink (default: ``TETHER_AUDIT_DSN`` or ``TETHER_AUDIT_DIR``), with the effect ledger beside
    it; ``new_ledger``: begin an empty ledger where one was created and is gone. ``planners``: the
    planners runs may name (default: the built-in ones). ``keys``: the fleet's ring (default:
    ``TETHER_STATE_KEY_FILE``). ``workflows``: default ``AgentRun``.
    """

    def __init__(
        self,
        *,
        policy: PolicyStore | None = None,
        rules: PolicyActivities | None = None,
        tools: ToolRegistry = REGISTRY,
        audit: AuditActivities | None = None,
        planners: Mapping[str, Planner] | None = None,
        keys: KeyRing | None = None,
        new_ledger: bool = False,
        workflows: Sequence[type] = (),
        data_converter: DataConverter | None = None,
        workflow_runner: WorkflowRunner | None = None,
    ) -> None:
        super().__init__(keys=keys, workflows=workflows, data_converter=data_converter, workflow_runner=workflow_runner)
        self.tools = tools
        self.planners = planners
        self.new_ledger = new_ledger
        # The audit sink (TETHER_AUDIT_DSN or TETHER_AUDIT_DIR): refused here, at configuration.
        self.audit = audit or AuditActivities()
        self.rules = rules or PolicyActivities(policy or PolicyStore(None), self.keys)
        if self.rules.keys is None:
            self.rules.keys = self.keys
        if self.rules.judgements is None:  # each Cedar judgement, where the audit sink is
            self.rules.judgements = log_from_env()
        if self.audit.publics is None:
            self.audit.publics = self.keys.public_keys()  # the sink takes only records the fleet signed
        self.collector: AuditCollector | None = None

    def activities_for(self, client: Client) -> list[Callable[..., Any]]:
        """The activities of a worker on ``client``, over the effect ledger beside the audit sink
        (each write and each undo started at most once, whichever run asks); the audit collector
        that writes a run's end records into the same sink once it has closed."""
        keys, audit, rules = self.keys, self.audit, self.rules
        ledger = ledger_for(audit.sink, new_ledger=self.new_ledger)
        # The tool worker judges the first call after a decision the run took on its roster, as the
        # policy activity would (the same file, the same judgements logged).
        tools = ToolActivities(self.tools, keys, ledger, records=audit.write, judge=rules.judge_decision)
        notify = NotifyActivities(rules.store)
        recovery = RecoveryActivities(client, keys, ledger)
        setup = SetupActivities(tools, rules, self.planners)
        self.collector = AuditCollector(client, audit.sink, publics=audit.publics)
        return [
            tools.execute_tool,
            setup.plan,
            setup.run_setup,
            rules.check_decision,
            rules.check_authority,
            rules.check_handoff,
            rules.check_person,
            notify.notify,
            audit.audit_append,
            recovery.recovery_source,
        ]

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        client = config["client"]
        self.activities = self.activities_for(client)
        config = super().configure_worker(config)
        # Its identity says which tools it serves (before its ledger mark): `tether status` and the
        # inbox tell a run whose tools no live worker serves (tether/pollers.served_tools).
        head, mark, ledger = (config.get("identity") or client.identity).partition(LEDGER_MARK)
        config["identity"] = f"{head}{tools_mark(self.tools.tools)}{mark}{ledger}"
        assert self.collector is not None
        return self.collector.configure_worker(config)

    async def run_worker(self, worker: Worker, next: Callable[[Worker], Awaitable[None]]) -> None:
        if self.collector is None:
            await next(worker)
        else:  # collects the end records of the runs this worker ends, until it stops
            await self.collector.run_worker(worker, next)
