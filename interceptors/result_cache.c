/* result_cache: claim before run, replay the first result to every duplicate.
 *
 *   read (replay fast path) → claim (one write txn) → run (lease renewed) → complete | release
 *
 * Only the claimer runs the handler; its lease is renewed while the handler runs (the
 * lease keeper in inflight.c), and the store-assigned owner is the call's fence. A
 * duplicate that reads a live lease does not write: it waits for the key (parked in
 * the in-flight table, holding no thread) up to its own deadline, else the server's
 * max wait, and replays the result; if the wait runs out it gets ABORTED "in progress"
 * with metadata retry-after-ms. Final codes are stored with the result TTL; transient
 * codes (and, by default, INVALID_ARGUMENT) release the claim and restore its token. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "call.h"
#include "store.h"

#include "inflight.h"

#define POLL_MS 20             /* first re-read while waiting (an owner in another process) */
#define MAX_POLL_MS 200        /* the re-read interval doubles up to this */
#define RETRY_AFTER_MS 100u    /* hint given with ABORTED "in progress" */
#define REPLY_MARGIN_MS 50u    /* stop waiting this long (at most 10%) before the deadline */
#define RECORD_RETRY_MS 10000u /* keep trying to record an outcome through a store outage */

/* The first result, with metadata idem-first-at. Kept as the stored bytes (rec's buffer
 * moves into the call) when the front sends wire replies, nothing before result_cache
 * can look at the response (every interceptor there is a built-in that tail-calls) and
 * the bytes are canonical: the nng front then sends them with the per-call fields
 * appended, as the decode + re-encode below would have written them. */
static idem_code replay(idem_call *call, idem_record *rec)
{
    char first_at[24];
    snprintf(first_at, sizeof(first_at), "%" PRIu64, rec->first_at_ms);
    if (call->wire_reply && call->rt->can_park && rec->response != NULL &&
        idem__replay_wire_ok(rec->response, rec->response_len)) {
        const uint8_t *w = rec->response;
        idem__call_reset_response(call);
        call->code = rec->response_len > 0 && w[0] == 0x08 ? (idem_code)w[1] : IDEM_OK;
        call->replay_wire = rec->response;
        call->replay_wire_len = rec->response_len;
        rec->response = NULL;
        rec->response_len = 0;
        memcpy(call->replay_first_at, first_at, sizeof(first_at));
        call->replayed = true;
        return call->code;
    }
    idem_code code = idem__load_call_response(call, rec->response, rec->response_len);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "replay: %s", idem_errmsg());
    }
    idem__call_set_meta(call, "idem-first-at", first_at);
    call->replayed = true;
    return call->code;
}

static idem_code reject_mismatch(idem_call *call)
{
    return idem__reject(call, IDEM_REASON_KEY_REUSED, IDEM_INVALID_ARGUMENT,
                        "idempotency key reused with a different request");
}

static idem_code answer_in_progress(idem_call *call)
{
    char hint[16];
    idem__reject(call, IDEM_REASON_IN_PROGRESS, IDEM_ABORTED,
                 "in progress: the first call with this key has not finished; retry with the "
                 "same key");
    snprintf(hint, sizeof(hint), "%u", RETRY_AFTER_MS);
    idem__call_set_meta(call, "retry-after-ms", hint);
    return IDEM_ABORTED;
}

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
 * restarting) for up to RECORD_RETRY_MS: the handler has run, and a lost record would
 * let the next retry run it again once the lease ends. A completion also waits out a
 * full store (RESOURCE_EXHAUSTED: nothing was written), which gets room back when
 * records expire or another writer deletes; a release does not need to (a lost release
 * only keeps the key until its lease ends), so a refused call is answered at once. */
static idem_code record_retrying(idem_call *call, const idem_cache_cfg *cfg,
                                 const idem_key_ref *key, uint64_t owner, bool complete)
{
    uint64_t give_up = idem__mono_ms() + RECORD_RETRY_MS, backoff = 10;
    bool retried = false;
    for (;;) {
        uint64_t ticket = call->claim_ticket; /* the first attempt ends a shared claim */
        call->claim_ticket = 0;
        idem_code st = complete ? record_result(call, cfg, key, owner, NULL, ticket)
                                : idem__store_release_shared(cfg->store, key, owner, ticket);
        if (st == IDEM_ABORTED && retried && recorded_by_us(cfg, key, owner, complete)) {
            return IDEM_OK;
        }
        bool again = st == IDEM_UNAVAILABLE || (complete && st == IDEM_RESOURCE_EXHAUSTED);
        if (!again || idem__mono_ms() + backoff > give_up) {
            return st;
        }
        idem__sleep_ms(backoff); /* before the next attempt */
        backoff = backoff * 2 > 500 ? 500 : backoff * 2;
        retried = true;
    }
}

/* One logfmt error line about this call (request id, method, what went wrong). */
static void log_error(const idem_call *call, const char *what)
{
    char id[IDEM_LOGQ_CAP], msg[IDEM_LOGQ_CAP];
    idem__log(call->rt->obs, IDEM_LOG_ERROR, "request_id=%s method=\"%s\" msg=%s",
              idem__logfmt_quote(id, sizeof(id), call->request_id), call->method->name,
              idem__logfmt_quote(msg, sizeof(msg), what));
}

/* Our claim was taken over while the handler ran (it outlived max_run_ms, or the store
 * was unreachable for a whole lease). Its answer must not be a second, different OK:
 * the client gets the winner's stored result, or ABORTED to retry with the same key. */
static idem_code claim_lost(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                            const uint8_t fingerprint[IDEM_FINGERPRINT_LEN])
{
    idem_record rec;
    idem_code code = idem_store_get(cfg->store, key, &rec);
    log_error(call, "claim lost while the handler ran; its answer is discarded");
    idem__call_reset_response(call);
    if (code == IDEM_OK && rec.state == IDEM_REC_COMPLETED &&
        memcmp(rec.fingerprint, fingerprint, IDEM_FINGERPRINT_LEN) == 0) {
        code = replay(call, &rec);
    } else {
        code = idem__reject(call, IDEM_REASON_CLAIM_LOST, IDEM_ABORTED,
                            "claim lost: the lease expired while the handler ran; retry with "
                            "the same key");
    }
    idem_record_clear(&rec);
    return code;
}

/* Answers that free the key instead of being stored: transient codes, by default a
 * handler's INVALID_ARGUMENT, and any answer given while the handler did not run (an
 * interceptor after result_cache said no, e.g. UNAUTHENTICATED or PERMISSION_DENIED:
 * nothing happened, and a stored refusal would be replayed to the corrected retry). */
static bool released_code(const idem_call *call, idem_code code)
{
    const idem_method_opts *o = &call->method->opts;
    uint32_t transient = o->transient_mask ? o->transient_mask : IDEM_TRANSIENT_CODES;
    if (!call->executed || (unsigned)code >= IDEM_CODE_COUNT) {
        return true; /* an out-of-range code from an interceptor is not an answer to keep */
    }
    return (IDEM_CODE_BIT(code) & transient) ||
           (code == IDEM_INVALID_ARGUMENT && !o->store_invalid_argument);
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

/* record_retrying for a claim-mode run, with its journaled steps (IDEM_METHOD_STEPS).
 * A release keeps them for the retry and first takes the call off the re-driver's list
 * (the claim still live: a transient failure is the client's to retry), listing it
 * again if the release then fails; not when the re-driver ran it: its client is gone,
 * so the re-driver tries again within its budget. A recorded outcome deletes them (a
 * failure only leaves them behind; a re-driver deletes them later). Steps' failures
 * are logged, never the call's answer. */
static idem_code record_run(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                            uint64_t owner, bool released, idem__saga_end saga)
{
    bool steps = (call->method->opts.flags & IDEM_METHOD_STEPS) != 0;
    /* A compensation's release: FRESH deleted the journal, UNFINISHED keeps it listed
     * for the re-driver to finish. */
    bool unlist = steps && released && call->pinned_key == NULL && saga == IDEM__SAGA_AS_IS;
    if (unlist && idem__call_steps_unlist(call) != IDEM_OK) {
        log_error(call, idem_errmsg());
    }
    idem_code st = record_retrying(call, cfg, key, owner, !released);
    if (st == IDEM_OK && steps && !released && idem__call_steps_forget(call) != IDEM_OK) {
        log_error(call, idem_errmsg());
    } else if (st != IDEM_OK && unlist) {
        idem__call_steps_relist(call); /* best effort, as the listing itself */
    }
    return st;
}

/* What follows the record of a run (st: how it went): the lease keeper stops, the key's
 * waiters wake (unless the end of an asynchronous record did both: done), and a failed
 * record decides the answer. */
static idem_code after_record(idem_call *call, const idem_cache_cfg *cfg, const idem_key_ref *key,
                              uint64_t owner, idem_keep *keep, idem_code code, idem_code st,
                              bool claimed_in_txn, bool done)
{
    bool transactional = (call->method->opts.flags & IDEM_METHOD_TRANSACTIONAL) != 0;
    uint32_t bucket = idem__inflight_bucket(key);
    idem__store_ticket_drop(cfg->store, call->claim_ticket); /* no path before left one */
    call->claim_ticket = 0;
    call->claim_store = NULL;
    if (!done) {
        /* Renewed until now: recording may retry through a store outage for longer than a
         * lease, and a lapse would let another instance take over and run it again. */
        idem__inflight_unkeep(call->rt->inflight, keep);
        idem__inflight_notify(call->rt->inflight, bucket);
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
    if (st == IDEM_ABORTED) {
        return claim_lost(call, cfg, key, call->fingerprint);
    }
    /* The handler ran; its answer stands. The record stays IN_PROGRESS until its lease
     * ends, then a retry may run again (the documented at-least-once edge). */
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
        idem__inflight_unkeep(call->rt->inflight, r->keep); /* never waits for the store */
        r->keep = NULL;
        idem__inflight_notify(call->rt->inflight, idem__inflight_bucket(&key));
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
        call->rt->resume == NULL || encode_result(call, cfg, &buf, &len, &now, &expires) != IDEM_OK) {
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
static idem_code record_resumed(idem_call *call, const idem_cache_cfg *cfg)
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

/* Runs the handler as the claim owner and records the outcome. txn is the handler txn
 * the claim was made in (stores with IDEM__STORE_CAP_TXN_CLAIM), else NULL; ticket the
 * claim's shared commit, still open maybe (the completion then joins it), else 0. */
static idem_code run_owned(idem_call *call, idem_next next, const idem_cache_cfg *cfg,
                           const idem_key_ref *key, uint64_t owner, idem_txn *txn, uint64_t ticket)
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
                                   o->max_run_ms ? o->max_run_ms : cfg->max_run_ms);
    }
    call->txn = txn;
    call->fence = owner;
    call->claim_store = cfg->store;
    call->claim_ticket = ticket;
    if ((o->flags & IDEM_METHOD_STEPS) && (st = idem__call_steps_begin(call)) != IDEM_OK) {
        code = idem__reject(call, IDEM_REASON_STORE, st, "steps: %s", idem_errmsg());
    } else {
        code = idem_call_next(call, next);
    }
    call->txn = NULL;
    bool released = released_code(call, code);
    idem__saga_end saga =
        txn == NULL ? idem__call_saga_end(call, &code, released) : IDEM__SAGA_AS_IS;
    if (saga != IDEM__SAGA_AS_IS) { /* the undos ran: the key's fate is the saga's */
        released = saga != IDEM__SAGA_STORE;
    }
    if (txn != NULL && code == IDEM_OK && !released) {
        st = record_result(call, cfg, key, owner, txn, 0); /* effect and record together */
    } else if (txn != NULL) {
        st = end_txn_not_ok(call, cfg, key, owner, txn, claimed_in_txn, released);
    } else if (!released && record_async(call, cfg, key, owner, keep, code, next)) {
        return IDEM_OK; /* suspended: resumes in record_resumed */
    } else {
        st = record_run(call, cfg, key, owner, released, saga);
    }
    return after_record(call, cfg, key, owner, keep, code, st, claimed_in_txn, false);
}

/* How long a duplicate may wait (monotonic): its own deadline (a little before it, so
 * that the answer still arrives), at most the server's max wait. */
static uint64_t wait_until(const idem_call *call, const idem_cache_cfg *cfg)
{
    uint64_t mono = idem__mono_ms(), wall = idem__rt_now_ms(call->rt);
    uint64_t deadline = idem_call_deadline_ms(call), wait = cfg->max_wait_ms;
    if (deadline > wall && deadline - wall < wait) {
        uint64_t left = deadline - wall, margin = left / 10;
        wait = left - (margin < REPLY_MARGIN_MS ? margin : REPLY_MARGIN_MS);
    }
    return mono + wait;
}

/* Waits for the key's owner: parks the call (the server resumes it here on the next
 * completion in its bucket or at its next re-read) or, where the chain cannot park,
 * blocks. Returns with call->suspend set, IDEM_OK to read again, or an answer. */
static idem_code wait_for_owner(idem_call *call, const idem_cache_cfg *cfg, idem_next next,
                                uint32_t bucket, uint64_t gen)
{
    uint64_t now = idem__mono_ms();
    if (call->wait_until_ms == 0) {
        call->wait_until_ms = wait_until(call, cfg);
        call->poll_ms = POLL_MS;
    }
    if (now >= call->wait_until_ms || call->park_refused || call->pinned_key != NULL) {
        return answer_in_progress(call); /* a re-driven call does not wait: it is no retry */
    }
    uint64_t wake = now + call->poll_ms;
    wake = wake < call->wait_until_ms ? wake : call->wait_until_ms;
    call->poll_ms = call->poll_ms * 2 > MAX_POLL_MS ? MAX_POLL_MS : call->poll_ms * 2;
    if (call->parkable && call->rt->can_park) {
        call->resume_pos = next.pos - 1; /* this interceptor */
        call->park_bucket = bucket;
        call->park_gen = gen;
        call->park_wake_ms = wake;
        return idem__call_suspend(call, IDEM__SUSPEND_PARK);
    }
    if (!idem__inflight_wait(call->rt->inflight, bucket, gen, wake - now)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "server shutting down");
    }
    return IDEM_OK;
}

/* The claim: in a handler txn of its own (*txn) for a transactional method on a store
 * that claims there; for a method whose handler neither writes in a txn of its own nor
 * journals steps (both read or write the claim's record), shared with its completion's
 * commit where the store can (*ticket: store.h); for a journaled one (STEPS) in a txn
 * with its re-driver listing (steps.c); else committed on its own. */
static idem_code claim(idem_call *call, const idem_cache_cfg *cfg, const idem_claim_req *req,
                       idem_txn **txn, idem_claim_outcome *outcome, idem_record *rec,
                       uint64_t *ticket)
{
    idem_code code;
    unsigned flags = call->method->opts.flags;
    *txn = NULL;
    *ticket = 0;
    if (!(flags & (IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_STEPS))) {
        return idem__store_claim_shared(cfg->store, req, outcome, rec, ticket);
    }
    if (!(flags & IDEM_METHOD_TRANSACTIONAL) && call->rt->redrive &&
        idem__store_has(cfg->store, IDEM__STORE_CAP_TXN)) {
        return idem__call_steps_claim(call, cfg->store, req, outcome, rec); /* and its listing */
    }
    if (!(flags & IDEM_METHOD_TRANSACTIONAL) ||
        !idem__store_has(cfg->store, IDEM__STORE_CAP_TXN_CLAIM)) {
        return idem_store_claim(cfg->store, req, outcome, rec);
    }
    memset(rec, 0, sizeof(*rec));
    if ((code = idem__store_txn_begin(cfg->store, txn)) != IDEM_OK) {
        return code;
    }
    if ((code = idem__store_txn_claim(*txn, req, outcome, rec)) != IDEM_OK) {
        idem__store_txn_abort(*txn);
        *txn = NULL;
    }
    return code;
}

/* One look at the store and, unless a live lease says wait, one claim. Returns an
 * answer, or IDEM_OK with *wait set, or with *again: a shared claim found a result its
 * txn may not have committed; that commit has ended since: look again (the read then
 * finds it, or it expired and the claim acquires: no third look). */
static idem_code look_or_claim(idem_call *call, const idem_cache_cfg *cfg, idem_next next,
                               const idem_key_ref *key,
                               const uint8_t fingerprint[IDEM_FINGERPRINT_LEN], bool *wait,
                               bool *again)
{
    const idem_method *m = call->method;
    idem_record rec;
    idem_code code = idem_store_get(cfg->store, key, &rec);
    uint64_t now = rec.now_ms ? rec.now_ms : idem__rt_now_ms(call->rt);
    bool same = memcmp(rec.fingerprint, fingerprint, IDEM_FINGERPRINT_LEN) == 0;
    *wait = *again = false;
    if (code == IDEM_OK && rec.state == IDEM_REC_COMPLETED && rec.expires_ms > now) {
        code = same ? replay(call, &rec) : reject_mismatch(call);
        idem_record_clear(&rec);
        return code;
    }
    bool leased = code == IDEM_OK && rec.state == IDEM_REC_IN_PROGRESS && rec.lease_until_ms > now;
    idem_record_clear(&rec);
    if (call->fast_only) { /* claiming writes, waiting waits: a worker resumes here */
        return idem__call_defer(call, next.pos - 1);
    }
    if (leased) { /* the owner is alive: no write claim, just wait */
        *wait = same;
        return same ? IDEM_OK : reject_mismatch(call);
    }
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return idem__reject(call, IDEM_REASON_STORE, code, "result cache: %s", idem_errmsg());
    }
    uint64_t lease = m->opts.lease_ms ? m->opts.lease_ms : cfg->lease_ms;
    idem_claim_req req = {.key = *key, .token = call->token_to_consume, .owner = 0};
    idem_claim_outcome outcome;
    memcpy(req.fingerprint, fingerprint, IDEM_FINGERPRINT_LEN);
    req.now_ms = idem__rt_now_ms(call->rt);
    req.lease_until_ms = idem__add_sat(req.now_ms, lease);
    req.expires_ms = idem__add_sat(req.lease_until_ms, cfg->result_ttl_ms);
    idem_txn *txn = NULL;
    uint64_t ticket;
    code = claim(call, cfg, &req, &txn, &outcome, &rec, &ticket);
    if (code != IDEM_OK) {
        bool token = code == IDEM_FAILED_PRECONDITION || code == IDEM_PERMISSION_DENIED;
        return idem__reject(call, token ? IDEM_REASON_TOKEN : IDEM_REASON_STORE, code, "%s",
                            idem_errmsg());
    }
    bool owned = outcome == IDEM_CLAIM_ACQUIRED || outcome == IDEM_CLAIM_TAKEN_OVER;
    if (txn != NULL && !owned) {
        idem__store_txn_abort(txn);
    }
    if (ticket != 0 && !owned) {
        idem__store_ticket_drop(cfg->store, ticket);
        if (outcome == IDEM_CLAIM_COMPLETED || outcome == IDEM_CLAIM_MISMATCH) {
            idem__store_ticket_wait(cfg->store, ticket); /* nothing uncommitted is answered */
        }
        if (outcome == IDEM_CLAIM_COMPLETED) { /* replayed from the store, as committed */
            idem_record_clear(&rec);
            *again = true;
            return IDEM_OK;
        }
    }
    switch (outcome) {
    case IDEM_CLAIM_ACQUIRED:
    case IDEM_CLAIM_TAKEN_OVER:
        call->token_to_consume = NULL;
        code = run_owned(call, next, cfg, key, rec.owner, txn, ticket);
        break;
    case IDEM_CLAIM_COMPLETED:
        code = replay(call, &rec);
        break;
    case IDEM_CLAIM_MISMATCH:
        code = reject_mismatch(call);
        break;
    case IDEM_CLAIM_IN_PROGRESS:
        *wait = true;
        code = IDEM_OK;
        break;
    }
    idem_record_clear(&rec);
    return code;
}

idem_code idem__result_cache_interceptor(idem_call *call, idem_next next, void *arg)
{
    const idem_cache_cfg *cfg = arg;
    const idem_method *m = call->method;
    const unsigned cached =
        IDEM_METHOD_CACHED | IDEM_METHOD_TOKEN_REQUIRED | IDEM_METHOD_TRANSACTIONAL;
    bool keyed = m != NULL && (m->opts.flags & cached) && call->key_source != IDEM_KEY_NONE;
    if (call->pinned_key != NULL && (!keyed || strcmp(call->pinned_key, call->key) != 0)) {
        /* A re-driven call must claim the record its first run claimed: a changed key
         * extractor or chain would otherwise run every step again under a new key. */
        return idem__reject(call, IDEM_REASON_BAD_KEY, IDEM_FAILED_PRECONDITION,
                            "re-run: the request no longer resolves to the key its first run "
                            "had; not run");
    }
    if (!keyed) {
        return idem_call_next(call, next);
    }
    if (call->recording.active) { /* resumed once its outcome's commit has ended */
        return record_resumed(call, cfg);
    }
    idem_key_ref key = {idem_call_caller(call), m->name, call->key};
    uint32_t bucket = idem__inflight_bucket(&key);
    uint8_t fingerprint[IDEM_FINGERPRINT_LEN];
    idem_code fp = idem__call_fingerprint(call, fingerprint);
    if (fp != IDEM_OK) {
        return idem__reject(call, fp == IDEM_INVALID_ARGUMENT ? IDEM_REASON_BAD_KEY : NULL, fp,
                            "%s", idem_errmsg());
    }
    for (;;) {
        bool wait, again;
        uint64_t gen = idem__inflight_gen(call->rt->inflight, bucket); /* before the read */
        idem_code code = look_or_claim(call, cfg, next, &key, fingerprint, &wait, &again);
        if (again) {
            continue;
        }
        if (!wait || call->suspend != IDEM__SUSPEND_NONE) {
            return code;
        }
        code = wait_for_owner(call, cfg, next, bucket, gen);
        if (code != IDEM_OK || call->suspend != IDEM__SUSPEND_NONE) {
            return code;
        }
    }
}
