/* The lease keeper: a claim whose owner is still working keeps its lease.
 *
 * Every lease/3 the keeper thread renews each kept lease in the store to now + lease, up
 * to the claim's max run time. So only an owner that died, stopped (SIGSTOP, a GC-like
 * pause: the keeper stops with its process) or outlived its max run time loses its
 * claim. The keeper is a thread of its own: a renewal round may block on the store, and
 * must hold up neither a server's waker nor anything else for long.
 *
 * One round renews every due lease in one store call (idem__store_renew_batch), on
 * copies and outside the lock, so unkeep never waits for the store, and a lease whose
 * row another session holds (a stalled claimer on another instance) delays no other
 * lease: the store skips that row, and the keeper tries it again every lease/10.
 * A lease is held until valid_until, the moment its claim or its last successful renewal
 * was asked for plus the lease: never from an answer, which a slow store sends late (the
 * store's lease began later, when the request reached it). Past it the entry has lapsed,
 * logged once: another claimer may take it from then on. idem__keeper_lost says so
 * (idem_lock_held and a journaled step ask it); a call's completion is conditional on its
 * owner. The keeper goes on renewing: a renewal is conditional on the owner, so one that
 * succeeds proves nobody took the key, and the claim is held again. A renewal answered
 * IDEM_ABORTED (the record was completed, released or taken over meanwhile) stops the
 * entry and marks it lost for good.
 *
 * Recording later (idem__keeper_record_later). A handler's final outcome that the store
 * could not record (a commit that failed on a disk error, an outage or a full store
 * outlasting the worker's own retries) is handed to the keeper with its claim's entry:
 * its client is answered UNAVAILABLE, never an OK the disk may not keep. The keeper
 * keeps renewing the lease (duplicates wait for the key meanwhile) and completes the
 * claim again with a backoff (RECORD_FIRST_MS doubling up to RECORD_MAX_MS) until it
 * lands, the claim is lost (taken over, or gone with a failed batch), or the claim's
 * max run time passes; then the entry goes and the key's waiters are woken (on_end).
 * After a give-up the lease runs out and a retry runs again: its first client was
 * never told OK. The keeper owns such an entry: nobody unkeeps it. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "keeper.h"

#define IDLE_MS 1000       /* the longest sleep */
#define ROUND_MAX 128      /* leases renewed in one store call */
#define RECORD_FIRST_MS 10 /* the first retry of an outcome recorded later */
#define RECORD_MAX_MS 1000 /* the longest pause between two of them */

/* A running claim whose lease is renewed. */
struct idem_keep {
    idem_keep *next;
    uint64_t id, owner, lease_ms;
    uint64_t renew_at, stop_at, valid_until; /* monotonic ms */
    bool lost;   /* a renewal answered IDEM_ABORTED: another claim holds the key */
    bool lapsed; /* valid_until passed (logged); renewals go on */
    char caller[IDEM_MAX_CALLER + 1], method[IDEM_MAX_METHOD + 1], key[IDEM_MAX_KEY + 1];
    char key_hash[IDEM_LOG_KEY_HASH_CAP]; /* as the calls' log lines print it */
    /* An outcome recorded later (the keeper's then): the encoded response, its TTL, when
     * to try next (monotonic) and the pause after that. NULL: a handler still runs. */
    uint8_t *record;
    size_t record_len;
    uint64_t record_ttl_ms, record_at, record_pause;
    idem__record_with with; /* complete NULL: idem__store_complete_at */
};

struct idem_keeper {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a lease to renew sooner, or stopping */
    uint64_t wake;     /* when the thread looks next (monotonic), if asleep */
    idem_keep *keeps;
    uint64_t next_id;
    bool stopping;
    uint64_t record_failed_at; /* the thread's last attempt to record an outcome later
                                  failed then (monotonic ms); 0: it did not */
    pthread_t thread;
    idem_store *store;
    const idem_runtime *rt;         /* may be NULL */
    idem_keep round[ROUND_MAX];     /* copies of this round's leases (keeper thread) */
    idem__renewal batch[ROUND_MAX]; /* and their renewals */
    void (*on_end)(void *arg, const idem_key_ref *key); /* an outcome recorded later ended */
    void *on_end_arg;
};

static uint64_t wall_ms(const idem_keeper *k)
{
    return k->rt != NULL ? idem__rt_now_ms(k->rt) : idem__now_ms();
}

/* One line about kp's lease or its outcome recorded later, naming its method and key as
 * the calls' own lines do; lapsed_at (wall ms, 0: none): when its lease ran out. */
static void log_lease_at(const idem_keeper *k, const idem_keep *kp, idem_log_level level,
                         uint64_t lapsed_at, const char *what)
{
    char method[IDEM_LOGQ_CAP], msg[IDEM_LOGQ_CAP], at[40] = "";
    if (k->rt == NULL) {
        return;
    }
    if (lapsed_at != 0) {
        snprintf(at, sizeof(at), " lapsed_at_ms=%" PRIu64, lapsed_at);
    }
    idem__log(k->rt->obs, level, "method=%s key=%s%s msg=%s",
              idem__logfmt_quote(method, sizeof(method), kp->method), kp->key_hash, at,
              idem__logfmt_quote(msg, sizeof(msg), what));
}

static void log_lease(const idem_keeper *k, const idem_keep *kp, idem_log_level level,
                      const char *what)
{
    log_lease_at(k, kp, level, 0, what);
}

static uint64_t retry_ms(const idem_keep *kp)
{
    return kp->lease_ms / 10 ? kp->lease_ms / 10 : 1;
}

/* Marks the leases that ran out without a renewal lost (once each, logged with the
 * wall time, the records' clock, at which it ran out). */
static void lapse_due(idem_keeper *k, uint64_t now)
{
    for (idem_keep *kp = k->keeps; kp != NULL; kp = kp->next) {
        if (!kp->lost && !kp->lapsed && now >= kp->valid_until && now < kp->stop_at) {
            kp->lapsed = true;
            idem__observe_lease(k->rt != NULL ? k->rt->obs : NULL, IDEM__LEASE_LAPSED);
            log_lease_at(k, kp, IDEM_LOG_ERROR, wall_ms(k) - (now - kp->valid_until),
                         "lease lapsed: no renewal reached the store in time; the claim is not "
                         "held until a renewal finds it still this owner's");
        }
    }
}

/* Copies the due leases into k->round; the count. */
static size_t collect_due(idem_keeper *k, uint64_t now)
{
    size_t n = 0;
    for (idem_keep *kp = k->keeps; kp != NULL && n < ROUND_MAX; kp = kp->next) {
        if (kp->renew_at <= now && now < kp->stop_at) {
            kp->renew_at = now + (kp->lease_ms / 3 ? kp->lease_ms / 3 : 1);
            k->round[n] = *kp;
            k->batch[n] =
                (idem__renewal){.key = {k->round[n].caller, k->round[n].method, k->round[n].key},
                                .owner = kp->owner};
            n++;
        }
    }
    return n;
}

/* Applies a round's answers to the entries still kept. */
static void apply_round(idem_keeper *k, size_t n, uint64_t asked)
{
    for (size_t i = 0; i < n; i++) {
        idem_code code = k->batch[i].code;
        for (idem_keep *p = k->keeps; p != NULL; p = p->next) {
            if (p->id != k->round[i].id || p->lost) {
                continue;
            }
            if (code == IDEM_OK) { /* the owner is unchanged: nobody took the key meanwhile */
                p->valid_until = asked + p->lease_ms;
                if (p->lapsed) {
                    p->lapsed = false;
                    log_lease(k, p, IDEM_LOG_INFO,
                              "lease renewed again after a lapse: the "
                              "claim was still this owner's");
                }
            } else if (code == IDEM_ABORTED) { /* completed or released meanwhile, as a rule */
                p->stop_at = 0;
                p->lost = true;
                log_lease(k, p, IDEM_LOG_INFO, "lease renewal: the claim is gone");
            } else {
                p->renew_at = asked + retry_ms(p); /* held or unreachable: try again soon */
            }
        }
    }
}

/* Renews the due leases in one store call, outside the lock; true when there were any. */
static bool renew_round(idem_keeper *k, uint64_t now)
{
    size_t n = collect_due(k, now);
    if (n == 0) {
        return false;
    }
    pthread_mutex_unlock(&k->mu);
    uint64_t wall = wall_ms(k);
    for (size_t i = 0; i < n; i++) {
        k->batch[i].now_ms = wall;
        k->batch[i].lease_until_ms = wall + k->round[i].lease_ms;
        k->batch[i].code = IDEM_UNAVAILABLE;
    }
    idem_code code = idem__store_renew_batch(k->store, k->batch, n);
    if (code != IDEM_OK) {
        log_lease(k, &k->round[0], IDEM_LOG_ERROR, idem_errmsg());
    }
    pthread_mutex_lock(&k->mu);
    apply_round(k, n, now);
    return true;
}

/* The next moment anything is due: a renewal or a lapse. */
static uint64_t next_due(const idem_keeper *k, uint64_t now)
{
    uint64_t next = now + IDLE_MS;
    for (const idem_keep *kp = k->keeps; kp != NULL; kp = kp->next) {
        if (now < kp->stop_at) {
            next = kp->renew_at < next ? kp->renew_at : next;
            next = kp->valid_until < next ? kp->valid_until : next;
        }
    }
    return next > now ? next : now + 1;
}

/* One attempt to record kp's outcome (outside the lock): true when it is over (landed,
 * or the claim is no longer kp's). */
static bool record_once(idem_keeper *k, idem_keep *kp)
{
    idem_key_ref ref = {kp->caller, kp->method, kp->key};
    uint64_t now = wall_ms(k), expires = idem__add_sat(now, kp->record_ttl_ms);
    idem_code code = kp->with.complete != NULL
                         ? kp->with.complete(kp->with.arg, k->store, &ref, kp->owner, kp->record,
                                             kp->record_len, expires, now)
                         : idem__store_complete_at(k->store, &ref, kp->owner, kp->record,
                                                   kp->record_len, expires, now, 0);
    char detail[IDEM_LOGQ_CAP];
    if (code == IDEM_OK) {
        log_lease(k, kp, IDEM_LOG_INFO, "an outcome recorded later has reached the store");
        return true;
    }
    idem_record rec;
    bool ours = code == IDEM_ABORTED && idem_store_get(k->store, &ref, &rec) == IDEM_OK &&
                rec.state == IDEM_REC_COMPLETED && rec.owner == kp->owner;
    if (code == IDEM_ABORTED) {
        idem_record_clear(&rec);
        snprintf(detail, sizeof(detail), "an outcome recorded later %s",
                 ours ? "had reached the store" : "found its claim lost; given up");
        log_lease(k, kp, ours ? IDEM_LOG_INFO : IDEM_LOG_ERROR, detail);
        return true;
    }
    return false;
}

/* Removes kp from the list (k->mu held). */
static void unlink_keep(idem_keeper *k, idem_keep *kp)
{
    for (idem_keep **pp = &k->keeps; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == kp) {
            *pp = kp->next;
            return;
        }
    }
}

/* The outcome kp records later is over: kp goes, and the key's waiters look again. */
static void record_end(idem_keeper *k, idem_keep *kp)
{
    unlink_keep(k, kp);
    pthread_mutex_unlock(&k->mu);
    idem_key_ref ref = {kp->caller, kp->method, kp->key};
    if (k->on_end != NULL) {
        k->on_end(k->on_end_arg, &ref);
    }
    free(kp->record);
    free(kp->with.arg);
    free(kp);
    pthread_mutex_lock(&k->mu);
}

/* Tries the first due outcome recorded later; true when it did (the list may have
 * changed). Past the claim's max run time it gives up: the lease then runs out. */
static bool record_due(idem_keeper *k, uint64_t now, uint64_t *next_wake)
{
    for (idem_keep *kp = k->keeps; kp != NULL; kp = kp->next) {
        if (kp->record == NULL) {
            continue;
        }
        if (kp->lost || now >= kp->stop_at) {
            log_lease(k, kp, IDEM_LOG_ERROR,
                      kp->lost ? "an outcome recorded later found its claim lost; given up"
                               : "an outcome recorded later did not reach the store within "
                                 "max_run_ms; given up: its lease runs out");
            record_end(k, kp);
            return true;
        }
        if (kp->record_at > now) {
            *next_wake = kp->record_at < *next_wake ? kp->record_at : *next_wake;
            continue;
        }
        pthread_mutex_unlock(&k->mu); /* only this thread frees kp */
        bool over = record_once(k, kp);
        pthread_mutex_lock(&k->mu);
        k->record_failed_at = over ? 0 : idem__mono_ms();
        if (over) {
            record_end(k, kp);
        } else {
            kp->record_at = idem__mono_ms() + kp->record_pause;
            kp->record_pause =
                kp->record_pause * 2 > RECORD_MAX_MS ? RECORD_MAX_MS : kp->record_pause * 2;
        }
        return true;
    }
    return false;
}

static void *keeper_main(void *arg)
{
    idem_keeper *k = arg;
    pthread_mutex_lock(&k->mu);
    while (!k->stopping) {
        uint64_t now = idem__mono_ms();
        lapse_due(k, now);
        uint64_t next_wake = next_due(k, now);
        /* Both each time: steady renewals must not starve the outcomes recorded later. */
        bool renewed = renew_round(k, now);
        if (record_due(k, now, &next_wake) || renewed) {
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
    /* Its owners have finished: only outcomes recorded later are left, each tried once.
     * After one attempt the store did not take (unreachable: it took up to its reconnect
     * bound), here or the thread's last one if it failed within its longest pause (it may
     * have been in flight at the join), the rest are not tried: each would wait as long,
     * and shutdown must not grow with their number. */
    bool store_answers =
        k->record_failed_at == 0 || idem__mono_ms() - k->record_failed_at > RECORD_MAX_MS;
    while (k->keeps != NULL) {
        idem_keep *kp = k->keeps;
        k->keeps = kp->next;
        if (kp->record != NULL && !kp->lost &&
            !(store_answers && (store_answers = record_once(k, kp)))) {
            log_lease(k, kp, IDEM_LOG_ERROR,
                      "an outcome recorded later was still not in "
                      "the store at shutdown; its lease runs out");
        }
        free(kp->record);
        free(kp->with.arg);
        free(kp);
    }
    pthread_cond_destroy(&k->cv);
    pthread_mutex_destroy(&k->mu);
    free(k);
}

idem_keep *idem__keeper_keep(idem_keeper *k, const idem_key_ref *key, uint64_t owner,
                             uint64_t lease_ms, uint64_t max_run_ms, uint64_t asked)
{
    idem_keep *kp = calloc(1, sizeof(*kp));
    if (kp == NULL) {
        return NULL; /* no renewal: the owner still works, under its first lease */
    }
    snprintf(kp->caller, sizeof(kp->caller), "%s", key->caller != NULL ? key->caller : "");
    snprintf(kp->method, sizeof(kp->method), "%s", key->method);
    snprintf(kp->key, sizeof(kp->key), "%s", key->key);
    idem__log_key_hash(kp->key_hash, key->key);
    uint64_t now = idem__mono_ms();
    asked = asked != 0 && asked < now ? asked : now;
    kp->owner = owner;
    kp->lease_ms = lease_ms;
    /* From the moment the claim was asked for: the store's lease began after it. An
     * answer that came late is renewed at once, and may have lapsed already. */
    kp->renew_at = asked + (lease_ms / 3 ? lease_ms / 3 : 1);
    kp->stop_at = idem__add_sat(asked, max_run_ms);
    kp->valid_until = idem__add_sat(asked, lease_ms);
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
    unlink_keep(k, kp);
    pthread_mutex_unlock(&k->mu); /* a renewal in flight works on a copy */
    free(kp);
}

void idem__keeper_record_later(idem_keeper *k, idem_keep *kp, uint8_t *response, size_t len,
                               uint64_t ttl_ms, const idem__record_with *with)
{
    pthread_mutex_lock(&k->mu);
    kp->with = with != NULL ? *with : (idem__record_with){0};
    kp->record = response;
    kp->record_len = len;
    kp->record_ttl_ms = ttl_ms;
    kp->record_pause = RECORD_FIRST_MS;
    kp->record_at = idem__mono_ms() + RECORD_FIRST_MS;
    if (k->wake != 0 && kp->record_at < k->wake) {
        pthread_cond_signal(&k->cv);
    }
    pthread_mutex_unlock(&k->mu);
}

void idem__keeper_on_end(idem_keeper *k, void (*fn)(void *arg, const idem_key_ref *key), void *arg)
{
    pthread_mutex_lock(&k->mu);
    k->on_end = fn;
    k->on_end_arg = arg;
    pthread_mutex_unlock(&k->mu);
}

bool idem__keeper_lost(idem_keeper *k, const idem_keep *kp)
{
    if (kp == NULL) {
        return false;
    }
    pthread_mutex_lock(&k->mu);
    bool lost = kp->lost || idem__mono_ms() >= kp->valid_until;
    pthread_mutex_unlock(&k->mu);
    return lost;
}

uint64_t idem__keeper_lapsed_at(idem_keeper *k, const idem_keep *kp)
{
    if (kp == NULL) {
        return 0;
    }
    pthread_mutex_lock(&k->mu);
    uint64_t now = idem__mono_ms();
    uint64_t at = now >= kp->valid_until ? wall_ms(k) - (now - kp->valid_until) : 0;
    pthread_mutex_unlock(&k->mu);
    return at;
}
