"""Store files are private to their user whatever the umask; a wider mode is chosen on
purpose; a store other users can reach is warned about (or refused), and fsck reports
and repairs it (kvstore/disk/permissions.py)."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import lmdb
import pytest
import torch

import kvstore
from kvstore.disk import permissions
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.tools import fsck
from kvstore.tools.cli.demo import MANIFEST, write_manifest
from kvstore.tools.cli.main import main as cli
from tests.conformance import NS, keys, make_tensor

EXTENT = 1 << 20
BLOCKS = [make_tensor(torch.uint8, (300_000,), i) for i in range(6)]  # two 1 MiB extents


@pytest.fixture(params=[0o000, 0o022, 0o277], ids=lambda m: f"umask{m:03o}")
def umask(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[int]:
    """Run the test under this umask (process-wide: restored afterwards).  Depends on
    tmp_path so that pytest makes that directory before the umask changes."""
    old = os.umask(request.param)
    try:
        yield int(request.param)
    finally:
        os.umask(old)


def build(path: Path, n: int = len(BLOCKS), start: int = 0, **options: Any) -> None:
    """Open (creating) a store, put ``n`` blocks from ``start`` and close it."""
    async def run() -> None:
        async with kvstore.open(path, namespace=NS, extent_bytes=EXTENT, staging_bytes=4 << 20,
                                **options) as store:
            await store.put_many(keys(n, start), BLOCKS[start:start + n])

    anyio.run(run)


def modes(root: Path) -> dict[str, int]:
    """Relative path -> permission bits of root and everything under it."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


def expect(root: Path, file_mode: int) -> dict[str, int]:
    """What ``modes(root)`` must be when every path has the store's mode."""
    return {rel: permissions.dir_mode(file_mode) if (root / rel).is_dir() else file_mode
            for rel in modes(root)}


def loosen(root: Path) -> None:
    """What a kvstore before this change left under umask 022: 0755 / 0644."""
    for rel in modes(root):
        p = root / rel
        p.chmod(0o755 if p.is_dir() else 0o644)


STORE_FILES = {"LOCK", "index", "index/data.mdb", "index/lock.mdb", "extents",
               "extents/00000001.kvx", "extents/00000002.kvx"}


def test_dir_mode_adds_search_where_read_is_granted() -> None:
    assert [permissions.dir_mode(m) for m in (0o600, 0o640, 0o660, 0o644)] == \
        [0o700, 0o750, 0o770, 0o755]


def test_a_new_store_is_owner_only_whatever_the_umask(tmp_path: Path, umask: int,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    top = tmp_path / "parent"
    store = top / "missing" / "store"  # parents kvstore creates are private too
    build(store)
    assert set(modes(store)) >= STORE_FILES
    assert modes(top) == expect(top, 0o600)
    assert os.umask(umask) == umask  # the store did not change the process umask
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_rebuild_index_leaves_owner_only_files(tmp_path: Path, umask: int) -> None:
    build(tmp_path / "s")
    report = fsck.rebuild_index(str(tmp_path / "s"))
    assert report.blocks == len(BLOCKS)
    got = modes(tmp_path / "s")
    assert any(r.startswith("index.broken-") for r in got)  # the old index, kept aside
    assert got == expect(tmp_path / "s", 0o600)


def test_demo_manifest_is_owner_only(tmp_path: Path, umask: int) -> None:
    store = tmp_path / "cache" / "kvstore" / "demo"
    permissions.make_dirs(str(store))
    write_manifest(str(store), "quick", {"ab": 1})
    manifest = store / MANIFEST
    assert json.loads(manifest.read_text())["checksums"] == {"ab": 1}
    assert modes(tmp_path / "cache") == expect(tmp_path / "cache", 0o600)
    manifest.chmod(0o644)  # a manifest of an older demo run is replaced owner-only
    write_manifest(str(store), "quick", {"cd": 2})
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600


def test_a_wider_mode_on_purpose(tmp_path: Path, umask: int,
                                 caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "s"
    build(store, 3, file_mode=0o660)
    assert modes(store) == expect(store, 0o660)
    build(store, 3, 3)  # reopened without the option: the recorded mode is kept
    assert "extents/00000002.kvx" in modes(store)
    assert modes(store) == expect(store, 0o660)
    assert fsck.check(str(store)).findings == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    build(store, 0, file_mode=0o600)  # and narrowed on purpose
    assert modes(store) == expect(store, 0o600)
    assert fsck.check(str(store)).findings == []


@pytest.mark.parametrize("mode, message", [
    (0o755, "bits other than read/write"), (0o400, "owner read and write"),
    (0o666, "every local user rewrite"), (0o4600, "bits other than read/write"),
    (True, "must be an int"), ("0o600", "must be an int")])
def test_a_bad_file_mode_is_refused_before_anything_is_made(tmp_path: Path, mode: object,
                                                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(tmp_path / "s", file_mode=mode)
    assert not (tmp_path / "s").exists()


def test_opening_a_loose_store_warns_with_the_fix(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "s"
    build(store)
    loosen(store)
    before = modes(store)
    caplog.set_level(logging.WARNING, logger="kvstore")
    build(store, 0)
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.name == "kvstore.permissions"
    text = record.getMessage()
    assert f"other users can reach the store at {store}" in text
    for rel in ("LOCK", "index/data.mdb", "extents/00000001.kvx"):
        assert f"{store / rel} (0644: group can read, others can read; want 0600)" in text
    assert f"{store / 'index'} (0755: group can read+search, others can read+search" in text
    assert f"fix: chmod -R go= {store}" in text and "fsck" in text
    assert modes(store) == before  # a warning changes nothing


def test_strict_refuses_a_loose_store(tmp_path: Path) -> None:
    store = tmp_path / "s"
    build(store)
    (store / "extents" / "00000001.kvx").chmod(0o640)
    with pytest.raises(kvstore.InsecurePermissionsError, match="group can read") as info:
        build(store, 0, strict_permissions=True)
    assert isinstance(info.value, PermissionError)
    assert "nothing was changed" in str(info.value)
    assert stat.S_IMODE((store / "extents" / "00000001.kvx").stat().st_mode) == 0o640
    build(store, 0)  # the refused open released the store


def test_fsck_reports_loose_permissions_and_repair_tightens_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "s"
    build(store)
    loosen(store)
    report = fsck.check(str(store))
    loose = [f for f in report.findings if f.kind == "loose-permissions"]
    assert {f.detail.split(" (")[0] for f in loose} == {str(store / r) for r in modes(store)}
    assert report.exit_code == 1 and all(f.severity == fsck.DAMAGE for f in loose)
    assert cli(["fsck", str(store)]) == 1
    out = capsys.readouterr().out
    assert "loose-permissions" in out and f"{store / 'LOCK'} (0644" in out

    fixed = fsck.check(str(store), repair=True)
    assert fixed.findings and all(f.fixed for f in fixed.findings)
    assert modes(store) == expect(store, 0o600)
    assert fsck.check(str(store)).findings == []
    build(store, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_fsck_repairs_to_the_stores_own_wider_mode(tmp_path: Path) -> None:
    store = tmp_path / "s"
    build(store, file_mode=0o640)
    (store / "index" / "data.mdb").chmod(0o644)
    (store / "extents").chmod(0o775)
    report = fsck.check(str(store))
    assert len(report.findings) == 2 and {f.kind for f in report.findings} == {"loose-permissions"}
    assert "others can read; want 0640" in report.findings[0].detail + report.findings[1].detail
    fsck.check(str(store), repair=True)
    assert modes(store) == expect(store, 0o640)
    assert fsck.check(str(store)).findings == []


def test_a_damaged_mode_record_is_refused_and_fsck_drops_it(tmp_path: Path) -> None:
    build(tmp_path, 1, file_mode=0o640)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(permissions.META_FILE_MODE, b"\x00\x07\x00\x00", db=meta)
    env.close()
    with pytest.raises(kvstore.IndexCorruptionError, match="file_mode record is damaged"):
        build(tmp_path, 0)
    report = fsck.check(str(tmp_path), repair=True)
    assert "meta" in {f.kind for f in report.findings}  # and the 0640 files: now loose
    assert fsck.check(str(tmp_path)).findings == []
    assert modes(tmp_path) == expect(tmp_path, 0o600)


def test_files_of_another_user_are_flagged(tmp_path: Path) -> None:
    build(tmp_path)  # as if the store belonged to the next uid: every path is foreign
    other = os.geteuid() + 1
    loose = permissions.audit(str(tmp_path), uid=other)
    assert {p.path for p in loose} == {str(tmp_path / r) for r in modes(tmp_path)}
    assert all(p.foreign and not p.extra_bits for p in loose)
    text = permissions.describe(str(tmp_path), loose, 0o600)
    assert f"not uid {other}" in text and f"chown -R {other} {tmp_path}" in text
    # a group-shared store may hold files of other members: ownership is not checked
    assert permissions.audit(str(tmp_path), 0o660, uid=other) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_a_file_owned_by_another_user_is_warned_about_and_left_to_root(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "s"
    build(store)
    planted = store / "extents" / "00000002.kvx"
    os.chown(planted, 65534, 65534)
    caplog.set_level(logging.WARNING, logger="kvstore")
    build(store, 0)
    assert f"{planted} (0600: owned by uid 65534" in caplog.text
    report = fsck.check(str(store), repair=True)
    [finding] = report.findings
    assert finding.kind == "foreign-owner" and not finding.fixed and report.exit_code == 1
    assert planted.stat().st_uid == 65534  # fsck never chowns: someone must look first


def test_the_vllm_connector_passes_the_mode_on(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra({"path": str(tmp_path), "file_mode": "0660",
                                         "strict_permissions": True})
    options = config.open_options()
    assert (options["file_mode"], options["strict_permissions"]) == (0o660, True)
    assert ConnectorConfig.from_extra({"path": "/x"}).open_options()["file_mode"] is None
    with pytest.raises(ValueError, match="kvstore connector: file_mode 0o755"):
        ConnectorConfig.from_extra({"path": "/x", "file_mode": 0o755})
    with pytest.raises(ValueError, match="strict_permissions must be true or false"):
        ConnectorConfig.from_extra({"path": "/x", "strict_permissions": "yes"})
