"""An operator's first week (issue 35): the small things the `tether` command must get right."""

from __future__ import annotations

import subprocess

import tether.client as client
from tests.helpers.paths import BIN, ROOT


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


def test_a_tenant_the_policy_does_not_name_is_refused_by_name() -> None:
    # Who may cancel is the run's word (tests/workflows/test_cancel.py); a client that has the policy file
    # still names a tenant it does not know, with the nearest ones.
    policy = ROOT / "examples/billing/policy.toml"
    assert client.tenant_refusal("default", policy) is None
    assert client.tenant_refusal("no-such-tenant", None) is None  # no file here: the worker's word
    unknown = client.tenant_refusal("no-such-tenant", policy)
    assert unknown is not None and unknown.code == client.USAGE
    assert str(unknown).endswith("its tenants: acme, default, signed")
    typo = client.tenant_refusal("Default", policy)
    assert typo is not None and typo.rule == "tenant_unknown" and str(typo).endswith("did you mean 'default'?")
    # A name from outside reaches the message escaped, as every name does.
    hostile = client.tenant_refusal("defau\x1b[2Jlt", policy)
    assert hostile is not None and "\x1b" not in str(hostile) and "did you mean 'default'?" in str(hostile)
    # A name that is no name is a usage error before anything is sent (Temporal unreachable here).
    done = tether("cancel", "run-1", "--by", "bob\x1b[2J", "--reason", "r")
    assert done.returncode == 2 and done.stderr.startswith("error: --by:") and "\x1b" not in done.stderr, done
