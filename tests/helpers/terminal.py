"""A command run the way a person runs it: on a (pseudo-)terminal, answering its question."""

from __future__ import annotations

import os
import pty
import subprocess

from tests.helpers.paths import ROOT


def in_terminal(argv: list[str], env: dict[str, str], answer: str) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as its stdin and stdout, the way a person runs it;
    answer ``answer`` once it asks ``[y/N]``. Returns the exit code and everything shown."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=env, cwd=ROOT, close_fds=True)
    os.close(follower)
    shown, answered = b"", False
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the command exited and closed the terminal
            break
        if not chunk:
            break
        shown += chunk
        if not answered and b"[y/N]" in shown:
            os.write(leader, answer.encode() + b"\n")
            answered = True
    code = proc.wait()
    os.close(leader)
    return code, shown.decode(errors="replace").replace("\r\n", "\n")
