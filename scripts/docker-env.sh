#!/usr/bin/env bash
# Makes a Docker engine answer and the Debian base image exist, for tasks whose environment is built from their
# Dockerfile (the tests in tests/integration/docker/ and whoever runs such tasks): starts `dockerd` in the
# background when none answers (log: $DOCKERD_LOG), then scripts/base-image.sh. Idempotent, well under a second
# when all is there. `./run.sh test` installs docker.io and debootstrap first and then runs this; the tests' fixture
# runs it too. On failure: exit 1 with the reason on stderr. The main job on the built-in tasks never needs it.
set -euo pipefail
here=$(dirname "$0")
log=${DOCKERD_LOG:-/tmp/grpoflow-dockerd.log}

command -v docker >/dev/null || { echo "docker-env.sh: the docker CLI is not installed (./run.sh test installs docker.io)" >&2; exit 1; }
if ! docker version >/dev/null 2>&1; then
  if [ -n "${DOCKER_HOST:-}" ] && [ "$DOCKER_HOST" != unix:///var/run/docker.sock ]; then
    echo "docker-env.sh: DOCKER_HOST=$DOCKER_HOST does not answer (not starting a local engine in its place)" >&2
    exit 1
  fi
  command -v dockerd >/dev/null || { echo "docker-env.sh: dockerd is not installed (apt-get install docker.io)" >&2; exit 1; }
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo -n"
  echo "docker-env.sh: starting dockerd in the background (log: $log)" >&2
  # The daemon outlives this script: it must not keep the caller's other descriptors open (a lock file the
  # caller holds, e.g. `flock LOCK ./run.sh test`, would stay locked for as long as dockerd runs).
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      [ "$fd" -gt 2 ] && eval "exec $fd>&-" 2>/dev/null
    done
    exec nohup $sudo dockerd >"$log" 2>&1 </dev/null
  ) &
  for _ in $(seq 60); do
    docker version >/dev/null 2>&1 && break
    sleep 0.5
  done
  if ! docker version >/dev/null 2>&1; then
    tail -n 10 "$log" >&2 || true
    echo "docker-env.sh: dockerd did not come up within 30 s (log: $log)" >&2
    exit 1
  fi
fi
exec "$here/base-image.sh"
