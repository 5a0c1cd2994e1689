/* Journaled steps (downstream.h): a step's output recorded once per call, bound to the
 * call's claim by its fence.
 *
 * Business database "idem.steps" (both stores, through idem_txn_*):
 *   'f' base          → be64 fence     the newest owner that recorded a step of the call
 *   's' H(base, step) → output         one per recorded step
 * where base = SHA-256(len-prefixed caller, method, key, request fingerprint): a
 * different request under a reused key never sees another request's steps. A record
 * txn refuses a fence older than the stored one (IDEM_ABORTED): a run that lost its
 * claim cannot overwrite the new owner's journal. The call remembers the steps it used
 * and result_cache deletes them once the outcome is recorded. */
#include <stdlib.h>
#include <string.h>

#include "call.h"

#include "idemrpc/downstream.h"
#include "idemrpc/toolkit.h"

#define STEPS_DB "idem.steps"
#define JKEY 33

static bool sha(const void *const *parts, const size_t *lens, size_t n, uint8_t out[32])
{
    return idem__sha256(parts, lens, n, out);
}

static idem_code journal_base(idem_call *call, uint8_t base[32])
{
    uint8_t fp[IDEM_FINGERPRINT_LEN], len_be[3][4];
    const char *parts[3] = {idem_call_caller(call), call->req->method, call->key};
    const void *p[7];
    size_t lens[7];
    idem_code code = idem__call_fingerprint(call, fp);
    if (code != IDEM_OK) {
        return code;
    }
    for (int i = 0; i < 3; i++) {
        uint32_t n = (uint32_t)strlen(parts[i]);
        idem__put_be32(len_be[i], n);
        p[2 * i] = len_be[i];
        lens[2 * i] = 4;
        p[2 * i + 1] = parts[i];
        lens[2 * i + 1] = n;
    }
    p[6] = fp;
    lens[6] = sizeof(fp);
    return sha(p, lens, 7, base) ? IDEM_OK : idem__err(IDEM_INTERNAL, "sha256 failed");
}

static idem_code step_key(const uint8_t base[32], const char *step, uint8_t out[JKEY])
{
    out[0] = 's';
    bool ok =
        sha((const void *const[]){base, step}, (const size_t[]){32, strlen(step)}, 2, out + 1);
    return ok ? IDEM_OK : idem__err(IDEM_INTERNAL, "sha256 failed");
}

/* Remembers a step key for the clean-up at completion (once per key). */
static idem_code remember(idem_call *call, const uint8_t key[JKEY])
{
    for (size_t i = 0; i < call->n_steps; i++) {
        if (memcmp(call->steps[i], key, JKEY) == 0) {
            return IDEM_OK;
        }
    }
    if (call->n_steps == IDEM_MAX_STEPS) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "at most %d steps per call", IDEM_MAX_STEPS);
    }
    if (call->steps == NULL && (call->steps = malloc(IDEM_MAX_STEPS * JKEY)) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    memcpy(call->steps[call->n_steps++], key, JKEY);
    return IDEM_OK;
}

typedef struct record_args {
    uint8_t fence_key[JKEY], step_key[JKEY];
    uint64_t fence;
    const void *data;
    size_t len;
} record_args;

static idem_code record_txn(idem_txn *t, void *arg)
{
    record_args *a = arg;
    const void *v;
    size_t n;
    uint8_t fence[8];
    idem_code code = idem_txn_get(t, STEPS_DB, a->fence_key, JKEY, &v, &n);
    if (code == IDEM_OK && n == 8 && idem__get_be64(v) > a->fence) {
        return idem__err(IDEM_ABORTED, "claim lost: a newer run of this call owns its steps; "
                                       "retry with the same key");
    }
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    idem__put_be64(fence, a->fence);
    if ((code = idem_txn_put(t, STEPS_DB, a->fence_key, JKEY, fence, 8)) != IDEM_OK) {
        return code;
    }
    return idem_txn_put(t, STEPS_DB, a->step_key, JKEY, a->data != NULL ? a->data : "", a->len);
}

void idem_step_result_clear(idem_step_result *r)
{
    if (r != NULL) {
        free(r->data);
        memset(r, 0, sizeof(*r));
    }
}

static idem_code step_check(const idem_call *call, const char *step, idem_step_fn fn)
{
    if (call == NULL || fn == NULL || !idem__step_name_ok(step)) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "a step needs a call, a function and a name of 1..%d bytes of "
                         "[A-Za-z0-9._-]",
                         IDEM_MAX_STEP);
    }
    if (call->txn != NULL) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "steps are for claim-mode handlers: a transactional handler's writes "
                         "already commit together");
    }
    if (call->claim_store == NULL || call->key_source == IDEM_KEY_NONE) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "steps need the call's claim: register %s as cached with a key",
                         call->req->method);
    }
    return IDEM_OK;
}

idem_code idem_call_step(idem_call *call, const char *step, idem_step_fn fn, void *arg,
                         idem_step_result *out)
{
    record_args a = {.fence = call != NULL ? call->fence : 0};
    uint8_t base[32];
    void *v;
    size_t n;
    memset(out, 0, sizeof(*out));
    idem_code code = step_check(call, step, fn);
    if (code != IDEM_OK || (code = journal_base(call, base)) != IDEM_OK ||
        (code = step_key(base, step, a.step_key)) != IDEM_OK) {
        return code;
    }
    a.fence_key[0] = 'f';
    memcpy(a.fence_key + 1, base, 32);
    code = idem_store_app_get(call->claim_store, STEPS_DB, a.step_key, JKEY, &v, &n);
    if (code == IDEM_OK) { /* an earlier run recorded it */
        out->data = v;
        out->len = n;
        out->replayed = true;
        return remember(call, a.step_key);
    }
    if (code != IDEM_NOT_FOUND || (code = remember(call, a.step_key)) != IDEM_OK) {
        return code;
    }
    if ((code = fn(call, arg, out)) != IDEM_OK) {
        idem_step_result_clear(out);
        return code;
    }
    if (out->len > IDEM_MAX_STEP_OUTPUT) {
        idem_step_result_clear(out);
        return idem__err(IDEM_INVALID_ARGUMENT, "step output over %d bytes", IDEM_MAX_STEP_OUTPUT);
    }
    a.data = out->data;
    a.len = out->len;
    if ((code = idem_store_run_txn(call->claim_store, record_txn, &a)) != IDEM_OK) {
        idem_step_result_clear(out);
    }
    return code;
}

typedef struct forget_args {
    const idem_call *call;
    const uint8_t *fence_key;
} forget_args;

static idem_code forget_txn(idem_txn *t, void *arg)
{
    forget_args *a = arg;
    for (size_t i = 0; i < a->call->n_steps; i++) {
        idem_code code = idem_txn_del(t, STEPS_DB, a->call->steps[i], JKEY);
        if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
            return code;
        }
    }
    idem_code code = idem_txn_del(t, STEPS_DB, a->fence_key, JKEY);
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

idem_code idem__call_steps_forget(idem_call *call)
{
    uint8_t base[32], fence_key[JKEY];
    if (call->n_steps == 0 || call->claim_store == NULL) {
        return IDEM_OK;
    }
    idem_code code = journal_base(call, base);
    if (code != IDEM_OK) {
        return code;
    }
    fence_key[0] = 'f';
    memcpy(fence_key + 1, base, 32);
    forget_args a = {call, fence_key};
    return idem_store_run_txn(call->claim_store, forget_txn, &a);
}
