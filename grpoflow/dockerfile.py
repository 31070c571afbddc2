"""What of a task's `environment/Dockerfile` the local sandbox reproduces, and the first line it does not.

The local sandbox (`grpoflow.embedded.sandbox.local`) builds no image: the host's /usr stands in for any `FROM`
image, and the task's `environment/app/` is copied into `/app`, its working directory. So a Dockerfile made of
`FROM`, `WORKDIR /app` and `COPY app/ /app/` (comments and blank lines aside) describes the environment the
sandbox gives; anything else (`RUN apt-get install`, `ENV`, `COPY` of other files or to elsewhere, another
`WORKDIR`, `USER`, a second stage) would be silently missing, and every trial of the task would score what the
policy could do in the wrong environment. Such a task is refused at prepare, naming the file and line.
"""

from __future__ import annotations

import posixpath
import shlex
from pathlib import Path

SANDBOX_WORKDIR = "/app"  # the one working directory the local sandbox has (pre-filled from environment/app/)
_APP_SOURCES = {"app", "app/", "./app", "./app/"}


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number of its first line, instruction in upper case, arguments) per instruction; comments and
    blank lines dropped, backslash continuations joined (Docker's default escape character)."""
    out: list[tuple[int, str, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # Docker drops comment lines inside a continued instruction
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        joined = " ".join(part.strip() for part in pending if part.strip())
        pending = []
        keyword, _, args = joined.partition(" ")
        out.append((start, keyword.upper(), args.strip()))
    if pending:  # a continuation at the end of the file: still an instruction
        joined = " ".join(part.strip() for part in pending if part.strip())
        keyword, _, args = joined.partition(" ")
        out.append((start, keyword.upper(), args.strip()))
    return out


def local_sandbox_problem(task_dir: Path) -> str | None:
    """The first thing in the task's Dockerfile (or its task.toml workdir) that the local sandbox does not
    reproduce, as one line `environment/Dockerfile:<line>: ...`; None when the sandbox gives the environment the
    Dockerfile describes (or the task has no Dockerfile)."""
    path = task_dir / "environment" / "Dockerfile"
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        return f"environment/Dockerfile is not UTF-8: {err.reason}"
    froms, workdir = 0, None
    for number, keyword, args in dockerfile_instructions(text):
        where = f"environment/Dockerfile:{number}: `{keyword} {args}`"[:200]
        if keyword == "FROM":
            froms += 1
            if froms == 1:
                continue  # the host's /usr stands in for the base image
            problem = "a second build stage"
        elif keyword == "WORKDIR":
            if posixpath.normpath(args or ".") == SANDBOX_WORKDIR:
                workdir = SANDBOX_WORKDIR
                continue
            problem = f"the local sandbox's working directory is {SANDBOX_WORKDIR}"
        elif keyword == "COPY":
            if _copies_app_into_workdir(args, workdir):
                continue
            problem = f"the local sandbox copies only environment/app/ into {SANDBOX_WORKDIR}/"
        else:
            problem = "the local sandbox builds no image, so this instruction would not run"
        return (
            f"{where}: {problem} (it reproduces only FROM, WORKDIR {SANDBOX_WORKDIR} and COPY app/ "
            f"{SANDBOX_WORKDIR}/; without a Docker build the task would run in the wrong environment)"
        )
    return None


def workdir_problem(workdir: str | None) -> str | None:
    """task.toml's `[environment].workdir`, when the local sandbox cannot honour it."""
    if workdir is None or posixpath.normpath(workdir) == SANDBOX_WORKDIR:
        return None
    return f"task.toml [environment].workdir = {workdir!r}: the local sandbox's working directory is {SANDBOX_WORKDIR}"


def _copies_app_into_workdir(args: str, workdir: str | None) -> bool:
    try:
        words = shlex.split(args)
    except ValueError:
        return False
    if len(words) != 2 or any(w.startswith("--") for w in words):  # --from, --chown, --chmod: not reproduced
        return False
    source, dest = words
    # A relative destination is relative to the WORKDIR set before it (none: `/`, not the sandbox's /app).
    target = posixpath.normpath(posixpath.join(workdir or "/", dest))
    return source in _APP_SOURCES and target == SANDBOX_WORKDIR
