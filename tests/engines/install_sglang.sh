#!/usr/bin/env bash
# Install real SGLang 0.5.23 for the CPU, for the live SGLang test lane (tests/engines/): prints the environment's
# python on stdout and nothing else; quiet unless it fails (then pip's log tail and one line on stderr, exit 1).
#
#   tests/engines/install_sglang.sh [PROJECT_PYTHON]     (default: .venv/bin/python of this checkout)
#
# SGLang pins torch 2.14.1 (the project's own), CUDA kernels and versions of openai / transformers that conflict
# with Harbor's, so it gets a venv of its own under ${GRPOFLOW_CACHE:-~/.cache/grpoflow}/engines/sglang-0.5.23/:
# made from the project venv's base interpreter (the same Python), with a .pth file that appends the project venv's
# site-packages to its path, so torch, transformers, fastapi, ... are the project's and only what SGLang needs
# beyond them is installed here, each with --no-deps at a pinned version (SGLang's own pin where it has one).
#
# SGLang's CPU kernels are not built here; its torch-native paths run. `sgl_kernel` (the kernel package SGLang
# imports everywhere) has no CPU build on the registry and no source package, so tests/engines/sgl_kernel_shim/
# stands in for it: every function in it raises when called, and with `--device cpu --attention-backend
# torch_native` SGLang calls none.
#
# The venv is reused while its recipe (this file, the shim, the base Python) is unchanged and rebuilt when it
# changes; the .pth is rewritten when the project venv moves. A first install takes about two minutes and 400 MB
# here (the sglang wheel is 39 MB); a reuse well under a second.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
project_python=${1:-$here/../../.venv/bin/python}
fail() { echo "install_sglang.sh: $*" >&2; exit 1; }
[ -x "$project_python" ] || fail "no project python at $project_python (run ./run.sh test, which makes .venv)"

# What SGLang 0.5.23 imports on its CPU path that the project venv lacks, found by starting it.
PACKAGES=(
  sglang==0.5.23
  apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 sentencepiece==0.2.1 soundfile==0.13.1 xgrammar==0.2.7
  dill==0.4.1 einops==0.8.2 ipython==9.18.1 loguru==0.7.3 msgspec==0.23.0 partial-json-parser==0.2.1.1.post7
  pybase64==1.5.1 python-multipart==0.0.34 pyzmq==27.3.0 torchvision==0.29.1 traitlets==5.16.1 uvloop==0.23.0
)

read -r base site < <("$project_python" -c 'import sys, sysconfig; print(sys._base_executable, sysconfig.get_paths()["purelib"])')
root=${GRPOFLOW_CACHE:-$HOME/.cache/grpoflow}/engines/sglang-0.5.23
venv=$root/venv
recipe=$( { cat "$0" "$here/sgl_kernel_shim/sgl_kernel/__init__.py"; "$base" -VV; } | sha256sum | cut -d' ' -f1)
mkdir -p "$root"
exec 9>"$root/.lock"
flock 9  # one install at a time; a second caller waits and then finds it done

if [ "$(cat "$venv/.grpoflow-recipe" 2>/dev/null)" != "$recipe" ]; then
  rm -rf "$venv"
  started=$(date +%s)
  log=$root/install.log
  if ! { "$base" -m venv "$venv" &&
         "$venv/bin/python" -m pip install --disable-pip-version-check --no-deps "${PACKAGES[@]}"; } > "$log" 2>&1; then
    tail -n 20 "$log" >&2
    fail "installing SGLang into $venv failed (full log: $log)"
  fi
  packages=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp -r "$here/sgl_kernel_shim/sgl_kernel" "$packages/"
  echo "$(( $(date +%s) - started ))" > "$venv/.grpoflow-install-seconds"  # for bench/engines.py
  echo "$recipe" > "$venv/.grpoflow-recipe"
fi
packages=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pth=$packages/grpoflow-project.pth
[ "$(cat "$pth" 2>/dev/null)" = "$site" ] || echo "$site" > "$pth"
echo "$venv/bin/python"
