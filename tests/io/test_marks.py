"""``PATH/owners/marks`` and its native fence helper (kvstore/io/marks.py,
kvstore/_native/marks.c; issue 43): a mark one process publishes is in the minimum
another process computes, cleared marks do not count, the header is checked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import FormatVersionError, StoreLockedError
from kvstore.io import marks
from kvstore.io.marks import NO_MARK, SLOTS, MarksFile, marks_path

pytestmark = pytest.mark.skipif(not marks.native()[0], reason=marks.native()[1])

CHILD = textwrap.dedent("""
    import sys
    from kvstore.io.marks import MarksFile
    f = MarksFile.open(sys.argv[1])
    f.publish(int(sys.argv[2]), int(sys.argv[3]))
    print(f.minimum(), flush=True)
    f.close()
""")


def store_dir(tmp_path: Path) -> str:
    (tmp_path / "owners").mkdir(exist_ok=True)
    return str(tmp_path)


def test_a_mark_published_in_another_process_is_in_the_minimum(tmp_path: Path) -> None:
    path = store_dir(tmp_path)
    here = MarksFile.open(path)
    try:
        assert here.minimum() == NO_MARK
        here.publish(1, 500)
        out = subprocess.run([sys.executable, "-c", CHILD, path, "7", "42"], check=True,
                             capture_output=True, text=True, cwd=os.getcwd()).stdout
        assert out == "42\n"  # the child saw this process's 500 and its own 42
        assert here.minimum() == 42 and here.mark(7) == 42
        here.publish(7, 0)  # (whoever finds that owner dead clears its slot)
        assert here.minimum() == 500
        here.publish(1, 0)
        assert here.minimum() == NO_MARK
    finally:
        here.close()
    assert os.path.getsize(marks_path(path)) == marks.HEADER_BYTES + 8 * SLOTS


@given(writes=st.lists(st.tuples(st.integers(1, SLOTS), st.integers(0, 2**64 - 2)),
                       max_size=40))
def test_the_minimum_is_the_smallest_mark_in_use(tmp_path_factory: pytest.TempPathFactory,
                                                  writes: list[tuple[int, int]]) -> None:
    path = store_dir(tmp_path_factory.mktemp("marks"))
    f = MarksFile.open(path)
    try:
        model: dict[int, int] = {}
        for slot, value in writes:
            f.publish(slot, value)
            model[slot] = value
            assert f.minimum() == min((v for v in model.values() if v), default=NO_MARK)
    finally:
        f.close()


def test_a_file_of_another_format_is_refused_not_overwritten(tmp_path: Path) -> None:
    path = store_dir(tmp_path)
    with open(marks_path(path), "wb") as out:
        out.write(b"KVSMARKS" + (2).to_bytes(4, "little") + bytes(52))
    with pytest.raises(FormatVersionError, match="delete it while no process"):
        MarksFile.open(path)
    with open(marks_path(path), "rb") as f:
        assert f.read(12)[8:] == (2).to_bytes(4, "little")


def test_without_the_native_helper_marks_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(marks, "_lib", None)
    monkeypatch.setattr(marks, "_reason", "disabled by a test")
    assert marks.native() == (False, "disabled by a test")
    with pytest.raises(StoreLockedError, match="native fence helper: disabled by a test"):
        MarksFile.open(store_dir(tmp_path))
    assert not os.path.exists(marks_path(str(tmp_path)))
