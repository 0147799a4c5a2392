"""AgentDojo's four v1 suites (workspace, Slack, banking, travel; ETH Zurich and Invariant Labs,
MIT) as governed Tether runs, judged by AgentDojo's own utility() and security() checks.

- ``catalog``: the suites as AgentDojo ships them, and each function's effect, summary fields
  and undo (what the Tether tools declare).
- ``service``: the tool-side service: each run's environment, keyed by run, in SQLite, every
  function call applied there and journaled by its idempotency key.
- ``api``: the service's HTTP client; ``tools``: every function as a Tether tool.
- ``driver``: AgentDojo pipeline elements whose tool calls are a Tether run's, so AgentDojo's
  runner and scoring run as they ship: ``TetherPipeline`` (the replayed plan) and
  ``PipelinePlanned`` (a run planned by AgentDojo's own pipeline), and the reviewer.
- ``planner``: AgentDojo's own agent pipeline (its system message, the user's query, the steps
  Tether executed, its ``OpenAILLM``) as a Tether planner: AgentDojo proposes, Tether governs.
- ``model``: a model that obeys every injection, for AgentDojo's ``OpenAILLM`` on the offline
  OpenAI-compatible endpoint (examples/fake_openai.py).

Needs the extra: ``pip install .[agentdojo]`` (bench: ``make bench-agentdojo``).
"""
