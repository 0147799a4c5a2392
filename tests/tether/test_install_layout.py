"""What `pip install .` installs: the wheel built from this checkout holds exactly the top-level
names docs/architecture.md's layout names as the package (tether, workflows, activities, worker,
starter), the inbox's templates and static files inside `tether`, and nothing of the checkout's
programs, examples, tests or benchmarks. The inbox serves its pages from the installed copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.wheel import build_wheel, checkout_copy, install_wheel

INSTALLED = {"tether", "workflows", "activities", "worker.py", "starter.py"}
# The modules of activities/: the activity classes the worker registers, one module each, and the
# plugin that registers them.
ACTIVITY_MODULES = {"__init__.py", "audit.py", "notify.py", "plugin.py", "policy_checks.py", "recovery.py", "setup.py",
                    "tools.py"}
INBOX = ROOT / "tether/inbox"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    into = tmp_path_factory.mktemp("wheel")
    return build_wheel(checkout_copy(into / "source"), into / "dist")


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_holds_only_the_package(wheel: Path) -> None:
    names = _names(wheel)
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == INSTALLED, sorted(top ^ INSTALLED)
    # Not a module or package of the checkout's own beside them, at any depth under another name.
    for left_out in ("client.py", "inbox/", "examples/", "tests/", "bench/"):
        assert not [n for n in names if n.startswith(left_out)], left_out
    # Each room holds its one job (issue 60): activities/ only the activity modules the worker
    # registers; the libraries in tether/, by subsystem.
    activities = {n.split("/")[1] for n in names if n.startswith("activities/") and n.endswith(".py")}
    assert activities == ACTIVITY_MODULES, sorted(activities ^ ACTIVITY_MODULES)
    rooms = {n.split("/")[1] for n in names if n.startswith("tether/") and n.count("/") >= 2}
    assert {"policy", "audit", "store", "tools", "planners", "client", "cli", "inbox"} <= rooms, sorted(rooms)
    # The CLI's entry point is the installed starter module.
    with zipfile.ZipFile(wheel) as z:
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "tether = starter:run" in z.read(entry_points).decode()


def test_the_inbox_files_are_package_data(wheel: Path) -> None:
    """Every template and static file of the checkout's inbox is in the wheel, under tether/inbox,
    and the Cedar schema under tether/policy: a file added to either folder ships with it."""
    names = set(_names(wheel))
    for folder in ("templates", "static"):
        files = sorted(p.relative_to(ROOT).as_posix() for p in (INBOX / folder).iterdir() if p.is_file())
        assert files and set(files) <= names, sorted(set(files) - names)
    assert "tether/policy/tether.cedarschema" in names
    assert not [n for n in names if n.startswith("tether/inbox/") and n.endswith((".pem", ".keys", ".db"))]


def _run_installed(site: Path, cwd: Path, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a Python that sees the installed copy and the dependencies only: -S leaves out
    the virtualenv's site (where the editable install puts this checkout on the path)."""
    deps = sysconfig.get_paths()["purelib"]
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(site), deps])}
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def _as_in_the_image(wheel: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The wheel installed (site), and a working directory (app) with a policy file, as the image
    has them."""
    site = install_wheel(wheel, tmp_path / "site")
    app = tmp_path / "app"
    app.mkdir()
    shutil.copyfile(ROOT / "examples/billing/policy.image.toml", app / "policy.toml")
    return site, app


def test_the_installed_inbox_serves_its_pages_from_the_installed_copy(wheel: Path, tmp_path: Path) -> None:
    """The inbox's templates and static files are found where it is installed, not in the checkout."""
    site, app = _as_in_the_image(wheel, tmp_path)
    # Beside the package: its metadata, and bin/ with the `tether` script.
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == sorted({*INSTALLED, "bin"})
    code = """
import json, sys
from pathlib import Path
import tether.inbox, tether.inbox.pages as pages
from tether.inbox.app import InboxConfig, create_app
from fastapi.testclient import TestClient

found = {}
for name in ("examples", "inbox", "tests", "bench"):
    try:
        __import__(name)
        found[name] = "importable"
    except ModuleNotFoundError:
        pass
client = TestClient(create_app(InboxConfig(policy=Path("policy.toml"), dev_login=True)), base_url="http://127.0.0.1")
login = client.get("/login")
css = client.get("/static/inbox.css")
print(json.dumps({
    "package": tether.inbox.__file__, "templates": str(pages.TEMPLATES), "static": str(pages.STATIC),
    "loaded": sorted(pages.templates().env.list_templates()), "found": found,
    "login": [login.status_code, login.headers.get("content-security-policy", ""), login.text],
    "css": [css.status_code, css.text],
}))
"""
    done = _run_installed(site, app, code)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("package", "templates", "static"):
        assert Path(seen[key]).resolve().is_relative_to(site.resolve()), (key, seen[key])
    assert seen["loaded"] == sorted(p.name for p in (INBOX / "templates").iterdir())
    assert seen["found"] == {}, seen["found"]  # the checkout's examples, tests and shim are not installed
    status, csp, page = seen["login"]
    assert status == 200 and "default-src 'none'" in csp and "Tether inbox" in page
    assert "bob" in page  # the policy's people, rendered by the installed template
    assert seen["css"] == [200, (INBOX / "static/inbox.css").read_text()]


def test_a_template_missing_from_the_installed_copy_is_a_500_not_the_checkouts(wheel: Path, tmp_path: Path) -> None:
    """The check above can fail: with the installed login template removed, the installed inbox
    does not fall back to the checkout's (it fails to render)."""
    site, app = _as_in_the_image(wheel, tmp_path)
    (site / "tether/inbox/templates/login.html").unlink()
    code = """
from pathlib import Path
from tether.inbox.app import InboxConfig, create_app
from fastapi.testclient import TestClient
client = TestClient(create_app(InboxConfig(policy=Path("policy.toml"), dev_login=True)), base_url="http://127.0.0.1",
                    raise_server_exceptions=False)
print(client.get("/login").status_code)
"""
    done = _run_installed(site, app, code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "500"
