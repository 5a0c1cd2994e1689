/* The lease lock's parts (lock.c acquire, renew, release and the call's locks;
 * lock_site.c what the locks of one store share in this process; fence.c the fencing
 * check; locked_update.c 一锁二判三更新). */
#ifndef IDEMRPC_LOCK_INTERNAL_H
#define IDEMRPC_LOCK_INTERNAL_H

#include "idemrpc/lock.h"

#include "call.h"
#include "keeper.h"
#include "store.h"

/* (scope, name) bounds, shared by the lock and the fence: the names' own rules. */
idem_code idem__lock_names_check(const char *scope, const char *name);

typedef struct idem_lock_site idem_lock_site;

/* An acquirer waiting for a busy lock. */
typedef struct idem_lock_waiter {
    struct idem_lock_waiter *next;
    uint32_t hash; /* idem__key_hash of the lock's record key */
    bool woken;
} idem_lock_waiter;

/* The site of st with a new reference (created on first use); NULL when out of memory. */
idem_lock_site *idem__lock_site_get(idem_store *st);
void idem__lock_site_put(idem_lock_site *s);
/* The keeper the site's locks held outside a server share, started on first use. */
idem_code idem__lock_site_keeper(idem_lock_site *s, idem_keeper **out);

/* A waiter's life: enter once; before each attempt arm; after a busy attempt wait (until
 * woken by a release of its hash, or until until_mono); leave once. */
void idem__lock_site_enter(idem_lock_site *s, idem_lock_waiter *w, uint32_t hash);
void idem__lock_site_arm(idem_lock_waiter *w);
void idem__lock_site_wait(idem_lock_site *s, idem_lock_waiter *w, uint64_t until_mono);
void idem__lock_site_leave(idem_lock_site *s, idem_lock_waiter *w);
/* A lock with this hash was released in this process: wake its waiters. */
void idem__lock_site_notify(idem_lock_site *s, uint32_t hash);

#endif
