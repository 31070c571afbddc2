#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
cat /app/parts/part1.txt /app/parts/part2.txt /app/parts/part3.txt > /app/whole.txt
sha256sum /app/whole.txt | cut -d' ' -f1 > /app/whole.sha256
