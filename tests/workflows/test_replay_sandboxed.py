"""The recorded histories replay with the sandbox's checks on and under several PYTHONHASHSEED
values, each seed in its own process (tests/helpers/determinism_replay.py, issue 33).

Production passes workflows/ through the sandbox (no per-run cost), so only the lint checks that
code; here the sandbox re-imports and restricts it, as a second layer. Between the seeds'
processes a string set's order and hash() differ: what the workflow sends (every activity's
arguments, the carried state, the result) must not, and must equal what the run recorded."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.determinism_lint import ROOT
from tests.helpers.determinism_replay import FEW, HISTORIES, SEEDS, replay


def test_the_replayed_histories_are_this_builds_main_paths() -> None:
    # A harness that replays nothing would pass: it covers the histories of the paths named.
    assert len(FEW) >= 4 and set(FEW) <= set(HISTORIES)
    assert len(set(SEEDS)) >= 3


def test_histories_replay_in_the_sandbox_under_every_seed_alike() -> None:
    results = replay(ROOT)
    assert set(results) == set(SEEDS)
    for seed, per_history in results.items():
        assert set(per_history) == {h.name for h in FEW}, seed
        failures = {name: r["failure"] for name, r in per_history.items() if r["failure"]}
        assert not failures, f"under PYTHONHASHSEED={seed}: {failures}"
    for history in FEW:
        sent = {seed: results[seed][history.name]["sent"] for seed in SEEDS}
        assert len(set(sent.values())) == 1, f"{history.name}: what replay sends depends on the hash seed: {sent}"


def test_a_seed_dependent_order_is_caught_between_seeds(tmp_path: Path) -> None:
    """The comparisons can fail: a set of strings whose order reaches every record's reason (a
    mutant the lint also names) gives different inputs under different seeds, and inputs that
    differ from the recording. The records reach history in the carried state of continue-as-new
    (audit batches go by local activity, whose inputs history does not keep)."""
    import shutil

    from tests.helpers.mutants import Mutant, inject

    shutil.copytree(ROOT / "workflows", tmp_path / "workflows", ignore=shutil.ignore_patterns("__pycache__"))
    # A set of five strings, in its order, ends up in the run's records: one of 120 orders,
    # chosen by the seed (two seeds suffice; seeds 0 and 1 give different ones).
    inject(tmp_path, Mutant("set-order-in-records", 'reason = "".join({"a", "b", "c", "d", "e"}) + reason', ""))
    carried = [h for h in HISTORIES if h.stem == "continue_as_new"]
    seeds = SEEDS[:2]
    results = replay(tmp_path, carried, seeds=seeds)
    sent = {s: results[s][carried[0].name]["sent"] for s in seeds}
    failures = [results[s][carried[0].name]["failure"] for s in seeds]
    assert len(set(sent.values())) > 1, sent
    assert all(f and "differs from the recorded one" in f for f in failures), failures
