#!/usr/bin/env bash
# idemctl against a store that a running idemrpc-demo is using.
. "$(dirname "$0")/demo_env.sh"
: "${IDEMCTL:?}" "${IDEMRPC_CALL:?}"
start_demo --delay-ms 0 --result-ttl-ms 600000 --log-level info
ctl() { "$IDEMCTL" --db "$work/db" "$@"; }
call() { "$IDEMRPC_CALL" "$sock" "$@" >/dev/null; }

call demo.Counter/Add 5 --key k1
call demo.Counter/Add 7 --key k2 --caller shop
ctl stats | grep -q '^completed    2$' || fail "stats: $(ctl stats)"
ctl --json stats | grep -q '"records":2' || fail "json stats"
[ "$(ctl list | wc -l)" = 3 ] || fail "list: $(ctl list)"
ctl list --caller shop | grep -q ' k2 ' || fail "list --caller"
ctl list --caller shop | grep -q ' k1 ' && fail "list --caller shows another caller"
ctl --json list --state completed | grep -q '"key":"k1"' || fail "json list"
ctl show demo.Counter/Add k1 | grep -q '^response     OK, 1 payload bytes' || fail "show"
ctl --json show demo.Counter/Add k2 --caller shop | grep -q '"state":"completed"' || fail "json show"
ctl show demo.Counter/Add nope && fail "show of a missing key succeeded"

# show without --caller finds the record of any caller and says whose it is.
out=$(ctl show demo.Counter/Add k2) || fail "show without --caller missed caller shop's k2"
grep -q '^caller       shop$' <<<"$out" || fail "show does not name the caller: $out"
ctl show demo.Counter/Add k2 --caller other && fail "show --caller other found shop's record"
{ ctl show demo.Counter/Add nope 2>&1 || true; } | grep -q 'no record demo.Counter/Add nope for any caller' ||
    fail "not-found message"
# A log line's key= digest leads to its record (idemctl show --digest).
line=$(grep 'caller="shop"' "$work/demo.err" | head -1)
digest=$(sed -n 's/.* key=\([0-9a-f]*\) .*/\1/p' <<<"$line")
[ ${#digest} = 16 ] || fail "no key digest in the log line: $line"
out=$(ctl show --digest "$digest") || fail "show --digest $digest found nothing"
grep -q '^key          k2$' <<<"$out" || fail "show --digest: $out"
grep -q "^key digest   $digest\$" <<<"$out" || fail "show prints the digest: $out"
ctl --json show --digest "$digest" | grep -q '"caller":"shop","method":"demo.Counter/Add","key":"k2"' ||
    fail "json show --digest: $(ctl --json show --digest "$digest")"
ctl show --digest 0000000000000000 && fail "show --digest of an unknown digest succeeded"
rc=0; ctl show --digest xyz 2>/dev/null || rc=$?
[ "$rc" = 2 ] || fail "a bad digest is a usage error (exit $rc)"

# delete of a completed record: the next call runs again.
ctl delete demo.Counter/Add k1 | grep -q deleted || fail "delete"
out=$("$IDEMRPC_CALL" "$sock" demo.Counter/Add 5 --key k1)
grep -q 'replayed: false' <<<"$out" || fail "after delete the call should run: $out"

# An IN_PROGRESS record needs --force.
kill "$demo"; wait "$demo" 2>/dev/null || true
start_demo --delay-ms 3000
"$IDEMRPC_CALL" "$sock" demo.Counter/Add 1 --key running >/dev/null &
caller=$!
await sh -c "'$IDEMCTL' --db '$work/db' list --state in_progress | grep -q running"
ctl delete demo.Counter/Add running && fail "deleted an IN_PROGRESS record without --force"
ctl --json delete demo.Counter/Add running --force |
    grep -qx '{"deleted":{"caller":"","method":"demo.Counter/Add","key":"running"}}' ||
    fail "json delete --force"
wait "$caller" || true

# purge --expired removes only what expired.
kill "$demo"; wait "$demo" 2>/dev/null || true
start_demo --result-ttl-ms 1
call demo.Counter/Add 1 --key short
await sh -c "'$IDEMCTL' --db '$work/db' purge --expired | grep -q 'purged [1-9]'"
ctl list | grep -q ' short ' && fail "purge left the expired record"
ctl --json purge --expired | grep -qx '{"purged":[0-9]*}' || fail "json purge"
ctl list | grep -q ' k1 ' || fail "purge removed a live record"
"$IDEMCTL" --db "$work/db" bogus && fail "bad command accepted"

# A call in progress: its owner and a live lease; after kill -9, list --lapsed finds it
# (LMDB: judged on this host's clock).
kill "$demo"; wait "$demo" 2>/dev/null || true
start_demo --delay-ms 60000 --lease-ms 600
"$IDEMRPC_CALL" "$sock" demo.Counter/Add 1 --key stuck >/dev/null 2>&1 &
caller=$!
await sh -c "'$IDEMCTL' --db '$work/db' list --older-ms 0 | grep -q ' stuck '"
ctl show demo.Counter/Add stuck | grep -q '^lease until  .* (live, [0-9]* ms left)$' ||
    fail "a renewed lease is not live: $(ctl show demo.Counter/Add stuck)"
kill -9 "$demo"; wait "$demo" 2>/dev/null || true; demo=
await sh -c "'$IDEMCTL' --db '$work/db' list --lapsed | grep -q ' stuck .* lapsed$'"
ctl --json show demo.Counter/Add stuck | grep -q '"owner":[1-9][0-9]*,.*"lease":"lapsed"' ||
    fail "json show of a lapsed lease: $(ctl --json show demo.Counter/Add stuck)"
kill "$caller" 2>/dev/null; wait "$caller" 2>/dev/null || true

# A path that is not a store: every verb exits 1 naming it, and nothing is created
# (a mistyped --db never becomes an empty store that "purged 0").
mkdir "$work/empty" "$work/other"
# another program's LMDB environment (one database "other", no idemrpc databases)
printf 'VERSION=3\nformat=bytevalue\ntype=btree\nHEADER=END\n 6b\n 76\nDATA=END\n' |
    mdb_load -s other "$work/other"
for path in "$work/missing" "$work/empty" "$work/other"; do
    for verb in stats list "purge --expired" "delete demo.Counter/Add k1 --force"; do
        rc=0
        # shellcheck disable=SC2086
        "$IDEMCTL" --db "$path" $verb >"$work/out" 2>"$work/err" || rc=$?
        [ "$rc" = 1 ] || fail "idemctl --db $path $verb exited $rc: $(cat "$work/out" "$work/err")"
        grep -q 'not an idemrpc store' "$work/err" || fail "$verb on $path: $(cat "$work/err")"
    done
done
[ -e "$work/missing" ] && fail "idemctl created $work/missing"
[ -z "$(ls -A "$work/empty")" ] || fail "idemctl wrote into $work/empty: $(ls "$work/empty")"
mdb_stat -a "$work/other" | grep -q records && fail "idemctl created its databases in $work/other"
# A store from before the "meta" database (records, tokens, expiry only) is a store: the
# writing verbs open it as the server does (and add "meta"), not refuse it.
mkdir "$work/premeta"
for db in records tokens expiry; do
    printf 'VERSION=3\nformat=bytevalue\ntype=btree\nHEADER=END\nDATA=END\n' |
        mdb_load -s "$db" "$work/premeta"
done
"$IDEMCTL" --db "$work/premeta" stats >/dev/null || fail "stats refused a pre-meta store"
"$IDEMCTL" --db "$work/premeta" purge --expired | grep -q 'purged 0' ||
    fail "purge refused a pre-meta store: $("$IDEMCTL" --db "$work/premeta" purge --expired 2>&1)"
echo "test_idemctl: all checks passed"
echo "test_idemctl: all checks passed"
