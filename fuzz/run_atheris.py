"""Run one fuzz target under atheris (coverage-guided libFuzzer for Python).

Usage (from the repository root)::

    python fuzz/run_atheris.py --list
    python fuzz/run_atheris.py slot_header -runs=100000
    python fuzz/run_atheris.py slot_header --corpus /tmp/kvs-corpus/slot_header -max_total_time=60

Everything after the target name other than the two options below is handed to
libFuzzer as is (``-runs=N``, ``-max_len=N``, ``-max_total_time=S``,
``-artifact_prefix=DIR/``, corpus directories).

``--corpus DIR``
    create ``DIR``, write the target's seed corpus into it (valid encodings from
    ``fuzz.targets.SEEDS``) and let libFuzzer grow it there.
``--keep-going``
    do not stop at the first crash: print each new *kind* of crash (exception type and
    the line that raised it) once, with its input, and continue.  For triaging a target
    whose decoder is known to be broken (the namespace targets today), where libFuzzer
    would otherwise stop at the first input.  libFuzzer's own ``-fork``/
    ``-ignore_crashes`` do not work with this runner (children cannot re-execute it).

Why a separate runner: atheris must instrument kvstore's modules as they are
imported to get coverage feedback, so it has to import them itself, inside
``atheris.instrument_imports()``, before anything else has.
"""

from __future__ import annotations

import hashlib
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _usage(names: list[str]) -> str:
    return (f"usage: {sys.argv[0]} TARGET [--corpus DIR] [--keep-going] [libFuzzer flags...]\n"
            f"targets: {', '.join(names)}")


def _write_seeds(corpus: Path, seeds: list[bytes]) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    for seed in seeds:  # content-addressed names, as libFuzzer itself names inputs
        (corpus / hashlib.sha1(seed).hexdigest()).write_bytes(seed)


def _keep_going(target: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """Wrap ``target`` so that every exception is reported once per kind and swallowed."""
    seen: set[tuple[str, str, int]] = set()

    def wrapped(data: bytes) -> None:
        try:
            target(data)
        except Exception as e:  # noqa: BLE001 - reporting every kind is the point
            frame = traceback.extract_tb(e.__traceback__)[-1]
            kind = (type(e).__name__, frame.filename, frame.lineno or 0)
            if kind not in seen:
                seen.add(kind)
                print(f"\n=== new crash kind #{len(seen)}: {type(e).__name__}: {e}\n"
                      f"    raised at {frame.filename}:{frame.lineno}\n"
                      f"    input ({len(data)} bytes): {data[:200]!r}", flush=True)

    return wrapped


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))  # run as a script: make `fuzz` and `kvstore` importable
    try:
        import atheris  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        print("atheris is not installed; `pip install atheris` (wheels exist for CPython "
              "3.8-3.11 on Linux x86-64; elsewhere it builds from source and needs clang "
              "with libFuzzer).  Without it, `pytest tests/test_fuzz.py` drives the same "
              "targets with Hypothesis.", file=sys.stderr)
        return 2

    with atheris.instrument_imports(include=["kvstore", "fuzz"]):
        from fuzz.targets import SEEDS, TARGETS

    names = sorted(TARGETS)
    args = argv[1:]
    if args[:1] == ["--list"]:
        print("\n".join(names))
        return 0
    if not args or args[0] in ("-h", "--help"):
        print(_usage(names), file=sys.stderr if not args else sys.stdout)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in TARGETS:
        print(f"unknown target {name!r}\n{_usage(names)}", file=sys.stderr)
        return 2
    if "--corpus" in rest:
        i = rest.index("--corpus")
        if i + 1 >= len(rest):
            print("--corpus needs a directory", file=sys.stderr)
            return 2
        corpus = Path(rest[i + 1])
        _write_seeds(corpus, SEEDS.get(name, [b""]))
        rest = [*rest[:i], *rest[i + 2:], str(corpus)]
    target = TARGETS[name]
    if "--keep-going" in rest:
        rest.remove("--keep-going")
        target = _keep_going(target)

    atheris.Setup([argv[0], *rest], target)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
