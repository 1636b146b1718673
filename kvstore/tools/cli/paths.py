"""What the CLI says about a path that is not a store it can open, in its user's words
(not the library's: "open with create=True" means nothing on a command line)."""

from __future__ import annotations

import os

from kvstore.disk import layout


class CliError(Exception):
    """A command cannot run (exit 2); the message is in the CLI user's words."""


def store_path_problem(path: str) -> str | None:
    """Why ``path`` is not a store ``stats``/``fsck`` can open, or None."""
    if not os.path.exists(path):
        return f"{path} does not exist"
    if not os.path.isdir(path):
        return f"{path} is a file, not a store directory"
    if not os.path.isdir(layout.index_dir(path)):
        if os.path.isdir(layout.extents_dir(path)):
            return (f"{path} has extent files but no index; rebuild it with "
                    f"`python -m kvstore fsck {path} --rebuild-index`")
        return f"{path} is not a kvstore store (it has no index/ directory)"
    return None


def require_store(path: str) -> None:
    problem = store_path_problem(path)
    if problem:
        raise CliError(problem)
