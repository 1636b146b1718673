"""The package's import graph has no circles, and optional parts stay unloaded.

Every ``import`` / ``from ... import`` in ``kvstore/`` counts, at module level, inside
functions (deferred imports) and under ``TYPE_CHECKING``: a deferred or type-only import
still says that one module knows the other, and a circle of such knowledge is what made
the store and its remote adapter one piece.  ``from kvstore import codecs`` counts as an
import of ``kvstore.codecs``, not of the package's ``__init__``.  No new dependency: the
graph comes from the standard ``ast`` module.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
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


def test_import_kvstore_leaves_the_optional_parts_unloaded() -> None:
    """The remote tier's client, metrics (prometheus_client) and the engine
    integrations load only for those who use them."""
    code = ("import sys, kvstore; print(','.join(sorted(m for m in sys.modules if "
            "m.startswith(('kvstore.remote.tier', 'kvstore.remote.client', "
            "'kvstore.remote.local', 'kvstore.metrics', 'kvstore.integrations', "
            "'obstore', 'prometheus_client', 'vllm', 'sglang')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == ""
