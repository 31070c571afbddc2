"""Atomic file writes and content hashes.

Every file grpoflow writes under a run dir goes through `write_*_atomic`: the bytes land in a temp file in the
same directory, are fsynced, then renamed over the target, so a crash never leaves a torn file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
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
