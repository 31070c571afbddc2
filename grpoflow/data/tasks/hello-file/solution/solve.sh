#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
echo hello > /app/hello.txt
