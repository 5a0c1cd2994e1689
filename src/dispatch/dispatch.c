/* The dispatch layer (dispatch.h): queue, workers, and one call's way through the chain.
 *
 *   front ──job──▶ queue ──▶ worker: decode → identity → chain ──answer──▶ front
 *                                          └─ park (inflight.c) ─ resume ─┘
 *
 * A duplicate that must wait for a running first call leaves the chain at result_cache
 * and parks; the completion of its key (or its re-read time) queues it again, and a
 * worker resumes it where it left. A call the store commits for (its outcome, or a new
 * key's claim the nng fast path queued) is suspended the same way and handed back by
 * the store's writer thread (resume_recorded). */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "dispatch_run.h"
#include "inflight.h"

struct idem_dispatch {
    idem_dispatch_cfg cfg;
    pthread_mutex_t mu; /* guards the queue and stopping (written under it, read without) */
    pthread_cond_t cv;  /* queue non-empty, or stopping */
    idem_job *head, *tail;
    atomic_size_t n_queued;
    atomic_bool stopping;
    /* Calls suspended while the store commits their outcome (IDEM__SUSPEND_RECORD): the
     * store hands each back once; stopping waits for them. */
    size_t recording;
    pthread_cond_t recorded_cv;
    pthread_t *threads;
    size_t n_threads;
};

/* Decode + identity + chain (dispatch_run.c); the fast path may queue a new key's claim
 * when the call can then be queued. */
static bool can_queue(idem_dispatch *d);
static bool run(idem_dispatch *d, const void *frame, size_t len, const idem_peer *peer,
                idem_run_opts opts, bool parkable, idem_served *out)
{
    bool claim = opts.fast_only && opts.fast_claim && d->cfg.rt->can_park &&
                 d->cfg.rt->resume != NULL && can_queue(d);
    return idem__dispatch_call_run(&d->cfg, frame, len, peer, opts, parkable, claim, out);
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
    idem__dispatch_reject_rt(d->cfg.rt, s, reason, code, message);
}

void idem__dispatch_busy(idem_dispatch *d, idem_served *s)
{
    char msg[96];
    snprintf(msg, sizeof(msg), "server busy: %zu calls queued; retry later", d->cfg.max_queue);
    idem__dispatch_reject(d, s, IDEM_REASON_BUSY, IDEM_RESOURCE_EXHAUSTED, msg);
    idem__call_set_meta(&s->call, "retry-after-ms", "100");
}

/* ---- the queue ---- */

/* A fresh job would be taken now (not stopping, max_queue not reached), as far as a
 * look without the lock can tell (the nng callbacks ask at every call). */
static bool can_queue(idem_dispatch *d)
{
    return !d->stopping && (d->cfg.max_queue == 0 || d->n_queued < d->cfg.max_queue);
}

/* Adds job to the queue (d->mu held): at its end, or first when resumed. */
static void queue_push(idem_dispatch *d, idem_job *job, bool fresh)
{
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
}

/* A call the store handed back is no longer counted (d->mu held). */
static void uncount_recording(idem_dispatch *d)
{
    d->recording--;
    if (d->recording == 0 && d->stopping) {
        pthread_cond_broadcast(&d->recorded_cv);
    }
}

/* A resumed job (a woken duplicate, a call whose outcome is committed) skips the
 * max_queue check and goes first: it was admitted before any call still queued.
 * recorded: a call the store handed back, uncounted once queued. A fresh job's worker
 * is woken after the lock is released (it would only wait for it); a resumed one's
 * under it: a thread that is not a front may outlive d once it is released. */
static idem_code enqueue(idem_dispatch *d, idem_job *job, bool fresh, bool recorded)
{
    idem_code code = IDEM_OK;
    pthread_mutex_lock(&d->mu);
    if (d->stopping) {
        code = IDEM_UNAVAILABLE;
    } else if (fresh && d->cfg.max_queue > 0 && d->n_queued >= d->cfg.max_queue) {
        code = IDEM_RESOURCE_EXHAUSTED;
    } else {
        queue_push(d, job, fresh);
        if (recorded) {
            uncount_recording(d);
        }
        if (!fresh) {
            pthread_cond_signal(&d->cv);
        }
    }
    pthread_mutex_unlock(&d->mu);
    if (code == IDEM_OK && fresh) {
        pthread_cond_signal(&d->cv);
        idem__observe_in_flight(d->cfg.rt->obs, 1); /* until answered, parked time included */
    }
    return code;
}

void idem__dispatch_discard(idem_served *s)
{
    idem__call_fini(&s->call);
    if (s->req != NULL) { /* the request and its strings live in the arena */
        idem__arena_reset(&s->arena);
        s->req = NULL;
    }
}

static void drop_job(idem_dispatch *d, idem_job *job);

/* A call whose claim the fast path queued (fast_claim): the store hands it back once the
 * claim is applied (resume_recorded), or has already: then it is queued now. Either way
 * the job is ours; one lock for both turns (the front's and the store's). */
static idem_code enqueue_claimed(idem_dispatch *d, idem_job *job)
{
    bool drop = false;
    job->parked_before = true; /* s holds the call */
    job->s.call.suspend = IDEM__SUSPEND_NONE;
    idem__observe_in_flight(d->cfg.rt->obs, 1);
    pthread_mutex_lock(&d->mu);
    if (!idem__call_recorded(&job->s.call)) {
        d->recording++; /* before the store's turn can uncount it: it needs d->mu */
    } else if (!d->stopping) {
        queue_push(d, job, false);
        pthread_cond_signal(&d->cv);
    } else {
        drop = true;
    }
    pthread_mutex_unlock(&d->mu);
    if (drop) {
        drop_job(d, job);
    }
    return IDEM_OK;
}

idem_code idem__dispatch_enqueue(idem_dispatch *d, idem_job *job)
{
    if (job->s.req != NULL && job->s.call.suspend == IDEM__SUSPEND_RECORD) {
        return enqueue_claimed(d, job);
    }
    /* A call the fast path began is resumed where it stopped, not decoded again. */
    job->parked_before = job->s.req != NULL && job->s.call.suspend == IDEM__SUSPEND_DEFER;
    idem_code code = enqueue(d, job, true, false);
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

/* Drops a job that will never be answered (shutdown). A claim the fast path took stays
 * until its lease ends (this may run on the store's writer thread: no store write),
 * as after a crash; its shared commit need not wait for a completion. */
static void drop_job(idem_dispatch *d, idem_job *job)
{
    if (job->parked_before && job->s.call.claiming.active) {
        idem__store_ticket_drop(d->cfg.store, job->s.call.claiming.ticket);
        job->s.call.claiming.active = false;
    }
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
    if (enqueue(d, job, false, false) != IDEM_OK) {
        drop_job(d, job); /* stopping: dropped like a queued call */
    }
}

static void recording_count(idem_dispatch *d, bool more)
{
    pthread_mutex_lock(&d->mu);
    if (more) {
        d->recording++;
    } else {
        uncount_recording(d);
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
    if (idem__call_recorded(call) && enqueue(d, job, false, true) != IDEM_OK) {
        drop_job(d, job); /* stopping: dropped like a queued call, then uncounted */
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
    return d->stopping; /* written under d->mu; a late look is as good as an early one */
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
        idem_run_opts opts = {.wire_reply = job->wire_reply,
                              .frame_writable = job->frame_writable,
                              .frame_built = job->frame_built};
        answered = run(d, job->frame, job->len, &job->peer, opts, rt->can_park, &job->s);
    } else if (call->fast_only) { /* the fast path began it: deferred, or claimed */
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
            idem__dispatch_answer_key(call);
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
    pthread_setname_np(pthread_self(), "idem:worker"); /* for per-thread counts (ps, /proc) */
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
