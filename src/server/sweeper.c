/* The sweeper: deletes expired records and tokens in bounded batches, so that a store's
 * size follows rate × TTL. One thread per server; stopping wakes it at once. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "sweeper.h"

struct idem_sweeper {
    idem_store *store;
    uint64_t interval_ms;
    size_t batch;
    idem_observer *obs;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* stopping */
    bool stopping;
    pthread_t thread;
};

static bool stopping(idem_sweeper *s)
{
    pthread_mutex_lock(&s->mu);
    bool v = s->stopping;
    pthread_mutex_unlock(&s->mu);
    return v;
}

/* One sweep: batches until a batch comes back short (nothing more is due). */
static void sweep_due(idem_sweeper *s)
{
    size_t deleted;
    do {
        if (idem_store_sweep(s->store, idem__now_ms(), s->batch, &deleted) != IDEM_OK) {
            char msg[IDEM_LOGQ_CAP], detail[IDEM_LOGQ_CAP];
            snprintf(detail, sizeof(detail), "sweep failed: %s", idem_errmsg());
            idem__log(s->obs, IDEM_LOG_ERROR, "msg=%s",
                      idem__logfmt_quote(msg, sizeof(msg), detail));
            return;
        }
    } while (deleted == s->batch && !stopping(s));
}

static void *sweeper_main(void *arg)
{
    idem_sweeper *s = arg;
    pthread_mutex_lock(&s->mu);
    while (!s->stopping) {
        struct timespec ts;
        idem__abs_timespec(&ts, s->interval_ms);
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        if (s->stopping) {
            break;
        }
        pthread_mutex_unlock(&s->mu);
        sweep_due(s);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

idem_code idem__sweeper_start(idem_sweeper **out, idem_store *store, uint64_t interval_ms,
                              size_t batch, idem_observer *obs)
{
    idem_sweeper *s = calloc(1, sizeof(*s));
    *out = NULL;
    if (s == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    *s = (idem_sweeper){.store = store, .interval_ms = interval_ms, .batch = batch, .obs = obs};
    pthread_mutex_init(&s->mu, NULL);
    idem__cond_init(&s->cv);
    if (pthread_create(&s->thread, NULL, sweeper_main, s) != 0) {
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start sweeper thread");
    }
    *out = s;
    return IDEM_OK;
}

void idem__sweeper_stop(idem_sweeper *s)
{
    if (s == NULL) {
        return;
    }
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
