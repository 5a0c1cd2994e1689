#!/usr/bin/env bash
# The command-line contract of idemrpc-chaos (tools/cli.h): --help prints the usage on
# stdout and exits 0; an unknown option, a missing or bad value, or a missing required
# option exits 2 with the usage on stderr, naming what was wrong; the pg topology says
# which environment variables it lacks.
#   test_chaos_cli.sh IDEMRPC_CHAOS
set -euo pipefail
[ $# = 1 ] || { echo "usage: test_chaos_cli.sh IDEMRPC_CHAOS" >&2; exit 2; }
chaos=$1
work=$(mktemp -d "${TMPDIR:-/tmp}/idemrpc-chaos-cli-XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# expect STATUS GREP-PATTERN STREAM CMD...: CMD exits STATUS and STREAM (out|err) matches.
expect() {
    local want=$1 pattern=$2 stream=$3 rc=0
    shift 3
    timeout 10 "$@" >"$work/out" 2>"$work/err" || rc=$?
    [ "$rc" = "$want" ] || fail "$* exited $rc, want $want: $(cat "$work/err")"
    grep -q -- "$pattern" "$work/$stream" || fail "$*: $stream lacks '$pattern'"
}

expect 0 usage out "$chaos" --help
[ -s "$work/err" ] && fail "--help wrote to stderr"
expect 2 --no-such-flag err "$chaos" --no-such-flag
expect 2 usage err "$chaos" --topology lmdb --seconds 5
expect 2 --topology err "$chaos" --topology sqlite --seconds 5 --seed 1
expect 2 --seconds err "$chaos" --topology lmdb --seconds 0 --seed 1
expect 2 --seed err "$chaos" --topology lmdb --seconds 5 --seed -1
expect 2 "unexpected argument" err "$chaos" --topology lmdb --seconds 5 --seed 1 extra
expect 2 IDEMRPC_TEST_PG err env -u IDEMRPC_TEST_PG -u IDEMRPC_TEST_REDIS \
    "$chaos" --topology pg --seconds 5 --seed 1 --dir "$work/pg"
echo "test_chaos_cli: ok"
