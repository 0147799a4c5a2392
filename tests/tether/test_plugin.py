"""TetherPlugin (activities/plugin.py): a worker and a replayer are configured by one plugin, so a
replay runs a recorded history under the worker's own configuration: its workflow, its sandbox,
its key ring, its converter. A replay under another ring, or without the plugin, is refused."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from tether.audit.collector import AuditCollector
from tether.store.codec import EncryptionCodec, KEY_FILE_ENV, new_key_line
from tether.store.keys import KeyRing, KeyRingInterceptor
from activities.plugin import TetherPlugin
from tether import create_replayer
from tether.replay import WORKFLOW_RUNNER
from workflows.agent_run import AgentRun

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
ACTIVITIES = {"execute_tool", "plan", "run_setup", "policy_check_decision", "policy_check_authority", "policy_check_handoff", "policy_check_person", "notify",
              "audit_append", "recovery_source"}


def recorded(name: str = "approve") -> WorkflowHistory:
    return WorkflowHistory.from_json(f"history-{name}", (HISTORIES / f"{name}.json").read_text())


def recording_ring() -> KeyRing:
    from tests.histories.record import RING

    return KeyRing.from_env(str(RING))


def rings(config: dict) -> list[KeyRing]:
    return [i.ring for i in config.get("interceptors") or () if isinstance(i, KeyRingInterceptor)]


async def test_a_worker_and_a_replayer_have_one_configuration(dev_env: WorkflowEnvironment) -> None:
    """The worker create_worker builds and the replayer of its histories: the same workflow,
    sandbox and ring (one interceptor each); the worker alone has the activities and the collector."""
    from worker import create_worker

    ring = KeyRing.from_env()
    worker = create_worker(dev_env.client, task_queue="plugin-config-never-polled", keys=ring)
    replayer = create_replayer(keys=ring, data_converter=dev_env.client.data_converter)
    at_work, at_replay = worker.config(active_config=True), replayer.config(active_config=True)
    assert list(at_work["workflows"]) == list(at_replay["workflows"]) == [AgentRun]
    assert at_work["workflow_runner"] is at_replay["workflow_runner"] is WORKFLOW_RUNNER
    assert "workflows" in WORKFLOW_RUNNER.restrictions.passthrough_modules
    assert rings(at_work) == rings(at_replay) == [ring]
    assert at_replay["data_converter"] is dev_env.client.data_converter
    assert {getattr(a, "__temporal_activity_definition").name for a in at_work["activities"]} == ACTIVITIES
    assert [type(i) for i in at_work["interceptors"] if isinstance(i, AuditCollector)] == [AuditCollector]
    assert not [i for i in at_replay["interceptors"] if isinstance(i, AuditCollector)]  # a replay does no I/O
    assert [p.name() for p in worker.config()["plugins"]] == ["tether.TetherPlugin"]


async def test_a_recorded_history_replays_under_the_plugin_and_not_under_another_ring() -> None:
    """The plugin hands the replayed workflow its ring: with the recording's, the history
    replays; with another ring (a worker outside the fleet) the workflow code refuses the seals."""
    ok = await create_replayer(keys=recording_ring()).replay_workflow(recorded(), raise_on_replay_failure=False)
    assert ok.replay_failure is None, ok.replay_failure
    stranger = KeyRing.of(secrets.token_hex(32).encode(), source="another fleet")
    refused = await create_replayer(keys=stranger).replay_workflow(recorded(), raise_on_replay_failure=False)
    assert "key_missing" in str(refused.replay_failure), refused.replay_failure


async def test_without_the_plugin_the_workflow_has_no_ring() -> None:
    """The SDK's bare replayer (no TetherPlugin) cannot replay a Tether history: the ring is the
    plugin's to give, never read by the workflow code from anywhere else."""
    bare = Replayer(workflows=[AgentRun], data_converter=pydantic_data_converter, workflow_runner=WORKFLOW_RUNNER)
    result = await bare.replay_workflow(recorded(), raise_on_replay_failure=False)
    assert "built without the fleet's key ring" in str(result.replay_failure), result.replay_failure


def test_the_replayer_takes_the_converter_connect_makes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No converter given: the one ``connect`` makes from the environment, the payload codec
    included when TETHER_ENCRYPTION_KEY_FILE names a key; a converter given wins."""
    key_file = tmp_path / "payload.keys"
    key_file.write_text(new_key_line("k1") + "\n")
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    converter = create_replayer(keys=recording_ring()).config(active_config=True)["data_converter"]
    assert isinstance(converter.payload_codec, EncryptionCodec)
    chosen = create_replayer(keys=recording_ring(), data_converter=pydantic_data_converter)
    assert chosen.config(active_config=True)["data_converter"] is pydantic_data_converter
    monkeypatch.delenv(KEY_FILE_ENV)
    plain = create_replayer(keys=recording_ring()).config(active_config=True)["data_converter"]
    assert plain.payload_codec is None and plain.payload_converter_class is pydantic_data_converter.payload_converter_class


def test_a_replayer_may_name_its_own_workflow_in_place_of_agent_run() -> None:
    """An older or deliberately broken build replays on purpose (tests, repair): it replaces
    AgentRun (two classes of one workflow name cannot both be registered)."""
    from tests.helpers.tampered import TamperedAgentRun

    config = create_replayer(keys=recording_ring(), workflows=[TamperedAgentRun]).config(active_config=True)
    assert list(config["workflows"]) == [TamperedAgentRun]
    assert list(TetherPlugin(keys=recording_ring()).configure_replayer({"workflows": []})["workflows"]) == [AgentRun]


async def test_the_plugin_alone_is_the_whole_recipe(dev_env: WorkflowEnvironment) -> None:
    """`Worker(client, task_queue=..., plugins=[TetherPlugin(...)])` is a Tether worker: the plugin
    builds its activities from its arguments (the policy, the tools), the audit collector, and the
    identity that names the tools it serves; the worker builds no activity of its own."""
    from temporalio.worker import Worker

    from tether.policy.files import PolicyStore
    from tether.tools.sdk import REGISTRY

    ring = KeyRing.from_env()
    plugin = TetherPlugin(policy=PolicyStore(None), tools=REGISTRY, keys=ring)
    worker = Worker(dev_env.client, task_queue="plugin-recipe-never-polled", plugins=[plugin])
    config = worker.config(active_config=True)
    assert {getattr(a, "__temporal_activity_definition").name for a in config["activities"]} == ACTIVITIES
    assert [type(i) for i in config["interceptors"] if isinstance(i, AuditCollector)] == [AuditCollector]
    assert rings(config) == [ring] and list(config["workflows"]) == [AgentRun]
    assert " tools=" in config["identity"] and plugin.rules.keys is ring and plugin.audit.publics is not None
    # Two workers of one plugin: each its own activities (the ledger and collector are per client).
    other = Worker(dev_env.client, task_queue="plugin-recipe-never-polled-2", plugins=[plugin])
    assert other.config(active_config=True)["activities"][0] is not config["activities"][0]
