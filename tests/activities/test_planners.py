"""Planners of your own: a pydantic-ai ``Agent`` (its ``FunctionModel``, offline) plans a
governed run on a real dev server with the real billing service; the planner registry a worker
is configured with; tools and planners load the same way in the worker and the ``tether``
command (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from temporalio.testing import WorkflowEnvironment

from tether.loading import LoadError
from tether.planners.pydantic_agent import AgentPlanner
from tether.planners.planning import BUILTIN_PLANNERS, load_planners
from tether.policy.files import PolicyStore
from tether.client import run_outcome
from examples.agents.refund_agent import refund_model
from tests.helpers.billing import Billing
from tests.helpers.runs import approval_for, make_request, running_worker, start_run
from tests.helpers.waiting import wait_for_state
from workflows.run_state import RunOutcome
from workflows.states import RunState, is_legal_path

ROOT = Path(__file__).resolve().parents[2]
S = RunState


class RecordingAgent:
    """The example's scripted model, with what each of its model calls was shown."""

    def __init__(self) -> None:
        self.seen: list[list[ModelMessage]] = []
        self.tools: list[list[str]] = []

        def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            self.seen.append(list(messages))
            self.tools.append([t.name for t in info.function_tools])
            return refund_model(messages, info)

        self.planner = AgentPlanner(Agent(FunctionModel(model), instructions="You refund orders."))


def refunds_of(billing: Billing, outcome: RunOutcome) -> list[dict]:
    keys = {r.refs.idempotency_key for r in outcome.timeline if r.refs.idempotency_key}
    return [r for key in keys for r in billing.refunds(key)]


async def test_a_pydantic_ai_agent_plans_a_governed_run(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    agent = RecordingAgent()
    before = a1001_refunds(billing)
    async with running_worker(dev_env.client, planners={**BUILTIN_PLANNERS, "refunds": agent.planner}) as worker:
        handle = await start_run(dev_env.client, worker, make_request([], planner="refunds"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL", timeout=60)
        # The lookup ran without approval; the refund the agent asked for next waits for one.
        assert [s.tool for s in snap.plan.steps] == ["issue_refund"] and snap.step == 1
        assert snap.plan.steps[0].args["amount_cents"] == 4999
        assert a1001_refunds(billing) == before and len(agent.seen) == 2
        await handle.signal("approve", approval_for(snap, "bob"))
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED and is_legal_path(outcome.timeline)
    assert [s.tool for s in outcome.steps] == ["get_order", "issue_refund"]
    [refund] = refunds_of(billing, outcome)
    assert refund["amount_cents"] == 4999 and refund["order_id"] == "A-1001"
    # The agent's final answer is the run's answer, built from the refund's result.
    assert outcome.answer == f"Refunded 49.99 on order A-1001 (refund {refund['refund_id']})."
    # Three model calls, each offered the worker's tools; each saw the executed steps as its own
    # tool calls with their results, under the run's tool call ids.
    assert len(agent.seen) == 3 and all("issue_refund" in tools for tools in agent.tools)
    returns = [p for p in (part for m in agent.seen[-1] for part in m.parts) if isinstance(p, ToolReturnPart)]
    assert [(p.tool_name, p.tool_call_id) for p in returns] == [(s.tool, s.tool_call_id) for s in outcome.steps]
    assert '"total_cents": 4999' in returns[0].content


def a1001_refunds(billing: Billing) -> int:
    return sum(1 for r in billing.refunds() if r["order_id"] == "A-1001")


async def test_a_withdrawn_tool_is_refused_to_the_agent_and_nothing_is_written(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(textwrap.dedent("""\
        [tenants.default]
        tools = ["get_order"]            # the refund tool is withdrawn
        [tenants.default.approvers]
        bob = { roles = ["approver"] }
    """))
    agent = RecordingAgent()
    async with running_worker(dev_env.client, policy=PolicyStore(policy), planners={"refunds": agent.planner}) as worker:
        handle = await start_run(dev_env.client, worker, make_request([], planner="refunds"))
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED and is_legal_path(outcome.timeline), outcome.timeline[-1].reason
    assert [s.tool for s in outcome.steps] == ["get_order"]
    assert refunds_of(billing, outcome) == []
    refused = [r for r in outcome.timeline if r.to_state == S.VALIDATION_FAILED]
    assert refused and "issue_refund" in refused[0].reason
    # The agent was told, in its conversation, and its answer says so.
    told = [p.content for m in agent.seen[-1] for p in m.parts if isinstance(p, UserPromptPart)]
    assert any(str(t).startswith("The runtime refused your last proposal") and "issue_refund" in str(t) for t in told)
    assert outcome.answer.startswith("I could not refund: refused")


async def test_a_run_naming_a_planner_the_worker_lacks_fails_naming_the_choices(
    dev_env: WorkflowEnvironment, billing: Billing
) -> None:
    async with running_worker(dev_env.client) as worker:
        outcome = await run_outcome(await start_run(dev_env.client, worker, make_request([], planner="nobody")))
    assert outcome.state == S.FAILED
    reason = outcome.timeline[-1].reason
    assert "unknown planner 'nobody'" in reason and "model, playbook" in reason and "--planner" in reason


def test_planners_load_from_configuration_or_say_what_is_wrong() -> None:
    loaded = load_planners(["refunds=examples.agents.refund_agent:planner", " "])
    assert set(loaded) == {"playbook", "model", "refunds"} and isinstance(loaded["refunds"], AgentPlanner)
    # A factory is called once, at load.
    assert isinstance(load_planners(["mine=tests.activities.test_planners:make_planner"])["mine"], AgentPlanner)
    cases = {
        "refunds": "not NAME=MODULE:ATTR",
        "Refunds=examples.agents.refund_agent:planner": "not NAME=MODULE:ATTR",
        "refunds=examples.agents.refund_agent": "is not MODULE:ATTR",
        "refunds=no_such_module_xyz:planner": "no planner 'refunds' 'no_such_module_xyz'",
        "refunds=examples.agents.refund_agent:nothing": "has no 'nothing'",
        "refunds=examples.agents.refund_agent:ORDER": "neither a planner",
        "model=examples.agents.refund_agent:planner": "configured twice (or is built in)",
        "refunds=tests.activities.test_planners:broken_factory": "broken_factory() failed: RuntimeError: no key",
    }
    for spec, expected in cases.items():
        with pytest.raises(LoadError, match=None) as caught:
            load_planners([spec])
        assert expected in str(caught.value), (spec, str(caught.value))
    with pytest.raises(LoadError, match="configured twice"):
        load_planners(["a=examples.agents.refund_agent:planner", "a=examples.agents.refund_agent:planner"])


def make_planner() -> AgentPlanner:
    return RecordingAgent().planner


def broken_factory() -> AgentPlanner:
    raise RuntimeError("no key")


# ----------------------------------------------------------------------------- one way to load


def tether(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TETHER_TOOLS", "PYTHONPATH")}
    return subprocess.run([str(Path(sys.executable).parent / "tether"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_tether_tools_names_a_missing_module_in_one_line(tmp_path: Path) -> None:
    result = tether("tools", "--tools", "no_such_module", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert "no_such_module" in line and "tool module" in line


def test_tether_tools_lists_a_module_from_the_current_directory_as_the_worker_does(tmp_path: Path) -> None:
    (tmp_path / "my_tools.py").write_text(textwrap.dedent('''\
        from pydantic import BaseModel
        from tether.tools.sdk import ToolContext, tool

        class Ref(BaseModel):
            parcel_id: str

        @tool(effect="read_only")
        def track_parcel(args: Ref, ctx: ToolContext) -> dict:
            """Where a parcel is."""
            return {}
    '''))
    result = tether("tools", "--tools", "my_tools", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "track_parcel" in result.stdout and "read_only" in result.stdout
    # A module that fails on import is named with its error, in one line.
    (tmp_path / "broken_tools.py").write_text("import no_such_dependency_xyz\n")
    result = tether("tools", "--tools", "broken_tools", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert "broken_tools" in line and "no_such_dependency_xyz" in line
    # The worker resolves the same modules the same way, and refuses a bad planner in one line,
    # before it connects to anything.
    worker = subprocess.run(
        [sys.executable, str(ROOT / "worker.py"), "--tools", "my_tools", "--planner", "x=my_tools:track_parcel"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TETHER_PLANNERS"},
    )
    assert worker.returncode == 1
    assert worker.stderr.strip().splitlines()[-1].startswith("planner 'x': my_tools:track_parcel")


def test_tool_declaration_mistakes_name_the_four_effects_and_a_module_without_tools_is_refused(tmp_path: Path) -> None:
    """Issue 58: `@tool` mistakes gave raw Python errors that did not list the effects, and a
    module with no tools listed an empty table with exit 0. Each is one line now, exit 2, and
    the worker refuses the same module the same way."""
    header = "from pydantic import BaseModel\nfrom tether import ToolContext, ToolEffect, tool\n\n\nclass A(BaseModel):\n    x: str\n\n\n"
    mistakes = {
        "no_parens": "@tool\ndef f(args: A, ctx: ToolContext) -> dict:\n    return {}\n",
        "no_effect": "@tool()\ndef f(args: A, ctx: ToolContext) -> dict:\n    return {}\n",
        "bad_effect": "@tool(effect='write')\ndef f(args: A, ctx: ToolContext) -> dict:\n    return {}\n",
    }
    for name, body in mistakes.items():
        (tmp_path / f"{name}.py").write_text(header + body)
        result = tether("tools", "--tools", name, cwd=tmp_path)
        assert result.returncode == 2 and result.stdout == "", (name, result)
        [line] = result.stderr.splitlines()
        assert name in line and all(e in line for e in ("READ_ONLY", "IDEMPOTENT", "RECONCILABLE", "UNSAFE")), line
    (tmp_path / "helpers_only.py").write_text(header + "def f(args: A) -> dict:\n    return {}\n")
    result = tether("tools", "--tools", "helpers_only", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == "", result
    [line] = result.stderr.splitlines()
    assert "tool module 'helpers_only' declares no tool" in line and "@tool(effect=" in line, line
    worker = subprocess.run([sys.executable, str(ROOT / "worker.py"), "--tools", "helpers_only"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode == 1 and "declares no tool" in worker.stderr.strip().splitlines()[-1], worker.stderr


async def test_a_planner_of_plain_code_runs_governed(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    planners = load_planners(["desk=examples.agents.order_desk:OrderDesk"])
    async with running_worker(dev_env.client, planners=planners) as worker:
        request = make_request([], planner="desk", goal="How much were orders A-1001 and A-1003?")
        outcome = await run_outcome(await start_run(dev_env.client, worker, request))
    assert outcome.state == S.COMPLETED and is_legal_path(outcome.timeline), outcome.timeline[-1].reason
    assert [s.tool for s in outcome.steps] == ["get_order", "get_order"]  # one plan, no approval
    assert outcome.answer == "A-1001: 49.99 EUR; A-1003: 8.99 EUR"


async def test_the_fake_openai_endpoint_runs_the_model_planner_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tether.planners.planning import ModelPlanner
    from tether.tools.sdk import REGISTRY, load_tool_modules
    from temporalio.exceptions import ApplicationError
    from workflows.wire import PlannerInput

    server = subprocess.Popen(
        [sys.executable, "-m", "examples.fake_openai", "--port", "0", "--script", "examples/agents/refund.model-script.json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = server.stdout.readline()  # printed once it listens
        url = line.split("OPENAI_BASE_URL=")[1].split()[0]
        monkeypatch.setenv("OPENAI_BASE_URL", url)
        monkeypatch.setenv("TETHER_MODEL", "fake")
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        catalog = load_tool_modules(["examples.billing.tools"], REGISTRY).catalog()
        request = PlannerInput(goal="Refund order A-1001", planner="model", playbook=[], executed=[])
        first = await ModelPlanner().propose(request, catalog)
        assert [(s.tool, json.loads(s.args)["order_id"]) for s in first.steps] == [("get_order", "A-1001"), ("issue_refund", "A-1001")]
        assert (await ModelPlanner().propose(request, catalog)).answer == "Refunded 49.99 EUR on order A-1001."
        with pytest.raises(ApplicationError, match="no scripted response left"):
            await ModelPlanner().propose(request, catalog)
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
    bad = tmp_path / "script.json"
    bad.write_text('[{"text": "ok"}, {"say": "what"}]')
    result = subprocess.run([sys.executable, "-m", "examples.fake_openai", "--port", "0", "--script", str(bad)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert "reply 2" in line


# ----------------------------------------------------------------------------- OpenAI Agents SDK


def agents_sdk_refunder(seen: list[list]) -> "AgentsSDKPlanner":
    """An Agents SDK agent on its ScriptedModel: get_order, then a refund of the total, then an
    answer; told the runtime refused, it answers so."""
    from agents import Agent as SDKAgent
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from tether.planners.openai_agents import AgentsSDKPlanner

    def respond(call):
        items = [i for i in call.input if isinstance(i, dict)]
        seen.append(items)
        said = [i["content"] for i in items if i.get("role") == "user" and isinstance(i.get("content"), str)]
        if any(s.startswith("The runtime refused") for s in said):
            return [assistant_message(f"I could not refund: refused ({said[-1].splitlines()[0]})")]
        results = {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}
        calls = {i["name"]: i["call_id"] for i in items if i.get("type") == "function_call"}
        if "issue_refund" in calls:
            refund = json.loads(results[calls["issue_refund"]])
            return [assistant_message(f"Refunded {refund['amount_cents'] / 100:.2f} ({refund['refund_id']}).")]
        if "get_order" in calls:
            order = json.loads(results[calls["get_order"]])
            return [function_call("issue_refund", {"order_id": order["id"], "amount_cents": order["total_cents"],
                                                   "reason": "damaged"}, call_id="model-2")]
        return [function_call("get_order", {"order_id": "A-1001"}, call_id="model-1")]

    model = ScriptedModel([ModelStep.respond(respond) for _ in range(5)])
    return AgentsSDKPlanner(SDKAgent(name="refunds", instructions="You refund orders.", model=model))


async def test_an_openai_agents_sdk_agent_plans_a_governed_run(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    seen: list[list] = []
    before = a1001_refunds(billing)
    async with running_worker(dev_env.client, planners={"refunds": agents_sdk_refunder(seen)}) as worker:
        handle = await start_run(dev_env.client, worker, make_request([], planner="refunds"))
        snap = await wait_for_state(handle, "AWAITING_APPROVAL", timeout=60)
        assert [s.tool for s in snap.plan.steps] == ["issue_refund"] and a1001_refunds(billing) == before
        await handle.signal("approve", approval_for(snap, "bob"))
        outcome = await run_outcome(handle)
    assert outcome.state == S.COMPLETED and is_legal_path(outcome.timeline)
    [refund] = refunds_of(billing, outcome)
    assert refund["amount_cents"] == 4999
    assert outcome.answer == f"Refunded 49.99 ({refund['refund_id']})."
    # The last model call saw both steps as its function calls with their outputs, by call id.
    outputs = [i["call_id"] for i in seen[-1] if i.get("type") == "function_call_output"]
    assert outputs == [s.tool_call_id for s in outcome.steps]


async def test_a_withdrawn_tool_is_refused_to_the_agents_sdk_agent(
    dev_env: WorkflowEnvironment, billing: Billing, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text('[tenants.default]\ntools = ["get_order"]\n[tenants.default.approvers]\nbob = { roles = ["approver"] }\n')
    seen: list[list] = []
    async with running_worker(dev_env.client, policy=PolicyStore(policy), planners={"refunds": agents_sdk_refunder(seen)}) as worker:
        outcome = await run_outcome(await start_run(dev_env.client, worker, make_request([], planner="refunds")))
    assert outcome.state == S.COMPLETED and [s.tool for s in outcome.steps] == ["get_order"]
    assert refunds_of(billing, outcome) == []
    assert outcome.answer.startswith("I could not refund: refused") and "issue_refund" in outcome.answer


async def test_what_a_planner_returns_or_raises_is_checked_at_the_activity_boundary() -> None:
    from temporalio.exceptions import ApplicationError

    from tether.planners.planning import PlannerError, plan
    from workflows.contract import ToolCatalog
    from workflows.wire import PlannerInput, Proposal

    class Returns:
        def __init__(self, value: object) -> None:
            self.value = value

        async def propose(self, request: PlannerInput, catalog: ToolCatalog) -> object:
            if isinstance(self.value, Exception):
                raise self.value
            return self.value

    request = PlannerInput(goal="g", planner="p", playbook=[], executed=[])
    # Not a Proposal (a dict that looks like one): refused, not retried.
    with pytest.raises(ApplicationError, match="returned dict, not a Proposal") as caught:
        await plan(request, ToolCatalog(), {"p": Returns({"answer": "done"})})
    assert caught.value.non_retryable
    # A PlannerError fails the run with its message; any other error is retried by the activity.
    with pytest.raises(ApplicationError, match="no key configured") as caught:
        await plan(request, ToolCatalog(), {"p": Returns(PlannerError("no key configured"))})
    assert caught.value.non_retryable and caught.value.type == "planner_error"
    with pytest.raises(ConnectionError):
        await plan(request, ToolCatalog(), {"p": Returns(ConnectionError("model down"))})
    # A huge answer enters history only as its size and digest.
    huge = await plan(request, ToolCatalog(), {"p": Returns(Proposal(answer="x" * 1_000_000))})
    assert huge.answer is None and huge.oversized_bytes > 1_000_000


async def test_one_agent_plans_concurrent_runs_without_crossing_them(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    # The planner keeps nothing between calls: each call's conversation is its own run's.
    agent = RecordingAgent()
    async with running_worker(dev_env.client, planners={"refunds": agent.planner}) as worker:
        handles = [await start_run(dev_env.client, worker, make_request([], planner="refunds", goal=f"Refund order {o}"))
                   for o in ("A-1001", "A-1003")]
        waiting = [await wait_for_state(h, "AWAITING_APPROVAL", timeout=60) for h in handles]
        assert [s.plan.steps[0].args["order_id"] for s in waiting] == ["A-1001", "A-1003"]
        for handle, snap in zip(handles, waiting):
            await handle.signal("approve", approval_for(snap, "bob"))
        outcomes = [await run_outcome(h) for h in handles]
    refunds = [refunds_of(billing, o) for o in outcomes]
    assert [[(r["order_id"], r["amount_cents"]) for r in rs] for rs in refunds] == [[("A-1001", 4999)], [("A-1003", 899)]]
    assert [o.answer for o in outcomes] == [
        f"Refunded 49.99 on order A-1001 (refund {refunds[0][0]['refund_id']}).",
        f"Refunded 8.99 on order A-1003 (refund {refunds[1][0]['refund_id']}).",
    ]


async def test_the_agents_sdk_example_module_plans_every_run_its_worker_takes(dev_env: WorkflowEnvironment, billing: Billing) -> None:
    """Issue 58: the SDK's ScriptedModel plays a fixed list of replies, so a worker planned one
    run with it and refused the next. The example module's model answers from each call's input:
    one worker plans run after run (two at once here), each approved and its order refunded once."""
    from examples.agents.sdk_refund_agent import planner

    async with running_worker(dev_env.client, planners={"sdk_refunds": planner}) as worker:
        handles = [await start_run(dev_env.client, worker, make_request([], planner="sdk_refunds", goal=f"Refund order {order}"))
                   for order in ("A-1001", "A-1002")]
        for handle in handles:
            snap = await wait_for_state(handle, "AWAITING_APPROVAL", timeout=60)
            assert [s.tool for s in snap.plan.steps] == ["issue_refund"], snap.plan
            await handle.signal("approve", approval_for(snap, "bob"))
        outcomes = [await run_outcome(h) for h in handles]
        # And a third, after those: the model has not run out.
        third = await start_run(dev_env.client, worker, make_request([], planner="sdk_refunds", goal="Refund order A-1003"))
        snap = await wait_for_state(third, "AWAITING_APPROVAL", timeout=60)
        await third.signal("approve", approval_for(snap, "bob"))
        outcomes.append(await run_outcome(third))
    for order, outcome in zip(("A-1001", "A-1002", "A-1003"), outcomes):
        assert outcome.state == S.COMPLETED, outcome
        [refund] = refunds_of(billing, outcome)
        assert refund["order_id"] == order, refund
        assert outcome.answer == f"Refunded {refund['amount_cents'] / 100:.2f} on order {order} (refund {refund['refund_id']})."
