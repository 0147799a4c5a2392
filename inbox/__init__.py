"""The approver's inbox: a small web app where signed-in people see what waits on them and decide.

``tether inbox --port PORT`` (``inbox.app.main``). Identity comes from the sign-in layer, never
from a form field: a JWT verified against the organisation's JWKS (``inbox.identity``), or, on
127.0.0.1 only, ``--dev-login``. Decisions go through ``client.decide`` (the ``decide`` Update),
signed with the inbox's own key as an attestation the policy can trust (``[signers.inbox]``).
Docs: docs/inbox.md.
"""
