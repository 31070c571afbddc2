"""`FaultySandbox`: the local sandbox with injected faults, for tests of retries and failure records.

`fail_start_probability` (with `fail_start_seed`, a function of (seed, session id): a retry draws again, a rerun of
the same trial repeats its fate) makes `start()` raise `SandboxStartError`; `die_after_execs` makes the sandbox
"die" after that many execs (Harbor's own, the verifier's among them, count too): every later exec raises
`SandboxDiedError`. `start_outage_s` (with `start_outage_file`) fails every start for that long from the first:
a provider outage. `shared_dir` binds one writable host dir at `/shared` into every trial's sandbox: state that
outlives a trial, as an outside service a flaky verifier consults would be. The `faulty_sandbox` fixture (tests/conftest.py) puts it where a run's `rollout.sandbox.backend=local`
goes, so `rollout.sandbox.kwargs` reach it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.rollout.environments import SandboxDiedError, SandboxStartError
from grpoflow.sandbox_settings import LocalSandboxSettings

FAULTY_SANDBOX_IMPORT_PATH = "tests.fakes.faulty_sandbox:FaultySandbox"


class FaultySandboxSettings(LocalSandboxSettings):
    """The keywords a run config may give `FaultySandbox` (the `faulty_sandbox` fixture has the config check them)."""

    fail_start_probability: float = Field(0.0, ge=0.0, le=1.0, strict=False)
    fail_start_seed: int | None = None
    die_after_execs: int | None = Field(None, ge=0)
    start_outage_s: float | None = Field(None, gt=0.0)
    start_outage_file: str | None = None
    shared_dir: str | None = None


SHARED = "/shared"


class FaultySandbox(LocalSandbox):
    Settings = FaultySandboxSettings

    def __init__(self, *args: Any, **kwargs: Any):
        shared = kwargs.get("shared_dir")
        if shared is not None:  # a user mount, as Harbor's `mounts` gives one to any environment
            kwargs["mounts"] = [{"type": "bind", "source": shared, "target": SHARED, "read_only": False}]
        super().__init__(*args, **kwargs)
        self.fail_start_probability = self.settings.fail_start_probability
        self.fail_start_seed = self.settings.fail_start_seed
        self.die_after_execs = self.settings.die_after_execs
        self._execs = 0

    def maybe_fail_start(self) -> None:
        self.maybe_outage()
        if self.fail_start_probability <= 0.0:
            return
        rng = random.Random(f"{self.fail_start_seed}/{self.session_id}") if self.fail_start_seed is not None else random
        if rng.random() < self.fail_start_probability:
            raise SandboxStartError(
                f"injected fault: sandbox {self.session_id} failed to start "
                f"(fail_start_probability={self.fail_start_probability})"
            )

    def maybe_outage(self) -> None:
        """A provider outage: every start fails for `start_outage_s` from the first start of any sandbox naming the
        same `start_outage_file` (which holds the outage's end, as a time.time())."""
        if self.settings.start_outage_s is None or self.settings.start_outage_file is None:
            return
        path = Path(self.settings.start_outage_file)
        try:  # the first start begins the outage (no await in between: one event loop's sandboxes agree)
            with open(path, "x") as f:
                f.write(str(time.time() + self.settings.start_outage_s))
        except FileExistsError:
            pass
        if time.time() < float(path.read_text()):
            raise SandboxStartError(f"injected outage: sandbox {self.session_id} failed to start (provider down)")

    async def start(self, force_build: bool) -> None:
        self.maybe_fail_start()
        await super().start(force_build)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: float | None = None,
        user: str | int | None = None,
    ):
        if self._root is not None and self._dead_reason is None:
            self._execs += 1
            if self.die_after_execs is not None and self._execs > self.die_after_execs:
                self._dead_reason = f"injected fault: died after {self.die_after_execs} execs"
                raise SandboxDiedError(f"sandbox {self.session_id}: {self._dead_reason}")
        return await super().exec(command, cwd, env, timeout_sec, user)
