"""Replaying recorded or live histories on this code, with the recording's key ring (replay
checks every attestation and seal)."""

from __future__ import annotations

from temporalio.client import WorkflowHandle
from temporalio.worker import Replayer


def replayer(*workflows: type) -> Replayer:
    """A replayer holding the recording's key ring: replay checks every attestation and seal."""
    from tether.store.keys import KeyRing
    from tests.histories.record import RING
    from worker import create_replayer

    return create_replayer(keys=KeyRing.from_env(str(RING)), workflows=workflows)


async def replays(handle: WorkflowHandle) -> None:
    """The run's own history replays on this code: the new commands are deterministic."""
    from worker import create_replayer

    replayer = create_replayer()
    result = await replayer.replay_workflow(await handle.fetch_history(), raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
