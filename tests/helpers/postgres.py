"""A real PostgreSQL server the tests start (Debian's postgresql: initdb + pg_ctl in a temporary
folder); the ``postgres_server`` fixture in tests/conftest.py starts one per session."""

from __future__ import annotations

import glob
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.parts import unavailable


def postgres_bin() -> Path:
    """Debian's PostgreSQL binaries (`apt-get install postgresql`; .ci/run installs them)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    initdb = Path(found[-1]) if found else (Path(shutil.which("initdb")) if shutil.which("initdb") else None)
    if initdb is None:
        unavailable("PostgreSQL is not installed (initdb not found): apt-get install -y postgresql")
    return initdb.parent


@dataclass
class Postgres:
    """A real PostgreSQL server the tests started: its DSN, and stop / start for outages."""

    dsn: str
    pg_ctl: list[str]

    def stop(self) -> None:
        self._run("-m", "fast", "-w", "stop")

    def start(self) -> None:
        self._run("-w", "-t", "60", "start")

    def _run(self, *args: str) -> None:
        subprocess.run([*self.pg_ctl, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
