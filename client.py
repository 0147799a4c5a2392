"""Deprecated: the client library is the ``tether.client`` package now; import from there.

For one release this module still serves scripts run from a checkout: importing it warns
(DeprecationWarning) and names the very objects of ``tether.client``, and what this module held
besides (its helpers, the names it imported) is found in the package's modules.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings

import tether.client as _package

from tether.client import *  # noqa: F403  (the same names, the same objects)
from tether.client import __all__  # noqa: F401

warnings.warn("the top-level `client` module is deprecated: import from tether.client", DeprecationWarning, stacklevel=2)

def __getattr__(name: str) -> object:
    """A name client.py held that is not the public API (a helper, or a name it imported): from
    the tether.client module that holds it now."""
    for module in pkgutil.iter_modules(_package.__path__):
        found = importlib.import_module(f"tether.client.{module.name}")
        if hasattr(found, name):
            return getattr(found, name)
    raise AttributeError(f"module 'client' has no attribute {name!r} (import from tether.client)")
