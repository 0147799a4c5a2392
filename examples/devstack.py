"""The local stack behind `make demo`, `make dev-server` and `make down`.

    python -m examples.devstack up [dev-server] [billing] [worker] [inbox] [mcp-worker]
    python -m examples.devstack restart [worker] [inbox]
    python -m examples.devstack down

``restart`` (default: the worker) starts the named services again with the current environment.
A worker is replaced without a gap: the new one starts beside the old, and only once it says it
is ready is the old one stopped; a new one that fails to start leaves the old one serving and
says why. (The inbox, bound to its port, is stopped, then started.) Tool modules load from the
installed packages, the checkout, the folder you run this from, and your ``PYTHONPATH``: ``TETHER_TOOLS=examples.billing.tools,my_tools TETHER_POLICY=my_policy.toml
python -m examples.devstack restart worker inbox`` swaps the demo's worker for one serving your
tools under your policy (docs/writing-tools.md); ``TETHER_PLANNERS`` adds your planners.

``mcp-worker`` (only when named; `make demo-mcp`) is a worker whose tools come from MCP servers:
``--mcp-config`` from TETHER_MCP_CONFIG (default: examples/git/mcp.toml), on its own task queue
(TETHER_MCP_TASK_QUEUE, default ``tether-mcp``), so it never takes the billing worker's runs.

Each service runs in the background in its own session (it outlives `make`), with its pid and
log under `.tether/`. `up` is idempotent: a service that is already answering is left alone.
The dev server keeps its state in `.tether/temporal.db`, so runs survive a restart.

One stack per checkout: the stack records whose it is (`.tether/stack.json`: checkout, ports,
task queue), and each port it serves on is claimed machine-wide (TETHER_STACKS_DIR, default
`$TMPDIR/tether-stacks-UID/`). A second checkout whose ports another checkout's stack holds is
refused with a message naming that checkout and the settings for a stack of its own
(TETHER_TEMPORAL_PORT, TETHER_UI_PORT, TETHER_BILLING_PORT, TETHER_CODEC_PORT,
TETHER_INBOX_PORT, TETHER_TASK_QUEUE). A service is `started` only when its own process says it is ready.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = ROOT / ".tether"
KEYS_DIR = STATE_DIR / "keys"  # the demo's signing keys (examples/billing/policy.toml, tenant "signed")
DEMO_SIGNERS = ("alice", "bob", "inbox")  # inbox: the approver inbox's own key (signers.inbox)
BIN = Path(sys.executable).parent
TEMPORAL_PORT = int(os.environ.get("TETHER_TEMPORAL_PORT", "7233"))
UI_PORT = int(os.environ.get("TETHER_UI_PORT", "8233"))
BILLING_PORT = int(os.environ.get("TETHER_BILLING_PORT", "8765"))
TASK_QUEUE = os.environ.get("TETHER_TASK_QUEUE") or "tether"
STACK_FILE = STATE_DIR / "stack.json"
STACKS_DIR = Path(os.environ.get("TETHER_STACKS_DIR") or Path(tempfile.gettempdir()) / f"tether-stacks-{os.getuid()}")
INBOX_PORT = int(os.environ.get("TETHER_INBOX_PORT", "8900"))
INBOX_URL = f"http://127.0.0.1:{INBOX_PORT}/"


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def http_ok(url: str) -> bool:
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


# The dynamic config every dev server here runs with (the demo's, the tests', the benchmarks'):
# eager activity execution. An activity a workflow task schedules on the run's own task queue
# (the decision's policy check, the tools) comes back to the worker in the server's reply to that
# task, with no trip through the task queue: under load it is most of an approval's path. The
# CLI's dev server enables it by default; a production server does not (docs/production.md).
DEV_SERVER_DYNAMIC_CONFIG = ("system.enableActivityEagerExecution=true",)


def dynamic_config_args(given: Sequence[str] = ()) -> list[str]:
    """``--dynamic-config-value`` arguments: DEV_SERVER_DYNAMIC_CONFIG, and ``given`` (KEY=VALUE)
    in place of a default of the same key."""
    keys = {value.partition("=")[0] for value in given}
    values = [v for v in DEV_SERVER_DYNAMIC_CONFIG if v.partition("=")[0] not in keys] + list(given)
    return [arg for value in values for arg in ("--dynamic-config-value", value)]


def dev_server_command(
    port: int = TEMPORAL_PORT, ui_port: int = UI_PORT, db: Path | None = None, dynamic_config: Sequence[str] = ()
) -> list[str]:
    """The dev server with our search attributes registered (unregistered ones leave runs stuck)
    and our dynamic config (``dynamic_config_args``)."""
    from workflows.published import SEARCH_ATTRIBUTES
    cmd = [
        str(BIN / "temporal"), "server", "start-dev",
        "--ip", "127.0.0.1", "--port", str(port), "--ui-port", str(ui_port),
        "--db-filename", str(db or STATE_DIR / "temporal.db"),
        "--log-level", "warn", "--ui-disable-news-fetch", *dynamic_config_args(dynamic_config),
    ]
    for key in SEARCH_ATTRIBUTES:
        cmd += ["--search-attribute", f"{key.name}=Keyword"]
    if os.environ.get("TETHER_ENCRYPTION_KEY_FILE"):
        # Payloads are encrypted: the UI asks the codec server (`python -m tether.store.codec`,
        # started by `make dev-server`) to decode them for the person looking.
        codec_port = os.environ.get("TETHER_CODEC_PORT", "8081")
        cmd += ["--ui-codec-endpoint", f"http://127.0.0.1:{codec_port}"]
    return cmd


@dataclass(frozen=True)
class Service:
    name: str
    command: Callable[[], list[str]]
    ready: Callable[[], bool]
    timeout: float = 60.0
    default: bool = True  # started by a bare `up`
    # The ports it serves on, each with the variable that moves it (claimed machine-wide).
    ports: Callable[[], dict[str, int]] = dict
    # A line its own process logs once ready: another program answering on the port is not it.
    marker: str | None = None

    @property
    def pidfile(self) -> Path:
        return STATE_DIR / f"{self.name}.pid"

    @property
    def logfile(self) -> Path:
        return STATE_DIR / f"{self.name}.log"


def worker_policy() -> str:
    """The policy file the stack's worker and inbox apply: TETHER_POLICY, else the example's
    (recorded in stack.json, where the checkout's CLI checks a tenant before it starts a run)."""
    # Relative to where you run this (the worker itself runs in the checkout).
    return os.path.abspath(os.environ["TETHER_POLICY"]) if os.environ.get("TETHER_POLICY") else str(ROOT / "examples/billing/policy.toml")


def _worker_ready(name: str = "worker") -> bool:
    log = STATE_DIR / f"{name}.log"
    pid = _pid(STATE_DIR / f"{name}.pid")
    return pid is not None and log.exists() and "worker ready" in log.read_text(errors="replace")


MCP_TASK_QUEUE = os.environ.get("TETHER_MCP_TASK_QUEUE", "tether-mcp")


CODEC_PORT = int(os.environ.get("TETHER_CODEC_PORT", "8081"))
KEY_FILE = os.environ.get("TETHER_ENCRYPTION_KEY_FILE")

SERVICES = {
    "dev-server": Service(
        "dev-server", dev_server_command, lambda: port_open(TEMPORAL_PORT),
        ports=lambda: {"TETHER_TEMPORAL_PORT": TEMPORAL_PORT, "TETHER_UI_PORT": UI_PORT},
    ),
    "billing": Service(
        "billing",
        lambda: [sys.executable, "-m", "examples.billing.service", "--port", str(BILLING_PORT),
                 "--db", str(STATE_DIR / "billing.db")],
        lambda: http_ok(f"http://127.0.0.1:{BILLING_PORT}/health"),
        ports=lambda: {"TETHER_BILLING_PORT": BILLING_PORT},
        marker="billing service listening",
    ),
    # Only with payload encryption on: lets the Web UI decode payloads for the person looking.
    "codec": Service(
        "codec",
        lambda: [sys.executable, "-m", "tether.store.codec", "--port", str(CODEC_PORT),
                 "--key-file", str(KEY_FILE),
                 "--origin", f"http://localhost:{UI_PORT}", "--origin", f"http://127.0.0.1:{UI_PORT}"],
        lambda: port_open(CODEC_PORT),
        ports=lambda: {"TETHER_CODEC_PORT": CODEC_PORT},
        marker="codec server listening",
    ),
    # The demo's worker applies the example policy (alice requests, bob approves) unless
    # TETHER_POLICY names another file.
    "worker": Service(
        "worker",
        lambda: [sys.executable, str(ROOT / "worker.py"), "--task-queue", TASK_QUEUE, "--policy",
                 worker_policy()],
        _worker_ready,
    ),
    # The approvers' web inbox, with the dev sign-in (loopback only) and the demo's inbox key,
    # which the example policy trusts as [signers.inbox].
    "inbox": Service(
        "inbox",
        lambda: [str(BIN / "tether"), "inbox", "--port", str(INBOX_PORT), "--dev-login",
                 "--policy", worker_policy(),
                 "--key", str(KEYS_DIR / "inbox.pem"), "--web-ui", f"http://localhost:{UI_PORT}"],
        lambda: http_ok(f"http://127.0.0.1:{INBOX_PORT}/healthz"),
        ports=lambda: {"TETHER_INBOX_PORT": INBOX_PORT},
        marker="Uvicorn running on",  # logged once its socket is bound
    ),
    "mcp-worker": Service(
        "mcp-worker",
        lambda: [sys.executable, str(ROOT / "worker.py"), "--tools", "", "--task-queue", MCP_TASK_QUEUE,
                 "--mcp-config", os.environ.get("TETHER_MCP_CONFIG") or str(ROOT / "examples/git/mcp.toml"),
                 "--policy", os.environ.get("TETHER_MCP_POLICY") or str(ROOT / "examples/git/policy.toml")],
        lambda: _worker_ready("mcp-worker"),
        default=False,
    ),
}


# ----------------------------------------------------------------------------- whose stack


def _claim_file(port: int) -> Path:
    return STACKS_DIR / f"port-{port}.json"


def _alive(pid: object) -> bool:
    """The process runs (an exited one nobody has reaped yet, a zombie, does not)."""
    try:
        os.kill(int(pid), 0)  # type: ignore[call-overload]
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # someone else's process: alive
    try:
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # type: ignore[call-overload]
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill(0) is all there is


def port_owner(port: int) -> dict | None:
    """The stack holding ``port`` (its record), while the service holding it lives."""
    try:
        claim = json.loads(_claim_file(port).read_text())
    except (OSError, ValueError):
        return None
    return claim if isinstance(claim, dict) and _alive(claim.get("pid")) else None


def stack_record() -> dict:
    """This checkout's stack: where it is, its ports and task queue, its services' pids."""
    try:
        record = json.loads(STACK_FILE.read_text())
    except (OSError, ValueError):
        record = {}
    record.update(
        checkout=str(ROOT), temporal=f"127.0.0.1:{TEMPORAL_PORT}", ui_port=UI_PORT,
        billing_port=BILLING_PORT, codec_port=CODEC_PORT, task_queue=TASK_QUEUE, policy=worker_policy(),
    )
    record.setdefault("services", {})
    return record


def _record(service: Service, pid: int | None) -> None:
    record = stack_record()
    if pid is None:
        record["services"].pop(service.name, None)
    else:
        record["services"][service.name] = pid
    if service.name == "worker" and pid is not None:
        # The planners its runs may name (`tether start --planner` checks against them first).
        record["planners"] = [spec.partition("=")[0].strip() for spec in
                              os.environ.get("TETHER_PLANNERS", "").split(",") if spec.strip()]
        # What it was started with, kept once it stops: the no-worker hint names the command
        # that starts this stack's worker with its tools (tether/client/workers.py).
        record["worker_env"] = {k: (worker_policy() if k == "TETHER_POLICY" else os.environ[k]) for k in
                                ("TETHER_TOOLS", "TETHER_POLICY", "TETHER_PLANNERS", "PYTHONPATH") if os.environ.get(k)}
    STATE_DIR.mkdir(exist_ok=True)
    STACK_FILE.write_text(json.dumps(record, indent=2) + "\n")
    if pid is not None:
        STACKS_DIR.mkdir(parents=True, exist_ok=True)
        for port in service.ports().values():
            _claim_file(port).write_text(json.dumps({**record, "service": service.name, "pid": pid}))
        return
    # Stopped: release what this checkout's service claimed, on whatever ports it was started.
    for claim in STACKS_DIR.glob("port-*.json"):
        try:
            owner = json.loads(claim.read_text())
        except (OSError, ValueError):
            continue
        if owner.get("checkout") == str(ROOT) and owner.get("service") == service.name:
            claim.unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_stack_hint() -> str:
    """Settings for a stack of this checkout's own, on ports free now."""
    settings = {"TETHER_TEMPORAL_PORT": _free_port(), "TETHER_UI_PORT": _free_port(),
                "TETHER_BILLING_PORT": _free_port(), "TETHER_CODEC_PORT": _free_port(),
                "TETHER_INBOX_PORT": _free_port()}
    queue = f"tether-{ROOT.name}"
    return " ".join([*(f"{k}={v}" for k, v in settings.items()), f"TETHER_TASK_QUEUE={queue}", "make demo"])


def check_ports(service: Service) -> bool:
    """True: start it. False: a Temporal server this stack did not start is there; use it.
    Exits naming the other checkout when its stack holds one of the ports."""
    for variable, port in service.ports().items():
        owner = port_owner(port)
        if owner is not None and owner.get("checkout") == str(ROOT) and owner.get("service") == service.name:
            print(f"{service.name}: already running (pid {owner.get('pid')})")
            return False
        if owner is not None and owner.get("checkout") != str(ROOT):
            raise SystemExit(
                f"{service.name}: port {port} belongs to the dev stack of {owner['checkout']} "
                f"({owner.get('service')} pid {owner.get('pid')}; Temporal {owner.get('temporal')}, "
                f"task queue '{owner.get('task_queue')}'). Stop it there with `make down`, or run "
                f"a stack of this checkout's own: {own_stack_hint()}"
            )
        if port_open(port):
            if service.name == "dev-server" and owner is None and variable == "TETHER_TEMPORAL_PORT":
                print(f"dev-server: something already listens on {port} (no Tether dev stack claims it); using it")
                return False
            raise SystemExit(
                f"{service.name}: port {port} is already in use by another program; set {variable} "
                f"to a free port, or run a stack of this checkout's own: {own_stack_hint()}"
            )
    return True


def _pid(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _alive(pid) else None


def _own_log_says_ready(service: Service) -> bool:
    return service.marker is None or (
        service.logfile.exists() and service.marker in service.logfile.read_text(errors="replace")
    )


def start(service: Service) -> None:
    if service.name == "codec" and not KEY_FILE:
        return  # payload encryption is off: nothing to decode
    if _pid(service.pidfile) is not None and service.ready():
        print(f"{service.name}: already running")
        return
    if not check_ports(service):
        return
    STATE_DIR.mkdir(exist_ok=True)
    if service.name.endswith("worker"):
        # The dev stack's one key ring (workers never create one): made here once, shared.
        from tether.store.keys import DEFAULT_STATE_KEY, KEY_SETTING, genkey

        genkey(ROOT / os.environ.get(KEY_SETTING, DEFAULT_STATE_KEY), if_missing=True)
    env = {**os.environ, "BILLING_URL": f"http://127.0.0.1:{BILLING_PORT}",
           "TEMPORAL_ADDRESS": f"127.0.0.1:{TEMPORAL_PORT}", "PYTHONUNBUFFERED": "1"}
    if service.name.endswith(("worker", WORKER_NEXT)):
        # The worker runs in the checkout; your tool modules load from where you are too (the
        # folder you ran this from, then your PYTHONPATH), as `python worker.py` there would.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    with open(service.logfile, "w") as log:
        proc = subprocess.Popen(
            service.command(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            start_new_session=True,  # outlive `make`
        )
    service.pidfile.write_text(str(proc.pid))
    deadline = time.monotonic() + service.timeout
    # Ready means this process says so: another program answering on the port is not it.
    while proc.poll() is not None or not (service.ready() and _own_log_says_ready(service)):
        if proc.poll() is not None:
            service.pidfile.unlink(missing_ok=True)
            raise SystemExit(
                f"{service.name} exited with code {proc.returncode}; see {service.logfile}:\n"
                + service.logfile.read_text(errors="replace")[-2000:]
            )
        if time.monotonic() > deadline:
            raise SystemExit(f"{service.name} not ready after {service.timeout:.0f}s; see {service.logfile}")
        time.sleep(0.2)
    _record(service, proc.pid)
    print(f"{service.name}: started (pid {proc.pid}, log {os.path.relpath(service.logfile)})")


WORKER_NEXT = "-next"


def replace_worker(service: Service) -> None:
    """Start a new worker beside the running one, wait until it says it is ready, then stop the
    old one: the stack always has a worker. A new one that fails leaves the old one serving."""
    old = _pid(service.pidfile)
    if old is None:
        start(service)
        return
    name = service.name + WORKER_NEXT
    new = Service(name, service.command, lambda: _worker_ready(name), timeout=service.timeout, default=False)
    try:
        start(new)
    except SystemExit as e:
        new.pidfile.unlink(missing_ok=True)
        _record(new, None)
        raise SystemExit(f"{e}\n{service.name}: the new worker did not start; the old one (pid {old}) still serves, "
                         "unchanged. Fix the cause and restart again.") from None
    stop(service)  # the old one finishes its tasks in flight (SIGTERM)
    pid = _pid(new.pidfile)
    os.replace(new.pidfile, service.pidfile)
    os.replace(new.logfile, service.logfile)
    _record(new, None)
    _record(service, pid)
    print(f"{service.name}: replaced (pid {old} -> {pid}, log {os.path.relpath(service.logfile)})")


def stop(service: Service) -> None:
    pid = _pid(service.pidfile)
    if pid is None:
        service.pidfile.unlink(missing_ok=True)
        _record(service, None)
        return
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while _pid(service.pidfile) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if _pid(service.pidfile) is not None:
        os.killpg(pid, signal.SIGKILL)
    service.pidfile.unlink(missing_ok=True)
    _record(service, None)
    print(f"{service.name}: stopped")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down", "restart"])
    parser.add_argument("services", nargs="*", help=f"any of {', '.join(SERVICES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.services if n not in SERVICES]
    if unknown:
        parser.error(f"unknown service {unknown[0]!r}; choose from {', '.join(SERVICES)}")
    names = args.services or [n for n, s in SERVICES.items() if s.default or args.action == "down"]
    if args.action == "restart":
        names = args.services or ["worker"]
        for name in reversed(names):
            if not name.endswith("worker"):  # a worker is replaced in place, below
                stop(SERVICES[name])
    if args.action in ("up", "restart"):
        if {"worker", "inbox"} & set(names):
            # The example policy's signed tenant and [signers.inbox] list these keys: make them first.
            from tether.client import ensure_keys

            ensure_keys(KEYS_DIR, DEMO_SIGNERS)
        for name in names:
            if args.action == "restart" and name.endswith("worker"):
                replace_worker(SERVICES[name])
            else:
                start(SERVICES[name])
        if "dev-server" in names:
            print(f"Temporal Web UI: http://localhost:{UI_PORT}")
        if "inbox" in names:
            print(f"Approvers' inbox: {INBOX_URL} (dev sign-in)")
    else:
        for name in reversed(names):
            stop(SERVICES[name])
    return 0


if __name__ == "__main__":
    from tether.connection import exit_process

    exit_process(main())  # past the Temporal client's teardown crash (sdk-python #300)
