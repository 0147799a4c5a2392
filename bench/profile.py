"""Where the worker's Python time goes: py-spy samples of the bench worker, by bucket.

    python -m bench.overhead --profile DIR ...   (py-spy from the extra `bench`)
    python -m bench.profile DIR/governed.txt DIR/bare.txt

While a variant's measured batches run, ``py-spy record --format raw`` samples the worker
process (all its Python threads); the stacks are then put in the first bucket whose marker
appears in them. Idle frames (a thread-pool thread waiting for work, the event loop in its
selector) are left out. Temporal's Rust core threads have no Python frames: py-spy shows them as
bare thread names ("native"), so /proc's CPU figures stay the reference for totals.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from bench.common import table

# (bucket, markers): the first bucket one of whose markers is in a stack gets its samples.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("audit_append local activity (runs on the event loop)", ("JsonlAuditSink.append", "audit_append")),
    ("policy / catalog / carryover local activities",
     ("PolicyActivities", "SetupActivities", "tool_catalog", "carryover_seal", "carryover_verify")),
    ("tool activity body", ("ToolActivities.execute_tool", "peer_agents.py")),
    ("planner activity body", ("tether/planners/planning.py", "pydantic_ai/models/function.py")),
    ("sandbox: a new workflow instance (module re-import)", ("_Instance.__init__", "_create_workflow_instance")),
    ("workflow code (workflows/*.py, bench/bare.py)", ("workflows/", "bench/bare.py")),
    ("payload visiting and converter per activation",
     ("PayloadVisitor", "_get_current_dc", "get_serialization_context", "encode_completion",
      "decode_activation", "_CommandAwareDataConverter")),
    ("other workflow activation handling", ("_handle_activation", "_Instance._run_code", "_RunningWorkflow")),
    ("activity worker plumbing (start, complete, heartbeat)", ("_ActivityWorker",)),
    ("event loop wake-ups across threads", ("call_soon_threadsafe", "_write_to_self", "_chain_future")),
]
IDLE_LEAVES = ("_worker (concurrent/futures/thread.py", "EpollSelector.select (selectors.py")


def py_spy() -> str:
    found = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy is not installed: it comes with the extra `bench` (make bench-peer installs it)")
    return found


class Recorder:
    """``py-spy record`` of one process into ``path`` (raw collapsed stacks), appended per use."""

    def __init__(self, pid: int, path: Path, rate: int = 100) -> None:
        self.pid, self.path, self.rate = pid, path, rate
        self.proc: subprocess.Popen | None = None
        self.part = 0

    def start(self) -> None:
        self.part += 1
        out = self.path.with_suffix(f".part{self.part}")
        self.proc = subprocess.Popen(
            [py_spy(), "record", "--pid", str(self.pid), "--format", "raw", "--rate", str(self.rate),
             "--threads", "--output", str(out), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        time.sleep(0.3)  # attached before the batch starts

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
        out = self.path.with_suffix(f".part{self.part}")
        if out.exists():
            with self.path.open("a") as f:
                f.write(out.read_text())
            out.unlink()


def buckets(path: Path) -> tuple[collections.Counter, int]:
    """Samples per bucket ("native": threads without Python frames; "other": the rest)."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if frames[-1].startswith(IDLE_LEAVES):
            continue
        total += int(n)
        if len(frames) == 1:
            counts["native (Temporal core threads, no Python frames)"] += int(n)
            continue
        name = next((b for b, markers in BUCKETS if any(m in stack for m in markers)), "other")
        counts[name] += int(n)
    return counts, total


def report(paths: dict[str, Path], steps: dict[str, int] | None = None) -> str:
    """A table of samples per bucket and variant (per 100 steps when ``steps`` is given)."""
    found = {name: buckets(p) for name, p in paths.items()}
    names = list(found)
    order = [b for b, _ in BUCKETS] + ["other", "native (Temporal core threads, no Python frames)"]
    scale = {n: (100 / steps[n] if steps and steps.get(n) else 1.0) for n in names}
    unit = "samples per 100 steps" if steps else "samples"
    rows = [[b, *(f"{found[n][0][b] * scale[n]:.0f}" for n in names)] for b in order]
    rows.append(["total (not idle)", *(f"{found[n][1] * scale[n]:.0f}" for n in names)])
    return table([f"worker, py-spy {unit}", *names], rows)


def main(argv: Sequence[str] | None = None) -> None:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        raise SystemExit("usage: python -m bench.profile FILE.txt [FILE.txt ...]")
    print(report({p.stem: p for p in paths}))


if __name__ == "__main__":
    sys.exit(main())
