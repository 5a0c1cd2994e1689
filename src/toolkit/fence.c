/* Fencing: the store refuses a txn of a lock holder that a newer holder has superseded.
 *
 * IDEM_FENCE_DB holds, per lock, scope \0 name → be64 highest token fenced. Tokens are the
 * lock's claim owners, from the store's one increasing counter, so "older holder" is
 * "smaller token". The check and the raise are one read and at most one write in the
 * caller's txn: on LMDB the txn holds the only writer; on PostgreSQL the read locks the
 * row (txn.c), so two fenced txns of one lock run one after the other and the second
 * sees the first's token. */
#include <string.h>

#include "lock_internal.h"

#define FENCE_KEY_MAX (IDEM_MAX_CALLER + 1 + IDEM_LOCK_MAX_NAME)

idem_code idem_txn_fence(idem_txn *t, const char *scope, const char *name, uint64_t token)
{
    uint8_t key[FENCE_KEY_MAX], val[8];
    const void *v;
    size_t vlen;
    idem_code code = idem__lock_names_check(scope, name);
    if (code != IDEM_OK) {
        return code;
    }
    if (t == NULL || token == 0) {
        return idem__err(IDEM_INVALID_ARGUMENT, "fence needs a txn and a lock's token (not 0)");
    }
    size_t ls = scope != NULL ? strlen(scope) : 0, ln = strlen(name);
    memcpy(key, scope != NULL ? scope : "", ls);
    key[ls] = 0;
    memcpy(key + ls + 1, name, ln);
    size_t klen = ls + 1 + ln;
    uint64_t highest = 0;
    code = idem_txn_get(t, IDEM_FENCE_DB, key, klen, &v, &vlen);
    if (code == IDEM_OK && vlen != sizeof(val)) {
        return idem__err(IDEM_DATA_LOSS, "fence of lock \"%s\" has a bad value", name);
    }
    if (code == IDEM_OK) {
        highest = idem__get_be64(v);
    } else if (code != IDEM_NOT_FOUND) {
        return code;
    }
    if (token < highest) {
        return idem__err(IDEM_ABORTED,
                         "fenced: token %llu of lock \"%s\" is older than %llu, a newer holder's "
                         "that has written",
                         (unsigned long long)token, name, (unsigned long long)highest);
    }
    if (token == highest) {
        return IDEM_OK; /* the same holder again */
    }
    idem__put_be64(val, token);
    return idem_txn_put(t, IDEM_FENCE_DB, key, klen, val, sizeof(val));
}

idem_code idem_txn_fence_lock(idem_txn *t, const idem_lock *lock)
{
    if (lock == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "fence needs a lock");
    }
    return idem_txn_fence(t, idem_lock_scope(lock), idem_lock_name(lock), idem_lock_token(lock));
}

/* The fence of the claim a handler runs under (chain.h), read back from the store once
 * (idem__store_claim_durable). */
idem_code idem_call_durable_fence(idem_call *call, uint64_t *fence)
{
    *fence = 0;
    if (call->fence_state == IDEM__FENCE_REFUSED) {
        return idem__err(IDEM_UNAVAILABLE, "fence refused: the claim did not reach the disk");
    }
    /* A claim sharing its commit with the completion may not be on disk yet, nor one in
     * the handler's open txn (PostgreSQL): a fence that leaves the process must be, or a
     * crash (or a failed commit, whose counter rolls back) would hand it out again. Made
     * durable, or read back, once; then it stays on disk. */
    if (call->fence != 0 && call->fence_state == IDEM__FENCE_UNCHECKED) {
        idem_key_ref key = {idem_call_caller(call), call->method->name, call->key};
        idem_code code = call->txn != NULL ? idem__store_txn_fence_durable(call->txn) : IDEM_OK;
        if (code == IDEM_OK) {
            code =
                idem__store_claim_durable(call->claim_store, &key, call->fence, call->claim_ticket);
        }
        call->fence_state = code == IDEM_OK ? IDEM__FENCE_DURABLE : IDEM__FENCE_REFUSED;
        if (code != IDEM_OK) {
            return idem__err(code, "fence refused: %s", idem_errmsg());
        }
    }
    *fence = call->fence;
    return IDEM_OK;
}

uint64_t idem_call_fence(const idem_call *call)
{
    uint64_t fence;
    /* The call is the handler's, never a constant object: the read-back is cached in it. */
    return idem_call_durable_fence((idem_call *)call, &fence) == IDEM_OK ? fence : 0;
}
