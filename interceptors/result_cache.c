/* result_cache: claim before run, replay the first result to every duplicate.
 *
 *   read (replay fast path) → claim (one write txn) → run → complete | release
 *
 * Only the claimer runs the handler. A duplicate that finds the record IN_PROGRESS waits
 * for it (up to its own deadline, else the server's max wait) and replays the result; if
 * the wait runs out it gets ABORTED "in progress" with metadata retry-after-ms. Final
 * codes are stored with the result TTL; transient codes release the claim. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "call.h"

#define POLL_MS 20             /* re-read the store this often while waiting (other processes) */
#define RETRY_AFTER_MS 100u    /* hint given with ABORTED "in progress" */
#define REPLY_MARGIN_MS 50u    /* stop waiting this long (at most 10%) before the deadline */
#define RECORD_RETRY_MS 10000u /* keep trying to record an outcome through a store outage */

void idem__waitset_init(idem_waitset *w)
{
    pthread_condattr_t ca;
    pthread_mutex_init(&w->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_REALTIME);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    w->gen = 0;
}

void idem__waitset_fini(idem_waitset *w)
{
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
}

void idem__waitset_notify(idem_waitset *w)
{
    pthread_mutex_lock(&w->mu);
    w->gen++;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

uint64_t idem__waitset_gen(idem_waitset *w)
{
    pthread_mutex_lock(&w->mu);
    uint64_t g = w->gen;
    pthread_mutex_unlock(&w->mu);
    return g;
}

bool idem__waitset_wait(idem_waitset *w, uint64_t seen_gen, uint64_t wait_ms)
{
    struct timespec ts;
    idem__abs_timespec(&ts, wait_ms);
    pthread_mutex_lock(&w->mu);
    while (w->gen == seen_gen && !w->stopping) {
        if (pthread_cond_timedwait(&w->cv, &w->mu, &ts) != 0) {
            break;
        }
    }
    bool go_on = !w->stopping;
    pthread_mutex_unlock(&w->mu);
    return go_on;
}

void idem__waitset_stop(idem_waitset *w)
{
    pthread_mutex_lock(&w->mu);
    w->stopping = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static idem_code replay(idem_call *call, const idem_record *rec)
{
    char first_at[24];
    idem_code code = idem__load_call_response(call, rec->response, rec->response_len);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "replay: %s", idem_errmsg());
    }
    snprintf(first_at, sizeof(first_at), "%" PRIu64, rec->first_at_ms);
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

/* Stores the call's response as the COMPLETED record: in the handler's own transaction
 * (committing its business writes with it) when it has one, else on its own. */
static idem_code record_result(idem_call *call, idem_runtime *rt, const idem_key_ref *key,
                               uint64_t owner, idem_txn *txn)
{
    const idem_method_opts *o = &call->method->opts;
    uint64_t expires = idem__now_ms() + (o->result_ttl_ms ? o->result_ttl_ms : rt->result_ttl_ms);
    uint8_t *buf;
    size_t len;
    idem_code st = idem__encode_call_response(call, false, &buf, &len);
    if (st != IDEM_OK) {
        if (txn != NULL) {
            idem__store_txn_abort(txn);
        }
        return st;
    }
    st = txn != NULL ? idem__store_txn_complete_commit(txn, key, owner, buf, len, expires)
                     : idem_store_complete(rt->store, key, owner, buf, len, expires);
    free(buf);
    return st;
}

/* After UNAVAILABLE, an ABORTED may mean our own earlier write did commit (its
 * acknowledgement was lost): the record then holds our result. */
static bool recorded_by_us(idem_runtime *rt, const idem_key_ref *key, uint64_t owner,
                           bool completed)
{
    idem_record rec;
    idem_code code = idem_store_get(rt->store, key, &rec);
    bool ours = completed ? code == IDEM_OK && rec.state == IDEM_REC_COMPLETED && rec.owner == owner
                          : code == IDEM_NOT_FOUND;
    idem_record_clear(&rec);
    return ours;
}

/* Completes (or releases) the claim, retrying a transient store failure (a database
 * restarting) for up to RECORD_RETRY_MS: the handler has run, and a lost record would
 * let the next retry run it again once the lease ends. */
static idem_code record_retrying(idem_call *call, idem_runtime *rt, const idem_key_ref *key,
                                 uint64_t owner, bool complete)
{
    uint64_t give_up = idem__mono_ms() + RECORD_RETRY_MS, backoff = 10;
    bool retried = false;
    for (;;) {
        idem_code st = complete ? record_result(call, rt, key, owner, NULL)
                                : idem_store_release(rt->store, key, owner);
        if (st == IDEM_ABORTED && retried && recorded_by_us(rt, key, owner, complete)) {
            return IDEM_OK;
        }
        if (st != IDEM_UNAVAILABLE || idem__mono_ms() + backoff > give_up) {
            return st;
        }
        struct timespec ts = {0, (long)backoff * 1000000L};
        nanosleep(&ts, NULL); /* backoff before the next attempt */
        backoff = backoff * 2 > 500 ? 500 : backoff * 2;
        retried = true;
    }
}

/* Runs the handler as the claim owner and records the outcome. */
static idem_code run_owned(idem_call *call, idem_next next, idem_runtime *rt,
                           const idem_key_ref *key, uint64_t owner)
{
    const idem_method_opts *o = &call->method->opts;
    uint32_t transient = o->transient_mask ? o->transient_mask : IDEM_TRANSIENT_CODES;
    bool transactional = (o->flags & IDEM_METHOD_TRANSACTIONAL) != 0;
    idem_txn *txn = NULL;
    idem_code code, st;

    if (transactional && (st = idem__store_txn_begin(rt->store, &txn)) != IDEM_OK) {
        idem_store_release(rt->store, key, owner);
        idem__waitset_notify(&rt->waits);
        return idem__reject(call, IDEM_REASON_STORE, st, "%s", idem_errmsg());
    }
    call->txn = txn;
    code = idem_call_next(call, next);
    call->txn = NULL;
    if (IDEM_CODE_BIT(code) & transient) {
        if (txn != NULL) {
            idem__store_txn_abort(txn); /* business writes vanish with the claim */
        }
        st = record_retrying(call, rt, key, owner, false);
    } else if (txn != NULL && code == IDEM_OK) {
        st = record_result(call, rt, key, owner, txn); /* effect and record together */
    } else {
        if (txn != NULL) {
            idem__store_txn_abort(txn); /* a final error has no effect, only its record */
        }
        st = record_retrying(call, rt, key, owner, true);
    }
    idem__waitset_notify(&rt->waits);
    if (st == IDEM_OK) {
        return code;
    }
    if (transactional) {
        /* Nothing committed: not the effect, not the record. Say so, and free the key. */
        idem_store_release(rt->store, key, owner);
        idem__waitset_notify(&rt->waits);
        return idem__reject(call, IDEM_REASON_STORE, st, "not committed: %s", idem_errmsg());
    }
    /* The handler ran; its answer stands. The record stays IN_PROGRESS until its lease
     * ends, then a retry may run again (the documented at-least-once edge). */
    idem__log(rt->obs, IDEM_LOG_ERROR,
              "request_id=%s method=\"%s\" msg=\"recording the outcome failed: %s\"",
              call->request_id, call->method->name, idem_errmsg());
    return code;
}

/* How long a duplicate may wait: its own deadline (a little before it, so that the
 * answer still arrives), at most the server's max wait. */
static uint64_t wait_until(const idem_call *call, const idem_runtime *rt)
{
    uint64_t start = idem__now_ms(), deadline = idem_call_deadline_ms(call);
    if (deadline == 0 || deadline > start + rt->max_wait_ms) {
        return start + rt->max_wait_ms;
    }
    if (deadline > start) {
        uint64_t margin = (deadline - start) / 10;
        deadline -= margin < REPLY_MARGIN_MS ? margin : REPLY_MARGIN_MS;
    }
    return deadline;
}

idem_code idem__result_cache_interceptor(idem_call *call, idem_next next, void *arg)
{
    idem_runtime *rt = arg;
    const idem_method *m = call->method;
    const unsigned cached =
        IDEM_METHOD_CACHED | IDEM_METHOD_TOKEN_REQUIRED | IDEM_METHOD_TRANSACTIONAL;
    if (m == NULL || !(m->opts.flags & cached) || call->key_source == IDEM_KEY_NONE) {
        return idem_call_next(call, next);
    }
    idem_key_ref key = {idem_call_caller(call), m->name, call->key};
    uint64_t lease = m->opts.lease_ms ? m->opts.lease_ms : rt->lease_ms;
    uint64_t deadline = wait_until(call, rt);
    size_t plen;
    const void *payload = idem_call_payload(call, &plen);
    idem_claim_req req = {.key = key, .token = call->token_to_consume};
    idem_claim_outcome outcome;
    idem_record rec;
    idem__fingerprint(m->name, payload, plen, req.fingerprint);
    for (;;) {
        uint64_t gen = idem__waitset_gen(&rt->waits);
        idem_code code = idem_store_get(rt->store, &key, &rec);
        uint64_t now = idem__now_ms();
        if (code == IDEM_OK && rec.state == IDEM_REC_COMPLETED && rec.expires_ms > now) {
            bool same = memcmp(rec.fingerprint, req.fingerprint, IDEM_FINGERPRINT_LEN) == 0;
            code = same ? replay(call, &rec) : reject_mismatch(call);
            idem_record_clear(&rec);
            return code;
        }
        idem_record_clear(&rec);
        if (call->fast_only) {
            return IDEM__DEFER; /* claiming is a write, waiting blocks */
        }
        if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
            return idem__reject(call, IDEM_REASON_STORE, code, "result cache: %s", idem_errmsg());
        }
        req.owner = idem__random_u64();
        req.now_ms = now;
        req.lease_until_ms = now + lease;
        req.expires_ms = req.lease_until_ms + rt->result_ttl_ms;
        code = idem_store_claim(rt->store, &req, &outcome, &rec);
        if (code != IDEM_OK) {
            bool token = code == IDEM_FAILED_PRECONDITION || code == IDEM_PERMISSION_DENIED;
            return idem__reject(call, token ? IDEM_REASON_TOKEN : IDEM_REASON_STORE, code, "%s",
                                idem_errmsg());
        }
        switch (outcome) {
        case IDEM_CLAIM_ACQUIRED:
        case IDEM_CLAIM_TAKEN_OVER:
            call->token_to_consume = NULL;
            return run_owned(call, next, rt, &key, req.owner);
        case IDEM_CLAIM_COMPLETED:
            code = replay(call, &rec);
            idem_record_clear(&rec);
            return code;
        case IDEM_CLAIM_MISMATCH:
            return reject_mismatch(call);
        case IDEM_CLAIM_IN_PROGRESS:
            idem_record_clear(&rec);
            break;
        }
        now = idem__now_ms();
        if (now >= deadline) {
            return answer_in_progress(call);
        }
        uint64_t left = deadline - now;
        if (!idem__waitset_wait(&rt->waits, gen, left < POLL_MS ? left : POLL_MS)) {
            return idem_call_fail(call, IDEM_UNAVAILABLE, "server shutting down");
        }
    }
}
