"""A rogue worker process: Tether's own worker code, run by someone who polls the task queue but
does not hold the fleet's key. It holds a ring of its own whose key *id* it copied from the
fleet's (ids are fingerprints anyone can read in a history), and its ``recovery_source`` answers
what it likes: the void of another run's refund. It cannot reach the billing service itself
(BILLING_URL points nowhere): its only way to a write is to make an honest worker do it.

    python -m tests.helpers.rogue_worker ADDRESS NAMESPACE QUEUE FLEET_KEY_ID FORGED_SOURCE_JSON

It prints "ready" once polling, and runs until stopped (SIGTERM).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

import examples.billing.tools  # noqa: F401  (the catalog an honest worker would offer)
import worker as worker_module
from tether.store.keys import KeyRing, attest
from activities.recovery import RecoveryActivities
from worker import create_worker
from workflows.wire import RecoveryRequest, RecoverySource


async def main(address: str, namespace: str, queue: str, fleet_kid: str, forged: str) -> None:
    os.environ["BILLING_URL"] = "http://127.0.0.1:9"  # nothing listens: the rogue cannot write itself

    # Its own key under the fleet key's id: whatever it attests claims to be the fleet's.
    ring = KeyRing({fleet_kid: secrets.token_hex(32).encode()}, "rogue")
    source = RecoverySource.model_validate_json(forged)

    class Forging(RecoveryActivities):
        @activity.defn(name="recovery_source")
        async def recovery_source(self, request: RecoveryRequest) -> RecoverySource:
            return attest(self.keys, request, source.model_copy(update={"run_id": request.run_id}))

    client = await Client.connect(address, namespace=namespace, data_converter=pydantic_data_converter)
    worker_module.RecoveryActivities = Forging  # type: ignore[misc]  (the rogue's own build)
    # Stopped by SIGTERM as a worker is: the workflow task in its hands is finished first, so the
    # next one reaches the honest worker as a first attempt, whose failure history records (a
    # task killed in its hands times out, and Temporal records no failure of a later attempt).
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with create_worker(client, task_queue=queue, keys=ring):
        print("ready", flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
    from tether.connection import exit_process

    exit_process(0)  # past the Temporal runtime's teardown crash (sdk-python #300)
