"""``infermux key new`` and ``infermux key hash``: API keys for ``[[auth.keys]]``.

The config stores only a key's SHA-256. ``key new`` makes a random key, prints it once (give
it to the client; it cannot be recovered) and the ``[[auth.keys]]`` table to paste into the
config. ``key hash`` reads an existing key from standard input (never from the command line,
where other users could see it in the process list) and prints its ``key_sha256``.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    """Register ``key`` with its ``new`` and ``hash`` subcommands."""
    parser = subparsers.add_parser(
        "key",
        help="make or hash API keys for [[auth.keys]]",
        description="API keys are stored in the config as SHA-256 hashes, never in clear.",
    )
    commands = parser.add_subparsers(dest="key_command", metavar="ACTION")
    new = commands.add_parser("new", help="make a random key and print its [[auth.keys]] table")
    new.add_argument("--id", default="my-key", help="the key's id in logs and usage records")
    new.add_argument("--tenant", default="default", help="who pays (budgets are per tenant)")
    new.add_argument("--rpm", type=int, default=None, help="requests per minute (default: none)")
    new.add_argument("--tpm", type=int, default=None, help="tokens per minute (default: none)")
    new.set_defaults(func=_new)
    hashing = commands.add_parser(
        "hash", help="read a key from standard input and print its key_sha256"
    )
    hashing.set_defaults(func=_hash)
    parser.set_defaults(func=lambda _args: parser.print_help() or 2)


def _new(args: argparse.Namespace) -> int:
    from gateway.http.auth import generate_key, hash_key

    key = generate_key()
    lines = [
        f"# API key (give it to the client; it is shown only now): {key}",
        "[[auth.keys]]",
        f'id = "{args.id}"',
        f'tenant = "{args.tenant}"',
        f'key_sha256 = "{hash_key(key)}"',
    ]
    if args.rpm is not None:
        lines.append(f"rpm = {args.rpm}")
    if args.tpm is not None:
        lines.append(f"tpm = {args.tpm}")
    print("\n".join(lines))
    return 0


def _hash(args: argparse.Namespace) -> int:
    from gateway.http.auth import hash_key

    if sys.stdin.isatty():
        key = getpass.getpass("API key: ")
    else:
        key = sys.stdin.readline()
    key = key.rstrip("\r\n")
    if not key:
        print("infermux: no key on standard input", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0
