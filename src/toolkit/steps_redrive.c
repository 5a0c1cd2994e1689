/* The re-driver's side of the step journal (steps.c): the claim of a journaled call,
 * which lists it, and what
 * src/server/redriver.c reads (the listed calls) and writes (forget a completed call's
 * journal, unlist, count a re-run), each write deciding on the record it re-reads in
 * its own txn. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "steps_internal.h"

#define STEPS_DB IDEM__STEPS_DB
#define JKEY IDEM__JKEY
/* ---- the claim of a journaled call ---- */

typedef struct claim_args {
    idem_call *call;
    idem__journal j;
    const idem_claim_req *req;
    idem_claim_outcome *outcome;
    idem_record *rec;
} claim_args;

/* The listing v (n bytes) written again in t with flags and runs. */
static idem_code put_listing(idem_txn *t, const uint8_t *call_key, const void *v, size_t n,
                             uint8_t flags, unsigned runs)
{
    uint8_t *copy = malloc(n);
    if (copy == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    memcpy(copy, v, n);
    copy[2] = flags;
    copy[3] = (uint8_t)runs;
    idem_code code = idem_txn_put(t, STEPS_DB, call_key, JKEY, copy, n);
    free(copy);
    return code;
}

/* The claim, and when it acquires (or takes over) the listing for the re-driver and the
 * key's generation in the same txn: a run that dies inside its first step is finished
 * too. A listing already
 * there (a takeover) is kept with its count of re-runs; its holder is new, so a
 * re-driver's count of the last one's death is over (CALL_COUNTED cleared). */
static idem_code claim_txn(idem_txn *t, claim_args *a)
{
    const void *v = NULL;
    size_t n;
    idem_code code = idem__store_txn_claim(t, a->req, a->outcome, a->rec);
    bool owned = *a->outcome == IDEM_CLAIM_ACQUIRED || *a->outcome == IDEM_CLAIM_TAKEN_OVER;
    if (code != IDEM_OK || !owned ||
        (code = idem__journal_draw_generation(t, a->call, &a->j, a->rec->owner)) != IDEM_OK) {
        return code;
    }
    code = idem_txn_get(t, STEPS_DB, a->j.call_key, JKEY, &v, &n);
    if (code == IDEM_NOT_FOUND) {
        return idem__journal_put_call(t, &a->j, a->call);
    }
    const uint8_t *p = v;
    if (code != IDEM_OK || n < CALL_FIXED || !(p[2] & CALL_COUNTED)) {
        return code;
    }
    return put_listing(t, a->j.call_key, v, n, p[2] & ~CALL_COUNTED, p[3]);
}

idem_code idem__call_steps_claim(idem_call *call, idem_store *st, const idem_claim_req *req,
                                 idem_claim_outcome *outcome, idem_record *rec)
{
    claim_args a = {.call = call, .req = req, .outcome = outcome, .rec = rec};
    idem_txn *t;
    memset(rec, 0, sizeof(*rec));
    idem_code code = idem__journal_keys(call, NULL, &a.j);
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

/* What count_run does: count a re-run, or take one back: REFUND one that did not run
 * the handler, UNCOUNT one that ran and lived (lost its claim, or left its compensation
 * unfinished). */
typedef enum count_how { COUNT, REFUND, UNCOUNT } count_how;

/* The re-driver's writes: each re-reads the call's record in its txn (kept so until
 * it ends), so no claim, completion or sweep slips in between its decision and its
 * write. */
typedef struct redrive_args {
    const idem__journaled_call *jc;
    idem__journal j;
    unsigned max_runs;
    uint64_t now_ms; /* this host's clock, for a store that keeps the callers' (LMDB) */
    count_how how;   /* count_run */
    idem__redrive_verdict verdict;
} redrive_args;

/* The listed call's key as a's txn sees its record (key_life.h): this request's
 * (COMPLETED, LIVE, LAPSED) on a re-driver pass, or absent (RELEASED: listed, so its
 * journal is kept; a compensating one looks the same here, journal_state tells), or
 * another request's (REDRIVE_OTHER). */
static idem_code record_seen(idem_txn *t, const redrive_args *a, idem__kl_state *state,
                             idem__kl_event *ev)
{
    const idem__journaled_call *jc = a->jc;
    idem_key_ref key = {jc->key_ref.caller, jc->key_ref.method, jc->key_ref.key};
    idem_record rec;
    idem_code code = idem__store_txn_record(t, &key, &rec);
    uint64_t now = rec.now_ms ? rec.now_ms : a->now_ms;
    bool ours = code == IDEM_OK && memcmp(rec.fingerprint, jc->fingerprint, 32) == 0;
    *ev = code == IDEM_OK && !ours ? IDEM__KL_REDRIVE_OTHER : IDEM__KL_REDRIVE;
    *state = !ours                             ? IDEM__KL_RELEASED
             : rec.state == IDEM_REC_COMPLETED ? IDEM__KL_COMPLETED
             : rec.lease_until_ms <= now       ? IDEM__KL_LAPSED
                                               : IDEM__KL_LIVE;
    idem_record_clear(&rec);
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

/* Whether the key's row in t is want: a->verdict DONE (the write may go on) or SKIP. */
static idem_code record_says(idem_txn *t, redrive_args *a, idem__kl_action want)
{
    idem__kl_state state;
    idem__kl_event ev;
    idem_code code = record_seen(t, a, &state, &ev);
    bool yes = code == IDEM_OK && idem__key_life_decide(state, ev)->action == want;
    a->verdict = yes ? IDEM__REDRIVE_DONE : IDEM__REDRIVE_SKIP;
    return code;
}

static idem_code forget_completed_txn(idem_txn *t, void *arg)
{
    redrive_args *a = arg;
    idem_code code = record_says(t, a, IDEM__KL_FORGET_JOURNAL);
    return code != IDEM_OK || a->verdict != IDEM__REDRIVE_DONE ? code
                                                               : idem__journal_forget_txn(t, &a->j);
}

/* Whether the journal's head lists a recorded step, and whether a compensation has
 * started ('c'), as t sees them. */
static idem_code journal_state(idem_txn *t, const idem__journal *j, bool *steps, bool *saga)
{
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, STEPS_DB, j->head_key, JKEY, &v, &n);
    *steps = code == IDEM_OK && n > 8;
    if (code == IDEM_OK || code == IDEM_NOT_FOUND) {
        code = idem_txn_get(t, STEPS_DB, j->saga_key, JKEY, &v, &n);
    }
    *saga = code == IDEM_OK;
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

/* Unlists a call whose key another request holds, unless its compensation started
 * (COMPENSATING: keep listed): the re-driver then runs it again once the key is free
 * (the other request is refused meanwhile, saga.c), never drops it with its effects
 * standing. */
static idem_code unlist_txn(idem_txn *t, void *arg)
{
    redrive_args *a = arg;
    bool steps, saga;
    idem__kl_state state;
    idem__kl_event ev;
    idem_code code = record_seen(t, a, &state, &ev);
    a->verdict = IDEM__REDRIVE_SKIP;
    if (code != IDEM_OK || ev != IDEM__KL_REDRIVE_OTHER ||
        (code = journal_state(t, &a->j, &steps, &saga)) != IDEM_OK ||
        idem__key_life_decide(saga ? IDEM__KL_COMPENSATING : IDEM__KL_RELEASED, ev)->action !=
            IDEM__KL_UNLIST) {
        return code;
    }
    a->verdict = IDEM__REDRIVE_DONE;
    code = idem_txn_del(t, STEPS_DB, a->j.call_key, JKEY);
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

/* Giving up on a call whose steps recorded effects: its compensation starts here, in
 * the txn that counts the last re-run, so whichever run comes next (the re-driver's,
 * or a client's retry) gives the effects back instead of running the call again. */
static idem_code give_up_txn(idem_txn *t, const redrive_args *a, bool *compensate)
{
    bool steps, saga;
    char msg[IDEM_MAX_MESSAGE + 1];
    idem_code code = journal_state(t, &a->j, &steps, &saga);
    *compensate = code == IDEM_OK && (steps || saga);
    if (code != IDEM_OK || !steps || saga) {
        return code; /* nothing recorded to give back (the call waits for its client), or
                      * a compensation already started */
    }
    snprintf(msg, sizeof(msg),
             "abandoned: %u re-runs of the call died, or were released without an outcome "
             "(redrive_max_runs; a run that lost its claim to another is not counted); the "
             "re-driver gave up and compensated its steps",
             a->max_runs);
    return idem__journal_put_failure(t, &a->j, IDEM_INTERNAL, msg);
}

/* The verdict on a call that has had runs re-runs: GO up to max_runs; at max_runs,
 * COMPENSATE (its compensation starts, give_up_txn; the run performs it) or GAVE_UP
 * (nothing to give back); past it, GO only to finish a compensation whose run died,
 * at most IDEM__REDRIVE_LIMIT(max_runs) runs in all. */
static idem_code verdict_of(idem_txn *t, const redrive_args *a, unsigned runs,
                            idem__redrive_verdict *v)
{
    bool steps, saga, compensate;
    idem_code code = IDEM_OK;
    *v = IDEM__REDRIVE_GO;
    if (runs == a->max_runs) {
        code = give_up_txn(t, a, &compensate);
        *v = compensate ? IDEM__REDRIVE_COMPENSATE : IDEM__REDRIVE_GAVE_UP;
    } else if (runs > a->max_runs) {
        code = journal_state(t, &a->j, &steps, &saga);
        *v =
            saga && runs < IDEM__REDRIVE_LIMIT(a->max_runs) ? IDEM__REDRIVE_GO : IDEM__REDRIVE_SKIP;
    }
    return code;
}

/* Whether a take-back finds nothing to take back in a listing with runs and flags. A
 * REFUND: only while CALL_COUNTED is still set (no run claimed since the count). An
 * UNCOUNT (the count's own run claimed, which cleared it, and lived):
 * only while CALL_COUNTED is clear (nobody counted since), and not the count of the run
 * that gave up (back to max_runs, the give-up would be said again). */
static bool nothing_to_take_back(const redrive_args *a, unsigned runs, uint8_t flags)
{
    if (runs == 0) {
        return true;
    }
    return a->how == REFUND ? !(flags & CALL_COUNTED)
                            : (flags & CALL_COUNTED) || runs == a->max_runs + 1;
}

/* Counts one more re-run in the 'r' entry, or says the call ran out of them: of a call
 * whose lease ran out, or whose record a re-run released (absent, still listed). Two
 * re-drivers (instances on one database) serialise here; a death is counted once: the
 * second finds the lease the first one's re-run took, or, when it comes before that
 * claim, CALL_COUNTED, and re-runs on the first one's verdict without counting (its
 * run and the first one's then meet at the claim). A refund or an uncount takes one
 * back, whatever the lease (nothing_to_take_back), and clears CALL_COUNTED. */
static idem_code count_run_txn(idem_txn *t, void *arg)
{
    redrive_args *a = arg;
    const void *v;
    size_t n;
    idem__kl_state state;
    idem__kl_event ev;
    bool take_back = a->how != COUNT;
    a->verdict = IDEM__REDRIVE_SKIP;
    idem_code code = record_seen(t, a, &state, &ev);
    /* A take-back also while the count's own run holds the key (its lease live). */
    bool eligible = idem__key_life_decide(state, ev)->action == IDEM__KL_RERUN ||
                    (take_back && state == IDEM__KL_LIVE && ev == IDEM__KL_REDRIVE);
    if (code != IDEM_OK || !eligible ||
        (code = idem_txn_get(t, STEPS_DB, a->j.call_key, JKEY, &v, &n)) != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    if (n < CALL_FIXED) {
        return idem__err(IDEM_DATA_LOSS, "a journaled call has an unknown format");
    }
    const uint8_t *p = v;
    unsigned runs = p[3];
    idem__redrive_verdict verdict = IDEM__REDRIVE_DONE;
    if (!take_back && (p[2] & CALL_COUNTED) && runs > 0) { /* this death is counted */
        code = verdict_of(t, a, runs - 1, &verdict);       /* the counter's, written then */
        bool go = verdict == IDEM__REDRIVE_GO || verdict == IDEM__REDRIVE_COMPENSATE;
        a->verdict = code == IDEM_OK && go ? IDEM__REDRIVE_GO_UNCOUNTED : IDEM__REDRIVE_SKIP;
        return code;
    }
    /* A REFUND only while no run has claimed since the count (CALL_COUNTED still set):
     * once another re-driver's uncounted run claimed, the death it counted was re-run,
     * and taking it back would let the call run past max_runs. An UNCOUNT's own run
     * claimed: nothing_to_take_back. */
    if ((take_back && nothing_to_take_back(a, runs, p[2])) ||
        (!take_back && (code = verdict_of(t, a, runs, &verdict)) != IDEM_OK)) {
        return code; /* nothing to take back; or the store failed */
    }
    if (verdict == IDEM__REDRIVE_SKIP) {
        return IDEM_OK; /* given up before, and said so */
    }
    a->verdict = verdict;
    return take_back ? put_listing(t, a->j.call_key, v, n, p[2] & ~CALL_COUNTED, runs - 1)
                     : put_listing(t, a->j.call_key, v, n, p[2] | CALL_COUNTED, runs + 1);
}

static idem_code redrive_write(idem_store *st, const idem__journaled_call *jc, unsigned max_runs,
                               count_how how, idem_txn_fn fn, idem__redrive_verdict *verdict)
{
    redrive_args a = {.jc = jc, .max_runs = max_runs, .now_ms = idem__now_ms(), .how = how};
    idem__journal_of_base(jc->base, &a.j);
    idem_code code = idem_store_run_txn(st, fn, &a);
    *verdict = code == IDEM_OK ? a.verdict : IDEM__REDRIVE_SKIP;
    return code;
}

idem_code idem__steps_forget_completed(idem_store *st, const idem__journaled_call *jc,
                                       idem__redrive_verdict *verdict)
{
    return redrive_write(st, jc, 0, COUNT, forget_completed_txn, verdict);
}

idem_code idem__steps_unlist(idem_store *st, const idem__journaled_call *jc,
                             idem__redrive_verdict *verdict)
{
    return redrive_write(st, jc, 0, COUNT, unlist_txn, verdict);
}

idem_code idem__steps_count_run(idem_store *st, const idem__journaled_call *jc, unsigned max_runs,
                                bool refund, idem__redrive_verdict *verdict)
{
    return redrive_write(st, jc, max_runs, refund ? REFUND : COUNT, count_run_txn, verdict);
}

idem_code idem__steps_uncount_run(idem_store *st, const idem__journaled_call *jc, unsigned max_runs,
                                  idem__redrive_verdict *verdict)
{
    return redrive_write(st, jc, max_runs, UNCOUNT, count_run_txn, verdict);
}

idem_code idem__steps_journal_exists(idem_store *st, const idem_key_ref *key,
                                     const uint8_t fingerprint[IDEM_FINGERPRINT_LEN], bool *exists)
{
    uint8_t base[32];
    idem__journal j;
    *exists = false;
    if (!idem__journal_base(key->caller != NULL ? key->caller : "", key->method, key->key,
                            fingerprint, base)) {
        return idem__err(IDEM_INTERNAL, "sha256 failed");
    }
    idem__journal_of_base(base, &j);
    return idem__journal_entry_exists(st, j.head_key, exists);
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

idem_code idem__journal_parse_call(const idem_app_entry *e, idem__journaled_call *out)
{
    return parse_call(e, out);
}

static idem_code drop_listing_txn(idem_txn *t, void *arg)
{
    const idem__journal *j = arg;
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
        idem__journal j;
        idem__journal_of_base(cursor + 1, &j);
        idem_store_run_txn(st, drop_listing_txn, &j); /* the caller reports the loss */
        idem__err(IDEM_DATA_LOSS, "a listed call could not be read; its listing was dropped");
    }
    return code;
}
