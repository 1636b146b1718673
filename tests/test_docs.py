"""README.md and the documentation site (docs/, mkdocs.yml) hold together: every relative
link names a file that exists (and, into a Markdown file, a heading that exists), every
page is in the site's navigation, and README keeps its two commands first. Fast, offline,
no MkDocs needed (CI builds the site itself with `mkdocs build --strict`)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

# [text](target) and ![alt](target), with an optional "title"; not inside code
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("**/*.md"))]


def _links(path: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))
    return _LINK.findall(text)


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (MkDocs) gives a heading; GitHub's agrees for the
    headings these pages link to (no runs of spaces or hyphens)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if _is_external(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        # the API reference's anchors (kvstore.open, ...) come from mkdocstrings
        generated = dest == DOCS / "reference.md" and anchor.startswith("kvstore")
        if anchor and dest.suffix == ".md" and not generated and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.glob("**/*.md")}
    assert pages - listed == set(), "add these pages to mkdocs.yml's nav"
    assert listed - pages == set(), "mkdocs.yml's nav names pages that do not exist"


def test_reference_names_only_public_names() -> None:
    """The API reference renders `::: PACKAGE.NAME` for names in the ``__all__`` of
    ``kvstore`` or of a public package (the remote tier's options, the engine
    integrations), never a module path that may move; the integrations' connector, its
    config and SGLang's backend config are among them."""
    import importlib

    names = re.findall(r"^:::\s+(\S+)", (DOCS / "reference.md").read_text(), re.M)
    assert names
    public = ("kvstore", "kvstore.remote", "kvstore.integrations.vllm",
              "kvstore.integrations.sglang")
    for name in names:
        package, _, attr = name.rpartition(".")
        assert package in public, name
        assert attr in importlib.import_module(package).__all__, name
    assert {"kvstore.integrations.vllm.KVStoreConnector",
            "kvstore.integrations.vllm.ConnectorConfig",
            "kvstore.integrations.sglang.BackendConfig"} <= set(names)


@pytest.mark.anyio
async def test_reference_shows_the_stores_public_members_only(tmp_path: Path) -> None:
    """``Store``'s entry lists its members: every public method and property of the
    class, the public attributes a store has, and none of its parts."""
    import kvstore

    text = (DOCS / "reference.md").read_text()
    block = re.search(r"^::: kvstore\.Store\n\s+options:\n\s+members:\n((?:\s+- \w+\n)+)",
                      text, re.M)
    assert block is not None
    listed = re.findall(r"- (\w+)", block.group(1))
    assert len(listed) == len(set(listed))
    on_class = {n for n, v in vars(kvstore.Store).items()
                if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    assert on_class <= set(listed)
    async with kvstore.open(tmp_path, extent_bytes=1 << 20, staging_bytes=1 << 20) as store:
        assert all(hasattr(store, n) for n in listed)
    for part in ("index", "writer", "engine", "arena", "allocator", "transfers", "puts",
                 "reads", "memory_room", "scrubber", "rechecks", "latency", "memory"):
        assert part not in listed


def test_readme_starts_with_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None and text.index("```bash") < text.index("\n## ")
    lines = block.group(1).strip().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("python -m kvstore demo")
    assert lines[1].endswith("python -m pytest")
    assert len(text.splitlines()) <= 400, "README is the front page: move detail to docs/"
