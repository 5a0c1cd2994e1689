# Sourced by the shell tests: starts idemrpc-demo in a fresh directory and cleans up.
#   start_demo [demo flags...]   sets $work, $sock, $http (base URL), $demo (pid)
set -euo pipefail
: "${IDEMRPC_DEMO:?}"
work=$(mktemp -d "${TMPDIR:-/tmp}/idemrpc-sh-XXXXXX")
demo=
cleanup() {
    [ -n "$demo" ] && kill "$demo" 2>/dev/null && wait "$demo" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

start_demo() {
    sock="ipc://$work/demo.sock"
    "$IDEMRPC_DEMO" --listen "$sock" --http http://127.0.0.1:0 --db "$work/db" "$@" \
        >"$work/demo.out" 2>"$work/demo.err" &
    demo=$!
    for _ in $(seq 200); do grep -q listening "$work/demo.out" && break; sleep 0.05; done
    grep -q listening "$work/demo.out" || { cat "$work/demo.err"; fail "demo did not start"; }
    http="http://127.0.0.1:$(awk '/http on port/ {print $5}' "$work/demo.out")"
}

# Polls until "$@" succeeds (a condition, not a fixed sleep); fails after 10 s.
await() {
    for _ in $(seq 200); do "$@" >/dev/null 2>&1 && return 0; sleep 0.05; done
    fail "timed out waiting for: $*"
}
