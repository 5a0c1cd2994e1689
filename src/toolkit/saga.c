/* Compensation (downstream.h, "sagas"): the undos of a journaled call's steps.
 *
 * Business database "idem.steps", next to the journal (steps.c):
 *   'c' base       → be32 code ‖ message: the final failure a compensation answers.
 *                    Written (under the claim) before the first undo runs, or by the
 *                    re-driver when it gives up on a call (steps_redrive.c); from then
 *                    on no new step runs and every run of the call answers that failure,
 *                    and the key stays the call's: another request under it runs nothing
 *                    (idem__call_steps_begin finds it through 'g') until it is deleted.
 *   'u' H(base, s) → "" once the undo of step s has run (s's hash as in its 's' entry,
 *                    so the journal's head lists it and the outcome deletes it).
 *   'g' H(caller, method, key) → be64 generation ‖ fingerprint: read before a run
 *                    (idem__call_steps_begin), kept before its first derived key
 *                    leaves or with its first record, deleted with the journal.
 *
 * A run knows the undos of the steps it completed or replayed (idem_call_step_with, in
 * order); a step recorded by an earlier run that this run did not reach has no known
 * undo, and so stands. After the handler, idem__call_saga_end decides (call.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "steps_internal.h"

/* Whether the request fp, the key's last to record a step (its 'g' entry), left a
 * compensation unfinished: its 'c' entry is there until its undos all ran (fresh_txn) or
 * its outcome is stored. */
static idem_code compensating(idem_call *call, const uint8_t fp[IDEM_FINGERPRINT_LEN], bool *yes)
{
    uint8_t base[32];
    idem__journal j;
    if (!idem__journal_base(idem_call_caller(call), call->req->method, call->key, fp, base)) {
        return idem__err(IDEM_INTERNAL, "sha256 failed");
    }
    idem__journal_of_base(base, &j);
    return idem__journal_entry_exists(call->claim_store, j.saga_key, yes);
}

/* The key's 'g' entry v: this request's kept generation (its earlier runs', or an older
 * release's), or another request's: the key's state is RELEASED (with a journal) or,
 * while that request's compensation is unfinished, COMPENSATING. Its row says: keep
 * this request's generation (RESUME); refuse another request while the key is
 * compensating (it would derive new keys and leave the earlier effects standing once
 * the key is its own: that request's retry refused "key reused", the re-driver finding
 * the key another's; the earlier request's retry, or the re-driver, finishes it first);
 * else RUN, with its claim's fence as generation. */
static idem_code generation_of(idem_call *call, const uint8_t *v)
{
    bool busy = false;
    bool same = memcmp(v + 8, call->fingerprint, IDEM_FINGERPRINT_LEN) == 0;
    idem_code code = same ? IDEM_OK : compensating(call, v + 8, &busy);
    if (code != IDEM_OK) {
        return code;
    }
    const idem__key_life_row *row =
        idem__key_life_decide(busy ? IDEM__KL_COMPENSATING : IDEM__KL_RELEASED,
                              same ? IDEM__KL_CLAIM_SAME : IDEM__KL_CLAIM_OTHER);
    switch (row->action) {
    case IDEM__KL_RESUME:
        call->step_gen = idem__get_be64(v); /* this request's: its keys stay */
        atomic_store(&call->step_gen_pin, false);
        return IDEM_OK;
    case IDEM__KL_REFUSE_COMPENSATING:
        return idem__err((idem_code)row->code,
                         "the key is compensating an earlier request (an undo of its steps "
                         "did not finish); retry later: that request's retry with the same "
                         "key (or the re-driver, where one runs) finishes it first");
    default: /* RUN: this claim's fence */
        return IDEM_OK;
    }
}

/* The generation of a run: the one kept for this request ('g' with its fingerprint),
 * else this claim's fence. Fences only grow, store-wide, so a generation drawn so was
 * never a generation of this key before, even once the key's 'g' is gone (deleted with
 * a completed call's journal, whose record then expires): a key's later request never
 * derives an earlier one's keys. A drawn one is kept before a key derived from it
 * leaves (idem__call_steps_pin), so the request's retries derive the same keys. */
idem_code idem__call_steps_begin(idem_call *call)
{
    idem__journal j;
    void *v;
    size_t n;
    call->step_gen = call->fence;
    atomic_store(&call->step_gen_pin, true);
    idem_code code = idem__journal_keys(call, NULL, &j);
    if (code != IDEM_OK || (code = idem_store_app_get(call->claim_store, IDEM__STEPS_DB, j.gen_key,
                                                      IDEM__JKEY, &v, &n)) != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code; /* none yet */
    }
    code = n == GEN_LEN ? generation_of(call, v)
                        : idem__err(IDEM_DATA_LOSS, "a key's generation has an unknown format");
    free(v);
    return code;
}

typedef struct saga_step {
    char name[IDEM_MAX_STEP + 1];
    idem_undo_fn undo;
    void *arg;
    bool effect_free;
    idem_step_result done; /* a copy of the step's output */
} saga_step;

struct idem__saga {
    size_t n;
    saga_step steps[IDEM_MAX_STEPS];
};

static void saga_free(idem_call *call)
{
    struct idem__saga *s = call->saga;
    for (size_t i = 0; s != NULL && i < s->n; i++) {
        idem_step_result_clear(&s->steps[i].done);
    }
    free(s);
    call->saga = NULL;
}

idem_code idem__saga_add(idem_call *call, const char *step, const idem_step_opts *opts,
                         const idem_step_result *out)
{
    struct idem__saga *s = call->saga;
    if (s == NULL && (s = call->saga = calloc(1, sizeof(*s))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    call->saga_free = saga_free;
    for (size_t i = 0; i < s->n; i++) {
        if (strcmp(s->steps[i].name, step) == 0) {
            return IDEM_OK; /* asked again in this run: one undo */
        }
    }
    if (s->n == IDEM_MAX_STEPS) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "at most %d steps per call", IDEM_MAX_STEPS);
    }
    saga_step *e = &s->steps[s->n];
    snprintf(e->name, sizeof(e->name), "%s", step);
    e->undo = opts != NULL ? opts->undo : NULL;
    e->arg = opts != NULL ? opts->undo_arg : NULL;
    e->effect_free = opts != NULL && opts->effect_free;
    if (out->len > 0 && (e->done.data = malloc(out->len)) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (out->len > 0) {
        memcpy(e->done.data, out->data, out->len);
    }
    e->done.len = out->len;
    e->done.replayed = out->replayed;
    s->n++;
    return IDEM_OK;
}

/* The compensation's failure, when one has started (*fail IDEM_OK: none), and its
 * message; the code is the read's. */
static idem_code saga_read(idem_call *call, const idem__journal *j, idem_code *fail, char *msg,
                           size_t cap)
{
    void *v;
    size_t n;
    idem_code code =
        idem_store_app_get(call->claim_store, IDEM__STEPS_DB, j->saga_key, IDEM__JKEY, &v, &n);
    *fail = IDEM_OK;
    msg[0] = '\0';
    if (code != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    const uint8_t *p = v;
    uint32_t c = n >= 4 ? (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]
                        : IDEM_UNKNOWN;
    size_t len = n >= 4 ? n - 4 : 0;
    snprintf(msg, cap, "%.*s", (int)(len < cap ? len : cap - 1), (const char *)p + 4);
    free(v);
    *fail = c == IDEM_OK || c >= IDEM_CODE_COUNT ? IDEM_UNKNOWN : (idem_code)c;
    return IDEM_OK;
}

idem_code idem__saga_check(idem_call *call, const idem__journal *j)
{
    char msg[IDEM_MAX_MESSAGE + 1];
    idem_code fail, code = saga_read(call, j, &fail, msg, sizeof(msg));
    return code != IDEM_OK ? code : fail == IDEM_OK ? IDEM_OK : idem__err(fail, "%s", msg);
}

/* Steps the journal lists (every run's), read from its head. */
static idem_code recorded_steps(idem_call *call, const idem__journal *j, size_t *count)
{
    void *v;
    size_t n;
    idem_code code =
        idem_store_app_get(call->claim_store, IDEM__STEPS_DB, j->head_key, IDEM__JKEY, &v, &n);
    *count = code == IDEM_OK && n >= 8 ? (n - 8) / 32 : 0;
    if (code == IDEM_OK) {
        free(v);
    }
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

idem_code idem__saga_replayed(idem_call *call, const idem__journal *j)
{
    char msg[IDEM_MAX_MESSAGE + 1];
    size_t recorded;
    idem_code fail, code = saga_read(call, j, &fail, msg, sizeof(msg));
    if (code != IDEM_OK || fail == IDEM_OK ||
        (code = recorded_steps(call, j, &recorded)) != IDEM_OK) {
        return code;
    }
    size_t known = call->saga != NULL ? call->saga->n : 0;
    return known < recorded ? IDEM_OK : idem__err(fail, "%s", msg);
}

/* Whether this run knows the undo of every step the journal recorded (it completed or
 * replayed them all). false when the journal cannot be read. */
static bool reached_every_step(idem_call *call, const idem__journal *j)
{
    size_t recorded;
    size_t known = call->saga != NULL ? call->saga->n : 0;
    return recorded_steps(call, j, &recorded) == IDEM_OK && known >= recorded;
}

typedef struct saga_args {
    idem_call *call;
    idem__journal j;
    idem_code code;
    const char *msg;
} saga_args;

/* Starts the compensation: its failure recorded under the claim. */
static idem_code start_txn(idem_txn *t, void *arg)
{
    saga_args *a = arg;
    idem_code code = idem__journal_claim_held(t, a->call, a->call->fence);
    return code != IDEM_OK ? code : idem__journal_put_failure(t, &a->j, a->code, a->msg);
}

/* Every effect undone: the journal goes with the key's generation, under the claim,
 * before the release; the next run draws a new one (its claim's fence). */
static idem_code fresh_txn(idem_txn *t, void *arg)
{
    saga_args *a = arg;
    idem_code code = idem__journal_claim_held(t, a->call, a->call->fence);
    return code != IDEM_OK ? code : idem__journal_forget_txn(t, &a->j);
}

/* Runs (or finds recorded) the undo of e. IDEM_OK: undone; a transient code: not yet
 * (the compensation is unfinished); another: the undo failed finally, the effect stands. */
static idem_code undo_step(idem_call *call, saga_step *e)
{
    char name[IDEM_MAX_STEP + 1];
    idem__journal uj;
    void *v;
    size_t n;
    snprintf(name, sizeof(name), "%s", e->name);
    idem_code code = idem__journal_keys(call, name, &uj);
    if (code != IDEM_OK) {
        return code;
    }
    uj.step_key[0] = 'u';
    if ((code = idem__journal_look_up(call, &uj, &v, &n)) == IDEM_OK) {
        free(v);
        return IDEM_OK; /* an earlier run undid it */
    }
    if (code != IDEM_NOT_FOUND) {
        return code;
    }
    call->undoing = e->name;
    idem__err_clear();
    code = e->undo(call, e->name, &e->done, e->arg);
    call->undoing = NULL;
    if (code == IDEM_OK) {
        return idem__journal_record(call, &uj, "", 0);
    }
    if (idem_errmsg()[0] == '\0') {
        idem__err(code, "undo of %s failed: %s", e->name, idem_code_name(code));
    }
    return code;
}

static void log_saga(const idem_call *call, idem_log_level level, const char *what)
{
    char id[IDEM_LOGQ_CAP], msg[IDEM_LOGQ_CAP];
    idem__log(call->rt->obs, level, "request_id=%s method=\"%s\" msg=%s",
              idem__logfmt_quote(id, sizeof(id), call->request_id), call->method->name,
              idem__logfmt_quote(msg, sizeof(msg), what));
}

/* The undos, last step first. Returns IDEM_OK when every known undo ran (*stands counts
 * the effects that stand: no undo, or an undo that failed finally), else the transient
 * failure that stopped it (idem_errmsg says which). */
static idem_code run_undos(idem_call *call, size_t *stands)
{
    struct idem__saga *s = call->saga;
    char what[IDEM_LOGQ_CAP];
    *stands = 0;
    for (size_t i = s != NULL ? s->n : 0; i-- > 0;) {
        saga_step *e = &s->steps[i];
        if (e->undo == NULL && e->effect_free) {
            continue; /* nothing to give back */
        }
        idem_code code = e->undo != NULL ? undo_step(call, e) : IDEM_FAILED_PRECONDITION;
        uint32_t transient = IDEM_TRANSIENT_CODES | IDEM_CODE_BIT(IDEM_ABORTED);
        if (code != IDEM_OK && (unsigned)code < IDEM_CODE_COUNT &&
            (IDEM_CODE_BIT(code) & transient)) {
            snprintf(what, sizeof(what), "compensation: the undo of %s did not finish: %s", e->name,
                     idem_errmsg());
            log_saga(call, IDEM_LOG_ERROR, what);
            return idem__err(code, "%s", what);
        }
        if (code != IDEM_OK) {
            (*stands)++;
            if (e->undo != NULL) {
                snprintf(what, sizeof(what),
                         "compensation: the undo of %s failed: %s: its "
                         "effect stands",
                         e->name, idem_errmsg());
                log_saga(call, IDEM_LOG_ERROR, what);
            }
        }
    }
    return IDEM_OK;
}

static bool any_undo(const idem_call *call)
{
    for (size_t i = 0; call->saga != NULL && i < call->saga->n; i++) {
        if (call->saga->steps[i].undo != NULL) {
            return true;
        }
    }
    return false;
}

/* Whether every step the journal lists is one of this run's effect-free ones. */
static bool no_effect(const idem_call *call, size_t recorded)
{
    size_t n = call->saga != NULL ? call->saga->n : 0;
    for (size_t i = 0; i < n; i++) {
        if (!call->saga->steps[i].effect_free) {
            return false;
        }
    }
    return n == recorded;
}

/* A compensation that could not finish now answers UNAVAILABLE: a retry (or the
 * re-driver) replays the steps and finishes it. */
static idem__kl_action unfinished(idem_call *call, idem_code *code)
{
    char why[IDEM_MAX_MESSAGE + 1];
    snprintf(why, sizeof(why), "%s", idem_errmsg());
    call->undos_unfinished = true;
    *code = idem_call_fail(call, IDEM_UNAVAILABLE,
                           "compensating: %s; retry with the same key to finish it", why);
    return idem__key_life_decide(IDEM__KL_COMPENSATING, IDEM__KL_UNDOS_UNFINISHED)->action;
}

/* Released for good: the journal goes, the next run derives new downstream keys. */
static idem__kl_action fresh(idem_call *call, saga_args *a, idem_code *code, const char *how)
{
    if (idem_store_run_txn(call->claim_store, fresh_txn, a) != IDEM_OK) {
        return unfinished(call, code);
    }
    if (how != NULL) {
        idem__call_set_meta(call, "idem-compensated", how);
    }
    return IDEM__KL_RELEASE_FRESH;
}

/* Runs the compensation a final failure needs (call.h); how its undos went (every one
 * ran, or an effect stands) is an event whose row ends it. */
static idem__kl_action compensate(idem_call *call, saga_args *a, idem_code *code, bool started)
{
    size_t recorded, stands;
    if (recorded_steps(call, &a->j, &recorded) != IDEM_OK) {
        return unfinished(call, code);
    }
    if (!started && !any_undo(call)) { /* every effect stands: the answer is final */
        return idem__key_life_decide(IDEM__KL_COMPENSATING, IDEM__KL_UNDOS_STAND)->action;
    }
    a->code = *code;
    a->msg = call->message != NULL ? call->message : "";
    if ((!started && idem_store_run_txn(call->claim_store, start_txn, a) != IDEM_OK) ||
        run_undos(call, &stands) != IDEM_OK) {
        return unfinished(call, code);
    }
    size_t known = call->saga != NULL ? call->saga->n : 0;
    bool all = stands == 0 && known == recorded;
    if (!all && known > stands) {
        idem__call_set_meta(call, "idem-compensated", "partial");
    }
    idem__kl_event end = all ? IDEM__KL_UNDOS_ALL : IDEM__KL_UNDOS_STAND;
    idem__kl_action action = idem__key_life_decide(IDEM__KL_COMPENSATING, end)->action;
    return action == IDEM__KL_RELEASE_FRESH ? fresh(call, a, code, "all") : action;
}

/* The journal's state after the handler (key_life.h): COMPENSATING once a compensation
 * started (its 'c' entry), STEPS when a recorded step had an effect, else LIVE. The
 * steps are read only when the outcome's row depends on them (a final failure or a
 * refusal); an outcome that keeps the journal as it is (OK, transient) does not read. */
idem__kl_action idem__call_saga_end(idem_call *call, idem_code *code, idem__kl_event ev)
{
    saga_args a = {.call = call};
    char msg[IDEM_MAX_MESSAGE + 1];
    size_t recorded;
    idem_code fail;
    idem__kl_action with_steps = idem__key_life_decide(IDEM__KL_STEPS, ev)->action;
    if (!(call->method->opts.flags & IDEM_METHOD_STEPS) || !call->executed ||
        call->claim_store == NULL) {
        return idem__key_life_decide(IDEM__KL_LIVE, ev)->action;
    }
    if (idem__journal_keys(call, NULL, &a.j) != IDEM_OK ||
        saga_read(call, &a.j, &fail, msg, sizeof(msg)) != IDEM_OK) {
        return unfinished(call, code);
    }
    if (fail != IDEM_OK && ev == IDEM__KL_RAN_TRANSIENT && !reached_every_step(call, &a.j)) {
        /* A transient answer is never final: storing the failure now would leave the
         * steps this run did not reach (their undos unknown to it) standing for good.
         * The compensation is unfinished (the COMPENSATING x RAN_TRANSIENT row). */
        idem__err(*code, "this run answered %s before it replayed every recorded step",
                  idem_code_name(*code));
        return unfinished(call, code);
    }
    if (fail != IDEM_OK) { /* a compensation started: its failure is the answer */
        *code = idem_call_fail(call, fail, "%s", msg);
        return compensate(call, &a, code, true);
    }
    if (with_steps != IDEM__KL_COMPENSATE) {
        return with_steps; /* a transient failure keeps the journal for the retry */
    }
    if (recorded_steps(call, &a.j, &recorded) != IDEM_OK) {
        return unfinished(call, code);
    }
    bool effect = recorded != 0 && !no_effect(call, recorded);
    idem__kl_action action =
        idem__key_life_decide(effect ? IDEM__KL_STEPS : IDEM__KL_LIVE, ev)->action;
    switch (action) {
    case IDEM__KL_COMPENSATE:
        return compensate(call, &a, code, false);
    case IDEM__KL_RELEASE_FRESH: /* nothing to give back: the key moves on */
        return fresh(call, &a, code, NULL);
    default: /* nothing to give back: a final code is stored */
        return action;
    }
}
