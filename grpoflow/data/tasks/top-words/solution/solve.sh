#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
tr -cs '[:alpha:]' '\n' < /app/text.txt | tr '[:upper:]' '[:lower:]' | grep -v '^$' \
    | sort | uniq -c | sort -rn | head -n 3 | awk '{ print $2 }' > /app/top3.txt
