#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
sed -i 's/cat/dog/g' /app/story.txt
