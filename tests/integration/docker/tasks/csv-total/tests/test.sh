#!/bin/bash
# Harbor's way: run the pytest checks, write the reward the exit status gives.
set -u
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
rm -f /logs/verifier/reward.json
if python3 -m pytest -q -p no:cacheprovider /tests/test_total.py; then
    echo 1 > /logs/verifier/reward.txt
fi
