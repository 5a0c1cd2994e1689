/* The dispatch layer (dispatch.h): queue, workers, and one call's way through the chain.
 *
 *   front ──job──▶ queue ──▶ worker: decode → identity → chain ──answer──▶ front
 *                                          └─ park (inflight.c) ─ resume ─┘
 *
 * A duplicate that must wait for a running first call leaves the chain at result_cache
 * and parks; the completion of its key (or its re-read time) queues it again, and a
 * worker resumes it where it left. */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "inflight.h"

struct idem_dispatch {
    idem_dispatch_cfg cfg;
    pthread_mutex_t mu; /* guards the queue and stopping */
    pthread_cond_t cv;  /* queue non-empty, or stopping */
    idem_job *head, *tail;
    size_t n_queued;
    bool stopping;
    /* Calls suspended while the store commits their outcome (IDEM__SUSPEND_RECORD): the
     * store hands each back once; stopping waits for them. */
    size_t recording;
    pthread_cond_t recorded_cv;
    pthread_t *threads;
    size_t n_threads;
};

/* The key the call ran under, for the client (idem_result.key): a business key may
 * have replaced the one it sent. A token is not echoed. */
static void answer_key(idem_call *call)
{
    const char *key = idem__call_answer_key(call);
    if (key != NULL && call->replay_wire == NULL) { /* a stored-bytes replay: the front adds it */
        idem__call_set_meta(call, "idem-key", key);
    }
}

/* Decode + identity + chain. false: a fast_only call needs a worker (out->call is kept,
 * suspended with DEFER: idem__dispatch_enqueue resumes it where it stopped), or
 * (parkable) the call parked in out->call.suspend; nothing to answer yet. */
static bool run(idem_dispatch *d, const void *frame, size_t len, const idem_peer *peer,
                idem_run_opts opts, bool parkable, idem_served *out)
{
    idem_runtime *rt = d->cfg.rt;
    uint64_t start = idem__mono_us();
    idem_code code;

    out->req = NULL;
    if (len > d->cfg.max_frame) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "frame of %zu bytes exceeds the %zu byte limit",
                         len, d->cfg.max_frame);
    } else {
        idem__arena_init(&out->arena);
        code = idem__decode_request_arena(frame, len, opts.frame_writable, &out->arena, &out->req);
    }
    if (code != IDEM_OK) {
        idem__dispatch_reject(
            d, out, code == IDEM_RESOURCE_EXHAUSTED ? IDEM_REASON_TOO_LARGE : IDEM_REASON_BAD_FRAME,
            code, idem_errmsg());
        return true;
    }
    out->start_us = start;
    idem__call_init(&out->call, out->req, d->cfg.find_method(d->cfg.find_arg, out->req->method),
                    rt);
    out->call.fast_only = opts.fast_only;
    out->call.parkable = parkable;
    out->call.wire_reply = opts.wire_reply;
    if (peer != NULL && peer->redriven) { /* its client's deadline has passed: a new one */
        uint32_t a = out->req->attempt;
        out->req->deadline_unix_ms = peer->redriven_deadline_ms;
        out->req->call_deadline_unix_ms = peer->redriven_deadline_ms;
        out->req->attempt = a < 2 ? 2 : a == UINT32_MAX ? a : a + 1; /* a retry, not a submit */
        out->call.pinned_key = peer->redriven_key;
    }
    uint64_t deadline = out->req->deadline_unix_ms;
    /* Who is calling, before anything reads the caller: a refusal runs and claims nothing. */
    bool identified = idem__identity_resolve(d->cfg.identity, peer, &out->call) == IDEM_OK;
    if (identified && deadline != 0 && deadline <= idem__rt_now_ms(rt)) {
        /* Nobody waits for the answer any more: run nothing, claim nothing. */
        idem__reject(&out->call, IDEM_REASON_DEADLINE, IDEM_DEADLINE_EXCEEDED,
                     "deadline passed before the call started (deadline_unix_ms %llu)",
                     (unsigned long long)deadline);
    } else if (identified) {
        idem_call_next(&out->call, (idem_next){d->cfg.chain, 0});
        if (out->call.suspend != IDEM__SUSPEND_NONE) {
            return false;
        }
    }
    if (out->call.request_id[0] == '\0') { /* refused before request_id ran, or no request_id */
        idem__random_hex(out->call.request_id, 16);
    }
    answer_key(&out->call);
    return true;
}

bool idem__dispatch_run(idem_dispatch *d, const void *frame, size_t len, const idem_peer *peer,
                        idem_run_opts opts, idem_served *out)
{
    return run(d, frame, len, peer, opts, false, out);
}

void idem__dispatch_count(idem_dispatch *d, const idem_served *s)
{
    idem__observe_call(d->cfg.rt->obs, &s->call, idem__mono_us() - s->start_us);
}

void idem__dispatch_done(idem_dispatch *d, idem_served *s)
{
    idem__dispatch_count(d, s);
    idem__dispatch_discard(s);
}

void idem__dispatch_reject(idem_dispatch *d, idem_served *s, const char *reason, idem_code code,
                           const char *message)
{
    static const Idem__V1__Request empty = IDEM__V1__REQUEST__INIT;
    s->start_us = idem__mono_us();
    s->req = NULL;
    idem__call_init(&s->call, &empty, NULL, d->cfg.rt);
    idem__reject(&s->call, reason, code, "%s", message);
    idem__random_hex(s->call.request_id, 16);
}

void idem__dispatch_busy(idem_dispatch *d, idem_served *s)
{
    char msg[96];
    snprintf(msg, sizeof(msg), "server busy: %zu calls queued; retry later", d->cfg.max_queue);
    idem__dispatch_reject(d, s, IDEM_REASON_BUSY, IDEM_RESOURCE_EXHAUSTED, msg);
    idem__call_set_meta(&s->call, "retry-after-ms", "100");
}

/* ---- the queue ---- */

/* A resumed job (a woken duplicate, a call whose outcome is committed) skips the
 * max_queue check and goes first: it was admitted before any call still queued. */
static idem_code enqueue(idem_dispatch *d, idem_job *job, bool fresh)
{
    pthread_mutex_lock(&d->mu);
    if (d->stopping) {
        pthread_mutex_unlock(&d->mu);
        return IDEM_UNAVAILABLE;
    }
    if (fresh && d->cfg.max_queue > 0 && d->n_queued >= d->cfg.max_queue) {
        pthread_mutex_unlock(&d->mu);
        return IDEM_RESOURCE_EXHAUSTED;
    }
    job->next = NULL;
    if (!fresh && d->head != NULL) {
        job->next = d->head;
        d->head = job;
    } else if (d->tail != NULL) {
        d->tail->next = job;
        d->tail = job;
    } else {
        d->head = d->tail = job;
    }
    d->n_queued++;
    pthread_cond_signal(&d->cv);
    pthread_mutex_unlock(&d->mu);
    if (fresh) {
        idem__observe_in_flight(d->cfg.rt->obs, 1); /* until answered, parked time included */
    }
    return IDEM_OK;
}

void idem__dispatch_discard(idem_served *s)
{
    idem__call_fini(&s->call);
    if (s->req != NULL) { /* the request and its strings live in the arena */
        idem__arena_reset(&s->arena);
        s->req = NULL;
    }
}

idem_code idem__dispatch_enqueue(idem_dispatch *d, idem_job *job)
{
    /* A call the fast path began is resumed where it stopped, not decoded again. */
    job->parked_before = job->s.req != NULL && job->s.call.suspend == IDEM__SUSPEND_DEFER;
    idem_code code = enqueue(d, job, true);
    if (code != IDEM_OK && job->parked_before) { /* the front answers busy or drops it */
        idem__dispatch_discard(&job->s);
        job->parked_before = false;
    }
    return code;
}

/* A place among the front's parked jobs; false when its bound is reached. */
static bool slot_take(idem_job *job)
{
    if (job->parked == NULL) {
        return true;
    }
    if (atomic_fetch_add(job->parked, 1) >= job->max_parked) {
        atomic_fetch_sub(job->parked, 1);
        return false;
    }
    job->holds_slot = true;
    return true;
}

static void slot_give_back(idem_job *job)
{
    if (job->holds_slot) {
        atomic_fetch_sub(job->parked, 1);
        job->holds_slot = false;
    }
}

/* Drops a job that will never be answered (shutdown). */
static void drop_job(idem_dispatch *d, idem_job *job)
{
    slot_give_back(job);
    if (job->parked_before) {
        idem__dispatch_done(d, &job->s);
    }
    job->drop(job);
    idem__observe_in_flight(d->cfg.rt->obs, -1);
}

/* Parks a call that must wait. true: the job belongs to the in-flight table now; false:
 * run the chain again at once (the bucket moved on, or no place: "in progress"). */
static bool park(idem_dispatch *d, idem_job *job)
{
    idem_call *call = &job->s.call;
    job->parked_before = true;
    call->suspend = IDEM__SUSPEND_NONE;
    if (!slot_take(job)) {
        call->park_refused = true;
        return false;
    }
    idem_park r = idem__inflight_park(d->cfg.rt->inflight, job, call->park_bucket, call->park_gen,
                                      call->park_wake_ms);
    if (r == IDEM__PARKED) {
        return true;
    }
    slot_give_back(job);
    call->park_refused = r == IDEM__PARK_FULL;
    return false;
}

/* The in-flight table hands back a woken job. */
static void resume_job(void *arg, idem_job *job)
{
    idem_dispatch *d = arg;
    if (enqueue(d, job, false) != IDEM_OK) {
        drop_job(d, job); /* stopping: dropped like a queued call */
    }
}

static void recording_count(idem_dispatch *d, bool more)
{
    pthread_mutex_lock(&d->mu);
    d->recording += more ? 1 : (size_t)-1;
    if (d->recording == 0 && d->stopping) {
        pthread_cond_broadcast(&d->recorded_cv);
    }
    pthread_mutex_unlock(&d->mu);
}

/* A call whose outcome the store commits without its worker: true when the store hands
 * it back later (resume_recorded); false when it already has: resume it now. The job
 * must not be touched once this returned true. */
static bool record_wait(idem_dispatch *d, idem_job *job)
{
    job->parked_before = true; /* s holds the call */
    job->s.call.suspend = IDEM__SUSPEND_NONE;
    recording_count(d, true);
    if (!idem__call_recorded(&job->s.call)) {
        return true;
    }
    recording_count(d, false);
    return false;
}

/* The store's writer thread hands back a call whose outcome it committed. */
static void resume_recorded(void *arg, idem_call *call)
{
    idem_dispatch *d = arg;
    idem_job *job = (idem_job *)((char *)call - offsetof(idem_job, s.call));
    if (idem__call_recorded(call)) {
        resume_job(d, job); /* queued, or dropped when stopping */
        recording_count(d, false);
    }
}

/* NULL when stopping (queued jobs are then dropped, not run). */
static idem_job *queue_pop(idem_dispatch *d)
{
    idem_job *job = NULL;
    pthread_mutex_lock(&d->mu);
    while (!d->stopping && d->head == NULL) {
        pthread_cond_wait(&d->cv, &d->mu);
    }
    if (!d->stopping) {
        job = d->head;
        d->head = job->next;
        d->n_queued--;
        if (d->head == NULL) {
            d->tail = NULL;
        }
    }
    pthread_mutex_unlock(&d->mu);
    return job;
}

bool idem__dispatch_stopping(idem_dispatch *d)
{
    pthread_mutex_lock(&d->mu);
    bool s = d->stopping;
    pthread_mutex_unlock(&d->mu);
    return s;
}

/* One turn of a job on a worker: decode and run the chain, or resume a parked call at
 * result_cache. A call that must wait parks (the job then belongs to the in-flight
 * table) unless its bucket moved on meanwhile (read again at once) or the table is
 * full (answered "in progress"). */
static void job_step(idem_dispatch *d, idem_job *job)
{
    idem_runtime *rt = d->cfg.rt;
    idem_call *call = &job->s.call;
    bool answered = false;
    slot_give_back(job); /* a woken job is no longer parked */
    if (!job->parked_before) {
        idem_run_opts opts = {.wire_reply = job->wire_reply, .frame_writable = job->frame_writable};
        answered = run(d, job->frame, job->len, &job->peer, opts, rt->can_park, &job->s);
    } else if (call->suspend == IDEM__SUSPEND_DEFER) { /* the fast path began it */
        call->suspend = IDEM__SUSPEND_NONE;
        call->fast_only = false;
        call->parkable = rt->can_park;
    }
    while (!answered) {
        if (call->suspend == IDEM__SUSPEND_PARK && park(d, job)) {
            return;
        }
        if (call->suspend == IDEM__SUSPEND_RECORD && record_wait(d, job)) {
            return;
        }
        if (!call->recording.active) { /* a recorded call keeps its answer */
            idem__call_reset_response(call);
        }
        idem_call_next(call, (idem_next){d->cfg.chain, call->resume_pos});
        if (call->suspend == IDEM__SUSPEND_NONE) {
            answer_key(call);
            answered = true;
        }
    }
    job->parked_before = false;
    job->answer(job);
    idem__observe_in_flight(rt->obs, -1);
}

static void *worker_main(void *arg)
{
    idem_dispatch *d = arg;
    idem_job *job;
    while ((job = queue_pop(d)) != NULL) {
        job_step(d, job);
    }
    return NULL;
}

/* ---- life cycle ---- */

idem_code idem__dispatch_create(idem_dispatch **out, const idem_dispatch_cfg *cfg)
{
    idem_dispatch *d = calloc(1, sizeof(*d));
    *out = NULL;
    if (d == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    d->cfg = *cfg;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    pthread_cond_init(&d->recorded_cv, NULL);
    cfg->rt->resume = resume_recorded;
    cfg->rt->resume_arg = d;
    idem_code code = idem__inflight_create(&cfg->rt->inflight, cfg->rt, cfg->store,
                                           cfg->max_waiters, resume_job, d);
    if (code != IDEM_OK) {
        idem__dispatch_destroy(d);
        return code;
    }
    *out = d;
    return IDEM_OK;
}

idem_code idem__dispatch_start(idem_dispatch *d)
{
    d->threads = calloc(d->cfg.workers, sizeof(pthread_t));
    if (d->threads == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t i = 0; i < d->cfg.workers; i++) {
        if (pthread_create(&d->threads[i], NULL, worker_main, d) != 0) {
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start worker thread");
        }
        d->n_threads++;
    }
    return IDEM_OK;
}

void idem__dispatch_stop(idem_dispatch *d)
{
    pthread_mutex_lock(&d->mu);
    d->stopping = true;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    if (d->cfg.rt->inflight != NULL) { /* parked duplicates are dropped like queued calls */
        for (idem_job *job = idem__inflight_close(d->cfg.rt->inflight), *next; job != NULL;
             job = next) {
            next = job->next;
            drop_job(d, job);
        }
    }
    /* A running handler finishes and its front sends the reply before the front closes. */
    for (size_t i = 0; i < d->n_threads; i++) {
        pthread_join(d->threads[i], NULL);
    }
    d->n_threads = 0;
    pthread_mutex_lock(&d->mu); /* the store hands these back within its batch's time */
    while (d->recording > 0) {
        pthread_cond_wait(&d->recorded_cv, &d->mu);
    }
    pthread_mutex_unlock(&d->mu);
    for (idem_job *job = d->head, *next; job != NULL; job = next) {
        next = job->next; /* no job is queued once stopping is set */
        drop_job(d, job);
    }
    d->head = d->tail = NULL;
}

void idem__dispatch_destroy(idem_dispatch *d)
{
    if (d == NULL) {
        return;
    }
    idem__dispatch_stop(d);
    idem__inflight_destroy(d->cfg.rt->inflight);
    d->cfg.rt->inflight = NULL;
    d->cfg.rt->resume = NULL;
    pthread_cond_destroy(&d->recorded_cv);
    pthread_cond_destroy(&d->cv);
    pthread_mutex_destroy(&d->mu);
    free(d->threads);
    free(d);
}
