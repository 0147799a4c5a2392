"""The run's decision logic as pure functions over its state: what happens on each event.

``AgentRun`` (workflows/agent_run.py) is the shell around this: it awaits activities, timers
and signals, and hands each outcome to the :class:`Engine`, which decides the next state
through the transition table. No Temporal, no I/O: time and ids are passed in. The property
tests drive this same code with random event sequences.

The engine is one run model (``workflows/run_model.py``: the run's state, the only code that
writes it, and the helpers the phases share) and its phases, one module each: planning,
approvals and their timers, steps, parallel groups, delegation, handoff (and cancel), compensating, outbox, carry and views; and the run's
program (``workflows/drive.py``), which says what to do next, one command at a time. The
phases call one another only through what ``run_model.Phases`` declares: the type checker
(``tests/workflows/test_types.py``) fails a rename there, and ``Engine(...)`` with a declared method missing.
"""

from __future__ import annotations

from workflows.approvals import Approvals, Decisions
from workflows.carry import Carry
from workflows.compensating import Compensating
from workflows.delegation import Delegating
from workflows.drive import Drive
from workflows.groups import Groups
from workflows.handoff import Handoff
from workflows.outbox import Outbox
from workflows.planning import Planning
from workflows.steps import Steps
from workflows.timers import Timers
from workflows.views import Views


class Engine(Drive, Planning, Approvals, Timers, Decisions, Steps, Groups, Delegating, Handoff, Compensating, Outbox, Carry, Views):
    """One run's decisions, and what it asks for next (``next``) and takes the result of
    (``on``). Every state change goes through ``data.lifecycle.move``."""
