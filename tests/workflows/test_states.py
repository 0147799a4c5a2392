"""The transition table, checked as data: every pair of states, allowed or denied."""

from __future__ import annotations

import itertools
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workflows.states import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    Lifecycle,
    RunState,
    is_allowed,
    is_legal_path,
    mermaid,
)

S = RunState
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)

# The table in docs/contract.md, written out independently: the code's table must equal it.
CONTRACT = {
    "RECEIVED": "PLANNING, VALIDATED, COMPENSATING, CANCELLED, FAILED",
    "PLANNING": "VALIDATED, VALIDATION_FAILED, COMPLETED, HANDED_OFF, CANCELLED, COMPENSATING, FAILED",
    "VALIDATION_FAILED": "PLANNING, FAILED",
    "VALIDATED": "AWAITING_APPROVAL, EXECUTING_TOOL, CANCELLED, COMPENSATING",
    "AWAITING_APPROVAL": "APPROVED, REJECTED, EXPIRED, PLANNING, VALIDATED, HANDED_OFF, CANCELLED, COMPENSATING",
    "APPROVED": "EXECUTING_TOOL, AWAITING_APPROVAL, CANCELLED, COMPENSATING",
    "EXECUTING_TOOL": "EXECUTING_TOOL, OBSERVING_RESULT, RETRY_WAIT, EXECUTION_FAILED, COMPENSATING, HANDED_OFF, CANCELLED, AWAITING_APPROVAL",
    "RETRY_WAIT": "EXECUTING_TOOL, EXECUTION_FAILED, CANCELLED, COMPENSATING",
    "OBSERVING_RESULT": "PLANNING, EXECUTING_TOOL, COMPLETED, CANCELLED, COMPENSATING",
    "COMPENSATING": "COMPENSATING, COMPENSATED, HANDED_OFF, CANCELLED",
}
ALLOWED = {(a, b) for a, targets in CONTRACT.items() for b in targets.split(", ")}
ALL_PAIRS = list(itertools.product(RunState, RunState))


def test_terminal_states_are_the_contracts() -> None:
    assert {s.value for s in TERMINAL} == {
        "COMPLETED", "REJECTED", "EXPIRED", "EXECUTION_FAILED", "HANDED_OFF", "CANCELLED", "FAILED",
        "COMPENSATED",
    }


@pytest.mark.parametrize(("src", "dst"), ALL_PAIRS, ids=[f"{a.value}->{b.value}" for a, b in ALL_PAIRS])
def test_every_pair_against_the_table(src: RunState, dst: RunState) -> None:
    expected = (src.value, dst.value) in ALLOWED
    assert is_allowed(src, dst) is expected
    lifecycle = Lifecycle(state=src, state_version=5)
    if expected:
        record = lifecycle.move(dst, at=NOW, actor="runtime", reason="test")
        assert (lifecycle.state, lifecycle.previous_state, lifecycle.state_version) == (dst, src, 6)
        assert (record.from_state, record.to_state, record.state_version) == (src, dst, 6)
        assert lifecycle.timeline == [record]
    else:
        with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
            lifecycle.move(dst, at=NOW, actor="runtime", reason="test")
        # A denied move changes nothing and records nothing.
        assert (lifecycle.state, lifecycle.state_version, lifecycle.timeline) == (src, 5, [])


@pytest.mark.parametrize("state", sorted(TERMINAL, key=lambda s: s.value))
def test_terminal_states_have_no_way_out(state: RunState) -> None:
    assert TRANSITIONS[state] == frozenset()
    assert all(not is_allowed(state, other) for other in RunState)


def test_refusal_records_without_changing_state() -> None:
    lifecycle = Lifecycle()
    lifecycle.move(S.PLANNING, at=NOW, actor="runtime", reason="go")
    record = lifecycle.refuse(at=NOW, actor="user:bob", reason="stale")
    assert record.kind == "refused"
    assert (record.from_state, record.to_state, record.state_version) == (S.PLANNING, S.PLANNING, 1)
    assert (lifecycle.state, lifecycle.state_version) == (S.PLANNING, 1)
    assert is_legal_path(lifecycle.timeline)


def test_legal_path_check() -> None:
    lifecycle = Lifecycle()
    for state in (S.PLANNING, S.VALIDATED, S.EXECUTING_TOOL, S.OBSERVING_RESULT, S.COMPLETED):
        lifecycle.move(state, at=NOW, actor="runtime", reason="step")
    assert is_legal_path(lifecycle.timeline)
    broken = list(lifecycle.timeline)
    broken[2] = broken[2].model_copy(update={"to_state": S.COMPLETED})
    assert not is_legal_path(broken)
    repeated_version = list(lifecycle.timeline)
    repeated_version[1] = repeated_version[1].model_copy(update={"state_version": 1})
    assert not is_legal_path(repeated_version)


def test_readme_diagram_is_generated_from_the_table() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```mermaid\n(.*?)```", readme, re.S)
    assert blocks, "README.md has no mermaid diagram"
    assert blocks[0].strip() == mermaid().strip(), (
        "README's state diagram is out of date: paste `python -c 'from workflows.states import "
        "mermaid; print(mermaid())'` into README.md"
    )


def test_the_attribute_shows_rests_endings_and_leaving_a_rest() -> None:
    """AgentRunState: every rest and ending is published; a working state only right after a rest
    (or RECEIVED, or a value that is no state), so a list never shows a run waiting that works."""
    from workflows.states import PUBLISHED, WORKING, to_publish

    for state in RunState:
        assert not to_publish(state.value, state)
    for rest in PUBLISHED | {RunState.RECEIVED}:
        for state in set(RunState) - {rest}:
            assert to_publish(rest.value, state), (rest, state)
    quiet = WORKING - PUBLISHED - {RunState.RECEIVED}
    for working in quiet:
        for state in set(RunState) - {working}:
            assert to_publish(working.value, state) == (state in PUBLISHED), (working, state)
    assert to_publish(None, RunState.PLANNING) and to_publish("not a state", RunState.PLANNING)


def test_a_start_lists_a_run_as_its_first_task_leaves_it() -> None:
    """The client's start publishes the state RECEIVED moves to (the table, as data, allows it
    one working successor per kind of run): the first task then has nothing to upsert."""
    from workflows.states import TRANSITIONS, first_published, to_publish

    firsts = {first_published(compensation=c) for c in (False, True)}
    # VALIDATED: only a compensation run of a COMPLETED run (its undos wait for an approval),
    # which its first task lists (the start cannot know what the original ended in).
    assert firsts == TRANSITIONS[RunState.RECEIVED] - TERMINAL - {RunState.VALIDATED}
    for first in firsts:
        assert not to_publish(first.value, first)


def test_what_a_run_sends_for_itself_goes_packed_and_reads_back_the_same() -> None:
    """states.pack_json: one helper for the audit batch and the published view; deterministic,
    the fields at their defaults left out, bounded when read back, older (JSON) forms still read."""
    import zlib

    from workflows.states import PACKED_MAX_BYTES, pack_json, unpack_json
    from workflows.wire import AuditBatch

    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    lc = Lifecycle()
    lc.move(RunState.PLANNING, at=at, actor="runtime", reason="received")
    lc.move(RunState.VALIDATED, at=at, actor="runtime", reason="validated")
    batch = AuditBatch(workflow_id="wf", first_run_id="r1", records=lc.timeline, run_id="r1")
    packed = batch.packed()
    assert isinstance(packed, bytes) and packed == batch.packed()  # the same records, the same bytes
    from workflows.states import PACK_DICT

    inflate = zlib.decompressobj(zdict=PACK_DICT)  # deflated with Tether's preset dictionary
    assert b'"kind"' not in inflate.decompress(packed)  # the default kind is left out
    assert AuditBatch.model_validate(zlib.compress(batch.model_dump_json(exclude_defaults=True).encode())) == batch  # no dictionary: still read
    with pytest.raises(ValueError, match="dictionary this build does not know"):
        other = zlib.compressobj(9, zdict=b"another dictionary")
        unpack_json(other.compress(b"{}") + other.flush())
    assert AuditBatch.model_validate(packed) == batch
    assert AuditBatch.model_validate(batch.model_dump(mode="json")) == batch  # an older build's JSON
    assert unpack_json({"a": 1}) == {"a": 1} and unpack_json(pack_json([1, "x"])) == [1, "x"]
    with pytest.raises(ValueError):
        unpack_json(b"not deflated")
    with pytest.raises(ValueError):
        unpack_json(zlib.compress(b" " * (PACKED_MAX_BYTES + 1)))  # inflates past the bound


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([30.0, -0.0, 12.5, 1e-4, 9.99e15, 1e16, 2.0**53])
    | st.text() | st.sampled_from(["\ud800", "a\x00\x1f\x7f\"\\", "\ue000", "\U0001f600", "é"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4) | st.sampled_from(["\ue000", "\U0001f600", "z"]), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_JSON)
def test_canonical_json_is_rfc8785_on_every_value(value) -> None:
    """The fast path (the C encoder) writes RFC 8785's text, or hands the value to the reference:
    digests and MACs of recorded histories depend on it."""
    import rfc8785

    from workflows.contract import canonical_json

    try:
        expected = rfc8785.dumps(value).decode()
    except (rfc8785.CanonicalizationError, UnicodeError, ValueError) as e:
        with pytest.raises((ValueError, UnicodeError)):
            canonical_json(value)
        return
    assert canonical_json(value) == expected
