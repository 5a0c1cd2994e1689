/* See periodic.h. Stopping wakes the thread at once. */
#include <pthread.h>
#include <stdlib.h>

#include "periodic.h"

struct idem_periodic {
    uint64_t interval_ms;
    idem_periodic_fn fn;
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* stopping */
    bool stopping;
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
        pthread_cond_timedwait(&p->cv, &p->mu, &ts);
        if (p->stopping) {
            break;
        }
        pthread_mutex_unlock(&p->mu);
        p->fn(p->arg, p);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
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
