/* result_cache, the owner's side: the handler runs under the claim, and its outcome is
 * recorded (completed, or released with its token restored).
 *
 * Invariants:
 *   - an answer that is stored and replayed (OK and final errors) reaches its client
 *     only once it is on disk: committed with the claim's shared commit, or on its own;
 *     one the store could not record is answered UNAVAILABLE, and the lease keeper
 *     records it later with the lease renewed (duplicates wait), until it lands or the
 *     method's max_run_ms passes (record_later);
 *   - a handler whose fence was refused (its claim did not reach the disk) has nothing
 *     recorded: its client hears UNAVAILABLE whatever it answered (fence_refused);
 *   - a completion that lost its claim never sends a second, different OK (claim_lost);
 *   - the lease keeper stops, and the key's waiters wake, once the outcome is recorded,
 *     released or handed to the keeper; never while the claim still runs. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "key_life.h"
#include "result_cache.h"

/* The COMPLETED record's response (malloc'd) and times. */
static idem_code encode_result(const idem_call *call, const idem_cache_cfg *cfg, uint8_t **buf,
                               size_t *len, uint64_t *now, uint64_t *expires)
{
    const idem_method_opts *o = &call->method->opts;
    *now = idem__rt_now_ms(call->rt);
    *expires = idem__add_sat(*now, o->result_ttl_ms ? o->result_ttl_ms : cfg->result_ttl_ms);
    return idem__encode_call_response(call, false, buf, len);
}

/* Stores the call's response as the COMPLETED record: in the handler's own transaction
 * (committing its business writes with it) when it has one, else on its own, or in its
 * claim's commit when that is still open (ticket). */
static idem_code record_result(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                               uint64_t owner, idem_txn *txn, uint64_t ticket)
{
    uint64_t now, expires;
    uint8_t *buf;
    size_t len;
    idem_code st = encode_result(call, cfg, &buf, &len, &now, &expires);
    if (st != IDEM_OK) {
        if (txn != NULL) {
            idem__store_txn_abort(txn);
        }
        idem__store_ticket_drop(cfg->store, ticket);
        return st;
    }
    st = txn != NULL
             ? idem__store_txn_complete_commit(txn, key, owner, buf, len, expires, now)
             : idem__store_complete_at(cfg->store, key, owner, buf, len, expires, now, ticket);
    free(buf);
    return st;
}

/* The lease keeper stops renewing the claim (keep), and the key's waiters wake. */
static void end_keep(idem_call *call, idem_keep *keep, const idem_key_ref *key)
{
    idem__inflight_unkeep(call->rt->inflight, keep);
    idem__inflight_notify(call->rt->inflight, idem__inflight_bucket(key));
}

/* One logfmt error line about this call (request id, method, what went wrong). */
static void log_error(const idem_call *call, const char *what)
{
    char id[IDEM_LOGQ_CAP], msg[IDEM_LOGQ_CAP];
    idem__log(call->rt->obs, IDEM_LOG_ERROR, "request_id=%s method=\"%s\" msg=%s",
              idem__logfmt_quote(id, sizeof(id), call->request_id), call->method->name,
              idem__logfmt_quote(msg, sizeof(msg), what));
}

/* The outcome of a journaled call (IDEM_METHOD_STEPS) recorded in one txn with the
 * deletion of its journal, listing and key generation: a crash between two commits left
 * the listing, and once the record was swept the re-driver ran the completed call again.
 * A deletion the store refuses (not an outage: that is retried whole) does not hold the
 * outcome back: it is recorded alone, and the re-driver deletes the journal later. */
static idem_code record_journaled(idem_call *call, const idem_cache_cfg *cfg,
                                  const idem_key_ref *key, uint64_t owner)
{
    idem_txn *txn;
    char detail[IDEM_LOGQ_CAP];
    idem_code st = idem__store_txn_begin(cfg->store, &txn);
    if (st != IDEM_OK) {
        return st;
    }
    if ((st = idem__call_steps_forget_in(call, txn)) == IDEM_OK) {
        return record_result(call, cfg, key, owner, txn, 0);
    }
    idem__store_txn_abort(txn);
    if (st == IDEM_UNAVAILABLE || st == IDEM_RESOURCE_EXHAUSTED) {
        return st;
    }
    snprintf(detail, sizeof(detail),
             "deleting the step journal failed: %s; the outcome is recorded alone, and a "
             "re-driver deletes the journal",
             idem_errmsg());
    log_error(call, detail);
    return record_result(call, cfg, key, owner, NULL, 0);
}

/* After UNAVAILABLE, an ABORTED may mean our own earlier write did commit (its
 * acknowledgement was lost): the record then holds our result. */
static bool recorded_by_us(const idem_cache_cfg *cfg, const idem_key_ref *key, uint64_t owner,
                           bool completed)
{
    idem_record rec;
    idem_code code = idem_store_get(cfg->store, key, &rec);
    bool ours = completed ? code == IDEM_OK && rec.state == IDEM_REC_COMPLETED && rec.owner == owner
                          : code == IDEM_NOT_FOUND;
    idem_record_clear(&rec);
    return ours;
}

/* Completes (or releases) the claim, retrying a transient store failure (a database
 * restarting) for up to IDEM_OUTAGE_RETRY_MS (idem__outage_again): the handler has run,
 * and a lost record would let the next retry run it again once the lease ends. A
 * completion also waits out a full store (RESOURCE_EXHAUSTED: nothing was written),
 * which gets room back when records expire or another writer deletes; a release does
 * not need to (a lost release only keeps the key until its lease ends), so a refused
 * call is answered at once. */
static idem_code record_retrying(idem_call *call, const idem_cache_cfg *cfg,
                                 const idem_key_ref *key, uint64_t owner, bool complete)
{
    idem_outage o = idem__outage_start();
    bool retried = false;
    bool journaled = complete && (call->method->opts.flags & IDEM_METHOD_STEPS) &&
                     call->claim_ticket == 0 && idem__store_has(cfg->store, IDEM__STORE_CAP_TXN);
    for (;;) {
        uint64_t ticket = call->claim_ticket; /* the first attempt ends a shared claim */
        call->claim_ticket = 0;
        idem_code st = journaled  ? record_journaled(call, cfg, key, owner)
                       : complete ? record_result(call, cfg, key, owner, NULL, ticket)
                                  : idem__store_release_shared(cfg->store, key, owner, ticket);
        if (st == IDEM_ABORTED && retried && recorded_by_us(cfg, key, owner, complete)) {
            return IDEM_OK;
        }
        bool again = st == IDEM_UNAVAILABLE || (complete && st == IDEM_RESOURCE_EXHAUSTED);
        if (!idem__outage_again(&o, again)) {
            return st;
        }
        retried = true;
    }
}

/* Our claim was taken over while the handler ran (it outlived max_run_ms, or the store
 * was unreachable for a whole lease). Its answer must not be a second, different OK:
 * the client gets the winner's stored result, or ABORTED to retry with the same key.
 * The line names the key (its hash) and when the lease ran out by this owner's own count
 * (lapsed_at, wall ms; 0: it had not, which no store should allow). */
static idem_code claim_lost(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                            const uint8_t fingerprint[IDEM_FINGERPRINT_LEN], uint64_t lapsed_at)
{
    idem_record rec;
    char id[IDEM_LOGQ_CAP], hash[IDEM_LOG_KEY_HASH_CAP];
    idem__log_key_hash(hash, call->key);
    idem__log(call->rt->obs, IDEM_LOG_ERROR,
              "request_id=%s method=\"%s\" key=%s lapsed_at_ms=%" PRIu64 " msg=\"claim lost "
              "while the handler ran; its answer is discarded%s\"",
              idem__logfmt_quote(id, sizeof(id), call->request_id), call->method->name, hash,
              lapsed_at,
              lapsed_at != 0 ? "" : " (its lease had not run out by this owner's count)");
    idem_code code = idem_store_get(cfg->store, key, &rec);
    call->claim_lost = true;
    idem__call_reset_response(call);
    if (code == IDEM_OK && rec.state == IDEM_REC_COMPLETED &&
        memcmp(rec.fingerprint, fingerprint, IDEM_FINGERPRINT_LEN) == 0) {
        code = idem__rc_replay(call, &rec);
    } else {
        code = idem__reject(call, IDEM_REASON_CLAIM_LOST, IDEM_ABORTED,
                            "claim lost: the lease expired while the handler ran; retry with "
                            "the same key");
    }
    idem_record_clear(&rec);
    return code;
}

/* Whether the owner's row for this outcome stores it (else the claim is released). */
static bool released_code(const idem_call *call, idem_code code)
{
    return idem__key_life_decide(IDEM__KL_LIVE, idem__key_life_outcome(call, code))->action !=
           IDEM__KL_STORE;
}

/* Ends a handler txn whose handler did not answer OK: a transient code rolls it back
 * (when the claim is in it, that frees the key; else the claim is released); a final
 * one loses the business writes but records itself, in the txn when the claim is in it. */
static idem_code end_txn_not_ok(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                                uint64_t owner, idem_txn *txn, bool claimed_in_txn, bool released)
{
    idem_code st;
    if (!claimed_in_txn) {
        idem__store_txn_abort(txn); /* business writes vanish; the claim is committed */
        return record_retrying(call, cfg, key, owner, !released);
    }
    if (released) {
        idem__store_txn_abort(txn); /* the claim goes with the writes */
        return IDEM_OK;
    }
    if ((st = idem__store_txn_undo(txn)) != IDEM_OK) {
        idem__store_txn_abort(txn);
        return st;
    }
    return record_result(call, cfg, key, owner, txn, 0);
}

/* record_retrying for a claim-mode run, as its row's action says, with its journaled
 * steps (IDEM_METHOD_STEPS). A release that keeps them for the retry (RELEASE,
 * RELEASE_KEEP_JOURNAL) first takes the call off the re-driver's list (the claim still
 * live: a transient failure is the client's to retry), listing it again if the release
 * then fails; not when the re-driver ran it: its client is gone, so the re-driver tries
 * again within its budget. A compensation's release: RELEASE_FRESH deleted the journal,
 * RELEASE_KEEP_LISTED keeps it listed for the re-driver to finish. A recorded outcome
 * deletes them in its own txn (record_journaled). Steps' failures are logged, never the
 * call's answer. */
static idem_code record_run(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                            uint64_t owner, idem__kl_action action)
{
    bool steps = (call->method->opts.flags & IDEM_METHOD_STEPS) != 0;
    bool released = action != IDEM__KL_STORE;
    bool unlist = steps && call->pinned_key == NULL &&
                  (action == IDEM__KL_RELEASE || action == IDEM__KL_RELEASE_KEEP_JOURNAL);
    if (unlist && idem__call_steps_unlist(call) != IDEM_OK) {
        log_error(call, idem_errmsg());
    }
    idem_code st = record_retrying(call, cfg, key, owner, !released);
    if (st != IDEM_OK && unlist) {
        idem__call_steps_relist(call); /* best effort, as the listing itself */
    }
    return st;
}

/* A final outcome the store could not record (a commit that failed on a disk error, or
 * an outage or a full store that outlasted IDEM_OUTAGE_RETRY_MS): no answer that is
 * stored and replayed, OK least of all, leaves for it, or a retry after the lease could
 * run the handler again and contradict it. The claim stays: the lease keeper renews it and
 * records the outcome later (keeper.c), duplicates wait for it meanwhile, and this
 * client hears UNAVAILABLE: its retry with the same key waits for the record and
 * replays it. Only when even that cannot be arranged (no keeper entry: out of memory)
 * does the lease run out; the client was never told OK either way. */
static idem_code record_later(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                              idem_keep *keep)
{
    char why[256], detail[IDEM_LOGQ_CAP];
    uint8_t *buf = NULL;
    size_t len;
    uint64_t now, expires;
    snprintf(why, sizeof(why), "%s", idem_errmsg());
    idem__record_with with = {0}; /* a journaled call's journal goes with the record */
    bool journaled = (call->method->opts.flags & IDEM_METHOD_STEPS) &&
                     idem__store_has(cfg->store, IDEM__STORE_CAP_TXN);
    bool later = keep != NULL && encode_result(call, cfg, &buf, &len, &now, &expires) == IDEM_OK &&
                 (!journaled || idem__call_steps_record_with(call, &with) == IDEM_OK);
    if (later) {
        idem__inflight_record_later(call->rt->inflight, keep, buf, len, expires - now, &with);
    } else {
        free(buf);
        end_keep(call, keep, key);
    }
    snprintf(detail, sizeof(detail), "recording the outcome failed: %s; %s", why,
             later ? "it is recorded again in the background" : "its lease runs out");
    log_error(call, detail);
    idem__call_reset_response(call);
    idem__reject(call, IDEM_REASON_STORE, IDEM_UNAVAILABLE,
                 "the outcome is not on disk yet (%s); retry with the same key: the retry "
                 "gets it once it is recorded",
                 why);
    return idem__rc_retry_after(call, IDEM_UNAVAILABLE);
}

/* What follows the record of a run (st: how it went): the lease keeper stops, the key's
 * waiters wake (unless the end of an asynchronous record did both: done, or the keeper
 * records the outcome later), and a failed record decides the answer. */
static idem_code after_record(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                              uint64_t owner, idem_keep *keep, idem_code code, idem_code st,
                              bool claimed_in_txn, bool done)
{
    bool transactional = (call->method->opts.flags & IDEM_METHOD_TRANSACTIONAL) != 0;
    bool refused = call->fence_state == IDEM__FENCE_REFUSED;
    bool later = st != IDEM_OK && st != IDEM_ABORTED && !transactional && !refused &&
                 !released_code(call, code);
    uint32_t bucket = idem__inflight_bucket(key);
    uint64_t lapsed_at = /* before the keeper forgets keep */
        st == IDEM_ABORTED ? idem__keeper_lapsed_at(idem__inflight_keeper(call->rt->inflight), keep)
                           : 0;
    idem__store_ticket_drop(cfg->store, call->claim_ticket); /* no path before left one */
    call->claim_ticket = 0;
    call->claim_store = NULL;
    if (!done && !later) {
        /* Renewed until now: recording may retry through a store outage for longer than a
         * lease, and a lapse would let another instance take over and run it again. */
        end_keep(call, keep, key);
    }
    if (st == IDEM_OK) {
        return code;
    }
    if (transactional) {
        /* Nothing committed, not the effect nor the record, or a commit whose outcome is
         * unknown (its acknowledgement was lost): either way the retry with the same key
         * replays or runs once. Say why (a release may fail too, e.g. on a full store,
         * and would overwrite idem_errmsg), and free the key. */
        char why[256];
        snprintf(why, sizeof(why), "%s", idem_errmsg());
        if (!claimed_in_txn) {
            idem_store_release(cfg->store, key, owner);
            idem__inflight_notify(call->rt->inflight, bucket);
        }
        return idem__reject(call, IDEM_REASON_STORE, st,
                            "not committed, or its outcome is unknown: %s; retry with the same "
                            "key",
                            why);
    }
    if (st == IDEM_ABORTED) { /* a refused fence: its claim is gone, as its answer says */
        return refused ? code : claim_lost(call, cfg, key, call->fingerprint, lapsed_at);
    }
    if (later) {
        return record_later(call, cfg, key, keep);
    }
    /* A release that failed: its answer (transient, or a refusal) stands, and the record
     * stays IN_PROGRESS until its lease ends. */
    char detail[IDEM_LOGQ_CAP];
    snprintf(detail, sizeof(detail), "recording the outcome failed: %s", idem_errmsg());
    log_error(call, detail);
    return code;
}

/* The store's writer thread: the commit of an asynchronous record has ended. A
 * committed outcome frees the key's waiters at once; the worker that resumes the call
 * does the rest (record_resumed). */
static void recorded(void *arg, idem_code st, const char *err)
{
    idem_call *call = arg;
    struct idem__recording *r = &call->recording;
    r->st = st;
    snprintf(r->err, sizeof(r->err), "%s", err);
    if (st == IDEM_OK) {
        idem_key_ref key = {idem_call_caller(call), call->method->name, call->key};
        end_keep(call, r->keep, &key); /* never waits for the store */
        r->keep = NULL;
    }
    call->rt->resume(call->rt->resume_arg, call);
}

/* Records a run's final outcome in its claim's shared commit without holding the worker
 * while the commit runs: the call suspends (IDEM__SUSPEND_RECORD) and resumes here, at
 * result_cache, once the commit has ended. false: not so (nothing queued; the worker
 * records it itself). */
static bool record_async(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                         uint64_t owner, idem_keep *keep, idem_code code, idem_next next)
{
    struct idem__recording *r = &call->recording;
    uint64_t now, expires;
    uint8_t *buf;
    size_t len;
    if (call->claim_ticket == 0 || !call->parkable || !call->rt->can_park ||
        call->rt->resume == NULL ||
        encode_result(call, cfg, &buf, &len, &now, &expires) != IDEM_OK) {
        return false;
    }
    r->active = true;
    r->code = code;
    r->owner = owner;
    r->keep = keep;
    atomic_store(&r->turns, 2);
    call->resume_pos = next.pos - 1; /* this interceptor */
    if (idem__store_complete_async(cfg->store, key, owner, buf, len, expires, call->claim_ticket,
                                   recorded, call) != IDEM_OK) {
        r->active = false;
        free(buf);
        return false;
    }
    call->claim_ticket = 0; /* ended by that write */
    idem__call_suspend(call, IDEM__SUSPEND_RECORD);
    return true;
}

/* A call that record_async suspended, resumed on a worker once its commit has ended. */
idem_code idem__rc_record_resumed(idem_call *call, const idem_cache_cfg *cfg)
{
    struct idem__recording *r = &call->recording;
    idem_key_ref key = {idem_call_caller(call), call->method->name, call->key};
    idem_code st = r->st;
    bool done = st == IDEM_OK; /* recorded() stopped the keeper and woke the waiters */
    r->active = false;
    if (st != IDEM_OK) {
        idem__err(st, "%s", r->err);
    }
    if (st == IDEM_UNAVAILABLE || st == IDEM_RESOURCE_EXHAUSTED) {
        st = record_retrying(call, cfg, &key, r->owner, true); /* as the worker would have */
    }
    return after_record(call, cfg, &key, r->owner, r->keep, r->code, st, false, done);
}

/* The handler asked for its fence and the claim was not on disk (its commit and the
 * redo of it failed, or the key or the fence was taken meanwhile): it must not have
 * acted on it, so nothing it answered is kept. UNAVAILABLE, not stored: the retry with
 * the same key runs under a claim of its own (tests/test_disk.c). */
static idem_code fence_refused(idem_call *call)
{
    idem__call_reset_response(call);
    return idem__reject(call, IDEM_REASON_STORE, IDEM_UNAVAILABLE,
                        "the claim did not reach the disk, so no fence was handed out; retry "
                        "with the same key");
}

/* The owner's own count of its lease (keeper.c: from the ask of its claim or last
 * renewal) ran out before the handler started: a claim answered late (a slow store), a
 * worker that picked the call up late, renewals that did not land. The store may hand
 * the key to another run at any moment, so the handler does not start. Nothing is
 * written: the record stays IN_PROGRESS, for a renewal already on its way or a takeover
 * once the store's lease ends; the client hears ABORTED (retry with the same key). */
static idem_code lapsed_before_start(idem_call *call, const idem_cache_cfg *cfg,
                                     const idem_key_ref *key, idem_keep *keep)
{
    call->txn = NULL;
    call->claim_keep = NULL;
    call->claim_store = NULL;
    idem__store_ticket_drop(cfg->store, call->claim_ticket); /* the claim commits as it is */
    call->claim_ticket = 0;
    call->claim_lost = true;
    end_keep(call, keep, key);
    log_error(call, "claim lost: the lease ran out before the handler started; not run");
    return idem__reject(call, IDEM_REASON_CLAIM_LOST, IDEM_ABORTED,
                        "claim lost: this run's lease ran out before the handler started (no "
                        "renewal reached the store in time); retry with the same key");
}

/* A journaled call whose handler does not start (its claim is released): the key is
 * compensating an earlier request (ABORTED, like a call in progress: retry later), or
 * its generation could not be read. */
static idem_code steps_not_begun(idem_call *call, idem_code st)
{
    if (st != IDEM_ABORTED) {
        return idem__reject(call, IDEM_REASON_STORE, st, "steps: %s", idem_errmsg());
    }
    idem__reject(call, IDEM_REASON_IN_PROGRESS, st, "%s", idem_errmsg());
    return idem__rc_retry_after(call, st);
}

/* Runs the handler as the claim owner and records the outcome. txn is the handler txn
 * the claim was made in (stores with IDEM__STORE_CAP_TXN_CLAIM), else NULL; ticket the
 * claim's shared commit, still open maybe (the completion then joins it), else 0. */
idem_code idem__rc_run_owned(idem_call *call, idem_next next, const idem_cache_cfg *cfg,
                             const idem_key_ref *key, uint64_t owner, idem_txn *txn,
                             uint64_t ticket)
{
    const idem_method_opts *o = &call->method->opts;
    bool transactional = (o->flags & IDEM_METHOD_TRANSACTIONAL) != 0;
    bool claimed_in_txn = txn != NULL;
    idem_keep *keep = NULL;
    idem_code code, st;

    if (transactional && txn == NULL && (st = idem__store_txn_begin(cfg->store, &txn)) != IDEM_OK) {
        idem_store_release(cfg->store, key, owner);
        idem__inflight_notify(call->rt->inflight, idem__inflight_bucket(key));
        return idem__reject(call, IDEM_REASON_STORE, st, "%s", idem_errmsg());
    }
    if (!transactional) { /* a handler txn holds its claim: nobody can take over */
        uint64_t lease = o->lease_ms ? o->lease_ms : cfg->lease_ms;
        keep = idem__inflight_keep(call->rt->inflight, key, owner, lease,
                                   o->max_run_ms ? o->max_run_ms : cfg->max_run_ms,
                                   call->claim_asked_ms);
    }
    call->claim_keep = keep;
    call->txn = txn;
    call->fence = owner;
    call->fence_state = IDEM__FENCE_UNCHECKED;
    call->claim_store = cfg->store;
    call->claim_ticket = ticket;
    if ((o->flags & IDEM_METHOD_STEPS) && (st = idem__call_steps_begin(call)) != IDEM_OK) {
        code = steps_not_begun(call, st);
    } else if (keep != NULL && idem__keeper_lost(idem__inflight_keeper(call->rt->inflight), keep)) {
        return lapsed_before_start(call, cfg, key, keep);
    } else {
        call->undo_frame = __builtin_frame_address(0); /* the undos run in this frame */
        call->undo_thread = pthread_self();
        code = idem_call_next(call, next);
        call->undo_frame = NULL;
    }
    call->txn = NULL;
    call->claim_keep = NULL; /* after_record unkeeps it, or hands it to the keeper */
    bool refused = call->fence_state == IDEM__FENCE_REFUSED;
    if (refused) {
        code = fence_refused(call);
    }
    /* The key's row for this outcome; a journaled run's is its journal's (the undos may
     * run: the key's fate and the answer are then the compensation's). */
    idem__kl_event ev = idem__key_life_outcome(call, code);
    idem__kl_action action = txn == NULL && !refused
                                 ? idem__call_saga_end(call, &code, ev)
                                 : idem__key_life_decide(IDEM__KL_LIVE, ev)->action;
    bool released = action != IDEM__KL_STORE;
    if (txn != NULL && code == IDEM_OK && !released) {
        st = record_result(call, cfg, key, owner, txn, 0); /* effect and record together */
    } else if (txn != NULL) {
        st = end_txn_not_ok(call, cfg, key, owner, txn, claimed_in_txn, released);
    } else if (!released && record_async(call, cfg, key, owner, keep, code, next)) {
        return IDEM_OK; /* suspended: resumes in record_resumed */
    } else {
        st = record_run(call, cfg, key, owner, action);
    }
    return after_record(call, cfg, key, owner, keep, code, st, claimed_in_txn, false);
}
