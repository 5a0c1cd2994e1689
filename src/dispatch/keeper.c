/* The lease keeper: a claim whose owner is still working keeps its lease.
 *
 * Every lease/3 the keeper thread renews each kept lease in the store (idem_store_renew)
 * to now + lease, up to the claim's max run time. So only an owner that died, stopped
 * (SIGSTOP, a GC-like pause: the keeper stops with its process) or outlived its max run
 * time loses its claim. The keeper is a thread of its own: a renewal may block on the
 * store, and must hold up neither a server's waker nor anything else for long. One
 * renewal runs at a time, on a copy of the entry and outside the lock, so unkeep never
 * waits for the store. A renewal answered IDEM_ABORTED (the record was completed,
 * released or taken over meanwhile) stops that entry and marks it lost. */
#include <stdio.h>
#include <stdlib.h>

#include "keeper.h"

#define IDLE_MS 1000 /* the longest sleep */

/* A running claim whose lease is renewed. */
struct idem_keep {
    idem_keep *next;
    uint64_t id, owner, lease_ms;
    uint64_t renew_at, stop_at; /* monotonic ms */
    bool lost;                  /* a renewal answered IDEM_ABORTED */
    char caller[IDEM_MAX_CALLER + 1], method[IDEM_MAX_METHOD + 1], key[IDEM_MAX_KEY + 1];
};

struct idem_keeper {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a lease to renew sooner, or stopping */
    uint64_t wake;     /* when the thread looks next (monotonic), if asleep */
    idem_keep *keeps;
    uint64_t next_id;
    bool stopping;
    pthread_t thread;
    idem_store *store;
    const idem_runtime *rt; /* may be NULL */
};

static uint64_t wall_ms(const idem_keeper *k)
{
    return k->rt != NULL ? idem__rt_now_ms(k->rt) : idem__now_ms();
}

static void log_failure(const idem_keeper *k, const idem_keep *copy, idem_code code)
{
    char method[IDEM_LOGQ_CAP], msg[IDEM_LOGQ_CAP], detail[IDEM_LOGQ_CAP];
    if (k->rt == NULL) {
        return;
    }
    snprintf(detail, sizeof(detail), "lease renewal failed: %s", idem_errmsg());
    idem__log(k->rt->obs, code == IDEM_ABORTED ? IDEM_LOG_INFO : IDEM_LOG_ERROR, "method=%s msg=%s",
              idem__logfmt_quote(method, sizeof(method), copy->method),
              idem__logfmt_quote(msg, sizeof(msg), detail));
}

/* Renews one due lease outside the lock (a store write may block). */
static void renew_one(idem_keeper *k, idem_keep *kp, uint64_t now)
{
    idem_keep copy = *kp;
    kp->renew_at = now + (kp->lease_ms / 3 ? kp->lease_ms / 3 : 1);
    pthread_mutex_unlock(&k->mu);
    idem_key_ref ref = {copy.caller, copy.method, copy.key};
    uint64_t wall = wall_ms(k);
    idem_code code = idem_store_renew(k->store, &ref, copy.owner, wall + copy.lease_ms, wall);
    if (code != IDEM_OK) { /* ABORTED: completed or released meanwhile, as a rule */
        log_failure(k, &copy, code);
    }
    pthread_mutex_lock(&k->mu);
    for (idem_keep *p = k->keeps; code == IDEM_ABORTED && p != NULL; p = p->next) {
        if (p->id == copy.id) { /* still kept: the claim is gone, nothing left to renew */
            p->stop_at = 0;
            p->lost = true;
        }
    }
}

/* Renews the first due lease; true when it did (the list may have changed). */
static bool renew_due(idem_keeper *k, uint64_t now, uint64_t *next_wake)
{
    for (idem_keep *kp = k->keeps; kp != NULL; kp = kp->next) {
        if (kp->renew_at <= now && now < kp->stop_at) {
            renew_one(k, kp, now);
            return true;
        }
        if (now < kp->stop_at) {
            *next_wake = kp->renew_at < *next_wake ? kp->renew_at : *next_wake;
        }
    }
    return false;
}

static void *keeper_main(void *arg)
{
    idem_keeper *k = arg;
    pthread_mutex_lock(&k->mu);
    while (!k->stopping) {
        uint64_t now = idem__mono_ms(), next_wake = now + IDLE_MS;
        if (renew_due(k, now, &next_wake)) {
            continue;
        }
        struct timespec ts;
        idem__abs_timespec(&ts, next_wake - now);
        k->wake = next_wake;
        pthread_cond_timedwait(&k->cv, &k->mu, &ts);
        k->wake = 0;
    }
    pthread_mutex_unlock(&k->mu);
    return NULL;
}

idem_code idem__keeper_create(idem_keeper **out, idem_store *st, const idem_runtime *rt)
{
    idem_keeper *k = calloc(1, sizeof(*k));
    *out = NULL;
    if (k == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    pthread_mutex_init(&k->mu, NULL);
    idem__cond_init(&k->cv);
    k->store = st;
    k->rt = rt;
    if (pthread_create(&k->thread, NULL, keeper_main, k) != 0) {
        pthread_cond_destroy(&k->cv);
        pthread_mutex_destroy(&k->mu);
        free(k);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start the lease keeper");
    }
    *out = k;
    return IDEM_OK;
}

void idem__keeper_destroy(idem_keeper *k)
{
    if (k == NULL) {
        return;
    }
    pthread_mutex_lock(&k->mu);
    k->stopping = true;
    pthread_cond_broadcast(&k->cv);
    pthread_mutex_unlock(&k->mu);
    pthread_join(k->thread, NULL);
    while (k->keeps != NULL) { /* its owners have finished: nothing should be left */
        idem_keep *kp = k->keeps;
        k->keeps = kp->next;
        free(kp);
    }
    pthread_cond_destroy(&k->cv);
    pthread_mutex_destroy(&k->mu);
    free(k);
}

idem_keep *idem__keeper_keep(idem_keeper *k, const idem_key_ref *key, uint64_t owner,
                             uint64_t lease_ms, uint64_t max_run_ms)
{
    idem_keep *kp = calloc(1, sizeof(*kp));
    if (kp == NULL) {
        return NULL; /* no renewal: the owner still works, under its first lease */
    }
    snprintf(kp->caller, sizeof(kp->caller), "%s", key->caller != NULL ? key->caller : "");
    snprintf(kp->method, sizeof(kp->method), "%s", key->method);
    snprintf(kp->key, sizeof(kp->key), "%s", key->key);
    uint64_t now = idem__mono_ms();
    kp->owner = owner;
    kp->lease_ms = lease_ms;
    kp->renew_at = now + (lease_ms / 3 ? lease_ms / 3 : 1);
    kp->stop_at = idem__add_sat(now, max_run_ms);
    pthread_mutex_lock(&k->mu);
    kp->id = ++k->next_id;
    kp->next = k->keeps;
    k->keeps = kp;
    if (k->wake != 0 && kp->renew_at < k->wake) {
        pthread_cond_signal(&k->cv); /* only when it would sleep past this one */
    }
    pthread_mutex_unlock(&k->mu);
    return kp;
}

void idem__keeper_unkeep(idem_keeper *k, idem_keep *kp)
{
    if (kp == NULL) {
        return;
    }
    pthread_mutex_lock(&k->mu);
    for (idem_keep **pp = &k->keeps; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == kp) {
            *pp = kp->next;
            break;
        }
    }
    pthread_mutex_unlock(&k->mu); /* a renewal in flight works on a copy */
    free(kp);
}

bool idem__keeper_lost(idem_keeper *k, const idem_keep *kp)
{
    if (kp == NULL) {
        return false;
    }
    pthread_mutex_lock(&k->mu);
    bool lost = kp->lost;
    pthread_mutex_unlock(&k->mu);
    return lost;
}
