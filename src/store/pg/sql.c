/* The PostgreSQL backend's statements (idem__pg_sql, prepared per connection by conn.c)
 * and their short names for error messages (idem__pg_stmt_name): data only, below every
 * other file of the backend. The tables are described in store_pg.c, created by
 * schema.c. */
#include "pg_internal.h"

#define DBNOW "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
#define SWEEPNOW "(extract(epoch FROM statement_timestamp()) * 1000)::bigint + $1::bigint"
#define REC_COLS                                                                                   \
    "state, fingerprint, owner, lease_until_ms, first_at_ms, expires_ms, response, " DBNOW
#define KEY_WHERE "caller = $1 AND method = $2 AND key = $3"
#define TOMB_COLS "fingerprint, code, first_at_ms, expired_at_ms, until_ms"
#define TOMB_FP_LEN "16" /* IDEM_TOMBSTONE_FP_LEN */
#define INT64_MAX_SQL "9223372036854775807"
/* $5 = 0 asks for a store-assigned owner; $6, $7 = lease and expiry durations. */
#define CLAIM_OWNER "CASE WHEN $5::bigint = 0 THEN nextval('idem_fence') ELSE $5::bigint END"
#define CLAIM_RETURNING                                                                            \
    " RETURNING owner, lease_until_ms, first_at_ms, expires_ms, " DBNOW ", token"
#define KEEP_IF_TAKEOVER(col) " " col " = CASE WHEN state = 1 THEN " col " END"
/* Ends a statement whose CTE d holds the changed rows: the count of d, and a NOTIFY
 * with the payload in param when d is not empty and param is not "". */
#define ANNOUNCE(param)                                                                            \
    ", n AS (SELECT pg_notify('" PG_CHANNEL "', " param ") FROM d WHERE " param " <> '' LIMIT 1)"  \
    " SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM n)"

const char *const idem__pg_sql[S_COUNT] = {
    /* Inserts, or locks the existing row without changing it (DO UPDATE … WHERE false
     * locks the conflicting row and returns nothing), so that the row cannot be released
     * or swept between this statement and S_CLAIM_LOCK. A store-assigned owner ($5 = 0)
     * is drawn by S_CLAIM_FENCE after the insert: a value drawn here, before the insert
     * waited for a conflicting transaction, could be older than that of a claim which
     * came, held the key and left meanwhile, and fences must only grow. */
    [S_CLAIM_INSERT] =
        "INSERT INTO idem_records (caller, method, key, state, fingerprint, owner,"
        " lease_until_ms, first_at_ms, expires_ms) VALUES ($1, $2, $3, 1, $4, $5::bigint, " DBNOW
        " + $6::bigint, " DBNOW ", " DBNOW " + $7::bigint) ON CONFLICT (caller, method, key)"
        " DO UPDATE SET state = idem_records.state WHERE false" CLAIM_RETURNING,
    /* Sent with S_CLAIM_INSERT (one round trip): only a row inserted just now has owner 0.
     * A claim without a tombstone horizon ($4 = 0) that inserted the row deletes the
     * key's tombstone with it, as on LMDB: a key has a record or a tombstone, never both
     * (one with a horizon reads it first, tombs.c). */
    [S_CLAIM_FENCE] =
        "WITH f AS (UPDATE idem_records SET owner = nextval('idem_fence') WHERE " KEY_WHERE
        " AND owner = 0 RETURNING owner), t AS (DELETE FROM idem_tombstones WHERE " KEY_WHERE
        " AND $4::bigint = 0 AND EXISTS (SELECT 1 FROM f)) SELECT owner FROM f",
    [S_CLAIM_LOCK] = "SELECT " REC_COLS " FROM idem_records WHERE " KEY_WHERE " FOR UPDATE",
    /* A takeover inherits the consumed token; re-claiming an expired result drops it. */
    [S_CLAIM_TAKE] =
        "UPDATE idem_records SET state = 1, fingerprint = $4, owner = " CLAIM_OWNER
        ", lease_until_ms = " DBNOW " + $6::bigint, first_at_ms = " DBNOW ", expires_ms = " DBNOW
        " + $7::bigint, response = NULL," KEEP_IF_TAKEOVER("token") "," KEEP_IF_TAKEOVER(
            "token_scope") "," KEEP_IF_TAKEOVER("token_expires_ms") " WHERE " KEY_WHERE
            CLAIM_RETURNING,
    /* A token another transaction is consuming right now (a handler's, on PostgreSQL)
     * is skipped, not waited for: "unknown or already used", and the caller retries. */
    [S_TOKEN_TAKE] =
        "DELETE FROM idem_tokens WHERE token IN (SELECT token FROM idem_tokens"
        " WHERE token = $1 FOR UPDATE SKIP LOCKED) RETURNING scope, expires_ms, " DBNOW,
    [S_TOKEN_KEEP] = "UPDATE idem_records SET token = $4, token_scope = $5, token_expires_ms = $6"
                     " WHERE " KEY_WHERE,
    /* S_TOKEN_TAKE's answer, consuming nothing (a takeover's other token). */
    [S_TOKEN_CHECK] = "SELECT scope, expires_ms, " DBNOW " FROM idem_tokens WHERE token = $1",
    /* $7: the announcement's payload, "" for none (ANNOUNCE). */
    [S_COMPLETE] =
        "WITH d AS (UPDATE idem_records SET state = 2, response = $5, expires_ms = " DBNOW
        " + $6::bigint, token = NULL, token_scope = NULL, token_expires_ms = NULL"
        " WHERE " KEY_WHERE " AND owner = $4 AND state = 1 RETURNING 1)" ANNOUNCE("$7"),
    /* The consumed token goes back in the same statement (one transaction). */
    [S_RELEASE] =
        "WITH d AS (DELETE FROM idem_records WHERE " KEY_WHERE " AND owner = $4 AND"
        " state = 1 RETURNING token, token_scope, token_expires_ms), t AS (INSERT INTO"
        " idem_tokens (token, scope, expires_ms) SELECT token, token_scope,"
        " token_expires_ms FROM d WHERE token IS NOT NULL ON CONFLICT DO NOTHING)" ANNOUNCE("$5"),
    [S_RENEW] = "UPDATE idem_records SET lease_until_ms = " DBNOW " + $5::bigint, expires_ms ="
                " GREATEST(expires_ms, " DBNOW " + $5::bigint) WHERE " KEY_WHERE
                " AND owner = $4 AND state = 1",
    [S_GET] = "SELECT " REC_COLS " FROM idem_records WHERE " KEY_WHERE,
    /* A forget announces itself too: other instances drop the key from their replay
     * caches (replay_cache.h). */
    [S_DELETE] =
        "WITH d AS (DELETE FROM idem_records WHERE " KEY_WHERE " RETURNING 1)" ANNOUNCE("$4"),
    /* Batches by primary key (plain SQL; no ctid), skipping rows a live transaction holds
     * (a handler's: never wait for it, nor deadlock with it). The outer condition is
     * checked again on the newest row version, so a row renewed or written meanwhile
     * stays. SWEEPNOW is stable within the statement, so the expiry index is used. */
    /* An expired COMPLETED record leaves its tombstone in the same statement, kept for
     * the longest horizon of the servers on the store (idem_meta "tomb_keep"); an older
     * tombstone of the key (a claim without a horizon leaves it, tombs.c) is replaced. */
    [S_SWEEP_RECORDS] =
        "WITH d AS (DELETE FROM idem_records WHERE expires_ms <= " SWEEPNOW " AND"
        " (caller, method, key) IN (SELECT caller, method, key FROM idem_records"
        " WHERE expires_ms <= " SWEEPNOW " LIMIT $2 FOR UPDATE SKIP LOCKED)"
        " RETURNING caller, method, key, state, fingerprint, first_at_ms, expires_ms, response),"
        " k AS (SELECT value AS keep FROM idem_meta WHERE name = 'tomb_keep' AND value > 0),"
        " t AS (INSERT INTO idem_tombstones (caller, method, key, " TOMB_COLS ")"
        " SELECT caller, method, key,"
        " substring(fingerprint FROM 1 FOR " TOMB_FP_LEN "), idem_response_code(response),"
        " first_at_ms, expires_ms, CASE WHEN keep > " INT64_MAX_SQL
        " - expires_ms THEN " INT64_MAX_SQL " ELSE expires_ms + keep END FROM d, k WHERE state = 2"
        " ON CONFLICT (caller, method, key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint,"
        " code = EXCLUDED.code, first_at_ms = EXCLUDED.first_at_ms,"
        " expired_at_ms = EXCLUDED.expired_at_ms, until_ms = EXCLUDED.until_ms)"
        " SELECT count(*) FROM d",
    [S_SWEEP_TOMBS] = "DELETE FROM idem_tombstones WHERE until_ms <= " SWEEPNOW " AND"
                      " (caller, method, key) IN (SELECT caller, method, key FROM idem_tombstones"
                      " WHERE until_ms <= " SWEEPNOW " LIMIT $2 FOR UPDATE SKIP LOCKED)",
    [S_SWEEP_TOKENS] = "DELETE FROM idem_tokens WHERE expires_ms <= " SWEEPNOW " AND token IN"
                       " (SELECT token FROM idem_tokens WHERE expires_ms <= " SWEEPNOW
                       " LIMIT $2 FOR UPDATE SKIP LOCKED)",
    /* The empty rows reads leave behind (txn.c). */
    [S_SWEEP_KV] = "DELETE FROM idem_kv WHERE v IS NULL AND (db, k) IN (SELECT db, k FROM idem_kv"
                   " WHERE v IS NULL LIMIT $1 FOR UPDATE SKIP LOCKED)",
    [S_TOKEN_PUT] = "INSERT INTO idem_tokens (token, scope, expires_ms) VALUES ($1, $2, " DBNOW
                    " + $3::bigint) ON CONFLICT DO NOTHING",
    [S_STATS] = "SELECT count(*), count(*) FILTER (WHERE state = 1), count(*) FILTER"
                " (WHERE state = 2), (SELECT count(*) FROM idem_tokens),"
                " (SELECT count(*) FROM idem_tombstones) FROM idem_records",
    [S_PAGE] = "SELECT caller, method, key, " REC_COLS " FROM idem_records WHERE (caller,"
               " method, key) > ($1, $2, $3) ORDER BY caller, method, key LIMIT 500",
    /* txn.c */
    [S_TRY_LOCK] = "SELECT pg_try_advisory_xact_lock($1::bigint)",
    [S_NOTIFY] = "SELECT pg_notify('" PG_CHANNEL "', $1)",
    [S_KV_LOCK] = "INSERT INTO idem_kv (db, k) VALUES ($1, $2) ON CONFLICT (db, k) DO UPDATE"
                  " SET v = idem_kv.v RETURNING v",
    [S_KV_PUT] = "INSERT INTO idem_kv (db, k, v) VALUES ($1, $2, $3) ON CONFLICT (db, k) DO UPDATE"
                 " SET v = EXCLUDED.v",
    [S_KV_DEL] = "DELETE FROM idem_kv WHERE db = $1 AND k = $2",
    [S_KV_READ] = "SELECT v FROM idem_kv WHERE db = $1 AND k = $2 AND v IS NOT NULL",
    [S_KV_NEXT] = "SELECT k, v FROM idem_kv WHERE db = $1 AND k > $2 AND v IS NOT NULL"
                  " ORDER BY k LIMIT 1",
    /* A row lock held to the end of the txn: no takeover, completion or sweep of the
     * record can slip in before it commits. */
    [S_TXN_RECORD] = "SELECT " REC_COLS " FROM idem_records WHERE " KEY_WHERE " FOR SHARE",
    /* One renewal round: $1..$5 arrays of callers, methods, keys, owners and leases.
     * Rows of this owner, IN_PROGRESS, are renewed unless another session holds them
     * (SKIP LOCKED: never queue behind a stalled claimer); each such row answers its
     * ordinal and whether it was renewed. A lease absent from the answer is lost. */
    [S_RENEW_BATCH] =
        "WITH v AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[],"
        " $5::bigint[]) WITH ORDINALITY AS v(caller, method, key, owner, lease_ms, i)),"
        " mine AS (SELECT v.* FROM v JOIN idem_records r USING (caller, method, key)"
        " WHERE r.owner = v.owner AND r.state = 1),"
        " l AS (SELECT r.caller, r.method, r.key FROM idem_records r JOIN mine m USING (caller,"
        " method, key) FOR UPDATE OF r SKIP LOCKED),"
        " u AS (UPDATE idem_records r SET lease_until_ms = " DBNOW " + m.lease_ms, expires_ms ="
        " GREATEST(r.expires_ms, " DBNOW " + m.lease_ms) FROM mine m JOIN l USING (caller,"
        " method, key) WHERE r.caller = m.caller AND r.method = m.method AND r.key = m.key"
        " AND r.owner = m.owner AND r.state = 1 RETURNING m.i)"
        " SELECT m.i, m.i IN (SELECT i FROM u) FROM mine m",
    /* tombs.c. A claim reads a tombstone only on a key it just inserted (it holds the
     * key: no sweep can write the key's tombstone before it commits). */
    [S_TOMB_GET] = "SELECT " TOMB_COLS " FROM idem_tombstones WHERE " KEY_WHERE,
    [S_TOMB_DEL] = "DELETE FROM idem_tombstones WHERE " KEY_WHERE,
    /* The row a claim inserted, when the key's tombstone answered instead. */
    [S_CLAIM_UNDO] = "DELETE FROM idem_records WHERE " KEY_WHERE " AND state = 1",
    [S_TOMB_KEEP] = "INSERT INTO idem_meta VALUES ('tomb_keep', $1::bigint) ON CONFLICT (name)"
                    " DO UPDATE SET value = EXCLUDED.value WHERE idem_meta.value < EXCLUDED.value",
    [S_TOMB_PAGE] = "SELECT caller, method, key, " TOMB_COLS " FROM idem_tombstones WHERE (caller,"
                    " method, key) > ($1, $2, $3) ORDER BY caller, method, key LIMIT 500",
    /* Is the claim (key, owner) committed? (A COMMIT whose answer was lost.) If so its
     * lease starts again from now ($5): the claim is older than its lease says. */
    [S_CLAIM_CONFIRM] =
        "UPDATE idem_records SET lease_until_ms = " DBNOW " + $5::bigint WHERE " KEY_WHERE
        " AND owner = $4 AND state = 1 RETURNING 1",
};

/* Each statement's short name: what an error message names instead of its SQL. */
const char *const idem__pg_stmt_name[S_COUNT] = {
    [S_CLAIM_INSERT] = "claim insert",
    [S_CLAIM_FENCE] = "claim fence",
    [S_CLAIM_LOCK] = "claim lock",
    [S_CLAIM_TAKE] = "claim take",
    [S_TOKEN_TAKE] = "token take",
    [S_TOKEN_KEEP] = "token keep",
    [S_TOKEN_CHECK] = "token check",
    [S_COMPLETE] = "complete",
    [S_RELEASE] = "release",
    [S_RENEW] = "renew",
    [S_GET] = "get",
    [S_DELETE] = "delete",
    [S_SWEEP_RECORDS] = "sweep records",
    [S_SWEEP_TOKENS] = "sweep tokens",
    [S_SWEEP_TOMBS] = "sweep tombstones",
    [S_SWEEP_KV] = "sweep kv",
    [S_TOKEN_PUT] = "token put",
    [S_STATS] = "stats",
    [S_PAGE] = "page",
    [S_TRY_LOCK] = "try lock",
    [S_NOTIFY] = "notify",
    [S_KV_LOCK] = "kv lock",
    [S_KV_PUT] = "kv put",
    [S_KV_DEL] = "kv del",
    [S_KV_READ] = "kv read",
    [S_KV_NEXT] = "kv next",
    [S_TXN_RECORD] = "txn record",
    [S_RENEW_BATCH] = "renew batch",
    [S_TOMB_GET] = "tombstone get",
    [S_TOMB_DEL] = "tombstone delete",
    [S_CLAIM_UNDO] = "claim undo",
    [S_TOMB_KEEP] = "tombstone keep",
    [S_TOMB_PAGE] = "tombstone page",
    [S_CLAIM_CONFIRM] = "claim confirm",
};
