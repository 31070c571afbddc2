#!/bin/bash
# Verifier for the "fix-script" task.
# Reward 1 if sum.sh prints the right sum for every hidden input, 0 otherwise.
# `set -u`, not `set -e`: a failed check must end in reward 0, never in an exit that leaves no reward.
set -u
mkdir -p /logs/verifier
# Reward 0 goes down first, so a crash or early exit below still leaves a valid score.
echo 0 > /logs/verifier/reward.txt
# Harbor reads reward.json in preference to reward.txt: never let one the agent planted win.
rm -f /logs/verifier/reward.json

finish() {
    rm -f /logs/verifier/reward.json
    echo "$1" > /logs/verifier/reward.txt
    echo "reward: $1"
    exit 0
}
fail() { echo "FAIL: $*"; finish 0; }
# A regular file, not a symlink: a link could point at an expected answer under /tests.
need_file() { [ -f "$1" ] && [ ! -L "$1" ] || fail "$1 is missing or not a regular file"; }
# Equal text up to trailing newlines ($(...) strips them on both sides).
same_text() { [ "$(cat -- "$1")" = "$(cat -- "$2")" ]; }

need_file /app/sum.sh
# Hidden inputs, so a script that only prints 15 does not pass. The agent's script runs under a
# time limit, from /tmp, with no stdin, and only its stdout counts. Its output goes to a file, not a
# pipe: a background child it leaves holding a pipe open would stall the verifier past its timeout.
out="$(mktemp)"
for case in /tests/cases/*.txt; do
    expected="$(cat "${case%.txt}.expected")"
    (cd /tmp && timeout 10 bash /app/sum.sh "$case" < /dev/null > "$out" 2>/dev/null)
    got="$(cat "$out")"
    [ "$got" = "$expected" ] || fail "sum.sh on $(basename "$case") printed '$got', expected $expected"
done
finish 1
