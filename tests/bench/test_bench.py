"""The benchmarks still run and still print their tables (tiny parameters; never timings).

One private dev server and bench worker for the module (bench.common.bench_stack, serving
pydantic-ai's agents too when the extra ``bench`` is installed); each benchmark's main runs on
it with a couple of runs of a couple of steps.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from bench import anatomy, overhead, peer, scaling
from bench.common import Stack, bench_stack

HAVE_PEER = importlib.util.find_spec("pydantic_ai") is not None


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack() -> AsyncIterator[Stack]:
    async with bench_stack(["--peer"] if HAVE_PEER else []) as s:
        yield s


def rows(out: str, first_header: str) -> list[list[str]]:
    """The rows of the markdown table whose first column is ``first_header``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} "))
    body = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        body.append([c.strip() for c in line.strip("|").split("|")])
    return body


async def test_overhead_prints_every_variant_with_history_and_latency(stack: Stack, capsys) -> None:
    await overhead.main_async(
        overhead.parse(["--runs", "2", "--steps", "2", "--rounds", "1", "--quiet-approvals", "1", "--warmup", "0"]), stack
    )
    out = capsys.readouterr().out
    main = {r[0]: r for r in rows(out, "variant")}
    assert list(main) == ["governed", "governed+approval", "governed+writes", "bare", "bare+approval"]
    assert all(r[1] == "2" for r in main.values())  # runs counted
    assert main["bare"][4] == "1.00"  # the base against itself
    # Same plan and tools, so the same activity tasks: the setup rides on the first planner call
    # and the end's records go with the end view (no local activity: docs/known-issues.md).
    assert main["bare"][7] == "4" and main["governed"][7] == "4"
    assert main["bare"][8] == "0" and int(main["governed"][8]) > 0
    latency = {r[0]: r for r in rows(out[out.index("latency under the same load"):], "variant")}
    approval = latency["governed+approval"]
    assert approval[3] != "-" and approval[4] != "-"  # signal -> tool scheduled / started measured
    assert latency["bare"][3] == "-"  # the bare loop has no approvals
    # Its baseline: the bare loop's reaction to the same signal, at the same clock points, in the
    # same burst, and one at a time alternating with the governed approvals.
    assert latency["bare+approval"][3] != "-"
    assert "governed+approval, one run at a time" in latency and latency["bare+approval, one run at a time"][3] != "-"
    assert "targets: approval signal -> tool scheduled, governed+approval vs bare+approval" in out
    assert "; one run at a time " in out and "targets: governed+approval/bare median" in out
    # The server's eager activity setting and what it did: the approval path's verdict activity
    # and the tools are handed out in the workflow task's reply (the dev server enables it).
    eager = next(line for line in out.splitlines() if line.startswith("eager activity execution: "))
    assert int(eager.split("; ")[1].split()[0]) > 0, eager
    assert "what governance adds to reacting to an approval" in out
    assert "WORKFLOW_EXECUTION_SIGNALED" in out  # the event-type table
    # The effect ledger's cost per write, against the write-steps variant's worker CPU per step.
    assert "effect ledger: " in out and "ms CPU per write" in out and "governed+writes" in out


@pytest.mark.skipif(not HAVE_PEER, reason="the extra `bench` (pydantic-ai) is not installed: make bench-peer")
async def test_peer_runs_pydantic_ai_side_by_side(stack: Stack, capsys) -> None:
    await peer.main_async(peer.parse(["--runs", "1", "--steps", "3", "--rounds", "1", "--warmup", "0"]), stack)
    out = capsys.readouterr().out
    main = {r[0]: r for r in rows(out, "variant")}
    assert list(main) == ["governed", "bare", peer.PEER_PLAN, peer.PEER_STEP]
    # One planning request + 3 tools + the final request; one request per call: 3 + 1 + 3.
    assert main[peer.PEER_PLAN][7] == "5"
    assert main[peer.PEER_STEP][7] == "7"
    assert f"governed vs {peer.PEER_PLAN}: throughput per round" in out


async def test_scaling_follows_continue_as_new_and_measures_queries(stack: Stack, capsys) -> None:
    # The shared server keeps its default continue-as-new threshold: --can-after 0.
    await scaling.main_async(
        scaling.parse(["--steps", "1,2,3", "--concurrency", "1", "--can-after", "0", "--max-total-steps", "2", "--warmup", "0"]),
        stack,
    )
    out = capsys.readouterr().out
    cells = rows(out, "variant")
    assert [(c[0], c[1]) for c in cells] == [("governed", "1"), ("governed", "2"), ("bare", "1"), ("bare", "2")]
    governed = cells[0]
    assert governed[3] == "1.0"  # one run in the chain
    # Answered after close (live samples depend on timing: not asserted).
    assert "KiB" in governed[13] and "KiB" in governed[14]
    assert cells[2][11] == "-"  # no queries on the bare loop
    assert "skipped (over --max-total-steps 2): 3 steps x 1" in out


async def test_anatomy_accounts_for_every_event(stack: Stack, capsys) -> None:
    await anatomy.main_async(anatomy.parse(["--steps", "2"]), stack)
    out = capsys.readouterr().out
    kinds = {r[0]: r for r in rows(out, "event type")}
    total = kinds.pop("total")
    assert sum(int(r[1]) for r in kinds.values()) == int(total[1])  # governed events add up
    assert sum(int(r[4]) for r in kinds.values()) == int(total[4])  # and so do their bytes
    ops = {r[0]: r for r in rows(out, "operation")}
    assert ops["activity execute_tool"][1:3] == ["2", "2"]
    assert not [op for op in ops if op.startswith("local activity")]  # none: reads cannot hurt a run
    assert ops["activity plan"][1] == "2"  # the first also brought the catalog and the policy
    assert "governed: search-attribute upserts, in order:" in out


def test_profile_buckets_put_each_sample_once_and_leave_idle_out(tmp_path) -> None:
    from bench.profile import buckets

    stacks = tmp_path / "w.txt"
    stacks.write_text(
        "thread (1): MainThread;main (bench/worker_proc.py:1);AuditActivities.audit_append (activities/audit.py:48);"
        "JsonlAuditSink.append (tether/audit/sink.py:110) 7\n"
        # audit_append inside payload visiting still counts once, in the first bucket that matches
        "thread (2);PayloadVisitor.visit (temporalio/bridge/_visitor.py:1);audit_append (x.py:1) 2\n"
        "thread (3);PayloadVisitor.visit (temporalio/bridge/_visitor.py:1) 5\n"
        "thread (4);Thread.run (threading.py:1);_worker (concurrent/futures/thread.py:83) 100\n"  # idle
        "thread (5) 3\n"  # a Rust core thread
        "garbage\n"
    )
    counts, total = buckets(stacks)
    assert total == 17
    assert counts["audit_append local activity (runs on the event loop)"] == 9
    assert counts["payload visiting and converter per activation"] == 5
    assert counts["native (Temporal core threads, no Python frames)"] == 3
