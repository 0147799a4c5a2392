"""What a Tether worker's workflow code runs under, for a worker and a replayer alike:
:class:`WorkflowPlugin` (temporalio's ``SimplePlugin``) and :func:`create_replayer`, so a replay of
a recorded history (tests, `tether repair`, a forced hand-off, benchmarks) runs the very
configuration a worker ran it with:

- the workflow (``AgentRun``; a test or a benchmark may name its own);
- the sandbox, with ``workflows/`` passed through (``WORKFLOW_RUNNER``);
- the fleet's key ring, handed to the workflow code as an extern function of this worker only
  (``KeyRingInterceptor``: seals, capabilities, attestations);
- the data converter: pydantic's, with the payload codec when ``TETHER_ENCRYPTION_KEY_FILE``
  names a key (a worker takes its client's, made by ``tether.connection.connect``).

A worker's activities are not here: :class:`activities.plugin.TetherPlugin` adds them (a replay does
no I/O), so a repair replays without importing activities/.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from temporalio.converter import DataConverter
from temporalio.plugin import SimplePlugin
from temporalio.worker import Replayer, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from tether.store.codec import data_converter_from_env
from tether.store.keys import KeyRing, KeyRingInterceptor
from workflows.agent_run import AgentRun

PLUGIN_NAME = "tether.TetherPlugin"

# The workflow modules, agent_run.py included, are checked for determinism from their source
# (tests/helpers/determinism_lint.py): passed through, the sandbox does not re-import and re-define the
# AgentRun class for every run it starts or replays (docs/performance.md).
WORKFLOW_RUNNER = SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules("workflows"))


class WorkflowPlugin(SimplePlugin):
    """The workflow side of a Tether worker, for ``Replayer(plugins=[...])`` (and, through
    :class:`activities.plugin.TetherPlugin`, ``Worker(plugins=[...])``).

    ``keys``: the fleet's ring (default: ``TETHER_STATE_KEY_FILE``, never created here).
    ``workflows``: the workflow classes (default: ``AgentRun``). ``data_converter``: a replayer's
    (default: the one ``connect`` makes from the environment). ``workflow_runner``: default
    ``WORKFLOW_RUNNER``.
    """

    def __init__(
        self,
        *,
        keys: KeyRing | None = None,
        workflows: Sequence[type] = (),
        data_converter: DataConverter | None = None,
        workflow_runner: WorkflowRunner | None = None,
        activities: Sequence[Callable[..., Any]] = (),
    ) -> None:
        self.keys = keys or KeyRing.from_env()
        super().__init__(
            PLUGIN_NAME,
            data_converter=lambda given: data_converter or _chosen(given) or data_converter_from_env(),
            interceptors=[KeyRingInterceptor(self.keys)],
            activities=list(activities) or None,
            workflows=list(workflows) or [AgentRun],
            workflow_runner=workflow_runner or WORKFLOW_RUNNER,
        )


def _chosen(converter: DataConverter | None) -> DataConverter | None:
    """A converter the caller chose (None: the SDK's default, which knows no pydantic model)."""
    return None if converter is None or converter is DataConverter.default else converter


def create_replayer(
    *, keys: KeyRing | None = None, workflows: Sequence[type] = (), data_converter: DataConverter | None = None,
    workflow_runner: WorkflowRunner | None = None, **options: Any,
) -> Replayer:
    """The one way to replay Tether histories (tests, benchmarks, `tether repair`): a worker's
    workflow configuration (:class:`WorkflowPlugin`) with the fleet's ring (``keys``, else
    TETHER_STATE_KEY_FILE), since replay checks every attestation and seal the run acted on.
    ``workflows`` replace ``AgentRun`` (an older or a broken build, replayed on purpose)."""
    plugin = WorkflowPlugin(keys=keys, workflows=workflows, data_converter=data_converter, workflow_runner=workflow_runner)
    return Replayer(workflows=[], plugins=[plugin, *options.pop("plugins", ())], **options)
