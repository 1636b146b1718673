"""The package's import graph has no circles and no upward imports, and optional parts
stay unloaded.

Every ``import`` / ``from ... import`` in ``kvstore/`` counts, at module level, inside
functions (deferred imports) and under ``TYPE_CHECKING``: a deferred or type-only import
still says that one module knows the other, and a circle of such knowledge is what made
the store and its remote adapter one piece.  ``from kvstore import codecs`` counts as an
import of ``kvstore.codecs.pipeline``, not of the package's ``__init__``.  No new dependency: the
graph comes from the standard ``ast`` module.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir``."""
    base = package_dir.parent
    mods = {}
    for path in package_dir.rglob("*.py"):
        name = ".".join(path.relative_to(base).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imported(node: ast.AST, module: str, is_package: bool, mods: dict[str, Path]
              ) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        for alias in node.names:
            full = f"{base}.{alias.name}"
            yield full if full in mods else base


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its source)."""
    mods = _modules(package_dir)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            for name in _imported(node, module, path.name == "__init__.py", mods):
                while name and name not in mods:  # an attribute of a module: the module
                    name = name.rpartition(".")[0]
                # a module importing its own package's __init__ is not a circle of ideas
                if name and name != module and not module.startswith(name + "."):
                    graph[module].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# floor -> kvstore's modules on it, relative to the package ("__init__" is the package
# itself).  A name covers the module and everything below it; the longest name wins
# ("remote" is floor 2, "remote.config" floor 0).  Extend by adding names.
FLOORS: dict[int, str] = {
    # 0: words: errors, the on-disk format, keys, plain values; no behaviour to speak of
    0: "errors disk.format keys disk.permissions codecs.tensors core.latency index.totals _native.lib _native "
       "codecs.result_buffers tiers.remote.config tiers.remote.stats",
    # 1: mechanisms: I/O engines and buffers, the index, codecs, slot bytes, extent files
    1: "io codecs.pipeline codecs.fp8_kernels io.slots io.native_slots index.index index.writer index.free_map index.eviction "
       "disk.extents disk.lock io.group_sync index.quarantine",
    # 2: the store's parts: space, transfers, tiers' machinery, options, the GPU path
    2: "core.allocator io.transfers tiers.memory.tier tiers.memory.prefetch core.backlog core.deletes core.operations stats options "
       "io.page_locking pinning cuda remote",
    # 3: the store: the coordinator, its call paths, and the tiers it hands a port to
    3: "store core.opening core.puts core.gets core.reads tiers tiers.remote.adapter core.rechecks core.scrub",
    # 4: users of the store: the package's front, the blocking bridge, tools, engines
    4: "__init__ __main__ blocking metrics tools.fsck tools.fsck_files tools.fsck_rebuild tools.fsck_report tools.cli "
       "integrations",
}


def floor_table(package: str, floors: Mapping[int, str]) -> dict[str, int]:
    """Dotted name -> floor, from a table like :data:`FLOORS`."""
    return {package if name == "__init__" else f"{package}.{name}": floor
            for floor, names in floors.items() for name in names.split()}


def floor_of(module: str, table: Mapping[str, int]) -> int | None:
    """The floor of the longest listed name that is ``module`` or a package above it
    (the package itself only by its own entry); None when nothing covers it."""
    name = module
    while name:
        if name in table and (name == module or "." in name):
            return table[name]
        name = name.rpartition(".")[0]
    return None


def upward_imports(graph: dict[str, set[str]], table: Mapping[str, int]
                   ) -> tuple[list[str], dict[str, str]]:
    """The imports from a floor to a higher one, and the modules no floor covers (each
    with the floors that would fit it: at or above what it imports, at or below its
    importers)."""
    upward, unlisted = [], {}
    for module in sorted(graph):
        here = floor_of(module, table)
        if here is None:
            low = max((f for m in graph[module] if (f := floor_of(m, table)) is not None),
                      default=0)
            high = min((f for m, imported in graph.items() if module in imported
                        if (f := floor_of(m, table)) is not None), default=max(table.values()))
            unlisted[module] = f"floor {low}" + (f"..{high}" if high > low else "") \
                if low <= high else f"no floor: imports floor {low}, imported by floor {high}"
            continue
        for imported in sorted(graph[module]):
            there = floor_of(imported, table)
            if there is not None and there > here:
                upward.append(f"{module} (floor {here}) imports {imported} (floor {there})")
    return upward, unlisted


def test_the_package_has_no_import_circles() -> None:
    assert circles(import_graph(ROOT / "kvstore")) == []


def test_a_deliberate_circle_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n")
    (pkg / "c.py").write_text("def f():\n    from .a import x\n")  # deferred, relative
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("X = 1\n")
    assert circles(import_graph(pkg)) == []


def test_no_module_imports_from_a_higher_floor() -> None:
    upward, unlisted = upward_imports(import_graph(ROOT / "kvstore"),
                                      floor_table("kvstore", FLOORS))
    if unlisted:
        warnings.warn("modules on no floor yet (add them to FLOORS in tests/test_imports.py): "
                      + "; ".join(f"{m}: {fit}" for m, fit in unlisted.items()), stacklevel=1)
    assert upward == []


def test_a_deliberate_upward_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.top import run\n")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "words.py").write_text("X = 1\n")
    (pkg / "middle.py").write_text("from pkg.low.words import X\n")
    (pkg / "top.py").write_text("from pkg import middle\n")
    (pkg / "new.py").write_text("from pkg import middle\n")  # on no floor yet
    floors = {0: "low", 1: "middle", 2: "top __init__"}
    table = floor_table("pkg", floors)
    assert upward_imports(import_graph(pkg), table) == ([], {"pkg.new": "floor 1..2"})
    # a deferred import of a higher floor (the way a circle starts) counts
    (pkg / "low" / "words.py").write_text("X = 1\ndef f():\n    from pkg.middle import Y\n")
    assert upward_imports(import_graph(pkg), table)[0] == [
        "pkg.low.words (floor 0) imports pkg.middle (floor 1)"]
    # and so does a type-only one, also from a module on no floor to a lower one's...
    (pkg / "low" / "words.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import new\n")
    assert upward_imports(import_graph(pkg), table) == (
        [], {"pkg.new": "no floor: imports floor 1, imported by floor 0"})
    assert circles(import_graph(pkg)) == [["pkg.low.words", "pkg.middle", "pkg.new"]]


def test_import_kvstore_leaves_the_optional_parts_unloaded() -> None:
    """CUDA (with the first store that page-locks), the remote tier's machinery (with
    the first store opened with ``remote=``), metrics (prometheus_client) and the engine
    integrations load only for those who use them.  The remote tier's options and stats
    (plain values, ``kvstore.tiers.remote.config`` / ``.stats``) may load: ``kvstore.blocking``
    imports ``RemoteConfig`` at run time (for ``attach_remote``'s annotation only)."""
    code = ("import sys, kvstore; print(' '.join(sorted(m for m in sys.modules if "
            "m.startswith(('kvstore.cuda', 'kvstore.remote.', 'kvstore.metrics', "
            "'kvstore.integrations', 'obstore', 'prometheus_client', 'vllm', 'sglang'"
            ")))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    loaded = set(out.stdout.split()) - {"kvstore.tiers.remote.config", "kvstore.tiers.remote.stats"}
    assert loaded == set()


# The house's size limits (issue 32): a class a reader can hold in mind, a file one
# sitting can read.  Files that stay one concern may be longer, by name; modules still
# being split are listed with their current size, and may only shrink.
CLASS_LINES = 350
FILE_LINES = 600
LONGER_FILES = {"kvstore/codecs/pipeline.py": 1000}
BEING_SPLIT: dict[str, int] = {}


def test_no_class_or_file_over_the_limits() -> None:
    over = []
    for path in sorted((ROOT / "kvstore").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        lines = source.count("\n")
        if lines > max(LONGER_FILES.get(name, FILE_LINES), BEING_SPLIT.get(name, 0)):
            over.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > max(CLASS_LINES, BEING_SPLIT.get(f"{name}:{node.name}", 0)):
                    over.append(f"{name}: class {node.name} {size} lines")
    assert over == []
