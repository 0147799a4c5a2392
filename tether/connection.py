"""What both a client and a worker need: the connection to Temporal, Tether's error type and its
codes, and the names of the task queue and the Worker Deployment.

:class:`TetherError`'s ``code`` is the CLI's exit code:

    0 OK        done
    1 REFUSED   the run refused it (stale plan hash, four-eyes, not a member, not awaiting
                approval, already finished), a decision not sent (no worker to take it: nothing
                decided) or, for a wait, the run ended other than COMPLETED
    2 USAGE     bad input, unknown run, Temporal unreachable
    3 PENDING   a decision the run accepted but has not judged yet (a slow policy check): the
                verdict follows on the run's record (`tether status RUN`)

Connection settings come from Temporal's environment configuration (TEMPORAL_ADDRESS,
TEMPORAL_NAMESPACE, TLS and API-key variables, profiles); where they name no server, from the
checkout's own dev stack (``.tether/stack.json``, ``examples/devstack.py``); payload encryption
from ``TETHER_ENCRYPTION_KEY_FILE`` (``tether/store/codec.py``).
"""

from __future__ import annotations

import os
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

from temporalio.client import Client
from temporalio.envconfig import ClientConfig
from temporalio.service import RPCError, RPCStatusCode

from tether.store.codec import KeyFileError, data_converter_from_env

OK, REFUSED, USAGE, PENDING = 0, 1, 2, 3
DEFAULT_TASK_QUEUE = "tether"
MCP_TASK_QUEUE = "tether-mcp"  # the MCP demo's worker (examples/devstack.py, docs/mcp.md)
QUERY_TIMEOUT = timedelta(seconds=10)
CONNECT_HINT = "start it with `make dev-server` or set TEMPORAL_ADDRESS"
# The Worker Deployment the workers are versions of (worker.py; docs/changing-workflows.md).
DEPLOYMENT_ENV = "TETHER_DEPLOYMENT"


class TetherError(Exception):
    """A failed operation, as one line for a person. What kind of failure it is is its class
    (one of the five below; catch ``TetherError`` for all), and the class is the CLI's exit code
    (``code``): callers branch on the type, never on the message.

    ``field`` names the input that was invalid (a model field such as ``approver``), so a front
    end can point at its own option for it. ``rule``: the run's rule that refused it
    (four_eyes, stale_plan_hash, ...) or the client's own (unknown_run, no_worker, ...), when
    one did. Rules stay text: a tenant's Cedar policy names its own (``@rule``).
    """

    code: ClassVar[int] = USAGE

    def __init__(self, message: str, *, field: str | None = None, detail: str = "", rule: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.detail = detail or message
        self.rule = rule


class UsageError(TetherError):
    """Bad input, an unknown run, a call Temporal would not take: nothing was done (exit 2)."""


class Refused(TetherError):
    """The run (or its policy, on the client's copy) refused it, or a waited-for run ended other
    than COMPLETED (exit 1)."""

    code = REFUSED


class Pending(TetherError):
    """The run accepted the request and has not judged it yet: the verdict follows on its
    record (exit 3)."""

    code = PENDING


class NoWorker(TetherError):
    """No worker serves the run's task queue (or none took its task): nothing reached the run
    (exit 2)."""

    def __init__(self, message: str, *, field: str | None = None, detail: str = "", rule: str | None = "no_worker") -> None:
        super().__init__(message, field=field, detail=detail, rule=rule)


class Unreachable(TetherError):
    """Temporal cannot be reached (or stopped answering): nothing was sent (exit 2)."""


def exit_process(code: int | None) -> None:
    """Exit without interpreter teardown, after flushing output.

    The Temporal client's native threads can outlive the event loop and crash CPython's
    finalization (SIGABRT, "PyGILState_Release ... must be current"; sdk-python issue #300),
    which would turn a successful command into exit code 134.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # the reader went away (`| head`): nothing left to tell it
    os._exit(code or 0)


# The dev stack of the checkout this code runs from (`make demo`, `make dev-server`): its
# server address, task queue and worker's policy file. An installed package has none.
STACK_FILE = Path(__file__).resolve().parent.parent / ".tether" / "stack.json"


def checkout_stack() -> dict[str, Any]:
    """This checkout's dev stack, as ``examples/devstack.py`` recorded it, when Temporal's
    configuration names no server ({} otherwise, or when there is none): a second checkout's
    commands use its own stack, never the first one's on the default port."""
    import json

    if "target_host" in ClientConfig.load_client_connect_config():  # TEMPORAL_ADDRESS, a profile
        return {}
    try:
        record = json.loads(STACK_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def task_queue() -> str:
    return os.environ.get("TETHER_TASK_QUEUE") or checkout_stack().get("task_queue") or DEFAULT_TASK_QUEUE


def deployment_name(given: str | None) -> str:
    name = given or os.environ.get(DEPLOYMENT_ENV) or ""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,200}", name):
        raise UsageError(
            f"give the Worker Deployment with --deployment NAME (env {DEPLOYMENT_ENV}), as its workers were started"
            if not name else f"invalid deployment name {name[:80]!r}: letters, digits, '-' and '_'",
            field="deployment",
        )
    return name


def connect_config(**overrides: Any) -> dict[str, Any]:
    """Temporal's environment configuration (env vars, profiles), with our defaults: where it
    names no server, the checkout's dev stack, else localhost:7233."""
    config: dict[str, Any] = dict(ClientConfig.load_client_connect_config())
    if isinstance(address := checkout_stack().get("temporal"), str):
        config["target_host"] = address
    config.setdefault("target_host", "localhost:7233")
    config.setdefault("namespace", "default")
    config.update(overrides)
    return config


def connect_cause(text: str) -> str:
    """The readable part of the SDK's connection error (a nested Rust debug string)."""
    kind = re.search(r'ConnectError\("([^"]+)"', text)
    details = re.findall(r'(?:message|error): "([^"]+)"', text)
    parts = [p for p in (kind.group(1) if kind else None, details[-1] if details else None) if p]
    return ": ".join(parts) if parts else " ".join(text.split())


async def connect(**overrides: Any) -> Client:
    """Connect with Temporal's environment configuration and Tether's data converter.

    The converter is pydantic's; when ``TETHER_ENCRYPTION_KEY_FILE`` names a key file it also
    encrypts every payload and failure message (``tether/store/codec.py``). Overrides (target_host,
    namespace, runtime, interceptors, data_converter, ...) go to ``Client.connect``. A server
    that cannot be reached raises :class:`TetherError` naming the address and the cause.
    """
    config = connect_config(**overrides)
    try:
        if "data_converter" not in config:
            config["data_converter"] = data_converter_from_env()
        return await Client.connect(**config)
    except KeyFileError as e:
        raise UsageError(f"payload encryption: {e}") from None
    except RuntimeError as e:
        raise Unreachable(
            f"cannot reach Temporal at {config['target_host']} ({connect_cause(str(e))}); {CONNECT_HINT}"
        ) from None


def timed_out(err: RPCError) -> bool:
    """The call's own rpc timeout ran out (the SDK reports it as CANCELLED "Timeout expired"):
    for a query or an Update, no worker answered in time."""
    return err.status == RPCStatusCode.DEADLINE_EXCEEDED or (
        err.status == RPCStatusCode.CANCELLED and "timeout expired" in err.message.lower()
    )


def rpc_error(err: RPCError, run_id: str) -> TetherError:
    """A Temporal call's failure for run ``run_id``, as what a person does next."""
    if err.status == RPCStatusCode.NOT_FOUND:
        if "completed" in err.message.lower():
            return Refused(f"run {run_id} already finished")
        return UsageError(f"unknown run {run_id!r}: check the id with `tether list`", rule="unknown_run")
    if timed_out(err):
        return NoWorker(f"no worker answered for run {run_id}: start one with `make worker`", rule=None)
    if err.status == RPCStatusCode.RESOURCE_EXHAUSTED:
        # E.g. Temporal's limit of 10 decide Updates in flight per run: nothing was sent.
        return UsageError(f"Temporal is limiting calls to run {run_id} ({err.message}): nothing was sent; try again in a moment")
    if err.status == RPCStatusCode.UNAVAILABLE:
        return Unreachable(f"Temporal became unreachable ({err.message.splitlines()[0] if err.message else 'unavailable'})")
    return UsageError(f"Temporal refused the call for {run_id}: {err.message}")
