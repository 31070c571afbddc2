#!/bin/bash
# Verifier for the "count-lines" task.
# Reward 1 for the bare count, 0.5 for the right count followed by other text, else 0.
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

need_file /app/count.txt
expected="$(cat /tests/expected_count.txt)"
got="$(tr -d '[:space:]' < /app/count.txt)"
[ "$got" = "$expected" ] && finish 1
# `wc -l /app/data.txt > /app/count.txt` writes "37 /app/data.txt": right count, extra text.
first="$(awk 'NR == 1 { print $1 }' /app/count.txt)"
[ "$first" = "$expected" ] && { echo "FAIL: right count but extra text"; finish 0.5; }
fail "/app/count.txt holds '$got', expected $expected"
