"""The `tether` command's contract, through the installed script (.venv/bin/tether) against a real
dev server: every subcommand's exit codes (0 done, 1 refused by the run, 2 usage / unknown run /
unreachable), one line on stderr for every error, never a traceback; why a run ended; pipes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from tests.helpers.billing import Billing
from tests.helpers.paths import BIN, ROOT
from tests.helpers.runs import running_worker, unique
from tests.helpers.waiting import wait_for_state
from tests.helpers.cli import Cli
from tests.helpers.terminal import in_terminal
from tests.helpers.cli import POLICY, SMALL_REFUND, one_line

# More than the order's total (permanent error) and above 500.00 (high risk: carol and erin).
HUGE_REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1003", "amount_cents": 999_999, "reason": "cli"}}]
UNKNOWN_TOOL = [{"tool": "wire_money", "args": {}}]
# Two refunds of A-1001 (49.99): the second is over what is left (permanent), so the first is undone.
OVER_REFUND = [{"tool": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 3000, "reason": "cli"}}] * 2


async def test_every_subcommand_exit_codes_and_one_line_errors(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    playbooks = {}
    for name, steps in (("small", SMALL_REFUND), ("huge", HUGE_REFUND), ("unknown", UNKNOWN_TOOL), ("over", OVER_REFUND)):
        playbooks[name] = tmp_path / f"{name}.json"
        playbooks[name].write_text(json.dumps(steps))
    key = tmp_path / "bob.pem"  # made by keygen below

    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)

        async def ok(*args: str) -> str:
            code, out, err = await cli(*args)
            assert code == 0 and "Traceback" not in err, (args, code, out, err)
            return out

        async def fails(code_expected: int, *args: str) -> str:
            code, out, err = await cli(*args)
            assert code == code_expected, (args, code, out, err)
            return one_line(err)

        async def start(playbook: str, *extra: str) -> str:
            run_id = unique("cli")
            await ok("start", "--goal", "Refund (cli test)", "--playbook", str(playbooks[playbook]),
                     "--requested-by", "alice", "--id", run_id, *extra)
            return run_id

        async def failed_run() -> None:  # a run the validator fails: --wait exits 1 saying why
            run_id = unique("cli-failed")
            line = await fails(1, "start", "--goal", "g", "--playbook", str(playbooks["unknown"]),
                               "--requested-by", "alice", "--id", run_id, "--max-replans", "0", "--wait")
            assert f"run {run_id} ended in FAILED: " in line and "wire_money" in line
            out = await ok("status", run_id)
            assert "state      FAILED" in out and "why        " in out and "wire_money" in out
            assert "wire_money" in json.loads(await ok("status", run_id, "--json"))["end_reason"]

        async def usage_errors() -> None:  # named after the option, before anything is sent
            small = ["--playbook", str(playbooks["small"]), "--requested-by", "alice"]
            assert (await fails(2, "start", "--goal", "", *small)).startswith("error: --goal: ")
            assert (await fails(2, "start", "--goal", "g", *small, "--max-steps", "0")).startswith("error: --max-steps: ")
            assert "--requested-by" in await fails(2, "start", "--goal", "g")  # argparse: one line too
            assert "--limit" in await fails(2, "list", "--limit", "0")
            assert "invalid tenant" in await fails(2, "list", "--tenant", "a b")
            assert "public_key = " in await ok("keygen", "--out", str(key))
            assert "exists" in await fails(2, "keygen", "--out", str(key))

        async def approved() -> None:
            run_id = await start("small", "--wait")
            assert (await fails(2, "approve", run_id, "--by", "", "--unreviewed")).startswith("error: --by: ")
            assert (await fails(2, "approve", run_id, "--by", "bob", "--unreviewed", "--comment", "c" * 2001)).startswith(
                "error: --comment: ")
            assert (await fails(2, "approve", run_id, "--by", "bob", "--unreviewed", "--decision-id", "d" * 129)).startswith(
                "error: --decision-id: ")
            assert (await fails(2, "reject", run_id, "--by", "bob", "--unreviewed", "--reason", "r" * 2001)).startswith(
                "error: --reason: ")
            assert "key file not found" in await fails(2, "approve", run_id, "--by", "bob", "--unreviewed", "--key", str(tmp_path / "no.pem"))
            # Refused by the run -> 1 with the rule.
            assert "[rule: four_eyes]" in await fails(1, "approve", run_id, "--by", "alice", "--unreviewed")
            assert "[rule: tenant_membership]" in await fails(1, "approve", run_id, "--by", "mallory", "--unreviewed")
            assert "APPROVED" in await ok("approve", run_id, "--by", "bob", "--unreviewed")
            await wait_for_state(dev_env.client.get_workflow_handle(run_id), "COMPLETED")
            assert "why" not in await ok("status", run_id)  # nothing to explain for a completed run

        async def high_risk() -> None:
            # Two approvals: the first is accepted, the second runs the plan; the tool fails for
            # good and status says why.
            run_id = await start("huge", "--wait")
            assert "accepted" in await ok("approve", run_id, "--by", "carol", "--unreviewed")
            assert "[rule: distinct_approvers]" in await fails(1, "approve", run_id, "--by", "carol", "--unreviewed")
            await ok("approve", run_id, "--by", "erin", "--unreviewed")
            await wait_for_state(dev_env.client.get_workflow_handle(run_id), "EXECUTION_FAILED")
            out = await ok("status", run_id)
            assert "why" in out and "[rule: amount_exceeds_total]" in out

        async def rejected() -> None:
            run_id = await start("small", "--wait")
            assert "REJECTED" in await ok("reject", run_id, "--by", "bob", "--unreviewed", "--reason", "no")
            out = await ok("status", run_id)
            assert "state      REJECTED" in out and "why" in out and "bob" in out

        async def handed_off() -> str:
            # A non-member is refused by the run (1, with the rule); a member hands off (0).
            run_id = await start("small", "--wait")
            assert (await fails(2, "handoff", run_id, "--by", "dana", "--reason", "")).startswith("error: --reason: ")
            assert "[rule: tenant_membership]" in await fails(1, "handoff", run_id, "--by", "mallory", "--reason", "r")
            assert "HANDED_OFF" in await ok("handoff", run_id, "--by", "dana", "--reason", "call the customer")
            assert "handed off by dana: call the customer" in await ok("status", run_id)
            records = json.loads(await ok("timeline", run_id, "--json"))
            assert records[-1]["to_state"] == "HANDED_OFF" and records[-1]["refs"]["decision_id"]
            assert any(r["rule"] == "tenant_membership" for r in records)
            return run_id

        async def expired() -> None:
            # No --wait: a busy worker may expire the request before `start` saw it asked for
            # (then --wait rightly exits 1, the run having ended in EXPIRED).
            run_id = await start("small", "--approval-ttl", "0.5")
            await wait_for_state(dev_env.client.get_workflow_handle(run_id), "EXPIRED")
            assert "why" in await ok("status", run_id)

        async def compensated() -> None:
            run_id = await start("over", "--on-failure", "compensate", "--wait")
            assert "issue_refund: can be undone by void_refund" in await ok("status", run_id)  # the approver reads it
            await ok("approve", run_id, "--by", "bob", "--unreviewed")
            await wait_for_state(dev_env.client.get_workflow_handle(run_id), "COMPENSATED")
            out = await ok("status", run_id)
            assert "state      COMPENSATED" in out and "undone (void_refund)" in out and "compensate " not in out
            assert "--on-failure" in await fails(2, "start", "--goal", "g", "--playbook", str(playbooks["small"]),
                                                 "--requested-by", "alice", "--on-failure", "undo")
            assert "only an ended run" in await fails(1, "compensate", await start("small", "--wait"), "--by", "bob")

        *_, handed = await asyncio.gather(
            failed_run(), usage_errors(), approved(), high_risk(), rejected(), expired(), compensated(), handed_off()
        )
        # Compensating a run that wrote nothing: refused before anything starts (1), every time;
        # a name the policy does not let compensate (1); an unknown run (2).
        line = await fails(1, "compensate", handed, "--by", "bob", "--wait")
        assert "started" not in line and "nothing_to_compensate" in line
        assert "nothing_to_compensate" in await fails(1, "compensate", handed, "--by", "carol")
        assert "[rule: role]" in await fails(1, "compensate", handed, "--by", "dana", "--policy", str(POLICY.path))
        assert (await cli("compensate", unique("no-such-run"), "--by", "bob"))[0] == 2

        # A reader that stops early (`| head`): no traceback, exit 0.
        read, write = os.pipe()
        os.close(read)
        proc = await asyncio.create_subprocess_exec(
            str(BIN / "tether"), "timeline", handed, stdout=write, stderr=asyncio.subprocess.PIPE, env=cli.env,
        )
        os.close(write)
        _, err = await proc.communicate()
        assert proc.returncode == 0 and err.decode() == "", err.decode()


async def test_unreachable_temporal_names_address_and_cause(dev_env: WorkflowEnvironment, tmp_path: Path) -> None:
    env = {**os.environ, "TEMPORAL_ADDRESS": "nosuchhost.invalid:7233"}
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "tether"), "status", "some-run", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    line = one_line(err.decode())
    assert proc.returncode == 2
    assert line.startswith("error: cannot reach Temporal at nosuchhost.invalid:7233 (dns error: ")
    assert line.endswith("; start it with `make dev-server` or set TEMPORAL_ADDRESS"), line
    # The worker says the same, in one line, and does not start.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "worker.py", "--task-queue", "nowhere", env=env, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == 1
    assert one_line(err.decode()).startswith("cannot reach Temporal at nosuchhost.invalid:7233 (dns error: ")


async def test_demo_prints_commands_that_paste(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """`make demo`'s closing commands, run as printed through `sh`, in order, each do what the
    demo says: exit 0, the suggested run waits for approval and, approved, completes (its own
    order has all of it left to refund); refusals show their exit code; `make demo-order` gives
    the README's examples an order each."""
    async with running_worker(dev_env.client, policy=POLICY) as worker:
        cli = Cli(dev_env, worker)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "examples.demo", env=cli.env, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, (out.decode()[-3000:], err.decode()[-3000:])
        text = out.decode()
        # No hint names a bare `tether` (not on PATH outside an activated virtualenv).
        assert not re.search(r"(?<![/\w])tether (approve|status|timeline|start|list) ", text), text
        printed = text.split("Next, try:\n", 1)[1].splitlines()
        commands = [line.strip() for line in printed[: next(i for i, line in enumerate(printed) if not line.startswith("  "))]]
        assert len(commands) >= 3 and all(".venv/bin/tether " in c for c in commands), text
        # Every step the demo echoed is a command line too.
        echoed = [line[2:] for line in text.splitlines() if line.startswith("$ ")]
        assert echoed and all(shlex.split(c)[0].endswith("tether") for c in echoed)
        # The refusals are shown with their exit code, in the one stream, where they happen.
        refusal = text.split("--by alice", 1)[1].split("\n$ ", 1)[0]
        assert "four_eyes" in refusal and "(exit code 1)" in refusal, refusal
        # The README's examples each refund an order of their own (`make demo-order`).
        playbooks = []
        for _ in range(2):
            made = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "examples.demo", "order", env=cli.env, cwd=ROOT,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            path, _ = await made.communicate()
            assert made.returncode == 0, path
            playbooks.append(json.loads((ROOT / path.decode().strip()).read_text()))
        orders = [steps[1]["args"]["order_id"] for steps in playbooks]
        assert orders[0] != orders[1] and not [r for r in billing.refunds() if r["order_id"] in orders]
        ran: dict[str, str] = {}
        env = {k: v for k, v in cli.env.items() if k != "TEMPORAL_ADDRESS"}
        for command in commands:
            verb = shlex.split(command)[shlex.split(command).index(".venv/bin/tether") + 1]
            if verb == "approve":  # pasted into a terminal: it shows the plan and asks
                code, shown = await asyncio.to_thread(in_terminal, ["sh", "-c", command], env, "y")
                assert code == 0 and "[y/N]" in shown, (command, shown)
                ran[verb] = shown
                continue
            shell = await asyncio.create_subprocess_exec(
                "sh", "-c", command, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
            out, err = await shell.communicate()
            assert shell.returncode == 0 and out and not err, (command, out.decode(), err.decode())
            ran[verb] = out.decode()
        assert "state      AWAITING_APPROVAL" in ran["start"] and "APPROVED" in ran["approve"], ran
        started = shlex.split(next(c for c in commands if " start " in c))
        handle = dev_env.client.get_workflow_handle(started[started.index("--id") + 1])
        snap = await wait_for_state(handle, "COMPLETED", "EXECUTION_FAILED")
        assert snap.state.value == "COMPLETED", await handle.query("timeline")
        order = started[started.index("--goal") + 1].split()[-1]
        assert [r["amount_cents"] for r in billing.refunds() if r["order_id"] == order] == [4999]


def test_help_imports_neither_the_client_nor_temporal_nor_pydantic() -> None:
    """`tether --help` (and a command's --help, and a usage error) print before anything heavy is
    imported: the client, Temporal, pydantic and the workflow models are imported on first use."""
    heavy = ("tether.client", "temporalio", "pydantic", "workflows.contract", "workflows.states", "asyncio")
    script = (
        "import sys, starter\n"
        "try:\n    starter.main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        f"print(code, *sorted({{m.split('.')[0] if m.split('.')[0] not in ('workflows', 'tether') else '.'.join(m.split('.')[:2]) for m in sys.modules}} & {set(heavy)!r}), "
        "file=sys.stderr)"
    )
    for argv in (["--help"], ["status", "--help"], ["approve", "--help"], ["status"], ["--version"]):
        proc = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, capture_output=True, text=True)
        assert proc.stderr.splitlines()[-1] == ("2" if argv == ["status"] else "0"), (argv, proc.stderr)
    # What a command needs is there once it runs (the README's table is generated from the same parser).
    proc = subprocess.run([sys.executable, "-c", "import sys, starter; starter.main(['status', 'no-such-run']); "
                           "print('tether.client' in sys.modules, 'temporalio' in sys.modules); "
                           "from tether.connection import exit_process; exit_process(0)"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TEMPORAL_ADDRESS": "127.0.0.1:1"})
    assert proc.stdout.split() == ["True", "True"] and "cannot reach Temporal" in proc.stderr, (proc.stdout, proc.stderr)


def test_starter_outside_the_virtualenv_says_how_to_run_it() -> None:
    # -S: no site-packages, as with a system Python that lacks the dependencies.
    proc = subprocess.run([sys.executable, "-S", "starter.py", "status", "x"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "is not installed" in one_line(proc.stderr) and ".venv/bin/tether" in proc.stderr


def test_processes_making_the_demo_keys_at_once_end_with_one_whole_pair_each(tmp_path: Path) -> None:
    """`make demo`, the inbox and parallel test workers may all make the demo's keys in a fresh
    checkout at the same moment: one pair per person survives, each private key matches the
    public key every process read, and nothing half-written is left."""
    folder = tmp_path / "keys"
    names = ["alice", "bob", "inbox"]
    script = (
        "import sys; from pathlib import Path; from tether.client import ensure_keys; "
        f"ensure_keys(Path(sys.argv[1]), {names!r}); "
        f"print(' '.join((Path(sys.argv[1]) / (n + '.pem.pub')).read_text().strip() for n in {names!r}))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(folder)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    seen = set()
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        seen.add(out.strip())
    assert len(seen) == 1, seen  # every process read the same public keys
    from cryptography.hazmat.primitives import serialization

    from tether.client import load_private_key

    for name, public in zip(names, seen.pop().split()):
        derived = load_private_key(folder / f"{name}.pem").public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        assert __import__("base64").b64encode(derived).decode() == public, name
        assert (folder / f"{name}.pem").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".ensure.lock", *(f"{n}.pem" for n in names), *(f"{n}.pem.pub" for n in names)])


def test_a_typod_planner_is_refused_before_the_start(tmp_path: Path) -> None:
    """Issue 58: `--planner` typos were found after the start (the run id used up), `--tenant`
    typos before it. The worker's planners are known where it is configured (TETHER_PLANNERS,
    or the dev stack's record): a name not among them is refused before anything is sent."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "TEMPORAL_"))}
    env.update(TEMPORAL_ADDRESS="127.0.0.1:1", TETHER_PLANNERS="refunds=examples.agents.refund_agent:planner")
    start = [str(BIN / "tether"), "start", "--goal", "g", "--requested-by", "alice", "--id", "typo-run"]
    done = subprocess.run([*start, "--planner", "refund"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    line = one_line(done.stderr)
    assert "no planner 'refund': did you mean 'refunds'?" in line and "model, playbook, refunds" in line, line
    assert "nothing was started" in line
    # A planner the worker has goes on to the start (here: no server to start it on).
    done = subprocess.run([*start, "--planner", "refunds"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "no planner" not in done.stderr and "cannot reach Temporal" in done.stderr, done


async def test_ctrl_c_during_start_wait_says_the_run_goes_on(dev_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """Issue 58: Ctrl-C during `start --wait` printed nothing, and the run went on. It says so now,
    and how to follow the run."""
    import signal

    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import PollWorkflowTaskQueueRequest

    client = dev_env.client
    queue = unique("ctrl-c")
    taken = asyncio.Event()

    async def holding_poller() -> None:
        # Polls the queue and answers nothing: the run is served (its task taken), never settled.
        while True:
            task = await client.workflow_service.poll_workflow_task_queue(PollWorkflowTaskQueueRequest(
                namespace=client.namespace, task_queue=TaskQueue(name=queue), identity="holding-poller"))
            if task.task_token:
                taken.set()

    poller = asyncio.create_task(holding_poller())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "TEMPORAL_"))}
    env.update(TEMPORAL_ADDRESS=client.service_client.config.target_host, TETHER_TASK_QUEUE=queue,
               PYTHONUNBUFFERED="1")
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "tether"), "start", "--goal", "Refund A-1001", "--requested-by", "alice", "--playbook",
        str(ROOT / "examples/billing/refund.playbook.json"), "--wait", "--wait-timeout", "600",
        env=env, cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = (await proc.stdout.readline()).decode()
        run_id = re.match(r"started (\S+)", line)[1]
        await taken.wait()  # the run's task is held: the command is waiting now
        proc.send_signal(signal.SIGINT)
        out, err = await proc.communicate()
    finally:
        poller.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 130, (out, err)
    said = err.decode()
    assert f"interrupted: run {run_id} goes on" in said and f"tether status {run_id}" in said, said
    handle = client.get_workflow_handle(run_id)
    assert (await handle.describe()).status.name == "RUNNING"
    await handle.terminate("test over")
