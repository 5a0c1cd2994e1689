/* PostgreSQL backend of idem_store, for several server instances sharing records.
 *
 *   idem_records(caller, method, key) PRIMARY KEY, state, fingerprint, owner, lease and
 *   expiry (unix ms), response bytea, the consumed token kept while IN_PROGRESS;
 *   idem_tokens(token PRIMARY KEY, scope, expires_ms);   sequence idem_fence (owners)
 *
 * Every time is the database's clock (DBNOW): the callers' now_ms only turns their
 * absolute times into durations, so instances with skewed clocks agree on every lease
 * and expiry.
 *
 * The claim is decided by the unique key: INSERT … ON CONFLICT either inserts (this
 * caller owns the key) or locks the existing row, which is then read so that an
 * expired-lease takeover or a token consumption is decided under the row lock, in the
 * same transaction. A store-assigned owner is drawn from idem_fence only once the row is
 * the claim's, so one key's successive owners only grow. Completion and release are
 * conditional on (key, owner, state).
 * Connection failures map to UNAVAILABLE, so the client's retryer carries calls across
 * a database restart; statements are prepared once per connection.
 *
 * Completions and releases announce themselves (NOTIFY PG_CHANNEL, sent at commit) so
 * that waiters in other instances wake at once (listen.c); handler transactions and the
 * business key-value table are in txn.c. */
#include <stdlib.h>
#include <string.h>

#include "pg_internal.h"

#define POOL_WAIT_MS 5000
#define FOREACH_PAGE 500

#define DBNOW "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
#define SWEEPNOW "(extract(epoch FROM statement_timestamp()) * 1000)::bigint + $1::bigint"
#define REC_COLS                                                                                   \
    "state, fingerprint, owner, lease_until_ms, first_at_ms, expires_ms, response, " DBNOW
#define KEY_WHERE "caller = $1 AND method = $2 AND key = $3"
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

static const char *const stmt_sql[S_COUNT] = {
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
    /* Sent with S_CLAIM_INSERT (one round trip): only a row inserted just now has owner 0. */
    [S_CLAIM_FENCE] = "UPDATE idem_records SET owner = nextval('idem_fence') WHERE " KEY_WHERE
                      " AND owner = 0 RETURNING owner",
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
    [S_DELETE] = "DELETE FROM idem_records WHERE " KEY_WHERE,
    /* Batches by primary key (plain SQL; no ctid), skipping rows a live transaction holds
     * (a handler's: never wait for it, nor deadlock with it). The outer condition is
     * checked again on the newest row version, so a row renewed or written meanwhile
     * stays. SWEEPNOW is stable within the statement, so the expiry index is used. */
    [S_SWEEP_RECORDS] = "DELETE FROM idem_records WHERE expires_ms <= " SWEEPNOW " AND"
                        " (caller, method, key) IN (SELECT caller, method, key FROM idem_records"
                        " WHERE expires_ms <= " SWEEPNOW " LIMIT $2 FOR UPDATE SKIP LOCKED)",
    [S_SWEEP_TOKENS] = "DELETE FROM idem_tokens WHERE expires_ms <= " SWEEPNOW " AND token IN"
                       " (SELECT token FROM idem_tokens WHERE expires_ms <= " SWEEPNOW
                       " LIMIT $2 FOR UPDATE SKIP LOCKED)",
    /* The empty rows reads leave behind (txn.c). */
    [S_SWEEP_KV] = "DELETE FROM idem_kv WHERE v IS NULL AND (db, k) IN (SELECT db, k FROM idem_kv"
                   " WHERE v IS NULL LIMIT $1 FOR UPDATE SKIP LOCKED)",
    [S_TOKEN_PUT] = "INSERT INTO idem_tokens (token, scope, expires_ms) VALUES ($1, $2, " DBNOW
                    " + $3::bigint) ON CONFLICT DO NOTHING",
    [S_STATS] = "SELECT count(*), count(*) FILTER (WHERE state = 1), count(*) FILTER"
                " (WHERE state = 2), (SELECT count(*) FROM idem_tokens) FROM idem_records",
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
};

/* Idempotent, serialised across instances by a transaction-scoped advisory lock
 * ("idmp"). Run only when SCHEMA_PRESENT says something is missing, once per store:
 * its ALTER TABLE and CREATE INDEX take table locks even when there is nothing to do,
 * and would wait for every open handler transaction (on any instance). */
static const char schema_present_sql[] =
    "SELECT to_regclass('idem_records') IS NOT NULL AND to_regclass('idem_tokens') IS NOT NULL"
    " AND to_regclass('idem_kv') IS NOT NULL AND to_regclass('idem_kv_empty') IS NOT NULL"
    " AND to_regclass('idem_fence') IS NOT NULL AND EXISTS (SELECT 1 FROM"
    " information_schema.columns WHERE table_name = 'idem_records' AND column_name ="
    " 'token_expires_ms' AND table_schema = (SELECT n.nspname FROM pg_class c JOIN"
    " pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass('idem_records')))";

static const char schema_sql[] =
    "SELECT pg_advisory_xact_lock(1768189296);"
    "CREATE TABLE IF NOT EXISTS idem_records ("
    " caller text NOT NULL, method text NOT NULL, key text NOT NULL,"
    " state smallint NOT NULL CHECK (state IN (1, 2)), fingerprint bytea NOT NULL,"
    " owner bigint NOT NULL, lease_until_ms bigint NOT NULL, first_at_ms bigint NOT NULL,"
    " expires_ms bigint NOT NULL, response bytea, PRIMARY KEY (caller, method, key));"
    "CREATE INDEX IF NOT EXISTS idem_records_expires ON idem_records (expires_ms);"
    "CREATE TABLE IF NOT EXISTS idem_tokens ("
    " token text PRIMARY KEY, scope text NOT NULL, expires_ms bigint NOT NULL);"
    "CREATE INDEX IF NOT EXISTS idem_tokens_expires ON idem_tokens (expires_ms);"
    "ALTER TABLE idem_records ADD COLUMN IF NOT EXISTS token text,"
    " ADD COLUMN IF NOT EXISTS token_scope text, ADD COLUMN IF NOT EXISTS token_expires_ms bigint;"
    "CREATE SEQUENCE IF NOT EXISTS idem_fence;"
    "CREATE TABLE IF NOT EXISTS idem_kv ("
    " db text NOT NULL, k bytea NOT NULL, v bytea, PRIMARY KEY (db, k));"
    "CREATE INDEX IF NOT EXISTS idem_kv_empty ON idem_kv (db) WHERE v IS NULL;";

/* Maps a failed result (or a dead connection) to a code: connection trouble and
 * serialisation conflicts are transient (UNAVAILABLE), a full disk RESOURCE_EXHAUSTED. */
idem_code idem__pg_fail(PGconn *c, PGresult *r, const char *what)
{
    const char *state = r != NULL ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
    const char *msg = r != NULL ? PQresultErrorMessage(r) : PQerrorMessage(c);
    idem_code code = IDEM_INTERNAL;
    if (PQstatus(c) != CONNECTION_OK || state == NULL || strncmp(state, "08", 2) == 0 ||
        strncmp(state, "57P", 3) == 0 || strcmp(state, "40001") == 0 ||
        strcmp(state, "40P01") == 0) {
        code = IDEM_UNAVAILABLE;
    } else if (strcmp(state, "53100") == 0 || strcmp(state, "53200") == 0) {
        code = IDEM_RESOURCE_EXHAUSTED;
    }
    idem__err(code, "postgres %s: %.200s", what, msg != NULL ? msg : "");
    if (r != NULL) {
        PQclear(r);
    }
    return code;
}

static idem_code pg_prepare(PGconn *c)
{
    char name[8];
    for (int i = 0; i < S_COUNT; i++) {
        snprintf(name, sizeof(name), "s%d", i);
        PGresult *r = PQprepare(c, name, stmt_sql[i], 0, NULL);
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            return idem__pg_fail(c, r, "prepare");
        }
        PQclear(r);
    }
    return IDEM_OK;
}

static void ignore_notice(void *arg, const char *message)
{
    (void)arg, (void)message;
}

/* Connection defaults a conninfo may override: bounded connects, and TCP keepalives on
 * both ends, so that a host that vanished (its handler transaction with it) is noticed
 * in about a minute, not the kernel's two hours. */
idem_code idem__pg_connect(const char *conninfo, const char *connect_timeout, PGconn **out)
{
    const char *keys[] = {"connect_timeout",
                          "keepalives",
                          "keepalives_idle",
                          "keepalives_interval",
                          "keepalives_count",
                          "dbname",
                          connect_timeout != NULL ? "connect_timeout" : NULL,
                          NULL};
    const char *vals[] = {"10", "1", "30", "10", "3", conninfo, connect_timeout, NULL};
    PGconn *c = PQconnectdbParams(keys, vals, 1); /* dbname: the conninfo, expanded */
    idem_code code = IDEM_OK;
    if (PQstatus(c) != CONNECTION_OK) {
        code = idem__err(IDEM_UNAVAILABLE, "postgres connect: %.200s", PQerrorMessage(c));
    } else if (PQstatus(c) == CONNECTION_OK && PQsocket(c) >= 0) {
        /* The server's side of the keepalive (ignored on a Unix socket). */
        code =
            idem__pg_exec_simple(c, "SET tcp_keepalives_idle = 30; SET"
                                    " tcp_keepalives_interval = 10; SET tcp_keepalives_count = 3");
    }
    if (code != IDEM_OK) {
        PQfinish(c);
        c = NULL;
    }
    *out = c;
    return code;
}

static idem_code schema_ensure(PGconn *c)
{
    PGresult *r = PQexec(c, schema_present_sql);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        return idem__pg_fail(c, r, "schema check");
    }
    bool present = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    PQclear(r);
    return present ? IDEM_OK : idem__pg_exec_simple(c, schema_sql);
}

/* (Re)connects a pool slot and prepares the statements. */
static idem_code pg_connect(pg_store *st, pool_slot *pc)
{
    if (pc->c != NULL && PQstatus(pc->c) == CONNECTION_OK) {
        return IDEM_OK;
    }
    if (pc->c != NULL) {
        PQfinish(pc->c);
    }
    idem_code code = idem__pg_connect(st->conninfo, NULL, &pc->c);
    if (code != IDEM_OK) {
        return code;
    }
    PQsetNoticeProcessor(pc->c, ignore_notice, NULL); /* "already exists, skipping" */
    if (!__atomic_load_n(&st->schema_ready, __ATOMIC_ACQUIRE) &&
        (code = schema_ensure(pc->c)) == IDEM_OK) {
        __atomic_store_n(&st->schema_ready, true, __ATOMIC_RELEASE);
    }
    if (code == IDEM_OK) {
        code = pg_prepare(pc->c);
    }
    if (code != IDEM_OK) {
        PQfinish(pc->c);
        pc->c = NULL;
    }
    return code;
}

idem_code idem__pg_pool_get(pg_store *st, pool_slot **out)
{
    struct timespec ts;
    idem__abs_timespec(&ts, POOL_WAIT_MS);
    pthread_mutex_lock(&st->mu);
    for (;;) {
        for (size_t i = 0; i < st->n; i++) {
            if (!st->pool[i].busy) {
                st->pool[i].busy = true;
                pthread_mutex_unlock(&st->mu);
                *out = &st->pool[i];
                idem_code code = pg_connect(st, *out);
                if (code != IDEM_OK) {
                    pthread_mutex_lock(&st->mu);
                    (*out)->busy = false;
                    pthread_cond_signal(&st->cv);
                    pthread_mutex_unlock(&st->mu);
                }
                return code;
            }
        }
        if (pthread_cond_timedwait(&st->cv, &st->mu, &ts) != 0) {
            pthread_mutex_unlock(&st->mu);
            return idem__err(IDEM_UNAVAILABLE, "no postgres connection free for %d ms",
                             POOL_WAIT_MS);
        }
    }
}

void idem__pg_pool_put(pg_store *st, pool_slot *pc)
{
    if (pc->c != NULL && PQtransactionStatus(pc->c) != PQTRANS_IDLE) {
        PQfinish(pc->c); /* reconnected by the next idem__pg_pool_get */
        pc->c = NULL;
    }
    pthread_mutex_lock(&st->mu);
    pc->busy = false;
    pthread_cond_signal(&st->cv);
    pthread_mutex_unlock(&st->mu);
}

/* ---- statements ---- */

/* Runs prepared statement s on connection c, with binary results; NULL (and *code)
 * on failure. */
PGresult *idem__pg_exec(PGconn *c, enum stmt s, const pg_args *a, ExecStatusType want,
                        idem_code *code)
{
    char name[8];
    snprintf(name, sizeof(name), "s%d", (int)s);
    PGresult *r = PQexecPrepared(c, name, a != NULL ? a->n : 0, a != NULL ? a->v : NULL,
                                 a != NULL ? a->len : NULL, a != NULL ? a->fmt : NULL, 1);
    if (PQresultStatus(r) != want) {
        *code = idem__pg_fail(c, r, stmt_sql[s]);
        return NULL;
    }
    return r;
}

idem_code idem__pg_run(PGconn *c, enum stmt s, const pg_args *a, ExecStatusType want)
{
    idem_code code;
    PGresult *r = idem__pg_exec(c, s, a, want, &code);
    if (r == NULL) {
        return code;
    }
    PQclear(r);
    return IDEM_OK;
}

idem_code idem__pg_exec_simple(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    if (PQresultStatus(r) != PGRES_COMMAND_OK) {
        return idem__pg_fail(c, r, sql);
    }
    PQclear(r);
    return IDEM_OK;
}

/* One statement's result in pipeline mode, and the NULL that ends it. */
static PGresult *pipeline_result(PGconn *c)
{
    PGresult *r = PQgetResult(c), *end;
    while (r != NULL && (end = PQgetResult(c)) != NULL) {
        PQclear(end);
    }
    return r;
}

/* Runs prepared statements s1 and s2 in one round trip (libpq pipeline mode): s2 runs
 * once s1 has finished, and not at all when s1 failed. Both results are checked for
 * PGRES_TUPLES_OK. A connection left in pipeline mode by a failure fails its next
 * statement; inside a transaction (every caller) the pool then closes it. */
static idem_code exec_pair(PGconn *c, enum stmt s1, const pg_args *a1, enum stmt s2,
                           const pg_args *a2, PGresult **r1, PGresult **r2)
{
    char n1[8], n2[8];
    snprintf(n1, sizeof(n1), "s%d", (int)s1);
    snprintf(n2, sizeof(n2), "s%d", (int)s2);
    *r1 = *r2 = NULL;
    if (!PQenterPipelineMode(c) || !PQsendQueryPrepared(c, n1, a1->n, a1->v, a1->len, a1->fmt, 1) ||
        !PQsendQueryPrepared(c, n2, a2->n, a2->v, a2->len, a2->fmt, 1) || !PQpipelineSync(c)) {
        return idem__pg_fail(c, NULL, "pipeline send");
    }
    PGresult *got1 = pipeline_result(c), *got2 = pipeline_result(c), *sync = PQgetResult(c);
    bool ended = sync != NULL && PQresultStatus(sync) == PGRES_PIPELINE_SYNC &&
                 PQexitPipelineMode(c) == 1; /* also after a failed statement */
    PQclear(sync);
    idem_code code = IDEM_OK;
    if (PQresultStatus(got1) != PGRES_TUPLES_OK) {
        code = idem__pg_fail(c, got1, stmt_sql[s1]);
        got1 = NULL;
    } else if (PQresultStatus(got2) != PGRES_TUPLES_OK) {
        code = idem__pg_fail(c, got2, stmt_sql[s2]);
        got2 = NULL;
    } else if (!ended) {
        code = idem__pg_fail(c, NULL, "pipeline end");
    }
    if (code != IDEM_OK) {
        PQclear(got1);
        PQclear(got2);
        return code;
    }
    *r1 = got1;
    *r2 = got2;
    return IDEM_OK;
}

int64_t idem__pg_col_i64(const PGresult *r, int row, int col)
{
    const unsigned char *p = (const unsigned char *)PQgetvalue(r, row, col);
    uint64_t v = 0;
    for (int i = 0; i < 8 && i < PQgetlength(r, row, col); i++) {
        v = v << 8 | p[i];
    }
    return (int64_t)v;
}

static int col_i16(const PGresult *r, int row, int col)
{
    const unsigned char *p = (const unsigned char *)PQgetvalue(r, row, col);
    return PQgetlength(r, row, col) == 2 ? (int16_t)(p[0] << 8 | p[1]) : -1;
}

/* Fills rec from the REC_COLS at column off of row; the response only when want. */
idem_code idem__pg_row_record(const PGresult *r, int row, int off, idem_record *rec, bool want)
{
    memset(rec, 0, sizeof(*rec));
    int state = col_i16(r, row, off);
    if ((state != IDEM_REC_IN_PROGRESS && state != IDEM_REC_COMPLETED) ||
        PQgetlength(r, row, off + 1) != IDEM_FINGERPRINT_LEN) {
        return idem__err(IDEM_DATA_LOSS, "record has an unknown format");
    }
    rec->state = (idem_record_state)state;
    memcpy(rec->fingerprint, PQgetvalue(r, row, off + 1), IDEM_FINGERPRINT_LEN);
    rec->owner = (uint64_t)idem__pg_col_i64(r, row, off + 2);
    rec->lease_until_ms = (uint64_t)idem__pg_col_i64(r, row, off + 3);
    rec->first_at_ms = (uint64_t)idem__pg_col_i64(r, row, off + 4);
    rec->expires_ms = (uint64_t)idem__pg_col_i64(r, row, off + 5);
    size_t n = PQgetisnull(r, row, off + 6) ? 0 : (size_t)PQgetlength(r, row, off + 6);
    rec->response_len = n;
    rec->now_ms = (uint64_t)idem__pg_col_i64(r, row, off + 7);
    if (want && n > 0) {
        if ((rec->response = malloc(n)) == NULL) {
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        }
        memcpy(rec->response, PQgetvalue(r, row, off + 6), n);
    }
    return IDEM_OK;
}

/* ---- the claim ---- */

/* Consumes a token inside the open transaction (the caller rolls back on error); its
 * expiry is judged on the database clock. */
static idem_code token_take(PGconn *c, const char *token, const char *scope, uint64_t *expires_ms)
{
    pg_args a = {0};
    idem_code code;
    arg_text(&a, token);
    PGresult *r = idem__pg_exec(c, S_TOKEN_TAKE, &a, PGRES_TUPLES_OK, &code);
    if (r == NULL) {
        return code;
    }
    if (PQntuples(r) != 1) {
        code = idem__err(IDEM_FAILED_PRECONDITION, "token unknown or already used");
    } else if (strcmp(PQgetvalue(r, 0, 0), scope != NULL ? scope : "") != 0) {
        code = idem__err(IDEM_PERMISSION_DENIED, "token was issued to another caller");
    } else if (idem__pg_col_i64(r, 0, 1) <= idem__pg_col_i64(r, 0, 2)) {
        code = idem__err(IDEM_FAILED_PRECONDITION, "token expired");
    } else {
        *expires_ms = (uint64_t)idem__pg_col_i64(r, 0, 1);
        code = IDEM_OK;
    }
    PQclear(r);
    return code;
}

static void claim_args(pg_args *a, const idem_claim_req *req)
{
    arg_key(a, &req->key);
    arg_bytes(a, req->fingerprint, IDEM_FINGERPRINT_LEN);
    arg_i64(a, req->owner);
    arg_i64(a, req->lease_until_ms - req->now_ms);
    arg_i64(a, req->expires_ms - req->now_ms);
}

/* Consumes the claim's token and keeps it in the claimed row (a release restores it). */
static idem_code token_take_keep(PGconn *c, const idem_claim_req *req, const pg_args *a)
{
    uint64_t expires;
    idem_code code = token_take(c, req->token, req->key.caller, &expires);
    if (code != IDEM_OK) {
        return code;
    }
    pg_args k = *a;
    k.n = 3; /* the key columns lead the claim's arguments */
    arg_text(&k, req->token);
    arg_text(&k, req->key.caller != NULL ? req->key.caller : "");
    arg_i64(&k, expires);
    return idem__pg_run(c, S_TOKEN_KEEP, &k, PGRES_COMMAND_OK);
}

/* The claimed row as RETURNING gave it (CLAIM_RETURNING). */
static void claimed_row(const PGresult *r, const idem_claim_req *req, idem_record *rec)
{
    memset(rec, 0, sizeof(*rec));
    rec->state = IDEM_REC_IN_PROGRESS;
    rec->owner = (uint64_t)idem__pg_col_i64(r, 0, 0);
    rec->lease_until_ms = (uint64_t)idem__pg_col_i64(r, 0, 1);
    rec->first_at_ms = (uint64_t)idem__pg_col_i64(r, 0, 2);
    rec->expires_ms = (uint64_t)idem__pg_col_i64(r, 0, 3);
    rec->now_ms = (uint64_t)idem__pg_col_i64(r, 0, 4);
    memcpy(rec->fingerprint, req->fingerprint, IDEM_FINGERPRINT_LEN);
}

/* The row exists, locked by the insert: decide under that lock, on the database clock.
 * Returns with *outcome set (and *got the row when this claim acquired it), or an
 * error. */
static idem_code claim_existing(PGconn *c, const idem_claim_req *req, const pg_args *a,
                                idem_claim_outcome *outcome, idem_record *rec, idem_record *got)
{
    idem_code code;
    idem_record cur;
    pg_args key = *a;
    key.n = 3;
    PGresult *r = idem__pg_exec(c, S_CLAIM_LOCK, &key, PGRES_TUPLES_OK, &code);
    if (r == NULL) {
        return code;
    }
    if (PQntuples(r) != 1) { /* cannot be: the insert locked it */
        PQclear(r);
        return idem__err(IDEM_UNAVAILABLE, "record vanished during the claim; retry");
    }
    code = idem__pg_row_record(r, 0, 0, &cur, true);
    PQclear(r);
    if (code != IDEM_OK) {
        return code;
    }
    bool expired = cur.state == IDEM_REC_COMPLETED && cur.expires_ms <= cur.now_ms;
    bool same = memcmp(cur.fingerprint, req->fingerprint, IDEM_FINGERPRINT_LEN) == 0;
    if (!expired && (!same || cur.state == IDEM_REC_COMPLETED || cur.lease_until_ms > cur.now_ms)) {
        *outcome = !same                             ? IDEM_CLAIM_MISMATCH
                   : cur.state == IDEM_REC_COMPLETED ? IDEM_CLAIM_COMPLETED
                                                     : IDEM_CLAIM_IN_PROGRESS;
        if (rec != NULL) {
            *rec = cur;
        } else {
            idem_record_clear(&cur);
        }
        return IDEM_OK;
    }
    bool took_over = cur.state == IDEM_REC_IN_PROGRESS;
    idem_record_clear(&cur);
    if ((r = idem__pg_exec(c, S_CLAIM_TAKE, a, PGRES_TUPLES_OK, &code)) == NULL) {
        return code;
    }
    claimed_row(r, req, got);
    /* A takeover re-runs the same call: the token it kept is the one it needs. Any other
     * token must be valid, and is consumed. */
    bool kept = took_over && req->token != NULL && !PQgetisnull(r, 0, 5) &&
                strcmp(PQgetvalue(r, 0, 5), req->token) == 0;
    PQclear(r);
    if (req->token != NULL && !kept && (code = token_take_keep(c, req, a)) != IDEM_OK) {
        return code;
    }
    *outcome = took_over ? IDEM_CLAIM_TAKEN_OVER : IDEM_CLAIM_ACQUIRED;
    return IDEM_OK;
}

/* The claim's insert; for a store-assigned owner with the fence drawn in the same round
 * trip (S_CLAIM_FENCE). *inserted when the row is this claim's (then in *got). */
static idem_code claim_insert(PGconn *c, const idem_claim_req *req, const pg_args *a,
                              bool *inserted, idem_record *got)
{
    idem_code code = IDEM_OK;
    PGresult *r, *f = NULL;
    pg_args key = *a;
    key.n = 3;
    if (req->owner != 0) {
        r = idem__pg_exec(c, S_CLAIM_INSERT, a, PGRES_TUPLES_OK, &code);
    } else if ((code = exec_pair(c, S_CLAIM_INSERT, a, S_CLAIM_FENCE, &key, &r, &f)) != IDEM_OK) {
        r = NULL;
    }
    if (r == NULL) {
        return code;
    }
    *inserted = PQntuples(r) == 1; /* the unique key decided */
    if (*inserted) {
        claimed_row(r, req, got);
        if (f != NULL && PQntuples(f) == 1) {
            got->owner = (uint64_t)idem__pg_col_i64(f, 0, 0);
        } else if (f != NULL) {
            code = idem__err(IDEM_INTERNAL, "postgres: no owner drawn for the claim");
        }
    }
    PQclear(r);
    PQclear(f);
    return code;
}

idem_code idem__pg_claim_in_txn(PGconn *c, const idem_claim_req *req, idem_claim_outcome *outcome,
                                idem_record *rec, idem_record *got)
{
    pg_args a = {0};
    bool inserted = false;
    claim_args(&a, req);
    idem_code code = claim_insert(c, req, &a, &inserted, got);
    if (code != IDEM_OK) {
        return code;
    }
    if (!inserted) {
        return claim_existing(c, req, &a, outcome, rec, got);
    }
    if (req->token != NULL && (code = token_take_keep(c, req, &a)) != IDEM_OK) {
        return code;
    }
    *outcome = IDEM_CLAIM_ACQUIRED;
    return IDEM_OK;
}

/* Runs fn in a transaction on a pooled connection: COMMIT when it returns IDEM_OK, else
 * ROLLBACK (keeping fn's error detail). */
static idem_code pooled_txn(pg_store *st, idem_code (*fn)(PGconn *c, void *arg), void *arg)
{
    pool_slot *pc;
    idem_code code = idem__pg_pool_get(st, &pc);
    if (code != IDEM_OK) {
        return code;
    }
    if ((code = idem__pg_exec_simple(pc->c, "BEGIN")) == IDEM_OK) {
        code = fn(pc->c, arg);
        if (code == IDEM_OK) {
            code = idem__pg_exec_simple(pc->c, "COMMIT");
        } else {
            idem_errkeep keep;
            idem__err_keep(&keep);
            idem__pg_exec_simple(pc->c, "ROLLBACK");
            idem__err_put(&keep, code);
        }
    }
    idem__pg_pool_put(st, pc);
    return code;
}

typedef struct claim_call {
    const idem_claim_req *req;
    idem_claim_outcome *outcome;
    idem_record *rec, got;
} claim_call;

static idem_code claim_fn(PGconn *c, void *arg)
{
    claim_call *a = arg;
    return idem__pg_claim_in_txn(c, a->req, a->outcome, a->rec, &a->got);
}

static idem_code pg_claim(idem_store *base, const idem_claim_req *req, idem_claim_outcome *outcome,
                          idem_record *rec)
{
    claim_call a = {.req = req, .outcome = outcome, .rec = rec};
    idem_code code = pooled_txn((pg_store *)base, claim_fn, &a);
    if (code == IDEM_OK && rec != NULL &&
        (*outcome == IDEM_CLAIM_ACQUIRED || *outcome == IDEM_CLAIM_TAKEN_OVER)) {
        *rec = a.got;
    }
    return code;
}

/* ---- single-statement operations ---- */

/* Runs prepared statement s on a connection from the pool; *out (may be NULL) gets
 * the result. */
idem_code idem__pg_exec_pooled(pg_store *st, enum stmt s, const pg_args *a, ExecStatusType want,
                               PGresult **out)
{
    pool_slot *pc;
    idem_code code = idem__pg_pool_get(st, &pc);
    if (code != IDEM_OK) {
        return code;
    }
    PGresult *r = idem__pg_exec(pc->c, s, a, want, &code);
    idem__pg_pool_put(st, pc);
    if (r != NULL) {
        if (out != NULL) {
            *out = r;
        } else {
            PQclear(r);
        }
        return IDEM_OK;
    }
    return code;
}

/* Runs a statement that must change exactly one row; else_code when it changed none. */
static idem_code pooled_exec_one_row(pg_store *st, enum stmt s, const pg_args *a,
                                     idem_code else_code, const char *else_msg)
{
    PGresult *r;
    idem_code code = idem__pg_exec_pooled(st, s, a, PGRES_COMMAND_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    bool changed = strcmp(PQcmdTuples(r), "1") == 0;
    PQclear(r);
    return changed ? IDEM_OK : idem__err(else_code, "%s", else_msg);
}

#define CLAIM_LOST "claim lost: the record is gone or owned by another claim"

/* The count of d from an ANNOUNCE statement. */
static idem_code announced_one(PGresult *r)
{
    bool changed = PQntuples(r) == 1 && idem__pg_col_i64(r, 0, 0) == 1;
    PQclear(r);
    return changed ? IDEM_OK : idem__err(IDEM_ABORTED, CLAIM_LOST);
}

static void complete_args(pg_args *a, const pg_store *st, const idem_key_ref *key, uint64_t owner,
                          const void *response, size_t len, uint64_t expires_ms, uint64_t now_ms)
{
    arg_key(a, key);
    arg_i64(a, owner);
    arg_bytes(a, response, len);
    arg_i64(a, expires_ms - now_ms);
    arg_announce(a, st, key);
}

idem_code idem__pg_complete_on(pg_store *st, PGconn *c, const idem_key_ref *key, uint64_t owner,
                               const void *response, size_t len, uint64_t expires_ms,
                               uint64_t now_ms)
{
    pg_args a = {0};
    idem_code code;
    complete_args(&a, st, key, owner, response, len, expires_ms, now_ms);
    PGresult *r = idem__pg_exec(c, S_COMPLETE, &a, PGRES_TUPLES_OK, &code);
    return r != NULL ? announced_one(r) : code;
}

/* ticket: LMDB's shared commits; each PostgreSQL write is a commit of its own. */
static idem_code pg_complete(idem_store *base, const idem_key_ref *key, uint64_t owner,
                             const void *response, size_t len, uint64_t expires_ms, uint64_t now_ms,
                             uint64_t ticket)
{
    (void)ticket;
    pg_args a = {0};
    PGresult *r;
    pg_store *st = (pg_store *)base;
    complete_args(&a, st, key, owner, response, len, expires_ms, now_ms);
    idem_code code = idem__pg_exec_pooled(st, S_COMPLETE, &a, PGRES_TUPLES_OK, &r);
    return code != IDEM_OK ? code : announced_one(r);
}

static idem_code pg_release(idem_store *base, const idem_key_ref *key, uint64_t owner,
                            uint64_t ticket)
{
    (void)ticket;
    pg_args a = {0};
    PGresult *r;
    pg_store *st = (pg_store *)base;
    arg_key(&a, key);
    arg_i64(&a, owner);
    arg_announce(&a, st, key);
    idem_code code = idem__pg_exec_pooled(st, S_RELEASE, &a, PGRES_TUPLES_OK, &r);
    return code != IDEM_OK ? code : announced_one(r);
}

static idem_code pg_renew(idem_store *base, const idem_key_ref *key, uint64_t owner,
                          uint64_t lease_until_ms, uint64_t now_ms)
{
    pg_args a = {0};
    arg_key(&a, key);
    arg_i64(&a, owner);
    arg_i64(&a, lease_until_ms - now_ms);
    return pooled_exec_one_row((pg_store *)base, S_RENEW, &a, IDEM_ABORTED, CLAIM_LOST);
}

static idem_code pg_delete(idem_store *base, const idem_key_ref *key)
{
    pg_args a = {0};
    arg_key(&a, key);
    return pooled_exec_one_row((pg_store *)base, S_DELETE, &a, IDEM_NOT_FOUND, "no record");
}

static idem_code pg_get(idem_store *base, const idem_key_ref *key, idem_record *rec)
{
    pg_args a = {0};
    PGresult *r;
    arg_key(&a, key);
    idem_code code = idem__pg_exec_pooled((pg_store *)base, S_GET, &a, PGRES_TUPLES_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    code = PQntuples(r) == 1 ? idem__pg_row_record(r, 0, 0, rec, true)
                             : idem__err(IDEM_NOT_FOUND, "no record");
    PQclear(r);
    return code;
}

/* S_SWEEP_KV takes only the limit. */
static idem_code sweep_table(pg_store *st, enum stmt s, uint64_t now_ms, size_t max,
                             size_t *deleted)
{
    pg_args a = {0};
    PGresult *r;
    if (s != S_SWEEP_KV) {
        arg_i64(&a, now_ms - idem__now_ms()); /* a shift of the database clock */
    }
    arg_i64(&a, max);
    idem_code code = idem__pg_exec_pooled(st, s, &a, PGRES_COMMAND_OK, &r);
    if (code == IDEM_OK) {
        *deleted += strtoul(PQcmdTuples(r), NULL, 10);
        PQclear(r);
    }
    return code;
}

static idem_code pg_sweep(idem_store *base, uint64_t now_ms, size_t max, size_t *deleted)
{
    pg_store *st = (pg_store *)base;
    idem_code code = sweep_table(st, S_SWEEP_RECORDS, now_ms, max, deleted);
    if (code == IDEM_OK && *deleted < max) {
        code = sweep_table(st, S_SWEEP_TOKENS, now_ms, max - *deleted, deleted);
    }
    if (code == IDEM_OK && *deleted < max) {
        size_t empty = 0; /* not records or tokens: not counted */
        code = sweep_table(st, S_SWEEP_KV, now_ms, max - *deleted, &empty);
    }
    return code;
}

static idem_code pg_token_put(idem_store *base, const char *token, const char *scope,
                              uint64_t expires_ms, uint64_t now_ms)
{
    pg_args a = {0};
    arg_text(&a, token);
    arg_text(&a, scope);
    arg_i64(&a, expires_ms - now_ms);
    return pooled_exec_one_row((pg_store *)base, S_TOKEN_PUT, &a, IDEM_ALREADY_EXISTS,
                               "token exists");
}

typedef struct token_call {
    const char *token, *scope;
} token_call;

static idem_code token_fn(PGconn *c, void *arg)
{
    token_call *a = arg;
    uint64_t expires;
    return token_take(c, a->token, a->scope, &expires);
}

static idem_code pg_token_consume(idem_store *base, const char *token, const char *scope,
                                  uint64_t now_ms)
{
    (void)now_ms; /* the database clock decides */
    token_call a = {token, scope};
    return pooled_txn((pg_store *)base, token_fn, &a);
}

static idem_code pg_stats(idem_store *base, idem_store_stats *out)
{
    PGresult *r;
    idem_code code = idem__pg_exec_pooled((pg_store *)base, S_STATS, NULL, PGRES_TUPLES_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    if (PQntuples(r) == 1) {
        out->records = (size_t)idem__pg_col_i64(r, 0, 0);
        out->in_progress = (size_t)idem__pg_col_i64(r, 0, 1);
        out->completed = (size_t)idem__pg_col_i64(r, 0, 2);
        out->tokens = (size_t)idem__pg_col_i64(r, 0, 3);
    }
    PQclear(r);
    return IDEM_OK;
}

/* Pages through the records in key order (keyset pagination, 500 per query). */
static idem_code pg_foreach(idem_store *base, idem_store_visit_fn fn, void *arg)
{
    char caller[IDEM_MAX_CALLER + 1] = "", method[IDEM_MAX_METHOD + 1] = "",
                                  key[IDEM_MAX_KEY + 1] = "";
    for (;;) {
        pg_args a = {0};
        PGresult *r;
        arg_key(&a, &(idem_key_ref){caller, method, key});
        idem_code code = idem__pg_exec_pooled((pg_store *)base, S_PAGE, &a, PGRES_TUPLES_OK, &r);
        if (code != IDEM_OK) {
            return code;
        }
        int n = PQntuples(r);
        bool go_on = n == FOREACH_PAGE;
        for (int i = 0; i < n; i++) {
            idem_record rec;
            snprintf(caller, sizeof(caller), "%s", PQgetvalue(r, i, 0));
            snprintf(method, sizeof(method), "%s", PQgetvalue(r, i, 1));
            snprintf(key, sizeof(key), "%s", PQgetvalue(r, i, 2));
            if (idem__pg_row_record(r, i, 3, &rec, false) == IDEM_OK &&
                !fn(arg, &(idem_key_ref){caller, method, key}, &rec)) {
                PQclear(r);
                return IDEM_OK;
            }
        }
        PQclear(r);
        if (!go_on) {
            return IDEM_OK;
        }
    }
}

static void pg_close(idem_store *base)
{
    pg_store *st = (pg_store *)base;
    idem__pg_listener_stop(st);
    for (size_t i = 0; i < st->n; i++) {
        if (st->pool[i].c != NULL) {
            PQfinish(st->pool[i].c);
        }
    }
    pthread_cond_destroy(&st->cv);
    pthread_mutex_destroy(&st->mu);
    free(st->pool);
    free(st->conninfo);
    free(st);
}

const idem_store_ops idem__pg_ops = {
    .name = "postgres",
    .caps = IDEM__STORE_CAP_TXN | IDEM__STORE_CAP_TXN_CLAIM | IDEM__STORE_CAP_WATCH,
    .claim = pg_claim,
    .complete = pg_complete,
    .release = pg_release,
    .renew = pg_renew,
    .get = pg_get,
    .del = pg_delete,
    .sweep = pg_sweep,
    .token_put = pg_token_put,
    .token_consume = pg_token_consume,
    .stats = pg_stats,
    .foreach = pg_foreach,
    .close = pg_close,
    .txn_begin = idem__pg_txn_begin,
    .txn_abort = idem__pg_txn_abort,
    .txn_commit = idem__pg_txn_commit,
    .txn_complete_commit = idem__pg_txn_complete_commit,
    .txn_get = idem__pg_txn_get,
    .txn_put = idem__pg_txn_put,
    .txn_del = idem__pg_txn_del,
    .app_get = idem__pg_app_get,
    .app_next = idem__pg_app_next,
    .txn_record = idem__pg_txn_record,
    .txn_claim = idem__pg_txn_claim,
    .txn_undo = idem__pg_txn_undo,
    .watch = idem__pg_watch,
    .unwatch = idem__pg_unwatch,
};

idem_code idem_store_open_postgres_ex(idem_store **out, const char *conninfo,
                                      const idem_pg_opts *opts)
{
    idem_pg_opts dflt = {0};
    opts = opts != NULL ? opts : &dflt;
    size_t pool_size = opts->pool_size ? opts->pool_size : 1;
    *out = NULL;
    if (conninfo == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "postgres conninfo not set");
    }
    pg_store *st = calloc(1, sizeof(*st));
    if (st == NULL || (st->conninfo = strdup(conninfo)) == NULL ||
        (st->pool = calloc(pool_size, sizeof(pool_slot))) == NULL) {
        if (st != NULL) {
            free(st->conninfo);
        }
        free(st);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    st->base.ops = &idem__pg_ops;
    st->n = pool_size;
    st->notify = !opts->no_notify;
    pthread_mutex_init(&st->mu, NULL);
    idem__cond_init(&st->cv);
    idem_code code = pg_connect(st, &st->pool[0]); /* fail early on a bad conninfo */
    if (code != IDEM_OK) {
        idem_errkeep keep;
        idem__err_keep(&keep);
        pg_close(&st->base);
        return idem__err_put(&keep, code);
    }
    *out = &st->base;
    return IDEM_OK;
}

idem_code idem_store_open_postgres(idem_store **out, const char *conninfo, size_t pool_size)
{
    idem_pg_opts opts = {.pool_size = pool_size};
    return idem_store_open_postgres_ex(out, conninfo, &opts);
}