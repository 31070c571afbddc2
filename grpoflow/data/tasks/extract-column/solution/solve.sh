#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
tail -n +2 /app/people.csv | cut -d, -f3 > /app/cities.txt
