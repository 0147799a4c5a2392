"""AgentDojo's four v1 suites (workspace, Slack, banking, travel; ETH Zurich and Invariant Labs,
MIT) as governed Tether runs, judged by AgentDojo's own utility() and security() checks.

- ``catalog``: the suites as AgentDojo ships them, and each function's effect, summary fields
  and undo (what the Tether tools declare).
- ``service``: the tool-side service: each run's environment, keyed by run, in SQLite, every
  function call applied there and journaled by its idempotency key.
- ``api``: the service's HTTP client; ``tools``: every function as a Tether tool.
- ``driver``: an AgentDojo pipeline element whose tool calls are a Tether run's (the replayed
  plan, the reviewer), so AgentDojo's runner and scoring run as they ship.

Needs the extra: ``pip install .[agentdojo]`` (bench: ``make bench-agentdojo``).
"""
