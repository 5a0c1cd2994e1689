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
 * codes (and, by default, INVALID_ARGUMENT) release the claim and restore its token.
 *
 * This file is the looking side: read, claim, wait, replay. The owner's side (run the
 * handler under the claim, record its outcome, and what a failed record answers) is
 * result_cache_run.c. Nothing is answered from a state the disk may not keep: a result
 * or another request met in an open shared commit is answered only as read back once
 * that commit has ended.
 *
 * On nng's callback thread (fast_only) a new key of a method whose claim is shared
 * (not transactional, no journaled steps) is claimed without waiting when the server
 * can take the call back (fast_claim): the claim is queued for the store's writer
 * thread, the call suspends (IDEM__SUSPEND_RECORD), and the writer thread hands it to a
 * worker once the claim is applied; the worker reads the outcome here (claimed) and
 * runs the handler, or looks again. A worker's sleep and wake around the claim saved. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "key_life.h"
#include "result_cache.h"

#define POLL_MS 20          /* first re-read while waiting (an owner in another process) */
#define MAX_POLL_MS 200     /* the re-read interval doubles up to this */
#define REPLY_MARGIN_MS 50u /* stop waiting this long (at most 10%) before the deadline */

/* Clears what a read left in rec; a response still lent goes back to the store. */
static void record_end(idem_record *rec, idem_borrow *borrow)
{
    if (borrow->end != NULL) {
        rec->response = NULL;
        borrow->end(borrow->a, borrow->b);
        borrow->end = NULL;
    }
    idem_record_clear(rec);
}

static idem_code reject_mismatch(idem_call *call)
{
    return idem__reject(call, IDEM_REASON_KEY_REUSED, IDEM_INVALID_ARGUMENT,
                        "idempotency key reused with a different request");
}

/* A late duplicate of a call whose result expired, within the tombstone horizon: done,
 * and never run again (docs/semantics.md "Tombstones"). */
static idem_code answer_result_gone(idem_call *call, const idem_record *rec)
{
    char first_at[24];
    snprintf(first_at, sizeof(first_at), "%" PRIu64, rec->first_at_ms);
    idem__call_set_meta(call, "idem-result-gone", idem_code_name(rec->result_code));
    idem__call_set_meta(call, "idem-first-at", first_at);
    return idem__reject(call, IDEM_REASON_RESULT_GONE, IDEM_ALREADY_EXISTS,
                        "already done: the first call with this key ended %s and its result "
                        "expired; not run again",
                        idem_code_name(rec->result_code));
}

static idem_code answer_in_progress(idem_call *call)
{
    idem__reject(call, IDEM_REASON_IN_PROGRESS, IDEM_ABORTED,
                 "in progress: the first call with this key has not finished; retry with the "
                 "same key");
    return idem__rc_retry_after(call, IDEM_ABORTED);
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
    /* The claim lives as long as the txn's session: one left idle for a lease (its
     * process stopped, or cut off) is ended, and the key freed. */
    uint64_t lease = call->method->opts.lease_ms ? call->method->opts.lease_ms : cfg->lease_ms;
    if ((code = idem__store_txn_begin_idle(cfg->store, lease, txn)) != IDEM_OK) {
        return code;
    }
    if ((code = idem__store_txn_claim(*txn, req, outcome, rec)) != IDEM_OK) {
        idem__store_txn_abort(*txn);
        *txn = NULL;
    }
    return code;
}

/* The committed record under key belongs to another request (another fingerprint). */
static bool other_request_on_disk(const idem_cache_cfg *cfg, const idem_key_ref *key,
                                  const uint8_t fingerprint[IDEM_FINGERPRINT_LEN])
{
    idem_record rec;
    idem_tombstone t;
    idem_code code = idem_store_get(cfg->store, key, &rec);
    bool other = code == IDEM_OK && memcmp(rec.fingerprint, fingerprint, IDEM_FINGERPRINT_LEN) != 0;
    idem_record_clear(&rec);
    if (code == IDEM_NOT_FOUND) { /* or the tombstone it left (whichever horizon found it) */
        code = idem_store_tombstone_get(cfg->store, key, &t);
        other = code == IDEM_OK && !idem__tomb_same(&t, fingerprint);
        code = code == IDEM_UNIMPLEMENTED ? IDEM_NOT_FOUND : code;
    }
    return other || (code != IDEM_OK && code != IDEM_NOT_FOUND); /* unreadable: as decided */
}

/* A shared claim that did not acquire: what it met may be in a txn that has not
 * committed. Waits for that commit before a result or a refusal decided on it, and
 * says whether to look again: a result is replayed from the store, as committed, and
 * "key reused" answered only for a request the disk holds (that commit may have failed,
 * and its redo with it). */
static bool look_again(const idem_cache_cfg *cfg, const idem_key_ref *key,
                       const uint8_t fingerprint[IDEM_FINGERPRINT_LEN], uint64_t ticket,
                       idem_claim_outcome outcome)
{
    idem__store_ticket_drop(cfg->store, ticket);
    if (outcome != IDEM_CLAIM_COMPLETED && outcome != IDEM_CLAIM_MISMATCH &&
        outcome != IDEM_CLAIM_TOMBSTONE) {
        return false;
    }
    idem__store_ticket_wait(cfg->store, ticket); /* nothing uncommitted is answered */
    return outcome == IDEM_CLAIM_COMPLETED ||
           (outcome == IDEM_CLAIM_MISMATCH && !other_request_on_disk(cfg, key, fingerprint));
}

/* The claim of key by this call: a lease from now, the result TTL after it. Notes when
 * it is asked for (claim_asked_ms): the owner's lease counts from then. */
static idem_claim_req claim_request(idem_call *call, const idem_cache_cfg *cfg,
                                    const idem_key_ref *key,
                                    const uint8_t fingerprint[IDEM_FINGERPRINT_LEN])
{
    const idem_method *m = call->method;
    call->claim_asked_ms = idem__mono_ms();
    uint64_t lease = m->opts.lease_ms ? m->opts.lease_ms : cfg->lease_ms;
    idem_claim_req req = {.key = *key, .token = call->token_to_consume, .owner = 0};
    memcpy(req.fingerprint, fingerprint, IDEM_FINGERPRINT_LEN);
    req.now_ms = idem__rt_now_ms(call->rt);
    req.lease_until_ms = idem__add_sat(req.now_ms, lease);
    req.expires_ms = idem__add_sat(req.lease_until_ms, cfg->result_ttl_ms);
    req.tombstone_ttl_ms =
        m->opts.tombstone_ttl_ms ? m->opts.tombstone_ttl_ms : cfg->tombstone_ttl_ms;
    return req;
}

/* The store's writer thread has applied the claim the fast path queued: the call goes
 * on to a worker, at result_cache (claimed). Never waits for a store write. */
static void claim_applied(void *arg, idem_code code, idem_claim_outcome outcome, uint64_t owner,
                          uint64_t ticket, const char *err)
{
    idem_call *call = arg;
    struct idem__claiming *c = &call->claiming;
    c->code = code;
    c->outcome = (int)outcome;
    c->owner = owner;
    c->ticket = ticket;
    snprintf(c->err, sizeof(c->err), "%s", err);
    call->rt->resume(call->rt->resume_arg, call);
}

/* On nng's callback thread (fast_claim): queues the shared claim of a new key and
 * suspends the call until the store has applied it, so that a worker takes the call
 * only to run the handler. false: not so (a worker claims, as without the fast path). */
static bool claim_queued(idem_call *call, const idem_cache_cfg *cfg, idem_next next,
                         const idem_key_ref *key, const uint8_t fingerprint[IDEM_FINGERPRINT_LEN])
{
    if (!call->fast_claim ||
        (call->method->opts.flags & (IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_STEPS))) {
        return false;
    }
    idem_claim_req req = claim_request(call, cfg, key, fingerprint);
    /* All set before the store may hand the call on (claim_applied). */
    call->claiming.active = true;
    atomic_store(&call->recording.turns, 2);
    call->resume_pos = next.pos - 1; /* this interceptor */
    call->suspend = IDEM__SUSPEND_RECORD;
    if (idem__store_claim_shared_async(cfg->store, &req, claim_applied, call) != IDEM_OK) {
        call->claiming.active = false;
        call->suspend = IDEM__SUSPEND_NONE;
        return false;
    }
    return true;
}

/* The key's life row for what a claim's txn met (outcome). MISMATCH: another request's
 * record, whatever its state: every state that holds one refuses alike
 * (key_life/another_requests_claim_on_any_held_record_is_key_reused). */
static const idem__key_life_row *claim_row(idem_claim_outcome outcome)
{
    switch (outcome) {
    case IDEM_CLAIM_ACQUIRED:
        return idem__key_life_decide(IDEM__KL_NONE, IDEM__KL_CLAIM_SAME);
    case IDEM_CLAIM_TAKEN_OVER:
        return idem__key_life_decide(IDEM__KL_LAPSED, IDEM__KL_CLAIM_SAME);
    case IDEM_CLAIM_COMPLETED:
        return idem__key_life_decide(IDEM__KL_COMPLETED, IDEM__KL_CLAIM_SAME);
    case IDEM_CLAIM_IN_PROGRESS:
        return idem__key_life_decide(IDEM__KL_LIVE, IDEM__KL_CLAIM_SAME);
    case IDEM_CLAIM_MISMATCH:
        return idem__key_life_decide(IDEM__KL_COMPLETED, IDEM__KL_CLAIM_OTHER);
    case IDEM_CLAIM_TOMBSTONE:
        return idem__key_life_decide(IDEM__KL_TOMBSTONE, IDEM__KL_CLAIM_SAME);
    }
    return idem__key_life_decide(IDEM__KL_STATE_COUNT, IDEM__KL_CLAIM_SAME); /* NEVER */
}

/* Whether the claim made this call the key's owner: the handler runs. */
static bool claim_runs(idem_claim_outcome outcome)
{
    idem__kl_action a = claim_row(outcome)->action;
    return a == IDEM__KL_RUN || a == IDEM__KL_RESUME;
}

/* A claim the fast path queued, on the worker that resumed the call: what
 * look_or_claim makes of a claim's outcome, without its record. A claim that did not
 * acquire looks again (*again): a result is then read as committed, a lease waited for. */
static idem_code claimed(idem_call *call, const idem_cache_cfg *cfg, idem_next next,
                         const idem_key_ref *key, const uint8_t fingerprint[IDEM_FINGERPRINT_LEN],
                         bool *again)
{
    const struct idem__claiming *c = &call->claiming;
    idem_claim_outcome outcome = (idem_claim_outcome)c->outcome;
    call->claiming.active = false;
    *again = false;
    if (c->code != IDEM_OK) {
        bool token = c->code == IDEM_FAILED_PRECONDITION || c->code == IDEM_PERMISSION_DENIED;
        return idem__reject(call, token ? IDEM_REASON_TOKEN : IDEM_REASON_STORE, c->code, "%s",
                            c->err);
    }
    if (claim_runs(outcome)) {
        call->token_to_consume = NULL;
        if (outcome == IDEM_CLAIM_TAKEN_OVER) {
            idem__observe_lease(call->rt->obs, IDEM__LEASE_TAKEN_OVER);
        }
        return idem__rc_run_owned(call, next, cfg, key, c->owner, NULL, c->ticket);
    }
    /* Dropped, and a result or another request met in the open txn waited for. */
    bool look = c->ticket != 0 && look_again(cfg, key, fingerprint, c->ticket, outcome);
    if (!look && claim_row(outcome)->action == IDEM__KL_REFUSE_REUSED) {
        return reject_mismatch(call); /* the other request is on disk */
    }
    *again = true;
    return IDEM_OK;
}

/* What a claim's outcome (rec: the record it read or wrote) makes of the call: its
 * row in the key's life (claim_row). */
static idem_code after_claim(idem_call *call, idem_next next, const idem_cache_cfg *cfg,
                             const idem_key_ref *key, idem_claim_outcome outcome, idem_record *rec,
                             idem_txn *txn, uint64_t ticket, bool *wait)
{
    idem__kl_action action = claim_row(outcome)->action;
    if (outcome == IDEM_CLAIM_TAKEN_OVER) {
        idem__observe_lease(call->rt->obs, IDEM__LEASE_TAKEN_OVER);
    }
    switch (action) {
    case IDEM__KL_RUN:
    case IDEM__KL_RESUME:
        call->token_to_consume = NULL;
        return idem__rc_run_owned(call, next, cfg, key, rec->owner, txn, ticket);
    case IDEM__KL_REPLAY:
        return idem__rc_replay(call, rec);
    case IDEM__KL_REFUSE_REUSED:
        return reject_mismatch(call);
    case IDEM__KL_ANSWER_GONE:
        return answer_result_gone(call, rec);
    case IDEM__KL_WAIT:
        *wait = true;
        return IDEM_OK;
    default:
        return idem__reject(call, NULL, IDEM_INTERNAL, "key life: \"%s\" after a claim",
                            idem__kl_action_name(action));
    }
}

/* The key's state as a read shows it to a claim: COMPLETED or LIVE, which the read
 * answers; else NONE (absent, a lapsed lease, an expired result), which only the claim's
 * own txn decides (a takeover, a tombstone, another request's record): claim. */
static idem__kl_state read_state(idem_code code, const idem_record *rec, uint64_t now)
{
    if (code == IDEM_OK && rec->state == IDEM_REC_COMPLETED && rec->expires_ms > now) {
        return IDEM__KL_COMPLETED;
    }
    if (code == IDEM_OK && rec->state == IDEM_REC_IN_PROGRESS && rec->lease_until_ms > now) {
        return IDEM__KL_LIVE;
    }
    return IDEM__KL_NONE;
}

/* One look at the store and, unless a live lease says wait, one claim. Returns an
 * answer, or IDEM_OK with *wait set, or with *again: a shared claim found a result (or
 * another request whose record the disk does not hold) in a txn that may not have
 * committed; that commit has ended since: look again (the read then finds it, or it
 * expired or never landed and the claim acquires: no third look). */
static idem_code look_or_claim(idem_call *call, const idem_cache_cfg *cfg, idem_next next,
                               const idem_key_ref *key,
                               const uint8_t fingerprint[IDEM_FINGERPRINT_LEN], bool *wait,
                               bool *again)
{
    idem_record rec;
    idem_borrow borrow;
    idem_code code = idem__store_get_borrowed(cfg->store, key, &rec, &borrow);
    uint64_t now = rec.now_ms ? rec.now_ms : idem__rt_now_ms(call->rt);
    bool same = memcmp(rec.fingerprint, fingerprint, IDEM_FINGERPRINT_LEN) == 0;
    idem__kl_state state = read_state(code, &rec, now);
    idem__kl_action action =
        idem__key_life_decide(state, same ? IDEM__KL_CLAIM_SAME : IDEM__KL_CLAIM_OTHER)->action;
    *wait = *again = false;
    if (state == IDEM__KL_COMPLETED) {
        code = action == IDEM__KL_REPLAY ? idem__rc_replay_borrowed(call, &rec, &borrow)
                                         : reject_mismatch(call);
        record_end(&rec, &borrow);
        return code;
    }
    bool leased = state == IDEM__KL_LIVE;
    record_end(&rec, &borrow);
    if (call->fast_only) { /* waiting waits, claiming writes: a worker resumes here */
        bool fresh = !leased && (code == IDEM_OK || code == IDEM_NOT_FOUND);
        if (fresh && claim_queued(call, cfg, next, key, fingerprint)) {
            return IDEM_UNAVAILABLE; /* suspended: never sent */
        }
        return idem__call_defer(call, next.pos - 1);
    }
    if (leased) { /* the owner is alive: no write claim, just wait */
        *wait = action == IDEM__KL_WAIT;
        return *wait ? IDEM_OK : reject_mismatch(call);
    }
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return idem__reject(call, IDEM_REASON_STORE, code, "result cache: %s", idem_errmsg());
    }
    idem_claim_req req = claim_request(call, cfg, key, fingerprint);
    idem_claim_outcome outcome;
    idem_txn *txn = NULL;
    uint64_t ticket;
    code = claim(call, cfg, &req, &txn, &outcome, &rec, &ticket);
    if (code != IDEM_OK) {
        bool token = code == IDEM_FAILED_PRECONDITION || code == IDEM_PERMISSION_DENIED;
        return idem__reject(call, token ? IDEM_REASON_TOKEN : IDEM_REASON_STORE, code, "%s",
                            idem_errmsg());
    }
    bool owned = claim_runs(outcome);
    if (txn != NULL && !owned) {
        idem__store_txn_abort(txn);
    }
    if (ticket != 0 && !owned && look_again(cfg, key, fingerprint, ticket, outcome)) {
        idem_record_clear(&rec);
        *again = true;
        return IDEM_OK;
    }
    code = after_claim(call, next, cfg, key, outcome, &rec, txn, ticket, wait);
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
        return idem__rc_record_resumed(call, cfg);
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
        bool wait = false, again;
        uint64_t gen = idem__inflight_gen(call->rt->inflight, bucket); /* before the read */
        idem_code code = call->claiming.active
                             ? claimed(call, cfg, next, &key, fingerprint, &again)
                             : look_or_claim(call, cfg, next, &key, fingerprint, &wait, &again);
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
