"""Test-only launcher: run the `grpoflow` command line and hold it at a chosen point, where a test SIGKILLs it (the
main process alone, as `kill -9` does: what it started is left to fend for itself). The point is monkeypatched
in here; production code has no hooks. Once the point is reached, MARKER is created.

    python tests/integration/faults/pause_at.py POINT MARKER -- <grpoflow arguments>

POINT:
  prepare  while the model is prepared (the Prefect server is up, nothing else started)
  rollout  in a trial, with its sandbox started and running a command (the engine is up)
  update   in the GRPO update of the first step (engine up, the step's sandboxes stopped)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def arm(point: str, marker: Path) -> None:
    if point == "prepare":
        import tasks.prepare as prepare

        real_prepare = prepare.prepare_model

        def prepare_model(source, *args, **kwargs):
            model = real_prepare(source, *args, **kwargs)
            marker.touch()
            time.sleep(3600)
            return model

        prepare.prepare_model = prepare_model
    elif point == "rollout":
        from grpoflow.embedded.sandbox.local import LocalSandbox

        real_start = LocalSandbox.start

        async def start(self, force_build):
            await real_start(self, force_build)
            if not marker.exists():  # the first sandbox: a command that holds its bwrap alive until the kill
                import asyncio

                asyncio.get_running_loop().call_later(1.0, marker.touch)
                await self.exec("sleep 3600", timeout_sec=None)

        LocalSandbox.start = start
    elif point == "update":
        import grpoflow.train.step as train_step_mod

        def train_step(*args, **kwargs):
            marker.touch()
            time.sleep(3600)

        train_step_mod.train_step = train_step
    else:
        raise SystemExit(f"unknown point {point}")


if __name__ == "__main__":
    sep = sys.argv.index("--")
    point, marker = sys.argv[1:sep]
    arm(point, Path(marker))
    from flows.cli import main

    sys.exit(main(sys.argv[sep + 1 :]))
