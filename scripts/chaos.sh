#!/usr/bin/env bash
# The fault campaign on every topology this build has (docs/chaos.md), as .ci/run runs it:
#   bash scripts/chaos.sh [SECONDS] [SEED]    # default 60 s per topology, seed 16016
#   bash scripts/chaos.sh 60 drawn            # a seed drawn now (printed, to replay)
# lmdb always; pg with the servers of scripts/services.sh in the environment
# (IDEMRPC_TEST_PG, IDEMRPC_TEST_REDIS, IDEMRPC_SERVICES); nats in a build with libnats
# and nats-server on the PATH. Needs build/ (scripts/test.sh builds it). Every topology
# runs even after one failed; the exit status is 1 if any did.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
seed=${2:-16016}
[ "$seed" = drawn ] && seed=$(($(od -An -N2 -tu2 /dev/urandom)))
chaos=build/chaos/idemrpc-chaos
[ -x "$chaos" ] || meson compile -C build
echo "chaos.sh: seed $seed, $secs s per topology; replay one with:"
echo "  $chaos --topology lmdb|pg|nats --seconds $secs --seed $seed"
status=0
# Bounded twice: the program stops by itself (run + at most ~2 min to settle and check),
# and timeout(1) stops it if that ever fails.
run() {
    timeout $((secs + 300)) "$chaos" --topology "$1" --seconds "$secs" --seed "$seed" ||
        { echo "chaos.sh: topology $1, seed $seed FAILED" >&2; status=1; }
}
run lmdb
if [ -n "${IDEMRPC_TEST_PG:-}" ] && [ -n "${IDEMRPC_TEST_REDIS:-}" ]; then
    run pg
else
    echo "chaos.sh: pg topology NOT run: IDEMRPC_TEST_PG / IDEMRPC_TEST_REDIS are not set" >&2
    status=1
fi
# The broker topology (issue 30): its own nats-server -js on a free port.
if grep -q CHAOS_HAVE_NATS build/compile_commands.json && command -v nats-server >/dev/null; then
    run nats
else
    echo "chaos.sh: nats topology NOT run: build/ has no libnats or nats-server is missing" >&2
fi
exit $status
