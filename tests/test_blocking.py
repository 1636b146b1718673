"""The blocking facade (kvstore/blocking.py): what a synchronous script sees."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kvstore
import kvstore.remote
from kvstore import blocking
from kvstore.codecs.pipeline import CodecSpec
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor, same

ROOT = Path(__file__).resolve().parents[1]


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.float16, (2, 4, 64), seed=i)


def test_blocking_roundtrip(tmp_path: Path) -> None:
    key = NS.chain_keys(list(range(16)))[0]
    value = torch.arange(64, dtype=torch.float16)
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        assert store.put(key, value)
        assert store.contains(key)
        got = store.get(key)
        assert got is not None and torch.equal(got, value)
        assert store.stats().blocks == 1


def test_script_that_never_closes_exits_and_keeps_its_puts(tmp_path: Path) -> None:
    """A script that opens with open_blocking() and exits without close() used to hang at
    interpreter exit; it must exit 0, with its acknowledged put stored and the lock free."""
    script = textwrap.dedent(f"""
        import sys, torch, kvstore
        from tests.conformance import NS
        store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes={SMALL_EXTENT})
        store.put(NS.chain_keys(list(range(16)))[0], torch.arange(64, dtype=torch.float16))
        print("put acknowledged", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "put acknowledged" in proc.stdout
    # closed at exit: the lock is free and the block reads back
    with kvstore.open_blocking(tmp_path, namespace=NS, create=False) as store:
        got = store.get(NS.chain_keys(list(range(16)))[0])
        assert got is not None and torch.equal(got, torch.arange(64, dtype=torch.float16))


# ---------------------------------------------------------------- the same API as Store

def _public_members(cls: type) -> dict[str, object]:
    return {name: inspect.getattr_static(cls, name) for name in dir(cls)
            if not name.startswith("_")}


def test_blocking_store_offers_every_store_method_with_the_same_parameters() -> None:
    """Every public ``Store`` method (coroutine or not) has a synchronous twin of the same
    name (``aclose`` is ``close``) taking the same parameters: names, kinds and defaults.
    A method added to ``Store`` fails here until ``BlockingStore`` mirrors it."""
    store_members = _public_members(kvstore.Store)
    blocking_members = _public_members(kvstore.BlockingStore)
    methods = {n: m for n, m in store_members.items() if inspect.isfunction(m)}
    assert {"put_many", "get_many", "prefetch", "stats", "aclose"} <= set(methods)
    for name, method in methods.items():
        twin_name = "close" if name == "aclose" else name
        twin = blocking_members.get(twin_name)
        assert inspect.isfunction(twin), f"BlockingStore lacks {twin_name}() (Store.{name})"
        assert not inspect.iscoroutinefunction(twin), f"BlockingStore.{twin_name} is async"
        want = [(p.name, p.kind, p.default)
                for p in inspect.signature(method).parameters.values()]
        got = [(p.name, p.kind, p.default)
               for p in inspect.signature(twin).parameters.values()]
        assert got == want, f"BlockingStore.{twin_name} differs from Store.{name}"
    for name, member in store_members.items():
        if isinstance(member, property):
            assert isinstance(blocking_members.get(name), property), \
                f"BlockingStore lacks the property {name}"


def test_put_many_takes_codec_and_background(tmp_path: Path) -> None:
    ks = keys(3, 100)
    blocks = [block(i) for i in range(3)]
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        result = store.put_many(ks[:2], blocks[:2], parents=kvstore.chain_parents(ks[:2]),
                                codec=CodecSpec(zstd=True))
        assert result.written == 2
        result = store.put_many(ks, blocks, parents=kvstore.chain_parents(ks),
                                background=True)
        assert result.written == 1 and result.dropped == 0
        got = store.get_many(ks)
        assert all(same(g, b) for g, b in zip(got, blocks))
        assert store.capacity_bytes > 0 and store.used_bytes > 0 and not store.read_only


def test_prefetch_brings_blocks_into_memory_and_gets_are_then_memory_hits(
        tmp_path: Path) -> None:
    ks = keys(4, 200)
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        store.put_many(ks, [block(i) for i in range(4)], parents=kvstore.chain_parents(ks))
    # reopened: the memory tier starts empty, the blocks are on disk only
    with kvstore.open_blocking(tmp_path, namespace=NS, create=False,
                               memory_bytes=4 << 20) as store:
        handle = store.prefetch(ks + keys(1, 990))  # one key that is not stored
        assert isinstance(handle, blocking.BlockingPrefetch)
        assert handle.wait() == 4
        assert handle.done and handle.requested == 5 and handle.scheduled == 4
        handle.cancel()  # idempotent on a finished prefetch
        got = store.get_many(ks)
        st = store.stats()
        late = store.prefetch(ks)  # cached already: nothing to read
    assert all(same(g, block(i)) for i, g in enumerate(got))
    assert st.prefetch_blocks == 4 and st.memory_hits == 4
    assert late.wait() == 0  # a finished handle still answers after close


def test_prefetch_without_a_memory_tier_raises_as_store_does(tmp_path: Path) -> None:
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store, \
            pytest.raises(ValueError, match="memory tier"):
        store.prefetch(keys(1))


def test_every_call_after_close_raises_store_closed_error(tmp_path: Path) -> None:
    key = keys(1)[0]
    value = block(0)
    store = kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT)
    store.put(key, value)
    store.close()
    store.close()  # idempotent
    calls: dict[str, Callable[[], object]] = {
        "put_many": lambda: store.put_many([key], [value]),
        "get_many": lambda: store.get_many([key]),
        "prefetch": lambda: store.prefetch([key]),
        "contains_many": lambda: store.contains_many([key]),
        "match_prefix": lambda: store.match_prefix([key]),
        "delete_many": lambda: store.delete_many([key]),
        "pin": lambda: store.pin([key]),
        "unpin": lambda: store.unpin([key]),
        "put": lambda: store.put(key, value),
        "get": lambda: store.get(key),
        "contains": lambda: store.contains(key),
        "delete": lambda: store.delete(key),
        "stats": store.stats,
        "attach_remote": lambda: store.attach_remote(
            kvstore.remote.RemoteConfig(bucket="b"), NS),
    }
    for name, call in calls.items():
        try:
            call()
        except kvstore.StoreClosedError:
            continue
        pytest.fail(f"{name}() after close() did not raise StoreClosedError")
    assert not store.read_only  # properties answer after close, as Store's do


def test_a_call_let_in_before_close_ends_on_the_live_loop(tmp_path: Path) -> None:
    """A call that passed the closed check just before another thread closed the store
    must end with StoreClosedError from the store, not the raw RuntimeError of a portal
    stopped under it: close() waits for such calls before it stops the loop.

    Deterministic: the call is parked right before it enters the portal, and let go
    when close() waits for it (fixed) or right after close() stopped the portal (the
    race as it was)."""
    key = keys(1)[0]
    store = kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT)
    store.put(key, block(0))
    parked, go = threading.Event(), threading.Event()
    real = store._portal
    late_result: list[object] = []

    class ParkingPortal:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def start_task_soon(self, func: Callable[..., Any], *args: Any) -> Any:
            if threading.current_thread() is late:  # the late call's hand-over
                parked.set()
                assert go.wait(60)
            return real.start_task_soon(func, *args)

        def call(self, func: Callable[..., Any], *args: Any) -> Any:
            if func == real.stop:  # stopping with the late call still parked
                try:
                    return real.call(func, *args)
                finally:
                    go.set()
            return real.call(func, *args)

    class SignallingCondition(threading.Condition):
        def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None
                     ) -> Any:
            go.set()  # close() waits for the calls let in: let the parked one go on
            return super().wait_for(predicate, timeout)

    def late_call() -> None:
        try:
            late_result.append(store.contains(key))
        except BaseException as e:  # noqa: BLE001 - judged by the test
            late_result.append(e)

    store._portal = ParkingPortal()  # type: ignore[assignment]
    store._handoff._portal = store._portal  # (calls go to the loop through it)
    store._cond = SignallingCondition()
    late = threading.Thread(target=late_call)
    late.start()
    assert parked.wait(60)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(timeout=60)
    late.join(timeout=60)
    assert not closer.is_alive() and not late.is_alive()
    assert len(late_result) == 1 and isinstance(late_result[0], kvstore.StoreClosedError), \
        late_result


# ---------------------------------------------------------------- fork

_FORK_SCRIPT = """
import os, select, signal, sys, subprocess, torch, kvstore
from tests.conformance import NS, keys, make_tensor, same
block = lambda i: make_tensor(torch.float16, (2, 4, 64), seed=i)

path = sys.argv[1]
ks = keys(2, 300)
store = kvstore.open_blocking(path, namespace=NS, extent_bytes={extent})
store.put_many(ks[:1], [block(0)])


def wait_child(pid, timeout):
    # bounded wait on the child: a hang is reported, never waited out
    fd = os.pidfd_open(pid)
    try:
        if not select.select([fd], [], [], timeout)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung"
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        os.close(fd)


def snapshot():
    return sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                  for e in os.scandir(path) if e.is_file())


# 1. a child that calls the inherited store: a clear error at once, then a clean exit
before = snapshot()
pid = os.fork()
if pid == 0:
    try:
        store.get(ks[0])
    except kvstore.errors.StoreForkedError as e:
        assert isinstance(e, kvstore.StoreClosedError) and "open_blocking" in str(e), e
    else:
        os._exit(3)
    for call in (lambda: store.put_many(ks[1:], [block(1)]), store.stats,
                 lambda: store.prefetch(ks)):
        try:
            call()
        except kvstore.errors.StoreForkedError:
            pass
        else:
            os._exit(4)
    store.close()  # the parent's store: nothing to release here, returns at once
    sys.exit(0)  # a normal exit: atexit handlers run and must skip the parent's store
print("child that called:", wait_child(pid, {timeout}), flush=True)
assert snapshot() == before, "the child touched the store's files"

# 2. a child that only exits (the atexit close used to hang on the parent's portal)
pid = os.fork()
if pid == 0:
    sys.exit(0)
print("child that exited:", wait_child(pid, {timeout}), flush=True)
assert snapshot() == before, "the child touched the store's files"

# the parent's store is untouched: still open, still locked, still serving
assert store.put_many(ks[1:], [block(1)]).written == 1
assert all(same(g, block(i)) for i, g in enumerate(store.get_many(ks)))
other = subprocess.run(
    [sys.executable, "-c",
     "import sys, kvstore\\n"
     "from tests.conformance import NS\\n"
     "try:\\n"
     "    kvstore.open_blocking(sys.argv[1], namespace=NS, create=False, exclusive=True)\\n"
     "except kvstore.StoreLockedError:\\n"
     "    print('locked')\\n", path],
    capture_output=True, text=True, timeout=60)
print("another process:", other.stdout.strip(), other.stderr.strip()[-500:], flush=True)
store.close()
with kvstore.open_blocking(path, namespace=NS, create=False) as again:
    assert all(same(g, block(i)) for i, g in enumerate(again.get_many(ks)))
print("parent done", flush=True)
"""


def test_a_forked_child_neither_hangs_nor_touches_the_parents_store(tmp_path: Path) -> None:
    """A child forked from a process with an open BlockingStore: a call on the inherited
    store raises StoreForkedError at once (it used to hang on the parent's portal), and
    its exit does not hang in the atexit close; the parent keeps its lock and its files.
    The fork happens in a subprocess, so the test process never forks with threads."""
    script = _FORK_SCRIPT.format(extent=SMALL_EXTENT, timeout=30)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert "child that called: 0" in out, (out, proc.stderr)
    assert "child that exited: 0" in out, (out, proc.stderr)
    assert "another process: locked" in out, (out, proc.stderr)
    assert "parent done" in out and proc.returncode == 0, (out, proc.stderr)


def test_fork_forgets_the_parents_stores_in_the_child(tmp_path: Path) -> None:
    """The registry the atexit handler closes is reset in a forked child (and an entry
    from another pid would be skipped anyway)."""
    store = kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT)
    try:
        assert store in blocking._OPEN
        blocking._after_fork_in_child()
        assert store not in blocking._OPEN
    finally:
        blocking._OPEN.add(store)  # it is this process's: restore, then close
        store.close()
    assert store not in blocking._OPEN


# ---------------------------------------------------------------- the bridge for connectors

def test_call_runs_a_composed_coroutine_on_the_loop(tmp_path: Path) -> None:
    ks = keys(3, 300)
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        async def put_then_match(n: int) -> int:
            await store.store.put_many(ks[:n], [block(i) for i in range(n)])
            return await store.store.match_prefix(ks)

        assert store.call(put_then_match, 2) == 2
    with pytest.raises(kvstore.StoreClosedError):
        store.call(put_then_match, 1)


def test_close_waits_for_every_submitted_call(tmp_path: Path) -> None:
    """A submitted save is a call in flight: ``close()`` returns only once every future
    is done, and each one that answered a ``PutResult`` is stored."""
    ks = keys(16, 400)
    store = kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT)
    futures = [store.submit(store.store.put_many, [k], [block(i)]) for i, k in enumerate(ks)]
    store.close()
    assert all(f.done() for f in futures)
    acknowledged = [k for k, f in zip(ks, futures) if f.exception() is None]
    assert all(isinstance(f.exception(), kvstore.StoreClosedError)
               for f in futures if f.exception() is not None)
    with pytest.raises(kvstore.StoreClosedError):
        store.submit(store.store.put_many, ks[:1], [block(0)])
    with kvstore.open_blocking(tmp_path, namespace=NS, create=False) as reopened:
        assert reopened.contains_many(acknowledged) == [True] * len(acknowledged)


def test_open_blocking_takes_store_options_as_open_does(tmp_path: Path) -> None:
    """``open_blocking(path, options, **fields)`` has ``kvstore.open``'s parameters: one
    ``StoreOptions``, keywords beside it replacing its fields (an engine connector's
    config holds a ``StoreOptions``)."""
    want = [(p.name, p.kind, p.default)
            for p in inspect.signature(kvstore.open).parameters.values()]
    got = [(p.name, p.kind, p.default)
           for p in inspect.signature(kvstore.open_blocking).parameters.values()]
    assert got == want
    options = kvstore.StoreOptions(namespace=NS, extent_bytes=SMALL_EXTENT, sync=False)
    with kvstore.open_blocking(tmp_path, options, sync=True) as store:
        assert store.store.options == kvstore.StoreOptions.of(options, sync=True)
        assert store.put(keys(1, 500)[0], block(0))
    with pytest.raises(TypeError, match="unknown store option"):
        kvstore.open_blocking(tmp_path, options, no_such_option=1)


def test_close_finishes_a_submitted_call_before_closing_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A submitted save that is still waiting for its data when ``close()`` starts (the
    vLLM connector's waits for the copy out of the KV cache) is finished, not refused:
    ``close()`` waits for submitted calls before it closes the store.  Deterministic: the
    save is let go from inside ``close()``'s wait for it."""
    import anyio

    ks = keys(1, 600)
    gate = threading.Event()
    real_wait = blocking.wait

    def wait_then_let_go(futures: Any) -> Any:
        gate.set()  # close() has begun and waits for the submitted save
        return real_wait(futures)

    monkeypatch.setattr(blocking, "wait", wait_then_let_go)
    store = kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT)

    async def save_when_let_go() -> kvstore.PutResult:
        # (the timeout only keeps a regression from hanging the suite)
        await anyio.to_thread.run_sync(lambda: gate.wait(timeout=60))
        return await store.store.put_many(ks, [block(0)])

    future = store.submit(save_when_let_go)
    store.close()
    assert gate.is_set()
    assert future.result().written == 1
    with kvstore.open_blocking(tmp_path, namespace=NS, create=False) as reopened:
        assert reopened.contains_many(ks) == [True]


def test_submit_returns_while_the_loop_is_busy_and_runs_calls_in_order(tmp_path: Path) -> None:
    """``submit`` hands the call over without waiting for the loop to take it (an engine
    step that submits its save must not wait behind the loop): with the loop thread held
    in a synchronous call, ``submit`` still returns; a call cancelled before the loop
    took it never runs; the rest run in the order submitted once the loop is free."""
    ks = keys(3, 700)
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        held, release = threading.Event(), threading.Event()

        async def hold_the_loop() -> None:
            held.set()
            # the loop's thread itself waits: nothing else runs on the loop meanwhile
            # (the timeout only keeps a regression from hanging the suite)
            release.wait(timeout=60)

        holder = store.submit(hold_the_loop)
        assert held.wait(timeout=60)
        ran: list[int] = []

        async def put(i: int) -> kvstore.PutResult:
            ran.append(i)
            return await store.store.put_many([ks[i]], [block(i)])

        submitted = threading.Event()
        futures: list[Any] = []

        def submit_all() -> None:
            futures.extend(store.submit(put, i) for i in range(3))
            submitted.set()

        threading.Thread(target=submit_all, daemon=True).start()
        assert submitted.wait(timeout=60)   # before: waited for the held loop, forever
        assert not release.is_set() and ran == []
        assert futures[1].cancel()          # not taken by the loop yet: never runs
        release.set()
        holder.result()
        assert futures[0].result().written == 1 and futures[2].result().written == 1
        assert futures[1].cancelled() and ran == [0, 2]
        assert store.contains_many(ks) == [True, False, True]
