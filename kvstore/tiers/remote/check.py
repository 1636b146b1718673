"""``python -m kvstore remote check PATH``: verify the remote objects of a store's
namespace(s), a random sample or all of them.

1. Read the namespaces recorded in the local store at PATH (closed, like fsck).
2. List ``<prefix>/v1/<namespace digest>/`` in the bucket.
3. GET each chosen object and verify it like a read does (header CRC, the key its name
   says, codec, length, payload CRC32C, and the HMAC tag with ``--hmac-key-file``).
Nothing is changed; bad objects are listed (delete or overwrite them with S3 tools;
stores treat them as misses meanwhile).  The local store is not touched: its own
check is ``python -m kvstore fsck``, which never looks at the remote.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstore.errors import CorruptionError, FormatVersionError, RemoteError
from kvstore.tiers.remote import objects
from kvstore.tiers.remote.client import ObjectClient, Unavailable
from kvstore.tiers.remote.config import RemoteConfig


@dataclass
class CheckReport:
    namespaces: list[str] = field(default_factory=list)
    listed: int = 0
    checked: int = 0
    ok: int = 0
    bad: list[dict[str, str]] = field(default_factory=list)
    foreign_names: list[str] = field(default_factory=list)  # not <key hex>

    @property
    def exit_code(self) -> int:
        return 1 if self.bad or self.foreign_names else 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "exit_code": self.exit_code}


def check(config: RemoteConfig, namespace_digests: list[bytes], *, sample: int | None,
          seed: int | None = None) -> CheckReport:
    """Verify ``sample`` objects per namespace (None: all).  Blocking."""
    client = ObjectClient(config)
    report = CheckReport(namespaces=[d.hex() for d in namespace_digests])
    rng = random.Random(seed)
    try:
        for digest in namespace_digests:
            prefix = objects.namespace_prefix(config.prefix, digest)
            names = [name for name, _ in client.list(prefix)]
            report.listed += len(names)
            chosen = names if sample is None or sample >= len(names) else rng.sample(names, sample)
            for name in chosen:
                _check_one(client, config, digest, prefix, name, report)
    except Unavailable as e:
        raise RemoteError(f"the S3 cluster did not answer: {e}") from None
    return report


def _check_one(client: ObjectClient, config: RemoteConfig, digest: bytes, prefix: str,
               name: str, report: CheckReport) -> None:
    try:
        key = bytes.fromhex(name[len(prefix):])
    except ValueError:
        key = b""
    if len(key) != 16:
        report.foreign_names.append(name)
        return
    report.checked += 1
    data = client.get(name)
    if data is None:  # deleted since the listing
        report.checked -= 1
        return
    try:
        objects.verify(data, key, namespace_digest=digest, hmac_key=config.hmac_key)
    except (CorruptionError, FormatVersionError) as e:
        report.bad.append({"object": name, "problem": str(e)})
        return
    report.ok += 1
