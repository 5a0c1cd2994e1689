#!/usr/bin/env bash
# Builds and installs (into a scratch DESTDIR) one combination of the build options the
# README names, and checks that the installed idemrpc.pc lists only what was built.
#   bash scripts/build-options.sh -Dpostgres=disabled -Dredis=disabled -Dnats=disabled -Djson=disabled -Dgrpc=disabled -Dtests=false
# With no options: the LMDB-only build (what .ci/run checks).
set -euo pipefail
cd "$(dirname "$0")/.."
opts=("$@")
[ ${#opts[@]} -gt 0 ] || opts=(-Dpostgres=disabled -Dredis=disabled -Dnats=disabled -Djson=disabled -Dgrpc=disabled -Dtests=false)
dir=$(mktemp -d /tmp/idemrpc-options-XXXXXX)
trap 'rm -rf "$dir"' EXIT
meson setup "$dir/b" --prefix=/usr "${opts[@]}" >/dev/null
meson compile -C "$dir/b" >/dev/null
DESTDIR="$dir/root" meson install -C "$dir/b" >/dev/null
pc=$(find "$dir/root" -name idemrpc.pc)
want() { # option value, the pc module it implies
    case " ${opts[*]} " in *" -D$1=disabled "*) ! grep -q "$2" "$pc" ;; *) true ;; esac
}
want postgres libpq || { echo "build-options: $pc lists libpq in a build without it" >&2; exit 1; }
want redis hiredis || { echo "build-options: $pc lists hiredis in a build without it" >&2; exit 1; }
want nats libnats || { echo "build-options: $pc lists libnats in a build without it" >&2; exit 1; }
want json jansson || { echo "build-options: $pc lists jansson in a build without it" >&2; exit 1; }
want grpc nghttp2 || { echo "build-options: $pc lists libnghttp2 in a build without it" >&2; exit 1; }
want grpc libssl || { echo "build-options: $pc lists libssl (the gRPC front's TLS) in a build without it" >&2; exit 1; }
echo "build-options: ${opts[*]}: built, installed, $(grep '^Requires.private' "$pc")"
