/* The re-driver (brandur's "completer"): a call of an IDEM_METHOD_STEPS method that
 * recorded a step and whose owner then died (killed, or stuck past max_run_ms) keeps
 * an IN_PROGRESS record whose lease runs out; only a client retry would finish it. With
 * idem_server_opts.redrive_interval_ms set, this thread looks at up to redrive_batch of
 * the journaled calls (steps.c keeps each call's request with its first step) every
 * interval, and for each:
 *
 *   record IN_PROGRESS, lease expired → run the stored request again through the
 *       whole chain, as its first run's caller, with a new deadline: the claim takes
 *       the record over (or, if a client retry got there first, waits and replays),
 *       the recorded steps replay, the rest run, and the outcome is recorded for the
 *       client's next retry; the answer itself goes nowhere but the log
 *   record COMPLETED → the outcome is recorded but the journal outlived it (deleting
 *       it at completion failed): delete it, or a later call with the same key, once
 *       the record is gone, would replay its steps
 *   no record of this request (released after a transient failure, then its client
 *       gave up; or deleted; or the key since claimed by another request) → leave
 *       it to a client retry for the result TTL, as long as a record would have
 *       replayed; then delete it
 *   lease alive → leave it to its owner
 *
 * One call at a time, on this thread; every pass and every call is bounded. Each
 * re-run and each removal is logged (re-runs at the error level: an owner died). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "periodic.h"
#include "redriver.h"
#include "store.h"

struct idem_redriver {
    idem_redriver_cfg cfg;
    uint8_t cursor[IDEM__JOURNAL_CURSOR]; /* where the last pass stopped */
    idem_periodic *thread;
};

static void log_call(idem_redriver *r, idem_log_level level, const idem__journaled_call *jc,
                     const char *what)
{
    char caller[IDEM_LOGQ_CAP], method[IDEM_LOGQ_CAP], msg[IDEM_LOGQ_CAP];
    idem__log(
        r->cfg.rt->obs, level, "redrive method=%s caller=%s key_hash=%08x msg=%s",
        idem__logfmt_quote(method, sizeof(method), jc->key_ref.method),
        idem__logfmt_quote(caller, sizeof(caller), jc->key_ref.caller),
        idem__key_hash(&(idem_key_ref){jc->key_ref.caller, jc->key_ref.method, jc->key_ref.key}),
        idem__logfmt_quote(msg, sizeof(msg), what));
}

static void log_failure(idem_redriver *r, const char *what)
{
    char msg[IDEM_LOGQ_CAP], detail[IDEM_LOGQ_CAP];
    snprintf(detail, sizeof(detail), "redrive: %s: %s", what, idem_errmsg());
    idem__log(r->cfg.rt->obs, IDEM_LOG_ERROR, "msg=%s",
              idem__logfmt_quote(msg, sizeof(msg), detail));
}

/* Runs the stored request through decode, the chain and the handler, as a worker
 * would, and logs how it ended. */
static void rerun(idem_redriver *r, const idem__journaled_call *jc)
{
    idem_peer peer = {.redriven = true, .redriven_verified = jc->caller_verified};
    idem_served s;
    char what[IDEM_LOGQ_CAP];
    snprintf(peer.redriven_caller, sizeof(peer.redriven_caller), "%s", jc->key_ref.caller);
    peer.redriven_deadline_ms = idem__add_sat(idem__rt_now_ms(r->cfg.rt), r->cfg.run_ms);
    /* Not sent anywhere: the answer is only logged (message included), so it is loaded. */
    idem_run_opts opts = {.wire_reply = false, .frame_writable = false, .fast_only = false};
    if (!idem__dispatch_run(r->cfg.dispatch, jc->request, jc->request_len, &peer, opts, &s)) {
        idem__dispatch_discard(&s); /* cannot happen: this call neither defers nor parks */
        return;
    }
    snprintf(what, sizeof(what),
             "its owner's lease ran out: ran it again from its stored request: %s%s%s%s",
             idem_code_name(s.call.code), s.call.replayed ? " (replayed)" : "",
             s.call.message != NULL ? ": " : "", s.call.message != NULL ? s.call.message : "");
    log_call(r, IDEM_LOG_ERROR, jc, what);
    idem__observe_redrive(r->cfg.rt->obs, true);
    idem__dispatch_done(r->cfg.dispatch, &s);
}

static bool forget(idem_redriver *r, const idem__journaled_call *jc, const char *what)
{
    if (idem__steps_forget_journal(r->cfg.store, jc->base) != IDEM_OK) {
        log_failure(r, "removing a step journal");
        return false;
    }
    log_call(r, IDEM_LOG_INFO, jc, what);
    idem__observe_redrive(r->cfg.rt->obs, false);
    return true;
}

/* Decides about one journaled call. false: the store failed (logged), end the pass. */
static bool visit(idem_redriver *r, const idem__journaled_call *jc)
{
    idem_key_ref key = {jc->key_ref.caller, jc->key_ref.method, jc->key_ref.key};
    idem_record rec;
    idem_code code = idem_store_get(r->cfg.store, &key, &rec);
    uint64_t now = rec.now_ms ? rec.now_ms : idem__rt_now_ms(r->cfg.rt);
    bool ok = code == IDEM_OK || code == IDEM_NOT_FOUND;
    /* The record is this request's (a released key may since hold another request). */
    bool ours =
        code == IDEM_OK && memcmp(rec.fingerprint, jc->fingerprint, IDEM_FINGERPRINT_LEN) == 0;
    bool aged = now >= jc->at_ms && now - jc->at_ms >= r->cfg.result_ttl_ms;
    if (!ok) {
        log_failure(r, "reading a journaled call's record");
    } else if (code == IDEM_OK && rec.state == IDEM_REC_COMPLETED) {
        ok = forget(r, jc, "removed the step journal of a completed call");
    } else if (ours && rec.lease_until_ms <= now) {
        const idem_method *m = r->cfg.find_method(r->cfg.find_arg, jc->key_ref.method);
        if (m != NULL && (m->opts.flags & IDEM_METHOD_STEPS)) {
            rerun(r, jc);
        } /* else: another server's method on this store; its re-driver may run it */
    } else if (!ours && aged) {
        ok = forget(r, jc,
                    "removed the step journal of a call without a record, older than the "
                    "result TTL");
    }
    idem_record_clear(&rec);
    return ok;
}

/* One pass: up to batch journaled calls from where the last pass stopped. */
static void pass(void *arg, idem_periodic *p)
{
    idem_redriver *r = arg;
    for (size_t i = 0; i < r->cfg.batch && !idem__periodic_stopping(p); i++) {
        idem__journaled_call jc;
        idem_code code = idem__steps_next_call(r->cfg.store, r->cursor, &jc);
        bool more = code == IDEM_OK || code == IDEM_DATA_LOSS;
        if (code == IDEM_OK) {
            more = visit(r, &jc);
        } else if (code == IDEM_DATA_LOSS) {
            log_failure(r, "skipping an unreadable journaled call");
        } else if (code != IDEM_NOT_FOUND) { /* NOT_FOUND: the end; the next pass starts over */
            log_failure(r, "reading the step journals");
        }
        idem__journaled_call_clear(&jc);
        if (!more) {
            return;
        }
    }
}

idem_code idem__redriver_start(idem_redriver **out, const idem_redriver_cfg *cfg)
{
    idem_redriver *r = calloc(1, sizeof(*r));
    *out = NULL;
    if (r == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    r->cfg = *cfg;
    idem_code code = idem__periodic_start(&r->thread, cfg->interval_ms, pass, r, "re-driver");
    if (code != IDEM_OK) {
        free(r);
        return code;
    }
    *out = r;
    return IDEM_OK;
}

void idem__redriver_stop(idem_redriver *r)
{
    if (r != NULL) {
        idem__periodic_stop(r->thread);
        free(r);
    }
}
