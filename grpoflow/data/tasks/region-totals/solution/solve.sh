#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
tail -n +2 /app/sales.csv | awk -F, '{ t[$1] += $2 } END { for (r in t) print r "," t[r] }' | sort > /app/totals.txt
