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

idem_code idem_store_claim(idem_store *st, const idem_claim_req *req, idem_claim_outcome *outcome,
                           idem_record *rec)
{
    idem_code code;
    if (rec != NULL) {
        memset(rec, 0, sizeof(*rec));
    }
    if ((code = idem__key_check(&req->key)) != IDEM_OK) {
        return code;
    }
    if (req->owner == 0 && rec == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "a store-assigned owner (0) needs rec");
    }
    if (req->token != NULL && token_check(req->token, req->key.caller) != IDEM_OK) {
        return idem__err(IDEM_FAILED_PRECONDITION, "token unknown");
    }
    code = st->ops->claim(st, req, outcome, rec);
    if (code != IDEM_OK) {
        idem_record_clear(rec); /* e.g. the commit failed after a replay was read */
    }
    return code;
}

idem_code idem__store_complete_at(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                  const void *response, size_t len, uint64_t expires_ms,
                                  uint64_t now_ms)
{
    idem_code code = idem__key_check(key);
    return code != IDEM_OK ? code
                           : st->ops->complete(st, key, owner, response, len, expires_ms, now_ms);
}

idem_code idem_store_complete(idem_store *st, const idem_key_ref *key, uint64_t owner,
                              const void *response, size_t len, uint64_t expires_ms)
{
    return idem__store_complete_at(st, key, owner, response, len, expires_ms, idem__now_ms());
}

idem_code idem_store_renew(idem_store *st, const idem_key_ref *key, uint64_t owner,
                           uint64_t lease_until_ms, uint64_t now_ms)
{
    idem_code code = idem__key_check(key);
    return code != IDEM_OK ? code : st->ops->renew(st, key, owner, lease_until_ms, now_ms);
}

idem_code idem_store_release(idem_store *st, const idem_key_ref *key, uint64_t owner)
{
    idem_code code = idem__key_check(key);
    return code != IDEM_OK ? code : st->ops->release(st, key, owner);
}

idem_code idem_store_get(idem_store *st, const idem_key_ref *key, idem_record *rec)
{
    memset(rec, 0, sizeof(*rec));
    idem_code code = idem__key_check(key);
    return code != IDEM_OK ? code : st->ops->get(st, key, rec);
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

idem_code idem__store_txn_begin(idem_store *st, idem_txn **out)
{
    *out = NULL;
    if (!idem__store_has(st, IDEM__STORE_CAP_TXN)) {
        return idem__err(IDEM_UNIMPLEMENTED, "the %s store has no handler transactions",
                         st->ops->name);
    }
    return st->ops->txn_begin(st, out);
}

void idem__store_txn_abort(idem_txn *t)
{
    ((const idem_txn_head *)t)->ops->txn_abort(t);
}

idem_code idem__store_txn_commit(idem_txn *t)
{
    return ((const idem_txn_head *)t)->ops->txn_commit(t);
}

idem_code idem__store_txn_complete_commit(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                          const void *response, size_t len, uint64_t expires_ms)
{
    idem_code code = idem__key_check(ref);
    if (code != IDEM_OK) {
        idem__store_txn_abort(t);
        return code;
    }
    return ((const idem_txn_head *)t)
        ->ops->txn_complete_commit(t, ref, owner, response, len, expires_ms);
}
