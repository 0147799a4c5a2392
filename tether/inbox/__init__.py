"""The approver's inbox: a small web app where signed-in people see what waits on them and decide.

``tether inbox --port PORT`` (``tether.inbox.app.serve``). Identity comes from the sign-in layer,
never from a form field: a JWT verified against the organisation's JWKS (``tether.inbox.identity``),
or, on 127.0.0.1 only, ``--dev-login``. Decisions go through ``client.decide`` (the ``decide``
Update), signed with the inbox's own key as an attestation the policy can trust (``[signers.inbox]``).

Modules: ``app`` (the routes), ``service`` (reading runs and deciding), ``pages`` (templates and
static files, shipped inside the package), ``guards`` (headers, body cap, origin checks), ``desk``
(pure choices over the policy and a run), ``identity`` (who a request is). Docs: docs/inbox.md.
"""
