#!/usr/bin/env bash
# What `meson install` puts on disk is enough to use idemrpc (docs/guide.md, "Use it from your
# project"): the headers, idemrpc.pc (no absolute library paths), the wire contract
# under share/idemrpc/, tools that run without LD_LIBRARY_PATH, and examples/consumer
# builds with meson and with make through pkg-config and runs.
#   test_install.sh BUILD_DIR CONSUMER_DIR [B_SANITIZE]
# Installs into a temporary DESTDIR; pkg-config finds that copy through
# PKG_CONFIG_SYSROOT_DIR, as it would a staged root.
set -euo pipefail
build=${1:?usage: test_install.sh BUILD_DIR CONSUMER_DIR [B_SANITIZE]}
consumer=${2:?usage: test_install.sh BUILD_DIR CONSUMER_DIR [B_SANITIZE]}
sanitize=${3:-none}
dest=$(mktemp -d "${TMPDIR:-/tmp}/idemrpc-install-XXXXXX")
demo=
trap '[ -n "$demo" ] && kill "$demo" 2>/dev/null; rm -rf "$dest"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
unset LD_LIBRARY_PATH

meson install -C "$build" --destdir "$dest/root" --no-rebuild --quiet >/dev/null
pc=$(find "$dest/root" -name idemrpc.pc | head -n 1)
[ -n "$pc" ] || fail "idemrpc.pc not installed"
prefix=$dest/root$(sed -n 's/^prefix=//p' "$pc")
bin=$prefix/bin
[ -x "$bin/idemrpc-demo" ] && [ -x "$bin/idemrpc-call" ] && [ -x "$bin/idemctl" ] ||
    fail "tools not installed in $bin"
[ -f "$prefix/share/idemrpc/idemrpc.proto" ] || fail "share/idemrpc/idemrpc.proto missing"

# idemrpc.pc: -lnng (Debian's nng has no .pc), no path to a library file.
grep -q '^Libs:.*-lidemrpc' "$pc" || fail "Libs: $(grep '^Libs:' "$pc")"
grep -q '^Libs.private:.*-lnng' "$pc" || fail "no -lnng: $(grep '^Libs.private:' "$pc")"
grep -E '^Libs.*(/[^ ]*\.(so|a)\b)' "$pc" && fail "absolute library path in idemrpc.pc"

# One version (meson.build, given as IDEMRPC_VERSION and IDEMRPC_SOVERSION): the .pc's,
# the installed library's soname, what the installed tools print.
if [ -n "${IDEMRPC_VERSION:-}" ]; then
    : "${IDEMRPC_SOVERSION:?IDEMRPC_VERSION comes with IDEMRPC_SOVERSION (tests/meson.build)}"
    grep -qx "Version: $IDEMRPC_VERSION" "$pc" || fail "idemrpc.pc: $(grep '^Version:' "$pc")"
    lib=$(find "$dest/root" -name "libidemrpc.so.$IDEMRPC_SOVERSION" | head -n 1)
    [ -n "$lib" ] || fail "no libidemrpc.so.$IDEMRPC_SOVERSION installed"
    # grep reads it all (no -q): objdump is not cut off by SIGPIPE, which pipefail counts
    soname=$(objdump -p "$lib" | grep SONAME)
    grep -q "SONAME *libidemrpc.so.$IDEMRPC_SOVERSION\$" <<<"$soname" || fail "soname: $soname"
    for tool in idemrpc-demo idemrpc-call idemctl; do
        [ "$("$bin/$tool" --version)" = "$tool $IDEMRPC_VERSION" ] ||
            fail "installed $tool --version: $("$bin/$tool" --version)"
    done
fi

# An installed tool finds the installed library through its RUNPATH.
sock=ipc://$dest/demo.sock
"$bin/idemrpc-demo" --listen "$sock" --db "$dest/demo-db" >"$dest/demo.out" 2>&1 &
demo=$!
for _ in $(seq 200); do grep -q listening "$dest/demo.out" && break; sleep 0.05; done
grep -q listening "$dest/demo.out" || fail "installed idemrpc-demo: $(cat "$dest/demo.out")"
out=$("$bin/idemrpc-call" "$sock" demo.Counter/Add 5 --key k1) || fail "idemrpc-call: $out"
grep -q '^code: OK' <<<"$out" || fail "idemrpc-call: $out"

# The consumer, against the installed copy only.
export PKG_CONFIG_PATH=$(dirname "$pc") PKG_CONFIG_SYSROOT_DIR=$dest/root
libdir=$(dirname "$(dirname "$pc")")
cflags=()
meson_args=()
if [ "$sanitize" != none ]; then # the library needs the sanitizer runtime linked in
    cflags=("-fsanitize=$sanitize")
    meson_args=("-Db_sanitize=$sanitize" -Db_lundef=false)
fi
# A handler that runs SQL on idem_txn_pg_conn() calls libpq itself: with libpq in the
# build, `pkg-config --libs idemrpc` gives -lpq (libpq is in Requires, not .private).
if grep -q '^Requires.*libpq' "$pc"; then
    pkg-config --libs idemrpc | grep -q -- '-lpq' ||
        fail "libpq in the build, no -lpq from pkg-config --libs: $(pkg-config --libs idemrpc)"
fi
cp -r "$consumer" "$dest/consumer"
meson setup "$dest/consumer-build" "$dest/consumer" "${meson_args[@]}" >"$dest/meson.log" 2>&1 ||
    { cat "$dest/meson.log"; fail "consumer: meson setup"; }
ninja -C "$dest/consumer-build" >"$dest/ninja.log" 2>&1 ||
    { cat "$dest/ninja.log"; fail "consumer: ninja"; }
make -s -C "$dest/consumer" CFLAGS="-O2 -Wall -Wextra -Werror ${cflags[*]}" \
    LDFLAGS="${cflags[*]}" || fail "consumer: make"
for exe in "$dest/consumer-build/consumer" "$dest/consumer/consumer"; do
    out=$(LD_LIBRARY_PATH=$libdir "$exe" "$exe-db") || fail "$exe: $out"
    [ "$out" = "hello, world (call 1), replayed: false
hello, world (call 1), replayed: true" ] || fail "$exe printed: $out"
done
echo "test_install: installed tools run, the consumer builds with meson and make and runs"
