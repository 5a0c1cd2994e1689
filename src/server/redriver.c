/* The re-driver (brandur's "completer"): a call of an IDEM_METHOD_STEPS method that
 * recorded a step and whose owner then died (killed, or stuck past max_run_ms) keeps
 * an IN_PROGRESS record whose lease runs out; only a client retry would finish it. On
 * a server with idem_server_opts.redrive_interval_ms set, every such call is listed in
 * its journal (steps.c) while it may still need finishing, and this thread looks at up
 * to redrive_batch listed calls every interval, and for each does what its row in the
 * key's life table says (key_life.c, the re-driver pass events):
 *
 *   this request's record, IN_PROGRESS, lease expired, or no record while listed (a
 *       re-run of it was released after a transient failure) → count a re-run (at most
 *       redrive_max_runs: a request that kills its process cannot crash-loop it) and
 *       run the stored request again through the whole chain, as its first run's
 *       caller, under its first run's key, with a new deadline: the claim takes the
 *       record over (or, if a client retry got there first, waits and replays), the
 *       recorded steps replay, the rest run, and the outcome is recorded for the
 *       client's next retry; the answer itself goes only to the log
 *   this request's record, COMPLETED → the outcome is recorded but the journal
 *       outlived it (deleting it at completion failed): delete it, or a later call with
 *       the same key, once the record is gone, would replay its steps
 *   the key now another request's → unlist it: the journal stays for this request's
 *       retry; not once its compensation started: it stays listed and is re-run once
 *       the key is free (meanwhile another request is refused, saga.c)
 *   lease alive → leave it to its owner
 *
 * Each write re-reads the record in its own txn, so a claim, completion or sweep
 * between the look and the write is seen. One call at a time, on this thread; a pass
 * looks at most redrive_batch listings, and stops with the server. Re-runs that
 * executed the handler are logged at the error level (an owner died), the rest at info;
 * all are counted (idem_redrives_total). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "periodic.h"
#include "journal.h"
#include "key_life.h"
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
    idem_key_ref key = {jc->key_ref.caller, jc->key_ref.method, jc->key_ref.key};
    idem__log(r->cfg.rt->obs, level, "redrive method=%s caller=%s key_hash=%08x msg=%s",
              idem__logfmt_quote(method, sizeof(method), jc->key_ref.method),
              idem__logfmt_quote(caller, sizeof(caller), jc->key_ref.caller), idem__key_hash(&key),
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
 * would, and logs how it ended. counted: this re-driver counted the run (and takes it
 * back when it did not run). */
static void rerun(idem_redriver *r, const idem__journaled_call *jc, const idem_method *m,
                  bool counted)
{
    idem_peer peer = {.redriven = true, .redriven_verified = jc->caller_verified};
    idem_served s;
    char what[IDEM_LOGQ_CAP];
    uint64_t run_ms = m->opts.max_run_ms ? m->opts.max_run_ms : r->cfg.run_ms;
    snprintf(peer.redriven_caller, sizeof(peer.redriven_caller), "%s", jc->key_ref.caller);
    snprintf(peer.redriven_key, sizeof(peer.redriven_key), "%s", jc->key_ref.key);
    peer.redriven_deadline_ms = idem__add_sat(idem__rt_now_ms(r->cfg.rt), run_ms);
    /* Not sent anywhere: the answer is only logged (message included), so it is loaded. */
    /* the stored request was accepted once: a front may have built it past max_frame */
    idem_run_opts opts = {.wire_reply = false, .frame_writable = false, .frame_built = true};
    if (!idem__dispatch_run(r->cfg.dispatch, jc->request, jc->request_len, &peer, opts, &s)) {
        idem__dispatch_discard(&s); /* cannot happen: this call neither defers nor parks */
        return;
    }
    const idem_call *c = &s.call;
    const char *how = c->executed   ? "ran it again"
                      : c->replayed ? "another run had finished it: replayed its outcome"
                                    : "did not run it";
    char run[48];
    if (jc->runs < r->cfg.max_runs) {
        snprintf(run, sizeof(run), "re-run %u of %u", jc->runs + 1, r->cfg.max_runs);
    } else {
        snprintf(run, sizeof(run), "compensating run %u", jc->runs - r->cfg.max_runs + 1);
    }
    snprintf(what, sizeof(what),
             "its owner's lease ran out; %s from its stored request: %s: %s%s%s", run, how,
             idem_code_name(c->code), c->message != NULL ? ": " : "",
             c->message != NULL ? c->message : "");
    /* Only a re-run that died counts against redrive_max_runs. Taken back: one turned
     * away before the handler by something passing (a full or unreachable store, a live
     * owner); one that lost its claim or its own lease while this process lived, within
     * its max run time (past it, its lease was no longer renewed: abandoned); and one
     * that left its compensation unfinished (an undo's downstream still failing): the
     * next pass runs it again, for as long as that lasts, one run a pass. */
    bool passing = c->code == IDEM_UNAVAILABLE || c->code == IDEM_RESOURCE_EXHAUSTED ||
                   c->code == IDEM_ABORTED;
    bool alive = (c->claim_lost && idem__mono_ms() - c->claim_asked_ms < run_ms) ||
                 c->undos_unfinished;
    log_call(r, c->executed && !c->undos_unfinished ? IDEM_LOG_ERROR : IDEM_LOG_INFO, jc, what);
    idem__redrive_verdict v;
    if (counted && alive &&
        idem__steps_uncount_run(r->cfg.store, jc, r->cfg.max_runs, &v) != IDEM_OK) {
        log_failure(r, "taking back a re-run that lived");
    } else if (counted && !alive && !c->executed && !c->replayed && passing &&
               idem__steps_count_run(r->cfg.store, jc, r->cfg.max_runs, true, &v) != IDEM_OK) {
        log_failure(r, "taking back a re-run that did not run");
    }
    idem__observe_redrive(r->cfg.rt->obs, c->executed ? IDEM__REDRIVE_RAN : IDEM__REDRIVE_OTHER);
    idem__dispatch_done(r->cfg.dispatch, &s);
}

/* An abandoned call: re-run it, unless it had its re-runs. false: the store failed. */
static bool redrive(idem_redriver *r, const idem__journaled_call *jc)
{
    const idem_method *m = r->cfg.find_method(r->cfg.find_arg, jc->key_ref.method);
    idem__redrive_verdict v;
    if (m == NULL || !(m->opts.flags & IDEM_METHOD_STEPS) ||
        jc->runs >= IDEM__REDRIVE_LIMIT(r->cfg.max_runs)) {
        return true; /* another server's method on this store; or given up before */
    }
    if (idem__steps_count_run(r->cfg.store, jc, r->cfg.max_runs, false, &v) != IDEM_OK) {
        log_failure(r, "counting a re-run");
        return false;
    }
    if (v == IDEM__REDRIVE_GAVE_UP || v == IDEM__REDRIVE_COMPENSATE) {
        char what[320];
        snprintf(what, sizeof(what),
                 "its owner's lease ran out again after %u re-runs that died or were released "
                 "(runs that lost their claim alive are not counted): not re-run any more; %s",
                 r->cfg.max_runs,
                 v == IDEM__REDRIVE_COMPENSATE
                     ? "compensating: the undos of its recorded steps run, and its failure "
                       "is its outcome"
                     : "nothing recorded to give back: it waits for a client retry (or an "
                       "operator)");
        log_call(r, IDEM_LOG_ERROR, jc, what);
        idem__observe_redrive(r->cfg.rt->obs, IDEM__REDRIVE_GAVE_UP_COUNT);
    }
    if (v == IDEM__REDRIVE_GO || v == IDEM__REDRIVE_COMPENSATE || v == IDEM__REDRIVE_GO_UNCOUNTED) {
        rerun(r, jc, m, v != IDEM__REDRIVE_GO_UNCOUNTED);
    }
    return true;
}

/* The listed call's row in the key's life (key_life.h), from its record: this
 * request's (COMPLETED, LIVE, LAPSED), absent (RELEASED: listed, so its journal is kept;
 * a compensating one too: its row is the same), or another request's (REDRIVE_OTHER:
 * the unlisting's txn reads whether its compensation started, which keeps it listed).
 * Each write decides again on the record its own txn reads (steps_redrive.c).
 * false: the store failed. */
static bool visit_row(idem_redriver *r, const idem__journaled_call *jc,
                      const idem__key_life_row **row)
{
    idem_key_ref key = {jc->key_ref.caller, jc->key_ref.method, jc->key_ref.key};
    idem_record rec;
    idem_code code = idem_store_get(r->cfg.store, &key, &rec);
    uint64_t now = rec.now_ms ? rec.now_ms : idem__rt_now_ms(r->cfg.rt);
    bool ours = code == IDEM_OK && memcmp(rec.fingerprint, jc->fingerprint, 32) == 0;
    idem__kl_state state = !ours                             ? IDEM__KL_RELEASED
                           : rec.state == IDEM_REC_COMPLETED ? IDEM__KL_COMPLETED
                           : rec.lease_until_ms <= now       ? IDEM__KL_LAPSED
                                                             : IDEM__KL_LIVE;
    *row = idem__key_life_decide(state, code == IDEM_OK && !ours ? IDEM__KL_REDRIVE_OTHER
                                                                 : IDEM__KL_REDRIVE);
    idem_record_clear(&rec);
    return code == IDEM_OK || code == IDEM_NOT_FOUND;
}

/* Acts on one listed call's row. false: the store failed (logged), end the pass. */
static bool visit(idem_redriver *r, const idem__journaled_call *jc)
{
    const idem__key_life_row *row;
    idem__redrive_verdict v = IDEM__REDRIVE_SKIP;
    bool ok = true;
    if (!visit_row(r, jc, &row)) {
        log_failure(r, "reading a listed call's record");
        return false;
    }
    switch (row->action) {
    case IDEM__KL_FORGET_JOURNAL:
        if (!(ok = idem__steps_forget_completed(r->cfg.store, jc, &v) == IDEM_OK)) {
            log_failure(r, "removing a completed call's journal");
        } else if (v == IDEM__REDRIVE_DONE) {
            log_call(r, IDEM_LOG_INFO, jc, "removed the step journal of a completed call");
            idem__observe_redrive(r->cfg.rt->obs, IDEM__REDRIVE_REMOVED);
        }
        break;
    case IDEM__KL_RERUN: /* abandoned, or a re-run of it was released: still listed */
        ok = redrive(r, jc);
        break;
    case IDEM__KL_UNLIST:
        if (!(ok = idem__steps_unlist(r->cfg.store, jc, &v) == IDEM_OK)) {
            log_failure(r, "unlisting a call whose key another request holds");
        }
        break;
    default: /* KEEP: its owner's lease is live */
        break;
    }
    return ok;
}

/* One pass: up to batch listed calls from where the last pass stopped. */
static void pass(void *arg, idem_periodic *p)
{
    idem_redriver *r = arg;
    for (size_t i = 0; i < r->cfg.batch && !idem__periodic_stopping(p) &&
                       !idem__dispatch_stopping(r->cfg.dispatch);
         i++) {
        idem__journaled_call jc;
        idem_code code = idem__steps_next_call(r->cfg.store, r->cursor, &jc);
        bool more = code == IDEM_OK || code == IDEM_DATA_LOSS || code == IDEM_UNIMPLEMENTED;
        if (code == IDEM_OK) {
            more = visit(r, &jc);
        } else if (code == IDEM_DATA_LOSS) {
            log_failure(r, "skipping a listing");
        } else if (code != IDEM_NOT_FOUND) { /* NOT_FOUND: the end; the next pass starts over */
            log_failure(r, "reading the listed calls");
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

void idem__redriver_run_now(idem_redriver *r)
{
    idem__periodic_run_now(r->thread);
}

void idem__redriver_stop(idem_redriver *r)
{
    if (r != NULL) {
        idem__periodic_stop(r->thread);
        free(r);
    }
}
