"""The peer: pydantic-ai's Temporal integration doing the same work as the bench's runs.

Two agents on ``TemporalDurability`` (the capability pydantic-ai-slim 2.68 documents; its
``TemporalAgent`` wrapper is deprecated), each in a ``PydanticAIWorkflow``, driven by a
deterministic ``FunctionModel`` that calls the same ``bench_read`` tool the Tether runs call:

- ``PeerPlanWorkflow``: one model request plans every call, then one request finishes
  (Tether's structure: 2 planner calls, M tools);
- ``PeerStepWorkflow``: one model request per tool call, then one that finishes (M + 1).

Model requests and tool calls are activities (pydantic-ai's own); the tools run one at a time
in order, as Tether's and the bare loop's steps do (``PeerInput.parallel`` lets pydantic-ai run
a plan's calls concurrently, its default outside this benchmark). Served by
``bench.worker_proc --peer`` on its own task queue, with ``PydanticAIPlugin`` on the client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    from pydantic_ai import Agent
    from pydantic_ai.durable_exec.temporal import PydanticAIWorkflow, TemporalDurability
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from tether.tools.sdk import ToolContext
    from bench.tool_bodies import KeyArgs, read_value


@dataclass
class PeerInput:
    steps: int
    parallel: bool = False


def _steps(messages: list[ModelMessage]) -> int:
    """The step count the prompt names (``... steps=N``)."""
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                found = re.search(r"steps=(\d+)", str(getattr(part, "content", "")))
                if found:
                    return int(found.group(1))
    raise ValueError("the prompt names no steps=N")


def _done(messages: list[ModelMessage]) -> int:
    return sum(
        isinstance(part, ToolReturnPart)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
    )


def _call(i: int) -> ToolCallPart:
    return ToolCallPart("bench_read", {"key": f"k{i}"}, tool_call_id=f"tc-{i + 1:03d}")


def plan_all(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """First request: every call at once; the next one: the answer."""
    steps, done = _steps(messages), _done(messages)
    if done == 0:
        return ModelResponse(parts=[_call(i) for i in range(steps)])
    return ModelResponse(parts=[TextPart(f"Done ({done} step(s))")])


def one_per_call(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """One call per request, then the answer."""
    steps, done = _steps(messages), _done(messages)
    if done < steps:
        return ModelResponse(parts=[_call(done)])
    return ModelResponse(parts=[TextPart(f"Done ({done} step(s))")])


async def bench_read(key: str) -> dict:
    """Read a value (no side effect): the bench tool Tether's runs call, with the same context."""
    info = activity.info()
    tool_call_id = f"{info.activity_id}"
    ctx = ToolContext(
        run_id=info.workflow_id, tenant="peer", tool_call_id=tool_call_id,
        idempotency_key=f"{info.workflow_id}:{tool_call_id}", attempt=info.attempt,
    )
    return await read_value(KeyArgs(key=key), ctx)


PLAN_AGENT = Agent(
    FunctionModel(plan_all), name="peer_plan", tools=[bench_read], capabilities=[TemporalDurability()]
)
STEP_AGENT = Agent(
    FunctionModel(one_per_call), name="peer_step", tools=[bench_read], capabilities=[TemporalDurability()]
)


async def _run(agent: Agent, peer: PeerInput) -> str:
    with Agent.parallel_tool_call_execution_mode("parallel" if peer.parallel else "sequential"):
        result = await agent.run(f"benchmark steps={peer.steps}")
    return str(result.output)


@workflow.defn(name="PeerPlanWorkflow")
class PeerPlanWorkflow(PydanticAIWorkflow):
    __pydantic_ai_agents__ = [PLAN_AGENT]

    @workflow.run
    async def run(self, peer: PeerInput) -> str:
        return await _run(PLAN_AGENT, peer)


@workflow.defn(name="PeerStepWorkflow")
class PeerStepWorkflow(PydanticAIWorkflow):
    __pydantic_ai_agents__ = [STEP_AGENT]

    @workflow.run
    async def run(self, peer: PeerInput) -> str:
        return await _run(STEP_AGENT, peer)


PEER_WORKFLOWS = [PeerPlanWorkflow, PeerStepWorkflow]
