"""What the engine asks the workflow to do next: one command at a time (``Engine.next``), whose
result goes back to the engine (``Engine.on``). ``workflows/effects.py`` turns each into Temporal
calls; the engine never awaits anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from workflows.states import RunState
from workflows.wire import AuthorityCheck, DecisionCheck, ToolCall

# What wakes a wait besides its timer: a decision in the inbox, a handoff, continue-as-new
# being wanted, records for the audit sink, the run's Updates running out.
Wake = Literal["inbox", "handoff", "continue", "audit", "updates"]


@dataclass(frozen=True)
class Call:
    """Call an activity. Its answer is the result; with ``catch`` a failure is the result too
    (a ToolFailure), else it ends the run. ``attested``: the answer bears the fleet key's MAC.
    ``show``: publish the run's state first."""

    name: str
    arg: Any
    result_type: type
    summary: str
    options: Literal["setup", "planner"] = "setup"
    attested: bool = True
    show: bool = True
    catch: bool = False


@dataclass(frozen=True)
class RunTool:
    """One ``execute_tool`` attempt (a write's with ``activity_id``). Result: its ToolOutcome
    or a ToolFailure."""

    call: ToolCall
    activity_id: str | None
    start_to_close: float
    heartbeat: float
    summary: str
    # A write: the records not yet in the audit sink go along (the tool worker appends them
    # before it calls the tool).
    records: bool = False


@dataclass(frozen=True)
class RunGroup:
    """A parallel group's attempts (tool calls, child runs), at most ``limit`` at once. Result:
    a Landed for each attempt that ended, in the order they ended."""

    members: tuple[RunTool | RunChild, ...]
    limit: int


@dataclass(frozen=True)
class Landed:
    """One attempt of a RunGroup that ended: its ToolOutcome or ToolFailure, and when."""

    index: int  # into RunGroup.members
    result: Any
    at: datetime


@dataclass(frozen=True)
class RunChild:
    """Start a child run (its request carries the grant, sealed by the workflow) and wait for
    its end. Result: its RunOutcome, or a ToolFailure when it could not start or failed."""

    request: Any  # a RunRequest
    child_id: str
    summary: str


@dataclass(frozen=True)
class Mint:
    """The write attempt's capability, minted with the fleet key. Result: the call bearing it."""

    call: ToolCall
    activity_id: str
    check: AuthorityCheck
    ttl_seconds: float
    # A decision taken on the run's roster: the call carries it, the capability names its digest,
    # and the tool worker judges it before the tool.
    judge: DecisionCheck | None = None


@dataclass(frozen=True)
class Checkpoint:
    """Where the run rests: every record to the audit sink, notifications started, the state
    and its view published. At the run's ``end`` the records not yet in the sink go with the view
    (the worker's audit collector writes them from there). (A write takes its records along.)"""

    end: bool = False


@dataclass(frozen=True)
class Show:
    """Notifications started and the state published: the run is about to await something."""


@dataclass(frozen=True)
class Publish:
    """Publish the state (``listed_as``: list the run as this state instead)."""

    listed_as: RunState | None = None


@dataclass(frozen=True)
class Notify:
    """Start the notifications due (the run does not wait for them)."""


@dataclass(frozen=True)
class Notified:
    """Wait, boundedly, for the notifications in flight."""


@dataclass(frozen=True)
class Sleep:
    seconds: float
    summary: str


@dataclass(frozen=True)
class Wait:
    """Wait ``seconds`` at most, or until one of ``until`` holds."""

    seconds: float
    summary: str
    until: tuple[Wake, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Probe:
    """Read where the run stands with the server (history size, handlers, notifications in
    flight). Result: Readings."""


@dataclass(frozen=True)
class Readings:
    suggested: bool  # the server suggests continue-as-new
    history_bytes: int
    history_events: int
    handlers_finished: bool
    notifying: int


@dataclass(frozen=True)
class ContinueAsNew:
    """Continue as new with the run's (folded) state, sealed."""


@dataclass(frozen=True)
class HandlersDone:
    """Wait until every signal and Update handler has finished."""


@dataclass(frozen=True)
class End:
    """Nothing left to do: the program has ended."""


Command = Call | RunTool | RunGroup | RunChild | Mint | Checkpoint | Show | Publish | Notify | Notified | Sleep | Wait | Probe | ContinueAsNew | HandlersDone | End
