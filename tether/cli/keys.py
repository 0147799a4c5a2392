"""`tether keygen`: an Ed25519 key pair for signed requests and decisions."""

from __future__ import annotations

import argparse
from pathlib import Path

from tether.cli.base import add_command, client


def _keygen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="PATH", help="where to write the private key (PEM)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument("--if-missing", action="store_true", help="keep an existing key (exit 0), else make one")


async def cmd_keygen(args: argparse.Namespace) -> int:
    path = Path(args.out)
    if args.if_missing and path.exists():
        print(f"{path} exists: kept")
        return client.OK
    encoded = client.keygen(path, force=args.force)
    public_path = path.with_name(path.name + ".pub")
    print(f"private key written to {path} (keep it secret); public key to {public_path}")
    print("add the public key to the approver in the policy file:")
    print(f'public_key = "{encoded}"   # or: public_key_file = "{public_path}"')
    return client.OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_command(sub, "keygen", "make an Ed25519 key pair for signed approvals", _keygen_args, cmd_keygen)
