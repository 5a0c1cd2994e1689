#!/usr/bin/env bash
# idemctl --pg against the PostgreSQL store a running idemrpc-demo is using: a schema of
# its own in $IDEMRPC_TEST_PG, dropped at exit. Skipped (77) without IDEMRPC_TEST_PG.
. "$(dirname "$0")/demo_env.sh"
: "${IDEMCTL:?}" "${IDEMRPC_CALL:?}"
[ -n "${IDEMRPC_TEST_PG:-}" ] || { echo "IDEMRPC_TEST_PG not set: skipped"; exit 77; }
schema="idemctl_$$_$RANDOM"
sql() { psql -qAt -v ON_ERROR_STOP=1 "$IDEMRPC_TEST_PG" -c "$1"; }
drop() {
    cleanup
    sql "DROP SCHEMA IF EXISTS $schema CASCADE; DROP SCHEMA IF EXISTS ${schema}_empty;
         DROP SCHEMA IF EXISTS ${schema}_old CASCADE" >/dev/null
}
trap drop EXIT
sql "CREATE SCHEMA $schema; CREATE SCHEMA ${schema}_empty" >/dev/null
pg="$IDEMRPC_TEST_PG options='-csearch_path=$schema'"
ctl() { "$IDEMCTL" --pg "$pg" "$@"; }
call() { "$IDEMRPC_CALL" "$sock" "$@" >/dev/null; }

start_demo --store "$pg" --delay-ms 0 --result-ttl-ms 600000 --log-level info
call demo.Counter/Add 5 --key k1
call demo.Counter/Add 7 --key k2 --caller shop
ctl stats | grep -q '^completed    2$' || fail "stats: $(ctl stats 2>&1)"
ctl stats | grep -q '^map used' && fail "stats on PostgreSQL prints an LMDB map"
ctl --json stats | grep -q '"records":2' || fail "json stats: $(ctl --json stats 2>&1)"
[ "$(ctl list | wc -l)" = 3 ] || fail "list: $(ctl list)"
ctl list --caller shop | grep -q ' k2 ' || fail "list --caller"
ctl list --caller shop | grep -q ' k1 ' && fail "list --caller shows another caller"
ctl --json list --state completed | grep -q '"key":"k1"' || fail "json list"
ctl show demo.Counter/Add k1 | grep -q '^response     OK, 1 payload bytes' || fail "show"
out=$(ctl show demo.Counter/Add k2) || fail "show without --caller missed caller shop's k2"
grep -q '^caller       shop$' <<<"$out" || fail "show does not name the caller: $out"
ctl show demo.Counter/Add nope 2>/dev/null && fail "show of a missing key succeeded"
digest=$(grep 'caller="shop"' "$work/demo.err" | head -1 | sed -n 's/.* key=\([0-9a-f]*\) .*/\1/p')
ctl --json show --digest "$digest" | grep -q '"caller":"shop","method":"demo.Counter/Add","key":"k2"' ||
    fail "json show --digest $digest: $(ctl --json show --digest "$digest" 2>&1)"

# delete of a completed record: the next call runs again.
ctl delete demo.Counter/Add k1 | grep -q deleted || fail "delete"
out=$("$IDEMRPC_CALL" "$sock" demo.Counter/Add 5 --key k1)
grep -q 'replayed: false' <<<"$out" || fail "after delete the call should run: $out"

# An IN_PROGRESS record needs --force.
kill "$demo"; wait "$demo" 2>/dev/null || true
start_demo --store "$pg" --delay-ms 3000
"$IDEMRPC_CALL" "$sock" demo.Counter/Add 1 --key running >/dev/null &
caller=$!
await sh -c "\"\$0\" --pg \"\$1\" list --state in_progress | grep -q running" "$IDEMCTL" "$pg"
ctl delete demo.Counter/Add running 2>/dev/null && fail "deleted an IN_PROGRESS record without --force"
ctl --json delete demo.Counter/Add running --force |
    grep -qx '{"deleted":{"caller":"","method":"demo.Counter/Add","key":"running"}}' ||
    fail "json delete --force"
wait "$caller" || true

# purge --expired removes only what expired.
kill "$demo"; wait "$demo" 2>/dev/null || true
start_demo --store "$pg" --result-ttl-ms 1
call demo.Counter/Add 1 --key short
await sh -c "\"\$0\" --pg \"\$1\" purge --expired | grep -q 'purged [1-9]'" "$IDEMCTL" "$pg"
ctl list | grep -q ' short ' && fail "purge left the expired record"
ctl --json purge --expired | grep -qx '{"purged":[0-9]*}' || fail "json purge"
ctl list | grep -q ' k1 ' || fail "purge removed a live record"

# Calls in progress: the owner (the claim's fence) and the lease, live while the server
# renews it and lapsed once it is killed; list --older-ms / --lapsed find them.
kill "$demo"; wait "$demo" 2>/dev/null || true
start_demo --store "$pg" --delay-ms 60000 --lease-ms 600
"$IDEMRPC_CALL" "$sock" demo.Counter/Add 1 --key stuck >/dev/null 2>&1 &
caller=$!
await sh -c "\"\$0\" --pg \"\$1\" list --older-ms 0 | grep -q ' stuck '" "$IDEMCTL" "$pg"
out=$(ctl show demo.Counter/Add stuck)
grep -q '^owner        [1-9]' <<<"$out" || fail "show names no owner: $out"
grep -q '^lease until  .* (live, [0-9]* ms left)$' <<<"$out" || fail "a renewed lease is not live: $out"
ctl list --lapsed | grep -q ' stuck ' && fail "list --lapsed shows a live lease"
ctl list --older-ms 3600000 | grep -q ' stuck ' && fail "list --older-ms 3600000 shows a new call"
kill -9 "$demo"; wait "$demo" 2>/dev/null || true; demo=
await sh -c "\"\$0\" --pg \"\$1\" list --lapsed | grep -q ' stuck .* lapsed$'" "$IDEMCTL" "$pg"
ctl show demo.Counter/Add stuck | grep -q '^lease until  .* (lapsed [0-9]* ms ago)$' ||
    fail "show of a lapsed lease: $(ctl show demo.Counter/Add stuck)"
ctl --json list --lapsed | grep -q '"key":"stuck","state":"in_progress","owner":[1-9][0-9]*,.*"lease":"lapsed"' ||
    fail "json list --lapsed: $(ctl --json list --lapsed)"
ctl --json show demo.Counter/Add stuck | grep -q '"lease":"lapsed","store_now_ms":[1-9]' ||
    fail "json show of a lapsed lease: $(ctl --json show demo.Counter/Add stuck)"
ctl list --lapsed --state completed 2>/dev/null && fail "--lapsed with --state completed accepted"
kill "$caller" 2>/dev/null; wait "$caller" 2>/dev/null || true

# A database (search_path) without the store's tables: every verb exits 1 naming it, and
# nothing is created there; a database that does not answer exits 1 too.
empty="$IDEMRPC_TEST_PG options='-csearch_path=${schema}_empty'"
for verb in stats list "purge --expired" "delete demo.Counter/Add k1 --force"; do
    rc=0
    # shellcheck disable=SC2086
    "$IDEMCTL" --pg "$empty" $verb >"$work/out" 2>"$work/err" || rc=$?
    [ "$rc" = 1 ] || fail "idemctl --pg (empty) $verb exited $rc: $(cat "$work/out" "$work/err")"
    grep -q 'not an idemrpc store' "$work/err" || fail "$verb on an empty schema: $(cat "$work/err")"
done
n=$(sql "SELECT count(*) FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace WHERE s.nspname = '${schema}_empty'")
[ "$n" = 0 ] || fail "idemctl created $n objects in an empty schema"
# A look at the store of an older release (the first one's idem_records, no idem_meta)
# changes nothing: no migration, no format raised that its servers would then refuse.
relations() {
    sql "SELECT count(*) FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace WHERE s.nspname = '${schema}_old'"
}
sql "CREATE SCHEMA ${schema}_old; SET search_path=${schema}_old; CREATE TABLE idem_records (
 caller text NOT NULL, method text NOT NULL, key text NOT NULL,
 state smallint NOT NULL CHECK (state IN (1, 2)), fingerprint bytea NOT NULL,
 owner bigint NOT NULL, lease_until_ms bigint NOT NULL, first_at_ms bigint NOT NULL,
 expires_ms bigint NOT NULL, response bytea, PRIMARY KEY (caller, method, key))" >/dev/null
before=$(relations)
rc=0
"$IDEMCTL" --pg "$IDEMRPC_TEST_PG options='-csearch_path=${schema}_old'" stats >/dev/null \
    2>"$work/err" || rc=$?
[ "$rc" = 1 ] || fail "a look at an older store's tables exited $rc"
grep -q 'older format' "$work/err" || fail "an older store's tables: $(cat "$work/err")"
[ "$(relations)" = "$before" ] || fail "a look at an older store changed its schema"
rc=0
"$IDEMCTL" --pg "host=127.0.0.1 port=1 connect_timeout=2" stats 2>"$work/err" || rc=$?
[ "$rc" = 1 ] || fail "an unreachable database exited $rc"
[ -s "$work/err" ] || fail "an unreachable database said nothing"
rc=0
"$IDEMCTL" --pg "$pg" --db "$work/db" stats 2>/dev/null || rc=$?
[ "$rc" = 2 ] || fail "--pg with --db is a usage error (exit $rc)"
echo "test_idemctl_pg: all checks passed"
