"""The recorded histories (tests/histories/*.json) replayed with the sandbox's checks ON, under
several ``PYTHONHASHSEED`` values, each seed in its own process (issue 33).

Production passes ``workflows`` through the sandbox (worker.WORKFLOW_RUNNER: no re-import of the
workflow modules per run), so there nothing checks that code at run time; tests/helpers/determinism_lint.py
checks it from the source. This is the second layer, paid for in tests only:

- the workflow modules are re-imported inside a default sandbox, so ``datetime.now()``,
  ``random``, ``os.environ``... raise where the code reaches them. ``agent_run.py`` imports them
  inside ``workflow.unsafe.imports_passed_through()``, which would pass them through whatever the
  restrictions say: here that context manager is made a no-op (in this process only), and only
  the third-party libraries in :data:`PASSTHROUGH` are passed through;
- what the workflow sends on replay (every activity's arguments, the continue-as-new arguments,
  the result) must equal what the run recorded, timestamps aside (see ``_TIME``): Temporal's
  replay compares only the commands, not their inputs, and an id or a record that differs is
  what issue 33's resets and forgeries live on;
- a string set's order, ``hash()`` of a str or an Enum differ between the seeds' processes, so
  what is sent must also be the same under every seed, timestamps included.

    python -m tests.helpers.determinism_replay [--root DIR] [HISTORY.json...]

prints ``{history file name: {"failure": why or null, "sent": digest of what replay sent}}`` as
JSON. A failure is a replay failure (a command that differs, a restricted call) or an input that
differs from the recorded one. ``--root`` replays the ``workflows`` package under DIR instead (a
copy with a mutant). :func:`replay` runs the seeds
concurrently and returns ``{seed: that mapping}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORIES = sorted((ROOT / "tests/histories").glob("*.json"))
SEEDS = (0, 1, 2)
# The histories make test replays under every seed (each costs ~0.3 s of CPU per seed: the
# sandbox re-imports the workflow modules for every run): the paths that reach the most code
# (partial approval, compensation, continue-as-new and the run it continued into, whose carried
# state is verified).
# If a re-recording renames them, the largest histories stand in.
FEW = [h for h in HISTORIES if h.stem in {"partial", "compensated", "continue_as_new", "continued"}] \
    or sorted(HISTORIES, key=lambda h: -h.stat().st_size)[:4]

# Passed through besides the sandbox's defaults (which include pydantic and pydantic_core): the
# third-party packages importing workflows.agent_run loads, and nothing of workflows/. The
# workflows modules only import libraries on the lint's list of pure ones
# (tests/helpers/determinism_lint.ALLOWED_IMPORTS); these are those and their dependencies. The
# default restrictions alone replay too, but re-importing these libraries for every run costs
# 40% more CPU here (10.4 s against 6.3 s for the 18 histories) and checks nothing of ours.
PASSTHROUGH = (
    "jsonschema", "jsonschema_specifications", "referencing", "rpds", "attr", "attrs", "idna",  # jsonschema
    "jsonpatch", "jsonpointer", "re2", "rfc8785", "confusable_homoglyphs",
    "typing_inspection",  # pydantic's
)


def _runner():  # noqa: ANN202 (temporalio types imported late: --root must come first on sys.path)
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSTHROUGH))


# What the workflow code sent while replaying: each activity's arguments, the result or the
# continue-as-new arguments. Replay itself compares only which commands come in which order; the
# recorded inputs are the run's own words, so a set's order or an address that reaches a record,
# an idempotency key or the result shows here even when the commands still line up.
SENT: list[tuple[str, str, Sequence]] = []


def _interceptor():  # noqa: ANN202
    import copy

    from temporalio.worker import Interceptor, WorkflowInboundInterceptor, WorkflowOutboundInterceptor

    class Outbound(WorkflowOutboundInterceptor):
        # Copied as sent: the command's payload is what it was at this point (a model the run
        # changes later, a compensation's status, must not show its later value).
        def start_activity(self, input):  # noqa: ANN001, ANN202
            SENT.append(("activity", input.activity, copy.deepcopy(list(input.args))))
            return super().start_activity(input)

        def continue_as_new(self, input):  # noqa: ANN001, ANN202
            SENT.append(("continue_as_new", "", copy.deepcopy(list(input.args))))
            return super().continue_as_new(input)

    class Inbound(WorkflowInboundInterceptor):
        def init(self, outbound: WorkflowOutboundInterceptor) -> None:
            super().init(Outbound(outbound))

        async def execute_workflow(self, input):  # noqa: ANN001, ANN202
            result = await super().execute_workflow(input)
            SENT.append(("result", "", [result]))
            return result

    class Capture(Interceptor):
        def workflow_interceptor_class(self, input):  # noqa: ANN001, ANN202
            return Inbound

    return Capture()


def _recorded(events: list[dict]) -> list[tuple[str, str, list[bytes]]]:
    import base64

    out = []
    for e in events:
        for key, kind in (("activityTaskScheduledEventAttributes", "activity"), ("workflowExecutionContinuedAsNewEventAttributes", "continue_as_new"),
                          ("workflowExecutionCompletedEventAttributes", "result")):
            if key in e:
                attrs = e[key]
                payloads = (attrs.get("result") if kind == "result" else attrs.get("input")) or {}
                name = attrs["activityType"]["name"] if kind == "activity" else ""
                out.append((kind, name, [base64.b64decode(p.get("data", "")) for p in payloads.get("payloads", [])]))
    return out


# A timestamp: masked when replay is compared with the recording (not between seeds). sdk-core
# replays workflow.now() after a local activity as the activity's recorded complete_time, where
# the run itself may have read the start of a later workflow task (continue_as_new.json: the
# first record's "at" is .641849 recorded, .632982 on replay). Everything else must match.
_TIME = re.compile(rb'"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2})?"')


def _sent(converter) -> list[tuple[str, str, list[bytes]]]:  # noqa: ANN001
    return [(kind, name, [p.data for p in converter.to_payloads(list(args))]) for kind, name, args in SENT]


def _first_difference(recorded: list[tuple[str, str, list[bytes]]], sent: list[tuple[str, str, list[bytes]]]) -> str | None:
    for i, (want, got) in enumerate(zip(recorded, sent)):
        masked = [(k, n, [_TIME.sub(b'"<time>"', d) for d in data]) for k, n, data in (want, got)]
        if masked[0] != masked[1]:
            a, b = b"|".join(masked[0][2]), b"|".join(masked[1][2])
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"input #{i} ({want[0]} {want[1]}) differs from the recorded one at byte {at}: "
                    f"recorded ...{a[max(0, at - 120):at + 120]!r}, replay sent ...{b[max(0, at - 120):at + 120]!r}")
    if len(recorded) != len(sent):
        return f"{len(recorded)} inputs recorded, {len(sent)} sent on replay"
    return None


# tests/histories/record.py starts each path as history-NAME; continued.json is the run that
# continue_as_new.json continued into, under the same workflow id.
WORKFLOW_IDS = {"continued": "history-continue_as_new"}


async def _replay(paths: Sequence[Path]) -> dict[str, dict[str, str | None]]:
    from temporalio import workflow
    from temporalio.client import WorkflowHistory
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.worker import Replayer

    # agent_run.py's `with workflow.unsafe.imports_passed_through():` would pass the workflow
    # modules through; a no-op here, so the sandbox re-imports (and restricts) them.
    workflow.unsafe.imports_passed_through = staticmethod(contextlib.nullcontext)  # type: ignore[method-assign]
    # The replayer tests/workflows/test_replay.py replays with (its key ring, its interceptors, if it has
    # a replayer() of its own), with the sandbox's checks on and the capture added.
    try:
        from tests.helpers.replay import replayer as base
    except ImportError:
        from workflows.agent_run import AgentRun

        config = Replayer(workflows=[AgentRun], data_converter=pydantic_data_converter).config()
    else:
        config = base().config(active_config=True)  # with its TetherPlugin's configuration applied
    config["workflow_runner"] = _runner()
    config["interceptors"] = [*(config.get("interceptors") or ()), _interceptor()]
    replayer = Replayer(**config)
    out: dict[str, dict[str, str | None]] = {}
    for path in paths:
        text = path.read_text()
        SENT.clear()
        # The workflow id the recording used (tests/histories/record.py): it is in the inputs.
        history = WorkflowHistory.from_json(WORKFLOW_IDS.get(path.stem, f"history-{path.stem}"), text)
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        sent = _sent(pydantic_data_converter.payload_converter)
        failure = (f"{type(result.replay_failure).__name__}: {result.replay_failure}" if result.replay_failure is not None
                   else _first_difference(_recorded(json.loads(text)["events"]), sent))
        # Unmasked: between the seeds' processes even a timestamp must be the same.
        digest = hashlib.sha256(repr(sent).encode()).hexdigest()
        out[path.name] = {"failure": failure, "sent": digest}
    return out


def replay(root: Path, histories: Iterable[Path] = FEW, seeds: Iterable[int] = SEEDS, timeout: float = 120) -> dict[int, dict[str, dict[str, str | None]]]:
    """Replay ``histories`` on ``root``'s workflows package, one process per seed, concurrently."""
    histories = [str(h) for h in histories]

    def one(seed: int) -> dict[str, dict[str, str | None]]:
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        proc = subprocess.run([sys.executable, "-m", "tests.helpers.determinism_replay", "--root", str(root), *histories],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"replay under PYTHONHASHSEED={seed} exited {proc.returncode}: {proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    seeds = list(seeds)
    with ThreadPoolExecutor(len(seeds)) as pool:
        return dict(zip(seeds, pool.map(one, seeds)))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--root"]:
        sys.path.insert(0, str(Path(args[1]).resolve()))  # before the checkout and the editable install
        args = args[2:]
        import workflows

        # The copy, not the checkout (the editable install finds the checkout's otherwise).
        assert Path(workflows.__file__).resolve().parent.parent == Path(sys.path[0]), workflows.__file__
    print(json.dumps(asyncio.run(_replay([Path(a) for a in args] or HISTORIES))))
    # Past the teardown crash of the Temporal runtime's threads (sdk-python #300): the answer
    # is printed, the exit code must not depend on it.
    from tether.connection import exit_process

    exit_process(0)
