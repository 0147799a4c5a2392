"""The project as `pip install .` installs it: its wheel built from a copy of the checkout, offline
(no build isolation: the virtualenv's setuptools; no index: nothing is downloaded), and that
wheel installed into a folder of its own (no dependencies: the virtualenv has them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT

# What a clean checkout does not have, or a build must not read: local state and build output.
NOT_SOURCE = (".git", ".venv", ".tether", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache",
              ".hypothesis", ".mypy_cache")


def _pip(*args: str) -> None:
    # The machine's pip configuration (indexes, links) is not read: the build uses only what is here.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def checkout_copy(into: Path) -> Path:
    """This checkout's files in ``into``, as a clean checkout has them (a build writes into its
    source folder: into the copy, not the checkout)."""
    shutil.copytree(ROOT, into, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
    return into


def build_wheel(source: Path, into: Path) -> Path:
    """The wheel of the project in ``source`` (a copy: the build writes there), in ``into``."""
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir", str(into), str(source))
    (wheel,) = into.glob("*.whl")
    return wheel


def install_wheel(wheel: Path, target: Path) -> Path:
    """``wheel``'s files in ``target``, as site-packages would hold them."""
    _pip("install", "--no-deps", "--no-index", "--no-compile", "--target", str(target), str(wheel))
    return target
