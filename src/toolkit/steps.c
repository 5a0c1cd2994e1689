/* Journaled steps (downstream.h): a step's output recorded once per call, bound to the
 * call's claim by its fence.
 *
 * Business database "idem.steps" (both stores, through idem_txn_*):
 *   'j' base          → be64 fence ‖ the 32-byte names of the recorded steps
 *   's' H(base, step) → output, one per recorded step
 *   'r' base          → the call, for the re-driver: 'R' 1 flags re-runs ‖ request
 *                       fingerprint ‖ be16-prefixed caller, method, effective key ‖
 *                       the packed idem.v1.Request
 *   'u' H(base, step) → "" once the step's undo ran; 'c' base → the failure a
 *                       compensation answers (saga.c)
 *   'g' H(caller, method, key) → be64 generation ‖ fingerprint: the generation mixed
 *                       into the run's derived keys (saga.c: read before the run,
 *                       kept with its first record)
 * where base = SHA-256(len-prefixed caller, method, key, request fingerprint): a
 * different request under a reused key never sees another request's steps. A record
 * txn first checks, in the txn, that the call's record is still IN_PROGRESS under the
 * run's fence (IDEM_ABORTED otherwise: a run that lost its claim cannot write over
 * the new owner's journal, nor leave one behind after the outcome). The 'j' entry is
 * the journal's head, with the fence of the last run that recorded: it lists every step
 * any run recorded, so the run that records the call's outcome deletes them all
 * (result_cache, for IDEM_METHOD_STEPS methods). The 'r' entry lists the call for the
 * re-driver (src/server/redriver.c), only on a server that runs one: the call's claim
 * writes it in its own commit (idem__call_steps_claim: a run that dies inside its first
 * step is listed too), and a step that finds it absent writes it; the outcome deletes
 * it with the journal, and a release deletes it
 * alone (the journal stays for the client's retry, which lists the call again). So the
 * re-driver scans only calls that may still be running or abandoned. */
#include <stdlib.h>
#include <string.h>

#include "steps_internal.h"

#include "idemrpc/toolkit.h"

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

/* IDEM_OK when the call's record is IN_PROGRESS under fence: in txn t (kept so until t
 * ends: nobody else can have it), else (t NULL, before fn runs) by a plain read, and
 * with its lease still running (once it has run out, a takeover may start fn again
 * any moment). A run that lost its claim gets ABORTED. */
static idem_code claim_held(idem_txn *t, const idem_call *call, uint64_t fence)
{
    idem_key_ref key = {idem_call_caller(call), call->method->name, call->key};
    idem_record rec;
    idem_code code = t != NULL ? idem__store_txn_record(t, &key, &rec)
                               : idem_store_get(call->claim_store, &key, &rec);
    uint64_t now = rec.now_ms ? rec.now_ms : idem__rt_now_ms(call->rt);
    bool held = code == IDEM_OK && rec.state == IDEM_REC_IN_PROGRESS && rec.owner == fence &&
                (t != NULL || rec.lease_until_ms > now);
    idem_record_clear(&rec);
    if (held) {
        return IDEM_OK;
    }
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    return idem__err(IDEM_ABORTED, "claim lost: another run of this call owns its steps or "
                                   "recorded its outcome; retry with the same key");
}

idem_code idem__journal_claim_held(idem_txn *t, const idem_call *call, uint64_t fence)
{
    return claim_held(t, call, fence);
}

typedef struct record_args {
    const idem_call *call;
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
    return record_retrying(call, &a);
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
    if (call->method == NULL || !(call->method->opts.flags & IDEM_METHOD_STEPS)) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "steps need a method registered with IDEM_METHOD_STEPS (%s is not)",
                         call->req->method);
    }
    if (call->claim_store == NULL || call->key_source == IDEM_KEY_NONE) {
        return idem__err(IDEM_FAILED_PRECONDITION, "steps run only inside the call's claim");
    }
    if (call->undoing != NULL) {
        return idem__err(IDEM_FAILED_PRECONDITION, "an undo runs no step (undoing %s)",
                         call->undoing);
    }
    return IDEM_OK;
}

static idem_code list_txn(idem_txn *t, void *arg)
{
    const record_args *a = arg;
    const void *v;
    size_t n;
    idem_code code = claim_held(t, a->call, a->fence);
    if (code == IDEM_OK &&
        (code = idem_txn_get(t, STEPS_DB, a->j.call_key, JKEY, &v, &n)) == IDEM_NOT_FOUND) {
        code = idem__journal_put_call(t, &a->j, a->call);
    }
    return code;
}

/* On a server with a re-driver: lists the call if it is not (a release unlisted it),
 * reading first. Best effort: a failure only leaves the call to its client. */
static void list_call(idem_call *call, const journal *j)
{
    bool listed;
    if (call->rt->redrive &&
        idem__journal_entry_exists(call->claim_store, j->call_key, &listed) == IDEM_OK && !listed) {
        record_args a = {.call = call, .j = *j, .fence = call->fence};
        idem_store_run_txn(call->claim_store, list_txn, &a);
    }
}

/* Runs fn for a step not recorded yet: the thread's error detail is fn's own (or says
 * which step failed), never a stale one from the journal's reads. */
static idem_code run_fn(idem_call *call, const char *step, idem_step_fn fn, void *arg,
                        idem_step_result *out)
{
    idem__err_clear();
    idem_code code = fn(call, arg, out);
    if (code != IDEM_OK && idem_errmsg()[0] == '\0') {
        idem__err(code, "step %s failed: %s", step, idem_code_name(code));
    }
    return code;
}

idem_code idem_call_step(idem_call *call, const char *step, idem_step_fn fn, void *arg,
                         idem_step_result *out)
{
    return idem_call_step_with(call, step, fn, arg, NULL, out);
}

idem_code idem_call_step_with(idem_call *call, const char *step, idem_step_fn fn, void *arg,
                              const idem_step_opts *opts, idem_step_result *out)
{
    record_args a = {.call = call, .fence = call != NULL ? call->fence : 0};
    void *v;
    size_t n;
    memset(out, 0, sizeof(*out));
    idem_code code = step_check(call, step, fn);
    if (code != IDEM_OK || (code = journal_keys(call, step, &a.j)) != IDEM_OK) {
        return code;
    }
    code = look_up(call, &a, &v, &n);
    if (code == IDEM_OK) { /* an earlier run recorded it */
        out->data = v;
        out->len = n;
        out->replayed = true;
        list_call(call, &a.j); /* a retry that only replays, then dies, is listed too */
        if ((code = idem__saga_add(call, step, opts, out)) != IDEM_OK ||
            (code = idem__saga_replayed(call, &a.j)) != IDEM_OK) {
            idem_step_result_clear(out);
        }
        return code;
    }
    /* Not ours any more (a takeover, or the call's outcome is recorded): fn must not
     * run. The record txn checks again, as the claim may go while fn runs. Nor once a
     * compensation has started: the call's outcome is its failure. */
    if (code != IDEM_NOT_FOUND || (code = idem__saga_check(call, &a.j)) != IDEM_OK ||
        (code = run_fn(call, step, fn, arg, out)) != IDEM_OK) {
        idem_step_result_clear(out);
        return code;
    }
    if (out->len > IDEM_MAX_STEP_OUTPUT || (out->data == NULL && out->len > 0)) {
        idem_step_result_clear(out);
        return idem__err(IDEM_INVALID_ARGUMENT, "a step's output is 0..%d bytes of data",
                         IDEM_MAX_STEP_OUTPUT);
    }
    a.data = out->data;
    a.len = out->len;
    if ((code = record_retrying(call, &a)) != IDEM_OK ||
        (code = idem__saga_add(call, step, opts, out)) != IDEM_OK) {
        idem_step_result_clear(out);
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

/* The whole journal, its listing and the key's generation, when there is any (a read
 * first: most calls of a method that records no step have none). */
idem_code idem__call_steps_forget(idem_call *call)
{
    journal j;
    bool any = false;
    idem_code code = journal_keys(call, NULL, &j);
    const uint8_t *keys[3] = {j.head_key, j.gen_key, j.call_key};
    for (int i = 0; code == IDEM_OK && !any && i < (call->rt->redrive ? 3 : 2); i++) {
        code = idem__journal_entry_exists(call->claim_store, keys[i], &any);
    }
    return code != IDEM_OK || !any ? code : idem_store_run_txn(call->claim_store, forget_txn, &j);
}

/* The owner's unlisting, before it releases: the claim is still its own. */
static idem_code owner_unlist_txn(idem_txn *t, void *arg)
{
    const record_args *a = arg;
    idem_code code = claim_held(t, a->call, a->fence);
    if (code == IDEM_OK) {
        code = idem_txn_del(t, STEPS_DB, a->j.call_key, JKEY);
    }
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

idem_code idem__call_steps_relist(idem_call *call)
{
    journal j;
    idem_code code = journal_keys(call, NULL, &j);
    if (code == IDEM_OK) {
        list_call(call, &j);
    }
    return code;
}

idem_code idem__call_steps_unlist(idem_call *call)
{
    record_args a = {.call = call, .fence = call->fence};
    bool listed;
    idem_code code = journal_keys(call, NULL, &a.j);
    if (code != IDEM_OK ||
        (code = idem__journal_entry_exists(call->claim_store, a.j.call_key, &listed)) != IDEM_OK ||
        !listed) {
        return code;
    }
    return idem_store_run_txn(call->claim_store, owner_unlist_txn, &a);
}
