/* The in-flight table: where duplicates wait for a first call, and the lease keeper.
 *
 * Waiting. Keys hash into buckets; each bucket has a generation and a list of parked
 * jobs. A duplicate that finds a live lease reads the bucket's generation BEFORE its
 * store read and parks with it: if a completion bumped the generation in between, the
 * park is refused (CHANGED) and the duplicate reads again, so no wake-up is lost. A
 * completion or release bumps its bucket and hands every job parked there back to the
 * workers; the waker thread hands back jobs whose re-read time has come (owners in
 * other processes, deadlines). A parked job holds no thread. The store stays the
 * truth: a woken job reads it again.
 *
 * Lease keeper. A handler that is still running keeps its claim: the table's keeper
 * (keeper.c) renews the lease every lease/3, up to the method's max run time, so only
 * an owner that died or hangs past max_run_ms loses its claim. It runs until the table
 * is destroyed, after the workers have finished: a shutdown does not drop the claims of
 * handlers that are still running. */
#include <stdlib.h>
#include <string.h>

#include "inflight.h"
#include "keeper.h"
#include "store.h"

#define N_BUCKETS 1024
#define IDLE_MS 1000 /* the waker's longest sleep */

typedef struct bucket {
    uint64_t gen;
    idem_job *parked;
} bucket;

struct idem_inflight {
    pthread_mutex_t mu;
    pthread_cond_t waker_cv; /* a park to time sooner, or closing */
    pthread_cond_t wait_cv;  /* a generation changed (blocking waiters) */
    bucket buckets[N_BUCKETS];
    size_t n_parked, max_parked;
    bool closed; /* no more parking (idem__inflight_close) */
    pthread_t waker;
    bool waker_started;
    idem_keeper *keeper; /* the leases of running handlers */
    bool watching;       /* hears the store's completion announcements */
    idem_runtime *rt;
    idem_store *store; /* where leases are renewed */
    void (*resume)(void *arg, idem_job *job);
    void *resume_arg;
};

uint32_t idem__inflight_bucket(const idem_key_ref *key)
{
    return idem__inflight_bucket_of(idem__key_hash(key));
}

uint32_t idem__inflight_bucket_of(uint32_t key_hash)
{
    return key_hash % N_BUCKETS;
}

uint64_t idem__inflight_gen(idem_inflight *t, uint32_t b)
{
    pthread_mutex_lock(&t->mu);
    uint64_t g = t->buckets[b].gen;
    pthread_mutex_unlock(&t->mu);
    return g;
}

idem_park idem__inflight_park(idem_inflight *t, idem_job *job, uint32_t b, uint64_t seen_gen,
                              uint64_t wake_ms)
{
    idem_park r = IDEM__PARKED;
    pthread_mutex_lock(&t->mu);
    if (t->buckets[b].gen != seen_gen) {
        r = IDEM__PARK_CHANGED;
    } else if (t->closed || t->n_parked >= t->max_parked) {
        r = IDEM__PARK_FULL;
    } else {
        job->bucket = b;
        job->wake_ms = wake_ms;
        job->next = t->buckets[b].parked;
        t->buckets[b].parked = job;
        t->n_parked++;
        pthread_cond_signal(&t->waker_cv);
    }
    pthread_mutex_unlock(&t->mu);
    if (r == IDEM__PARKED) {
        idem__observe_waiting(t->rt->obs, 1);
    }
    return r;
}

/* Hands a list of unparked jobs back to the workers. */
static void resume_all(idem_inflight *t, idem_job *list)
{
    while (list != NULL) {
        idem_job *next = list->next;
        idem__observe_waiting(t->rt->obs, -1);
        t->resume(t->resume_arg, list);
        list = next;
    }
}

void idem__inflight_notify(idem_inflight *t, uint32_t b)
{
    pthread_mutex_lock(&t->mu);
    t->buckets[b].gen++;
    idem_job *list = t->buckets[b].parked;
    t->buckets[b].parked = NULL;
    for (idem_job *j = list; j != NULL; j = j->next) {
        t->n_parked--;
    }
    pthread_cond_broadcast(&t->wait_cv);
    pthread_mutex_unlock(&t->mu);
    resume_all(t, list);
}

bool idem__inflight_wait(idem_inflight *t, uint32_t b, uint64_t seen_gen, uint64_t wait_ms)
{
    struct timespec ts;
    idem__abs_timespec(&ts, wait_ms);
    pthread_mutex_lock(&t->mu);
    while (t->buckets[b].gen == seen_gen && !t->closed) {
        if (pthread_cond_timedwait(&t->wait_cv, &t->mu, &ts) != 0) {
            break;
        }
    }
    bool go_on = !t->closed;
    pthread_mutex_unlock(&t->mu);
    return go_on;
}

/* Unparks the jobs whose time has come; returns them and the next wake time. */
static idem_job *take_due(idem_inflight *t, uint64_t now, uint64_t *next_wake)
{
    idem_job *due = NULL;
    for (size_t b = 0; b < N_BUCKETS && t->n_parked > 0; b++) {
        for (idem_job **pp = &t->buckets[b].parked; *pp != NULL;) {
            idem_job *j = *pp;
            if (j->wake_ms <= now) {
                *pp = j->next;
                j->next = due;
                due = j;
                t->n_parked--;
            } else {
                *next_wake = j->wake_ms < *next_wake ? j->wake_ms : *next_wake;
                pp = &j->next;
            }
        }
    }
    return due;
}

/* Hands back parked jobs whose re-read time has come. */
static void *waker_main(void *arg)
{
    idem_inflight *t = arg;
    pthread_mutex_lock(&t->mu);
    while (!t->closed) {
        uint64_t now = idem__mono_ms(), next_wake = now + IDLE_MS;
        idem_job *due = take_due(t, now, &next_wake);
        if (due != NULL) {
            pthread_mutex_unlock(&t->mu);
            resume_all(t, due);
            pthread_mutex_lock(&t->mu);
            continue;
        }
        struct timespec ts;
        idem__abs_timespec(&ts, next_wake - now);
        pthread_cond_timedwait(&t->waker_cv, &t->mu, &ts);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

idem_keep *idem__inflight_keep(idem_inflight *t, const idem_key_ref *key, uint64_t owner,
                               uint64_t lease_ms, uint64_t max_run_ms, uint64_t asked)
{
    return idem__keeper_keep(t->keeper, key, owner, lease_ms, max_run_ms, asked);
}

void idem__inflight_unkeep(idem_inflight *t, idem_keep *k)
{
    idem__keeper_unkeep(t->keeper, k);
}

void idem__inflight_record_later(idem_inflight *t, idem_keep *k, uint8_t *response, size_t len,
                                 uint64_t ttl_ms, const idem__record_with *with)
{
    idem__keeper_record_later(t->keeper, k, response, len, ttl_ms, with);
}

/* The keeper has recorded an outcome later (or given up): the key's waiters look again. */
static void recorded_later(void *arg, const idem_key_ref *key)
{
    idem__inflight_notify(arg, idem__inflight_bucket(key));
}

idem_keeper *idem__inflight_keeper(idem_inflight *t)
{
    return t->keeper;
}

idem_store *idem__inflight_store(idem_inflight *t)
{
    return t->store;
}

/* A completion or release committed in another process (the store's announcement). */
static void heard(void *arg, uint32_t key_hash)
{
    idem_inflight *t = arg;
    idem__observe_announcement(t->rt->obs);
    if (key_hash != IDEM__STORE_WATCH_ALL) {
        idem__inflight_notify(t, idem__inflight_bucket_of(key_hash));
        return;
    }
    for (uint32_t b = 0; b < N_BUCKETS; b++) { /* announcements may have been lost */
        idem__inflight_notify(t, b);
    }
}

idem_code idem__inflight_create(idem_inflight **out, idem_runtime *rt, idem_store *store,
                                size_t max_parked, void (*resume)(void *arg, idem_job *job),
                                void *resume_arg)
{
    idem_inflight *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    pthread_mutex_init(&t->mu, NULL);
    idem__cond_init(&t->waker_cv);
    idem__cond_init(&t->wait_cv);
    t->rt = rt;
    t->store = store;
    t->max_parked = max_parked;
    t->resume = resume;
    t->resume_arg = resume_arg;
    t->waker_started = pthread_create(&t->waker, NULL, waker_main, t) == 0;
    if (!t->waker_started) {
        idem__inflight_destroy(t);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start the in-flight threads");
    }
    idem_code code = idem__keeper_create(&t->keeper, store, rt);
    if (code != IDEM_OK) {
        idem__inflight_destroy(t);
        return code;
    }
    idem__keeper_on_end(t->keeper, recorded_later, t);
    /* Announcements only save latency: without them waiters re-read on their timers. */
    if (idem__store_watch(store, heard, t) == IDEM_OK) {
        t->watching = true;
    } else {
        char msg[IDEM_LOGQ_CAP];
        idem__log(rt->obs, IDEM_LOG_ERROR,
                  "msg=\"not hearing the store's completion announcements; waiters re-read "
                  "on their timers\" detail=%s",
                  idem__logfmt_quote(msg, sizeof(msg), idem_errmsg()));
    }
    *out = t;
    return IDEM_OK;
}

idem_job *idem__inflight_close(idem_inflight *t)
{
    idem_job *all = NULL;
    size_t n = 0;
    if (t->watching) { /* first: an announcement may be arriving on the store's thread */
        idem__store_unwatch(t->store, heard, t);
        t->watching = false;
    }
    pthread_mutex_lock(&t->mu);
    t->closed = true;
    for (size_t b = 0; b < N_BUCKETS; b++) {
        while (t->buckets[b].parked != NULL) {
            idem_job *j = t->buckets[b].parked;
            t->buckets[b].parked = j->next;
            j->next = all;
            all = j;
            n++;
        }
    }
    t->n_parked = 0;
    pthread_cond_broadcast(&t->waker_cv);
    pthread_cond_broadcast(&t->wait_cv);
    pthread_mutex_unlock(&t->mu);
    idem__observe_waiting(t->rt->obs, -(int)n);
    if (t->waker_started) {
        pthread_join(t->waker, NULL);
        t->waker_started = false;
    }
    return all;
}

void idem__inflight_destroy(idem_inflight *t)
{
    if (t == NULL) {
        return;
    }
    idem__inflight_close(t);         /* the dispatcher has closed it and dropped its jobs already */
    idem__keeper_destroy(t->keeper); /* handlers have finished: nothing is left to renew */
    pthread_cond_destroy(&t->wait_cv);
    pthread_cond_destroy(&t->waker_cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
}
