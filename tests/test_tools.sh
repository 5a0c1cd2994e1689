#!/usr/bin/env bash
# The command-line contract of every program (tools/cli.h): --help prints the usage on
# stdout and exits 0 without doing anything else; an unknown option, a missing value or
# a bad number exits 2 with the usage on stderr and names the option that was wrong.
#   test_tools.sh IDEMRPC_DEMO IDEMRPC_CALL IDEMCTL IDEMRPC_BENCH IDEMRPC_SOAK IDEMRPC_CHAOS
set -euo pipefail
[ $# = 6 ] || { echo "usage: test_tools.sh DEMO CALL IDEMCTL BENCH SOAK CHAOS" >&2; exit 2; }
demo=$1 call=$2 ctl=$3 bench=$4 soak=$5 chaos=$6
work=$(mktemp -d "${TMPDIR:-/tmp}/idemrpc-tools-XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# expect STATUS GREP-PATTERN STREAM CMD...: CMD exits STATUS and STREAM (out|err) matches.
expect() {
    local want=$1 pattern=$2 stream=$3 rc=0
    shift 3
    timeout 10 "$@" >"$work/out" 2>"$work/err" || rc=$?
    [ "$rc" = "$want" ] || fail "$* exited $rc, want $want: $(cat "$work/err")"
    grep -q -- "$pattern" "$work/$stream" || fail "$*: $stream lacks '$pattern': $(cat "$work/$stream")"
}

for prog in "$demo" "$call" "$ctl" "$bench" "$soak" "$chaos"; do
    name=$(basename "$prog")
    expect 0 usage out "$prog" --help
    [ -s "$work/err" ] && fail "$name --help wrote to stderr: $(cat "$work/err")"
    expect 2 usage err "$prog" --no-such-flag
    grep -q -- --no-such-flag "$work/err" || fail "$name does not name the unknown option"
done

# Bad numbers and missing values name their option.
expect 2 "--delay-ms" err "$demo" --delay-ms 10x
expect 2 "--flaky" err "$demo" --flaky -1
expect 2 "--listen" err "$demo" --listen
expect 2 "--log-level" err "$demo" --log-level loud
expect 2 "unexpected argument" err "$demo" stray
expect 2 "--limit" err "$ctl" --db "$work/db" list --limit ten
expect 2 "--state" err "$ctl" --db "$work/db" list --state done
expect 2 "--db DIR is required" err "$ctl" stats
expect 2 "needs METHOD KEY" err "$ctl" --db "$work/db" show demo.Counter/Add
expect 2 "unknown command" err "$ctl" --db "$work/db" bogus
expect 2 "--count" err "$bench" --count 0
expect 2 "--clients" err "$bench" --clients 1,x
expect 2 "--seconds" err "$bench" --seconds
expect 2 "--keys" err "$soak" --keys many
expect 2 "unexpected argument" err "$soak" 100
# idemrpc-call: URL METHOD PAYLOAD are taken by place (a payload may look like a flag).
expect 2 "URL METHOD PAYLOAD" err "$call" tcp://127.0.0.1:1 demo.Counter/Add
expect 2 "--timeout-ms" err "$call" tcp://127.0.0.1:1 demo.Counter/Add -5 --timeout-ms 1s
expect 2 "unexpected argument" err "$call" tcp://127.0.0.1:1 demo.Counter/Add 5 --key k extra
# idemrpc-chaos: required options, bad values, and what pg needs.
expect 2 usage err "$chaos" --topology lmdb --seconds 5
expect 2 --topology err "$chaos" --topology sqlite --seconds 5 --seed 1
expect 2 --seconds err "$chaos" --topology lmdb --seconds 0 --seed 1
expect 2 --seed err "$chaos" --topology lmdb --seconds 5 --seed -1
expect 2 "unexpected argument" err "$chaos" --topology lmdb --seconds 5 --seed 1 extra
expect 2 IDEMRPC_TEST_PG err env -u IDEMRPC_TEST_PG -u IDEMRPC_TEST_REDIS \
    "$chaos" --topology pg --seconds 5 --seed 1 --dir "$work/pg"
echo "test_tools: all checks passed"
