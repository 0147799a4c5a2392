"""The docs' commands, run as written: on a fresh copy of the repository (its tracked files, no
`.tether/`), with the demo stack `make demo` starts (Temporal dev server, billing service,
worker, inbox: real processes, on ports of the test's own).

- docs/writing-tools.md: its files are saved in a folder of one's own (``~/goodwill``, in a
  fresh home, outside the checkout) and every command block runs, in order, in one shell: a new
  tool module goes from nothing to an approved, completed run whose credit the billing service
  holds once.
- docs/model-planner.md: the blocks marked ``<!-- tested -->`` (the planners of your own,
  loaded by the stack's worker from TETHER_PLANNERS) run and complete."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from workflows.states import TERMINAL
from tests.helpers.doc_files import page_parts
from tests.helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
class Stack:
    def __init__(self, copy: Path, env: dict[str, str], seconds_to_start: float) -> None:
        self.copy, self.env, self.seconds_to_start = copy, env, seconds_to_start

    def shell(self, script: str, answers: str = "", **env: str) -> subprocess.CompletedProcess[str]:
        """``script`` in one bash, stopping at the first failing command; its stdin a terminal
        with ``answers`` typed ahead (`tether approve` asks there, as it does a person)."""
        leader, follower = pty.openpty()
        try:
            os.write(leader, answers.encode())
            return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=self.copy, env={**self.env, **env},
                                  stdin=follower, capture_output=True, text=True, timeout=300)
        finally:
            os.close(follower)
            os.close(leader)

    def worker_log(self) -> str:
        return (self.copy / ".tether/worker.log").read_text()

    def wait_for_end(self, run_id: str) -> dict:
        """`tether status --json` until the run has ended (each call is a real CLI process)."""
        while True:
            result = subprocess.run([str(self.copy / ".venv/bin/tether"), "status", run_id, "--json"], cwd=self.copy,
                                    env=self.env, capture_output=True, text=True, timeout=120)
            assert result.returncode in (0, 1), result.stderr
            status = json.loads(result.stdout)
            if status["state"] in {state.value for state in TERMINAL}:
                return status
            time.sleep(0.2)

    def get(self, path: str) -> dict:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.env['TETHER_BILLING_PORT']}{path}", timeout=30) as response:
            return json.loads(response.read())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The repository's files as a clone has them, sharing this checkout's virtualenv (which
    `make install` made), and the demo stack on ports of its own, stopped after the module
    whatever happened."""
    base = tmp_path_factory.mktemp("docs")
    copy = base / "tether"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    (copy / ".venv").symlink_to(ROOT / ".venv")
    ports = {name: free_port() for name in ("TETHER_TEMPORAL_PORT", "TETHER_UI_PORT", "TETHER_BILLING_PORT",
                                            "TETHER_CODEC_PORT", "TETHER_INBOX_PORT")}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "TEMPORAL_", "OPENAI_"))}
    env.update({k: str(v) for k, v in ports.items()})
    env.update(TETHER_STACKS_DIR=str(base / "stacks"), TETHER_TASK_QUEUE="tether-doc",
               TEMPORAL_ADDRESS=f"127.0.0.1:{ports['TETHER_TEMPORAL_PORT']}", NO_PROXY="127.0.0.1,localhost")
    began = time.monotonic()
    try:
        up = subprocess.run([sys.executable, "-m", "examples.devstack", "up"], cwd=copy, env=env,
                            capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        yield Stack(copy, env, time.monotonic() - began)
    finally:
        subprocess.run([sys.executable, "-m", "examples.devstack", "down"], cwd=copy, env=env,
                       capture_output=True, timeout=120)


def test_writing_tools_takes_a_new_tool_module_to_an_approved_run(stack: Stack, tmp_path: Path) -> None:
    parts = page_parts("docs/writing-tools.md")
    files = [(m["file"], m["body"]) for m in parts if m["file"]]
    commands = [m["body"] for m in parts if m["lang"] == "bash"]
    assert [name for name, _ in files] == ["goodwill.py", "goodwill_policy.toml", "goodwill.playbook.json"]
    assert len(commands) == 6, "the page's command blocks changed: check what this test runs"
    *to_the_run, back = commands
    setup = to_the_run[0]
    assert "mkdir -p ~/goodwill && cd ~/goodwill" in setup

    began = time.monotonic()
    home = tmp_path / "home"  # the person's home: their folder goes there, outside the checkout
    (home / "goodwill").mkdir(parents=True)
    for name, body in files:
        (home / "goodwill" / name).write_text(body)
    done = stack.shell("\n".join(to_the_run), answers="y\n", HOME=str(home))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # 3: the tools, as the worker will serve them.
    assert re.search(r"goodwill_credit\s+python\s+idempotent\s+yes\s+take_back_credit", out), out
    # 4: the worker serves them under the page's policy.
    # (the demo's worker replaced by the new one once it was ready: never no worker)
    assert "worker: replaced (pid " in out and "inbox: started" in out
    assert "with tools: goodwill_credit, order_balance, take_back_credit;" in stack.worker_log()
    assert f"{home}/goodwill/goodwill_policy.toml" in stack.worker_log()
    assert not (stack.copy / "goodwill.py").exists()  # nothing of the user's went into the checkout
    # 5: it waited for an approval, showing the write's arguments, the amount as money.
    run_id = re.search(r"started (goodwill-\d+)", out)[1]
    assert "AWAITING_APPROVAL" in out and "amount_cents: 5.00 EUR (500)" in out and "take_back_credit" in out, out
    # 6: bob's approval was asked for, sent and recorded.
    assert "Approve exactly this plan" in out and re.search(r"\bAPPROVED\b", out), out
    # The run completes; the credit is written once, with the run's idempotency key.
    status = stack.wait_for_end(run_id)
    assert status["state"] == "COMPLETED", status
    finished = time.monotonic()
    refunds = [r for r in stack.get("/refunds")["refunds"] if r["reason"] == "goodwill: arrived a week late"]
    assert [(r["order_id"], r["amount_cents"]) for r in refunds] == [("A-1002", 500)]
    assert run_id in refunds[0]["idempotency_key"]
    # 7: back to the demo's worker.
    back_out = stack.shell(f"{setup}\n{back}", HOME=str(home))  # the same shell: $TETHER set
    assert back_out.returncode == 0, back_out.stdout + back_out.stderr
    assert "with tools: get_order, issue_refund" in stack.worker_log()
    print(f"\nwriting-tools.md: stack up {stack.seconds_to_start:.1f} s; the page's commands to a completed run "
          f"{finished - began:.1f} s")


def test_the_planners_of_your_own_run_on_the_demo_stack_as_documented(stack: Stack) -> None:
    blocks = [m["body"] for m in page_parts("docs/model-planner.md") if m["tested"]]
    assert len(blocks) == 2, "the page's tested blocks changed: check what this test expects"
    desk = stack.shell(blocks[0])
    out = desk.stdout + desk.stderr
    assert desk.returncode == 0, out
    assert "planners: desk, model, playbook" in stack.worker_log()
    assert "COMPLETED" in out and "A-1001: 49.99 EUR; A-1003: 8.99 EUR" in out, out
    agent = stack.shell(blocks[1])
    out = agent.stdout + agent.stderr
    assert agent.returncode == 0, out
    assert "planners: model, playbook, refunds" in stack.worker_log()
    assert "COMPLETED" in out and re.search(r"Refunded 8\.99 on order A-1003 \(refund R-\d+\)\.", out), out
    assert [r["amount_cents"] for r in stack.get("/refunds")["refunds"] if r["order_id"] == "A-1003"] == [899]
