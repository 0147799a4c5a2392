"""A trail says where it ends: `tether audit verify` names each stream "complete, N records,
ended STATE" or "open or cut short after seq N", and exits 1 for a trail cut short where its run
has ended (or any open one with --complete); `--all` counts both. On a real dev server, a real
worker and the JSONL audit sink."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

import tether.client as tether_client
from tether.audit.sink import JsonlAuditSink, audit_path
from tether.audit.verify import verify_streams
from tether.runs import public_keys
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import audit_collected, wait_for_state
from tests.helpers.cli import Cli
from workflows.states import TERMINAL, RunState

REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 119, "reason": "trail ends"}}]


async def completed(client, worker) -> str:
    handle = await start_run(client, worker, make_request(REFUND))
    await handle.signal("approve", approval_for(await wait_for_state(handle, "AWAITING_APPROVAL"), "bob"))
    assert (await tether_client.run_outcome(handle)).state == RunState.COMPLETED
    await audit_collected(client, handle.id)
    return handle.id


def copy_trail(audit_dir: Path, into: Path, workflow_id: str, run_id: str) -> Path:
    target = audit_path(into, workflow_id, run_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(audit_path(audit_dir, workflow_id, run_id), target)
    shutil.copy(audit_path(audit_dir, workflow_id, run_id).parent / "workflow_id", target.parent / "workflow_id")
    return target


async def test_a_trail_cut_short_fails_verify_and_all_counts_complete_and_cut(
    dev_env: WorkflowEnvironment, billing: Billing, audit_dir: Path, tmp_path: Path
) -> None:
    client = dev_env.client
    async with running_worker(client) as worker:
        cli = Cli(dev_env, worker)
        victim, other = await completed(client, worker), await completed(client, worker)
        code, out, err = await cli("audit", "verify", victim)
        assert code == 0, out + err
        streams = await JsonlAuditSink(audit_dir).read(victim)
        [(run_id, records)] = streams.items()
        total = len(records)
        assert f"run {run_id}: complete, {total} record(s), ended COMPLETED" in out, out

        # Someone with write access to the sink cuts the trail back to a signed record before the
        # approval: what is left verifies record by record, so only its end tells.
        ended_at = next(r.seq for r in records if r.kind == "transition" and r.to_state in TERMINAL)
        keep = max(r.seq for r in records if r.sig and r.seq < ended_at and r.to_state == RunState.AWAITING_APPROVAL)
        assert total > keep
        cut_dir = tmp_path / "cut"
        path = copy_trail(audit_dir, cut_dir, victim, run_id)
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(lines[:keep]))
        other_run = next(iter(await JsonlAuditSink(audit_dir).read(other)))
        copy_trail(audit_dir, cut_dir, other, other_run)
        cut = await JsonlAuditSink(cut_dir).read(victim)
        assert [r.seq for r in cut[run_id]] == list(range(1, keep + 1))
        assert verify_streams(public_keys(), victim, cut).problems == []  # every signature and link holds

        code, out, err = await cli("audit", "verify", victim, "--audit-dir", str(cut_dir))
        assert code == 1, out + err
        line = next(line for line in out.splitlines() if f"run {run_id}: " in line)
        assert line.startswith(f"{victim} run {run_id}: open or cut short after seq {keep} ({keep} record(s)")
        assert f"final view says it wrote {total})" in line and line.endswith(": its run has ended"), out
        # From the sink alone (Temporal not reachable): the end is what the records say.
        code, out, err = await cli("audit", "verify", victim, "--audit-dir", str(cut_dir),
                                   env={"TEMPORAL_ADDRESS": "127.0.0.1:9"})
        assert code == 1 and f"open or cut short after seq {keep} ({keep} record(s)): its run has ended" in out, out + err
        code, out, err = await cli("audit", "verify", "--all", "--audit-dir", str(cut_dir))
        assert code == 1, out + err
        assert "1 trail(s) complete, 0 open (still running), 1 cut short" in out, out

        # A run still waiting: its trail is open, which is no failure until --complete asks for its end.
        waiting = await start_run(client, worker, make_request(REFUND))
        await wait_for_state(waiting, "AWAITING_APPROVAL")
        await audit_collected(client, waiting.id)
        code, out, err = await cli("audit", "verify", waiting.id)
        assert code == 0 and "its run is still running" in out and "0 cut short" in out, out + err
        code, out, err = await cli("audit", "verify", waiting.id, "--complete")
        assert code == 1 and ": --complete" in out, out + err


async def test_the_end_is_a_signed_mark_so_a_cut_trail_fails_with_temporal_gone(
    dev_env: WorkflowEnvironment, billing: Billing, audit_dir: Path, tmp_path: Path
) -> None:
    """The run marks its last record final and signs it: from the sink alone (Temporal's copy of
    the run gone, the server unreachable) a full trail is complete and a cut one is not; the mark
    can be neither added to a cut trail nor taken off a full one without breaking a signature."""
    client = dev_env.client
    async with running_worker(client) as worker:
        cli = Cli(dev_env, worker)
        victim = await completed(client, worker)
    [(run_id, records)] = (await JsonlAuditSink(audit_dir).read(victim)).items()
    last = records[-1]
    assert last.final and last.sig and last.to_state == RunState.COMPLETED
    assert [r.seq for r in records if r.final] == [last.seq]  # only the end is marked
    no_temporal = {"TEMPORAL_ADDRESS": "127.0.0.1:9"}  # Temporal forgot the run: the sink alone
    full_dir = tmp_path / "full"
    copy_trail(audit_dir, full_dir, victim, run_id)
    code, out, err = await cli("audit", "verify", victim, "--audit-dir", str(full_dir), env=no_temporal)
    assert code == 0, out + err
    assert f"run {run_id}: complete, {len(records)} record(s), ended COMPLETED" in out, out

    # Cut back to the last signed record before the end: every link and signature left holds.
    keep = max(r.seq for r in records if r.sig and r.seq < last.seq)
    cut_dir = tmp_path / "cut"
    path = copy_trail(audit_dir, cut_dir, victim, run_id)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:keep]))
    assert verify_streams(public_keys(), victim, await JsonlAuditSink(cut_dir).read(victim)).problems == []
    code, out, err = await cli("audit", "verify", victim, "--audit-dir", str(cut_dir), env=no_temporal)
    assert code == 1, out + err
    assert f"run {run_id}: open or cut short after seq {keep} ({keep} record(s))" in out, out
    assert "0 trail(s) complete, 0 open (still running), 1 cut short" in out, out

    # Marking the cut trail's last record final breaks its signature; so does taking the mark off.
    for name, lines_then in (("forged", lines[:keep]), ("unmarked", lines)):
        body = [json.loads(line) for line in lines_then]
        if name == "forged":
            body[-1]["final"] = True
        else:
            body[-1].pop("final")
        target = copy_trail(audit_dir, tmp_path / name, victim, run_id)
        target.write_text("".join(json.dumps(b) + "\n" for b in body))
        code, out, err = await cli("audit", "verify", victim, "--audit-dir", str(tmp_path / name), env=no_temporal)
        assert code == 1 and "with records that are not the fleet's" in out, (name, out + err)
        assert f"run {run_id}: open or cut short after seq" in out, (name, out)
