"""``python -m kvstore remote check`` (kvstore/tiers/remote/check.py) on the real cluster."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from kvstore.tiers.remote import objects
from kvstore.tiers.remote.client import ObjectClient
from kvstore.tools import fsck
from kvstore.tools.cli.main import main
from tests.conformance import NS, keys
from tests.tiers.remote.cluster import SeaweedCluster
from tests.tiers.remote.test_tier import config, fresh_prefix, open_store, parents, value

pytestmark = pytest.mark.anyio


async def cli(argv: list[str]) -> int:
    """The command runs its own event loop: on a thread of its own here."""
    return await anyio.to_thread.run_sync(main, argv)


async def test_remote_check_finds_a_corrupt_object_and_fsck_ignores_the_remote(
        seaweed: SeaweedCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    prefix, ks = fresh_prefix(), keys(5)
    key_file = tmp_path / "hmac"
    key_file.write_bytes(b"h" * 32)
    async with open_store(tmp_path / "s", config(seaweed, prefix, hmac_key=b"h" * 32)) as s:
        await s.put_many(ks, [value(i) for i in range(5)], parents=parents(ks))
        await s.remote.flush()
    for k, v in seaweed.env.items():
        monkeypatch.setenv(k, v)
    argv = ["remote", "check", str(tmp_path / "s"), "--bucket", "kvstore", "--endpoint",
            seaweed.endpoint, "--prefix", prefix, "--hmac-key-file", str(key_file), "--json"]
    assert await cli([*argv, "--all"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] == 5

    client = ObjectClient(config(seaweed, prefix))
    name = objects.object_name(prefix, NS.digest, ks[2])
    got = client.get(name)
    assert got is not None
    data = bytearray(got)
    data[-1] ^= 1  # the HMAC tag
    client.put(name, bytes(data))
    assert await cli([*argv, "--all"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] == 4 and [b["object"] for b in report["bad"]] == [name]
    assert "HMAC" in report["bad"][0]["problem"]
    assert await cli([*argv, "--sample", "2"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["checked"] == 2
    # the local store is fine, and fsck does not look at the remote
    assert fsck.check(str(tmp_path / "s"), deep=True).exit_code == 0
