"""The local stack behind `make demo`, `make dev-server` and `make down`.

    python -m examples.devstack up [dev-server] [billing] [worker] [inbox] [mcp-worker]
    python -m examples.devstack down

``mcp-worker`` (only when named; `make demo-mcp`) is a worker whose tools come from MCP servers:
``--mcp-config`` from TETHER_MCP_CONFIG (default: examples/git/mcp.toml), on its own task queue
(TETHER_MCP_TASK_QUEUE, default ``tether-mcp``), so it never takes the billing worker's runs.

Each service runs in the background in its own session (it outlives `make`), with its pid and
log under `.tether/`. `up` is idempotent: a service that is already answering is left alone.
The dev server keeps its state in `.tether/temporal.db`, so runs survive a restart.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from client import ensure_keys

from workflows.agent_run import SEARCH_ATTRIBUTES

ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = ROOT / ".tether"
KEYS_DIR = STATE_DIR / "keys"  # the demo's signing keys (examples/billing/policy.toml, tenant "signed")
DEMO_SIGNERS = ("alice", "bob", "inbox")  # inbox: the approver inbox's own key (signers.inbox)
BIN = Path(sys.executable).parent
TEMPORAL_PORT = int(os.environ.get("TETHER_TEMPORAL_PORT", "7233"))
UI_PORT = int(os.environ.get("TETHER_UI_PORT", "8233"))
BILLING_PORT = int(os.environ.get("TETHER_BILLING_PORT", "8765"))
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


def dev_server_command(
    port: int = TEMPORAL_PORT, ui_port: int = UI_PORT, db: Path | None = None
) -> list[str]:
    """The dev server with our search attributes registered (unregistered ones leave runs stuck)."""
    cmd = [
        str(BIN / "temporal"), "server", "start-dev",
        "--ip", "127.0.0.1", "--port", str(port), "--ui-port", str(ui_port),
        "--db-filename", str(db or STATE_DIR / "temporal.db"),
        "--log-level", "warn", "--ui-disable-news-fetch",
    ]
    for key in SEARCH_ATTRIBUTES:
        cmd += ["--search-attribute", f"{key.name}=Keyword"]
    if os.environ.get("TETHER_ENCRYPTION_KEY_FILE"):
        # Payloads are encrypted: the UI asks the codec server (`python -m activities.codec`,
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

    @property
    def pidfile(self) -> Path:
        return STATE_DIR / f"{self.name}.pid"

    @property
    def logfile(self) -> Path:
        return STATE_DIR / f"{self.name}.log"


def _worker_ready(name: str = "worker") -> bool:
    log = STATE_DIR / f"{name}.log"
    pid = _pid(STATE_DIR / f"{name}.pid")
    return pid is not None and log.exists() and "worker ready" in log.read_text(errors="replace")


MCP_TASK_QUEUE = os.environ.get("TETHER_MCP_TASK_QUEUE", "tether-mcp")


CODEC_PORT = int(os.environ.get("TETHER_CODEC_PORT", "8081"))
KEY_FILE = os.environ.get("TETHER_ENCRYPTION_KEY_FILE")

SERVICES = {
    "dev-server": Service("dev-server", dev_server_command, lambda: port_open(TEMPORAL_PORT)),
    "billing": Service(
        "billing",
        lambda: [sys.executable, "-m", "examples.billing.service", "--port", str(BILLING_PORT),
                 "--db", str(STATE_DIR / "billing.db")],
        lambda: http_ok(f"http://127.0.0.1:{BILLING_PORT}/health"),
    ),
    # The demo's worker applies the example policy (alice requests, bob approves) unless
    # TETHER_POLICY names another file.
    # Only with payload encryption on: lets the Web UI decode payloads for the person looking.
    "codec": Service(
        "codec",
        lambda: [sys.executable, "-m", "activities.codec", "--port", str(CODEC_PORT),
                 "--key-file", str(KEY_FILE),
                 "--origin", f"http://localhost:{UI_PORT}", "--origin", f"http://127.0.0.1:{UI_PORT}"],
        lambda: port_open(CODEC_PORT),
    ),
    "worker": Service(
        "worker",
        lambda: [sys.executable, str(ROOT / "worker.py"), "--policy",
                 os.environ.get("TETHER_POLICY") or str(ROOT / "examples/billing/policy.toml")],
        _worker_ready,
    ),
    # The approvers' web inbox, with the dev sign-in (loopback only) and the demo's inbox key,
    # which the example policy trusts as [signers.inbox].
    "inbox": Service(
        "inbox",
        lambda: [str(BIN / "tether"), "inbox", "--port", str(INBOX_PORT), "--dev-login",
                 "--policy", os.environ.get("TETHER_POLICY") or str(ROOT / "examples/billing/policy.toml"),
                 "--key", str(KEYS_DIR / "inbox.pem"), "--web-ui", f"http://localhost:{UI_PORT}"],
        lambda: http_ok(f"http://127.0.0.1:{INBOX_PORT}/healthz"),
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


def _pid(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None


def start(service: Service) -> None:
    if service.name == "codec" and not KEY_FILE:
        return  # payload encryption is off: nothing to decode
    if _pid(service.pidfile) is not None and service.ready():
        print(f"{service.name}: already running")
        return
    if service.name == "dev-server" and port_open(TEMPORAL_PORT):
        print(f"dev-server: something already listens on {TEMPORAL_PORT}; using it")
        return
    STATE_DIR.mkdir(exist_ok=True)
    env = {**os.environ, "BILLING_URL": f"http://127.0.0.1:{BILLING_PORT}",
           "TEMPORAL_ADDRESS": f"127.0.0.1:{TEMPORAL_PORT}", "PYTHONUNBUFFERED": "1"}
    with open(service.logfile, "w") as log:
        proc = subprocess.Popen(
            service.command(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            start_new_session=True,  # outlive `make`
        )
    service.pidfile.write_text(str(proc.pid))
    deadline = time.monotonic() + service.timeout
    while not service.ready():
        if proc.poll() is not None:
            raise SystemExit(
                f"{service.name} exited with code {proc.returncode}; see {service.logfile}:\n"
                + service.logfile.read_text(errors="replace")[-2000:]
            )
        if time.monotonic() > deadline:
            raise SystemExit(f"{service.name} not ready after {service.timeout:.0f}s; see {service.logfile}")
        time.sleep(0.2)
    print(f"{service.name}: started (pid {proc.pid}, log {service.logfile.relative_to(ROOT)})")


def stop(service: Service) -> None:
    pid = _pid(service.pidfile)
    if pid is None:
        service.pidfile.unlink(missing_ok=True)
        return
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while _pid(service.pidfile) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if _pid(service.pidfile) is not None:
        os.killpg(pid, signal.SIGKILL)
    service.pidfile.unlink(missing_ok=True)
    print(f"{service.name}: stopped")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("services", nargs="*", help=f"any of {', '.join(SERVICES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.services if n not in SERVICES]
    if unknown:
        parser.error(f"unknown service {unknown[0]!r}; choose from {', '.join(SERVICES)}")
    names = args.services or [n for n, s in SERVICES.items() if s.default or args.action == "down"]
    if args.action == "up":
        # The example policy's signed tenant lists these people's keys: make them first.
        ensure_keys(KEYS_DIR, DEMO_SIGNERS)
        for name in names:
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
    sys.exit(main())
