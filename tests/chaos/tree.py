"""A chaos round for a run tree: the root's cancel while a parallel group and child runs are in
flight (every read held before its call), with the worker SIGKILLed right after the cancel in
one variant. Real processes, as the other rounds (``tests/chaos/harness.py``).

Nothing may be left stranded: every run of the tree ends CANCELLED on its own record, Temporal
holds no open workflow, no pending activity and no pending child for any of them, no held read
made its call after the cancel, and every timeline is a legal path.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.api.enums.v1 import WorkflowExecutionStatus
from temporalio.client import Client

from tests.chaos.harness import CANCEL_TOOL_TIMEOUT, BillingProc, _await_state, _start, _unique, _wait, start_worker
from tests.helpers.invariants import READ_ONLY_TOOLS, check_timeline
from workflows.contract import DELEGATE
from workflows.run_state import RunRequest
from workflows.states import TERMINAL, RunState, TransitionRecord

READ = "chaos_get_order"


def _read(order: str) -> dict:
    return {"tool": READ, "args": {"order_id": order}}


def _child(goal: str, playbook: list[dict]) -> dict:
    return {"delegate": {"goal": goal, "tools": [READ], "max_steps": 3, "playbook": playbook}}


# The shapes a round's root runs, and how many tool calls of the tree are held at once in each.
SHAPES: dict[str, tuple[list[dict], int]] = {
    # A group of one read and two children, each child holding a read of its own.
    "group": ([{"parallel": [
        _read("A-1001"),
        _child("look up the first order", [_read("A-1002")]),
        _child("look up the second order", [_read("A-1003")]),
    ]}], 3),
    # A child delegating to a grandchild whose own group holds two reads.
    "nested": ([_child("look up orders", [
        {"delegate": {"goal": "look up both", "tools": [READ], "max_steps": 2,
                      "playbook": [{"parallel": [_read("A-1001"), _read("A-1002")]}]}},
    ])], 2),
}


@dataclass
class TreeResult:
    shape: str
    kill: bool
    runs: dict[str, RunState] = field(default_factory=dict)  # workflow id -> Tether's end state
    open: list[str] = field(default_factory=list)  # still running in Temporal after the end
    pending: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (activities, children)
    held: int = 0  # calls that reached their hold
    called: int = 0  # held calls that went on to make their external call


def _held(chaos_dir: Path) -> int:
    return len(list(chaos_dir.glob("*.1.before")))


def _called(chaos_dir: Path) -> int:
    return len(list(chaos_dir.glob("*.after")))


async def _tree(client: Client, root: str) -> list[str]:
    """The root and every descendant, from Temporal's own parent-child links."""
    ids, todo = [], [root]
    while todo:
        wid = todo.pop(0)
        ids.append(wid)
        desc = await client.get_workflow_handle(wid).describe()
        todo += [c.workflow_id for c in desc.raw_description.pending_children]
    return ids


async def tree_cancel_round(
    client: Client, address: str, billing: BillingProc, workdir: Path, *, shape: str, kill: bool,
) -> TreeResult:
    playbook, expected_holds = SHAPES[shape]
    chaos_dir = workdir / _unique(f"tree-{shape}")
    chaos_dir.mkdir(parents=True)
    queue = _unique("chaos-q")
    worker = start_worker(address, billing.url, queue, chaos_dir, "before", CANCEL_TOOL_TIMEOUT)
    result = TreeResult(shape=shape, kill=kill)
    try:
        await worker.wait_for_output("worker ready")
        request = RunRequest(goal=f"chaos tree {shape}", requested_by="alice", playbook=playbook)
        root = await _start(client, request, _unique(f"tree-{shape}"), queue)
        # Every read of the tree at its hold: the group's attempts and the children's are all open.
        await _wait(lambda: _held(chaos_dir) >= expected_holds, 120, f"{expected_holds} reads held")
        ids = await _tree(client, root.id)
        result.held = _held(chaos_dir)
        await root.cancel(reason="chaos cancel of the tree")
        if kill:
            # The cancel is on the root's history; the worker dies before it can carry it out.
            # The next worker holds its reads too: an attempt of the dead worker's that the server
            # retries (its heartbeat timed out) before the cancel has come down the tree to its
            # run waits there, and the cancel must reach it (on a busy machine the retry can come
            # first, and a read made then is the server's retry, not a run that missed its cancel).
            worker.kill()
            worker = start_worker(address, billing.url, queue, chaos_dir, "before", tool_timeout=CANCEL_TOOL_TIMEOUT)
            await worker.wait_for_output("worker ready")
        for wid in ids:
            result.runs[wid] = await _ended(client, wid)
        for wid in ids:
            desc = await client.get_workflow_handle(wid).describe()
            raw = desc.raw_description
            if desc.raw_description.workflow_execution_info.status == WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING:
                result.open.append(wid)
            result.pending[wid] = (len(raw.pending_activities), len(raw.pending_children))
        # Anything of the tree's still running on its queue (a child the links above missed).
        async for wf in client.list_workflows(f'TaskQueue="{queue}" AND ExecutionStatus="Running"'):
            if wf.id not in result.open:
                result.open.append(wf.id)
        result.called = _called(chaos_dir)
    finally:
        worker.stop()
    return result


async def _ended(client: Client, wid: str) -> RunState:
    """Wait for one run of the tree to end; its timeline must be a legal path (a delegate step
    reads as a read: what its child does is on the child's own record)."""
    handle = client.get_workflow_handle(wid)
    snap = await _await_state(handle, set(TERMINAL), 300)
    timeline = await handle.query("timeline", result_type=list[TransitionRecord])
    tools = {s.tool_call_id: s.tool for s in snap.plan.steps} if snap.plan else {}
    check_timeline(timeline, tools, read_only=READ_ONLY_TOOLS | {DELEGATE})
    return snap.state


def check_tree(r: TreeResult) -> None:
    expected_runs = {"group": 3, "nested": 3}[r.shape]
    assert len(r.runs) == expected_runs, r
    assert set(r.runs.values()) == {RunState.CANCELLED}, r
    assert not r.open, r
    assert all(p == (0, 0) for p in r.pending.values()), r
    assert r.held >= SHAPES[r.shape][1], r
    assert r.called == 0, r


async def tree_rounds(client: Client, address: str, billing: BillingProc, workdir: Path) -> list[TreeResult]:
    return list(await asyncio.gather(*(
        tree_cancel_round(client, address, billing, workdir, shape=shape, kill=kill)
        for shape, kill in (("group", False), ("group", True), ("nested", True))
    )))
