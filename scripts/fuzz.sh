#!/usr/bin/env bash
# Builds a libFuzzer target (clang, ASan+UBSan, in build-fuzz/) and fuzzes it for SECONDS
# (default 60): fuzz_envelope (the request envelope, the default; seeds in
# tests/fuzz/corpus) or fuzz_grpc (the gRPC front's HTTP/2 session; tests/fuzz/corpus_grpc).
#   bash scripts/fuzz.sh [SECONDS] [TARGET]
# New inputs go to build-fuzz/corpus-work (the committed seeds are only read), crash
# files to build-fuzz/artifacts/. Exits non-zero when the fuzzer finds a crash, a leak,
# a sanitizer report or a failed response check; the last line says which.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
target=${2:-fuzz_envelope}
case $target in
fuzz_envelope) seeds=tests/fuzz/corpus suffix= ;;
fuzz_grpc) seeds=tests/fuzz/corpus_grpc suffix=-grpc ;;
*) seconds=x ;;
esac
if ! [[ $seconds =~ ^[0-9]+$ ]] || [ "$seconds" -lt 1 ]; then
    echo "usage: bash scripts/fuzz.sh [SECONDS] [fuzz_envelope|fuzz_grpc]" >&2
    exit 2
fi

builddir=build-fuzz
if [ ! -f "$builddir/build.ninja" ]; then
    CC=clang meson setup "$builddir" -Dfuzz=true -Dtests=false \
        -Db_sanitize=address,undefined -Db_lundef=false
fi
meson compile -C "$builddir" "$target"

work=$builddir/corpus-work$suffix
artifacts=$builddir/artifacts
scratch=$builddir/tmp # the target's LMDB directories (TMPDIR)
log=$builddir/fuzz$suffix.log
mkdir -p "$work" "$artifacts" "$scratch"
cp -n "$seeds"/* "$work"/ 2>/dev/null || true

export TMPDIR=$PWD/$scratch
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
# libFuzzer stops itself after max_total_time; timeout is the backstop for a hang it
# cannot see (e.g. a deadlock outside the target's -timeout handling).
timeout --kill-after=30 $((seconds + 120)) \
    "$builddir/tests/fuzz/$target" -max_total_time="$seconds" -max_len=70000 \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts/" \
    "$work" "$seeds" >"$log" 2>&1 || status=$?
rm -rf "${scratch:?}"/idemrpc-fuzz.* # left behind only when the target crashed

grep -E '^#[0-9]+.*(INITED|DONE)' "$log" || true
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -n1)
if [ "$status" -ne 0 ]; then
    tail -n 60 "$log"
    crash=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n1)
    echo "fuzz: FAILED (exit $status) after ${runs:-?} runs; reproducer: ${crash:-none}; log: $log"
    exit "$status"
fi
echo "fuzz: ${runs:-?} runs in ${secs:-$seconds} s, no crashes"
