"""`tether inbox`: serve the approvers' web inbox (inbox/, docs/inbox.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tether.cli.base import add_command, client


def _inbox_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", required=True, type=int, metavar="PORT", help="port to serve on")
    p.add_argument("--host", default="127.0.0.1", metavar="HOST", help="address to bind (default 127.0.0.1)")
    p.add_argument("--dev-login", action="store_true",
                   help="a sign-in page listing the policy's people (only on 127.0.0.1; not for production)")
    p.add_argument("--jwks", default=os.environ.get("TETHER_INBOX_JWKS") or None, metavar="JWKS",
                   help="the sign-in layer's JWKS, a file or an https URL: JWTs are verified against it (env TETHER_INBOX_JWKS)")
    p.add_argument("--issuer", default=os.environ.get("TETHER_INBOX_ISSUER") or None, metavar="ISS",
                   help="the JWTs' required iss (env TETHER_INBOX_ISSUER)")
    p.add_argument("--audience", default=os.environ.get("TETHER_INBOX_AUDIENCE") or None, metavar="AUD",
                   help="the JWTs' required aud (env TETHER_INBOX_AUDIENCE)")
    p.add_argument("--claim", default="preferred_username", metavar="CLAIM",
                   help="the claim naming the person as the policy file does (default preferred_username)")
    p.add_argument("--subjects", default=os.environ.get("TETHER_INBOX_SUBJECTS") or None, metavar="TOML",
                   help="each person's sign-in subject ([people.NAME] oidc_subject = \"SUB\"): a bound person signs in "
                   "with that subject only, whatever the name claim says (env TETHER_INBOX_SUBJECTS)")
    p.add_argument("--header", default="X-Forwarded-Assertion", metavar="NAME",
                   help="an identity-aware proxy's assertion header (default X-Forwarded-Assertion; '' for none)")
    p.add_argument("--policy", metavar="PATH", help="the policy file (default TETHER_POLICY, else the example's)")
    p.add_argument("--key", default=os.environ.get("TETHER_INBOX_KEY") or ".tether/keys/inbox.pem", metavar="PEM",
                   help="the inbox's Ed25519 key: it signs what it verified (policy [signers.NAME])")
    p.add_argument("--web-ui", default=os.environ.get("TETHER_WEB_UI", "http://localhost:8233"), metavar="URL",
                   help="the Temporal Web UI, for links to runs")


async def cmd_inbox(args: argparse.Namespace) -> int:
    from tether.inbox.app import InboxConfig, serve

    if args.port < 1 or args.port > 65535:
        raise client.UsageError(f"--port must be 1-65535, not {args.port}", field="port")
    config = InboxConfig(
        policy=Path(args.policy or os.environ.get("TETHER_POLICY") or "examples/billing/policy.toml"),
        dev_login=args.dev_login,
        jwks=args.jwks,
        issuer=args.issuer,
        audience=args.audience,
        claim=args.claim,
        subjects=Path(args.subjects) if args.subjects else None,
        header=args.header or None,
        key=Path(args.key),
        web_ui=args.web_ui,
        namespace=client.connect_config()["namespace"],
        host=args.host,
    )
    return await serve(config, args.port)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_command(sub, "inbox", "serve the approvers' web inbox (docs/inbox.md)", _inbox_args, cmd_inbox)
