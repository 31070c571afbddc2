"""Test-only launcher: run the `grpoflow` command line and SIGKILL it (with everything it started) at a chosen
point, as a crash or an OOM kill would. The point is monkeypatched in here; production code has no fault hooks.

    python tests/integration/faults/kill_at.py POINT STEP [N] -- <grpoflow arguments>

POINT (in step STEP):
  rollout     after the N-th finished trial of the step is journaled (other trials are mid-flight)
  eval        the same, in the evaluation of the weights after STEP steps (once step STEP - 1's full checkpoint
              is complete)
  train       after the GRPO update of the step ran (weights and optimizer changed in memory only)
  checkpoint  while the step's dir is being made a full checkpoint (optimizer state written, not yet published)
  metrics     after the step's checkpoint is in place, half-way through appending its metrics.jsonl row
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.fakes.proc import descendants  # noqa: E402


def die() -> None:
    """SIGKILL every process this one started (engine, sandboxes), then itself: nothing gets to clean up."""
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def arm(point: str, step: int, n: int) -> None:
    if point in ("rollout", "eval"):
        import grpoflow.rollout.journal as journal

        real, count = journal.append_jsonl, [0]
        where = f"{'step' if point == 'rollout' else 'eval'}_{step}"

        def append(path, record):
            real(path, record)
            if Path(path).name == "journal.jsonl" and Path(path).parent.name == where:
                count[0] += 1
                if count[0] == n:
                    if point == "eval":  # the evaluation after step STEP - 1: kill once its full checkpoint is in
                        _wait_for(Path(path).parents[2] / "checkpoints" / f"step_{step - 1}" / "optimizer.pt")
                    die()

        journal.append_jsonl = append
    elif point == "train":
        import grpoflow.train.ranks as ranks

        real_update = ranks.grpo_update

        def grpo_update(state, samples, cfg, at):
            out = real_update(state, samples, cfg, at)
            if at >= step:  # after the update, before its commit
                die()
            return out

        ranks.grpo_update = grpo_update
    elif point == "checkpoint":
        import grpoflow.fileio as fileio

        real_fsync = fileio.fsync_path

        def fsync(path):
            if Path(path).parent.name == f"step_{step}":  # making the step's dir a full checkpoint
                die()
            real_fsync(path)

        fileio.fsync_path = fsync  # fsync_files, which makes a step dir durable, calls it
    elif point == "metrics":
        import grpoflow.run.metrics as reporting

        real_append = reporting.append_jsonl

        def append(path, record):
            if Path(path).name == "metrics.jsonl" and record.get("step") == step:
                line = (json.dumps(record) + "\n").encode()
                with open(path, "ab") as f:
                    f.write(line[: len(line) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                die()
            real_append(path, record)

        reporting.append_jsonl = append
    else:
        raise SystemExit(f"unknown point {point}")


if __name__ == "__main__":
    sep = sys.argv.index("--")
    head, argv = sys.argv[1:sep], sys.argv[sep + 1 :]
    arm(head[0], int(head[1]), int(head[2]) if len(head) > 2 else 1)
    from flows.cli import main

    sys.exit(main(argv))
