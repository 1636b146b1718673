"""A forked child does not keep the store locked (issue 31, a sibling of item 4).

A ``flock`` belongs to the open file description, which a child shares through its copy
of the descriptor: the lock dropped only when the last copy closed, so a child that ran
on (a worker process) kept the store locked after the parent had closed it.  The child
now closes its copy at fork, which never unlocks the parent's store while it is open.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

import kvstore


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_running_child_neither_keeps_the_lock_nor_takes_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        held_r, held_w = os.pipe()
        report_r, report_w = os.pipe()
        async with kvstore.open(tmp_path):
            pid = os.fork()
            if pid == 0:  # the child: reports, then runs on until the parent says
                try:
                    os.write(report_w, b"up")
                    os.read(held_r, 1)
                finally:
                    os._exit(0)
            assert os.read(report_r, 2) == b"up"
            # Still the parent's: another opener is refused while it is open.
            with pytest.raises(kvstore.StoreLockedError):
                async with kvstore.open(tmp_path):
                    pass
        try:
            # Closed by the parent while the child still runs: free for the next one.
            async with kvstore.open(tmp_path) as again:
                assert again.stats().blocks == 0
        finally:
            os.write(held_w, b"x")
            _, status = os.waitpid(pid, 0)
            for fd in (held_r, held_w, report_r, report_w):
                os.close(fd)
        assert os.waitstatus_to_exitcode(status) == 0

    anyio.run(scenario)
