/* The lease lock (lock.h): acquire, renew, release, and the locks a handler takes
 * through its call.
 *
 * A lock is the record (scope, IDEM_LOCK_METHOD, name) in IDEM_REC_IN_PROGRESS, claimed
 * with a store-assigned owner: the claim's unique key decides between acquirers, the
 * owner is the fencing token, the lease is the record's. Every lock record carries the
 * same fingerprint, so any other record under that key is "not a lock" (MISMATCH or
 * COMPLETED), never silently taken. Release is the claim's release (owner-checked),
 * renewal the claim's renewal; both answer IDEM_ABORTED to a holder that lost it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inflight.h"
#include "lock_internal.h"

#define BACKOFF_MIN_MS 5
#define BACKOFF_MAX_MS 200

struct idem_lock {
    idem_store *st;
    idem_lock_site *site;
    idem_keeper *keeper; /* who renews it: its site's or its server's; NULL: manual */
    idem_keep *keep;
    const idem_runtime *rt; /* the clock of a lock taken through a call; NULL: this host's */
    idem_call *call;        /* taken through this call: released when its handler returns */
    idem_lock *call_next;
    uint64_t token, lease_ms;
    /* idem__mono_ms() before the claim that acquired it left; without a keeper (manual
     * renewal) the end of its lease by this holder's clock, from the last ask that
     * succeeded. */
    uint64_t asked, valid_until;
    uint32_t hash;
    char scope[IDEM_MAX_CALLER + 1], name[IDEM_LOCK_MAX_NAME + 1];
};

/* What one acquisition asks for (opts checked and defaulted). */
typedef struct lock_req {
    idem_store *st;
    const char *scope, *name;
    idem_lock_opts o;
    uint64_t wait_ms;
    const idem_runtime *rt;
    idem_keeper *keeper; /* NULL: the site's */
} lock_req;

static const uint8_t lock_fingerprint[IDEM_FINGERPRINT_LEN] = "idem.lock/v1: a lease lock";

static bool text_ok(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f) {
            return false;
        }
    }
    return idem__utf8_valid(s, n);
}

idem_code idem__lock_names_check(const char *scope, const char *name)
{
    size_t ls = scope != NULL ? strnlen(scope, IDEM_MAX_CALLER + 1) : 0;
    size_t ln = name != NULL ? strnlen(name, IDEM_LOCK_MAX_NAME + 1) : 0;
    if (ln == 0 || ln > IDEM_LOCK_MAX_NAME || !text_ok(name, ln)) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "lock name must be 1..%d bytes of UTF-8 without control characters",
                         IDEM_LOCK_MAX_NAME);
    }
    if (ls > IDEM_MAX_CALLER || !text_ok(scope != NULL ? scope : "", ls)) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "lock scope must be 0..%d bytes of UTF-8 without control characters",
                         IDEM_MAX_CALLER);
    }
    return IDEM_OK;
}

static idem_code opts_check(const idem_lock_opts *in, idem_lock_opts *o)
{
    *o = in != NULL ? *in : (idem_lock_opts){0};
    o->lease_ms = o->lease_ms ? o->lease_ms : IDEM_LOCK_DEFAULT_LEASE_MS;
    o->max_hold_ms = o->max_hold_ms ? o->max_hold_ms : IDEM_LOCK_DEFAULT_MAX_HOLD_MS;
    if (o->lease_ms < IDEM_LOCK_MIN_LEASE_MS || o->lease_ms > IDEM_LOCK_MAX_LEASE_MS) {
        return idem__err(IDEM_INVALID_ARGUMENT, "lock lease must be %d..%d ms",
                         IDEM_LOCK_MIN_LEASE_MS, IDEM_LOCK_MAX_LEASE_MS);
    }
    if (o->wait_ms > IDEM_LOCK_MAX_WAIT_MS) {
        return idem__err(IDEM_INVALID_ARGUMENT, "lock wait must be at most %d ms",
                         IDEM_LOCK_MAX_WAIT_MS);
    }
    if (o->max_hold_ms > IDEM_LOCK_MAX_HOLD_MS) {
        return idem__err(IDEM_INVALID_ARGUMENT, "lock hold must be at most %d ms",
                         IDEM_LOCK_MAX_HOLD_MS);
    }
    return IDEM_OK;
}

static uint64_t lock_wall_ms(const idem_runtime *rt)
{
    return rt != NULL ? idem__rt_now_ms(rt) : idem__now_ms();
}

static idem_key_ref lock_key(const idem_lock *l)
{
    return (idem_key_ref){l->scope, IDEM_LOCK_METHOD, l->name};
}

/* One claim of the lock's record. *acquired with the token, or *busy_ms (> 0) with how
 * long the holder's lease still runs. */
static idem_code try_once(idem_lock *l, bool *acquired, uint64_t *busy_ms)
{
    idem_claim_outcome outcome;
    idem_record rec;
    l->asked = idem__mono_ms(); /* the lease counts from here (before its wall clock's now) */
    uint64_t now = lock_wall_ms(l->rt);
    idem_claim_req req = {.key = lock_key(l),
                          .owner = 0, /* the store assigns the next fence */
                          .now_ms = now,
                          .lease_until_ms = now + l->lease_ms,
                          .expires_ms = now + l->lease_ms};
    memcpy(req.fingerprint, lock_fingerprint, IDEM_FINGERPRINT_LEN);
    *acquired = false;
    *busy_ms = 0;
    idem_code code = idem_store_claim(l->st, &req, &outcome, &rec);
    if (code != IDEM_OK) {
        return code;
    }
    if (outcome == IDEM_CLAIM_ACQUIRED || outcome == IDEM_CLAIM_TAKEN_OVER) {
        l->token = rec.owner;
        *acquired = true;
    } else if (outcome == IDEM_CLAIM_IN_PROGRESS) {
        uint64_t clock = rec.now_ms != 0 ? rec.now_ms : now; /* the store's, or ours */
        *busy_ms = rec.lease_until_ms > clock ? rec.lease_until_ms - clock : 1;
    } else {
        code = idem__err(IDEM_FAILED_PRECONDITION,
                         "lock \"%s\": the record under that name is not a lock", l->name);
    }
    idem_record_clear(&rec);
    return code;
}

/* Claims until acquired, an error, or the wait bound; waits between attempts for a
 * release of this lock (in this process, or announced by the store), at most the
 * backoff and never past the holder's lease or the bound. */
static idem_code claim_waiting(idem_lock *l, uint64_t wait_ms)
{
    idem_lock_waiter w;
    uint64_t until = idem__add_sat(idem__mono_ms(), wait_ms), backoff = BACKOFF_MIN_MS;
    bool acquired = false;
    uint64_t busy_ms;
    idem_code code;
    idem__lock_site_enter(l->site, &w, l->hash);
    for (;;) {
        idem__lock_site_arm(&w);
        if ((code = try_once(l, &acquired, &busy_ms)) != IDEM_OK || acquired) {
            break;
        }
        uint64_t now = idem__mono_ms();
        if (now >= until) {
            code = idem__err(IDEM_ABORTED, "lock \"%s\" is held by another holder (waited %llu ms)",
                             l->name, (unsigned long long)wait_ms);
            break;
        }
        uint64_t pause = (uint64_t)((double)backoff * (0.5 + idem__random_unit())) + 1;
        pause = pause < busy_ms + 1 ? pause : busy_ms + 1;
        idem__lock_site_wait(l->site, &w, now + pause < until ? now + pause : until);
        backoff = backoff * 2 < BACKOFF_MAX_MS ? backoff * 2 : BACKOFF_MAX_MS;
    }
    idem__lock_site_leave(l->site, &w);
    return code;
}

/* Starts the lease's renewal: by the request's keeper, else the site's. */
static idem_code start_renewal(idem_lock *l, const lock_req *q)
{
    idem_code code = IDEM_OK;
    idem_key_ref key = lock_key(l);
    if (q->o.manual_renew) {
        return IDEM_OK;
    }
    l->keeper = q->keeper;
    if (l->keeper == NULL && (code = idem__lock_site_keeper(l->site, &l->keeper)) != IDEM_OK) {
        l->keeper = NULL;
        return code;
    }
    l->keep = idem__keeper_keep(l->keeper, &key, l->token, l->lease_ms, q->o.max_hold_ms, l->asked);
    return l->keep != NULL ? IDEM_OK : idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
}

static void lock_free(idem_lock *l)
{
    idem__keeper_unkeep(l->keeper, l->keep);
    idem__lock_site_put(l->site);
    free(l);
}

static idem_code lock_take(const lock_req *q, idem_lock **out)
{
    idem_lock *l = calloc(1, sizeof(*l));
    idem_code code;
    *out = NULL;
    if (l == NULL || (l->site = idem__lock_site_get(q->st)) == NULL) {
        free(l);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    l->st = q->st;
    l->rt = q->rt;
    l->lease_ms = q->o.lease_ms;
    snprintf(l->scope, sizeof(l->scope), "%s", q->scope != NULL ? q->scope : "");
    snprintf(l->name, sizeof(l->name), "%s", q->name);
    idem_key_ref key = lock_key(l);
    l->hash = idem__key_hash(&key);
    if ((code = claim_waiting(l, q->wait_ms)) != IDEM_OK) {
        lock_free(l);
        return code;
    }
    l->valid_until = l->asked + l->lease_ms;
    if ((code = start_renewal(l, q)) != IDEM_OK) {
        idem_errkeep keep;
        idem__err_keep(&keep);
        /* Unrenewed, it would end mid-work: give it back. If even that fails, it ends
         * with its lease; the caller learns why it was not acquired either way. */
        if (idem_store_release(l->st, &key, l->token) == IDEM_OK) {
            idem__lock_site_notify(l->site, l->hash);
        }
        lock_free(l);
        return idem__err_put(&keep, code);
    }
    *out = l;
    return IDEM_OK;
}

idem_code idem_lock_acquire(idem_store *st, const char *scope, const char *name,
                            const idem_lock_opts *opts, idem_lock **out)
{
    lock_req q = {.st = st, .scope = scope, .name = name};
    idem_code code;
    if (out == NULL || st == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "lock acquire needs a store and an out pointer");
    }
    *out = NULL;
    if ((code = idem__lock_names_check(scope, name)) != IDEM_OK ||
        (code = opts_check(opts, &q.o)) != IDEM_OK) {
        return code;
    }
    q.wait_ms = q.o.wait_ms;
    return lock_take(&q, out);
}

/* ---- locks taken through a call ---- */

/* chain.c calls this when the handler returns: what it still holds is released. */
static void release_call_locks(idem_call *call)
{
    while (call->locks != NULL) {
        idem_lock_release(call->locks); /* unlinks itself */
    }
}

idem_code idem_call_lock(idem_call *call, const char *name, const idem_lock_opts *opts,
                         idem_lock **out)
{
    idem_code code;
    if (out == NULL || call == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "call lock needs a call and an out pointer");
    }
    *out = NULL;
    if (call->rt == NULL || call->rt->inflight == NULL) {
        return idem__err(IDEM_FAILED_PRECONDITION, "idem_call_lock: no server runs this call");
    }
    if (call->txn != NULL) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "idem_call_lock: a transactional handler's txn already serialises what "
                         "it touches; take the lock in a claim-mode handler");
    }
    lock_req q = {.st = idem__inflight_store(call->rt->inflight),
                  .scope = call->caller,
                  .name = name,
                  .rt = call->rt,
                  .keeper = idem__inflight_keeper(call->rt->inflight)};
    if ((code = idem__lock_names_check(q.scope, name)) != IDEM_OK ||
        (code = opts_check(opts, &q.o)) != IDEM_OK) {
        return code;
    }
    uint64_t deadline = idem_call_deadline_ms(call), now = idem__rt_now_ms(call->rt);
    q.wait_ms = q.o.wait_ms;
    if (deadline != 0) {
        uint64_t left = deadline > now ? deadline - now : 0;
        q.wait_ms = left < q.wait_ms ? left : q.wait_ms;
    }
    if ((code = lock_take(&q, out)) != IDEM_OK) {
        return code;
    }
    (*out)->call = call;
    (*out)->call_next = call->locks;
    call->locks = *out;
    call->locks_release = release_call_locks;
    return IDEM_OK;
}

static void call_unlink(idem_lock *l)
{
    for (idem_lock **pp = &l->call->locks; *pp != NULL; pp = &(*pp)->call_next) {
        if (*pp == l) {
            *pp = l->call_next;
            break;
        }
    }
}

/* ---- holding ---- */

idem_code idem_lock_renew(idem_lock *l)
{
    if (l == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "no lock to renew");
    }
    idem_key_ref key = lock_key(l);
    uint64_t asked = idem__mono_ms(), now = lock_wall_ms(l->rt);
    idem_code code = idem_store_renew(l->st, &key, l->token, now + l->lease_ms, now);
    if (code == IDEM_OK) {
        l->valid_until = asked + l->lease_ms; /* from the ask: the store's began later */
    } else if (code == IDEM_ABORTED) {
        l->valid_until = 0;
        return idem__err(IDEM_ABORTED,
                         "lock \"%s\" was lost: its lease passed and another holder took it, "
                         "or it was released",
                         l->name);
    }
    return code;
}

idem_code idem_lock_release(idem_lock *l)
{
    if (l == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "no lock to release");
    }
    bool lost_before = idem__keeper_lost(l->keeper, l->keep);
    idem__keeper_unkeep(l->keeper, l->keep); /* no renewal after the release */
    l->keep = NULL;
    idem_key_ref key = lock_key(l);
    idem_code code = idem_store_release(l->st, &key, l->token);
    if (code == IDEM_OK) {
        idem__lock_site_notify(l->site, l->hash);
    } else if (code == IDEM_ABORTED || lost_before) {
        code = idem__err(IDEM_ABORTED,
                         "lock \"%s\" had been lost: its lease passed and another holder took it",
                         l->name);
    }
    if (l->call != NULL) {
        call_unlink(l);
    }
    lock_free(l);
    return code;
}

bool idem_lock_held(const idem_lock *l)
{
    if (l == NULL) {
        return false;
    }
    if (l->keep != NULL) {
        return !idem__keeper_lost(l->keeper, l->keep);
    }
    return idem__mono_ms() < l->valid_until;
}

uint64_t idem_lock_token(const idem_lock *l)
{
    return l != NULL ? l->token : 0;
}

const char *idem_lock_name(const idem_lock *l)
{
    return l != NULL ? l->name : "";
}

const char *idem_lock_scope(const idem_lock *l)
{
    return l != NULL ? l->scope : "";
}
