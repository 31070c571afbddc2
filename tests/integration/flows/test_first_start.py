"""A newcomer's first run: no Prefect server configured and a fresh PREFECT_HOME, so the flow starts Prefect's
temporary server, whose first start creates and migrates its database. Our wait for it fits that first start,
and a wait the user set (environment or profile) still wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.common import EPHEMERAL_STARTUP_TIMEOUT_S

REPO = Path(__file__).resolve().parents[3]
PROBE = (
    "import flows.common\n"
    "from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as S\n"
    "print(S.value())\n"
)


def _fresh_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without any Prefect setting, with a fresh HOME and PREFECT_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    (home / ".prefect").mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), "PREFECT_HOME": str(home / ".prefect"), **extra}


def _startup_wait(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_the_wait_fits_a_first_start_unless_the_user_set_one(tmp_path):
    assert EPHEMERAL_STARTUP_TIMEOUT_S > 20  # Prefect's own default, too short for a first start here
    assert _startup_wait(_fresh_env(tmp_path / "a")) == EPHEMERAL_STARTUP_TIMEOUT_S
    env = _fresh_env(tmp_path / "b", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="50")
    assert _startup_wait(env) == 50
    env = _fresh_env(tmp_path / "c")
    Path(env["PREFECT_HOME"], "profiles.toml").write_text(
        'active = "mine"\n[profiles.mine]\nPREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS = "77"\n'
    )
    assert _startup_wait(env) == 77


@pytest.mark.slow
def test_first_command_in_a_fresh_prefect_home_works(tmp_path, tiny_model_dir):
    """The real command line, as a newcomer runs it: the temporary server's first start, then the flow."""
    env = _fresh_env(tmp_path / "home")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "prepare",
            "--model",
            str(tiny_model_dir),
            "--run-id",
            "first",
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "run first finished" in out.stdout
    assert (tmp_path / "runs" / "first" / "prompts.jsonl").is_file()
    assert Path(env["PREFECT_HOME"], "prefect.db").is_file()  # the database was created by this first start
