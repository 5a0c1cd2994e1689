#!/usr/bin/env bash
# One command from a fresh Debian machine: install dependencies, build, start
# idemrpc-demo in the background, and walk through what it guarantees.
#   bash scripts/demo.sh          # set up, (re)start the demo server, run the walk-through
#   bash scripts/demo.sh stop     # stop the demo server
#   IDEMRPC_GRPC=tcp://127.0.0.1:7790 bash scripts/demo.sh   # also serve gRPC there
# The server keeps running afterwards on tcp://127.0.0.1:7700 (store ./idemrpc-data,
# log ./idemrpc-demo.log) for you to call with build/tools/idemrpc-call (or, with
# IDEMRPC_GRPC, any gRPC client: README "gRPC").
set -euo pipefail
cd "$(dirname "$0")/.."
URL=${IDEMRPC_URL:-tcp://127.0.0.1:7700}
GRPC=()
[ -z "${IDEMRPC_GRPC:-}" ] || GRPC=(--grpc "$IDEMRPC_GRPC")
PIDFILE=idemrpc-demo.pid

stop() {
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        kill "$(cat "$PIDFILE")"
        while kill -0 "$(cat "$PIDFILE")" 2>/dev/null; do sleep 0.1; done
        echo "idemrpc-demo stopped"
    fi
    rm -f "$PIDFILE"
}
if [ "${1:-}" = "stop" ]; then stop; exit 0; fi

bash scripts/bootstrap.sh
[ -f build/build.ninja ] || meson setup build
meson compile -C build

stop
rm -rf ./idemrpc-data # a fresh store, so the walk-through starts from zero
build/tools/idemrpc-demo --listen "$URL" "${GRPC[@]}" --db ./idemrpc-data --delay-ms 300 \
    >idemrpc-demo.log 2>&1 &
echo $! >"$PIDFILE"
for _ in $(seq 100); do grep -q listening idemrpc-demo.log && break; sleep 0.1; done
grep -q listening idemrpc-demo.log || { cat idemrpc-demo.log; exit 1; }

call() { echo "\$ idemrpc-call $URL $*"; build/tools/idemrpc-call "$URL" "$@" || true; echo; }
echo "== demo.Counter/Add is NOT idempotent by itself: it adds to a total."
echo "== The handler takes 300 ms; the first call waits only 100 ms per attempt, times"
echo "== out, and retries with the SAME key: the retry gets the first result."
call demo.Counter/Add 5 --key pay-1 --timeout-ms 100
echo "== Sent again (a payment callback arriving twice): replayed, total unchanged."
call demo.Counter/Add 5 --key pay-1
call demo.Counter/Get ""
echo "== Same key, different request: rejected, nothing runs."
call demo.Counter/Add 50 --key pay-1
echo "== One-time submit token: the first submit creates an order, a double-click replays it."
TOKEN=$(build/tools/idemrpc-call "$URL" idem.Token/Issue "" | awk '/^token:/ {print $2}')
call demo.Order/Submit "" --token "$TOKEN"
call demo.Order/Submit "" --token "$TOKEN"
echo "idemrpc-demo is running on $URL (pid $(cat "$PIDFILE")); stop it with: bash scripts/demo.sh stop"
