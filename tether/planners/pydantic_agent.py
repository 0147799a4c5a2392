"""A pydantic-ai ``Agent`` as a Tether planner.

    from pydantic_ai import Agent
    from tether.planners.pydantic_agent import AgentPlanner

    agent = Agent("openai:gpt-4.1-mini", instructions="You handle refunds for the billing team.")
    planner = AgentPlanner(agent)          # worker.py --planner refunds=mymodule:planner

The agent keeps its model, instructions and settings. Tether's tools are offered to it as
*external* tools (pydantic-ai's ``ExternalToolset``): when the model calls them, the agent run
stops with ``DeferredToolRequests`` instead of running anything, and those calls are the
proposal (a call of ``tether_delegate``, the model planner's delegate step, is the plan's
delegate step: a child run planned by the same agent). The workflow validates it, gets it
approved and executes each step as an activity; on the next planning call the executed steps
come back into the agent's message history as its own tool calls (``ToolCallPart``) with their
results (``ToolReturnPart``), and what the runtime refused or a person left out as a note (the
same words the model planner uses). A text answer without tool calls is the run's answer.

Each ``propose`` is one agent run inside the ``plan`` activity: its model calls happen there,
retried by the activity's retry policy. Tools registered on the agent itself would run inside
that activity too, ungoverned: give it none, or only ones without effects.
"""

from __future__ import annotations

from typing import Any

from tether.planners import planning
from workflows.contract import ToolCatalog
from workflows.wire import PlannerInput, Proposal

try:
    from pydantic_ai import Agent, AgentRunResult, DeferredToolRequests
    from pydantic_ai.exceptions import UserError
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.tools import ToolDefinition
    from pydantic_ai.toolsets import ExternalToolset
except ImportError as e:  # pragma: no cover - the dev extra installs it
    raise ImportError(f"the pydantic-ai planner needs pydantic-ai: pip install pydantic-ai-slim ({e})") from None


def external_tools(catalog: ToolCatalog) -> ExternalToolset:
    """The catalog as tools the agent may call but never runs: name, description with the
    effect class and whether it needs approval, and the JSON schema of the arguments; the
    delegate step, when the catalog has it, as the model planner offers it (``tether_delegate``)."""
    return ExternalToolset(
        [
            ToolDefinition(
                name=d["function"]["name"],
                description=d["function"]["description"],
                parameters_json_schema=d["function"]["parameters"],
            )
            for d in planning.tool_definitions(catalog)
        ],
        id="tether",
    )


def message_history(request: PlannerInput) -> list[ModelMessage]:
    """The run so far as the agent's conversation: the goal, each executed step as the agent's
    tool call with its (bounded) result, and the runtime's notes. Ends with a request, so the
    agent's next model call answers it."""
    first: list[Any] = [UserPromptPart(f"Goal: {request.goal}")]
    messages: list[ModelMessage] = []
    pending = first
    for step in planning.bound_observations(request.executed):
        messages.append(ModelRequest(parts=pending))
        name = planning.function_name(step.tool)
        messages.append(ModelResponse(parts=[ToolCallPart(name, dict(step.args), tool_call_id=step.tool_call_id)]))
        pending = [ToolReturnPart(name, planning.observation_text(step), tool_call_id=step.tool_call_id)]
    pending.extend(UserPromptPart(note) for note in planning.runtime_notes(request))
    messages.append(ModelRequest(parts=pending))
    return messages


class AgentPlanner:
    """A pydantic-ai ``Agent`` as a planner (see the module's docstring)."""

    def __init__(self, agent: Agent[Any, Any]) -> None:
        if not isinstance(agent, Agent):
            raise TypeError(f"AgentPlanner takes a pydantic_ai.Agent, not {type(agent).__name__}")
        self.agent = agent

    async def propose(self, request: PlannerInput, catalog: ToolCatalog) -> Proposal:
        history = message_history(request)
        try:
            result: AgentRunResult[str | DeferredToolRequests] = await self.agent.run(
                message_history=history,
                toolsets=[external_tools(catalog)],
                output_type=[str, DeferredToolRequests],
            )
        except UserError as e:  # the agent's own configuration: retrying cannot fix it
            raise planning.PlannerError(f"pydantic-ai agent: {e}") from None
        tokens = result.usage.total_tokens or 0
        output = result.output
        if isinstance(output, DeferredToolRequests):
            steps = [planning.proposed_step(call.tool_name, call.args) for call in [*output.calls, *output.approvals]]
            return Proposal(steps=steps, usage_tokens=tokens)
        return planning.answer_proposal(str(output), tokens)

