/* The batch a consumer fetched, kept from its ack wait while it waits (nats_consumer.c).
 * The consumer's thread handles a batch one message after the other; the messages behind
 * the one in hand are told "in progress" (+WPI) every third of the durable's ack wait from
 * a thread of their own, so that none expires and goes to another consumer on the durable
 * while a slow handler runs before it. Invariant: the keeper touches only msgs(at, count),
 * under mu, and the consumer's thread moves at, under mu, before it touches msgs[at]: no
 * message is ever used by both threads. The message in hand is not kept: a handler that
 * runs past the ack wait has its message redelivered (its marker makes that copy a
 * duplicate), and one that hangs holds the rest for at most KEEP_MAX_MS. */
#include <string.h>

#include "nats_internal.h"

#define KEEP_MAX_MS 300000 /* the server's default max_run_ms: a handler past it is hung */

static void keep_batch(idem__nats_progress *p)
{
    for (int i = p->at + 1; i < p->count; i++) {
        /* A lost +WPI costs one redelivery, which the marker makes a duplicate. */
        (void)natsMsg_InProgress(p->msgs[i], NULL);
    }
}

static void *progress_main(void *arg)
{
    idem__nats_progress *p = arg;
    struct timespec ts;
    pthread_mutex_lock(&p->mu);
    while (!p->stopping) {
        uint64_t now = idem__mono_ms();
        if (p->msgs == NULL || now - p->in_hand_ms >= KEEP_MAX_MS) {
            pthread_cond_wait(&p->cv, &p->mu); /* until a batch, or the next message */
            continue;
        }
        if (now - p->kept_ms >= p->period_ms) {
            keep_batch(p);
            p->kept_ms = now;
        }
        idem__abs_timespec(&ts, p->kept_ms + p->period_ms - now);
        pthread_cond_timedwait(&p->cv, &p->mu, &ts);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

idem_code idem__nats_progress_start(idem__nats_progress *p, uint64_t ack_wait_ms)
{
    memset(p, 0, sizeof(*p));
    pthread_mutex_init(&p->mu, NULL);
    idem__cond_init(&p->cv);
    p->period_ms = ack_wait_ms / 3 > 0 ? ack_wait_ms / 3 : 1;
    if (pthread_create(&p->thread, NULL, progress_main, p) != 0) {
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "nats consumer: no thread");
    }
    p->started = true;
    return IDEM_OK;
}

static void progress_set(idem__nats_progress *p, natsMsgList *list, int at)
{
    pthread_mutex_lock(&p->mu);
    if (list != NULL && p->msgs == NULL) { /* fetched just now: the ack waits start */
        p->kept_ms = idem__mono_ms();
    }
    p->msgs = list != NULL ? list->Msgs : NULL;
    p->count = list != NULL ? list->Count : 0;
    p->at = at;
    p->in_hand_ms = idem__mono_ms();
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void idem__nats_progress_at(idem__nats_progress *p, natsMsgList *list, int at)
{
    if (p->started) {
        progress_set(p, list, at);
    }
}

void idem__nats_progress_done(idem__nats_progress *p)
{
    if (p->started) {
        progress_set(p, NULL, 0);
    }
}

void idem__nats_progress_stop(idem__nats_progress *p)
{
    if (!p->started) {
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->stopping = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    p->started = false;
}
