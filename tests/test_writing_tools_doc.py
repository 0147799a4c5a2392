"""docs/writing-tools.md, run as written: on a fresh copy of the repository (its tracked files,
no `.tether/`), with the demo stack `make demo` starts (Temporal dev server, billing service,
worker, inbox: real processes, on ports of the test's own), the page's files are saved and its
commands run in order, in one shell. The new tool module goes from nothing to an approved,
completed run whose credit the billing service holds once."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from workflows.states import TERMINAL

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs/writing-tools.md"
BLOCK = re.compile(r"(?:<!-- file: (?P<file>[^ ]+) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)```", re.S)


def page_parts() -> list[tuple[str, str, str | None]]:
    """(language, body, file name or None) for every fenced block of the page, in order."""
    return [(m["lang"], m["body"], m["file"]) for m in BLOCK.finditer(PAGE.read_text())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fresh_copy(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """The repository's files as a clone has them, sharing this checkout's virtualenv (which
    `make install` made), and the environment of a stack of its own. The stack is stopped after
    the test, whatever happened."""
    copy = tmp_path / "tether"
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
    env.update(TETHER_STACKS_DIR=str(tmp_path / "stacks"), TETHER_TASK_QUEUE="tether-doc",
               TEMPORAL_ADDRESS=f"127.0.0.1:{ports['TETHER_TEMPORAL_PORT']}", NO_PROXY="127.0.0.1,localhost")
    try:
        yield copy, env
    finally:
        subprocess.run([sys.executable, "-m", "examples.devstack", "down"], cwd=copy, env=env,
                       capture_output=True, timeout=120)


def shell(script: str, cwd: Path, env: dict[str, str], answers: str = "") -> subprocess.CompletedProcess[str]:
    """``script`` in one bash, stopping at the first failing command; its stdin a terminal with
    ``answers`` typed ahead (`tether approve` asks there, as it does a person)."""
    leader, follower = pty.openpty()
    try:
        os.write(leader, answers.encode())
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, stdin=follower,
                              capture_output=True, text=True, timeout=300)
    finally:
        os.close(follower)
        os.close(leader)


def test_the_pages_commands_take_a_new_tool_module_to_an_approved_run(fresh_copy: tuple[Path, dict[str, str]]) -> None:
    copy, env = fresh_copy
    parts = page_parts()
    files = [(name, body) for _, body, name in parts if name]
    commands = [body for lang, body, _ in parts if lang == "bash"]
    assert [name for name, _ in files] == ["goodwill.py", "goodwill_policy.toml", "goodwill.playbook.json"]
    assert len(commands) == 5, "the page's command blocks changed: check what this test runs"
    *to_the_run, back = commands

    began = time.monotonic()
    up = subprocess.run([sys.executable, "-m", "examples.devstack", "up"], cwd=copy, env=env,
                        capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    stack_ready = time.monotonic()
    for name, body in files:
        (copy / name).write_text(body)
    done = shell("\n".join(to_the_run), copy, env, answers="y\n")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # 3: the tools, as the worker will serve them.
    assert re.search(r"goodwill_credit\s+python\s+idempotent\s+yes\s+take_back_credit", out), out
    # 4: the worker serves them under the page's policy.
    assert "worker: started" in out and "inbox: started" in out
    worker_log = (copy / ".tether/worker.log").read_text()
    assert "with tools: goodwill_credit, order_balance, take_back_credit;" in worker_log
    assert "goodwill_policy.toml" in worker_log
    # 5: it waited for an approval, showing the write's summary and the amount as money.
    run_id = re.search(r"started (goodwill-\d+)", out)[1]
    assert "AWAITING_APPROVAL" in out and "amount_cents: 5.00 EUR (500)" in out and "take_back_credit" in out, out
    # 6: bob's approval was asked for, sent and recorded.
    assert "Approve exactly this plan" in out and re.search(r"\bAPPROVED\b", out), out
    # The run completes; the credit is written once, with the run's idempotency key.
    status = wait_for_end(copy, env, run_id)
    assert status["state"] == "COMPLETED", status
    finished = time.monotonic()
    billing = f"http://127.0.0.1:{env['TETHER_BILLING_PORT']}"
    refunds = [r for r in get(f"{billing}/refunds")["refunds"] if r["reason"] == "goodwill: arrived a week late"]
    assert [(r["order_id"], r["amount_cents"]) for r in refunds] == [("A-1002", 500)]
    assert run_id in refunds[0]["idempotency_key"]
    # 7: back to the demo's worker.
    back_out = shell(back, copy, env)
    assert back_out.returncode == 0, back_out.stdout + back_out.stderr
    assert "with tools: get_order, issue_refund" in (copy / ".tether/worker.log").read_text()
    print(f"\nwriting-tools.md: stack up {stack_ready - began:.1f} s; the page's commands to a completed run "
          f"{finished - stack_ready:.1f} s")


def get(url: str) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=30) as response:
        return json.loads(response.read())


def wait_for_end(copy: Path, env: dict[str, str], run_id: str) -> dict:
    """`tether status --json` until the run has ended (each call is a real CLI process)."""
    while True:
        result = subprocess.run([str(copy / ".venv/bin/tether"), "status", run_id, "--json"], cwd=copy, env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode in (0, 1), result.stderr
        status = json.loads(result.stdout)
        if status["state"] in {state.value for state in TERMINAL}:
            return status
        time.sleep(0.2)
