"""One dev stack per checkout: two checkouts on one machine (copies of this one, each running
`python -m examples.devstack` from its own folder) do not tangle. The billing service stands in
for every service: the port claims and the readiness rule are the same for all."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout(path: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", ".tether")
    for folder in ("examples", "activities", "workflows"):
        shutil.copytree(ROOT / folder, path / folder, ignore=ignore)
    for module in ("client.py", "worker.py", "starter.py"):
        shutil.copyfile(ROOT / module, path / module)
    return path


def devstack(where: Path, claims: Path, *args: str, port: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "TEMPORAL_"))}
    env.update(TETHER_STACKS_DIR=str(claims), PYTHONDONTWRITEBYTECODE="1")
    if port is not None:
        env["TETHER_BILLING_PORT"] = str(port)
    return subprocess.run([sys.executable, "-m", "examples.devstack", *args], cwd=where, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_second_checkout_is_refused_naming_the_first_or_runs_on_its_own_ports(tmp_path: Path) -> None:
    first, second = checkout(tmp_path / "first"), checkout(tmp_path / "second")
    claims = tmp_path / "claims"
    port = free_port()
    up = devstack(first, claims, "up", "billing", port=port)
    try:
        assert up.returncode == 0 and "billing: started" in up.stdout, up
        record = json.loads((first / ".tether/stack.json").read_text())
        assert record["checkout"] == str(first) and record["billing_port"] == port and record["task_queue"] == "tether"

        # The second checkout, same port: refused, naming the first and how to run its own.
        clash = devstack(second, claims, "up", "billing", port=port)
        assert clash.returncode != 0 and "started" not in clash.stdout, clash
        assert f"port {port} belongs to the dev stack of {first}" in clash.stderr
        assert "task queue 'tether'" in clash.stderr and "TETHER_BILLING_PORT=" in clash.stderr
        assert "TETHER_TASK_QUEUE=tether-second make demo" in clash.stderr

        # With claims it cannot see (another folder) the second cannot know whose the port is;
        # its billing service could not bind while the first one's answers the health check:
        # it never says started.
        blind = devstack(second, tmp_path / "other-claims", "up", "billing", port=port)
        assert blind.returncode != 0 and "started" not in blind.stdout, blind
        assert f"port {port} is already in use" in blind.stderr

        # On a port of its own it runs, beside the first.
        own = free_port()
        up = devstack(second, claims, "up", "billing", port=own)
        assert up.returncode == 0 and "billing: started" in up.stdout, up
        assert json.loads((second / ".tether/stack.json").read_text())["billing_port"] == own
    finally:
        for where in (first, second):
            assert devstack(where, claims, "down", "billing").returncode == 0
    # Down released the claims.
    assert list(claims.glob("port-*.json")) == []
