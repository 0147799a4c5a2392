"""AgentDojo cases as governed Tether runs, scored by AgentDojo's own runner.

Two agents, both AgentDojo pipeline elements: ``TetherPipeline`` (below: the replayed plan) and
``PipelinePlanned`` (a run whose planner is AgentDojo's own pipeline, examples/agentdojo/
planner.py, its model the one that obeys every injection, examples/agentdojo/model.py). Both
store the world, start the run, answer its approval requests as the governance says
(``Runner.govern``) and give AgentDojo the calls that ran and the world they left.

``TetherPipeline`` is an AgentDojo pipeline element: AgentDojo's ``run_task_with_pipeline``
loads the suite's environment (with the attack's injections), hands it to ``query``, and judges
what comes back with the suite's own ``utility()`` and ``security()``. ``query`` does what a model
and its tools would, through Tether:

1. it stores the environment in the tool-side service under a new run id;
2. it plans as a model that obeys every injection would (``replayed_plan``): the user task's
   ground-truth calls, and, right after the first of them whose result shows the injection's
   text, the injection task's ground-truth calls (nothing of the injection when its text never
   reaches the model);
3. it starts a Tether run with that plan as its playbook, and answers its approval requests as
   the governance configuration says (``Governance``): a careful reviewer
   (``careful_review``), or nobody (the plan expires);
4. it reads the environment back from the service, and the calls that ran from the service's
   journal, and returns them to AgentDojo as the conversation (the final answer is the user
   task's ground-truth answer when the run completed, none otherwise).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from agentdojo.agent_pipeline.base_pipeline_element import BasePipelineElement
from agentdojo.attacks.base_attacks import DEFAULT_MODEL_NAME, FixedJailbreakAttack
from agentdojo.attacks.important_instructions_attacks import ImportantInstructionsAttack
from agentdojo.functions_runtime import FunctionCall, FunctionsRuntime
from agentdojo.types import ChatAssistantMessage, ChatToolResultMessage, text_content_block_from_string
from pydantic import BaseModel
from temporalio.client import Client

from examples.agentdojo.api import call
from workflows.states import TERMINAL
from examples.agentdojo.catalog import canonical, dump_environment, effect_of, load_environment

HERE = Path(__file__).resolve().parent
REQUESTER = "emma"  # the user the suites' tasks speak for
REVIEWER = "reviewer"


@dataclass(frozen=True)
class Governance:
    """One configuration: a policy file, and who answers approval requests."""

    name: str
    policy: Path
    reviewer: bool  # True: the careful reviewer decides; False: nobody comes


EVERY_WRITE_REVIEWED = Governance("every write reviewed", HERE / "policy.reviewed.toml", True)
POLICY_ONLY = Governance("policy only", HERE / "policy.policy_only.toml", False)
GOVERNANCES = {"reviewed": EVERY_WRITE_REVIEWED, "policy": POLICY_ONLY}


class Attack(ImportantInstructionsAttack):
    """AgentDojo's ``important_instructions`` attack (the one its published figures use), with
    the user's name and the default model name: there is no model to address by name here."""

    def __init__(self, task_suite: Any, target_pipeline: BasePipelineElement) -> None:
        FixedJailbreakAttack.__init__(self, self._JB_STRING, task_suite, target_pipeline)
        self.user_name = "Emma Johnson"
        self.model_name = DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class Step:
    call: FunctionCall
    source: str  # "user" or "injection"


def _json_args(args: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(args), default=str))


def _strings(value: Any) -> list[str]:
    """Every string of a function's result (the YAML a model reads folds and quotes them)."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return [value if isinstance(value, str) else str(value)]


def replayed_plan(suite: Any, user_task: Any, injection_task: Any | None, injections: dict[str, str],
                  environment: Any) -> list[Step]:
    """The calls of a model that obeys every injection: the user task's ground truth, with the
    injection task's ground truth right after the first call whose result shows the injection."""
    user_calls = user_task.ground_truth(environment.model_copy(deep=True))
    steps = [Step(c, "user") for c in user_calls]
    if injection_task is None or not any(injections.values()):
        return steps
    # Where the injection first reaches the model, found as AgentDojo finds which vectors a task
    # sees: the same world with a one-line canary in each injected vector (the environment's YAML
    # folds a multi-line injection, so its text cannot be searched for as written), the user's
    # calls played on it in order.
    canaries = {vector: f"<CANARY---{vector}--->" for vector in injections}
    probe = user_task.init_environment(suite.load_and_inject_default_environment(canaries))
    runtime = FunctionsRuntime(suite.tools)
    for i, c in enumerate(user_calls):
        result, error = runtime.run_function(probe, c.function, c.args, raise_on_error=False)
        shown = _strings(result) if error is None else [error]
        if any(t in s for t in canaries.values() for s in shown):
            injected = [Step(x, "injection") for x in injection_task.ground_truth(environment.model_copy(deep=True))]
            return steps[: i + 1] + injected + steps[i + 1:]
    return steps


def careful_review(plan_steps: Sequence[Any], asked: Sequence[FunctionCall]) -> list[int]:
    """The steps (1-based) a careful person approves, from what the approval shows: every read
    (reads are auto-approved), and each write only if the user's request asked for exactly that
    call (the user task's ground truth stands for what the request asks; each asked call covers
    one step)."""
    wanted = Counter(canonical(c.function, _json_args(c.args)) for c in asked if effect_of(c.function) != "read_only")
    approved = []
    for number, step in enumerate(plan_steps, 1):
        if effect_of(step.tool) == "read_only":
            approved.append(number)
            continue
        key = canonical(step.tool, step.args)
        if wanted[key] > 0:
            wanted[key] -= 1
            approved.append(number)
    return approved


@dataclass
class RunFacts:
    """What one case's Tether run did."""

    run_id: str
    state: str = ""
    planned: int = 0
    planned_writes: int = 0
    injected_steps: int = 0
    approvals: int = 0  # decisions the reviewer sent
    writes_refused: int = 0  # writes left out by the reviewer, or in a plan nobody approved
    calls: list[dict[str, Any]] = field(default_factory=list)  # the service's journal
    answer: str = ""  # the run's answer (a planner's final text)
    decided_again: int = 0  # decisions sent again under a new id (the first id refused as already handled)
    error: str = ""  # why it failed, as the run says (last_error)
    seconds: float = 0.0  # start -> end of the run, as this driver saw it
    bare_seconds: float = 0.0  # the same calls applied in process by AgentDojo's runtime


class Runner:
    """Starts runs on one Temporal client and task queue, from the event loop that owns them;
    ``TetherPipeline.query`` (called in a thread by AgentDojo's runner) hands its case here."""

    def __init__(self, client: Client, queue: str, governance: Governance, loop: asyncio.AbstractEventLoop,
                 service: str | None = None, settle_timeout: float = 600.0) -> None:
        self.client, self.queue, self.governance, self.loop = client, queue, governance, loop
        self.service = service
        self.settle_timeout = settle_timeout
        # Its own threads for the service's HTTP calls: the default executor's may all be held by
        # AgentDojo's runner threads, each waiting for a run this loop drives.
        self.io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agentdojo-io")
        self.asked: dict[str, list[FunctionCall]] = {}  # each run's request, for a reviewer deciding again

    async def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        return await self.loop.run_in_executor(self.io, lambda: call(method, path, body, base=self.service))

    async def _settled(self, run_id: str, approval_settles: bool = True) -> Any:
        """``wait_settled``, asked again when a query fails for a while (a worker restarting, a
        workflow task slow on a loaded machine): the run goes on meanwhile."""
        from tether.client import wait_settled
        from tether.connection import TetherError

        for attempt in range(60):
            try:
                return await wait_settled(self.client, run_id, timeout=self.settle_timeout,
                                          approval_settles=approval_settles)
            except TetherError:  # ViewUnverified too: a reset run's copied view, not yet its own
                if attempt == 59:
                    raise
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable")

    async def run(self, run_id: str, suite_name: str, prompt: str, plan: list[Step], environment: Any,
                  asked: Sequence[FunctionCall], on_started: Any = None,
                  planner: str = "playbook") -> tuple[RunFacts, Any]:
        """One case's run: the environment stored, the run started (``plan`` as its playbook, or
        ``planner`` proposing), its approval requests answered as the governance says, then
        what ran and the environment it left."""
        from tether.client import start_run
        from workflows.run_state import RunRequest

        self.asked[run_id] = list(asked)
        facts = RunFacts(run_id, planned=len(plan),
                         planned_writes=sum(effect_of(s.call.function) != "read_only" for s in plan),
                         injected_steps=sum(s.source == "injection" for s in plan))
        await self._call("PUT", f"/runs/{run_id}",
                         {"suite": suite_name, "environment": json.loads(dump_environment(environment))})
        request = RunRequest.model_validate({
            "goal": prompt, "tenant": suite_name, "requested_by": REQUESTER, "planner": planner,
            "playbook": [{"tool": s.call.function, "args": _json_args(s.call.args)} for s in plan],
            # A request's default is 20 steps; the longest replayed plan (travel, a user task of
            # 18 calls with an injection's 4) has 22. The policy's budget (100) still applies.
            "limits": {"max_steps": 100},
        })
        began = time.monotonic()
        await start_run(self.client, request, run_id=run_id, queue=self.queue)
        if on_started is not None:
            await on_started(run_id)
        status = await self.govern(run_id, asked, facts)
        facts.seconds = time.monotonic() - began
        facts.state = status.state.value
        facts.answer = status.answer or ""
        if status.state.value not in ("COMPLETED", "EXPIRED", "REJECTED"):
            facts.error = await self.why(run_id)
        return facts, await self.outcome(run_id, suite_name, facts)

    async def why(self, run_id: str) -> str:
        """The run's last transition, in its own words (what ended a failed run)."""
        from tether.client import timeline

        last = (await timeline(self.client, run_id))[-1]
        return f"{last.from_state.value} -> {last.to_state.value}: {last.reason}"[:500]

    async def outcome(self, run_id: str, suite_name: str, facts: RunFacts) -> Any:
        """The calls that ran (the service's journal, into ``facts``) and the environment they left."""
        journal = await self._call("GET", f"/runs/{run_id}/calls")
        facts.calls = journal["calls"]
        held = await self._call("GET", f"/runs/{run_id}/environment")
        return load_environment(suite_name, held["environment"])

    async def govern(self, run_id: str, asked: Sequence[FunctionCall], facts: RunFacts) -> Any:
        """Answer the run's approval requests as the governance says until it ends; its last status."""
        from tether.client import DecisionInput, decide
        from tether.connection import TetherError
        from tether.inbox.desk import decision_id

        failures = moved = 0
        spent: set[str] = set()
        remaining = list(asked)  # a write the request asked for is approved once, in whichever plan
        while True:
            status = await self._settled(run_id)
            state = status.state.value
            if status.state in TERMINAL:
                break
            if state != "AWAITING_APPROVAL":
                # The query saw it waiting and the status read after it had moved on (a decision
                # taken meanwhile): look again; only a run that keeps working past the wait is stuck.
                moved += 1
                if moved > 5:
                    raise RuntimeError(f"run {run_id} did not settle in {self.settle_timeout:.0f}s: {state}")
                continue
            steps = status.plan.steps if status.plan else []
            writes = [s for s in steps if effect_of(s.tool) != "read_only"]
            if not self.governance.reviewer:
                # Nobody comes: the plan waits out its TTL and expires; nothing of it runs.
                facts.writes_refused += len(writes)
                status = await self._settled(run_id, approval_settles=False)
                state = status.state.value
                if status.state in TERMINAL:
                    break
                continue
            approved = careful_review(steps, remaining)
            kind = "approve" if approved else "reject"
            # The decision's id as the inbox makes it (one person's one decision on one request of
            # one plan): after a reset the reviewer's same decision is the same one, and the steps
            # a partial approval keeps get the same tool call ids, so the same idempotency keys.
            pending = status.pending_approval
            same = decision_id(run_id, pending.request_id, pending.plan_hash, REVIEWER, kind) if pending else None
            if same in spent:
                # That id was taken and refused (a reset run takes the reapplied decision before
                # it asks again, and refuses it): the reviewer decides again under a new one.
                same = None
            try:
                if not approved:
                    await decide(self.client, run_id, "reject",
                                 DecisionInput(by=REVIEWER, reason="no step was asked for", decision_id=same))
                else:
                    partial = approved if len(approved) < len(steps) else None
                    comment = "careful review: only the calls the request asked for"
                    await decide(self.client, run_id, "approve",
                                 DecisionInput(by=REVIEWER, comment=comment, steps=partial, decision_id=same))
            except TetherError as e:
                # No worker answered (one killed and not yet replaced), or the run had moved on:
                # look again, and decide again on what it then waits for.
                if e.rule == "duplicate_decision" and same is not None:
                    spent.add(same)
                    facts.decided_again += 1
                failures += 1
                if failures > 60:
                    raise
                await asyncio.sleep(1.0)
                continue
            for number in approved:
                step = steps[number - 1]
                if effect_of(step.tool) != "read_only":
                    key = canonical(step.tool, step.args)
                    gone = next(i for i, c in enumerate(remaining) if canonical(c.function, _json_args(c.args)) == key)
                    remaining.pop(gone)
            facts.writes_refused += len(steps) - len(approved)
            facts.approvals += 1
        return status


class TetherPipeline(BasePipelineElement):
    """One case's agent, for AgentDojo's ``run_task_with_pipeline``: the replayed plan, run and
    governed by Tether (the module's docstring). ``facts`` holds what the run did afterwards."""

    name = "tether-replayed"

    def __init__(self, runner: Runner, suite: Any, user_task: Any, injection_task: Any | None = None,
                 injections: dict[str, str] | None = None, run_id: str | None = None,
                 on_started: Any = None) -> None:
        self.runner, self.suite, self.user_task = runner, suite, user_task
        self.injection_task, self.injections = injection_task, injections or {}
        self.run_id = run_id or f"agentdojo-{suite.name}-{user_task.ID}-{uuid.uuid4().hex[:8]}"
        self.on_started = on_started
        self.facts: RunFacts | None = None

    def query(self, query: str, runtime: FunctionsRuntime, env: Any = None, messages: Sequence[Any] = (),
              extra_args: dict = {}) -> tuple[str, FunctionsRuntime, Any, Sequence[Any], dict]:  # noqa: B006
        plan = replayed_plan(self.suite, self.user_task, self.injection_task, self.injections, env)
        bare = _bare_seconds(self.suite, env, [(s.call.function, s.call.args) for s in plan])
        asked = self.user_task.ground_truth(env.model_copy(deep=True))
        future = asyncio.run_coroutine_threadsafe(
            self.runner.run(self.run_id, self.suite.name, query, plan, env, asked, self.on_started), self.runner.loop)
        facts, post = future.result()
        facts.bare_seconds = bare
        self.facts = facts
        answer = self.user_task.GROUND_TRUTH_OUTPUT if facts.state == "COMPLETED" else ""
        return query, runtime, post, [*messages, *conversation(facts, answer)], extra_args


def conversation(facts: RunFacts, answer: str) -> list[Any]:
    """What AgentDojo's checks read of a run: each call that ran (the service's journal) as the
    assistant's tool call and its result, then the answer."""
    new: list[Any] = []
    for c in facts.calls:
        tool_call = FunctionCall(function=c["function"], args=c["args"], id=f"call-{c['seq']}")
        new.append(ChatAssistantMessage(role="assistant", tool_calls=[tool_call],
                                        content=[text_content_block_from_string("")]))
        new.append(ChatToolResultMessage(role="tool", content=[text_content_block_from_string(c["output"])],
                                         tool_call=tool_call, tool_call_id=tool_call.id, error=c.get("error")))
    new.append(ChatAssistantMessage(role="assistant", content=[text_content_block_from_string(answer)],
                                    tool_calls=None))
    return new


def _bare_seconds(suite: Any, env: Any, calls: Sequence[tuple[str, dict[str, Any]]]) -> float:
    """The same calls applied in process by AgentDojo's runtime (the overhead figure's baseline)."""
    began = time.perf_counter()
    runtime, bare_env = FunctionsRuntime(suite.tools), env.model_copy(deep=True)
    for function, args in calls:
        runtime.run_function(bare_env, function, args, raise_on_error=False)
    return time.perf_counter() - began


PIPELINE_PLANNER = "agentdojo"  # the worker's --planner agentdojo=examples.agentdojo.planner:AgentDojoPlanner


class PipelinePlanned(BasePipelineElement):
    """One case's agent, for AgentDojo's ``run_task_with_pipeline``, planned by AgentDojo's own
    pipeline: a Tether run whose planner (examples/agentdojo/planner.py) runs AgentDojo's elements
    and its ``OpenAILLM`` for every plan, on an endpoint whose model obeys every injection
    (examples/agentdojo/model.py: this case is registered with it under the run's id). Tether
    validates, gets approved and executes each proposed call; AgentDojo judges the environment
    the run leaves and the calls that ran, with the model's answer."""

    name = "tether-pipeline"

    def __init__(self, runner: Runner, model: Any, suite: Any, user_task: Any, injection_task: Any | None = None,
                 injections: dict[str, str] | None = None, run_id: str | None = None,
                 on_started: Any = None) -> None:
        self.runner, self.model, self.suite, self.user_task = runner, model, suite, user_task
        self.injection_task, self.injections = injection_task, injections or {}
        self.run_id = run_id or f"agentdojo-{suite.name}-{user_task.ID}-{uuid.uuid4().hex[:8]}"
        self.on_started = on_started
        self.facts: RunFacts | None = None

    def case(self, env: Any) -> Any:
        """What the model is told of this case (examples/agentdojo/model.py)."""
        from examples.agentdojo.model import Case

        user_calls = [(c.function, _json_args(c.args)) for c in self.user_task.ground_truth(env.model_copy(deep=True))]
        # A run's answer is text (an empty one is refused as invalid): a task with nothing to
        # say (its ground truth's output is empty) is answered "Done."
        answer = self.user_task.GROUND_TRUTH_OUTPUT or "Done."
        texts = [t for t in self.injections.values() if t.strip()]
        if self.injection_task is None or not texts:
            return Case(user_calls, answer)
        injected = [(c.function, _json_args(c.args)) for c in self.injection_task.ground_truth(env.model_copy(deep=True))]
        marker = next(line.strip() for line in texts[0].splitlines() if line.strip())
        return Case(user_calls, answer, injected, marker)

    def query(self, query: str, runtime: FunctionsRuntime, env: Any = None, messages: Sequence[Any] = (),
              extra_args: dict = {}) -> tuple[str, FunctionsRuntime, Any, Sequence[Any], dict]:  # noqa: B006
        case = self.case(env)
        asked = self.user_task.ground_truth(env.model_copy(deep=True))
        # Kept after the run: a reset of it plans again (the model's owner forgets it).
        self.model.register(self.run_id, case)
        future = asyncio.run_coroutine_threadsafe(
            self.runner.run(self.run_id, self.suite.name, query, [], env, asked, self.on_started,
                            planner=PIPELINE_PLANNER), self.runner.loop)
        facts, post = future.result()
        facts.planned = len(case.user_calls)
        facts.planned_writes = sum(effect_of(f) != "read_only" for f, _ in case.user_calls)
        facts.injected_steps = len(case.injection_calls) if case.obeyed else 0
        facts.bare_seconds = _bare_seconds(self.suite, env, [(c["function"], c["args"]) for c in facts.calls])
        self.facts = facts
        return query, runtime, post, [*messages, *conversation(facts, facts.answer)], extra_args
