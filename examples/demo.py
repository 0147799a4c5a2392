"""The demo behind `make demo`: a refund agent stops for approval, is approved, and finishes.

Runs against the stack `examples.devstack up` started, through the same CLI a user types.
`PLANNER=model` (`make demo PLANNER=model`) lets the configured model plan instead of the
playbook: the worker needs TETHER_MODEL, OPENAI_BASE_URL and/or OPENAI_API_KEY in its
environment (see docs/model-planner.md); bob approves each plan that writes.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import uuid
from pathlib import Path

import tether.client as client
import starter
from tether.client import exit_process
from examples.devstack import BILLING_PORT, DEMO_SIGNERS, INBOX_URL, KEYS_DIR, STATE_DIR, TEMPORAL_PORT, UI_PORT
from tether.cli.output import script_path
from workflows.run_state import RunSnapshot
from workflows.states import TERMINAL, RunState

PLAYBOOK = "examples/billing/refund.playbook.json"
DEMO_TOOLS = "examples.billing.tools"  # the module its worker serves (worker.DEFAULT_TOOLS)
ROOT = Path(__file__).resolve().parent.parent
GOAL = "Refund order A-1001 (damaged on arrival)"
# Settings a pasted command needs when they differ from the defaults (another server, queue).
CONNECTION_ENV = ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TETHER_TASK_QUEUE")


def tether() -> str:
    """The installed `tether` script, as a path that works from the repository root."""
    return script_path()


def command(argv: list[str]) -> str:
    """``argv`` as a line that pastes into a shell: quoted, with the connection it needs."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in CONNECTION_ENV if os.environ.get(k)]
    return " ".join([*env, shlex.join([tether(), *argv])])


def step(title: str, argv: list[str], expect: int = 0) -> int:
    import contextlib

    print(f"\n$ {shlex.join([tether(), *argv])}", flush=True)
    # One stream, in order, as a terminal shows it; and the exit code, which is product.
    with contextlib.redirect_stderr(sys.stdout):
        code = starter.main(argv)
    if code:
        print(f"(exit code {code})", flush=True)
    if code != expect:
        raise SystemExit(f"demo step failed ({title}): exit code {code}, expected {expect}")
    return code


async def _wait(run_id: str, *, settled: bool, timeout: float) -> RunSnapshot:
    return await client.wait_settled(await client.connect(), run_id, timeout, approval_settles=settled)


def wait_for_end(run_id: str, timeout: float = 60.0) -> RunSnapshot:
    return asyncio.run(_wait(run_id, settled=False, timeout=timeout))


def wait_settled(run_id: str, timeout: float = 180.0) -> RunSnapshot:
    return asyncio.run(_wait(run_id, settled=True, timeout=timeout))


def reviewed(run_id: str) -> list[str]:
    """``--plan-hash`` and the pending plan's hash as `tether status` printed it: the decision is
    bound to the plan the demo showed (a plan changed since is refused as stale)."""
    pending = wait_settled(run_id).pending_approval
    if pending is None:
        raise SystemExit(f"run {run_id} is not waiting for an approval")
    return ["--plan-hash", pending.plan_hash[: client.HASH_PREFIX]]


def own_order() -> tuple[str, str]:
    """A new order (A-1001's customer and total) and a refund playbook for it, under
    .tether/demo/: the suggested run has its own order, with all of it left to refund."""
    import json

    order_id = f"A-{2000 + uuid.uuid4().int % 8000}"  # the tools' order id pattern: A-dddd
    fresh_order(order_id, like="A-1001")
    steps = Path(PLAYBOOK).read_text().replace("A-1001", order_id)
    json.loads(steps)  # still JSON
    folder = STATE_DIR / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"refund-{order_id}.playbook.json"
    path.write_text(steps)
    return order_id, os.path.relpath(path)


def next_steps(run_id: str) -> None:
    """The commands to try next, exactly as they paste (the demo's last words); each works as
    printed, in order (tests/tether/test_cli.py runs them all)."""
    order_id, playbook = own_order()
    new_run = f"refund-{order_id}-{uuid.uuid4().hex[:6]}"
    print("\nNext, try:")
    for argv in (
        ["status", run_id],
        ["timeline", run_id, "--all"],
        ["list", "--state", "COMPLETED", "--limit", "5"],
        ["tools"],
        ["start", "--goal", f"Refund order {order_id}", "--playbook", playbook, "--requested-by", "alice",
         "--id", new_run, "--wait"],
        ["approve", new_run, "--by", "bob"],
    ):
        print(f"  {command(argv)}")
    print(f"The last two start a run on an order of its own ({order_id}), which waits for approval, "
          "and approve it (it shows the plan and asks first).\n`make demo-order` makes another order and "
          "prints its playbook's path.")


MODEL_GOAL = (
    "Refund order A-1001 in full: it was damaged on arrival. Look the order up first, then "
    "refund its total, post the matching negative ledger entry, and email the customer."
)


def main_model() -> int:
    if not os.environ.get("TETHER_MODEL"):
        print("PLANNER=model needs TETHER_MODEL (and OPENAI_BASE_URL / OPENAI_API_KEY) in the "
              "environment of `make demo`, which starts the worker; see docs/model-planner.md. "
              "A worker started earlier without them keeps running: `make down` first.",
              file=sys.stderr)
        return 2
    fresh_order()
    run_id = f"refund-A-1001-{uuid.uuid4().hex[:6]}"
    print(f"== alice asks the refund agent (model {os.environ['TETHER_MODEL']}) to refund A-1001")
    step("start", ["start", "--goal", MODEL_GOAL, "--planner", "model", "--requested-by",
                   "alice", "--id", run_id, "--wait", "--wait-timeout", "180"])
    snap = wait_settled(run_id)
    approvals = 0
    while snap.state == RunState.AWAITING_APPROVAL and approvals < 5:
        approvals += 1
        print(f"\n== the model's plan writes: bob reviews it and approves exactly this plan "
              f"hash (approval {approvals})")
        step("status", ["status", run_id])
        step("approve", ["approve", run_id, "--by", "bob", *reviewed(run_id), "--comment", "checked the plan"])
        snap = wait_settled(run_id)
    print(f"\n== the run ended in {snap.state.value}" if snap.state in TERMINAL
          else f"\n== the run is {snap.state.value}")
    step("status", ["status", run_id])
    step("timeline", ["timeline", run_id])
    print(f"\nThis run: http://localhost:{UI_PORT}/namespaces/default/workflows/{run_id}\n"
          "The server, UI, billing service and worker keep running; `make down` stops them.")
    fresh_order()
    next_steps(run_id)
    return 0 if snap.state == RunState.COMPLETED else 1


def fresh_order(order_id: str = "A-1001", like: str | None = None) -> None:
    """The example order as seeded (or a new order like a seeded one), nothing refunded yet:
    refunds count against what is left, and every demo refunds it in full."""
    import json
    import urllib.request

    from examples.billing.db import SEED_ORDERS

    _, email, total, currency, _ = next(o for o in SEED_ORDERS if o[0] == (like or order_id))
    url = os.environ.get("BILLING_URL") or f"http://127.0.0.1:{BILLING_PORT}"
    body = json.dumps({"customer_email": email, "total_cents": total, "currency": currency}).encode()
    request = urllib.request.Request(f"{url}/admin/orders/{order_id}", data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10):
        pass


def signed_run() -> RunSnapshot:
    """Tenant `signed`: names are not enough, every step is signed with the demo's keys."""
    run_id = f"refund-signed-{uuid.uuid4().hex[:6]}"
    client.ensure_keys(KEYS_DIR, DEMO_SIGNERS)  # `devstack up` made them; a bare worker may not have
    fresh_order()
    keys = os.path.relpath(KEYS_DIR)
    print("\n== in tenant `signed` a name is only a claim: alice signs her request with her key")
    step("start signed", ["start", "--goal", GOAL, "--playbook", PLAYBOOK, "--tenant", "signed",
                          "--requested-by", "alice", "--key", f"{keys}/alice.pem", "--id", run_id, "--wait"])
    print("\n== bob approves without his key: refused (signature_required), exit code 1")
    step("unsigned approval", ["approve", run_id, "--by", "bob", *reviewed(run_id)], expect=1)
    print("\n== bob approves with his key: the signature covers this run, request and plan")
    step("signed approval", ["approve", run_id, "--by", "bob", *reviewed(run_id), "--key", f"{keys}/bob.pem"])
    return wait_for_end(run_id)


def main_order() -> int:
    """`make demo-order`: a new order to refund, and prints its playbook's path (for the
    README's examples: each refunds an order of its own)."""
    _, playbook = own_order()
    print(playbook)
    return 0


def playbook_tools() -> list[str]:
    """The tools the demo's playbook calls, in order."""
    import json

    def tools(steps: object) -> list[str]:
        found: list[str] = []
        for entry in steps if isinstance(steps, list) else []:
            if isinstance(entry, dict):
                found += [entry["tool"]] if isinstance(entry.get("tool"), str) else tools(entry.get("parallel"))
        return found

    return list(dict.fromkeys(tools(json.loads((ROOT / PLAYBOOK).read_text()))))


def worker_problem() -> str | None:
    """What to tell a person whose stack's worker does not serve the demo's tools (one started
    with their own, `devstack restart worker` with TETHER_TOOLS): `up` left it serving, and the
    demo's runs would wait for a worker that serves them. Judged from the live workers' own
    word (each lists its tools in its identity: tether/pollers.served_tools); None: they serve
    them, or it cannot be told (the demo then runs, and `tether status` says what a run waits for)."""
    from examples.devstack import stack_record
    from tether.pollers import served_tools

    async def ask() -> frozenset[str] | None:
        return await served_tools(await client.connect(), client.task_queue())

    try:
        served = asyncio.run(ask())
    except client.TetherError:
        return None  # the server is not there: the demo's first command says so, with what to do
    missing = [t for t in playbook_tools() if served and t not in served]
    if not missing:
        return None
    started_with = stack_record().get("worker_env") or {}
    python = os.path.relpath(sys.executable) if Path(sys.executable).is_relative_to(ROOT) else sys.executable
    unset = " ".join(f"-u {k}" for k in ("TETHER_TOOLS", "TETHER_POLICY", "TETHER_PLANNERS", "PYTHONPATH"))
    mine = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(started_with.items()))
    lines = [
        f"make demo: the worker serving task queue {client.task_queue()!r} serves other tools "
        f"({', '.join(sorted(served or ())) or 'none'}), not the demo's: it lacks {', '.join(missing)} "
        f"(module {DEMO_TOOLS}). Nothing was started: the demo's runs would wait for a worker that serves them.",
    ]
    if mine:
        lines.append(f"It was started with: {mine}")
    lines += [
        "To go back to the demo's worker (its tools and policy):",
        f"  env {unset} {shlex.quote(python)} -m examples.devstack restart worker",
    ]
    if "TETHER_POLICY" in started_with:
        lines.append(f"  env {unset} {shlex.quote(python)} -m examples.devstack restart inbox   (it reads your policy too)")
    lines.append("then `make demo` again (or `make down && make demo` for a fresh stack).")
    if mine:
        lines.append(f"To go back to yours afterwards: {mine} {shlex.quote(python)} -m examples.devstack restart worker")
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:] == ["order"]:
        return main_order()
    if "TEMPORAL_ADDRESS" not in os.environ and TEMPORAL_PORT != 7233:
        # A stack on its own ports (examples/devstack.py): the demo and its commands use it.
        os.environ["TEMPORAL_ADDRESS"] = f"127.0.0.1:{TEMPORAL_PORT}"
    problem = worker_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if os.environ.get("PLANNER", "playbook").strip() == "model":
        return main_model()
    fresh_order()
    run_id = f"refund-A-1001-{uuid.uuid4().hex[:6]}"
    print("== alice asks the refund agent to refund order A-1001")
    step("start", ["start", "--goal", GOAL,
                   "--playbook", PLAYBOOK, "--requested-by", "alice", "--id", run_id, "--wait"])
    print("\n== the plan writes (refund, ledger, email): the run waits for a human")
    step("list", ["list", "--state", "AWAITING_APPROVAL"])
    print("\n== alice tries to approve her own run: the policy (four-eyes) refuses, exit code 1")
    step("self-approval", ["approve", run_id, "--by", "alice", *reviewed(run_id)], expect=1)
    print("\n== bob reviews the plan and approves exactly this plan hash")
    step("approve", ["approve", run_id, "--by", "bob", *reviewed(run_id), "--comment", "checked the order"])
    snap = wait_for_end(run_id)
    print(f"\n== the run ended in {snap.state.value}")
    step("status", ["status", run_id])
    step("timeline", ["timeline", run_id])
    signed = signed_run()
    print(f"\n== the signed run ended in {signed.state.value}")
    waiting = waiting_for_the_inbox()
    print(
        f"\nWeb UI: http://localhost:{UI_PORT}/namespaces/default/workflows?query="
        "AgentRunState%3D%22AWAITING_APPROVAL%22  (runs waiting for approval)\n"
        f"This run: http://localhost:{UI_PORT}/namespaces/default/workflows/{run_id}\n"
        "The server, UI, billing service, worker and inbox keep running; `make down` stops them."
    )
    print(f"\nApprovers' inbox: {INBOX_URL}  — sign in as bob (dev sign-in) and approve {waiting}")
    next_steps(run_id)
    return 0 if snap.state == RunState.COMPLETED and signed.state == RunState.COMPLETED else 1


def waiting_for_the_inbox() -> str:
    """One more refund, left waiting: the one to approve from the browser (on an order of its
    own, so approving it later refunds what is there)."""
    order_id, playbook = own_order()
    run_id = f"refund-{order_id}-{uuid.uuid4().hex[:6]}"
    print(f"\n== one more refund (order {order_id}), left waiting for approval in the inbox")
    step("start for the inbox", ["start", "--goal", f"Refund order {order_id}", "--playbook", playbook,
                                 "--requested-by", "alice", "--id", run_id, "--wait"])
    return run_id


if __name__ == "__main__":
    exit_process(main())
