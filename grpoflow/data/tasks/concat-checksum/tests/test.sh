#!/bin/bash
# Verifier for the "concat-checksum" task.
# Reward 0.5 for the concatenated file and 0.5 for its digest.
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

score=0
# The digest covers exact bytes, so whole.txt is compared byte for byte (no newline tolerance).
if [ -f /app/whole.txt ] && [ ! -L /app/whole.txt ] && cmp -s /app/whole.txt /tests/whole.txt; then
    score=$((score + 1))
else
    echo "FAIL: /app/whole.txt is missing or not the three parts in order"
fi
if [ -f /app/whole.sha256 ] && [ ! -L /app/whole.sha256 ] && \
   [ "$(tr -d '[:space:]' < /app/whole.sha256)" = "$(tr -d '[:space:]' < /tests/whole.sha256)" ]; then
    score=$((score + 1))
else
    echo "FAIL: /app/whole.sha256 is missing or not exactly the 64-character digest"
fi
case $score in
    2) finish 1 ;;
    1) finish 0.5 ;;
    *) finish 0 ;;
esac
