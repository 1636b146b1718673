"""A store on a network file system is never shared (issue 43,
kvstore/disk/network_fs.py): the mount table names the file system, and an open there
takes the store alone and says why when a second one is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstore
import kvstore.core.opening
from kvstore.disk.network_fs import network_fs
from tests.conformance import NS, keys, same

MOUNTS = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:1 / / rw,relatime - ext4 /dev/vda rw
40 27 0:50 / /mnt/cache rw,relatime - nfs4 server:/export rw,vers=4.2
41 40 254:2 / /mnt/cache/local rw,relatime - ext4 /dev/vdb rw
42 27 0:51 / /mnt/with\\040space rw - cifs //host/share rw
43 27 0:52 / /mnt/ssh rw,nosuid shared:5 - fuse.sshfs me@host:/ rw
44 27 0:53 / /mnt/other rw - fuse.local-fs local rw
"""


@pytest.mark.parametrize("path, kind", [
    ("/mnt/cache/store", "nfs4"),
    ("/mnt/cache", "nfs4"),
    ("/mnt/cache/local/store", None),  # a local disk mounted inside the NFS export
    ("/mnt/cachex/store", None),  # (a prefix of the name is not a parent directory)
    ("/mnt/with space/store", "cifs"),
    ("/mnt/ssh/store", "fuse.sshfs"),
    ("/mnt/other/store", None),
    ("/var/store", None),
])
def test_the_mount_table_names_the_file_system(tmp_path: Path, path: str,
                                               kind: str | None) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTS)
    assert network_fs(path, str(table)) == kind


def test_this_machines_work_disk_is_local(tmp_path: Path) -> None:
    assert network_fs(str(tmp_path)) is None
    assert network_fs(str(tmp_path), str(tmp_path / "no-such-table")) is None


def test_a_store_on_a_network_file_system_is_opened_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """No network file system mounts here: the mount table's answer is replaced for
    this path.  The first open takes the store alone (logged), a second is refused
    naming the file system and what to do; the first still serves."""
    monkeypatch.setattr(kvstore.core.opening, "network_fs",
                        lambda path: "nfs4" if Path(path) == tmp_path else None)
    ks = keys(2)
    with kvstore.open_blocking(tmp_path, namespace=NS, engine="threads") as first:
        assert "network file system (nfs4)" in caplog.text
        with pytest.raises(kvstore.StoreLockedError,
                           match=r"network file system \(nfs4\).*local disk"):
            kvstore.open_blocking(tmp_path, namespace=NS, engine="threads")
        first.put_many(ks, [torch.ones(8), torch.zeros(8)])
        assert all(same(g, v) for g, v in zip(first.get_many(ks),
                                               [torch.ones(8), torch.zeros(8)]))
