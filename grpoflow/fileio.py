"""Atomic file and directory writes, and content hashes.

Every file grpoflow writes under a run dir goes through `write_*_atomic`: the bytes land in a temp file in the
same directory, are fsynced, then renamed over the target, so a crash never leaves a torn file. A directory
(a checkpoint, a converted model, an installed CLI, an adapter) is built beside its place and published by one
rename (`publish_dir`), so a reader never sees a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the mode open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        # A bare "[Errno 28] No space left on device" does not say which artifact was lost: name it.
        raise OSError(err.errno, f"cannot write {path}: {err.strerror or err}") from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_jsonl_atomic(path: Path, records: Iterable[Any]) -> None:
    write_text_atomic(path, "".join(json.dumps(r, sort_keys=False) + "\n" for r in records))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(root: Path, pattern: str = "**/*") -> str:
    """Hash of every file under `root` matching `pattern`: relative paths, executable bits and contents.

    Paths are sorted, so the hash is independent of directory listing order.
    """
    root = Path(root)
    h = hashlib.sha256()
    for p in sorted(q for q in root.glob(pattern) if q.is_file()):
        rel = p.relative_to(root).as_posix()
        mode = "x" if os.access(p, os.X_OK) else "-"
        h.update(f"{rel}\0{mode}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def append_jsonl(path: Path, record: Any) -> None:
    """Append one line and fsync.

    A crash or a full disk can at worst leave a torn last line (readers skip it). The next append first cuts
    such a fragment off, so a record is never glued onto it and the log stays readable.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "a+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    f.seek(0)
                    f.truncate(f.read().rfind(b"\n") + 1)
            f.write((json.dumps(record) + "\n").encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise OSError(err.errno, f"cannot append to {path}: {err.strerror or err}") from err


def temp_sibling(path: Path, kind: str) -> Path:
    """`.<name>.<kind>-<pid>` beside `path`: where a dir is written (`tmp`) or set aside (`old`) around the rename
    that publishes it."""
    return path.parent / f".{path.name}.{kind}-{os.getpid()}"


def is_temp_sibling(path: Path) -> bool:
    """A `temp_sibling` left by an interrupted write."""
    return re.fullmatch(r"\..+\.(tmp|old)-\d+", path.name) is not None


@contextmanager
def publish_dir(dest: Path, *, replace: bool = False, durable: bool = False, mode: int = 0o755) -> Iterator[Path]:
    """A fresh dir beside `dest` to build in; when the block ends without error it becomes `dest` by one rename,
    and however the block ends no temp dir is left behind.

    `replace`: an existing `dest` is swapped out (a retried step's checkpoint); otherwise an existing one stands
    and the new build is dropped (another process published the same content first: a conversion, an install).
    `durable`: every file is fsynced before the rename and the rename after it. `mode`: the dir's own mode
    (others read a cache entry: the engine, the sandbox's uid)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(dest, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if durable:  # the rename is only as durable as the bytes it points at
            fsync_files(tmp)
        tmp.chmod(mode)
        if dest.exists() and replace:
            old = temp_sibling(dest, "old")
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old)
        elif not dest.exists():
            try:
                tmp.rename(dest)
            except OSError:
                if not dest.exists():  # anything but losing a race to another publisher
                    raise
        if durable:
            fsync_path(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fsync_files(folder: Path) -> None:
    """Every file below `folder` and every folder inside it."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            fsync_path(Path(root) / name)
        for name in dirs:
            fsync_path(Path(root) / name)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tail(path: Path, max_bytes: int) -> str:
    """The last `max_bytes` of a file a sandbox wrote (a verifier's output can be gigabytes): a link or anything
    but a regular file reads as nothing, and a read never blocks."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd)
        if not stat.S_ISREG(size.st_mode):
            return ""
        f.seek(max(size.st_size - max_bytes, 0))
        return f.read(max_bytes).decode("utf-8", errors="replace")
