/* Handler transactions on PostgreSQL (txn.h): the claim, the handler's SQL and its
 * idem_txn_* writes, and the COMPLETED record in one transaction on one pooled
 * connection.
 *
 *   BEGIN; pg_try_advisory_xact_lock(key); claim; SAVEPOINT; handler; complete; COMMIT
 *
 * The advisory lock (transaction-scoped, so a dead session drops it with its
 * transaction) tells a duplicate on any instance that the key is in a handler
 * transaction right now, without waiting on the uncommitted row: it answers
 * IDEM_CLAIM_IN_PROGRESS and the duplicate waits off-thread for the announcement of
 * the commit. A final error rolls back to the savepoint (the handler's writes go, the
 * claim stays) and records itself; a transient one rolls everything back.
 *
 * idem_txn_* data: table idem_kv(db, k, v). A read is an upsert that locks the row
 * (inserting an empty one, v NULL, when the key is absent), so every key a transaction
 * touches stays locked until it ends: two-phase locking, serialisable for this data
 * at READ COMMITTED. The sweep deletes empty rows. Values read point into a PGresult
 * kept until the transaction ends. */
#include <stdlib.h>
#include <string.h>

#include "pg_internal.h"

/* A handler txn holds a connection; a second one begun on the same thread (a toolkit
 * call with its own txn inside a handler) could wait for the first's row locks
 * forever, which PostgreSQL cannot see as a deadlock. Refused, as on LMDB. */
static _Thread_local bool thread_in_txn;

typedef struct pg_txn {
    idem_txn_head head; /* first: store.c dispatches through it */
    pg_store *st;
    pool_slot *slot;
    PGresult **kept; /* results whose values idem_txn_get handed out */
    size_t n_kept, cap_kept;
    bool claimed;       /* this txn holds a claim: announce its rollback */
    idem_key_ref claim; /* the claim's key (the caller's strings, alive until the end) */
} pg_txn;

#define SAVEPOINT_NAME "idem_claimed"
#define HANDLER_IDLE_MS 300000ull /* the server's default max_run_ms, 5 min */

static pg_txn *pg_txn_of(idem_txn *t)
{
    return (pg_txn *)t;
}

static void drop_kept(pg_txn *t)
{
    for (size_t i = 0; i < t->n_kept; i++) {
        PQclear(t->kept[i]);
    }
    t->n_kept = 0;
}

static void txn_free(pg_txn *t)
{
    drop_kept(t);
    free(t->kept);
    idem__pg_pool_put(t->st, t->slot);
    thread_in_txn = false;
    free(t);
}

idem_code idem__pg_txn_begin(idem_store *base, uint64_t idle_ms, idem_txn **out)
{
    char begin[192];
    pg_store *st = (pg_store *)base;
    if (thread_in_txn) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "this thread is inside a transactional handler: use idem_txn_* on its "
                         "txn, not a transaction of its own");
    }
    pg_txn *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    idem_code code = idem__pg_pool_get(st, &t->slot);
    if (code != IDEM_OK) {
        free(t);
        return code;
    }
    t->head.ops = &idem__pg_ops;
    t->st = st;
    thread_in_txn = true;
    /* A handler that hangs, or whose process stopped or was cut off, must not hold its
     * claim, its row locks and this connection for ever: PostgreSQL ends a session idle
     * in a transaction for idle_ms (a claim's lease; HANDLER_IDLE_MS without one), its
     * commit then fails and the retry runs. The handler's own SQL is bounded by the
     * handler: no statement or lock timeout. */
    snprintf(begin, sizeof(begin),
             "BEGIN; SET LOCAL idle_in_transaction_session_timeout = %llu;"
             " SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0",
             (unsigned long long)(idle_ms ? idle_ms : HANDLER_IDLE_MS));
    if ((code = idem__pg_exec_simple(t->slot, begin)) != IDEM_OK) {
        txn_free(t);
        return code;
    }
    *out = (idem_txn *)t;
    return IDEM_OK;
}

/* A rolled-back claim frees its key: waiters in other instances may claim it now. */
static void announce_rollback(pg_txn *t)
{
    pg_args a = {0};
    arg_announce(&a, t->st, &t->claim);
    idem__pg_run(t->slot, S_NOTIFY, &a, PGRES_TUPLES_OK);
}

bool idem__pg_txn_broken(const idem_txn *base)
{
    const pool_slot *pc = ((const pg_txn *)base)->slot;
    return pc->dead || pc->c == NULL || PQstatus(pc->c) != CONNECTION_OK;
}

void idem__pg_txn_abort(idem_txn *base)
{
    pg_txn *t = pg_txn_of(base);
    idem_errkeep keep;
    idem__err_keep(&keep); /* the reason for the abort is what the caller reports */
    if (idem__pg_exec_simple(t->slot, "ROLLBACK") == IDEM_OK && t->claimed && t->st->notify) {
        announce_rollback(t); /* best effort: waiters also re-read on their timers */
    }
    idem__err_put(&keep, IDEM_OK);
    txn_free(t); /* a connection still in the transaction is closed by the pool */
}

idem_code idem__pg_txn_commit(idem_txn *base)
{
    pg_txn *t = pg_txn_of(base);
    idem_code code = idem__pg_exec_simple(t->slot, "COMMIT");
    if (code != IDEM_OK) {
        idem__err(code, "the commit failed or its outcome is unknown (%s)", idem_errmsg());
    }
    txn_free(t);
    return code;
}

idem_code idem__pg_txn_complete_commit(idem_txn *base, const idem_key_ref *ref, uint64_t owner,
                                       const void *response, size_t len, uint64_t expires_ms,
                                       uint64_t now_ms)
{
    pg_txn *t = pg_txn_of(base);
    idem_code code =
        idem__pg_complete_on(t->st, t->slot, ref, owner, response, len, expires_ms, now_ms);
    if (code != IDEM_OK) {
        idem__pg_txn_abort(base);
        return code;
    }
    return idem__pg_txn_commit(base);
}

/* True when this transaction now holds the key's advisory lock. */
static idem_code lock_key(pool_slot *c, const idem_key_ref *key, bool *locked)
{
    pg_args a = {0};
    idem_code code;
    arg_i64(&a, idem__key_hash64(key));
    PGresult *r = idem__pg_exec(c, S_TRY_LOCK, &a, PGRES_TUPLES_OK, &code);
    if (r == NULL) {
        return code;
    }
    *locked = PQntuples(r) == 1 && PQgetlength(r, 0, 0) == 1 && PQgetvalue(r, 0, 0)[0] != 0;
    PQclear(r);
    return IDEM_OK;
}

idem_code idem__pg_txn_claim(idem_txn *base, const idem_claim_req *req, idem_claim_outcome *outcome,
                             idem_record *rec)
{
    pg_txn *t = pg_txn_of(base);
    pool_slot *c = t->slot;
    idem_record got;
    bool locked = false;
    char bounds[128];
    /* The claim waits for no row lock longer than any claim does; the handler's own SQL,
     * after the savepoint, is bounded by the handler. */
    snprintf(bounds, sizeof(bounds),
             "SET LOCAL statement_timeout = %u; SET LOCAL lock_timeout = %u", t->st->stmt_ms,
             t->st->lock_ms);
    idem_code code = idem__pg_exec_simple(c, bounds);
    if (code != IDEM_OK || (code = lock_key(c, &req->key, &locked)) != IDEM_OK) {
        return code;
    }
    if (!locked) { /* another session's handler txn has it */
        rec->state = IDEM_REC_IN_PROGRESS;
        *outcome = IDEM_CLAIM_IN_PROGRESS;
        return IDEM_OK;
    }
    if ((code = idem__pg_claim_in_txn(c, req, outcome, rec, &got)) != IDEM_OK) {
        return code;
    }
    if (*outcome == IDEM_CLAIM_ACQUIRED || *outcome == IDEM_CLAIM_TAKEN_OVER) {
        *rec = got;
        t->claimed = true;
        t->claim = req->key;
        return idem__pg_exec_simple(c, "SAVEPOINT " SAVEPOINT_NAME "; SET LOCAL statement_timeout"
                                       " = 0; SET LOCAL lock_timeout = 0");
    }
    return IDEM_OK;
}

/* The claim's draw came before the flush, on this txn's session. That session still
 * answering after the flush proves that no crash came between: a restart ends every
 * session, and a failover ends the old leader's (a standby refuses the flush). A
 * session that does not answer leaves the fence unproven: refused. */
idem_code idem__pg_txn_fence_durable(idem_txn *base)
{
    pg_txn *t = pg_txn_of(base);
    if (!t->claimed) {
        return IDEM_OK;
    }
    idem_code code = idem__pg_fences_flush(t->st);
    if (code == IDEM_OK &&
        idem__pg_query_named(t->slot, "fence session check", "SELECT 1", NULL) != IDEM_OK) {
        code = idem__err(IDEM_UNAVAILABLE,
                         "the draw may be lost: the handler's session did not answer after the "
                         "flush (%s)",
                         idem_errmsg());
    }
    return code;
}

idem_code idem__pg_txn_undo(idem_txn *base)
{
    pg_txn *t = pg_txn_of(base);
    drop_kept(t);
    return idem__pg_exec_simple(t->slot, "ROLLBACK TO SAVEPOINT " SAVEPOINT_NAME);
}

/* Locks (db, key) for the rest of the transaction and returns its row's result. */
static idem_code kv_lock(pg_txn *t, const char *db, const void *key, size_t klen, PGresult **out)
{
    pg_args a = {0};
    idem_code code;
    arg_text(&a, db);
    arg_bytes(&a, key, klen);
    PGresult *r = idem__pg_exec(t->slot, S_KV_LOCK, &a, PGRES_TUPLES_OK, &code);
    if (r == NULL) {
        return code;
    }
    if (PQntuples(r) != 1) {
        PQclear(r);
        return idem__err(IDEM_INTERNAL, "postgres: the key-value upsert returned no row");
    }
    *out = r;
    return IDEM_OK;
}

static idem_code keep_result(pg_txn *t, PGresult *r)
{
    if (t->n_kept == t->cap_kept) {
        size_t cap = t->cap_kept ? t->cap_kept * 2 : 8;
        PGresult **k = realloc(t->kept, cap * sizeof(*k));
        if (k == NULL) {
            PQclear(r);
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        }
        t->kept = k;
        t->cap_kept = cap;
    }
    t->kept[t->n_kept++] = r;
    return IDEM_OK;
}

idem_code idem__pg_txn_get(idem_txn *base, const char *db, const void *key, size_t klen,
                           const void **val, size_t *vlen)
{
    pg_txn *t = pg_txn_of(base);
    PGresult *r;
    idem_code code = kv_lock(t, db, key, klen, &r);
    if (code != IDEM_OK) {
        return code;
    }
    if (PQgetisnull(r, 0, 0)) {
        PQclear(r);
        return idem__err(IDEM_NOT_FOUND, "no such key");
    }
    *val = PQgetvalue(r, 0, 0);
    *vlen = (size_t)PQgetlength(r, 0, 0);
    return keep_result(t, r);
}

/* The row's lock waited for lock_timeout_ms at most (the handler's own SQL, after it, for
 * as long as the handler lets it: lock_timeout back to 0). */
idem_code idem__pg_txn_get_bounded(idem_txn *base, const char *db, const void *key, size_t klen,
                                   const void **val, size_t *vlen)
{
    pg_txn *t = pg_txn_of(base);
    char bound[48];
    idem_errkeep k;
    snprintf(bound, sizeof(bound), "SET LOCAL lock_timeout = %u", t->st->lock_ms);
    idem__pg_fail_forget();
    idem_code code = idem__pg_exec_simple(t->slot, bound);
    if (code == IDEM_OK) {
        code = idem__pg_txn_get(base, db, key, klen, val, vlen);
    }
    if (code == IDEM_UNAVAILABLE && idem__pg_failed_with("55P03")) { /* lock_not_available */
        return idem__err(IDEM_ABORTED,
                         "another transaction holds the row, past lock_timeout_ms (%u ms)",
                         t->st->lock_ms);
    }
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    idem__err_keep(&k);
    idem_code reset = idem__pg_exec_simple(t->slot, "SET LOCAL lock_timeout = 0");
    return reset != IDEM_OK ? reset : idem__err_put(&k, code);
}

idem_code idem__pg_txn_put(idem_txn *base, const char *db, const void *key, size_t klen,
                           const void *val, size_t vlen)
{
    pg_txn *t = pg_txn_of(base);
    pg_args a = {0};
    if (vlen > INT32_MAX) {
        return idem__err(IDEM_INVALID_ARGUMENT, "value of %zu bytes is too large", vlen);
    }
    arg_text(&a, db);
    arg_bytes(&a, key, klen);
    arg_bytes(&a, val != NULL ? val : "", vlen);
    return idem__pg_run(t->slot, S_KV_PUT, &a, PGRES_COMMAND_OK);
}

idem_code idem__pg_txn_del(idem_txn *base, const char *db, const void *key, size_t klen)
{
    pg_txn *t = pg_txn_of(base);
    PGresult *r;
    idem_code code = kv_lock(t, db, key, klen, &r); /* absent keys are locked too */
    if (code != IDEM_OK) {
        return code;
    }
    bool absent = PQgetisnull(r, 0, 0);
    PQclear(r);
    if (absent) {
        return idem__err(IDEM_NOT_FOUND, "no such key");
    }
    pg_args a = {0};
    arg_text(&a, db);
    arg_bytes(&a, key, klen);
    return idem__pg_run(t->slot, S_KV_DEL, &a, PGRES_COMMAND_OK);
}

/* A malloc'd copy of field f of row 0 (bytea in binary results). */
static bool copy_field(const PGresult *r, int f, void **out, size_t *len)
{
    *len = (size_t)PQgetlength(r, 0, f);
    if ((*out = malloc(*len ? *len : 1)) == NULL) {
        return false;
    }
    memcpy(*out, PQgetvalue(r, 0, f), *len);
    return true;
}

idem_code idem__pg_app_get(idem_store *base, const char *db, const void *key, size_t klen,
                           void **val, size_t *vlen)
{
    pg_args a = {0};
    PGresult *r;
    arg_text(&a, db);
    arg_bytes(&a, key, klen);
    idem_code code = idem__pg_exec_pooled((pg_store *)base, S_KV_READ, &a, PGRES_TUPLES_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    if (PQntuples(r) != 1) {
        code = idem__err(IDEM_NOT_FOUND, "no such key");
    } else if (!copy_field(r, 0, val, vlen)) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    PQclear(r);
    return code;
}

idem_code idem__pg_txn_record(idem_txn *base, const idem_key_ref *key, idem_record *rec)
{
    pg_args a = {0};
    idem_code code;
    arg_key(&a, key);
    PGresult *r = idem__pg_exec(pg_txn_of(base)->slot, S_TXN_RECORD, &a, PGRES_TUPLES_OK, &code);
    if (r == NULL) {
        return code;
    }
    code = PQntuples(r) == 1 ? idem__pg_row_record(r, 0, 0, rec, false)
                             : idem__err(IDEM_NOT_FOUND, "no record");
    PQclear(r);
    return code;
}

idem_code idem__pg_app_next(idem_store *base, const char *db, const void *after, size_t alen,
                            idem_app_entry *out)
{
    pg_args a = {0};
    PGresult *r;
    arg_text(&a, db);
    arg_bytes(&a, alen ? after : "", alen);
    idem_code code = idem__pg_exec_pooled((pg_store *)base, S_KV_NEXT, &a, PGRES_TUPLES_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    if (PQntuples(r) != 1) {
        code = idem__err(IDEM_NOT_FOUND, "no key after it");
    } else if (!copy_field(r, 0, &out->key, &out->klen) ||
               !copy_field(r, 1, &out->val, &out->vlen)) {
        idem__app_entry_clear(out);
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    PQclear(r);
    return code;
}

struct pg_conn *idem_txn_pg_conn(idem_txn *t)
{
    return t != NULL && ((const idem_txn_head *)t)->ops == &idem__pg_ops ? pg_txn_of(t)->slot->c
                                                                         : NULL;
}
