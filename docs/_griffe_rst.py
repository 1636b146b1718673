"""Griffe extension (mkdocs.yml): kvstore's docstrings as Markdown, without editing them.

The docstrings are prose written in reStructuredText's inline forms: ``literals``,
roles such as :class:`~kvstore.options.StoreOptions`, and field blocks (``name`` then
its description, continuation lines indented under it). mkdocstrings renders a
docstring's text as Markdown, where a role shows raw (``:class:`` before the name) and a
field block runs together into one paragraph. This rewrites each docstring as griffe
loads it:

* ``:role:`~a.b.C``` becomes ```C``` and ``:role:`a.b.C``` becomes ```a.b.C```: code,
  not a link, since not every target has a page of its own;
* a field block (two or more lines that start with a ``literal`` followed by text, each
  continued by deeper-indented lines) becomes a Markdown list, one item per field.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|term|ref):`(~?)([^`]+)`")
_FIELD = re.compile(r"^(\s*)``([\w.]+)``\s+(\S.*)$")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    if "<" in target and target.endswith(">"):  # :ref:`title <target>`
        return f"`{target[:target.index('<')].strip()}`"
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _field_block(lines: list[str]) -> list[str] | None:
    """``lines`` (one block, no blank line) as a Markdown list, or None if they are not
    a field block."""
    first = _FIELD.match(lines[0])
    if first is None:
        return None
    indent = len(first.group(1))
    items: list[list[str]] = []
    for line in lines:
        field = _FIELD.match(line)
        if field is not None and len(field.group(1)) == indent:
            items.append([f"{' ' * indent}- ``{field.group(2)}``: {field.group(3)}"])
        elif len(line) - len(line.lstrip()) > indent:
            items[-1].append(f"{' ' * (indent + 2)}{line.strip()}")
        else:
            return None
    return [line for item in items for line in item] if len(items) > 1 else None


def rewrite(text: str) -> str:
    """``text`` (a cleaned docstring) with roles as code and field blocks as lists."""
    text = _ROLE.sub(_role, text)
    out: list[str] = []
    block: list[str] = []
    for line in [*text.split("\n"), ""]:
        if line.strip():
            block.append(line)
            continue
        if block:
            out.extend(_field_block(block) or block)
            block = []
        out.append(line)
    return "\n".join(out[:-1])


class RstProse(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
