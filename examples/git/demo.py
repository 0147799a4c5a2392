"""The demo behind `make demo-mcp`: an agent whose tools come from the reference git MCP server.

A scratch repository under .tether/git-demo gets a changed NOTES.md. A read-only run (git_status)
finishes without anyone approving. The commit run (status, add, commit) waits: add and commit
write. bob approves exactly that plan; the run commits once and ends COMPLETED.

Runs against the dev server and the `mcp-worker` that `examples.devstack up` starts, through the
same CLI a user types. `make down` stops them.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from examples import devstack
from examples.demo import reviewed, step, wait_for_end
from worker import exit_process
from workflows.states import RunState

REPO = devstack.STATE_DIR / "git-demo"
HERE = Path(__file__).resolve().parent


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def playbook(name: str) -> str:
    """The example playbook with ``repo_path`` resolved: "." means the server's working
    directory, which tells an approver nothing; the scratch repository's path does (the git
    server accepts it: it is the repository it was started on)."""
    import json

    steps = json.loads((HERE / name).read_text())
    for s in steps:
        if s["args"].get("repo_path") == ".":
            s["args"]["repo_path"] = str(REPO.resolve())
    folder = devstack.STATE_DIR / "git-demo-playbooks"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(steps, indent=1) + "\n")
    return os.path.relpath(folder / name)


def scratch_repository() -> None:
    """The repository the git server works on (its `cwd` in mcp.toml), with one new change."""
    if not (REPO / ".git").exists():
        REPO.mkdir(parents=True, exist_ok=True)
        git("init", "-q", "-b", "main")
        git("config", "user.email", "demo@tether.example")
        git("config", "user.name", "Tether demo")
        (REPO / "README").write_text("Scratch repository of `make demo-mcp`.\n")
        git("add", "README")
        git("commit", "-q", "-m", "Start the scratch repository")
    with open(REPO / "NOTES.md", "a") as notes:
        notes.write(f"- {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC: governed commit\n")


def commits() -> int:
    return int(git("rev-list", "--count", "HEAD").strip())


def main() -> int:
    started = time.monotonic()
    scratch_repository()
    # The worker lists the git server's tools at start, so the repository must exist first.
    devstack.main(["up", "dev-server", "mcp-worker"])
    os.environ["TETHER_TASK_QUEUE"] = devstack.MCP_TASK_QUEUE  # the CLI starts runs there
    ready = time.monotonic()
    before = commits()
    print(f"\n== scratch repository {REPO.relative_to(devstack.ROOT)}: {before} commit(s), NOTES.md changed")

    status_id = f"git-status-{uuid.uuid4().hex[:6]}"
    print("\n== alice asks for the repository's status: git_status is read-only, no approval needed")
    step("start", ["start", "--goal", "What is the state of the repository?", "--playbook",
                   playbook("status.playbook.json"), "--requested-by", "alice", "--id", status_id, "--wait"])
    snap = wait_for_end(status_id)
    if snap.state != RunState.COMPLETED or snap.approved_by:
        raise SystemExit(f"the read-only run ended {snap.state.value} (approved by {snap.approved_by})")

    run_id = f"git-commit-{uuid.uuid4().hex[:6]}"
    print("\n== alice asks the agent to commit the notes: add and commit write, so the plan waits")
    step("start", ["start", "--goal", "Commit today's notes", "--playbook", playbook("commit.playbook.json"),
                   "--requested-by", "alice", "--id", run_id, "--wait"])
    step("status", ["status", run_id])
    if commits() != before:
        raise SystemExit("a commit happened before the approval")
    print("\n== bob reviews the plan and approves exactly this plan hash")
    step("approve", ["approve", run_id, "--by", "bob", *reviewed(run_id), "--comment", "notes look fine"])
    snap = wait_for_end(run_id)
    print(f"\n== the run ended in {snap.state.value}")
    step("timeline", ["timeline", run_id])
    after = commits()
    print(f"\n== the repository has {after - before} new commit(s):\n{git('log', '-1', '--stat', '--format=%h %s')}")
    print(f"stack ready in {ready - started:.1f}s; both runs in {time.monotonic() - ready:.1f}s\n"
          f"This run: http://localhost:{devstack.UI_PORT}/namespaces/default/workflows/{run_id}\n"
          "The server and the MCP worker keep running; `make down` stops them.")
    return 0 if snap.state == RunState.COMPLETED and after == before + 1 else 1


if __name__ == "__main__":
    exit_process(main())
