#!/bin/bash
# Verifier for the "copy-file" task.
# Reward 1 if backup.txt is a copy and source.txt is intact, 0.5 if source.txt was lost, else 0.
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

need_file /app/backup.txt
same_text /app/backup.txt /tests/source.txt || fail "/app/backup.txt differs from the original source.txt"
# A copy keeps the original; moving it away does only half the task.
if [ -f /app/source.txt ] && same_text /app/source.txt /tests/source.txt; then
    finish 1
fi
echo "FAIL: /app/source.txt is gone or changed"
finish 0.5
