#!/usr/bin/env bash
# The command-line contract of every program (tools/cli.h): --help prints the usage on
# stdout and exits 0 without doing anything else (and the installed tools' --version
# prints "NAME VERSION"); an unknown option, a stray argument,
# a missing value or a bad number exits 2 with the usage on stderr and names what was
# wrong. "Every" is checked: each executable() of bench/, chaos/ and tools/ meson.build, and
# each script there, must be one of the programs given.
#   test_tools.sh SRCDIR IDEMRPC_DEMO IDEMRPC_CALL IDEMCTL IDEMRPC_BENCH IDEMRPC_SOAK \
#                 IDEMRPC_CHAOS PLOT_SH [IDEMRPC_HA_CHECK (built with libpq)]
set -euo pipefail
[ $# -ge 8 ] || { echo "usage: test_tools.sh SRCDIR DEMO CALL IDEMCTL BENCH SOAK CHAOS PLOT [HA_CHECK]" >&2; exit 2; }
src=$1 demo=$2 call=$3 ctl=$4 bench=$5 soak=$6 chaos=$7 plot=$8
shift
programs=("$@")
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

given=" $(for p in "${programs[@]}"; do basename "$p"; done | tr '\n' ' ') "
for dir in bench chaos tools; do
    for name in $(sed -n "s/.*executable('\([^']*\)'.*/\1/p" "$src/$dir/meson.build") \
        $(cd "$src/$dir" && ls -- *.sh 2>/dev/null); do
        case $given in
        *" $name "*) continue ;;
        esac
        # idemrpc-ha-check is built only with libpq, idemrpc-grpc-bench only with
        # libnghttp2 (and then given)
        [ "$name" = idemrpc-ha-check ] || [ "$name" = idemrpc-grpc-bench ] ||
            fail "$dir/$name is not checked here: add it to the tools test (tests/meson.build)"
    done
done

for prog in "${programs[@]}"; do
    name=$(basename "$prog")
    expect 0 usage out "$prog" --help
    [ -s "$work/err" ] && fail "$name --help wrote to stderr: $(cat "$work/err")"
    expect 2 usage err "$prog" --no-such-flag
    grep -q -- --no-such-flag "$work/err" || fail "$name does not name the unknown option"
    # A stray word is not a run: it exits 2 before starting anything. idemctl reads it
    # as a command (and first wants --db: "unknown command" is checked below),
    # idemrpc-call as a URL without METHOD PAYLOAD; the others name it.
    expect 2 usage err "$prog" stray-word
    case $name in
    idemctl | idemrpc-call) ;;
    *) grep -q -- stray-word "$work/err" || fail "$name does not name the stray argument" ;;
    esac
done

# --version: the installed tools print "NAME VERSION" (meson.build's, $IDEMRPC_VERSION)
# on stdout and exit 0; idemrpc-call also after its positional arguments.
: "${IDEMRPC_VERSION:?the tools test needs IDEMRPC_VERSION (tests/meson.build sets it)}"
for prog in "$demo" "$call" "$ctl"; do
    name=$(basename "$prog")
    expect 0 "^$name $IDEMRPC_VERSION\$" out "$prog" --version
    if [ "$(wc -l <"$work/out")" != 1 ] || [ -s "$work/err" ]; then
        fail "$name --version: $(cat "$work/out" "$work/err")"
    fi
done
expect 0 "^idemrpc-call $IDEMRPC_VERSION\$" out "$call" tcp://127.0.0.1:1 demo.Counter/Add 5 --version

# Bad numbers and missing values name their option.
expect 2 "--delay-ms" err "$demo" --delay-ms 10x
expect 2 "--flaky" err "$demo" --flaky -1
expect 2 "--listen" err "$demo" --listen
expect 2 "--log-level" err "$demo" --log-level loud
expect 2 "unexpected argument" err "$demo" stray
expect 2 "--limit" err "$ctl" --db "$work/db" list --limit ten
expect 2 "--state" err "$ctl" --db "$work/db" list --state done
expect 2 "name one store: --db DIR or --pg CONNINFO" err "$ctl" stats
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
# idemrpc-ha-check (given when built with libpq): a seed is a number.
if [ $# -ge 8 ]; then
    expect 2 --seed err "${programs[7]}" --seed x
fi
echo "test_tools: all checks passed"
