"""The image cache is collected least recently used first, never under a live sandbox or a trial just started."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from flows.cli import main
from grpoflow.embedded.sandbox.images import USED, TaskImage, collect, hold

MIB = 2**20


def _entry(cache: Path, digest: str, mib: int, used_ago_s: float) -> TaskImage:
    tree = cache / digest / "rootfs"
    tree.mkdir(parents=True)
    (tree / "blob").write_bytes(os.urandom(mib * MIB))  # real blocks: sizes are measured on disk
    (cache / digest / "image.json").write_text(json.dumps({"tag": f"grpoflow-env-test:{digest}", "workdir": None}))
    (cache / f"{digest}.build.log").write_text("built\n")
    used = cache / digest / USED
    used.touch()
    os.utime(used, (time.time() - used_ago_s,) * 2)
    return TaskImage(f"grpoflow-env-test:{digest}", tree, None, {}, None, cache / f"{digest}.build.log", False)


def test_collect_removes_the_least_recently_used_first_and_spares_held_and_recent(tmp_path: Path) -> None:
    cache = tmp_path / "images"
    _entry(cache, "oldest", 2, 7200)
    held = _entry(cache, "held", 2, 5000)
    _entry(cache, "older", 2, 3600)
    _entry(cache, "recent", 2, 10)
    lock = hold(held)  # a live sandbox runs on it
    try:
        done = collect(cache, 3 * MIB)
    finally:
        os.close(lock)
    assert [d for d, _ in done.removed] == ["oldest", "older"]  # LRU order, skipping what is in use
    assert sorted(done.busy) == ["held", "recent"]  # over budget, but a sandbox holds one, a trial just took one
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == ["held", "recent"]
    assert not (cache / "oldest.build.log").exists() and (cache / "held.build.log").exists()
    assert all(size >= 2 * MIB for _, size in done.removed)


def test_cache_gc_prints_what_went(tmp_path: Path, capsys) -> None:
    cache = tmp_path / "images"
    _entry(cache, "a", 2, 7200)
    _entry(cache, "b", 1, 3600)
    assert main(["cache", "gc", "--max-mb", "2", "--image-cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "removed a (2 MiB)" and out[-1].endswith(": 1 images removed, 1 MiB kept")
    assert [p.name for p in cache.iterdir() if p.is_dir()] == ["b"]
