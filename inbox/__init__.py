"""Deprecated: the inbox is ``tether.inbox`` now. This shim, in the checkout only (``pip install .``
does not install it), keeps ``import inbox`` and ``from inbox.app import ...`` working for one
release: the very modules of ``tether.inbox``, with a DeprecationWarning.
"""

import sys
import warnings

from tether.inbox import app, desk, guards, identity, pages, service

warnings.warn("the `inbox` package moved to `tether.inbox`: import from there (this path goes in the next release)",
              DeprecationWarning, stacklevel=2)
for _name, _module in {"app": app, "desk": desk, "guards": guards, "identity": identity, "pages": pages,
                       "service": service}.items():
    sys.modules[f"{__name__}.{_name}"] = _module
