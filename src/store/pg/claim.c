/* The claim on PostgreSQL: decided by the unique key inside one transaction.
 *
 * INSERT … ON CONFLICT either inserts (this caller owns the key) or locks the existing
 * row, which is then read so that an expired-lease takeover or a token consumption is
 * decided under the row lock, in the same transaction. A store-assigned owner is drawn
 * from idem_fence only once the row is the claim's, so one key's successive owners only
 * grow.
 *
 * The transaction carries the store's lock and statement timeouts (SET LOCAL), so a
 * claim behind another session's uncommitted claim (a stalled instance) ends with
 * UNAVAILABLE after lock_timeout_ms instead of holding a worker. A COMMIT whose answer
 * was lost (the connection died after it was sent) leaves the outcome unknown: the row
 * is re-read, and the claim is this call's exactly when it holds the owner drawn.
 *
 * A fence leaves the process only once durable (txn.c's fence_durable). nextval
 * WAL-logs its draw at once, but nothing flushes that record before some commit does,
 * and a draw in a handler's still-open txn has no commit yet: a crash (or a failover to
 * a standby, which has only flushed WAL) would draw the same fence again for the key's
 * next holder while the old one may still be alive. */
#include <stdlib.h>
#include <string.h>

#include "pg_internal.h"

/* Consumes a token inside the open transaction (the caller rolls back on error), or with
 * S_TOKEN_CHECK only checks it; its expiry is judged on the database clock. */
static idem_code token_take(pool_slot *c, const char *token, const char *scope,
                            uint64_t *expires_ms, enum stmt stmt)
{
    pg_args a = {0};
    idem_code code;
    arg_text(&a, token);
    PGresult *r = idem__pg_exec(c, stmt, &a, PGRES_TUPLES_OK, &code);
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
static idem_code token_take_keep(pool_slot *c, const idem_claim_req *req, const pg_args *a)
{
    uint64_t expires;
    idem_code code = token_take(c, req->token, req->key.caller, &expires, S_TOKEN_TAKE);
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

/* An expired COMPLETED record the sweep has not reached answers as its tombstone
 * within the claim's horizon (true: *outcome set; cur is cleared). */
static bool expired_answers(idem_record *cur, const idem_claim_req *req,
                            idem_claim_outcome *outcome, idem_record *rec)
{
    idem_tombstone t = {.code = idem__response_code(cur->response, cur->response_len),
                        .first_at_ms = cur->first_at_ms,
                        .expired_at_ms = cur->expires_ms,
                        .until_ms = UINT64_MAX}; /* not swept: the claim's horizon bounds it */
    memcpy(t.fingerprint, cur->fingerprint, IDEM_TOMBSTONE_FP_LEN);
    if (!idem__tomb_decides(&t, req, cur->now_ms)) {
        return false;
    }
    idem_record_clear(cur);
    idem__tomb_answer(&t, req, outcome, rec);
    return true;
}

/* The row exists, locked by the insert: decide under that lock, on the database clock.
 * Returns with *outcome set (and *got the row when this claim acquired it), or an
 * error. */
static idem_code claim_existing(pool_slot *c, const idem_claim_req *req, const pg_args *a,
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
    if (expired && expired_answers(&cur, req, outcome, rec)) {
        return IDEM_OK;
    }
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
    /* A takeover re-runs the same call, paid for by the token the row kept, which a
     * release gives back: another token is checked, consumes nothing and never replaces
     * the kept one. Otherwise the claim's token is consumed and kept. */
    bool keeps = took_over && !PQgetisnull(r, 0, 5);
    bool kept = keeps && req->token != NULL && strcmp(PQgetvalue(r, 0, 5), req->token) == 0;
    PQclear(r);
    uint64_t expires;
    if (req->token != NULL && !kept &&
        (code = keeps ? token_take(c, req->token, req->key.caller, &expires, S_TOKEN_CHECK)
                      : token_take_keep(c, req, a)) != IDEM_OK) {
        return code;
    }
    *outcome = took_over ? IDEM_CLAIM_TAKEN_OVER : IDEM_CLAIM_ACQUIRED;
    return IDEM_OK;
}

/* The claim's insert; for a store-assigned owner with the fence drawn in the same round
 * trip (S_CLAIM_FENCE). *inserted when the row is this claim's (then in *got). */
static idem_code claim_insert(pool_slot *c, const idem_claim_req *req, const pg_args *a,
                              bool *inserted, idem_record *got)
{
    idem_code code = IDEM_OK;
    PGresult *r, *f = NULL;
    pg_args key = *a;
    key.n = 3;
    arg_i64(&key, req->tombstone_ttl_ms != 0); /* S_CLAIM_FENCE's $4 */
    if (req->owner != 0) {
        r = idem__pg_exec(c, S_CLAIM_INSERT, a, PGRES_TUPLES_OK, &code);
    } else if ((code = idem__pg_exec_pair(c, S_CLAIM_INSERT, a, S_CLAIM_FENCE, &key, &r, &f)) !=
               IDEM_OK) {
        r = NULL;
    }
    if (r == NULL) {
        return code;
    }
    *inserted = PQntuples(r) == 1; /* the unique key decided */
    if (*inserted && f == NULL && req->tombstone_ttl_ms == 0) {
        key.n = 3; /* an owner of the caller's: the key's tombstone goes as S_CLAIM_FENCE's */
        code = idem__pg_run(c, S_TOMB_DEL, &key, PGRES_COMMAND_OK);
    }
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

idem_code idem__pg_claim_in_txn(pool_slot *c, const idem_claim_req *req,
                                idem_claim_outcome *outcome, idem_record *rec, idem_record *got)
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
    bool decided = false;
    if (req->tombstone_ttl_ms != 0 &&
        ((code = idem__pg_tomb_claim(c, req, got->now_ms, outcome, rec, &decided)) != IDEM_OK ||
         decided)) {
        return code; /* the key's tombstone answered: the row is deleted again */
    }
    if (req->token != NULL && (code = token_take_keep(c, req, &a)) != IDEM_OK) {
        return code;
    }
    *outcome = IDEM_CLAIM_ACQUIRED;
    return IDEM_OK;
}

/* Runs fn in a transaction on a pooled connection, with the store's bounds made
 * transaction-local (so that they hold through a pooler too): COMMIT when it returns
 * IDEM_OK, else ROLLBACK (keeping fn's error detail). *unknown when the COMMIT was sent
 * and its answer lost: the transaction may or may not have committed. */
static idem_code pooled_txn(pg_store *st, idem_code (*fn)(pool_slot *c, void *arg), void *arg,
                            bool *unknown)
{
    pool_slot *pc;
    *unknown = false;
    idem_code code = idem__pg_pool_get(st, &pc);
    if (code != IDEM_OK) {
        return code;
    }
    if ((code = idem__pg_exec_simple(pc, st->txn_sql)) == IDEM_OK) {
        code = fn(pc, arg);
        if (code == IDEM_OK) {
            code = idem__pg_exec_simple(pc, "COMMIT");
            *unknown = code != IDEM_OK && (pc->dead || PQstatus(pc->c) != CONNECTION_OK);
        } else {
            idem_errkeep keep;
            idem__err_keep(&keep);
            idem__pg_exec_simple(pc, "ROLLBACK");
            idem__err_put(&keep, code);
        }
    }
    idem__pg_pool_put(st, pc);
    return code;
}

/* The commit of a txn that wrote WAL is flushed: that covers the WAL of every draw made
 * before it, and with synchronous_commit on it waits for the synchronous standbys too.
 * The txn writes one transactional logical message (a WAL record, no table; logical
 * decoding plugins may see it). An xid alone is not enough: a txn with an xid and no WAL
 * of its own writes its commit record but does not flush it (txid_current() flushes
 * nothing). No statement_timeout: a cancelled wait for the standbys ends in a COMMIT
 * "committed locally" that reports success; the client's bound on the slot cuts it off
 * instead (UNAVAILABLE). */
#define FENCES_FLUSH                                                                               \
    "BEGIN; SET LOCAL statement_timeout = 0; SET LOCAL synchronous_commit = on;"                   \
    " SELECT pg_logical_emit_message(true, 'idemrpc', 'fence'); COMMIT"

/* FENCES_FLUSH on st->fence_slot; once more on a new connection when the server had
 * closed it since its last use (a restart): a flush repeated flushes nothing twice. */
static idem_code flush_on_slot(pg_store *st)
{
    idem_code code;
    bool closed = false;
    for (int tries = 0; tries == 0 || (closed && tries < 2); tries++) {
        pool_slot *pc;
        if ((code = idem__pg_fence_slot_get(st, &pc)) == IDEM_OK) {
            code = idem__pg_query_named(pc, "fence flush", FENCES_FLUSH, NULL);
            closed = code != IDEM_OK && pc->c != NULL && PQstatus(pc->c) == CONNECTION_BAD;
        }
        idem__pg_fence_slot_put(pc);
    }
    return code;
}

/* On a connection of its own (st->fence_slot), so that it never waits for a pooled one
 * that handlers hold. Concurrent callers share flushes: one that began after this call
 * did (numbered past what it saw on arrival, so after its draw) and succeeded covers
 * it. */
idem_code idem__pg_fences_flush(pg_store *st)
{
    uint64_t seen = __atomic_load_n(&st->fence_flushes, __ATOMIC_SEQ_CST);
    idem_code code = IDEM_OK;
    pthread_mutex_lock(&st->fence_mu);
    if (st->fence_flushed <= seen) {
        uint64_t n = __atomic_add_fetch(&st->fence_flushes, 1, __ATOMIC_SEQ_CST);
        if ((code = flush_on_slot(st)) == IDEM_OK) {
            st->fence_flushed = n;
        }
    }
    pthread_mutex_unlock(&st->fence_mu);
    return code;
}

typedef struct claim_call {
    const idem_claim_req *req;
    idem_claim_outcome *outcome;
    idem_record *rec, got;
} claim_call;

static idem_code claim_fn(pool_slot *c, void *arg)
{
    claim_call *a = arg;
    return idem__pg_claim_in_txn(c, a->req, a->outcome, a->rec, &a->got);
}

/* A claim whose COMMIT went unanswered: it took effect exactly when the row now holds
 * the owner it drew, IN_PROGRESS. Asked (retrying a lost connection for reconnect_ms)
 * before anything is answered or run, and its lease started again, since the claim is
 * older than its lease says; IDEM_UNAVAILABLE when it cannot be told. */
static idem_code claim_committed(pg_store *st, const idem_claim_req *req, uint64_t owner,
                                 bool *committed)
{
    pg_args a = {0};
    PGresult *r;
    arg_key(&a, &req->key);
    arg_i64(&a, owner);
    arg_i64(&a, req->lease_until_ms - req->now_ms);
    idem_code code = idem__pg_exec_pooled(st, S_CLAIM_CONFIRM, &a, PGRES_TUPLES_OK, &r);
    if (code == IDEM_OK) {
        *committed = PQntuples(r) == 1;
        PQclear(r);
    }
    return code;
}

idem_code idem__pg_claim(idem_store *base, const idem_claim_req *req, idem_claim_outcome *outcome,
                         idem_record *rec)
{
    pg_store *st = (pg_store *)base;
    for (int tries = 0;; tries++) {
        claim_call a = {.req = req, .outcome = outcome, .rec = rec};
        bool unknown, committed = false;
        *outcome = 0;
        idem_code code = pooled_txn(st, claim_fn, &a, &unknown);
        bool mine = *outcome == IDEM_CLAIM_ACQUIRED || *outcome == IDEM_CLAIM_TAKEN_OVER;
        if (unknown && mine) {
            idem_errkeep keep;
            idem__err_keep(&keep);
            if (claim_committed(st, req, a.got.owner, &committed) != IDEM_OK) {
                return idem__err_put(&keep, code); /* cannot tell: the client retries */
            }
            code = committed ? IDEM_OK : code;
        } else if (unknown && *outcome != 0) {
            code = IDEM_OK; /* only read: the commit of nothing does not matter */
        }
        if (code == IDEM_OK && rec != NULL && mine) {
            *rec = a.got;
        }
        if (code == IDEM_OK || !unknown || tries > 0) {
            return code; /* a claim that did not commit is tried once more */
        }
    }
}

typedef struct token_call {
    const char *token, *scope;
} token_call;

static idem_code token_fn(pool_slot *c, void *arg)
{
    token_call *a = arg;
    uint64_t expires;
    return token_take(c, a->token, a->scope, &expires, S_TOKEN_TAKE);
}

/* A consumption whose COMMIT went unanswered is reported UNAVAILABLE: the token may be
 * spent (a retry then hears "unknown or already used"). */
idem_code idem__pg_token_consume(idem_store *base, const char *token, const char *scope,
                                 uint64_t now_ms)
{
    (void)now_ms; /* the database clock decides */
    token_call a = {token, scope};
    bool unknown;
    return pooled_txn((pg_store *)base, token_fn, &a, &unknown);
}
