"""MCP servers' tools as governed tools, against real servers run as stdio subprocesses: the
reference servers ``mcp-server-git`` and ``mcp-server-time`` from PyPI (nobody here wrote them),
over a temporary git repository, and our own fault server (tests/helpers/mcp_fault_server.py) for the
failures. Real Temporal (time-skipping test server; the dev server for the worker kill), real
worker processes for the kill, the real ``openai`` client against examples/fake_openai.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tether.tools.mcp import describe_tools, format_tools
from tether.tools.mcp_catalog import McpServers, mcp_tools
from tether.tools.mcp_config import parse_config
from tether.tools.sdk import ToolRegistry
from tests.chaos.harness import Proc, free_port
from tether.client import run_outcome
from tests.helpers.paths import ROOT
from tests.helpers.queries import observations, snapshot
from tests.helpers.runs import approval_for, make_request, running_worker, start_run, unique
from tests.helpers.waiting import wait_for_state
from examples.fake_openai import call, text, tool_calls
from tests.helpers.fake_model import fake_model
from workflows.contract import ToolEffect
from workflows.run_state import RunOutcome
from workflows.states import RunState, is_legal_path

S, E = RunState, ToolEffect
FAULT_SERVER = ROOT / "tests/helpers/mcp_fault_server.py"

# What mcp-server-git publishes (listed from the real server, not from its source): seven tools
# read only; git_add and git_reset idempotent (git_reset destructive); the rest plain writes.
GIT_EFFECTS = {
    "git_status": E.READ_ONLY, "git_diff_unstaged": E.READ_ONLY, "git_diff_staged": E.READ_ONLY,
    "git_diff": E.READ_ONLY, "git_log": E.READ_ONLY, "git_show": E.READ_ONLY, "git_branch": E.READ_ONLY,
    "git_add": E.IDEMPOTENT, "git_reset": E.IDEMPOTENT,
    "git_commit": E.UNSAFE, "git_checkout": E.UNSAFE, "git_create_branch": E.UNSAFE,
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def commits(repo: Path) -> list[str]:
    return git(repo, "log", "--format=%s").splitlines()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "tether@example.com")
    git(repo, "config", "user.name", "Tether Test")
    (repo / "README").write_text("scratch\n")
    git(repo, "add", "README")
    git(repo, "commit", "-q", "-m", "initial")
    (repo / "hello.txt").write_text("hello\n")
    return repo


def git_server(name: str, repo: Path, extra: str = "") -> str:
    return f'[servers.{name}]\ncommand = "mcp-server-git"\nargs = ["--repository", "{repo}"]\n{extra}\n'


def fault_server(state: Path, record_timeout: float = 10) -> str:
    return (
        f'[servers.faults]\ncommand = "{sys.executable}"\nargs = ["{FAULT_SERVER}", "{state}"]\n'
        "trust_annotations = true\ntimeout = 10\n"
        f"[servers.faults.tools.record]\ntimeout = {record_timeout}\n"
        '[servers.faults.tools.post]\neffect = "reconcilable"\nlookup = "find"\n'
    )


@asynccontextmanager
async def mcp_registry(toml: str) -> AsyncIterator[tuple[ToolRegistry, McpServers]]:
    registry = ToolRegistry()
    async with mcp_tools(parse_config(toml), registry) as servers:
        assert servers is not None
        yield registry, servers


def calls(state: Path, tool: str) -> list[list[str]]:
    path = state / "calls"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.split(" ", 2) for line in lines if line.startswith(tool + " ")]


async def approve(handle: WorkflowHandle) -> None:
    snap = await wait_for_state(handle, "AWAITING_APPROVAL")
    assert snap.plan is not None
    await handle.signal(
        "approve", approval_for(snap, "bob")
    )


def path(outcome: RunOutcome) -> list[str]:
    return [r.to_state.value for r in outcome.timeline if r.kind == "transition"]


# ----------------------------------------------------------------------------- the catalog


async def test_git_server_annotations_become_effects_under_the_trust_policy(repo: Path) -> None:
    toml = (
        git_server("git", repo, "trust_annotations = true")
        + git_server("gitu", repo)  # not trusted: its annotations are ignored
        + git_server("gito", repo, 'trust_annotations = true\n[servers.gito.tools.git_add]\neffect = "unsafe"\n'
                     'summary_fields = ["files"]')
    )
    async with mcp_registry(toml) as (registry, servers):
        assert servers.unavailable == {}
        trusted = {n.removeprefix("git__"): s for n, s in registry.tools.items() if n.startswith("git__")}
        assert {name: spec.effect for name, spec in trusted.items()} == GIT_EFFECTS
        for name, spec in trusted.items():
            # Read-only tools run without approval; every write needs one.
            assert spec.requires_approval == (GIT_EFFECTS[name] != E.READ_ONLY)
            assert spec.source == "mcp:git" and spec.why.startswith("annotation:")
        # The server marks only git_reset destructive (its other writes say destructiveHint false).
        assert {n for n, s in trusted.items() if s.destructive} == {"git_reset"}
        untrusted = {n: s for n, s in registry.tools.items() if n.startswith("gitu__")}
        assert len(untrusted) == 12
        assert all(s.effect == E.UNSAFE and s.requires_approval and s.destructive for s in untrusted.values())
        overridden = registry.get("gito__git_add")
        assert overridden is not None and overridden.effect == E.UNSAFE and overridden.why == "override: effect = unsafe"
        assert registry.get("gito__git_reset").effect == E.IDEMPOTENT  # only the named tool changes
        # The catalog snapshot carries the server's own JSON schema, description and source.
        info = registry.catalog().get("git__git_add")
        assert info is not None and info.source == "mcp:git" and info.description == "Adds file contents to the staging area"
        assert info.args_schema["properties"]["files"]["minItems"] == 1
        assert info.args_schema["required"] == ["repo_path", "files"]


async def test_a_server_down_at_start_is_left_out_and_the_log_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tether.mcp")
    toml = f'[servers.down]\ncommand = "{tmp_path / "no-such-server"}"\n\n[servers.time]\ncommand = "mcp-server-time"\n'
    async with mcp_registry(toml) as (registry, servers):
        assert sorted(registry.tools) == ["time__convert_time", "time__get_current_time"]
        assert list(servers.unavailable) == ["down"]
    line = next(r.getMessage() for r in caplog.records if "'down'" in r.getMessage())
    assert "unavailable at worker start" in line and "no-such-server" in line and "absent from new runs' catalogs" in line


# ----------------------------------------------------------------------------- governed runs


async def test_governed_git_run_commits_exactly_once_after_approval(ts_env: WorkflowEnvironment, repo: Path) -> None:
    toml = git_server("git", repo, 'trust_annotations = true\n[servers.git.tools.git_commit]\nsummary_fields = ["message"]')
    r = str(repo)
    async with mcp_registry(toml) as (registry, _), running_worker(ts_env.client, registry=registry) as worker:
        # A read-only step runs without approval.
        status = await start_run(ts_env.client, worker, make_request([{"tool": "git__git_status", "args": {"repo_path": r}}]))
        outcome = await run_outcome(status)
        assert outcome.state == S.COMPLETED and "AWAITING_APPROVAL" not in path(outcome)
        assert "hello.txt" in (await observations(status))[0]

        steps = [
            {"tool": "git__git_status", "args": {"repo_path": r}},
            {"tool": "git__git_add", "args": {"repo_path": r, "files": ["hello.txt"]}},
            {"tool": "git__git_commit", "args": {"repo_path": r, "message": "Add hello"}},
        ]
        handle = await start_run(ts_env.client, worker, make_request(steps, goal="Commit hello.txt"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL")
        assert snap.pending_approval is not None
        summary = snap.pending_approval.summary
        assert "2 of 3 step(s) write" in summary and "git__git_commit (cannot be undone; unsafe: never re-run; message=\"Add hello\")" in summary
        assert commits(repo) == ["initial"] and snap.step == 0, "nothing runs before the approval"
        await approve(handle)
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED and is_legal_path(outcome.timeline)
    assert [s.tool for s in outcome.steps] == [s["tool"] for s in steps]
    assert commits(repo) == ["Add hello", "initial"]
    assert git(repo, "show", "--name-only", "--format=", "HEAD").split() == ["hello.txt"]
    assert path(outcome).count("EXECUTING_TOOL") == 3 and "RETRY_WAIT" not in path(outcome)


async def test_fault_cases_error_results_crashes_and_timeouts(ts_env: WorkflowEnvironment, tmp_path: Path) -> None:
    state = tmp_path / "faults"
    state.mkdir()
    # The tools' own timeouts (10 s): a call after a crash starts a new server process within
    # its deadline, which a loaded machine must have room for; no case here is about a timeout.
    async with mcp_registry(fault_server(state)) as (registry, _), \
            running_worker(ts_env.client, registry=registry) as worker:

        async def run(tool: str, args: dict) -> tuple[WorkflowHandle, RunOutcome]:
            handle = await start_run(ts_env.client, worker, make_request([{"tool": tool, "args": args}]))
            await approve(handle)
            return handle, await run_outcome(handle)

        # isError with a Tether error code in _meta: EXECUTION_FAILED with that code, not retried.
        _, outcome = await run("faults__decline", {"amount_cents": 500})
        assert outcome.state == S.EXECUTION_FAILED
        assert outcome.timeline[-1].refs.error_code == "card_declined"
        # The server's error text may quote arguments: the record names the code, not the text.
        assert "500" not in outcome.timeline[-1].reason and "outcome failed" in outcome.timeline[-1].reason
        assert len(calls(state, "decline")) == 1
        # isError from the SDK's own ToolError: the generic code.
        _, outcome = await run("faults__fail", {})
        assert outcome.state == S.EXECUTION_FAILED and outcome.timeline[-1].refs.error_code == "mcp_tool_error"

        # Crash mid-call of an idempotent tool: outcome unknown, retried on a new session with
        # the same idempotency key, and the second call succeeds.
        handle, outcome = await run("faults__upsert", {"note": "n1"})
        assert outcome.state == S.COMPLETED and path(outcome).count("RETRY_WAIT") == 1
        key = f"{handle.id}:{outcome.steps[0].tool_call_id}"  # the run's key reached the server in _meta
        assert [k for _, k, _ in calls(state, "upsert")] == [key, key]

        # A reconcilable tool (the operator's word, with a lookup tool) whose answer is lost after
        # its effect: the retry looks the effect up by key and returns it instead of posting again.
        handle, outcome = await run("faults__post", {"note": "p1"})
        key = f"{handle.id}:{outcome.steps[0].tool_call_id}"
        assert outcome.state == S.COMPLETED and path(outcome).count("RETRY_WAIT") == 1
        assert [k for _, k, _ in calls(state, "post")] == [key]
        assert [k for _, k, _ in calls(state, "find")] == [key]
        assert json.loads((await observations(handle))[0]) == f"found {key} p1"

        # Crash mid-call of an unsafe tool: HANDED_OFF naming the call, never a second call.
        (state / "crash").touch()
        _, outcome = await run("faults__record", {"note": "crash"})
        (state / "crash").unlink()
        assert outcome.state == S.HANDED_OFF
        last = outcome.timeline[-1]
        assert last.refs.tool_call_id and last.refs.tool_call_id in last.reason and "outcome unknown" in last.reason
        assert last.refs.error_code == "mcp_connection_lost"
        assert len(calls(state, "record")) == 1

        # The next call gets a new session (the server was restarted).
        after, outcome = await run("faults__record", {"note": "after"})
        assert outcome.state == S.COMPLETED and json.loads((await observations(after))[0]) == "recorded after"
        assert len(calls(state, "record")) == 2


async def test_a_server_over_streamable_http(ts_env: WorkflowEnvironment, tmp_path: Path) -> None:
    state = tmp_path / "faults"
    state.mkdir()
    port = free_port()
    server = Proc("mcp-http", [sys.executable, str(FAULT_SERVER), str(state), "--http", str(port)],
                  tmp_path / "mcp-http.log", {**os.environ, "NO_PROXY": "127.0.0.1,localhost"})
    try:
        await server.wait_for_output("Uvicorn running")
        toml = f'[servers.web]\nurl = "http://127.0.0.1:{port}/mcp"\ntrust_annotations = true\n'
        async with mcp_registry(toml) as (registry, _), running_worker(ts_env.client, registry=registry) as worker:
            assert registry.get("web__find").effect == E.READ_ONLY
            handle = await start_run(ts_env.client, worker, make_request([{"tool": "web__record", "args": {"note": "hi"}}]))
            await approve(handle)
            outcome = await run_outcome(handle)
    finally:
        server.stop()
    assert outcome.state == S.COMPLETED and json.loads((await observations(handle))[0]) == "recorded hi"
    assert [k for _, k, _ in calls(state, "record")] == [f"{handle.id}:{outcome.steps[0].tool_call_id}"]


async def test_a_slow_unsafe_call_past_its_timeout_is_outcome_unknown(dev_env: WorkflowEnvironment, tmp_path: Path) -> None:
    # The dev server, not the time-skipping one: the worker's own deadline (a little under the
    # tool's 3 s timeout) must pass in real time before Temporal's.
    state = tmp_path / "faults"
    state.mkdir()
    (state / "slow").write_text("30")
    async with mcp_registry(fault_server(state, record_timeout=3)) as (registry, _), \
            running_worker(dev_env.client, registry=registry) as worker:
        handle = await start_run(dev_env.client, worker, make_request([{"tool": "faults__record", "args": {"note": "slow"}}]))
        await approve(handle)
        outcome = await run_outcome(handle)
        assert outcome.state == S.HANDED_OFF and outcome.timeline[-1].refs.error_code == "mcp_timeout"
        assert "outcome unknown" in outcome.timeline[-1].reason
        assert len(calls(state, "record")) == 1


async def test_worker_killed_during_a_slow_unsafe_mcp_call_hands_off_without_a_second_call(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    state = tmp_path / "faults"
    state.mkdir()
    (state / "slow").write_text("60")
    config = tmp_path / "mcp.toml"
    config.write_text(fault_server(state, record_timeout=4) + f'\n[servers.down]\ncommand = "{tmp_path / "nothing"}"\n')
    queue = unique("mcp-kill")
    address = dev_env.client.service_client.config.target_host
    env = {**os.environ, "TEMPORAL_ADDRESS": address, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "worker.py", "--tools", "", "--task-queue", queue, "--mcp-config", str(config)]
    first = Proc("worker-1", cmd, tmp_path / "worker-1.log", env)
    second: Proc | None = None
    try:
        await first.wait_for_output("worker ready")
        assert "MCP server 'down' unavailable at worker start" in first.output()
        assert "faults__record" in first.output() and "down__" not in first.output()
        client: Client = dev_env.client
        handle = await start_run(client, type("W", (), {"task_queue": queue})(), make_request(
            [{"tool": "faults__record", "args": {"note": "slow"}}]))
        await approve(handle)
        tool_call_id = (await snapshot(handle)).plan.steps[0].tool_call_id
        for _ in range(400):  # until the server has the call (it then sleeps 60 s)
            if calls(state, "record"):
                break
            await asyncio.sleep(0.05)
        assert len(calls(state, "record")) == 1
        first.kill()
        second = Proc("worker-2", cmd, tmp_path / "worker-2.log", env)
        await second.wait_for_output("worker ready")
        outcome: RunOutcome = await asyncio.wait_for(run_outcome(handle), 60)
    finally:
        first.kill()
        if second is not None:
            second.stop()
    assert outcome.state == S.HANDED_OFF
    last = outcome.timeline[-1]
    assert last.refs.tool_call_id == tool_call_id and tool_call_id in last.reason and "outcome unknown" in last.reason
    assert len(calls(state, "record")) == 1, "an unsafe MCP tool was called twice"


async def test_model_planner_is_offered_mcp_tools_and_its_proposal_is_checked_against_their_schemas(
    ts_env: WorkflowEnvironment, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = str(repo)
    with fake_model(monkeypatch, api_key="sk-test-mcp-0000000000") as fake:
        fake.script(
            tool_calls(call("git__git_add", {"repo_path": r, "files": []})),  # the server's schema: minItems 1
            tool_calls(call("git__git_status", {"repo_path": r})),
            text("hello.txt is untracked."),
        )
        toml = git_server("git", repo, "trust_annotations = true")
        async with mcp_registry(toml) as (registry, _), running_worker(ts_env.client, registry=registry) as worker:
            # The model planner offers the tools of the worker it runs on: here, the MCP tools only.
            request = make_request([], goal="What is the state of the repository?", planner="model")
            outcome = await run_outcome(await start_run(ts_env.client, worker, request))
        first = fake.completions[0]
    assert outcome.state == S.COMPLETED and outcome.answer == "hello.txt is untracked."
    assert path(outcome)[:4] == ["PLANNING", "VALIDATION_FAILED", "PLANNING", "VALIDATED"]
    failed = next(r for r in outcome.timeline if r.to_state == S.VALIDATION_FAILED)
    assert "git__git_add" in failed.reason and "files" in failed.reason
    assert "AWAITING_APPROVAL" not in path(outcome), "a read-only MCP tool runs without approval"
    offered = {t["function"]["name"]: t["function"] for t in first.tools}
    assert set(offered) == {f"git__{name}" for name in GIT_EFFECTS} | {"tether_delegate"}  # and the delegate step
    assert offered["git__git_add"]["parameters"] == registry.get("git__git_add").args_schema
    assert "Effect: read_only" in offered["git__git_status"]["description"]
    assert "Effect: unsafe" in offered["git__git_commit"]["description"]


async def test_an_mcp_tool_declares_its_undo_in_the_config(repo: Path, caplog: pytest.LogCaptureFixture) -> None:
    toml = git_server(
        "git", repo,
        'trust_annotations = true\n'
        '[servers.git.tools.git_add]\ncompensate = { tool = "git_reset", args = { repo_path = "/args/repo_path" } }\n'
        '[servers.git.tools.git_commit]\ncompensate = { tool = "git_uncommit", args = { repo_path = "/args/repo_path" } }\n',
    )
    async with mcp_registry(toml) as (registry, _):
        info = registry.catalog().get("git__git_add")
        # The compensating tool is the same server's, named as the catalog names it.
        assert info.compensate is not None and info.compensate.tool == "git__git_reset"
        assert info.compensate.args == {"repo_path": "/args/repo_path"}
        # A compensating tool the server does not publish: no recovery path, and the log says so.
        assert registry.catalog().get("git__git_commit").compensate is None
        assert "git_uncommit" in caplog.text and "not published" in caplog.text
        listing = format_tools(describe_tools(registry))
        assert "UNDO" in listing.splitlines()[0]
        assert any(line.startswith("git__git_add ") and "git__git_reset" in line for line in listing.splitlines())
    # A pointer outside /args and /result is refused when the config is read.
    with pytest.raises(Exception, match="not a JSON pointer into /args or /result"):
        parse_config(git_server("git", repo, '[servers.git.tools.git_add]\ncompensate = { tool = "git_reset", args = { repo_path = "repo" } }\n'))
# ----------------------------------------------------------------------------- hostile listings

BAD_LISTING_SERVER = ROOT / "tests/helpers/mcp_bad_listing_server.py"


async def test_one_bad_listing_never_stops_the_worker_and_a_nested_quantifier_never_freezes_it(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A real worker process: one server lists a name twice, invalid entries, an oversized one and
    a lookahead pattern; the worker starts with every other tool. Its ``echo`` tool's pattern
    ``^(\\w+\\s?)+$`` against a 10 kB argument (a backtracking engine takes minutes on 32
    characters) is refused at once, and the next run on the same worker takes its usual time."""
    config = tmp_path / "mcp.toml"
    config.write_text(
        f'[servers.bad]\ncommand = "{sys.executable}"\nargs = ["{BAD_LISTING_SERVER}"]\ntrust_annotations = true\n'
        '[servers.time]\ncommand = "mcp-server-time"\n'
    )
    queue = unique("mcp-bad")
    env = {**os.environ, "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "worker.py", "--tools", "examples.billing.tools", "--task-queue", queue, "--mcp-config", str(config)]
    worker = Proc("worker-bad-listing", cmd, tmp_path / "worker.log", env)
    try:
        await worker.wait_for_output("worker ready")
        out = worker.output()
        ready = next(line for line in out.splitlines() if "worker ready" in line)
        # Python tools, the other server's tools and the bad server's one good tool are there.
        for name in ("get_order", "issue_refund", "time__get_current_time", "bad__echo"):
            assert name in ready, ready
        offered, _, left_out = ready.partition(" left out: ")
        for name in ("twice", "lookahead", "broken", "huge", "stringschema"):
            assert f"bad__{name}" not in offered and f"bad__{name}" in left_out
        # Each bad entry has its own log line naming the server and the tool.
        assert "MCP server 'bad': tool 'twice' left out: the server lists 'twice' 2 times" in out
        assert "MCP server 'bad': tool 'lookahead' left out: schema pattern at /properties/text/pattern cannot run in linear time" in out
        assert "MCP server 'bad': tool 'broken' left out: invalid input schema" in out
        assert "MCP server 'bad': tool 'huge' left out: the server's tools exceed" in out
        assert "MCP server 'bad': tool 'stringschema' left out: not a valid tool entry" in out
        assert "MCP server 'bad': tool #7 (no name) left out" in out
        assert "unavailable at worker start" not in out
        # `tether tools` lists what was left out, and why.
        only_bad = tmp_path / "bad.toml"
        only_bad.write_text(config.read_text().split("[servers.time]")[0])
        listing = subprocess.run([sys.executable, "starter.py", "tools", "--mcp-config", str(only_bad), "--tools", ""],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert listing.returncode == 0, listing.stderr
        rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
        assert "read_only" in rows["bad__echo"] and "left out" not in rows["bad__echo"]
        assert "left out" in rows["bad__twice"] and "the server lists 'twice' 2 times" in rows["bad__twice"]
        assert "left out" in rows["bad__lookahead"] and "RE2: invalid perl operator" in rows["bad__lookahead"]
        assert "left out" in rows["bad__stringschema"] and "not a valid tool entry" in rows["bad__stringschema"]

        target = type("W", (), {"task_queue": queue})()

        async def run(text: str) -> tuple[RunOutcome, float]:
            loop = asyncio.get_running_loop()
            started = loop.time()
            handle = await start_run(dev_env.client, target, make_request(
                [{"tool": "bad__echo", "args": {"text": text}}], limits={"max_replans": 0}))
            outcome = await asyncio.wait_for(run_outcome(handle), 60)
            return outcome, loop.time() - started

        usual, usual_seconds = await run("hello world")
        assert usual.state == S.COMPLETED and usual.steps[0].status == "ok"  # the call works too
        hostile, hostile_seconds = await run("a " * 5000 + "!")  # 10,001 characters, no match
        assert hostile.state != S.COMPLETED
        failed = next(r for r in hostile.timeline if r.to_state == S.VALIDATION_FAILED)
        assert "text: does not match the required pattern" in failed.reason
        after, after_seconds = await run("hello again")
        assert after.state == S.COMPLETED
        # Bounded cost: the hostile run ends as fast as an ordinary one; so does the next run.
        assert hostile_seconds < usual_seconds + 5, (usual_seconds, hostile_seconds)
        assert after_seconds < usual_seconds + 5, (usual_seconds, after_seconds)
    finally:
        worker.stop()
