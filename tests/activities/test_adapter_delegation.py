"""Delegation from the agent adapters: a pydantic-ai ``Agent`` and an OpenAI Agents SDK ``Agent``,
each on its real library and the real ``openai`` client over real HTTP against the local fake
endpoint (examples/fake_openai.py), are offered the model planner's delegate step
(``tether_delegate``) and propose it; the run validates what they propose as any delegation (a
real dev server, the real billing service)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from temporalio.testing import WorkflowEnvironment

from tether.planners.planning import DELEGATE_DEFINITION, DELEGATE_FUNCTION, Planner, plan
from tether.policy.files import PolicyStore
from tether.tools.sdk import REGISTRY, load_tool_modules
from examples.fake_openai import FakeOpenAI, Recorded, call, text, tool_calls
from tests.helpers.billing import Billing
from tests.helpers.runs import make_request, running_worker, start_run
from tests.helpers.delegation import child_outcome
from tether.client import run_outcome
from workflows.contract import DELEGATE, ToolCatalog
from workflows.run_state import RunOutcome
from workflows.states import RunState, is_legal_path
from workflows.wire import PlannerInput

S = RunState
INSTRUCTIONS = "You answer questions about orders; hand lookups to a child run."


def pydantic_ai_planner(base_url: str) -> Planner:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from tether.planners.pydantic_agent import AgentPlanner

    client = AsyncOpenAI(base_url=base_url, api_key="no-key", max_retries=0)
    return AgentPlanner(Agent(OpenAIChatModel("fake", provider=OpenAIProvider(openai_client=client)), instructions=INSTRUCTIONS))


def agents_sdk_planner(base_url: str) -> Planner:
    from agents import Agent, OpenAIChatCompletionsModel

    from tether.planners.openai_agents import AgentsSDKPlanner

    client = AsyncOpenAI(base_url=base_url, api_key="no-key", max_retries=0)
    return AgentsSDKPlanner(Agent(name="orders", instructions=INSTRUCTIONS,
                                  model=OpenAIChatCompletionsModel(model="fake", openai_client=client)))


ADAPTERS: dict[str, Callable[[str], Planner]] = {"pydantic-ai": pydantic_ai_planner, "openai-agents": agents_sdk_planner}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with FakeOpenAI() as server:
        yield server


def offered(request: Recorded) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"] for t in request.tools}


def billing_catalog() -> ToolCatalog:
    return load_tool_modules(["examples.billing.tools"], REGISTRY).catalog()


def delegate(tools: list[str], max_steps: int, goal: str = "look up order A-1001") -> dict:
    return call(DELEGATE_FUNCTION, {"goal": goal, "tools": tools, "max_steps": max_steps})


async def agent_run(env: WorkflowEnvironment, fake: FakeOpenAI, adapter: str, *, max_depth: int | None = None,
                    tmp_path: Path | None = None, **request: Any) -> tuple[RunOutcome, RunOutcome | None]:
    """A run the adapter plans against the fake endpoint, to its end, and its child's outcome
    (None: it delegated nothing); under a policy that sets ``max_depth`` when one is given."""
    options: dict[str, Any] = {"planners": {"agent": ADAPTERS[adapter](fake.base_url)}}
    if max_depth is not None:
        policy = (tmp_path or Path()) / "policy.toml"
        policy.write_text(f"[tenants.default]\n[tenants.default.budgets]\nmax_depth = {max_depth}\n")
        options["policy"] = PolicyStore(policy)
    async with running_worker(env.client, **options) as worker:  # a query needs a worker, even of a closed run
        parent = await run_outcome(await start_run(env.client, worker, make_request([], planner="agent", **request)))
        delegated = any(s.tool == DELEGATE for s in parent.steps)
        return parent, (await child_outcome(env, parent))[1] if delegated else None


def told(request: Recorded) -> list[str]:
    """What the runtime told the agent in this model call (its notes arrive as user messages)."""
    return [m["content"] for m in request.messages if m["role"] == "user" and isinstance(m.get("content"), str)]


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_each_adapter_offers_the_delegate_step_when_the_catalog_has_it(fake: FakeOpenAI, adapter: str) -> None:
    planner = ADAPTERS[adapter](fake.base_url)
    request = PlannerInput(goal="How much was order A-1001?", planner="agent", playbook=[], executed=[])
    catalog = billing_catalog()
    fake.script(text("49.99 EUR."), text("49.99 EUR."))
    # Through the plan activity's boundary: the worker's tools and the delegate step.
    assert (await plan(request, catalog, {"agent": planner})).answer == "49.99 EUR."
    # Given a catalog without it (a run that may not delegate), the agent is not offered it.
    assert catalog.get(DELEGATE) is None
    assert (await planner.propose(request, catalog)).answer == "49.99 EUR."
    with_it, without = (offered(r) for r in fake.completions)
    tools = {t.name for t in catalog.tools}
    assert set(with_it) == tools | {DELEGATE_FUNCTION} and set(without) == tools
    # The model planner's definition, not a second one: same name, same argument schema.
    assert with_it[DELEGATE_FUNCTION]["parameters"] == DELEGATE_DEFINITION["function"]["parameters"]
    assert with_it[DELEGATE_FUNCTION]["description"] == DELEGATE_DEFINITION["function"]["description"]


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_an_adapter_planned_run_delegates_a_lookup_to_a_child(
    dev_env: WorkflowEnvironment, billing: Billing, fake: FakeOpenAI, adapter: str
) -> None:
    fake.script(
        tool_calls(delegate(["get_order"], 2)),  # the parent's plan: the delegate step
        tool_calls(call("get_order", {"order_id": "A-1001"})),  # the child's plan, by the same agent
        text("A-1001 totals 49.99 EUR."),  # the child's answer
        text("Order A-1001 totals 49.99 EUR."),  # the parent's
    )
    refunds_before = len(billing.refunds())
    parent, child = await agent_run(dev_env, fake, adapter, goal="How much was order A-1001?")
    assert child is not None
    assert parent.state == S.COMPLETED and is_legal_path(parent.timeline), parent.timeline[-1].reason
    assert [s.tool for s in parent.steps] == [DELEGATE] and parent.answer == "Order A-1001 totals 49.99 EUR."
    assert child.state == S.COMPLETED and is_legal_path(child.timeline)
    assert [s.tool for s in child.steps] == ["get_order"] and child.answer == "A-1001 totals 49.99 EUR."
    assert len(billing.refunds()) == refunds_before
    # Nobody approved anything: the delegation and the lookup are read-only.
    assert S.AWAITING_APPROVAL not in {r.to_state for r in parent.timeline + child.timeline}
    # The parent's next model call shows the delegation as the agent called it, with the child's outcome.
    last = fake.completions[3].messages
    [called] = [c for m in last if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert called["function"]["name"] == DELEGATE_FUNCTION and called["id"] == parent.steps[0].tool_call_id
    assert json.loads(called["function"]["arguments"]) == {"goal": "look up order A-1001", "tools": ["get_order"], "max_steps": 2}
    [result] = [m for m in last if m["role"] == "tool"]
    assert json.loads(result["content"]) == {"child": child.run_id, "state": "COMPLETED", "answer": child.answer}


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_a_delegation_beyond_the_parents_grant_is_refused_with_nothing_run(
    dev_env: WorkflowEnvironment, billing: Billing, fake: FakeOpenAI, adapter: str
) -> None:
    fake.script(
        tool_calls(delegate(["get_order", "wire_money"], 2)),  # a tool the parent does not have
        tool_calls(delegate(["get_order"], 50)),  # more steps than the parent has left (4)
        tool_calls(delegate(["get_order"], 2)),  # within the parent's: the child starts
        tool_calls(delegate(["issue_refund"], 1, goal="refund A-1001")),  # the child: outside its grant
        text("I may only look orders up."),  # the child's answer
        text("The child could not refund."),  # the parent's
    )
    refunds_before = len(billing.refunds())
    parent, child = await agent_run(dev_env, fake, adapter, goal="Refund order A-1001", limits={"max_steps": 4})
    assert child is not None
    refused = [r.reason for r in parent.timeline if r.to_state == S.VALIDATION_FAILED]
    assert len(refused) == 2 and "delegation names 'wire_money', not a tool this run has" in refused[0]
    assert "delegation of 50 steps, over the 4 this run has left" in refused[1]
    [child_refused] = [r.reason for r in child.timeline if r.to_state == S.VALIDATION_FAILED]
    assert "delegation names a tool it cannot give" in child_refused and "'issue_refund'" in child_refused
    # Nothing ran but the one child the valid delegation started; it ran nothing and wrote nothing.
    assert [s.tool for s in parent.steps] == [DELEGATE] and child.steps == []
    assert parent.state == S.COMPLETED and child.state == S.COMPLETED and is_legal_path(parent.timeline)
    assert len(billing.refunds()) == refunds_before
    # Each refusal reached the agent in the runtime's words, in its next model call.
    notes = [told(fake.completions[n]) for n in (1, 2, 4)]
    assert all(any(t.startswith("The runtime refused your last proposal") for t in n) for n in notes)
    assert any("wire_money" in t for t in notes[0]) and any("issue_refund" in t for t in notes[2])


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_a_run_that_may_not_delegate_is_not_offered_the_delegate_step(
    dev_env: WorkflowEnvironment, billing: Billing, fake: FakeOpenAI, adapter: str, tmp_path: Path
) -> None:
    fake.script(text("49.99 EUR."))
    outcome, _ = await agent_run(dev_env, fake, adapter, max_depth=0, tmp_path=tmp_path)
    assert outcome.state == S.COMPLETED
    assert DELEGATE_FUNCTION not in offered(fake.completions[0])


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_a_child_at_the_depth_limit_is_not_offered_the_delegate_step(
    dev_env: WorkflowEnvironment, billing: Billing, fake: FakeOpenAI, adapter: str, tmp_path: Path
) -> None:
    fake.script(tool_calls(delegate(["get_order"], 2)), text("I looked nothing up."), text("Nothing to do."))
    parent, child = await agent_run(dev_env, fake, adapter, max_depth=1, tmp_path=tmp_path)
    assert parent.state == S.COMPLETED and child is not None and child.state == S.COMPLETED
    parents_first, childs_first, parents_next = (offered(r) for r in fake.completions)
    assert DELEGATE_FUNCTION in parents_first and DELEGATE_FUNCTION in parents_next
    assert DELEGATE_FUNCTION not in childs_first and "get_order" in childs_first
