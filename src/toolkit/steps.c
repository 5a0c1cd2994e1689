/* Journaled steps (downstream.h): a step's output recorded once per call, bound to the
 * call's claim by its fence.
 *
 * Business database "idem.steps" (both stores, through idem_txn_*):
 *   'j' base          → be64 fence ‖ the 32-byte names of the recorded steps
 *   's' H(base, step) → output, one per recorded step
 *   'r' base          → the call, for the re-driver: 'R' 1 flags re-runs ‖ request
 *                       fingerprint ‖ be16-prefixed caller, method, effective key ‖
 *                       the packed idem.v1.Request
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

#include "call.h"
#include "store.h"

#include "idemrpc/downstream.h"
#include "idemrpc/toolkit.h"

#define STEPS_DB "idem.steps"
#define JKEY 33 /* a prefix byte and a SHA-256 */
_Static_assert(JKEY == IDEM__JOURNAL_CURSOR, "the re-driver's cursor is a journal key");
#define CALL_MAGIC 'R'
#define CALL_VERSION 1
#define CALL_VERIFIED 1u /* flags: the caller was verified, not only declared */
#define CALL_FIXED (4 + IDEM_FINGERPRINT_LEN) /* the entry up to the key's parts */
#define HEAD_MAX (8 + IDEM_MAX_STEPS * 32)
/* A step's record rides out a store outage or a full store this long, as the outcome's
 * completion does (interceptors/result_cache.c, RECORD_RETRY_MS): fn's effect is done,
 * and a lost record makes the next run do it again. */
#define STEP_RECORD_RETRY_MS 10000u

typedef struct journal {
    uint8_t head_key[JKEY], step_key[JKEY], call_key[JKEY];
} journal;

static void journal_of_base(const uint8_t base[32], journal *j)
{
    j->head_key[0] = 'j';
    j->step_key[0] = 's';
    j->call_key[0] = 'r';
    memcpy(j->head_key + 1, base, 32);
    memcpy(j->call_key + 1, base, 32);
}

/* base = SHA-256(len-prefixed caller, method, key, request fingerprint). */
static bool journal_base(const char *caller, const char *method, const char *key,
                         const uint8_t fp[IDEM_FINGERPRINT_LEN], uint8_t base[32])
{
    const char *parts[3] = {caller, method, key};
    return idem__lp_sha256(parts, 3, fp, IDEM_FINGERPRINT_LEN, base);
}

static idem_code journal_keys(idem_call *call, const char *step, journal *j)
{
    uint8_t fp[IDEM_FINGERPRINT_LEN], base[32];
    idem_code code = idem__call_fingerprint(call, fp);
    if (code != IDEM_OK) {
        return code;
    }
    if (!journal_base(idem_call_caller(call), call->req->method, call->key, fp, base) ||
        (step != NULL && !idem__sha256((const void *const[]){base, step},
                                       (const size_t[]){32, strlen(step)}, 2, j->step_key + 1))) {
        return idem__err(IDEM_INTERNAL, "sha256 failed");
    }
    journal_of_base(base, j);
    return IDEM_OK;
}

/* Whether the journal entry key is in the store (a read, so that a write txn is opened
 * only when there is something to write). */
static idem_code entry_exists(idem_store *st, const uint8_t key[JKEY], bool *exists)
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
static idem_code put_call(idem_txn *t, const journal *j, const idem_call *call)
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
    if (code != IDEM_OK) {
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
    return code == IDEM_NOT_FOUND ? put_call(t, &a->j, a->call) : code;
}

/* Riding out a store outage (or a full store) for up to STEP_RECORD_RETRY_MS: a step
 * that fails transiently releases its call, and the journal then waits for a client
 * retry that may never come. */
typedef struct outage {
    uint64_t give_up, backoff;
} outage;

static outage outage_start(void)
{
    return (outage){.give_up = idem__mono_ms() + STEP_RECORD_RETRY_MS, .backoff = 10};
}

/* True, after a pause, when a transient failure is worth another attempt. */
static bool outage_again(outage *o, bool transient)
{
    if (!transient || idem__mono_ms() + o->backoff > o->give_up) {
        return false;
    }
    idem__sleep_ms(o->backoff);
    o->backoff = o->backoff * 2 > 500 ? 500 : o->backoff * 2;
    return true;
}

/* Records the step. Each attempt checks the claim again in its txn, so a run that lost
 * its claim meanwhile gets ABORTED; an attempt whose commit did land but was not
 * acknowledged is repeated harmlessly (the same output, still our claim). */
static idem_code record_retrying(idem_call *call, record_args *a)
{
    outage o = outage_start();
    idem_code code;
    do {
        code = idem_store_run_txn(call->claim_store, record_txn, a);
    } while (outage_again(&o, code == IDEM_UNAVAILABLE ||
                                  (code == IDEM_RESOURCE_EXHAUSTED && !a->too_many)));
    return code;
}

/* The step's recorded output (IDEM_OK), or IDEM_NOT_FOUND while the claim is still
 * this run's (fn may run); ABORTED when it is not. */
static idem_code look_up(idem_call *call, const record_args *a, void **v, size_t *n)
{
    outage o = outage_start();
    idem_code code;
    do {
        code = idem_store_app_get(call->claim_store, STEPS_DB, a->j.step_key, JKEY, v, n);
        if (code == IDEM_NOT_FOUND && (code = claim_held(NULL, call, call->fence)) == IDEM_OK) {
            code = IDEM_NOT_FOUND;
        }
    } while (outage_again(&o, code == IDEM_UNAVAILABLE));
    return code;
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
        code = put_call(t, &a->j, a->call);
    }
    return code;
}

/* On a server with a re-driver: lists the call if it is not (a release unlisted it),
 * reading first. Best effort: a failure only leaves the call to its client. */
static void list_call(idem_call *call, const journal *j)
{
    bool listed;
    if (call->rt->redrive && entry_exists(call->claim_store, j->call_key, &listed) == IDEM_OK &&
        !listed) {
        record_args a = {.call = call, .j = *j, .fence = call->fence};
        idem_store_run_txn(call->claim_store, list_txn, &a);
    }
}

idem_code idem_call_step(idem_call *call, const char *step, idem_step_fn fn, void *arg,
                         idem_step_result *out)
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
        return IDEM_OK;
    }
    /* Not ours any more (a takeover, or the call's outcome is recorded): fn must not
     * run. The record txn checks again, as the claim may go while fn runs. */
    if (code != IDEM_NOT_FOUND || (code = fn(call, arg, out)) != IDEM_OK) {
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
    if ((code = record_retrying(call, &a)) != IDEM_OK) {
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
    idem_code code = idem_txn_del(t, STEPS_DB, j->call_key, JKEY);
    if ((code != IDEM_OK && code != IDEM_NOT_FOUND) ||
        (code = idem_txn_get(t, STEPS_DB, j->head_key, JKEY, &v, &n)) != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    uint8_t head[HEAD_MAX];
    n = n < HEAD_MAX ? n : HEAD_MAX;
    memcpy(head, v, n); /* v is gone once the txn writes (LMDB) */
    for (size_t off = 8; off + 32 <= n; off += 32) {
        memcpy(key + 1, head + off, 32);
        if ((code = idem_txn_del(t, STEPS_DB, key, JKEY)) != IDEM_OK && code != IDEM_NOT_FOUND) {
            return code;
        }
    }
    return idem_txn_del(t, STEPS_DB, j->head_key, JKEY);
}

idem_code idem__call_steps_forget(idem_call *call)
{
    journal j;
    bool any; /* a call may have recorded no step at all */
    idem_code code = journal_keys(call, NULL, &j);
    if (code != IDEM_OK || (code = entry_exists(call->claim_store, j.head_key, &any)) != IDEM_OK) {
        return code;
    }
    if (!any && (!call->rt->redrive ||
                 (code = entry_exists(call->claim_store, j.call_key, &any)) != IDEM_OK || !any)) {
        return code; /* listed at its claim, even without a step */
    }
    return idem_store_run_txn(call->claim_store, forget_txn, &j);
}

/* The re-driver's writes: each re-reads the call's record in its txn (kept so until
 * it ends), so no claim, completion or sweep slips in between its decision and its
 * write. */
typedef struct redrive_args {
    const idem__journaled_call *jc;
    journal j;
    unsigned max_runs;
    uint64_t now_ms; /* this host's clock, for a store that keeps the callers' (LMDB) */
    bool refund;     /* count_run: take back a re-run that did not run the handler */
    idem__redrive_verdict verdict;
} redrive_args;

/* The record as a's txn sees it: 'c' this request's and COMPLETED, 'p' this request's
 * and IN_PROGRESS with a live lease, 'x' the same with its lease run out, 'a' absent,
 * 'o' another request's. */
static idem_code record_kind(idem_txn *t, const redrive_args *a, char *kind)
{
    const idem__journaled_call *jc = a->jc;
    idem_key_ref key = {jc->key_ref.caller, jc->key_ref.method, jc->key_ref.key};
    idem_record rec;
    idem_code code = idem__store_txn_record(t, &key, &rec);
    uint64_t now = rec.now_ms ? rec.now_ms : a->now_ms;
    bool ours = code == IDEM_OK && memcmp(rec.fingerprint, jc->fingerprint, 32) == 0;
    *kind = code == IDEM_NOT_FOUND            ? 'a'
            : !ours                           ? 'o'
            : rec.state == IDEM_REC_COMPLETED ? 'c'
            : rec.lease_until_ms <= now       ? 'x'
                                              : 'p';
    idem_record_clear(&rec);
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

/* Whether the record is of kind want in t: a->verdict DONE (the write may go on) or SKIP. */
static idem_code record_is(idem_txn *t, redrive_args *a, char want)
{
    char kind;
    idem_code code = record_kind(t, a, &kind);
    a->verdict = code == IDEM_OK && kind == want ? IDEM__REDRIVE_DONE : IDEM__REDRIVE_SKIP;
    return code;
}

static idem_code forget_completed_txn(idem_txn *t, void *arg)
{
    redrive_args *a = arg;
    idem_code code = record_is(t, a, 'c');
    return code != IDEM_OK || a->verdict != IDEM__REDRIVE_DONE ? code : forget_txn(t, &a->j);
}

static idem_code unlist_txn(idem_txn *t, void *arg)
{
    redrive_args *a = arg;
    idem_code code = record_is(t, a, 'o');
    if (code != IDEM_OK || a->verdict != IDEM__REDRIVE_DONE) {
        return code;
    }
    code = idem_txn_del(t, STEPS_DB, a->j.call_key, JKEY);
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

/* Counts one more re-run in the 'r' entry, or says the call ran out of them: of a call
 * whose lease ran out, or whose record a re-run released (absent, still listed). Two
 * re-drivers (instances on one database) serialise here; the second finds the lease
 * the first one's re-run took. A refund takes one back, whatever the lease. */
static idem_code count_run_txn(idem_txn *t, void *arg)
{
    redrive_args *a = arg;
    const void *v;
    size_t n;
    char kind;
    a->verdict = IDEM__REDRIVE_SKIP;
    idem_code code = record_kind(t, a, &kind);
    bool eligible = kind == 'x' || kind == 'a' || (a->refund && kind == 'p');
    if (code != IDEM_OK || !eligible ||
        (code = idem_txn_get(t, STEPS_DB, a->j.call_key, JKEY, &v, &n)) != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    if (n < CALL_FIXED) {
        return idem__err(IDEM_DATA_LOSS, "a journaled call has an unknown format");
    }
    unsigned runs = ((const uint8_t *)v)[3];
    if (runs > a->max_runs || (a->refund && runs == 0)) {
        return IDEM_OK; /* given up before, and said so; or nothing to take back */
    }
    uint8_t *copy = malloc(n);
    if (copy == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    memcpy(copy, v, n);
    /* runs == max_runs: max_runs + 1 marks "gave up" */
    copy[3] = (uint8_t)(a->refund ? runs - 1 : runs + 1);
    a->verdict = a->refund            ? IDEM__REDRIVE_DONE
                 : runs < a->max_runs ? IDEM__REDRIVE_GO
                                      : IDEM__REDRIVE_GAVE_UP;
    code = idem_txn_put(t, STEPS_DB, a->j.call_key, JKEY, copy, n);
    free(copy);
    return code;
}

static idem_code redrive_write(idem_store *st, const idem__journaled_call *jc, unsigned max_runs,
                               bool refund, idem_txn_fn fn, idem__redrive_verdict *verdict)
{
    redrive_args a = {.jc = jc, .max_runs = max_runs, .now_ms = idem__now_ms(), .refund = refund};
    journal_of_base(jc->base, &a.j);
    idem_code code = idem_store_run_txn(st, fn, &a);
    *verdict = code == IDEM_OK ? a.verdict : IDEM__REDRIVE_SKIP;
    return code;
}

idem_code idem__steps_forget_completed(idem_store *st, const idem__journaled_call *jc,
                                       idem__redrive_verdict *verdict)
{
    return redrive_write(st, jc, 0, false, forget_completed_txn, verdict);
}

idem_code idem__steps_unlist(idem_store *st, const idem__journaled_call *jc,
                             idem__redrive_verdict *verdict)
{
    return redrive_write(st, jc, 0, false, unlist_txn, verdict);
}

idem_code idem__steps_count_run(idem_store *st, const idem__journaled_call *jc, unsigned max_runs,
                                bool refund, idem__redrive_verdict *verdict)
{
    return redrive_write(st, jc, max_runs, refund, count_run_txn, verdict);
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

/* ---- the claim of a journaled call ---- */

typedef struct claim_args {
    idem_call *call;
    journal j;
    const idem_claim_req *req;
    idem_claim_outcome *outcome;
    idem_record *rec;
} claim_args;

/* The claim, and when it acquires (or takes over) the listing for the re-driver in the
 * same txn: a run that dies inside its first step is finished too. A listing already
 * there (a takeover) is kept with its count of re-runs. */
static idem_code claim_txn(idem_txn *t, claim_args *a)
{
    const void *v;
    size_t n;
    idem_code code = idem__store_txn_claim(t, a->req, a->outcome, a->rec);
    bool owned = *a->outcome == IDEM_CLAIM_ACQUIRED || *a->outcome == IDEM_CLAIM_TAKEN_OVER;
    if (code != IDEM_OK || !owned || !a->call->rt->redrive) {
        return code;
    }
    code = idem_txn_get(t, STEPS_DB, a->j.call_key, JKEY, &v, &n);
    return code == IDEM_NOT_FOUND ? put_call(t, &a->j, a->call) : code;
}

idem_code idem__call_steps_claim(idem_call *call, idem_store *st, const idem_claim_req *req,
                                 idem_claim_outcome *outcome, idem_record *rec)
{
    claim_args a = {.call = call, .req = req, .outcome = outcome, .rec = rec};
    idem_txn *t;
    memset(rec, 0, sizeof(*rec));
    idem_code code = journal_keys(call, NULL, &a.j);
    if (code != IDEM_OK || (code = idem__store_txn_begin(st, &t)) != IDEM_OK) {
        return code;
    }
    if ((code = claim_txn(t, &a)) != IDEM_OK) {
        idem__store_txn_abort(t);
        idem_record_clear(rec);
        return code;
    }
    if ((code = idem__store_txn_commit(t)) != IDEM_OK) {
        idem_record_clear(rec); /* not committed, or unknown: the client retries */
    }
    return code;
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
        (code = entry_exists(call->claim_store, a.j.call_key, &listed)) != IDEM_OK || !listed) {
        return code;
    }
    return idem_store_run_txn(call->claim_store, owner_unlist_txn, &a);
}

idem_code idem__steps_journal_exists(idem_store *st, const idem_key_ref *key,
                                     const uint8_t fingerprint[IDEM_FINGERPRINT_LEN], bool *exists)
{
    uint8_t base[32];
    journal j;
    *exists = false;
    if (!journal_base(key->caller != NULL ? key->caller : "", key->method, key->key, fingerprint,
                      base)) {
        return idem__err(IDEM_INTERNAL, "sha256 failed");
    }
    journal_of_base(base, &j);
    return entry_exists(st, j.head_key, exists);
}

void idem__journaled_call_clear(idem__journaled_call *c)
{
    free(c->request);
    memset(c, 0, sizeof(*c));
}

static bool get_lp16(const uint8_t **p, const uint8_t *end, char *out, size_t max)
{
    if (end - *p < 2) {
        return false;
    }
    size_t n = (size_t)(*p)[0] << 8 | (*p)[1];
    if (n > max || (size_t)(end - *p - 2) < n || memchr(*p + 2, '\0', n) != NULL) {
        return false;
    }
    memcpy(out, *p + 2, n);
    out[n] = '\0';
    *p += 2 + n;
    return true;
}

static idem_code parse_call(const idem_app_entry *e, idem__journaled_call *out)
{
    const uint8_t *p = e->val, *end = p + e->vlen;
    if (e->vlen >= 2 && p[0] == CALL_MAGIC && p[1] > CALL_VERSION) {
        return idem__err(IDEM_UNIMPLEMENTED, "a listing of a newer version (an instance "
                                             "upgraded before this one)");
    }
    if (e->vlen < CALL_FIXED || p[0] != CALL_MAGIC || p[1] != CALL_VERSION) {
        return idem__err(IDEM_DATA_LOSS, "a journaled call has an unknown format");
    }
    out->caller_verified = (p[2] & CALL_VERIFIED) != 0;
    out->runs = p[3];
    memcpy(out->fingerprint, p + 4, IDEM_FINGERPRINT_LEN);
    p += CALL_FIXED;
    if (!get_lp16(&p, end, out->key_ref.caller, IDEM_MAX_CALLER) ||
        !get_lp16(&p, end, out->key_ref.method, IDEM_MAX_METHOD) ||
        !get_lp16(&p, end, out->key_ref.key, IDEM_MAX_KEY)) {
        return idem__err(IDEM_DATA_LOSS, "a journaled call is truncated");
    }
    out->request_len = (size_t)(end - p);
    if ((out->request = malloc(out->request_len ? out->request_len : 1)) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    memcpy(out->request, p, out->request_len);
    return IDEM_OK;
}

static idem_code drop_listing_txn(idem_txn *t, void *arg)
{
    const journal *j = arg;
    return idem_txn_del(t, STEPS_DB, j->call_key, JKEY);
}

idem_code idem__steps_next_call(idem_store *st, uint8_t cursor[JKEY], idem__journaled_call *out)
{
    idem_app_entry e;
    memset(out, 0, sizeof(*out));
    /* cursor[0] is 'r' once a round started: the next 'r' key after it; else the first. */
    size_t clen = cursor[0] == 'r' ? JKEY : 1;
    if (clen == 1) {
        cursor[0] = 'r';
    }
    idem_code code = idem__store_app_next(st, STEPS_DB, cursor, clen, &e);
    if (code == IDEM_OK && (e.klen != JKEY || ((const uint8_t *)e.key)[0] != 'r')) {
        code = idem__err(IDEM_NOT_FOUND, "no more journaled calls");
    }
    if (code != IDEM_OK) {
        cursor[0] = 0; /* the next round starts at the first */
    } else {
        memcpy(cursor, e.key, JKEY);
        memcpy(out->base, cursor + 1, 32);
        code = parse_call(&e, out);
    }
    idem__app_entry_clear(&e);
    if (code == IDEM_DATA_LOSS) { /* a listing nobody can act on: drop it, keep the journal */
        journal j;
        journal_of_base(cursor + 1, &j);
        idem_store_run_txn(st, drop_listing_txn, &j); /* the caller reports the loss */
        idem__err(IDEM_DATA_LOSS, "a listed call could not be read; its listing was dropped");
    }
    return code;
}
