#!/bin/bash
# Print the sum of the integers in the file given as the first argument (one per line).
total=0
while read -r n; do
    total=$((total + n)
done < "$1"
echo "total"
