"""The harness CLIs the local sandbox cannot install itself: `@anthropic-ai/claude-code` and `opencode-ai`, pinned,
installed once with npm into the cache (`<cache>/clis/<package>@<version>/`), then shown read-only in every
sandbox (`LocalSandbox(cli_dir=...)`). Both packages ship native binaries as npm optional dependencies, so
nothing is downloaded when a trial runs. Cloud sandboxes keep Harbor's own install path, at the same versions.

The install goes to a temp dir beside the cache entry and is renamed into place once the binary answers
`--version` with the pinned version, so an interrupted install never leaves a half entry that looks installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from grpoflow.errors import ConfigError, one_line
from grpoflow.fileio import publish_dir
from grpoflow.prepare.model import default_cache_dir


@dataclass(frozen=True)
class CliPackage:
    npm: str  # the npm package
    version: str  # pinned: Harbor's trajectories and our tool-call handling are tested against it
    bin: str  # its command

    @property
    def spec(self) -> str:
        return f"{self.npm}@{self.version}"


CLI_PACKAGES: dict[str, CliPackage] = {
    "claude-code": CliPackage("@anthropic-ai/claude-code", "2.1.328", "claude"),
    "opencode": CliPackage("opencode-ai", "1.18.33", "opencode"),
}
# npm itself: no audit, funding or update-notifier requests; the registry is the only host it needs.
_NPM_ENV = {"npm_config_update_notifier": "false", "npm_config_fund": "false", "npm_config_audit": "false"}


def cli_dir(harness: str, cache_dir: Path | None = None) -> Path:
    pkg = CLI_PACKAGES[harness]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", pkg.spec)
    return Path(cache_dir or default_cache_dir()) / "clis" / name


def installed_cli(harness: str, cache_dir: Path | None = None) -> Path:
    """The cache dir of the harness's pinned CLI; `ConfigError` when prepare has not installed it."""
    path = cli_dir(harness, cache_dir)
    if not _installed(path, CLI_PACKAGES[harness]):
        raise ConfigError(
            f"rollout.harness.name={harness}: its CLI {CLI_PACKAGES[harness].spec} is not installed in {path}; the "
            "prepare stage installs it (npm and the npm registry needed once)"
        )
    return path


def ensure_cli(harness: str, cache_dir: Path | None = None) -> Path:
    """Install the harness's pinned CLI into the cache unless it is there; returns its dir."""
    pkg = CLI_PACKAGES[harness]
    path = cli_dir(harness, cache_dir)
    if _installed(path, pkg):
        return path
    npm = shutil.which("npm")
    if npm is None:
        raise ConfigError(
            f"rollout.harness.name={harness}: npm is needed once to install {pkg.spec} for the local sandbox "
            "(apt-get install -y npm)"
        )
    # A dir there is a broken install: replaced. 0755 lets the sandbox's own uid read it.
    with publish_dir(path, replace=path.exists()) as tmp:
        _install(npm, pkg, tmp)
    return path


def _installed(prefix: Path, pkg: CliPackage) -> bool:
    return (prefix / "node_modules" / ".bin" / pkg.bin).exists()


def _install(npm: str, pkg: CliPackage, prefix: Path) -> None:
    """npm install the package into `prefix` and check its binary answers with the pinned version."""
    binary = prefix / "node_modules" / ".bin" / pkg.bin
    try:
        done = subprocess.run(
            [npm, "install", "--prefix", str(prefix), "--no-save", "--loglevel=error", pkg.spec],
            capture_output=True,
            text=True,
            env={**os.environ, **_NPM_ENV},
            timeout=900,
        )
        if done.returncode != 0:
            raise ConfigError(f"npm install {pkg.spec} failed (exit {done.returncode}): {_tail(done.stderr)}")
        version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:  # no binary (an optional dependency left out), a hang
        raise ConfigError(f"installing {pkg.spec} with npm: {e}") from e
    if pkg.version not in version.stdout:
        raise ConfigError(
            f"{pkg.spec}: the installed {pkg.bin} says {version.stdout.strip()[:80]!r} "
            f"(exit {version.returncode}): {_tail(version.stderr)}"
        )


def _tail(text: str) -> str:
    return one_line(" ".join(text.strip().splitlines()[-3:]), 400)
