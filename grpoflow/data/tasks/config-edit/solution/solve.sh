#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
# Only inside [server]: from its header up to the next section header.
sed -i '/^\[server\]/,/^\[/ s/^port = .*/port = 8080/' /app/config.ini
