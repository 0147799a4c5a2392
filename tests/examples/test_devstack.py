"""One dev stack per checkout: two checkouts on one machine (copies of this one, each running
`python -m examples.devstack` from its own folder) do not tangle. The billing service stands in
for every service: the port claims and the readiness rule are the same for all."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from tests.helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def checkout(path: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", ".tether")
    for folder in ("examples", "activities", "workflows", "tether"):
        shutil.copytree(ROOT / folder, path / folder, ignore=ignore)
    for module in ("worker.py", "starter.py"):
        shutil.copyfile(ROOT / module, path / module)
    return path


def devstack(where: Path, claims: Path, *args: str, port: int | None = None, **settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "TEMPORAL_"))}
    env.update(TETHER_STACKS_DIR=str(claims), PYTHONDONTWRITEBYTECODE="1", **settings)
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


def cli(where: Path, *args: str, **settings: str) -> subprocess.CompletedProcess:
    """The checkout's `tether` (python -m starter from its folder), with none of the caller's
    Temporal or Tether settings unless given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "TEMPORAL_"))}
    env.update(PYTHONDONTWRITEBYTECODE="1", **settings)
    return subprocess.run([sys.executable, "-m", "starter", *args], cwd=where, env=env,
                          capture_output=True, text=True, timeout=120)


async def test_the_cli_follows_its_checkouts_stack_and_a_typod_tenant_gets_did_you_mean(
    dev_env, tmp_path: Path
) -> None:
    """A second checkout whose stack runs on ports of its own: its plain `tether` talks to that
    stack (server, task queue, the worker's policy), not to whatever answers on the default port."""
    import asyncio
    import uuid

    from temporalio.client import WorkflowExecutionStatus

    second = checkout(tmp_path / "second")
    claims = tmp_path / "claims"
    server_port = dev_env.client.service_client.config.target_host.rsplit(":", 1)[1]
    queue = f"tether-second-{uuid.uuid4().hex[:6]}"
    # The second checkout's stack: its Temporal port is the test's server, its own task queue.
    up = devstack(second, claims, "up", "billing", port=free_port(), TETHER_TEMPORAL_PORT=server_port,
                  TETHER_TASK_QUEUE=queue)
    try:
        assert up.returncode == 0 and "billing: started" in up.stdout, up
        record = json.loads((second / ".tether/stack.json").read_text())
        assert record["temporal"] == f"127.0.0.1:{server_port}" and record["task_queue"] == queue
        assert record["policy"] == str(second / "examples/billing/policy.toml")

        # A typo'd tenant: refused before anything starts, with the policy's nearest name.
        playbook = str(ROOT / "examples/billing/refund.playbook.json")
        typo = cli(second, "start", "--goal", "Refund A-1001", "--requested-by", "alice", "--tenant", "defualt",
                   "--playbook", playbook)
        assert typo.returncode == 2 and typo.stdout == "", typo
        assert "tenant 'defualt' is not in the policy file" in typo.stderr and "did you mean 'default'?" in typo.stderr
        far = cli(second, "start", "--goal", "Refund A-1001", "--requested-by", "alice", "--tenant", "zzz",
                  "--playbook", playbook)
        assert far.returncode == 2 and "its tenants: acme, default, signed" in far.stderr, far

        # No TEMPORAL_ADDRESS: a plain start goes to the stack's server, on the stack's queue.
        run_id = f"second-{uuid.uuid4().hex[:8]}"
        started = cli(second, "start", "--goal", "Refund A-1001", "--requested-by", "alice", "--playbook", playbook,
                      "--id", run_id)
        assert started.returncode == 0 and f"started {run_id}" in started.stdout, started
        assert f"no worker polls task queue '{queue}'" in started.stderr, started.stderr
        handle = dev_env.client.get_workflow_handle(run_id)
        try:
            assert (await handle.describe()).task_queue == queue
            # And `tether list` there lists it (visibility catches up: wait for it, not a time).
            for _ in range(600):
                listed = await asyncio.to_thread(cli, second, "list", "--limit", "200")
                assert listed.returncode == 0, listed
                if run_id in listed.stdout:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(listed.stdout)
        finally:
            await handle.terminate("test over")
        assert (await handle.describe()).status == WorkflowExecutionStatus.TERMINATED

        # An explicit setting wins over the checkout's stack.
        elsewhere = cli(second, "list", TEMPORAL_ADDRESS="127.0.0.1:1")
        assert elsewhere.returncode == 2 and "cannot reach Temporal at 127.0.0.1:1" in elsewhere.stderr, elsewhere
    finally:
        assert devstack(second, claims, "down", "billing").returncode == 0


def one_line(text: str) -> str:
    return " ".join(text.split())


def _serving_pid(where: Path) -> int:
    return int((where / ".tether/worker.pid").read_text())


def _alive(pid: int) -> bool:
    from examples.devstack import _alive as running  # a zombie (exited, not reaped yet) is not

    return running(pid)


async def test_a_worker_restart_never_leaves_the_stack_without_a_worker_and_loads_your_tools(dev_env, tmp_path: Path) -> None:
    """Issue 58: `restart worker` stopped the old worker before the new one failed (a bad tool
    module): no worker. Now the new one starts beside the old, and the old stops only once the
    new one is ready; tool modules load from the caller's folder and PYTHONPATH."""
    from tether.pollers import live_pollers

    where = checkout(tmp_path / "checkout")
    claims = tmp_path / "claims"
    port = dev_env.client.service_client.config.target_host.rsplit(":", 1)[1]
    queue = f"restart-{os.urandom(4).hex()}"
    settings = {"TETHER_TEMPORAL_PORT": port, "TETHER_TASK_QUEUE": queue}
    up = devstack(where, claims, "up", "worker", **settings)
    try:
        assert up.returncode == 0 and "worker: started" in up.stdout, up
        old = _serving_pid(where)

        # A new worker that cannot start (a tool module that is not there): the old one serves on.
        failed = devstack(where, claims, "restart", "worker", TETHER_TOOLS="no_such_tools", **settings)
        assert failed.returncode != 0, failed
        assert "no_such_tools" in failed.stderr and f"the old one (pid {old}) still serves" in failed.stderr, failed.stderr
        assert _serving_pid(where) == old and _alive(old)
        assert not (where / ".tether/worker-next.pid").exists()
        assert len(await live_pollers(dev_env.client, queue) or []) == 1

        # Your own tools, in a folder of your own outside the checkout, run from there (the
        # folder is on the path) and from anywhere with PYTHONPATH: the new worker serves them.
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "my_tools.py").write_text(
            "from pydantic import BaseModel\nfrom tether import ToolContext, ToolEffect, tool\n\n\n"
            "class Hello(BaseModel):\n    name: str\n\n\n"
            "@tool(effect=ToolEffect.READ_ONLY)\ndef say_hello(args: Hello, ctx: ToolContext) -> dict:\n"
            "    \"\"\"Greets.\"\"\"\n    return {\"hello\": args.name}\n")
        swapped = devstack(where, claims, "restart", "worker", TETHER_TOOLS="examples.billing.tools,my_tools", PYTHONPATH=str(mine), **settings)
        assert swapped.returncode == 0 and f"worker: replaced (pid {old} -> " in swapped.stdout, swapped
        new = _serving_pid(where)
        assert new != old and _alive(new) and not _alive(old)
        assert "say_hello" in (where / ".tether/worker.log").read_text()

        # With no worker, the hint names the command that starts this stack's worker with its
        # tools, not the demo's.
        assert devstack(where, claims, "down", "worker", **settings).returncode == 0
        started = cli(where, "start", "--goal", "hello", "--requested-by", "alice", "--playbook",
                      str(ROOT / "examples/billing/refund.playbook.json"), TETHER_TASK_QUEUE=queue)
        assert started.returncode == 0, started
        hint = one_line(started.stderr)
        assert f"no worker polls task queue '{queue}'" in hint and "examples.devstack up worker" in hint, hint
        assert f"TETHER_TOOLS=examples.billing.tools,my_tools" in hint and f"PYTHONPATH={mine}" in hint, hint
        await dev_env.client.get_workflow_handle(started.stdout.split()[1]).terminate("test over")
    finally:
        assert devstack(where, claims, "down", "worker", **settings).returncode == 0


MY_TOOLS = (
    "from pydantic import BaseModel\nfrom tether import ToolContext, ToolEffect, tool\n\n\n"
    "class Hello(BaseModel):\n    name: str\n\n\n"
    "@tool(effect=ToolEffect.READ_ONLY)\ndef say_hello(args: Hello, ctx: ToolContext) -> dict:\n"
    "    \"\"\"Greets.\"\"\"\n    return {\"hello\": args.name}\n"
)


async def test_make_demo_on_a_stack_whose_worker_serves_other_tools_says_so_and_how_to_go_back(dev_env, tmp_path: Path) -> None:
    """Issue 58: after `restart worker` with your own tools, `make demo` reused that worker and
    failed with "unknown tool 'get_order'" and no hint. Now it says which tools the worker lacks,
    what it was started with, and the command that brings the demo's worker back (followed here
    as printed); nothing is started."""
    from tether.pollers import served_tools

    where = checkout(tmp_path / "checkout")
    claims = tmp_path / "claims"
    port = dev_env.client.service_client.config.target_host.rsplit(":", 1)[1]
    queue = f"demo-{os.urandom(4).hex()}"
    settings = {"TETHER_TEMPORAL_PORT": port, "TETHER_TASK_QUEUE": queue}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my_tools.py").write_text(MY_TOOLS)
    (mine / "policy.toml").write_text(
        '[tenants.default]\ntools = ["say_hello"]\nfour_eyes = true\n'
        '[tenants.default.approvers]\nbob = { roles = ["approver"] }\n'
    )
    up = devstack(where, claims, "up", "worker", TETHER_TOOLS="my_tools", PYTHONPATH=str(mine),
                  TETHER_POLICY=str(mine / "policy.toml"), **settings)
    try:
        assert up.returncode == 0 and "worker: started" in up.stdout, up
        while await served_tools(dev_env.client, queue) != frozenset({"say_hello"}):
            await asyncio.sleep(0.2)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "TEMPORAL_"))}
        env.update(PYTHONDONTWRITEBYTECODE="1", TETHER_STACKS_DIR=str(claims), **settings)
        demo = subprocess.run([sys.executable, "-m", "examples.demo"], cwd=where, env=env, capture_output=True,
                              text=True, timeout=120)
        assert demo.returncode == 2, demo
        said = demo.stderr
        assert "serves other tools (say_hello)" in said and "lacks get_order, issue_refund, post_ledger_entry, send_email" in said, said
        assert "It was started with:" in said and "TETHER_TOOLS=my_tools" in said and f"PYTHONPATH={mine}" in said, said
        assert "To go back to yours afterwards: " in said, said
        assert "unknown tool" not in said + demo.stdout and "$ " not in demo.stdout, demo  # nothing was started
        lines = said.splitlines()
        back = lines[lines.index("To go back to the demo's worker (its tools and policy):") + 1].strip()
        assert back.startswith("env -u TETHER_TOOLS") and back.endswith("-m examples.devstack restart worker"), back
        # Followed as printed, from a shell that still has your settings exported.
        followed = subprocess.run(back, shell=True, cwd=where, capture_output=True, text=True, timeout=120,
                                  env={**env, "TETHER_TOOLS": "my_tools", "PYTHONPATH": str(mine),
                                       "TETHER_POLICY": str(mine / "policy.toml")})
        assert followed.returncode == 0 and "worker: replaced" in followed.stdout, followed
        while not {"get_order", "issue_refund", "post_ledger_entry", "send_email"} <= (await served_tools(dev_env.client, queue) or set()):
            await asyncio.sleep(0.2)
    finally:
        assert devstack(where, claims, "down", "worker", **settings).returncode == 0
