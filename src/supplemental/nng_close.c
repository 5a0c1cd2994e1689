/* nng_close that returns.
 *
 * nng 1.5.2 (Debian's) can leave an aio of a req0 pipe begun and never finished when the
 * pipe closes while a reply is being received: nng's one reaper thread then waits for it
 * forever in the pipe's stop, and nng_close waits for the reaper (seen with gdb; the
 * symptom of nng issue #1813, fixed upstream in 2024 by pull request #1824).
 * A client whose attempts timed out receives late replies, so its close could hang its
 * caller (harden/client::closes_even_when_late_replies_race_its_close, through
 * tests/close_client.c, failed 2 of 3 runs under ASan before this). The close therefore
 * runs on a thread of its own, and the caller waits for it a bounded time: normally the
 * close is done in well under a millisecond; when nng is stuck, the caller goes on, and
 * what nng holds for the socket (its pipe, a thread) stays with nng until the process
 * exits. Once the reaper is stuck, every later close in the process waits the bound. */
#include "nng_close.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

typedef struct closing {
    nng_socket sock;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    int refs; /* the closer and the waiter: the last one frees */
} closing;

static void closing_rele(closing *c)
{
    pthread_mutex_lock(&c->mu);
    bool last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) {
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
        free(c);
    }
}

static void *closer_main(void *arg)
{
    closing *c = arg;
    nng_close(c->sock);
    pthread_mutex_lock(&c->mu);
    c->done = true;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    closing_rele(c);
    return NULL;
}

bool idem__nng_close_bounded(nng_socket s)
{
    closing *c = calloc(1, sizeof(*c));
    pthread_condattr_t ca;
    pthread_t t;
    pthread_attr_t ta;
    if (c == NULL || pthread_condattr_init(&ca) != 0) {
        free(c);
        nng_close(s); /* no memory for the thread: close here, as before */
        return true;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&c->mu, NULL);
    c->sock = s;
    c->refs = 2;
    bool started = pthread_attr_init(&ta) == 0;
    if (started) {
        pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
        started = pthread_create(&t, &ta, closer_main, c) == 0;
        pthread_attr_destroy(&ta);
    }
    if (!started) {
        c->refs = 1;
        closer_main(c); /* no thread: close here, as before */
        return true;
    }
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += IDEM_NNG_CLOSE_WAIT_MS / 1000;
    until.tv_nsec += (long)(IDEM_NNG_CLOSE_WAIT_MS % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&c->mu);
    int rv = 0;
    while (!c->done && rv == 0) {
        rv = pthread_cond_timedwait(&c->cv, &c->mu, &until);
    }
    bool done = c->done;
    pthread_mutex_unlock(&c->mu);
    closing_rele(c);
    return done;
}
