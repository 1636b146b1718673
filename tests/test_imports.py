"""The package's import graph has no circles, every folder imports only what its rule
allows, and optional parts stay unloaded.

Every ``import`` / ``from ... import`` in ``kvstore/`` counts, at module level, inside
functions (deferred imports) and under ``TYPE_CHECKING``: a deferred or type-only import
still says that one module knows the other, and a circle of such knowledge is what made
the store and its remote adapter one piece.  ``from kvstore import x`` counts as an
import of ``kvstore.x`` when that is a module, else of the package ``kvstore`` itself.
No new dependency: the graph comes from the standard ``ast`` module.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
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


def import_graph(package_dir: Path, *, ancestors: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its source).  A module's
    import of a package above it (``import kvstore`` in ``kvstore.tools.cli.demo``) is
    left out unless ``ancestors``: it is no circle of ideas (every submodule's import
    runs its packages' ``__init__``), but the folder rules count it (the top package is
    the public API, which a lower folder must not use)."""
    mods = _modules(package_dir)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            for name in _imported(node, module, path.name == "__init__.py", mods):
                while name and name not in mods:  # an attribute of a module: the module
                    name = name.rpartition(".")[0]
                if name and name != module and (ancestors or not module.startswith(name + ".")):
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


# One rule per folder: folder -> what its modules may import besides their own folder.
# An entry is a folder with a rule of its own (its modules, not its subfolders: those
# have rules of their own and are named when allowed) or a single module (with what
# lies below it).  ``kvstore`` is the top folder: the public API (``store``, ``blocking``,
# ``__init__``, ...), which may import everything (``metrics``, a package, has a rule).  The public modules a
# lower folder uses (``errors``, ``keys``, ``options``, ``stats``) have a rule each:
# they sit below the call paths that take them.  Every folder may import
# ``kvstore.errors`` (``WORDS``).  docs/architecture.md has the same table in prose.
WORDS = ("kvstore.errors",)
PUBLIC = ("kvstore", "kvstore.errors", "kvstore.keys", "kvstore.options", "kvstore.stats")
TIER_PARTS = ("kvstore.core", "kvstore.index", "kvstore.io", "kvstore.codecs", "kvstore.disk")
RULES: dict[str, tuple[str, ...] | None] = {
    "kvstore": None,  # the public API: anything
    "kvstore.errors": (),
    "kvstore.keys": ("kvstore.disk",),
    "kvstore.options": ("kvstore.keys", "kvstore.disk", "kvstore.codecs", "kvstore.io",
                        "kvstore.tiers.remote.config"),
    "kvstore.stats": ("kvstore.io",),
    "kvstore.remote": ("kvstore.tiers.remote.config", "kvstore.tiers.remote.stats"),
    "kvstore.integrations": (),
    "kvstore.integrations.common": (*PUBLIC, "kvstore.codecs", "kvstore.tiers.remote.config"),
    "kvstore.integrations.sglang": (*PUBLIC, "kvstore.codecs", "kvstore.tiers.remote.config",
                                    "kvstore.integrations.common"),
    # the vLLM level: the connector (both roles) and what both roles share
    "kvstore.integrations.vllm": (*PUBLIC, "kvstore.codecs", "kvstore.tiers.remote.config",
                                  "kvstore.integrations.common",
                                  "kvstore.integrations.vllm.scheduler",
                                  "kvstore.integrations.vllm.worker"),
    # never the worker side, never kvstore.cuda (also not through another module:
    # test_the_vllm_scheduler_side_never_reaches_the_worker_side_or_cuda)
    "kvstore.integrations.vllm.scheduler": (*PUBLIC, "kvstore.integrations.common",
                                            "kvstore.integrations.vllm"),
    "kvstore.integrations.vllm.worker": (*PUBLIC, "kvstore.codecs", "kvstore.cuda",
                                         "kvstore.integrations.common",
                                         "kvstore.integrations.vllm"),
    # Prometheus export: the public API it reads (Store, BlockingStore, their stats and
    # latency histograms), nothing below them
    "kvstore.metrics": ("kvstore", "kvstore.stats", "kvstore.core.latency"),
    "kvstore.tools": ("kvstore", "kvstore.core", "kvstore.index", "kvstore.disk", "kvstore.io",
                      "kvstore.tiers.remote", "kvstore.codecs", "kvstore.cuda"),
    "kvstore.tools.cli": ("kvstore", "kvstore.tools", "kvstore.core", "kvstore.index",
                          "kvstore.disk", "kvstore.io", "kvstore.tiers.remote",
                          "kvstore.codecs", "kvstore.cuda"),
    "kvstore.tiers": (*TIER_PARTS, "kvstore.stats"),  # host.py: the port
    "kvstore.tiers.memory": ("kvstore.tiers", *TIER_PARTS),
    "kvstore.tiers.remote": ("kvstore.tiers", *TIER_PARTS),
    "kvstore.core": ("kvstore.index", "kvstore.io", "kvstore.disk", "kvstore.codecs",
                     "kvstore.keys", "kvstore.options", "kvstore.stats"),
    "kvstore.cuda": ("kvstore.io.arena", "kvstore.codecs"),
    "kvstore.index": ("kvstore.disk",),
    "kvstore.io": ("kvstore.disk", "kvstore.codecs", "kvstore._native"),
    "kvstore.codecs": ("kvstore.disk.format", "kvstore._native"),
    "kvstore.disk": (),
    "kvstore._native": (),
}

# Imports that break their folder's rule today, each to be removed by the change named
# beside it.  The list is exact: an entry whose import is gone fails the test too.
KNOWN_WRONG_WAY: dict[tuple[str, str], str] = {
}


def rule_of(module: str, rules: Mapping[str, object]) -> str:
    """The folder (or module) whose rule covers ``module``: the longest rule name that
    is ``module`` or a package above it."""
    name = module
    while name not in rules:
        name = name.rpartition(".")[0]
        if not name:
            raise KeyError(f"no rule covers {module}")
    return name


def allowed(module: str, imported: str, rules: Mapping[str, tuple[str, ...] | None],
            words: Iterable[str] = WORDS) -> bool:
    here, there = rule_of(module, rules), rule_of(imported, rules)
    may = rules[here]
    if may is None or here == there:
        return True
    entries = (*may, *words)
    return there in entries or any(imported == e or imported.startswith(e + ".")
                                   for e in entries if e not in rules)


def wrong_way(graph: Mapping[str, set[str]], rules: Mapping[str, tuple[str, ...] | None],
              words: Iterable[str] = WORDS) -> set[tuple[str, str]]:
    """Every import a folder's rule does not allow, as (importer, imported)."""
    return {(m, i) for m, imported in graph.items() for i in imported
            if not allowed(m, i, rules, tuple(words))}


def reachable(graph: Mapping[str, set[str]], starts: Iterable[str],
              skip: Iterable[tuple[str, str]] = ()) -> set[str]:
    """The modules ``starts`` import, directly or through others (not through
    ``skip``'s edges)."""
    skipped, seen = set(skip), set()
    todo = list(starts)
    while todo:
        m = todo.pop()
        for i in graph.get(m, ()):
            if i not in seen and (m, i) not in skipped:
                seen.add(i)
                todo.append(i)
    return seen


def scheduler_reaches(graph: Mapping[str, set[str]], skip: Iterable[tuple[str, str]] = ()
                      ) -> list[str]:
    """The vLLM worker side's and kvstore.cuda's modules the scheduler side imports,
    directly or through any other module."""
    side = "kvstore.integrations.vllm.scheduler"
    starts = [m for m in graph if m == side or m.startswith(side + ".")]
    return sorted(m for m in reachable(graph, starts, skip)
                  if m.startswith(("kvstore.integrations.vllm.worker", "kvstore.cuda"))
                  or m == "kvstore.cuda")


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


def test_every_folder_has_a_rule() -> None:
    folders = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "kvstore").rglob("__init__.py")}
    mods = _modules(ROOT / "kvstore")
    assert sorted(folders - set(RULES)) == []
    # every rule and every entry names a folder or a module that exists
    assert sorted(r for r in RULES if r not in folders and r not in mods) == []
    assert sorted(e for may in RULES.values() for e in may or () if e not in mods) == []


def test_every_folder_imports_only_what_its_rule_allows() -> None:
    found = wrong_way(import_graph(ROOT / "kvstore", ancestors=True), RULES)
    assert sorted(found - set(KNOWN_WRONG_WAY)) == []  # a new wrong-way import
    assert sorted(set(KNOWN_WRONG_WAY) - found) == []  # fixed: take it off the list


# The public API reaches kvstore.cuda through one door: kvstore/_cuda_path.py, whose
# imports of kvstore.cuda are deferred to the first CUDA tensor or page-locked region a
# store meets (the store hands its parts the copier and page locker it names).
CUDA_DOOR = {("kvstore._cuda_path", m) for m in ("kvstore.cuda", "kvstore.cuda.copies",
                                                  "kvstore.cuda.torch_copies",
                                                  "kvstore.cuda.page_locked")}


def test_the_vllm_scheduler_side_never_reaches_the_worker_side_or_cuda() -> None:
    # (Not through the imports listed as wrong-way, nor through the public API's
    # deferred CUDA door above.)
    graph = import_graph(ROOT / "kvstore", ancestors=True)
    assert scheduler_reaches(graph, skip=set(KNOWN_WRONG_WAY) | CUDA_DOOR) == []
    # the door is as described: nothing else of the public API imports kvstore.cuda
    public = [m for m in graph if m.count(".") == 1 and not m.startswith(
        ("kvstore.cuda", "kvstore._cuda_path", "kvstore.integrations", "kvstore.tools"))]
    assert [m for m in public for n in graph[m] if n.startswith("kvstore.cuda")] == []


def test_a_deliberate_wrong_way_import_is_found(tmp_path: Path) -> None:
    """The rules on a synthetic package: a lower folder importing a higher one is found
    wherever the import is (module level, deferred, type-only), and so is an import of
    the top package's public API from below."""
    pkg = tmp_path / "pkg"
    for d in ("low", "mid", "mid/inner"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from pkg.mid.api import run\n")
    (pkg / "errs.py").write_text("class E(Exception): ...\n")
    (pkg / "low" / "words.py").write_text("from pkg.errs import E\n")
    (pkg / "mid" / "api.py").write_text("from pkg.low import words\n")
    (pkg / "mid" / "inner" / "x.py").write_text("from pkg.low.words import E\n")
    rules: dict[str, tuple[str, ...] | None] = {
        "pkg": None, "pkg.errs": (), "pkg.low": (), "pkg.mid": ("pkg.low",),
        "pkg.mid.inner": ("pkg.low.words",)}
    graph = import_graph(pkg, ancestors=True)
    assert wrong_way(graph, rules, words=("pkg.errs",)) == set()
    for source in ("from pkg.mid import api\n",  # module level
                   "def f():\n    from pkg.mid.api import run\n",  # deferred
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from pkg.mid.inner import x\n",  # type-only, into a subfolder
                   "import pkg\n"):  # the top package (its public API)
        (pkg / "low" / "words.py").write_text(source)
        found = wrong_way(import_graph(pkg, ancestors=True), rules, words=("pkg.errs",))
        assert {m for m, _ in found} == {"pkg.low.words"}, source
    # a folder allowed a module of another may not import its siblings
    (pkg / "low" / "words.py").write_text("X = 1\n")
    (pkg / "low" / "other.py").write_text("Y = 1\n")
    (pkg / "mid" / "inner" / "x.py").write_text("from pkg.low.other import Y\n")
    assert wrong_way(import_graph(pkg, ancestors=True), rules, words=("pkg.errs",)) == {
        ("pkg.mid.inner.x", "pkg.low.other")}


def _copy_of_the_package(tmp_path: Path) -> Path:
    copy = tmp_path / "kvstore"
    shutil.copytree(ROOT / "kvstore", copy,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    return copy


def test_the_real_rules_catch_a_wrong_way_import_added_to_the_package(tmp_path: Path) -> None:
    """A copy of the package with one import added against the rules: the disk layer
    reaching up into the call paths (deferred, inside a function), the index importing
    the public API, the vLLM scheduler side importing kvstore.cuda, and a module the
    scheduler shares with the worker (vLLM level) importing the worker side."""
    cases = {
        "disk/format.py": ("def _up():\n    from kvstore.core import opening\n",
                           {("kvstore.disk.format", "kvstore.core.opening")}),
        "index/totals.py": ("import kvstore\n", {("kvstore.index.totals", "kvstore")}),
        "integrations/vllm/scheduler/stale.py": (
            "from kvstore.cuda import mover\n",
            {("kvstore.integrations.vllm.scheduler.stale", "kvstore.cuda.mover")}),
    }
    for path, (line, expected) in cases.items():
        copy = _copy_of_the_package(tmp_path / path.replace("/", "_"))
        target = copy / path
        target.write_text(target.read_text() + "\n" + line)
        found = wrong_way(import_graph(copy, ancestors=True), RULES)
        assert found - set(KNOWN_WRONG_WAY) == expected, path
    # through a module at the vLLM level (allowed to import the worker side, for the
    # connector): the scheduler imports it, so it reaches the worker side
    copy = _copy_of_the_package(tmp_path / "through")
    target = copy / "integrations" / "vllm" / "metrics.py"
    target.write_text(target.read_text() + "\nfrom kvstore.integrations.vllm.worker import loads\n")
    graph = import_graph(copy, ancestors=True)
    assert wrong_way(graph, RULES) - set(KNOWN_WRONG_WAY) == set()  # each step is allowed
    reached = scheduler_reaches(graph, skip=KNOWN_WRONG_WAY)
    assert "kvstore.integrations.vllm.worker.loads" in reached
    assert "kvstore.cuda.mover" in reached


def test_import_kvstore_leaves_the_optional_parts_unloaded() -> None:
    """CUDA (with the first store that page-locks), the remote tier's machinery (with
    the first store opened with ``remote=``), metrics (prometheus_client) and the engine
    integrations load only for those who use them.  The remote tier's options (a plain
    value, ``kvstore.tiers.remote.config``) may load, with its (empty) packages:
    ``kvstore.blocking`` imports ``RemoteConfig`` at run time (for ``attach_remote``'s
    annotation only)."""
    code = ("import sys, kvstore; print(' '.join(sorted(m for m in sys.modules if "
            "m.startswith(('kvstore.cuda', 'kvstore.remote', 'kvstore.tiers.remote', "
            "'kvstore.metrics', 'kvstore.integrations', 'obstore', 'prometheus_client', "
            "'vllm', 'sglang'"
            ")))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    loaded = set(out.stdout.split()) - {"kvstore.tiers.remote", "kvstore.tiers.remote.config",
                                        "kvstore.tiers.remote.stats"}
    assert loaded == set()


# The house's size limits: a class a reader can hold in mind, a file one sitting can
# read.  The modules still over them are listed with their current size, to be split
# by concern; a listed one may only shrink, and leaves the list once it is within the
# limits (the list is exact).
CLASS_LINES = 300
FILE_LINES = 500
OVER_THE_LIMITS: dict[str, int] = {
}


def sizes() -> dict[str, int]:
    """Every file's and class's size in lines under ``kvstore/``, keyed like
    :data:`OVER_THE_LIMITS` (``path`` and ``path:Class``)."""
    found = {}
    for path in sorted((ROOT / "kvstore").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        found[name] = source.count("\n")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                found[f"{name}:{node.name}"] = (node.end_lineno or node.lineno) - node.lineno + 1
    return found


def test_no_class_or_file_over_the_limits() -> None:
    found = sizes()
    over = {name: n for name, n in found.items()
            if n > (CLASS_LINES if ":" in name else FILE_LINES)}
    assert {n: size for n, size in over.items() if n not in OVER_THE_LIMITS} == {}
    assert {n: size for n, size in over.items() if size > OVER_THE_LIMITS.get(n, size)} == {}
    assert sorted(set(OVER_THE_LIMITS) - set(over)) == []  # within the limits: off the list
