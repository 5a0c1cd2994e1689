#!/bin/sh
# The LMDB tombstone target (issue 36 item 4): at most 64 B per tombstone when the sweep
# writes them in a random order (--expiries 1000), as idemrpc-tombstone-bytes measures
# at its default 1e5 (docs/performance.md "Tombstones on LMDB").
bench=${1:?usage: test_tombstone_bytes.sh PATH-TO-idemrpc-tombstone-bytes}
out=$("$bench" --records 100000 --expiries 1000) || { echo "$out"; exit 1; }
echo "$out"
bytes=$(printf '%s\n' "$out" | sed -n 's/^tombstone_bytes .*= \([0-9.]*\) B.*/\1/p')
[ -n "$bytes" ] || { echo "no tombstone_bytes line"; exit 1; }
awk -v b="$bytes" 'BEGIN { exit !(b <= 64) }' || { echo "FAIL: $bytes B per tombstone > 64"; exit 1; }
echo "test_tombstone_bytes: $bytes B per tombstone <= 64"
