#!/usr/bin/env bash
# The README's two commands: `./run.sh main` (the main job on the embedded default) and `./run.sh test`.
# Each one first makes sure the environment exists: Python >= 3.12 in .venv with the pinned dependencies
# (re-installed when pyproject.toml changes), and the system tools the local sandbox needs (bubblewrap, tmux, and
# slirp4netns and nftables for tasks with a network);
# `test` also installs chromium for the browser test of the Prefect UI, and Docker (engine started, base image
# built) for the tests of tasks built from their Dockerfile.
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  for py in python3.12 python3.13 python3; do
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$py"; return 0
    fi
  done
  echo "run.sh: need Python >= 3.12 (harbor requires it); install python3.12 or select it with pyenv" >&2
  return 1
}

apt_install() {
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq >/dev/null &&
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_system_tools() {
  local missing=()
  command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
  command -v tmux >/dev/null 2>&1 || missing+=(tmux)
  # A task whose network policy is public or an allowlist: user-mode networking and its filter.
  command -v slirp4netns >/dev/null 2>&1 || missing+=(slirp4netns)
  PATH="$PATH:/usr/sbin:/sbin" command -v nft >/dev/null 2>&1 || missing+=(nftables)
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "run.sh: installing ${missing[*]} (the local sandbox needs them)" >&2
  apt_install "${missing[@]}"
}

# The browser test of the Prefect UI drives Debian's headless chromium, and the claude-code / opencode tests install
# the pinned CLIs with npm (once, into the cache); without them those tests are skipped.
ensure_test_tools() {
  if ! command -v chromium >/dev/null 2>&1; then
    echo "run.sh: installing chromium (the Prefect UI browser test needs it)" >&2
    apt_install chromium || echo "run.sh: could not install chromium; the UI browser test will be skipped" >&2
  fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "run.sh: installing npm (the claude-code and opencode tests install their CLIs with it)" >&2
    apt_install npm || echo "run.sh: could not install npm; the claude-code and opencode tests will be skipped" >&2
  fi
  # Tasks built from their Dockerfile (tests/integration/docker/): a Docker engine and the Debian base image that
  # their FROM lines name (no registry serves images here). Not needed by the main job. A failure does not stop the
  # suite: those tests fail with the reason.
  local docker_missing=()
  command -v dockerd >/dev/null 2>&1 || docker_missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || docker_missing+=(debootstrap)
  if [ ${#docker_missing[@]} -gt 0 ]; then
    echo "run.sh: installing ${docker_missing[*]} (the Dockerfile-task tests build images with them)" >&2
    apt_install "${docker_missing[@]}" || echo "run.sh: could not install ${docker_missing[*]}" >&2
  fi
  scripts/docker-env.sh ||
    echo "run.sh: Docker is not ready (reason above); the tests in tests/integration/docker/ will fail with it" >&2
}

ensure_venv() {
  local stamp=.venv/.grpoflow-installed want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  if [ ! -x .venv/bin/python ]; then "$(find_python)" -m venv .venv; fi
  echo "run.sh: installing grpoflow and its pinned dependencies into .venv (first run: a few minutes)" >&2
  # pip's output goes to a log, shown only when the install fails.
  if ! { .venv/bin/python -m pip install --upgrade pip &&
         .venv/bin/python -m pip install -e '.[dev]'; } > .venv/install.log 2>&1; then
    tail -n 30 .venv/install.log >&2
    echo "run.sh: installing dependencies failed (full log: .venv/install.log)" >&2
    return 1
  fi
  echo "$want" > "$stamp"
}

# The live SGLang lane (tests/engines/) runs real SGLang on the CPU from an environment of its own, cached outside
# the repo (tests/engines/install_sglang.sh: about two minutes and 400 MB the first time). A failed install does not
# stop the suite: the lane's tests fail with its reason.
ensure_sglang() {
  tests/engines/install_sglang.sh .venv/bin/python >/dev/null ||
    echo "run.sh: SGLang for the live lane did not install; the lane's tests will fail with the reason" >&2
}

# The live vLLM lane (tests/engines/test_vllm.py) runs vLLM's CPU build from a Python 3.11 venv of its own, cached
# outside the repo (tests/engines/install_vllm.sh: about two and a half minutes and 3.5 GB the first time). A failed
# install does not stop the suite: the lane's tests fail with its reason.
ensure_vllm() {
  tests/engines/install_vllm.sh >/dev/null ||
    echo "run.sh: vLLM for the live lane did not install; the lane's tests will fail with the reason" >&2
}

# Offline hygiene (nothing phones home) is set by the `flows` package itself, for the CLI and the tests alike.

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  main) ensure_system_tools; ensure_venv; exec .venv/bin/grpoflow main "$@" ;;
  test) ensure_system_tools; ensure_test_tools; ensure_venv; ensure_sglang; ensure_vllm; exec .venv/bin/python -m pytest "$@" ;;
  *) echo "usage: ./run.sh main [grpoflow options] | ./run.sh test [pytest options]" >&2; exit 2 ;;
esac
