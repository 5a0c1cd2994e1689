/* PostgreSQL backend of idem_store, for several server instances sharing records.
 *
 *   idem_records(caller, method, key) PRIMARY KEY, state, fingerprint, owner, lease and
 *   expiry (unix ms), response bytea, the consumed token kept while IN_PROGRESS;
 *   idem_tokens(token PRIMARY KEY, scope, expires_ms);   sequence idem_fence (owners)
 *   idem_tombstones(caller, method, key) PRIMARY KEY: what an expired COMPLETED record
 *   leaves while a tombstone horizon runs (tombs.c)
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
 * conditional on (key, owner, state); the claim itself is in claim.c.
 * Connection failures map to UNAVAILABLE, so the client's retryer carries calls across
 * a database restart; statements are prepared once per connection (conn.c), or sent
 * unnamed through a pooler. Lease renewals come in rounds (S_RENEW_BATCH), one
 * statement each, that skip a row another session holds instead of waiting for it.
 *
 * Completions and releases announce themselves (NOTIFY PG_CHANNEL, sent at commit) so
 * that waiters in other instances wake at once (listen.c); handler transactions and the
 * business key-value table are in txn.c. The statements and the schema are in sql.c. */
#include <stdlib.h>
#include <string.h>

#include "pg_internal.h"

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

/* ---- single-statement operations ---- */

/* Runs statement s on a connection from the pool; *out (may be NULL) gets the result.
 * A read that lost its connection is tried again on a new one (reconnect_ms). */
idem_code idem__pg_exec_pooled(pg_store *st, enum stmt s, const pg_args *a, ExecStatusType want,
                               PGresult **out)
{
    /* Reads, and S_CLAIM_CONFIRM (it only extends a lease this claim holds), may run twice. */
    bool read = s == S_GET || s == S_STATS || s == S_PAGE || s == S_KV_READ || s == S_KV_NEXT ||
                s == S_CLAIM_CONFIRM || s == S_TOMB_GET || s == S_TOMB_PAGE;
    uint64_t give_up = idem__mono_ms() + st->reconnect_ms;
    for (;;) {
        pool_slot *pc;
        idem_code code = idem__pg_pool_get(st, &pc);
        if (code != IDEM_OK) {
            return code;
        }
        PGresult *r = idem__pg_exec(pc, s, a, want, &code);
        bool dropped = r == NULL && (pc->dead || pc->c == NULL || PQstatus(pc->c) != CONNECTION_OK);
        idem__pg_pool_put(st, pc);
        if (r != NULL) {
            if (out != NULL) {
                *out = r;
            } else {
                PQclear(r);
            }
            return IDEM_OK;
        }
        if (!read || !dropped || idem__mono_ms() >= give_up) {
            return code;
        }
    }
}

/* Runs a statement that must change exactly one row; else_code when it changed none. */
idem_code idem__pg_exec_one_row(pg_store *st, enum stmt s, const pg_args *a, idem_code else_code,
                                const char *else_msg)
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

idem_code idem__pg_complete_on(pg_store *st, pool_slot *c, const idem_key_ref *key, uint64_t owner,
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

static idem_code pg_token_put(idem_store *base, const char *token, const char *scope,
                              uint64_t expires_ms, uint64_t now_ms)
{
    pg_args a = {0};
    arg_text(&a, token);
    arg_text(&a, scope);
    arg_i64(&a, expires_ms - now_ms);
    return idem__pg_exec_one_row((pg_store *)base, S_TOKEN_PUT, &a, IDEM_ALREADY_EXISTS,
                                 "token exists");
}

static void pg_close(idem_store *base)
{
    pg_store *st = (pg_store *)base;
    idem__pg_listener_stop(st->listener);
    idem__pg_rcache_destroy(st->rcache); /* its watch ended with the listener */
    for (size_t i = 0; i < st->n; i++) {
        if (st->pool[i].c != NULL) {
            PQfinish(st->pool[i].c);
        }
    }
    if (st->renew_slot.c != NULL) {
        PQfinish(st->renew_slot.c);
    }
    if (st->fence_slot.c != NULL) {
        PQfinish(st->fence_slot.c);
    }
    pthread_mutex_destroy(&st->renew_mu);
    pthread_mutex_destroy(&st->fence_mu);
    pthread_cond_destroy(&st->cv);
    pthread_mutex_destroy(&st->mu);
    free(st->pool);
    idem__pg_hosts_free(st->hosts);
    free(st);
}

const idem_store_ops idem__pg_ops = {
    .name = "postgres",
    .caps = IDEM__STORE_CAP_TXN | IDEM__STORE_CAP_TXN_CLAIM | IDEM__STORE_CAP_WATCH,
    .claim = idem__pg_claim,
    .complete = pg_complete,
    .release = pg_release,
    .renew = idem__pg_renew,
    .renew_batch = idem__pg_renew_batch,
    .get = idem__pg_get,
    .del = idem__pg_delete,
    .sweep = idem__pg_sweep,
    .tomb_keep = idem__pg_tomb_keep,
    .tomb_get = idem__pg_tomb_get,
    .tomb_del = idem__pg_tomb_del,
    .tomb_foreach = idem__pg_tomb_foreach,
    .token_put = pg_token_put,
    .token_consume = idem__pg_token_consume,
    .stats = idem__pg_stats,
    .foreach = idem__pg_foreach,
    .close = pg_close,
    .txn_begin = idem__pg_txn_begin,
    .txn_abort = idem__pg_txn_abort,
    .txn_broken = idem__pg_txn_broken,
    .txn_commit = idem__pg_txn_commit,
    .txn_complete_commit = idem__pg_txn_complete_commit,
    .txn_get = idem__pg_txn_get,
    .txn_get_bounded = idem__pg_txn_get_bounded,
    .txn_put = idem__pg_txn_put,
    .txn_del = idem__pg_txn_del,
    .app_get = idem__pg_app_get,
    .app_next = idem__pg_app_next,
    .txn_record = idem__pg_txn_record,
    .txn_claim = idem__pg_txn_claim,
    .txn_undo = idem__pg_txn_undo,
    .txn_fence_durable = idem__pg_txn_fence_durable,
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
    pg_hosts *hosts;
    idem_code code = idem__pg_hosts_parse(conninfo, &hosts);
    if (code != IDEM_OK) {
        return code;
    }
    pg_store *st = calloc(1, sizeof(*st));
    if (st == NULL || (st->pool = calloc(pool_size, sizeof(pool_slot))) == NULL) {
        idem__pg_hosts_free(hosts);
        free(st);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    st->hosts = hosts;
    st->base.ops = &idem__pg_ops;
    st->n = pool_size;
    st->pooler = opts->pooler;
    st->existing = opts->existing;
    st->notify = !opts->no_notify && !opts->pooler;
    /* Bounded to an hour: a poll() timeout and a margin must fit in an int. */
    st->stmt_ms = opts->statement_timeout_ms ? opts->statement_timeout_ms : 5000;
    st->stmt_ms = st->stmt_ms > 3600000 ? 3600000 : st->stmt_ms;
    st->lock_ms = opts->lock_timeout_ms ? opts->lock_timeout_ms : 1000;
    st->lock_ms = st->lock_ms > st->stmt_ms ? st->stmt_ms : st->lock_ms;
    st->migrate_ms = opts->migrate_timeout_ms ? opts->migrate_timeout_ms : 30000;
    st->migrate_ms = st->migrate_ms > 3600000 ? 3600000 : st->migrate_ms;
    /* The server's side of the keepalive (ignored on a Unix socket), and its bounds. */
    snprintf(st->session_sql, sizeof(st->session_sql),
             "SET tcp_keepalives_idle = 30; SET tcp_keepalives_interval = 10;"
             " SET tcp_keepalives_count = 3; SET statement_timeout = %u; SET lock_timeout = %u",
             st->stmt_ms, st->lock_ms);
    snprintf(st->txn_sql, sizeof(st->txn_sql),
             "BEGIN; SET LOCAL statement_timeout = %u; SET LOCAL lock_timeout = %u;"
             " SET LOCAL idle_in_transaction_session_timeout = %u",
             st->stmt_ms, st->lock_ms, st->stmt_ms);
    pthread_mutex_init(&st->mu, NULL);
    pthread_mutex_init(&st->renew_mu, NULL);
    pthread_mutex_init(&st->fence_mu, NULL);
    idem__cond_init(&st->cv);
    pool_slot *pc;
    code = idem__pg_pool_get(st, &pc); /* fail early on a bad conninfo */
    if (code == IDEM_OK) {
        idem__pg_pool_put(st, pc);
        code = idem__pg_rcache_open(st, opts);
    }
    if (code != IDEM_OK) {
        idem_errkeep keep;
        idem__err_keep(&keep);
        pg_close(&st->base);
        return idem__err_put(&keep, code);
    }
    st->reconnect_ms = opts->reconnect_ms ? opts->reconnect_ms : 10000; /* 0 while opening */
    st->reconnect_ms = st->reconnect_ms > 3600000 ? 3600000 : st->reconnect_ms;
    *out = &st->base;
    return IDEM_OK;
}

idem_code idem_store_open_postgres(idem_store **out, const char *conninfo, size_t pool_size)
{
    idem_pg_opts opts = {.pool_size = pool_size};
    return idem_store_open_postgres_ex(out, conninfo, &opts);
}