"""A sandbox's files as a generated task family's oracle and verifier see them, modelled in Python.

The built-in families (`grpoflow.prepare.families`) each say what their oracle does to the files
(`Family.effect`) and what their verifier checks (`Family.grade`), over a `Tree`. That lets prepare ask, for
thousands of instance pairs in milliseconds, whether one instance's oracle also solves another's verifier (a
leak across the split: `families.leaks`) without starting a sandbox. Where the shell would fail, an operation
raises `Stop` (the oracle's `set -e` ends it there, its earlier writes kept); where this model cannot tell
what the shell would do, it raises `Unknown`, which the leak check counts as a leak. A contract test holds the
model to the real sandbox's verdicts.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field


class Stop(Exception):
    """The command fails here: a `set -e` script ends, keeping what it wrote before."""


class Unknown(Exception):
    """The model cannot tell what the shell would do."""


@dataclass
class Tree:
    """Absolute path -> a file's text, or None for a directory; `executable`: files with the x bit."""

    nodes: dict[str, str | None]
    executable: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, files: Mapping[str, str]) -> Tree:
        """The files a task's agent starts with (under /app), in their directories."""
        tree = cls({"/": None, "/app": None})
        for path, text in files.items():
            tree.mkdir_p(posixpath.dirname(path))
            tree.write(path, text)
        return tree

    def is_file(self, path: str) -> bool:
        return self.nodes.get(path, None) is not None

    def is_dir(self, path: str) -> bool:
        return path in self.nodes and self.nodes[path] is None

    def exists(self, path: str) -> bool:
        return path in self.nodes

    def read(self, path: str) -> str:
        """The file's text; `Stop` when there is no such file (`cat`, `<` and friends fail)."""
        text = self.nodes.get(path)
        if text is None:
            raise Stop(f"{path}: no such file")
        return text

    def write(self, path: str, text: str) -> None:
        """`> path`: created or truncated (its mode kept); fails on a directory or a missing parent."""
        if self.is_dir(path) or not self.is_dir(posixpath.dirname(path)):
            raise Stop(f"{path}: cannot write")
        self.nodes[path] = text

    def mkdir_p(self, path: str) -> None:
        parts = path.strip("/").split("/")
        for n in range(1, len(parts) + 1):
            prefix = "/" + "/".join(parts[:n])
            if self.is_file(prefix):
                raise Stop(f"{prefix}: not a directory")
            self.nodes[prefix] = None

    def touch(self, path: str) -> None:
        if not self.exists(path):
            self.write(path, "")

    def remove_file(self, path: str) -> None:
        """`rm -f`: nothing to do when absent, fails on a directory."""
        if self.is_dir(path):
            raise Stop(f"{path}: is a directory")
        self.nodes.pop(path, None)
        self.executable.discard(path)

    def copy(self, src: str, dst: str) -> None:
        text = self.read(src)
        if self.is_dir(dst):
            dst = posixpath.join(dst, posixpath.basename(src))
        self.write(dst, text)

    def move(self, src: str, dst: str) -> None:
        if self.is_dir(src) or self.is_dir(dst):
            raise Unknown(f"mv {src} {dst}: a directory")  # never made by one oracle from a task's own files
        text = self.read(src)
        executable = src in self.executable
        self.remove_file(src)
        self.nodes[dst] = text
        if executable:
            self.executable.add(dst)

    def chmod_x(self, path: str) -> None:
        if not self.exists(path):
            raise Stop(f"{path}: no such file")
        self.executable.add(path)


def same_text(tree: Tree, path: str, expected: str) -> bool:
    """The verifiers' `same_text`: equal up to trailing newlines (`$(cat ...)` strips them), a file that cannot
    be read counting as empty text."""
    text = tree.nodes.get(path) or ""
    return text.rstrip("\n") == expected.rstrip("\n")
