/* idem_store: argument checks shared by every backend, then dispatch to its ops. */
#include <stdlib.h>
#include <string.h>

#include "store.h"

idem_code idem__key_check(const idem_key_ref *ref)
{
    size_t lc = ref->caller != NULL ? strlen(ref->caller) : 0;
    size_t lm = ref->method != NULL ? strlen(ref->method) : 0;
    size_t lk = ref->key != NULL ? strlen(ref->key) : 0;
    if (lc > IDEM_MAX_CALLER || lm == 0 || lm > IDEM_MAX_METHOD || lk == 0 || lk > IDEM_MAX_KEY) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "key out of bounds (caller %zu/%d, method %zu/%d, key %zu/%d bytes)", lc,
                         IDEM_MAX_CALLER, lm, IDEM_MAX_METHOD, lk, IDEM_MAX_KEY);
    }
    return IDEM_OK;
}

uint64_t idem__key_hash64(const idem_key_ref *key)
{
    uint64_t h = 14695981039346656037ull;
    const char *parts[] = {key->caller != NULL ? key->caller : "", key->method, key->key};
    for (size_t i = 0; i < 3; i++) {
        for (const unsigned char *p = (const unsigned char *)parts[i];; p++) {
            h = (h ^ *p) * 1099511628211ull;
            if (*p == '\0') {
                break;
            }
        }
    }
    return h;
}

uint32_t idem__key_hash(const idem_key_ref *key)
{
    uint64_t h = idem__key_hash64(key);
    return (uint32_t)(h ^ (h >> 32));
}

static idem_code token_check(const char *token, const char *scope)
{
    size_t tl = token != NULL ? strlen(token) : 0;
    if (tl == 0 || tl > IDEM_MAX_TOKEN || (scope != NULL && strlen(scope) > IDEM_MAX_CALLER)) {
        return idem__err(IDEM_INVALID_ARGUMENT, "token or scope out of bounds");
    }
    return IDEM_OK;
}

void idem_store_close(idem_store *st)
{
    if (st != NULL) {
        st->ops->close(st);
    }
}

/* What every claim checks before the store sees it: the key's bounds, the token's form. */
static idem_code claim_check(const idem_claim_req *req)
{
    idem_code code = idem__key_check(&req->key);
    if (code == IDEM_OK && req->token != NULL &&
        token_check(req->token, req->key.caller) != IDEM_OK) {
        code = idem__err(IDEM_FAILED_PRECONDITION, "token unknown");
    }
    return code;
}

/* idem_store_claim, shared when ticket is not NULL and the store can. */
static idem_code claim(idem_store *st, const idem_claim_req *req, idem_claim_outcome *outcome,
                       idem_record *rec, uint64_t *ticket)
{
    idem_code code;
    if (rec != NULL) {
        memset(rec, 0, sizeof(*rec));
    }
    if (ticket != NULL) {
        *ticket = 0;
    }
    if (req->owner == 0 && rec == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "a store-assigned owner (0) needs rec");
    }
    if ((code = claim_check(req)) != IDEM_OK) {
        return code;
    }
    code = ticket != NULL && st->ops->claim_shared != NULL
               ? st->ops->claim_shared(st, req, outcome, rec, ticket)
               : st->ops->claim(st, req, outcome, rec);
    if (code != IDEM_OK) {
        idem_record_clear(rec); /* e.g. the commit failed after a replay was read */
    }
    return code;
}

idem_code idem_store_claim(idem_store *st, const idem_claim_req *req, idem_claim_outcome *outcome,
                           idem_record *rec)
{
    return claim(st, req, outcome, rec, NULL);
}

idem_code idem__store_claim_shared(idem_store *st, const idem_claim_req *req,
                                   idem_claim_outcome *outcome, idem_record *rec, uint64_t *ticket)
{
    return claim(st, req, outcome, rec, ticket);
}

idem_code idem__store_claim_shared_async(idem_store *st, const idem_claim_req *req,
                                         idem__store_claimed_fn done, void *arg)
{
    if (st->ops->claim_shared_async == NULL || req->owner != 0) {
        return idem__err(IDEM_UNAVAILABLE, "no asynchronous claim here");
    }
    idem_code code = claim_check(req);
    return code != IDEM_OK ? code : st->ops->claim_shared_async(st, req, done, arg);
}

idem_code idem__store_complete_at(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                  const void *response, size_t len, uint64_t expires_ms,
                                  uint64_t now_ms, uint64_t ticket)
{
    idem_code code = idem__key_check(key);
    if (code != IDEM_OK) {
        idem__store_ticket_drop(st, ticket);
        return code;
    }
    return st->ops->complete(st, key, owner, response, len, expires_ms, now_ms, ticket);
}

idem_code idem__store_release_shared(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                     uint64_t ticket)
{
    idem_code code = idem__key_check(key);
    if (code != IDEM_OK) {
        idem__store_ticket_drop(st, ticket);
        return code;
    }
    return st->ops->release(st, key, owner, ticket);
}

idem_code idem__store_complete_async(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                     void *response, size_t len, uint64_t expires_ms,
                                     uint64_t ticket, idem__store_done_fn done, void *arg)
{
    if (ticket == 0 || st->ops->complete_async == NULL) {
        return idem__err(IDEM_UNAVAILABLE, "no asynchronous completion here");
    }
    return st->ops->complete_async(st, key, owner, response, len, expires_ms, ticket, done, arg);
}

void idem__store_ticket_drop(idem_store *st, uint64_t ticket)
{
    if (ticket != 0) {
        st->ops->ticket_drop(st, ticket);
    }
}

void idem__store_ticket_wait(idem_store *st, uint64_t ticket)
{
    if (ticket != 0) {
        st->ops->ticket_wait(st, ticket);
    }
}

idem_code idem__store_claim_durable(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                    uint64_t ticket)
{
    if (ticket == 0) {
        return IDEM_OK; /* committed before the handler ran */
    }
    st->ops->ticket_wait(st, ticket);
    idem_record rec;
    idem_code code = idem_store_get(st, key, &rec);
    bool ours = code == IDEM_OK && rec.state == IDEM_REC_IN_PROGRESS && rec.owner == owner;
    idem_record_clear(&rec);
    if (ours) {
        return IDEM_OK;
    }
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return idem__err(IDEM_UNAVAILABLE, "the claim could not be read back: %s", idem_errmsg());
    }
    return idem__err(IDEM_UNAVAILABLE, "the claim did not reach the disk (its commit failed)");
}

idem_code idem_store_complete(idem_store *st, const idem_key_ref *key, uint64_t owner,
                              const void *response, size_t len, uint64_t expires_ms)
{
    return idem__store_complete_at(st, key, owner, response, len, expires_ms, idem__now_ms(), 0);
}

idem_code idem_store_renew(idem_store *st, const idem_key_ref *key, uint64_t owner,
                           uint64_t lease_until_ms, uint64_t now_ms)
{
    idem_code code = idem__key_check(key);
    return code != IDEM_OK ? code : st->ops->renew(st, key, owner, lease_until_ms, now_ms);
}

idem_code idem__store_renew_batch(idem_store *st, idem__renewal *r, size_t n)
{
    if (st->ops->renew_batch != NULL) {
        return st->ops->renew_batch(st, r, n);
    }
    for (size_t i = 0; i < n; i++) {
        r[i].code = idem_store_renew(st, &r[i].key, r[i].owner, r[i].lease_until_ms, r[i].now_ms);
    }
    return IDEM_OK;
}

idem_code idem_store_release(idem_store *st, const idem_key_ref *key, uint64_t owner)
{
    return idem__store_release_shared(st, key, owner, 0);
}

idem_code idem_store_get(idem_store *st, const idem_key_ref *key, idem_record *rec)
{
    memset(rec, 0, sizeof(*rec));
    idem_code code = idem__key_check(key);
    return code != IDEM_OK ? code : st->ops->get(st, key, rec);
}

idem_code idem__store_get_borrowed(idem_store *st, const idem_key_ref *key, idem_record *rec,
                                   idem_borrow *borrow)
{
    memset(rec, 0, sizeof(*rec));
    borrow->end = NULL;
    idem_code code = idem__key_check(key);
    if (code != IDEM_OK) {
        return code;
    }
    return st->ops->get_borrowed != NULL ? st->ops->get_borrowed(st, key, rec, borrow)
                                         : st->ops->get(st, key, rec);
}

idem_code idem_store_delete(idem_store *st, const idem_key_ref *key)
{
    idem_code code = idem__key_check(key);
    return code != IDEM_OK ? code : st->ops->del(st, key);
}

idem_code idem_store_sweep(idem_store *st, uint64_t now_ms, size_t max, size_t *deleted)
{
    *deleted = 0;
    return st->ops->sweep(st, now_ms, max, deleted);
}

idem_code idem__store_token_put_at(idem_store *st, const char *token, const char *scope,
                                   uint64_t expires_ms, uint64_t now_ms)
{
    idem_code code = token_check(token, scope);
    return code != IDEM_OK
               ? code
               : st->ops->token_put(st, token, scope != NULL ? scope : "", expires_ms, now_ms);
}

idem_code idem_store_token_put(idem_store *st, const char *token, const char *scope,
                               uint64_t expires_ms)
{
    return idem__store_token_put_at(st, token, scope, expires_ms, idem__now_ms());
}

idem_code idem_store_token_consume(idem_store *st, const char *token, const char *scope,
                                   uint64_t now_ms)
{
    if (token_check(token, scope) != IDEM_OK) {
        return idem__err(IDEM_FAILED_PRECONDITION, "token unknown");
    }
    return st->ops->token_consume(st, token, scope != NULL ? scope : "", now_ms);
}

idem_code idem_store_stats_get(idem_store *st, idem_store_stats *out)
{
    memset(out, 0, sizeof(*out));
    return st->ops->stats(st, out);
}

idem_code idem_store_foreach(idem_store *st, idem_store_visit_fn fn, void *arg)
{
    return st->ops->foreach (st, fn, arg);
}

const char *idem_store_backend(const idem_store *st)
{
    return st->ops->name;
}

void idem_record_clear(idem_record *rec)
{
    if (rec != NULL) {
        free(rec->response);
        rec->response = NULL;
        rec->response_len = 0;
    }
}

bool idem__store_has(const idem_store *st, unsigned cap)
{
    return (st->ops->caps & cap) == cap;
}

/* ---- handler transactions, on backends with IDEM__STORE_CAP_TXN ---- */

idem_code idem__store_txn_begin_idle(idem_store *st, uint64_t idle_ms, idem_txn **out)
{
    *out = NULL;
    if (!idem__store_has(st, IDEM__STORE_CAP_TXN)) {
        return idem__err(IDEM_UNIMPLEMENTED, "the %s store has no handler transactions",
                         st->ops->name);
    }
    return st->ops->txn_begin(st, idle_ms, out);
}

idem_code idem__store_txn_begin(idem_store *st, idem_txn **out)
{
    return idem__store_txn_begin_idle(st, 0, out);
}

static const idem_store_ops *ops_of(const idem_txn *t)
{
    return ((const idem_txn_head *)t)->ops;
}

bool idem__store_txn_broken(const idem_txn *t)
{
    return ops_of(t)->txn_broken != NULL && ops_of(t)->txn_broken(t);
}

void idem__store_txn_abort(idem_txn *t)
{
    ops_of(t)->txn_abort(t);
}

idem_code idem__store_txn_commit(idem_txn *t)
{
    return ops_of(t)->txn_commit(t);
}

idem_code idem__store_txn_complete_commit(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                          const void *response, size_t len, uint64_t expires_ms,
                                          uint64_t now_ms)
{
    idem_code code = idem__key_check(ref);
    if (code != IDEM_OK) {
        idem__store_txn_abort(t);
        return code;
    }
    return ops_of(t)->txn_complete_commit(t, ref, owner, response, len, expires_ms, now_ms);
}

idem_code idem__store_txn_claim(idem_txn *t, const idem_claim_req *req, idem_claim_outcome *outcome,
                                idem_record *rec)
{
    memset(rec, 0, sizeof(*rec));
    idem_code code = idem__key_check(&req->key);
    if (code == IDEM_OK && req->token != NULL &&
        token_check(req->token, req->key.caller) != IDEM_OK) {
        return idem__err(IDEM_FAILED_PRECONDITION, "token unknown");
    }
    if (code != IDEM_OK) {
        return code;
    }
    if (ops_of(t)->txn_claim == NULL) {
        return idem__err(IDEM_UNIMPLEMENTED, "the %s store claims outside handler txns",
                         ops_of(t)->name);
    }
    if ((code = ops_of(t)->txn_claim(t, req, outcome, rec)) != IDEM_OK) {
        idem_record_clear(rec);
    }
    return code;
}

idem_code idem__store_txn_undo(idem_txn *t)
{
    return ops_of(t)->txn_undo(t);
}

idem_code idem__store_txn_fence_durable(idem_txn *t)
{
    return ops_of(t)->txn_fence_durable != NULL ? ops_of(t)->txn_fence_durable(t) : IDEM_OK;
}

/* ---- business key-value data (txn.h), on backends with IDEM__STORE_CAP_TXN ---- */

idem_code idem__app_check(const char *db, size_t klen)
{
    size_t n = db != NULL ? strlen(db) : 0;
    if (n == 0 || n > IDEM_MAX_DB_NAME) {
        return idem__err(IDEM_INVALID_ARGUMENT, "database name must be 1..%d bytes",
                         IDEM_MAX_DB_NAME);
    }
    if (klen == 0 || klen > IDEM__APP_MAX_KEY) {
        return idem__err(IDEM_INVALID_ARGUMENT, "key must be 1..%d bytes", IDEM__APP_MAX_KEY);
    }
    return IDEM_OK;
}

idem_code idem_txn_get(idem_txn *t, const char *db, const void *key, size_t klen, const void **val,
                       size_t *vlen)
{
    idem_code code = idem__app_check(db, klen);
    return code != IDEM_OK ? code : ops_of(t)->txn_get(t, db, key, klen, val, vlen);
}

idem_code idem_txn_put(idem_txn *t, const char *db, const void *key, size_t klen, const void *val,
                       size_t vlen)
{
    idem_code code = idem__app_check(db, klen);
    return code != IDEM_OK ? code : ops_of(t)->txn_put(t, db, key, klen, val, vlen);
}

idem_code idem_txn_del(idem_txn *t, const char *db, const void *key, size_t klen)
{
    idem_code code = idem__app_check(db, klen);
    return code != IDEM_OK ? code : ops_of(t)->txn_del(t, db, key, klen);
}

idem_code idem_store_app_get(idem_store *st, const char *db, const void *key, size_t klen,
                             void **val, size_t *vlen)
{
    *val = NULL;
    *vlen = 0;
    idem_code code = idem__app_check(db, klen);
    if (code == IDEM_OK && !idem__store_has(st, IDEM__STORE_CAP_TXN)) {
        code =
            idem__err(IDEM_UNIMPLEMENTED, "the %s store has no business databases", st->ops->name);
    }
    return code != IDEM_OK ? code : st->ops->app_get(st, db, key, klen, val, vlen);
}

idem_code idem__store_txn_get_bounded(idem_txn *t, const char *db, const void *key, size_t klen,
                                      const void **val, size_t *vlen)
{
    if (ops_of(t)->txn_get_bounded == NULL) {
        return idem_txn_get(t, db, key, klen, val, vlen);
    }
    idem_code code = idem__app_check(db, klen);
    return code != IDEM_OK ? code : ops_of(t)->txn_get_bounded(t, db, key, klen, val, vlen);
}

idem_code idem__store_txn_record(idem_txn *t, const idem_key_ref *key, idem_record *rec)
{
    memset(rec, 0, sizeof(*rec));
    idem_code code = idem__key_check(key);
    return code != IDEM_OK ? code : ops_of(t)->txn_record(t, key, rec);
}

void idem__app_entry_clear(idem_app_entry *e)
{
    free(e->key);
    free(e->val);
    memset(e, 0, sizeof(*e));
}

idem_code idem__store_app_next(idem_store *st, const char *db, const void *after, size_t alen,
                               idem_app_entry *out)
{
    memset(out, 0, sizeof(*out));
    idem_code code = idem__app_check(db, alen);
    if (code == IDEM_OK && !idem__store_has(st, IDEM__STORE_CAP_TXN)) {
        code =
            idem__err(IDEM_UNIMPLEMENTED, "the %s store has no business databases", st->ops->name);
    }
    return code != IDEM_OK ? code : st->ops->app_next(st, db, after, alen, out);
}

/* ---- completion announcements ---- */

idem_code idem__store_watch(idem_store *st, idem__store_watch_fn fn, void *arg)
{
    return idem__store_has(st, IDEM__STORE_CAP_WATCH) ? st->ops->watch(st, fn, arg) : IDEM_OK;
}

void idem__store_unwatch(idem_store *st, idem__store_watch_fn fn, void *arg)
{
    if (idem__store_has(st, IDEM__STORE_CAP_WATCH)) {
        st->ops->unwatch(st, fn, arg);
    }
}
