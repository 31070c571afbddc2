#!/bin/bash
set -eu
python3 -c 'import csv; print(sum(int(r["amount"]) for r in csv.DictReader(open("sales.csv"))))' > "$TOTAL_FILE"
