#!/usr/bin/env bash
# An external program speaks the wire contract: protoc --encode builds an idem.v1.Request
# from text, nngcat --req sends it to idemrpc-demo, protoc --decode reads the Response.
set -euo pipefail
: "${IDEMRPC_DEMO:?}" "${IDEMRPC_PROTO:?}"
command -v protoc >/dev/null && command -v nngcat >/dev/null || {
    echo "SKIP: protoc or nngcat missing"; exit 77; }

work=$(mktemp -d "${TMPDIR:-/tmp}/idemrpc-ext-XXXXXX")
sock="ipc://$work/demo.sock"
"$IDEMRPC_DEMO" --listen "$sock" --db "$work/db" >"$work/demo.log" 2>&1 &
demo=$!
trap 'kill $demo 2>/dev/null; wait $demo 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do grep -q listening "$work/demo.log" && break; sleep 0.05; done
grep -q listening "$work/demo.log" || { cat "$work/demo.log"; exit 1; }

proto_dir=$(dirname "$IDEMRPC_PROTO")
call() { # text-format Request → text-format Response
    printf '%s' "$1" | protoc -I"$proto_dir" --encode=idem.v1.Request idemrpc.proto >"$work/req"
    timeout 10 nngcat --req --dial "$sock" --file "$work/req" --raw --recv-timeout 5 >"$work/resp"
    protoc -I"$proto_dir" --decode=idem.v1.Response idemrpc.proto <"$work/resp"
}
expect() { # $1 = response text, $2 = grep pattern
    grep -q -- "$2" <<<"$1" || { echo "FAIL: expected /$2/ in:"; echo "$1"; exit 1; }
}

r=$(call 'method: "demo.Counter/Add" idempotency_key: "ext-1" payload: "5" attempt: 1')
expect "$r" 'payload: "5"'
expect "$r" 'request_id: "'
r=$(call 'method: "demo.Counter/Add" idempotency_key: "ext-1" payload: "5" attempt: 2')
expect "$r" 'replayed: true'
expect "$r" 'payload: "5"'
r=$(call 'method: "demo.Counter/Get"')
expect "$r" 'payload: "5"'
r=$(call 'method: "demo.Counter/Add" payload: "5"')
expect "$r" 'code: INVALID_ARGUMENT'
r=$(call 'method: "demo.Counter/Add" idempotency_key: "ext-1" payload: "6"')
expect "$r" 'code: INVALID_ARGUMENT'
r=$(call 'method: "nope.X/Y"')
expect "$r" 'code: UNIMPLEMENTED'
printf 'not a protobuf' >"$work/req"
timeout 10 nngcat --req --dial "$sock" --file "$work/req" --raw --recv-timeout 5 >"$work/resp"
r=$(protoc -I"$proto_dir" --decode=idem.v1.Response idemrpc.proto <"$work/resp")
expect "$r" 'code: INVALID_ARGUMENT'
echo "external_encode: all checks passed"
