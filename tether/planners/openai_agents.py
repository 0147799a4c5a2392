"""An OpenAI Agents SDK ``Agent`` as a Tether planner.

    from agents import Agent
    from tether.planners.openai_agents import AgentsSDKPlanner

    agent = Agent(name="refunds", instructions="You refund orders.", model="gpt-4.1-mini")
    planner = AgentsSDKPlanner(agent)      # worker.py --planner refunds=mymodule:planner

Tether's tools are given to the agent as function tools that need approval
(``needs_approval=True``): when the model calls them, ``Runner.run`` stops with those calls as
its ``interruptions`` and runs nothing. They are the proposal (a call of ``tether_delegate``,
the model planner's delegate step, is the plan's delegate step: a child run planned by the same
agent); Tether validates it, gets it approved and executes each step as an activity. The next
planning call starts a new ``Runner.run`` whose input is the run so far as Responses items: the
goal, each executed step as a ``function_call`` with its ``function_call_output`` (same call
id), and the runtime's notes (a refusal, steps a person left out) as user messages. A final
output without tool calls is the run's answer. The SDK's own approval state (``RunState``) is
not used: Tether's approval is the one that counts, and it is bound to the plan.

The model calls run inside the ``plan`` activity. The SDK's tracing export is off unless the
``RunConfig`` you pass turns it on. Tools of the agent's own are replaced by Tether's.
"""

from __future__ import annotations

import json
from typing import Any

from tether.planners import planning
from workflows.contract import ToolCatalog
from workflows.wire import PlannerInput, Proposal

try:
    from agents import Agent, FunctionTool, RunConfig, Runner, TResponseInputItem
except ImportError as e:  # pragma: no cover - the dev extra installs it
    raise ImportError(f"the OpenAI Agents SDK planner needs openai-agents: pip install openai-agents ({e})") from None


async def _never_here(context: Any, arguments: str) -> str:
    # Every Tether tool needs approval, so the SDK stops before calling it.
    raise planning.PlannerError("a Tether tool was invoked inside the planner: it must only be proposed")


def proposed_tools(catalog: ToolCatalog) -> list[FunctionTool]:
    """The catalog as function tools the SDK stops at (``needs_approval``) and never runs; the
    delegate step, when the catalog has it, as the model planner offers it (``tether_delegate``)."""
    return [
        FunctionTool(
            name=d["function"]["name"],
            description=d["function"]["description"],
            params_json_schema=d["function"]["parameters"],
            on_invoke_tool=_never_here,
            strict_json_schema=False,  # the tool's own schema, checked by Tether's validation
            needs_approval=True,
        )
        for d in planning.tool_definitions(catalog)
    ]


def run_input(request: PlannerInput) -> list[TResponseInputItem]:
    """The run so far as the agent's input items."""
    items: list[TResponseInputItem] = [{"role": "user", "content": f"Goal: {request.goal}"}]
    for step in planning.bound_observations(request.executed):
        items.append({"type": "function_call", "call_id": step.tool_call_id, "name": planning.function_name(step.tool),
                      "arguments": json.dumps(step.args, sort_keys=True)})
        items.append({"type": "function_call_output", "call_id": step.tool_call_id, "output": planning.observation_text(step)})
    items.extend({"role": "user", "content": note} for note in planning.runtime_notes(request))
    return items


class AgentsSDKPlanner:
    """An Agents SDK ``Agent`` as a planner (see the module's docstring)."""

    def __init__(self, agent: Agent[Any], run_config: RunConfig | None = None, max_turns: int = 10) -> None:
        if not isinstance(agent, Agent):
            raise TypeError(f"AgentsSDKPlanner takes an agents.Agent, not {type(agent).__name__}")
        self.agent = agent
        self.run_config = run_config or RunConfig(tracing_disabled=True)
        self.max_turns = max_turns

    async def propose(self, request: PlannerInput, catalog: ToolCatalog) -> Proposal:
        from agents.exceptions import MaxTurnsExceeded, UserError

        agent = self.agent.clone(tools=proposed_tools(catalog), tool_use_behavior="run_llm_again")
        try:
            result = await Runner.run(agent, run_input(request), run_config=self.run_config, max_turns=self.max_turns)
        except (UserError, MaxTurnsExceeded) as e:  # configuration, or a loop: retrying cannot fix it
            raise planning.PlannerError(f"OpenAI Agents SDK agent: {type(e).__name__}: {e}") from None
        tokens = result.context_wrapper.usage.total_tokens or 0
        calls = [item.raw_item for item in result.interruptions]
        if calls:
            steps = [planning.proposed_step(str(_field(c, "name")), _field(c, "arguments")) for c in calls]
            return Proposal(steps=steps, usage_tokens=tokens)
        output = result.final_output
        return planning.answer_proposal(output if isinstance(output, str) else json.dumps(output, default=str), tokens)


def _field(raw: Any, name: str) -> Any:
    return raw.get(name) if isinstance(raw, dict) else getattr(raw, name, None)

