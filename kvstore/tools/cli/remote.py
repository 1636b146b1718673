"""``python -m kvstore remote check PATH``: verify remote objects of the store's
namespaces (kvstore/tiers/remote/check.py says what is checked)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import anyio

from kvstore.tools.cli.paths import CliError, require_store


def add_parser(sub: Any) -> None:
    p = sub.add_parser("remote", help="check the shared remote tier (S3) of a store")
    p.add_argument("action", choices=["check"])
    p.add_argument("path", help="the local store whose namespaces to check (closed)")
    p.add_argument("--bucket", required=True)
    p.add_argument("--endpoint", default=None,
                   help="S3 endpoint URL (default: AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--prefix", default="kvstore")
    p.add_argument("--hmac-key-file", default=None,
                   help="file holding the fleet's hmac_key: objects must carry a valid tag")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--sample", type=int, default=100,
                     help="objects per namespace, chosen at random (default 100)")
    how.add_argument("--all", action="store_true", help="every object")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(fn=cmd_remote)


async def _namespaces(path: str) -> list[bytes]:
    import kvstore

    async with kvstore.open(path, create=False) as store:
        # a namespace's digest is the hash of its record (kvstore.keys.Namespace)
        return [kvstore.Namespace.from_json(ns).digest for ns in store.stats().namespaces]


def cmd_remote(args: argparse.Namespace) -> int:
    from kvstore.tiers.remote.check import check
    from kvstore.tiers.remote.config import RemoteConfig, read_hmac_key_file

    require_store(args.path)
    hmac_key = None
    if args.hmac_key_file:
        try:
            hmac_key = read_hmac_key_file(args.hmac_key_file)
        except ValueError as e:
            raise CliError(str(e)) from None
    if args.sample < 1:
        raise CliError("--sample must be >= 1")
    try:  # a bad --prefix, --endpoint, key: a message, not a traceback
        config = RemoteConfig(bucket=args.bucket, endpoint=args.endpoint, prefix=args.prefix,
                              hmac_key=hmac_key)
    except ValueError as e:
        raise CliError(str(e)) from None
    digests = anyio.run(_namespaces, os.fspath(args.path))
    if not digests:
        raise CliError(f"the store at {args.path} has no namespace recorded: nothing to check")
    report = check(config, digests, sample=None if args.all else args.sample)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return report.exit_code
    print(f"remote check: {report.checked} of {report.listed} object(s) in "
          f"{len(digests)} namespace(s) verified: {report.ok} ok, {len(report.bad)} bad")
    for bad in report.bad:
        print(f"  BAD {bad['object']}: {bad['problem']}")
    for name in report.foreign_names:
        print(f"  FOREIGN {name}: not a kvstore object name")
    return report.exit_code
