#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
cat > /app/prime.sh <<'EOF'
# is_prime N: exit status 0 if N is prime, 1 otherwise.
is_prime() {
    local n=$1 k
    (( n < 2 )) && return 1
    for (( k = 2; k * k <= n; k++ )); do
        (( n % k == 0 )) && return 1
    done
    return 0
}
EOF
