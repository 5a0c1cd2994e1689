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
 *                       kept before its first derived key leaves or with its first
 *                       record)
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "inflight.h"
#include "steps_internal.h"

#include "idemrpc/toolkit.h"

#define STEPS_DB IDEM__STEPS_DB
#define JKEY IDEM__JKEY

typedef idem__journal journal;

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

/* An undo runs after the handler returned (idem__call_saga_end, in the frame that ran
 * the handler): an undo_arg between that frame and this one, on this thread, points into
 * frames that are gone by then (the handler's locals). Under ASan's
 * detect_stack_use_after_return locals live on a fake stack this cannot see; ASan then
 * reports the undo's read itself. */
static idem_code undo_arg_check(const idem_call *call, const char *step, const idem_step_opts *o)
{
    uintptr_t here = (uintptr_t)__builtin_frame_address(0), top = (uintptr_t)call->undo_frame;
    uintptr_t p = o != NULL && o->undo != NULL ? (uintptr_t)o->undo_arg : 0;
    if (p == 0 || top == 0 || !pthread_equal(call->undo_thread, pthread_self()) ||
        p < (here < top ? here : top) || p >= (here < top ? top : here)) {
        return IDEM_OK;
    }
    return idem__err(IDEM_FAILED_PRECONDITION,
                     "step %s: its undo_arg points into the handler's stack, gone when the undo "
                     "runs: give the undo what it needs in the step's output (its done argument) "
                     "and pass as undo_arg only a context that outlives the call",
                     step);
}

/* A call's listing for the re-driver, written or deleted while the claim is its own. */
typedef struct listing {
    idem_call *call;
    journal j;
    uint64_t fence;
} listing;

static idem_code list_txn(idem_txn *t, void *arg)
{
    const listing *a = arg;
    const void *v;
    size_t n;
    idem_code code = idem__journal_claim_held(t, a->call, a->fence);
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
        listing a = {.call = call, .j = *j, .fence = call->fence};
        idem_store_run_txn(call->claim_store, list_txn, &a);
    }
}

/* Runs fn for a step not recorded yet: the thread's error detail is fn's own (or says
 * which step failed), never a stale one from the journal's reads. Not once the run's
 * own view of its lease has run out (keeper.c: counted from the ask of its claim or last
 * renewal, so it ends before the store's): the store's answer that the claim is held
 * may have come late, and another run may take the call over at any moment. */
static idem_code run_fn(idem_call *call, const char *step, idem_step_fn fn, void *arg,
                        idem_step_result *out)
{
    if (call->claim_keep != NULL &&
        idem__keeper_lost(idem__inflight_keeper(call->rt->inflight), call->claim_keep)) {
        call->claim_lost = true;
        return idem__err(IDEM_ABORTED,
                         "claim lost: this run's lease ran out before step %s (no renewal "
                         "reached the store in time); retry with the same key",
                         step);
    }
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
    journal j;
    void *v;
    size_t n;
    memset(out, 0, sizeof(*out));
    idem_code code = step_check(call, step, fn);
    if (code != IDEM_OK || (code = undo_arg_check(call, step, opts)) != IDEM_OK ||
        (code = idem__journal_keys(call, step, &j)) != IDEM_OK) {
        return code;
    }
    code = idem__journal_look_up(call, &j, &v, &n);
    if (code == IDEM_OK) { /* an earlier run recorded it */
        out->data = v;
        out->len = n;
        out->replayed = true;
        list_call(call, &j); /* a retry that only replays, then dies, is listed too */
        if ((code = idem__saga_add(call, step, opts, out)) != IDEM_OK ||
            (code = idem__saga_replayed(call, &j)) != IDEM_OK) {
            idem_step_result_clear(out);
        }
        return code;
    }
    /* Not ours any more (a takeover, or the call's outcome is recorded): fn must not
     * run. The record txn checks again, as the claim may go while fn runs. Nor once a
     * compensation has started: the call's outcome is its failure. */
    if (code != IDEM_NOT_FOUND || (code = idem__saga_check(call, &j)) != IDEM_OK ||
        (code = run_fn(call, step, fn, arg, out)) != IDEM_OK) {
        idem_step_result_clear(out);
        return code;
    }
    if (out->len > IDEM_MAX_STEP_OUTPUT || (out->data == NULL && out->len > 0)) {
        idem_step_result_clear(out);
        return idem__err(IDEM_INVALID_ARGUMENT, "a step's output is 0..%d bytes of data",
                         IDEM_MAX_STEP_OUTPUT);
    }
    if ((code = idem__journal_record(call, &j, out->data, out->len)) != IDEM_OK ||
        (code = idem__saga_add(call, step, opts, out)) != IDEM_OK) {
        idem_step_result_clear(out);
    }
    return code;
}

static idem_code pin_txn(idem_txn *t, void *arg)
{
    const listing *a = arg;
    idem_code code = idem__journal_claim_held(t, a->call, a->fence);
    return code != IDEM_OK ? code : idem__journal_keep_generation(t, a->call, &a->j);
}

idem_code idem__call_steps_pin(idem_call *call)
{
    listing a = {.call = call, .fence = call->fence};
    if (!atomic_load(&call->step_gen_pin)) {
        return IDEM_OK;
    }
    if (call->claim_store == NULL) {
        return idem__err(IDEM_FAILED_PRECONDITION, "keys are derived only inside the call's claim");
    }
    idem_code code = idem__journal_keys(call, NULL, &a.j);
    if (code == IDEM_OK && (code = idem_store_run_txn(call->claim_store, pin_txn, &a)) == IDEM_OK) {
        atomic_store(&call->step_gen_pin, false);
    }
    return code;
}

idem_code idem__call_steps_forget_in(idem_call *call, idem_txn *t)
{
    journal j;
    idem_code code = idem__journal_keys(call, NULL, &j);
    return code != IDEM_OK ? code : idem__journal_forget_txn(t, &j);
}

/* The keeper's completion of an outcome recorded later (j: the call's journal keys): as
 * record_journaled's, the journal deleted in the completion's txn; a journal that cannot
 * be deleted for another reason than an outage leaves the outcome recorded alone (a
 * re-driver deletes it). */
static idem_code complete_forgetting(void *j, idem_store *st, const idem_key_ref *key,
                                     uint64_t owner, const uint8_t *response, size_t len,
                                     uint64_t expires_ms, uint64_t now_ms)
{
    idem_txn *t;
    idem_code code = idem__store_txn_begin(st, &t);
    if (code != IDEM_OK) {
        return code;
    }
    if ((code = idem__journal_forget_txn(t, j)) == IDEM_OK) {
        return idem__store_txn_complete_commit(t, key, owner, response, len, expires_ms, now_ms);
    }
    idem__store_txn_abort(t);
    if (code == IDEM_UNAVAILABLE || code == IDEM_RESOURCE_EXHAUSTED) {
        return code;
    }
    return idem__store_complete_at(st, key, owner, response, len, expires_ms, now_ms, 0);
}

idem_code idem__call_steps_record_with(idem_call *call, idem__record_with *with)
{
    journal *j = malloc(sizeof(*j));
    idem_code code = j != NULL ? idem__journal_keys(call, NULL, j)
                               : idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    if (code != IDEM_OK) {
        free(j);
        return code;
    }
    *with = (idem__record_with){.complete = complete_forgetting, .arg = j};
    return IDEM_OK;
}

/* The owner's unlisting, before it releases: the claim is still its own. */
static idem_code owner_unlist_txn(idem_txn *t, void *arg)
{
    const listing *a = arg;
    idem_code code = idem__journal_claim_held(t, a->call, a->fence);
    if (code == IDEM_OK) {
        code = idem_txn_del(t, STEPS_DB, a->j.call_key, JKEY);
    }
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

idem_code idem__call_steps_relist(idem_call *call)
{
    journal j;
    idem_code code = idem__journal_keys(call, NULL, &j);
    if (code == IDEM_OK) {
        list_call(call, &j);
    }
    return code;
}

idem_code idem__call_steps_unlist(idem_call *call)
{
    listing a = {.call = call, .fence = call->fence};
    bool listed;
    idem_code code = idem__journal_keys(call, NULL, &a.j);
    if (code != IDEM_OK ||
        (code = idem__journal_entry_exists(call->claim_store, a.j.call_key, &listed)) != IDEM_OK ||
        !listed) {
        return code;
    }
    return idem_store_run_txn(call->claim_store, owner_unlist_txn, &a);
}
