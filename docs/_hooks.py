"""MkDocs hook: repository files that the docs link to are published with the site.

A page links to a file outside ``docs/`` with a plain relative link (``../FORMAT.md``,
``../benchmarks/results/bench.md``), which works when the page is read in the repository.
For the built site this hook copies each such file, as is, under ``repo/`` (a
``.md`` file is copied as text, not rendered) and points the link there. A link to a
path that does not exist is left alone, so MkDocs reports it and ``--strict`` fails.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

# Markdown inline links and images: [text](target) / [text](target "title")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


class _RepoFile(File):
    """A repository file copied into the site verbatim (never rendered as a page)."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False


def _targets(text: str) -> list[str]:
    out = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("/", "#")):
            continue  # a URL, an absolute path, an anchor on the same page
        out.append(target.split("#", 1)[0].split("?", 1)[0])
    return out


def on_files(files: Files, config: Any) -> Files:
    docs_dir = os.path.realpath(config["docs_dir"])
    root = os.path.dirname(os.path.realpath(config["config_file_path"]))
    seen: set[str] = set()
    for page in list(files.documentation_pages()):
        with open(page.abs_src_path, encoding="utf-8") as f:
            text = f.read()
        for target in _targets(text):
            src_uri = posixpath.normpath(
                posixpath.join(posixpath.dirname(page.src_uri), target))
            path = os.path.realpath(os.path.join(docs_dir, src_uri))
            if not src_uri.startswith("../") or src_uri in seen:
                continue
            if os.path.commonpath([root, path]) != root or not os.path.isfile(path):
                continue  # outside the repository, or missing: MkDocs reports the link
            seen.add(src_uri)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            repo_file = _RepoFile(src_uri, docs_dir, config["site_dir"],
                                  config["use_directory_urls"], dest_uri=f"repo/{rel}",
                                  inclusion=InclusionLevel.INCLUDED)
            repo_file.abs_src_path = path
            files.append(repo_file)
    return files
