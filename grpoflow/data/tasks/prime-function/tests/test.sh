#!/bin/bash
# Verifier for the "prime-function" task.
# Reward 1 if is_prime answers every hidden case and sourcing prints nothing, 0 otherwise.
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

need_file /app/prime.sh
# The agent's code runs in a child bash under a time limit, from /tmp, with no stdin; it prints one
# "N status" line per hidden case, compared with the expected list as a whole. Its output goes to a
# file, not a pipe: a background child left holding a pipe open would stall the verifier.
out="$(mktemp)"
(cd /tmp && timeout 20 bash -c '
    out="$(source /app/prime.sh 2>&1)"
    [ -z "$out" ] || { echo "sourcing printed output"; exit 0; }
    source /app/prime.sh >/dev/null 2>&1
    for n in "$@"; do
        is_prime "$n" >/dev/null 2>&1
        echo "$n $?"
    done
' is-prime-check $(cat /tests/cases.txt) < /dev/null > "$out" 2>/dev/null)
got="$(cat "$out")"
[ "$got" = "$(cat /tests/expected.txt)" ] || fail "is_prime gave: $(echo "$got" | tr '\n' ',')"
finish 1
