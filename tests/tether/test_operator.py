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


def test_what_went_wrong_is_a_type_and_the_exit_code_is_the_types() -> None:
    """Callers branch on the class (``except client.Refused``), never on a message or a code
    number; every one is a TetherError, and the CLI exits with its class's code."""
    from temporalio.service import RPCError, RPCStatusCode

    kinds = (client.Refused, client.UsageError, client.Pending, client.NoWorker, client.Unreachable)
    assert all(issubclass(k, client.TetherError) for k in kinds)
    assert [k.code for k in kinds] == [client.REFUSED, client.USAGE, client.PENDING, client.USAGE, client.USAGE]
    assert client.JudgementLogUnreadable.code == 4

    def failed(status: RPCStatusCode, message: str) -> client.TetherError:
        return client.rpc_error(RPCError(message, status, b""), "run-1")

    finished = failed(RPCStatusCode.NOT_FOUND, "workflow execution already completed")
    unknown = failed(RPCStatusCode.NOT_FOUND, "workflow not found")
    silent = failed(RPCStatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    gone = failed(RPCStatusCode.UNAVAILABLE, "connection refused")
    assert (type(finished), type(unknown), type(silent), type(gone)) == (
        client.Refused, client.UsageError, client.NoWorker, client.Unreachable)
    assert (unknown.rule, silent.rule) == ("unknown_run", None)  # no worker answered: not a probe's verdict
    assert client.NoWorker("no worker serves it").rule == "no_worker"
    # Temporal unreachable: the CLI says so in one line, exit 2 (the Unreachable type's code).
    done = tether("status", "run-1")
    assert done.returncode == client.Unreachable.code and "cannot reach Temporal" in done.stderr, done
