/* The step journal's entries (steps_internal.h; the layout is in steps.c's header):
 * their keys, the claim check of a record txn, the record and its look-up, the listing
 * entry and the journal's deletion. Below steps.c (idem_call_step), saga.c (undos) and
 * steps_redrive.c (the claim, the re-driver's writes). */
#include <stdlib.h>
#include <string.h>

#include "steps_internal.h"

#define STEPS_DB IDEM__STEPS_DB
#define JKEY IDEM__JKEY
_Static_assert(JKEY == IDEM__JOURNAL_CURSOR, "the re-driver's cursor is a journal key");
#define HEAD_MAX (8 + IDEM_MAX_STEPS * 32)

typedef idem__journal journal;

void idem__journal_of_base(const uint8_t base[32], idem__journal *j)
{
    memset(j, 0, sizeof(*j)); /* gen_key[0] 0: unknown (the re-driver's journals) */
    j->head_key[0] = 'j';
    j->step_key[0] = 's';
    j->call_key[0] = 'r';
    j->saga_key[0] = 'c';
    memcpy(j->head_key + 1, base, 32);
    memcpy(j->call_key + 1, base, 32);
    memcpy(j->saga_key + 1, base, 32);
}

/* base = SHA-256(len-prefixed caller, method, key, request fingerprint). */
bool idem__journal_base(const char *caller, const char *method, const char *key,
                        const uint8_t fp[IDEM_FINGERPRINT_LEN], uint8_t base[32])
{
    const char *parts[3] = {caller, method, key};
    return idem__lp_sha256(parts, 3, fp, IDEM_FINGERPRINT_LEN, base);
}

static idem_code journal_keys(idem_call *call, const char *step, journal *j)
{
    uint8_t fp[IDEM_FINGERPRINT_LEN], base[32], gen[32];
    const char *parts[3] = {idem_call_caller(call), call->req->method, call->key};
    idem_code code = idem__call_fingerprint(call, fp);
    if (code != IDEM_OK) {
        return code;
    }
    if (!idem__journal_base(parts[0], parts[1], parts[2], fp, base) ||
        !idem__lp_sha256(parts, 3, NULL, 0, gen)) {
        return idem__err(IDEM_INTERNAL, "sha256 failed");
    }
    idem__journal_of_base(base, j);
    if (step != NULL && !idem__sha256((const void *const[]){base, step},
                                      (const size_t[]){32, strlen(step)}, 2, j->step_key + 1)) {
        return idem__err(IDEM_INTERNAL, "sha256 failed");
    }
    j->gen_key[0] = 'g';
    memcpy(j->gen_key + 1, gen, 32);
    return IDEM_OK;
}

idem_code idem__journal_keys(idem_call *call, const char *step, idem__journal *j)
{
    return journal_keys(call, step, j);
}

/* The key's generation as this run derives with it, kept with this request's
 * fingerprint: written with the run's first record (no extra commit), rewritten only
 * when it changed (another request claimed the key). */
idem_code idem__journal_keep_generation(idem_txn *t, const idem_call *call, const idem__journal *j)
{
    const void *v;
    size_t n;
    uint8_t g[GEN_LEN];
    idem__put_be64(g, call->step_gen);
    memcpy(g + 8, call->fingerprint, IDEM_FINGERPRINT_LEN);
    idem_code code = idem_txn_get(t, IDEM__STEPS_DB, j->gen_key, IDEM__JKEY, &v, &n);
    if (code == IDEM_OK && n == GEN_LEN && memcmp(v, g, GEN_LEN) == 0) {
        return IDEM_OK;
    }
    return code == IDEM_OK || code == IDEM_NOT_FOUND
               ? idem_txn_put(t, IDEM__STEPS_DB, j->gen_key, IDEM__JKEY, g, GEN_LEN)
               : code;
}

/* Whether the request fp under call's key has a compensation marker ('c') in t. */
static idem_code compensating_in(idem_txn *t, const idem_call *call, const uint8_t *fp, bool *yes)
{
    uint8_t base[32];
    const void *v;
    size_t n;
    journal other;
    if (!idem__journal_base(idem_call_caller(call), call->req->method, call->key, fp, base)) {
        return idem__err(IDEM_INTERNAL, "sha256 failed");
    }
    idem__journal_of_base(base, &other);
    idem_code code = idem_txn_get(t, IDEM__STEPS_DB, other.saga_key, IDEM__JKEY, &v, &n);
    *yes = code == IDEM_OK;
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

/* In a claim's txn (steps_redrive.c): unless the key's generation is this request's,
 * the claim's fence becomes it (idem__call_steps_begin then reads it as this request's),
 * so that no commit of its own precedes the run's first derived key. Not while another
 * request's compensation is unfinished: its 'g' says whose the key stays (saga.c). */
idem_code idem__journal_draw_generation(idem_txn *t, const idem_call *call, const idem__journal *j,
                                        uint64_t fence)
{
    const void *v;
    size_t n;
    uint8_t g[GEN_LEN];
    bool busy = false;
    idem_code code = idem_txn_get(t, IDEM__STEPS_DB, j->gen_key, IDEM__JKEY, &v, &n);
    if (code == IDEM_OK && n == GEN_LEN &&
        memcmp((const uint8_t *)v + 8, call->fingerprint, IDEM_FINGERPRINT_LEN) == 0) {
        return IDEM_OK;
    }
    if (code == IDEM_OK && n == GEN_LEN &&
        ((code = compensating_in(t, call, (const uint8_t *)v + 8, &busy)) != IDEM_OK || busy)) {
        return code;
    }
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    idem__put_be64(g, fence);
    memcpy(g + 8, call->fingerprint, IDEM_FINGERPRINT_LEN);
    return idem_txn_put(t, IDEM__STEPS_DB, j->gen_key, IDEM__JKEY, g, GEN_LEN);
}

/* Whether the journal entry key is in the store (a read, so that a write txn is opened
 * only when there is something to write). */
idem_code idem__journal_entry_exists(idem_store *st, const uint8_t key[JKEY], bool *exists)
{
    void *v;
    size_t n;
    idem_code code = idem_store_app_get(st, STEPS_DB, key, JKEY, &v, &n);
    *exists = code == IDEM_OK;
    if (*exists) {
        free(v);
    }
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

static void put_lp16(uint8_t **p, const char *s)
{
    size_t n = strlen(s); /* every part is bounded far below 64 KiB */
    (*p)[0] = (uint8_t)(n >> 8);
    (*p)[1] = (uint8_t)n;
    memcpy(*p + 2, s, n);
    *p += 2 + n;
}

/* The 'r' entry of a call: who called, its record's key and the request itself. */
idem_code idem__journal_put_call(idem_txn *t, const idem__journal *j, const idem_call *call)
{
    const char *parts[3] = {idem_call_caller(call), call->req->method, call->key};
    size_t n = CALL_FIXED + protobuf_c_message_get_packed_size(&call->req->base);
    for (int i = 0; i < 3; i++) {
        n += 2 + strlen(parts[i]);
    }
    uint8_t *buf = malloc(n), *p = buf;
    if (buf == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    *p++ = CALL_MAGIC;
    *p++ = CALL_VERSION;
    *p++ = call->caller_verified ? CALL_VERIFIED : 0;
    *p++ = 0;                                           /* re-runs so far */
    memcpy(p, call->fingerprint, IDEM_FINGERPRINT_LEN); /* computed for the journal key */
    p += IDEM_FINGERPRINT_LEN;
    for (int i = 0; i < 3; i++) {
        put_lp16(&p, parts[i]);
    }
    protobuf_c_message_pack(&call->req->base, p);
    idem_code code = idem_txn_put(t, STEPS_DB, j->call_key, JKEY, buf, n);
    free(buf);
    return code;
}

/* IDEM_OK when the key's row for a step is JOURNAL (key_life.h): LIVE, the call's
 * record IN_PROGRESS under fence in txn t (kept so until t ends: nobody else can have
 * it), else (t NULL, before fn runs) by a plain read and with its lease still running
 * (once it has run out, a takeover may start fn again any moment). Else the run lost
 * its claim (LAPSED: run out or taken over; COMPLETED; NONE: released) and gets
 * ABORTED. */
static idem_code claim_held(idem_txn *t, idem_call *call, uint64_t fence)
{
    idem_key_ref key = {idem_call_caller(call), call->method->name, call->key};
    idem_record rec;
    idem_code code = t != NULL ? idem__store_txn_record(t, &key, &rec)
                               : idem_store_get(call->claim_store, &key, &rec);
    uint64_t now = rec.now_ms ? rec.now_ms : idem__rt_now_ms(call->rt);
    bool held = code == IDEM_OK && rec.state == IDEM_REC_IN_PROGRESS && rec.owner == fence &&
                (t != NULL || rec.lease_until_ms > now);
    idem__kl_state state = code != IDEM_OK                   ? IDEM__KL_NONE
                           : rec.state == IDEM_REC_COMPLETED ? IDEM__KL_COMPLETED
                           : held                            ? IDEM__KL_LIVE
                                                             : IDEM__KL_LAPSED;
    idem_record_clear(&rec);
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    if (idem__key_life_decide(state, IDEM__KL_STEP)->action == IDEM__KL_JOURNAL) {
        return IDEM_OK;
    }
    call->claim_lost = true;
    return idem__err(IDEM_ABORTED, "claim lost: another run of this call owns its steps or "
                                   "recorded its outcome; retry with the same key");
}

idem_code idem__journal_claim_held(idem_txn *t, idem_call *call, uint64_t fence)
{
    return claim_held(t, call, fence);
}

typedef struct record_args {
    idem_call *call;
    journal j;
    uint64_t fence;
    const void *data;
    size_t len;
    bool too_many; /* the call has IDEM_MAX_STEPS steps: no retry fixes that */
} record_args;

static idem_code record_txn(idem_txn *t, void *arg)
{
    record_args *a = arg;
    const void *v;
    size_t n = 0;
    uint8_t head[HEAD_MAX];
    idem_code code = claim_held(t, a->call, a->fence);
    if (code != IDEM_OK || (code = idem__journal_keep_generation(t, a->call, &a->j)) != IDEM_OK) {
        return code;
    }
    code = idem_txn_get(t, STEPS_DB, a->j.head_key, JKEY, &v, &n);
    if (code == IDEM_NOT_FOUND) {
        n = 8;
    } else if (code != IDEM_OK) {
        return code;
    } else if (n < 8 || (n - 8) % 32 != 0 || n > HEAD_MAX) {
        return idem__err(IDEM_DATA_LOSS, "step journal head has an unknown format");
    } else {
        memcpy(head, v, n);
    }
    bool listed = false;
    for (size_t off = 8; off < n && !listed; off += 32) {
        listed = memcmp(head + off, a->j.step_key + 1, 32) == 0;
    }
    if (!listed && n == HEAD_MAX) {
        a->too_many = true;
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "at most %d steps per call", IDEM_MAX_STEPS);
    }
    if (!listed) {
        memcpy(head + n, a->j.step_key + 1, 32);
        n += 32;
    }
    idem__put_be64(head, a->fence);
    if ((code = idem_txn_put(t, STEPS_DB, a->j.head_key, JKEY, head, n)) != IDEM_OK ||
        (code = idem_txn_put(t, STEPS_DB, a->j.step_key, JKEY, a->data != NULL ? a->data : "",
                             a->len)) != IDEM_OK) {
        return code;
    }
    if (!a->call->rt->redrive) {
        return IDEM_OK;
    }
    code = idem_txn_get(t, STEPS_DB, a->j.call_key, JKEY, &v, &n); /* listed for the re-driver? */
    return code == IDEM_NOT_FOUND ? idem__journal_put_call(t, &a->j, a->call) : code;
}

/* Records the step, riding out a store outage or a full store (idem__outage_again), as
 * the outcome's completion does (interceptors/result_cache_run.c): fn's effect is done,
 * and a lost record makes the next run do it again; a step that fails transiently
 * releases its call, and the journal then waits for a client retry that may never come.
 * Each attempt checks the claim again in its txn, so a run that lost its claim meanwhile
 * gets ABORTED; an attempt whose commit did land but was not acknowledged is repeated
 * harmlessly (the same output, still our claim). */
static idem_code record_retrying(idem_call *call, record_args *a)
{
    idem_outage o = idem__outage_start();
    idem_code code;
    do {
        code = idem_store_run_txn(call->claim_store, record_txn, a);
    } while (idem__outage_again(&o, code == IDEM_UNAVAILABLE ||
                                        (code == IDEM_RESOURCE_EXHAUSTED && !a->too_many)));
    return code;
}

/* The step's recorded output (IDEM_OK), or IDEM_NOT_FOUND while the claim is still
 * this run's (fn may run); ABORTED when it is not. */
static idem_code look_up(idem_call *call, const record_args *a, void **v, size_t *n)
{
    idem_outage o = idem__outage_start();
    idem_code code;
    do {
        code = idem_store_app_get(call->claim_store, STEPS_DB, a->j.step_key, JKEY, v, n);
        if (code == IDEM_NOT_FOUND && (code = claim_held(NULL, call, call->fence)) == IDEM_OK) {
            code = IDEM_NOT_FOUND;
        }
    } while (idem__outage_again(&o, code == IDEM_UNAVAILABLE));
    return code;
}

idem_code idem__journal_look_up(idem_call *call, const idem__journal *j, void **v, size_t *n)
{
    record_args a = {.call = call, .j = *j, .fence = call->fence};
    return look_up(call, &a, v, n);
}

idem_code idem__journal_record(idem_call *call, const idem__journal *j, const void *data,
                               size_t len)
{
    record_args a = {.call = call, .j = *j, .fence = call->fence, .data = data, .len = len};
    idem_code code = record_retrying(call, &a);
    if (code == IDEM_OK) {
        atomic_store(&call->step_gen_pin, false); /* kept with the record */
    }
    return code;
}

static idem_code forget_txn(idem_txn *t, void *arg)
{
    const journal *j = arg;
    const void *v;
    size_t n;
    uint8_t key[JKEY] = {'s'};
    idem_code code = idem_txn_del(t, STEPS_DB, j->saga_key, JKEY);
    if ((code == IDEM_OK || code == IDEM_NOT_FOUND) && j->gen_key[0] == 'g') {
        code = idem_txn_del(t, STEPS_DB, j->gen_key, JKEY);
    }
    if (code == IDEM_OK || code == IDEM_NOT_FOUND) {
        code = idem_txn_del(t, STEPS_DB, j->call_key, JKEY);
    }
    if ((code != IDEM_OK && code != IDEM_NOT_FOUND) ||
        (code = idem_txn_get(t, STEPS_DB, j->head_key, JKEY, &v, &n)) != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    uint8_t head[HEAD_MAX];
    n = n < HEAD_MAX ? n : HEAD_MAX;
    memcpy(head, v, n); /* v is gone once the txn writes (LMDB) */
    for (size_t off = 8; off + 32 <= n; off += 32) {
        memcpy(key + 1, head + off, 32);
        for (int i = 0; i < 2; i++) { /* the step's output, its undo's record */
            key[0] = i == 0 ? 's' : 'u';
            if ((code = idem_txn_del(t, STEPS_DB, key, JKEY)) != IDEM_OK &&
                code != IDEM_NOT_FOUND) {
                return code;
            }
        }
    }
    return idem_txn_del(t, STEPS_DB, j->head_key, JKEY);
}

idem_code idem__journal_forget_txn(idem_txn *t, void *j)
{
    return forget_txn(t, j);
}

idem_code idem__journal_put_failure(idem_txn *t, const idem__journal *j, idem_code code,
                                    const char *msg)
{
    size_t n = strnlen(msg, IDEM_MAX_MESSAGE);
    uint8_t buf[4 + IDEM_MAX_MESSAGE];
    idem__put_be32(buf, (uint32_t)code);
    memcpy(buf + 4, msg, n);
    return idem_txn_put(t, STEPS_DB, j->saga_key, JKEY, buf, 4 + n);
}
