"""`tether` whose history replays wait for a gate: a repair slowed between judging a run and
resetting it, as one replaying many candidate prefixes on a loaded machine is
(tests/tether/test_repair.py). Once it is about to replay it creates GATE.waiting; it replays once GATE
exists. Run as a script:

    python -m tests.helpers.slow_repair GATE repair RUN [options]
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from temporalio.worker import Replayer

import starter


def main(gate: Path, argv: list[str]) -> None:
    replay = Replayer.replay_workflow

    async def gated(self: Replayer, *args: Any, **kwargs: Any) -> Any:
        gate.with_suffix(".waiting").touch()
        while not gate.exists():
            await asyncio.sleep(0.05)
        return await replay(self, *args, **kwargs)

    Replayer.replay_workflow = gated  # type: ignore[method-assign]
    sys.argv = ["tether", *argv]
    starter.run()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
