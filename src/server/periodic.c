/* See periodic.h. Stopping wakes the thread at once. */
#include <pthread.h>
#include <stdlib.h>

#include "periodic.h"

struct idem_periodic {
    uint64_t interval_ms;
    idem_periodic_fn fn;
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* stopping, a run asked for, a run done */
    bool stopping;
    bool asked;    /* idem__periodic_run_now: run fn now, not after the interval */
    bool running;  /* fn is running (it may have looked before an ask) */
    uint64_t runs; /* fn's runs so far */
    pthread_t thread;
};

bool idem__periodic_stopping(idem_periodic *p)
{
    pthread_mutex_lock(&p->mu);
    bool v = p->stopping;
    pthread_mutex_unlock(&p->mu);
    return v;
}

static void *periodic_main(void *arg)
{
    idem_periodic *p = arg;
    pthread_mutex_lock(&p->mu);
    while (!p->stopping) {
        struct timespec ts;
        idem__abs_timespec(&ts, p->interval_ms);
        while (!p->stopping && !p->asked && pthread_cond_timedwait(&p->cv, &p->mu, &ts) == 0) {
        }
        if (p->stopping) {
            break;
        }
        p->asked = false;
        p->running = true;
        pthread_mutex_unlock(&p->mu);
        p->fn(p->arg, p);
        pthread_mutex_lock(&p->mu);
        p->running = false;
        p->runs++;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

void idem__periodic_run_now(idem_periodic *p)
{
    pthread_mutex_lock(&p->mu);
    uint64_t until = p->runs + (p->running ? 2 : 1);
    p->asked = true; /* a run under way leaves it set: the next one starts at once */
    pthread_cond_broadcast(&p->cv);
    while (!p->stopping && p->runs < until) {
        pthread_cond_wait(&p->cv, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
}

idem_code idem__periodic_start(idem_periodic **out, uint64_t interval_ms, idem_periodic_fn fn,
                               void *arg, const char *what)
{
    idem_periodic *p = calloc(1, sizeof(*p));
    *out = NULL;
    if (p == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    *p = (idem_periodic){.interval_ms = interval_ms, .fn = fn, .arg = arg};
    pthread_mutex_init(&p->mu, NULL);
    idem__cond_init(&p->cv);
    if (pthread_create(&p->thread, NULL, periodic_main, p) != 0) {
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        free(p);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start the %s thread", what);
    }
    *out = p;
    return IDEM_OK;
}

void idem__periodic_stop(idem_periodic *p)
{
    if (p == NULL) {
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->stopping = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
}
