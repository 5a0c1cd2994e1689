/* The thread of a consumer or a relay: rounds until stopped, pausing between rounds on
 * the monotonic clock, woken at once by the stop. */
#include <string.h>

#include "nats_internal.h"

void idem__nats_loop_init(idem__nats_loop *l)
{
    memset(l, 0, sizeof(*l));
    pthread_mutex_init(&l->mu, NULL);
    idem__cond_init(&l->cv);
}

idem_code idem__nats_loop_start(idem__nats_loop *l, void *(*fn)(void *), void *arg,
                                const char *what)
{
    if (l->started) {
        return idem__err(IDEM_FAILED_PRECONDITION, "%s: started before", what);
    }
    if (pthread_create(&l->thread, NULL, fn, arg) != 0) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "%s: no thread", what);
    }
    l->started = true;
    return IDEM_OK;
}

bool idem__nats_loop_pause(idem__nats_loop *l, uint64_t ms)
{
    struct timespec ts;
    idem__abs_timespec(&ts, ms);
    pthread_mutex_lock(&l->mu);
    while (!l->stopping && pthread_cond_timedwait(&l->cv, &l->mu, &ts) == 0) {
    }
    bool stopping = l->stopping;
    pthread_mutex_unlock(&l->mu);
    return stopping;
}

void idem__nats_loop_fini(idem__nats_loop *l)
{
    if (l->started) {
        pthread_mutex_lock(&l->mu);
        l->stopping = true;
        pthread_cond_broadcast(&l->cv);
        pthread_mutex_unlock(&l->mu);
        pthread_join(l->thread, NULL);
        l->started = false;
    }
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
}

void idem__nats_add(idem__nats_loop *l, uint64_t *counter, uint64_t n)
{
    pthread_mutex_lock(&l->mu);
    *counter += n;
    pthread_mutex_unlock(&l->mu);
}
