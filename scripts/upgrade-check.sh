#!/usr/bin/env bash
# Upgrade and way back between the previous release point and this tree, on both stores
# (docs/upgrading.md). Builds the previous release's demo and call tool from this
# repository's history (git archive; no download), then on one LMDB directory and on one
# PostgreSQL database:
#   old writes a result → new replays it and writes its own → old replays both (way back)
#   → old and new serve the store at once, each replaying the other's results.
# A replay must be "replayed: true" with the first answer's payload; any other line fails.
#   bash scripts/upgrade-check.sh [BUILD_DIR]    (default build/; needs its idemrpc-demo
#                                                 and idemrpc-call; PostgreSQL from
#                                                 $IDEMRPC_TEST_PG, else LMDB only)
set -euo pipefail
cd "$(dirname "$0")/.."
PREVIOUS=${IDEMRPC_PREVIOUS_RELEASE:-e8b9a13} # the 0.3-era release point (CHANGELOG.md)
new_build=$(cd "${1:-build}" && pwd)
work=$(mktemp -d /tmp/idemrpc-upgrade-XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "upgrade-check: FAIL: $*" >&2; exit 1; }

if ! git cat-file -e "$PREVIOUS^{commit}" 2>/dev/null; then
    if [ "$(git rev-parse --is-shallow-repository 2>/dev/null)" = true ]; then
        echo "upgrade-check: NOT run: a shallow clone lacks $PREVIOUS (clone with history)" >&2
        exit 0
    fi
    fail "the previous release point $PREVIOUS is not in this repository's history"
fi
echo "upgrade-check: building $PREVIOUS ($(git log -1 --format=%s "$PREVIOUS" | cut -c1-60))"
mkdir "$work/old"
git archive "$PREVIOUS" | tar -x -C "$work/old"
(cd "$work/old" && meson setup build -Dtests=false >"$work/old-setup.log" 2>&1 &&
    meson compile -C build tools/idemrpc-demo tools/idemrpc-call >"$work/old-build.log" 2>&1) ||
    { tail -20 "$work"/old-*.log >&2; fail "the previous release did not build"; }
OLD_DEMO=$work/old/build/tools/idemrpc-demo
OLD_CALL=$work/old/build/tools/idemrpc-call
NEW_DEMO=$new_build/tools/idemrpc-demo
NEW_CALL=$new_build/tools/idemrpc-call
n=0

# serve DEMO STORE-ARGS...: starts a demo on a fresh ipc socket, sets $url and $pid.
serve() {
    local demo=$1
    shift
    n=$((n + 1))
    url="ipc://$work/demo$n.sock"
    "$demo" --listen "$url" "$@" >"$work/demo$n.out" 2>"$work/demo$n.err" &
    pid=$!
    pids+=("$pid")
    for _ in $(seq 200); do grep -q listening "$work/demo$n.out" && return 0; sleep 0.05; done
    cat "$work/demo$n.err" >&2
    fail "$demo $* did not start"
}
stop() { kill "$1" && wait "$1" 2>/dev/null || true; }

# expect CALL URL KEY AMOUNT REPLAYED: Counter/Add AMOUNT under KEY answers payload AMOUNT
# (the demo's total starts at 0 in each process, so a first run answers its own amount)
# with the given replayed flag.
expect() {
    local out
    out=$("$1" "$2" demo.Counter/Add "$4" --key "$3" 2>&1) || fail "$3 on $2: $out"
    grep -q "replayed: $5" <<<"$out" || fail "$3 on $2: want replayed: $5, got: $out"
    grep -q "^payload: $4\$" <<<"$out" ||
        fail "$3 on $2: want the first answer $4, got: $out"
}

check_store() {
    local label=$1
    shift
    serve "$OLD_DEMO" "$@"; expect "$OLD_CALL" "$url" "$label-old" 5 false; stop "$pid"
    serve "$NEW_DEMO" "$@"
    expect "$NEW_CALL" "$url" "$label-old" 5 true
    expect "$NEW_CALL" "$url" "$label-new" 7 false
    stop "$pid"
    serve "$OLD_DEMO" "$@" # the way back
    expect "$OLD_CALL" "$url" "$label-old" 5 true
    expect "$OLD_CALL" "$url" "$label-new" 7 true
    local old_url=$url old_pid=$pid
    serve "$NEW_DEMO" "$@" # both at once
    expect "$NEW_CALL" "$url" "$label-old" 5 true
    expect "$OLD_CALL" "$old_url" "$label-new" 7 true
    expect "$OLD_CALL" "$old_url" "$label-mixed" 3 false
    expect "$NEW_CALL" "$url" "$label-mixed" 3 true
    stop "$pid"
    stop "$old_pid"
    echo "upgrade-check: $label: $PREVIOUS -> new -> $PREVIOUS and both at once: every result replayed"
}

check_store lmdb --db "$work/lmdb"
if [ -n "${IDEMRPC_TEST_PG:-}" ]; then
    db=idem_upgrade_$$
    psql "$IDEMRPC_TEST_PG" -qAtc "CREATE DATABASE $db" >/dev/null
    pg_url="postgres://$(sed -n 's/.*user=\([^ ]*\).*/\1/p' <<<"$IDEMRPC_TEST_PG")@127.0.0.1:$(sed -n 's/.*port=\([0-9]*\).*/\1/p' <<<"$IDEMRPC_TEST_PG")/$db"
    check_store pg --store "$pg_url"
    psql "$IDEMRPC_TEST_PG" -qAtc "DROP DATABASE $db WITH (FORCE)" >/dev/null
else
    echo "upgrade-check: PostgreSQL NOT checked: IDEMRPC_TEST_PG is not set" >&2
fi
