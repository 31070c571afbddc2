#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
awk '{ count[$NF]++ } END { for (s in count) print s, count[s] }' /app/access.log | sort -n > /app/summary.txt
