#!/usr/bin/env bash
# The installed headers and pkg-config file are enough to build a program against
# idemrpc (every public header listed in install_headers, none missing).
set -euo pipefail
build=${1:?usage: test_install.sh BUILD_DIR}
dest=$(mktemp -d "${TMPDIR:-/tmp}/idemrpc-install-XXXXXX")
trap 'rm -rf "$dest"' EXIT
meson install -C "$build" --destdir "$dest" --no-rebuild --quiet >/dev/null
prefix=$(find "$dest" -name idemrpc.pc -printf '%h\n' | head -n 1)
[ -n "$prefix" ] || { echo "FAIL: idemrpc.pc not installed"; exit 1; }
inc=$(find "$dest" -type d -path '*/include/idemrpc' | head -n 1)
[ -n "$inc" ] || { echo "FAIL: headers not installed"; exit 1; }
cat >"$dest/use.c" <<'C'
#include <idemrpc/idemrpc.h>
int main(void) { return idem_code_name(IDEM_OK)[0] == 'O' ? 0 : 1; }
C
cc -std=c11 -Wall -Werror -I"$(dirname "$inc")" -c "$dest/use.c" -o "$dest/use.o"
grep -q '^Libs:.*-lidemrpc' "$prefix/idemrpc.pc" || { echo "FAIL: idemrpc.pc"; exit 1; }
echo "test_install: installed headers compile"
