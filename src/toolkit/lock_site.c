/* Lock sites: what the locks of one store share in this process.
 *
 *   waiters  acquirers waiting for a busy lock, each with its key hash and a woken flag
 *   keeper   the lease keeper of the locks held outside a server (started on demand)
 *   watch    the store's completion announcements (PostgreSQL NOTIFY): another
 *            instance's release wakes the waiters of that key here
 *
 * A site exists while a lock of its store is held or waited for (refs), so nothing here
 * outlives the store. One mutex guards the list of sites and every site's waiters; the
 * store's watch callback takes it, so watch and unwatch are called without it (the
 * store holds its own lock while it calls back). A waiter arms (woken = false) before
 * each claim attempt and waits after it: a release that lands in between is not lost. */
#include <stdlib.h>

#include "lock_internal.h"

struct idem_lock_site {
    idem_lock_site *next;
    idem_store *st;
    size_t refs;
    pthread_cond_t cv; /* a waiter was woken */
    idem_lock_waiter *waiters;
    idem_keeper *keeper; /* NULL until a lock held outside a server needs it */
    bool watching;
};

static pthread_mutex_t sites_mu = PTHREAD_MUTEX_INITIALIZER;
static idem_lock_site *sites;

/* With sites_mu held. */
static void wake_locked(idem_lock_site *s, uint32_t hash)
{
    bool any = false;
    for (idem_lock_waiter *w = s->waiters; w != NULL; w = w->next) {
        if (w->hash == hash || hash == IDEM__STORE_WATCH_ALL) {
            w->woken = true;
            any = true;
        }
    }
    if (any) {
        pthread_cond_broadcast(&s->cv);
    }
}

/* A completion or release in any instance sharing the store (the store's thread). */
static void heard(void *arg, uint32_t key_hash)
{
    pthread_mutex_lock(&sites_mu);
    wake_locked(arg, key_hash);
    pthread_mutex_unlock(&sites_mu);
}

/* The site of st with a new reference, created when absent; *created when this call
 * made it (it then starts the watch). */
static idem_lock_site *site_ref(idem_store *st, bool *created)
{
    idem_lock_site *s;
    *created = false;
    pthread_mutex_lock(&sites_mu);
    for (s = sites; s != NULL && s->st != st; s = s->next) {
    }
    if (s == NULL && (s = calloc(1, sizeof(*s))) != NULL) {
        s->st = st;
        idem__cond_init(&s->cv);
        s->next = sites;
        sites = s;
        *created = true;
    }
    if (s != NULL) {
        s->refs++;
    }
    pthread_mutex_unlock(&sites_mu);
    return s;
}

idem_lock_site *idem__lock_site_get(idem_store *st)
{
    bool created;
    idem_lock_site *s = site_ref(st, &created);
    if (s != NULL && created) {
        /* Without the announcements waiters re-read on their timers: not an error. */
        bool ok = idem__store_watch(st, heard, s) == IDEM_OK;
        pthread_mutex_lock(&sites_mu);
        s->watching = ok;
        pthread_mutex_unlock(&sites_mu);
    }
    return s;
}

void idem__lock_site_put(idem_lock_site *s)
{
    if (s == NULL) {
        return;
    }
    pthread_mutex_lock(&sites_mu);
    bool last = --s->refs == 0;
    if (last) {
        for (idem_lock_site **pp = &sites; *pp != NULL; pp = &(*pp)->next) {
            if (*pp == s) {
                *pp = s->next;
                break;
            }
        }
    }
    pthread_mutex_unlock(&sites_mu);
    if (!last) {
        return;
    }
    if (s->watching) { /* returns once no announcement is being delivered to s */
        idem__store_unwatch(s->st, heard, s);
    }
    idem__keeper_destroy(s->keeper); /* every lock of s has stopped its renewal */
    pthread_cond_destroy(&s->cv);
    free(s);
}

idem_code idem__lock_site_keeper(idem_lock_site *s, idem_keeper **out)
{
    idem_code code = IDEM_OK;
    pthread_mutex_lock(&sites_mu);
    if (s->keeper == NULL) {
        code = idem__keeper_create(&s->keeper, s->st, NULL);
    }
    *out = s->keeper;
    pthread_mutex_unlock(&sites_mu);
    return code;
}

void idem__lock_site_enter(idem_lock_site *s, idem_lock_waiter *w, uint32_t hash)
{
    w->hash = hash;
    w->woken = false;
    pthread_mutex_lock(&sites_mu);
    w->next = s->waiters;
    s->waiters = w;
    pthread_mutex_unlock(&sites_mu);
}

void idem__lock_site_leave(idem_lock_site *s, idem_lock_waiter *w)
{
    pthread_mutex_lock(&sites_mu);
    for (idem_lock_waiter **pp = &s->waiters; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == w) {
            *pp = w->next;
            break;
        }
    }
    pthread_mutex_unlock(&sites_mu);
}

void idem__lock_site_arm(idem_lock_waiter *w)
{
    pthread_mutex_lock(&sites_mu);
    w->woken = false;
    pthread_mutex_unlock(&sites_mu);
}

void idem__lock_site_wait(idem_lock_site *s, idem_lock_waiter *w, uint64_t until_mono)
{
    pthread_mutex_lock(&sites_mu);
    for (uint64_t now = idem__mono_ms(); !w->woken && now < until_mono; now = idem__mono_ms()) {
        struct timespec ts;
        idem__abs_timespec(&ts, until_mono - now);
        if (pthread_cond_timedwait(&s->cv, &sites_mu, &ts) != 0) {
            break;
        }
    }
    pthread_mutex_unlock(&sites_mu);
}

void idem__lock_site_notify(idem_lock_site *s, uint32_t hash)
{
    pthread_mutex_lock(&sites_mu);
    wake_locked(s, hash);
    pthread_mutex_unlock(&sites_mu);
}
