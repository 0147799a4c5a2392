"""AgentDojo's own agent pipeline as a Tether planner: AgentDojo's elements propose, Tether
executes and governs.

AgentDojo runs an agent as a chain of pipeline elements (``AgentPipeline.from_config``): a
``SystemMessage``, ``InitQuery`` (the user's task), the LLM element, then a loop of
``ToolsExecutor`` (which runs each tool call in process on the environment) and the LLM again.
This planner cuts that chain at the executor. Each planning request of a Tether run runs
AgentDojo's chain up to its next model call:

1. ``SystemMessage`` (AgentDojo's default system message) and ``InitQuery`` (the run's goal,
   the user task's prompt);
2. ``ExecutedSteps``: every step Tether has executed so far, as AgentDojo's ``ToolsExecutor``
   would have left it in the conversation: the assistant's tool call and its
   ``ChatToolResultMessage`` (the function's output as AgentDojo formats it, YAML, or its
   error), and what the runtime refused or a person left out as a user message;
3. the LLM element: ``OpenAILLM`` (AgentDojo's, unchanged) on an OpenAI-compatible endpoint.

The tool calls of its answer are the proposal: the workflow validates them, the policy and a
person approve them, and each runs as an activity on the run's environment in the tool-side
service (examples/agentdojo/service.py); their results come back into the conversation on the
next planning request. A text answer without tool calls is the run's answer. Nothing here runs
a tool: the ``runtime`` handed to the elements only lists the suite's functions (what the model
is offered, as AgentDojo offers them).

Configured on the worker like the model planner (docs/model-planner.md): ``TETHER_MODEL``,
``OPENAI_BASE_URL``, ``OPENAI_API_KEY``; the suite is the run's world's, asked of the service
(``AGENTDOJO_URL``). Each model request carries the run's id in ``X-Tether-Run`` (a scripted
endpoint answers each run from it: examples/agentdojo/model.py).

    worker.py --tools examples.agentdojo.tools --planner agentdojo=examples.agentdojo.planner:AgentDojoPlanner

What the model sees of a result is what Tether keeps of it: each result is cut to 4,000
characters and all of them to 16,000 (docs/model-planner.md); a result cut short is shown as
Tether stored it. AgentDojo's ``OpenAILLM`` reports no token usage, so the run counts none.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
from collections.abc import Sequence
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from tether.planners import planning
from examples.agentdojo.api import call
from examples.agentdojo.catalog import suites
from workflows.contract import ToolCatalog
from workflows.wire import PlannerInput, Proposal, ProposedStep

RUN_HEADER = "X-Tether-Run"


def _result_text(observation: str) -> tuple[str, str | None]:
    """A step's stored result as AgentDojo's ``ToolsExecutor`` shows it: the function's output
    (YAML) and its error; a result Tether cut short (no longer JSON) as it was stored."""
    try:
        found = json.loads(observation)
    except json.JSONDecodeError:
        return observation, None
    if not isinstance(found, dict):
        return observation, None
    return str(found.get("output", "")), found.get("error")


class ExecutedSteps:
    """The pipeline element that stands where AgentDojo's ``ToolsExecutor`` loop stands: the
    steps Tether executed, as the messages that loop would have added (see the module)."""

    name = "tether-executed-steps"

    def __init__(self, request: PlannerInput) -> None:
        self.request = request

    def query(self, query: str, runtime: Any, env: Any = None, messages: Sequence[Any] = (),
              extra_args: dict = {}) -> tuple[str, Any, Any, Sequence[Any], dict]:  # noqa: B006
        from agentdojo.functions_runtime import FunctionCall
        from agentdojo.types import (ChatAssistantMessage, ChatToolResultMessage, ChatUserMessage,
                                     text_content_block_from_string)

        added: list[Any] = []
        for step in planning.bound_observations(self.request.executed):
            tool_call = FunctionCall(function=step.tool, args=dict(step.args), id=step.tool_call_id)
            added.append(ChatAssistantMessage(role="assistant", tool_calls=[tool_call],
                                              content=[text_content_block_from_string("")]))
            if step.status != "ok" or not step.observation:
                output, error = planning.observation_text(step), None
            else:
                output, error = _result_text(step.observation)
            added.append(ChatToolResultMessage(role="tool", content=[text_content_block_from_string(output)],
                                               tool_call=tool_call, tool_call_id=step.tool_call_id, error=error))
        for note in planning.runtime_notes(self.request):
            added.append(ChatUserMessage(role="user", content=[text_content_block_from_string(note)]))
        return query, runtime, env, [*messages, *added], extra_args


def _openai_llm(run_id: str) -> Any:
    """AgentDojo's ``OpenAILLM`` on the worker's endpoint (``TETHER_MODEL``, ``OPENAI_BASE_URL``,
    ``OPENAI_API_KEY``), its requests naming the run."""
    import openai
    from agentdojo.agent_pipeline.llms.openai_llm import OpenAILLM

    model = os.environ.get("TETHER_MODEL", "").strip()
    if not model:
        raise planning.PlannerError("TETHER_MODEL is not set on the worker: the model AgentDojo's OpenAILLM calls")
    api_key = os.environ.get("OPENAI_API_KEY") or None
    if api_key is None and not os.environ.get("OPENAI_BASE_URL"):
        raise planning.PlannerError("OPENAI_API_KEY is not set on the worker: set it, or point OPENAI_BASE_URL "
                                    "at a local server that needs no key")
    client = openai.OpenAI(api_key=api_key or "no-key", max_retries=0,
                           timeout=float(os.environ.get("TETHER_MODEL_TIMEOUT") or 60),
                           default_headers={RUN_HEADER: run_id})
    return OpenAILLM(client, model)


class AgentDojoPlanner:
    """AgentDojo's agent pipeline, up to its next model call, as a Tether planner (the module's
    docstring). ``llm``: a function of the run id returning the LLM element (default: AgentDojo's
    ``OpenAILLM`` on the worker's endpoint)."""

    def __init__(self, llm: Any = None) -> None:
        self.llm = llm or _openai_llm

    async def propose(self, request: PlannerInput, catalog: ToolCatalog) -> Proposal:
        run_id = activity.info().workflow_id
        held = await asyncio.to_thread(call, "GET", f"/runs/{urllib.parse.quote(run_id, safe='')}")
        return await asyncio.to_thread(self._propose, request, run_id, held["suite"])

    def _propose(self, request: PlannerInput, run_id: str, suite_name: str) -> Proposal:
        import openai
        from agentdojo.agent_pipeline.agent_pipeline import AgentPipeline, load_system_message
        from agentdojo.agent_pipeline.basic_elements import InitQuery, SystemMessage
        from agentdojo.functions_runtime import EmptyEnv, FunctionsRuntime
        from agentdojo.types import get_text_content_as_str

        runtime = FunctionsRuntime(suites()[suite_name].tools)
        pipeline = AgentPipeline([SystemMessage(load_system_message(None)), InitQuery(),
                                  ExecutedSteps(request), self.llm(run_id)])
        try:
            _, _, _, messages, _ = pipeline.query(request.goal, runtime, EmptyEnv())
        except openai.APIStatusError as e:
            raise planning.status_error(e.status_code, planning._error_message(e), code=getattr(e, "code", None),
                                        model=os.environ.get("TETHER_MODEL", ""),
                                        endpoint=planning._endpoint(e.request.url), headers=e.response.headers) from None
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise ApplicationError(f"AgentDojo's LLM element: the model endpoint did not answer: {e}",
                                   type="model_unreachable") from None
        answer = messages[-1]
        calls = answer.get("tool_calls") or []
        if calls:
            return Proposal(steps=[ProposedStep(tool=c.function, args=dict(c.args)) for c in calls])
        return planning.answer_proposal(get_text_content_as_str(answer.get("content") or []), 0)
