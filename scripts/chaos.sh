#!/usr/bin/env bash
# The fault campaign on both topologies (README "Fault campaign"), as .ci/run runs it:
#   bash scripts/chaos.sh [SECONDS] [SEED]    # default 60 s per topology, seed 16016
# Needs build/ (scripts/test.sh builds it) and, for the pg topology, the servers of
# scripts/services.sh in the environment (IDEMRPC_TEST_PG, IDEMRPC_TEST_REDIS,
# IDEMRPC_SERVICES). Each run is bounded; the seed is printed so a failure replays.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
seed=${2:-16016}
chaos=build/chaos/idemrpc-chaos
[ -x "$chaos" ] || meson compile -C build
echo "chaos.sh: seed $seed, $secs s per topology; replay one with:"
echo "  $chaos --topology lmdb|pg --seconds $secs --seed $seed"
status=0
# Bounded twice: the program stops by itself (run + at most ~2 min to settle and check),
# and timeout(1) stops it if that ever fails.
timeout $((secs + 300)) "$chaos" --topology lmdb --seconds "$secs" --seed "$seed" || status=1
if [ -n "${IDEMRPC_TEST_PG:-}" ] && [ -n "${IDEMRPC_TEST_REDIS:-}" ]; then
    timeout $((secs + 300)) "$chaos" --topology pg --seconds "$secs" --seed "$seed" || status=1
else
    echo "chaos.sh: pg topology NOT run: IDEMRPC_TEST_PG / IDEMRPC_TEST_REDIS are not set" >&2
    status=1
fi
exit $status
