"""What of a task's `environment/Dockerfile` the local sandbox reproduces on the host's rootfs, and what it
needs a Docker build for.

On the host rootfs (`grpoflow.embedded.sandbox.local`) no image is built: the host's /usr stands in for any
`FROM` image, and the task's `environment/app/` is copied into `/app`, its working directory. So a Dockerfile made
of `FROM`, `WORKDIR /app` and `COPY app/ /app/` (comments and blank lines aside) describes the environment the
sandbox gives without Docker (every built-in task); anything else (`RUN apt-get install`, `ENV`, `COPY` of other
files or to elsewhere, another `WORKDIR`, `USER`, a second stage) needs the image built
(`grpoflow.embedded.sandbox.images`, which builds it). With a Docker engine reachable such a task is built and run in its image;
without one it is refused at prepare, naming the file and line, as it is when its `FROM` image cannot be had:
not on this machine, not mapped to a local image by `dataset.base_images`, and no registry answering a pull.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_answered: set[str | None] = set()  # DOCKER_HOST values whose engine answered in this process
ENGINE_TIMEOUT_S = 15  # `docker version`: a dead socket fails at once, a hung engine must not hang prepare
SANDBOX_WORKDIR = "/app"  # the one working directory the local sandbox has (pre-filled from environment/app/)
_APP_SOURCES = {"app", "app/", "./app", "./app/"}


# A heredoc marker in a RUN, COPY or ADD instruction (BuildKit's syntax): `<<EOF`, `<<-EOF`, `<<'EOF'`, `<<"EOF"`,
# starting a word (not a here-string `<<<`, not a shift inside `$((...))`).
HEREDOC = re.compile(r"(?:^|(?<=\s))\d*<<(-?)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2(?=\s|$)")
HEREDOC_INSTRUCTIONS = ("RUN", "COPY", "ADD")


@dataclass(frozen=True)
class Instruction:
    line: int  # its first line
    end: int  # its last line (a heredoc's terminator, where it has one)
    keyword: str  # upper case
    args: str  # the instruction's own line(s), continuations joined
    heredocs: str = ""  # the lines after it that its heredocs take, terminators included ("" if none)


def _instructions(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    lines = text.splitlines()
    pending: list[str] = []
    start = 0
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i].strip()
        i += 1
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # Docker drops comment lines inside a continued instruction
            continue
        if not pending:
            start = number
        if line.endswith("\\") and i < len(lines):
            pending.append(line[:-1])
            continue
        pending.append(line.removesuffix("\\"))  # a continuation at the end of the file: still an instruction
        joined = " ".join(part.strip() for part in pending if part.strip())
        pending = []
        keyword, _, args = joined.partition(" ")
        keyword, body = keyword.upper(), []
        if keyword in HEREDOC_INSTRUCTIONS and not args.lstrip().startswith("["):  # the exec form has none
            for strip_tabs, _, word in HEREDOC.findall(args):
                while i < len(lines):  # the body runs to a line that is the word alone (tabs first, with <<-)
                    body.append(lines[i])
                    i += 1
                    if (lines[i - 1].lstrip("\t") if strip_tabs else lines[i - 1]) == word:
                        break
        out.append(Instruction(start, i if body else number, keyword, args.strip(), "\n".join(body)))
    return out


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number of its first line, instruction in upper case, arguments) per instruction; comments and
    blank lines dropped, backslash continuations joined (Docker's default escape character); a heredoc's lines
    belong to its instruction (after a newline in its arguments), never read as instructions."""
    return [(i.line, i.keyword, f"{i.args}\n{i.heredocs}" if i.heredocs else i.args) for i in _instructions(text)]


def local_sandbox_problem(
    task_dir: Path, build_images: bool | None = None, mapping: dict[str, str] | None = None
) -> str | list[BaseImage] | None:
    """Why the local sandbox cannot give the task the environment its Dockerfile describes, as one line naming
    the file and line; when it can: None on the host rootfs, or (`build_images` not False, a Docker engine
    answering and every `FROM` image resolved by `resolve_base_images`) the base images its image builds from."""
    problem = host_rootfs_problem(task_dir / "environment")
    if problem is None:
        return None
    if build_images is False:
        return f"{problem}; dataset.build_images=true builds it with Docker"
    if (engine := docker_engine_problem()) is not None:
        return f"{problem}; {engine}"
    try:
        return resolve_base_images(task_dir / "environment", mapping)
    except UnresolvedBaseImage as err:
        return str(err)


@dataclass(frozen=True)
class BaseImage:
    """A `FROM` image of a task's Dockerfile as this machine's Docker engine resolves it."""

    line: int  # of the FROM instruction in environment/Dockerfile
    reference: str  # as the FROM line writes it
    image: str  # what the build uses: `dataset.base_images`' mapping of the reference, or the reference
    id: str  # the engine's image ID (sha256:...): what the build starts from, and part of the image cache's key


class UnresolvedBaseImage(ValueError):
    """A `FROM` image that is neither on this machine nor pulled, in one line naming the reference and the setting."""


_pulled: dict[str, str | None] = {}  # reference -> why its pull failed (None: pulled), once per process
PULL_TIMEOUT_S = 900


def resolve_base_images(environment_dir: Path, mapping: dict[str, str] | None = None) -> list[BaseImage]:
    """Every `FROM` image of `environment_dir/Dockerfile`, mapped by `mapping` (`dataset.base_images`), and its
    image ID on this machine's engine. An unmapped reference the engine lacks is pulled (once per process); one
    that cannot be had raises `UnresolvedBaseImage`."""
    mapping = mapping or {}
    text = (environment_dir / "Dockerfile").read_text(encoding="utf-8")
    out = []
    for number, reference in from_images(text):
        where = f"environment/Dockerfile:{number}: FROM {reference}"
        image = mapping.get(reference, reference)
        image_id = image_id_of(image)
        if image_id is None and reference in mapping:
            raise UnresolvedBaseImage(
                f"{where}: dataset.base_images maps it to {image}, which is not on this machine's Docker engine"
            )
        if image_id is None:
            if (why := pull(reference)) is not None:
                raise UnresolvedBaseImage(
                    f"{where}: not on this machine's Docker engine and not pulled ({why}); map it to a local image "
                    "with dataset.base_images (scripts/base-image.sh builds Debian bookworm)"
                )
            image_id = image_id_of(reference)
            if image_id is None:
                raise UnresolvedBaseImage(f"{where}: pulled, but the engine does not show it")
        out.append(BaseImage(number, reference, image, image_id))
    return out


def from_images(text: str) -> list[tuple[int, str]]:
    """(line, image) of every `FROM` that names an image (not `scratch`, not an earlier stage)."""
    stages: set[str] = set()
    out = []
    for number, keyword, args in dockerfile_instructions(text):
        if keyword != "FROM":
            continue
        words = [w for w in args.split() if not w.startswith("--")]  # --platform=...
        if not words:
            continue
        if words[0] != "scratch" and words[0].lower() not in stages:
            out.append((number, words[0]))
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
    return out


def pinned_dockerfile(text: str, bases: list[BaseImage]) -> str:
    """The Dockerfile as built: each `FROM` reference replaced by the image ID it resolved to (the build starts from
    exactly the image the cache key names, whatever a tag points at meanwhile), and each RUN heredoc in a form
    Docker's legacy builder runs (`legacy_run_heredocs`)."""
    lines = text.splitlines(keepends=True)
    for base in bases:
        words = lines[base.line - 1].split(" ")
        at = [i for i, w in enumerate(words) if w.strip() == base.reference]
        if not at:  # a FROM continued over lines: not rewritten in place
            raise UnresolvedBaseImage(
                f"environment/Dockerfile:{base.line}: FROM {base.reference}: write the FROM instruction on one line"
            )
        tail = words[at[0]][len(words[at[0]].rstrip()) :]
        words[at[0]] = base.id + tail
        lines[base.line - 1] = " ".join(words)
    return legacy_run_heredocs("".join(lines))


def legacy_run_heredocs(text: str) -> str:
    """`text` with each RUN that has a heredoc (BuildKit's syntax, which the legacy builder without BuildKit reads
    as instructions) rewritten as the exec form of the shell running the same script: the instruction's line and
    its heredocs, or for a bare `RUN <<EOF` the heredoc's body, as BuildKit runs them. Left as written (for the
    builder to refuse in its own words): heredocs of COPY or ADD, a RUN with flags (`--mount`, BuildKit's), and a
    bare heredoc naming its interpreter (`#!`)."""
    found = _instructions(text)
    lines = text.splitlines(keepends=True)
    shell = ["/bin/sh", "-c"]
    rewrites: list[tuple[Instruction, list[str]]] = []
    for ins in found:
        if ins.keyword == "FROM":
            shell = ["/bin/sh", "-c"]  # each stage starts from the default
        if ins.keyword == "SHELL":
            try:
                shell = [str(word) for word in json.loads(ins.args)]
            except ValueError:
                pass  # not JSON: the builder refuses the SHELL line itself
        if ins.keyword != "RUN" or not ins.heredocs or ins.args.startswith("--"):  # RUN --mount=...: BuildKit's
            continue
        if HEREDOC.fullmatch(ins.args):  # bare: the body is the script
            body = ins.heredocs.splitlines()[:-1]
            if body and body[0].startswith("#!"):
                continue
            script = "\n".join(body)
        else:
            script = f"{ins.args}\n{ins.heredocs}"
        rewrites.append((ins, [*shell, script]))
    for ins, argv in reversed(rewrites):  # from the end: earlier line numbers stay valid
        lines[ins.line - 1 : ins.end] = [f"RUN {json.dumps(argv)}\n"]
    return "".join(lines)


def image_id_of(name: str) -> str | None:
    proc = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", "--", name],  # a name is never an option
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def pull(reference: str) -> str | None:
    """`docker pull` of `reference`; None when it came, else the engine's last line (remembered for the process:
    a thousand tasks on one unreachable base try once)."""
    if reference not in _pulled:
        try:
            proc = subprocess.run(
                ["docker", "pull", "-q", "--", reference], capture_output=True, text=True, timeout=PULL_TIMEOUT_S
            )
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            _pulled[reference] = None if proc.returncode == 0 else (lines[-1] if lines else f"exit {proc.returncode}")
        except subprocess.TimeoutExpired:
            _pulled[reference] = f"no answer within {PULL_TIMEOUT_S} s"
    return _pulled[reference]


def host_rootfs_problem(environment_dir: Path) -> str | None:
    """The first thing in `environment/Dockerfile` that the sandbox on the host's rootfs does not reproduce, as
    one line `environment/Dockerfile:<line>: ...`; None when it does (or there is no Dockerfile). Not None: the
    task needs its image built."""
    path = environment_dir / "Dockerfile"
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


def docker_engine_problem() -> str | None:
    """Why no Docker engine can build images here, in one line; None when one answers (`DOCKER_HOST` honoured).
    An engine that answered once is not asked again (a dataset of thousands of tasks asks once); one that did not
    is asked each time, since it may have been started meanwhile."""
    host = os.environ.get("DOCKER_HOST")
    if host in _answered:
        return None
    problem = _ask_engine()
    if problem is None:
        _answered.add(host)
    return problem


def _ask_engine() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "the docker CLI is not installed"
    try:
        proc = subprocess.run(
            [docker, "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"the Docker engine did not answer within {ENGINE_TIMEOUT_S} s"
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return f"no Docker engine answers: {lines[-1] if lines else f'docker version exit {proc.returncode}'}"
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
