#!/bin/bash
# Reference solution (Harbor's oracle agent runs it); the verifier must score it 1.0.
set -euo pipefail
cat > /app/sum.sh <<'EOF'
#!/bin/bash
# Print the sum of the integers in the file given as the first argument (one per line).
total=0
while read -r n; do
    total=$((total + n))
done < "$1"
echo "$total"
EOF
