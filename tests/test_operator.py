"""An operator's first week (issue 35): the small things the `tether` command must get right."""

from __future__ import annotations

import subprocess

import client
from tests.conftest import BIN, ROOT


def tether(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "tether"), *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "TEMPORAL_ADDRESS": "127.0.0.1:1"})


def test_version_and_a_misspelt_option_points_to_the_subcommands_help() -> None:
    done = tether("--version")
    assert done.returncode == 0 and done.stdout.strip().startswith("tether 0."), done
    done = tether("approve", "run-1", "--by", "bob", "--plan-hsh", "x")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: unrecognized arguments: --plan-hsh x (see `tether approve --help`)"
    ], done.stderr


def test_states_are_taken_in_any_case() -> None:
    assert client.list_query("awaiting_approval", None) == client.list_query("AWAITING_APPROVAL", None)
    assert "AgentRunState = 'AWAITING_APPROVAL'" in client.list_query("Awaiting_Approval", None)
    try:
        client.list_query("awaiting", None)
    except client.TetherError as e:
        assert e.field == "state" and "unknown state 'AWAITING'" in str(e)
    else:
        raise AssertionError("an unknown state was taken")


def test_cancel_names_who_and_the_policy_says_who_may() -> None:
    assert client.cancellation_reason("dana", "withdrawn") == "by dana: withdrawn"
    policy = ROOT / "examples/billing/policy.toml"
    assert client.cancel_refusal("dana", "default", policy) is None  # a member (support)
    refused = client.cancel_refusal("mallory", "default", policy)
    assert refused is not None and refused.code == client.REFUSED and refused.rule == "tenant_membership"
    assert "mallory" in str(refused) and "only its members may cancel" in str(refused)
    unknown = client.cancel_refusal("dana", "no-such-tenant", policy)
    assert unknown is not None and unknown.code == client.REFUSED
    assert str(unknown).endswith("its tenants: acme, default, signed")
    typo = client.cancel_refusal("dana", "Default", policy)
    assert typo is not None and typo.rule == "tenant_unknown" and str(typo).endswith("did you mean 'default'?")
    # A name from outside reaches the message escaped, as every name does.
    hostile = client.cancel_refusal("dana", "defau\x1b[2Jlt", policy)
    assert hostile is not None and "\x1b" not in str(hostile) and "did you mean 'default'?" in str(hostile)
    assert client.cancel_refusal("mallory", "default", None) is None  # no file here: the worker's default
    # A name that is no name is a usage error before anything is sent (Temporal unreachable here).
    done = tether("cancel", "run-1", "--by", "bob\x1b[2J", "--reason", "r")
    assert done.returncode == 2 and done.stderr.startswith("error: --by:") and "\x1b" not in done.stderr, done
