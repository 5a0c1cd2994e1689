/* A distributed lease lock with fencing tokens, on either store (一锁、二判、三更新).
 *
 * For a critical section that no unique key expresses: one settlement per merchant
 * per day across every instance, one reconciliation at a time. Most of the time the
 * unique key (a cached method, idem_consume) or the state machine (idem_sm_advance) is
 * the better tool: they decide in the same transaction as the effect and need no lock
 * at all. Take a lock when the decision spans more than one transaction, or work
 * outside the store (another service), and no single key can carry it.
 *
 * What a lock is. A record in the store's own record space: caller = scope, method
 * IDEM_LOCK_METHOD, key = name. (No RPC can meet it: a wire method has a '/'.) Acquiring
 * is a claim of that record with a store-assigned owner, exactly like a call's claim:
 * of concurrent acquirers one wins, and its owner id is the lock's fencing token, taken
 * from the store's one counter of claims, so every acquisition of a lock gets a larger
 * token than any before it. The record holds a lease; a holder whose process dies (or
 * stops: SIGSTOP, a GC-like pause) stops renewing and loses the lock once the lease has
 * passed, judged on the database's clock on PostgreSQL. Releasing deletes the record.
 *
 * Why a lease row on PostgreSQL, not an advisory lock or a transaction's row lock. An
 * advisory lock is freed the moment its session dies, but it belongs to one pooled
 * connection for the whole hold (a pool of 8 and 8 holders stops the server), breaks
 * behind a transaction-mode pooler, and hands out no token; a row lock needs a
 * transaction open for the whole critical section, which is exactly what a section
 * that calls another service must not do. Both also end at once when the connection
 * drops while the holder keeps working, so a second holder appears anyway and fencing
 * is still needed. The lease row uses a connection only to acquire, renew and release,
 * works the same on both stores, and its cost is stated: a dead holder keeps the lock
 * until its lease ends (so keep the lease short: it is renewed while you work).
 *
 * Renewal. A lock taken outside a server (idem_lock_acquire) is renewed every lease/3
 * by a keeper thread that the locks of one store share in this process (started with
 * the first held lock, stopped with the last), up to max_hold_ms. A lock taken in a
 * handler (idem_call_lock) is renewed by the server's own lease keeper, the heartbeat
 * of the handler's claim, and released when the handler returns if it was not
 * already. With manual_renew nothing renews it but idem_lock_renew: a holder that
 * stops making progress then loses the lock, which some prefer.
 *
 * Waiting. A busy lock is waited for up to wait_ms: a release in this process, or (on
 * PostgreSQL) any instance's release announced by NOTIFY, wakes the waiters at once;
 * otherwise (LMDB shared by several processes, or no_notify) they re-read with a
 * jittered backoff of 5 ms doubling to 200 ms, never past the holder's lease end or
 * their own bound. This bounded polling is the fallback where nothing can be awaited.
 *
 * Fencing. A lease can end while its holder still works (a pause longer than the
 * lease, a renewal that could not reach the store). Then two holders exist for a
 * moment, and only the store can tell them apart: idem_txn_fence(t, scope, name, token)
 * inside a write txn raises the highest token seen for the lock (in the reserved
 * business database IDEM_FENCE_DB) and refuses an older one with IDEM_ABORTED, so
 * every write of that txn (idem_txn_*, idem_sm_advance, idem_versioned_put) is refused
 * for a holder that has been superseded by a holder that wrote. Check the business
 * state inside the fenced txn, after the fence: a newer holder then also sees whatever
 * an older one managed to commit before it. Pass the token downstream for writes to
 * other systems, and have them keep the same rule.
 *
 * Bounds: name 1..IDEM_LOCK_MAX_NAME bytes and scope 0..IDEM_MAX_CALLER bytes, UTF-8
 * without control characters; lease IDEM_LOCK_MIN_LEASE_MS..IDEM_LOCK_MAX_LEASE_MS;
 * wait up to IDEM_LOCK_MAX_WAIT_MS; hold up to IDEM_LOCK_MAX_HOLD_MS. Anything else is
 * IDEM_INVALID_ARGUMENT with idem_errmsg() naming it. Lock records show in idemctl and
 * in the store's in_progress count; the sweeper deletes those whose lease has passed.
 * Fence entries are kept: one per lock name ever fenced. */
#ifndef IDEMRPC_LOCK_H
#define IDEMRPC_LOCK_H

#include <stdbool.h>
#include <stdint.h>

#include "chain.h"
#include "status.h"
#include "store.h"
#include "toolkit.h"
#include "txn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_lock idem_lock;

#define IDEM_LOCK_METHOD "idem.lock" /* the record space of locks */
#define IDEM_FENCE_DB "idem.fence"   /* stored as "app.idem.fence": the highest tokens */
#define IDEM_LOCK_MAX_NAME IDEM_MAX_KEY
#define IDEM_LOCK_DEFAULT_LEASE_MS 10000
#define IDEM_LOCK_MIN_LEASE_MS 100
#define IDEM_LOCK_MAX_LEASE_MS 600000
#define IDEM_LOCK_MAX_WAIT_MS 600000
#define IDEM_LOCK_DEFAULT_MAX_HOLD_MS 300000
#define IDEM_LOCK_MAX_HOLD_MS 86400000

typedef struct idem_lock_opts {
    uint64_t lease_ms;    /* 0 = IDEM_LOCK_DEFAULT_LEASE_MS (10 s) */
    uint64_t wait_ms;     /* how long a busy lock is waited for; 0 = try once */
    uint64_t max_hold_ms; /* renewal stops this long after acquiring; 0 = 5 min */
    bool manual_renew;    /* nothing renews the lease but idem_lock_renew */
} idem_lock_opts;

/* Acquires the lock `name` of `scope` (NULL = "") in st, waiting up to opts->wait_ms
 * while another holder has it. opts may be NULL (defaults: try once). On IDEM_OK *out
 * is held (idem_lock_token() is its fencing token) until idem_lock_release. Codes:
 * IDEM_ABORTED when it stayed held by another for the whole wait; IDEM_INVALID_ARGUMENT
 * for a bound; IDEM_FAILED_PRECONDITION when the record under that name is not a lock,
 * or called from inside a store transaction on LMDB (the thread holds the writer); the
 * store's own codes (IDEM_UNAVAILABLE while PostgreSQL is down: nothing was acquired). */
IDEM_API idem_code idem_lock_acquire(idem_store *st, const char *scope, const char *name,
                                     const idem_lock_opts *opts, idem_lock **out);

/* The same from a handler, in the server's store and with the call's caller as scope;
 * the wait also ends at the call's deadline. The lock is renewed by the server's lease
 * keeper and released when the handler returns, if it still holds it. Only on the
 * handler's thread. IDEM_FAILED_PRECONDITION in a call no server runs, and inside a
 * transactional handler (its transaction already serialises what it touches: idem_txn_*
 * reads lock their rows; a lock would be released before that transaction commits). */
IDEM_API idem_code idem_call_lock(idem_call *call, const char *name, const idem_lock_opts *opts,
                                  idem_lock **out);

/* Extends the lease to now + lease_ms. IDEM_ABORTED when the lock is no longer this
 * holder's (its lease passed and another acquired it, or the record was swept): stop
 * working under it; every later fenced write with its token will be refused once the
 * newer holder has written. */
IDEM_API idem_code idem_lock_renew(idem_lock *l);

/* Stops the renewal, releases the lock (the next waiter may take it at once) and frees
 * l, whatever the outcome. IDEM_ABORTED when it had been lost already. */
IDEM_API idem_code idem_lock_release(idem_lock *l);

/* Whether this holder still holds the lock by its own clock: its lease, counted from the
 * moment the acquisition or the last renewal that succeeded was asked for (never from the
 * store's answer, which a slow store sends late), has not run out, and no renewal found
 * it taken. False: another holder may have it now; a renewal that succeeds later makes
 * it true again. Check it just before an effect the lock guards that no fence protects;
 * a fenced txn (idem_txn_fence_lock) stays the store's own proof. False for NULL. */
IDEM_API bool idem_lock_held(const idem_lock *l);

/* The fencing token: nonzero, larger than every earlier acquisition's in this store. */
IDEM_API uint64_t idem_lock_token(const idem_lock *l);
IDEM_API const char *idem_lock_name(const idem_lock *l);
IDEM_API const char *idem_lock_scope(const idem_lock *l);

/* Inside a write txn: refuses the txn's writes to a holder older than one that has
 * written. Reads the highest token fenced for (scope, name): a smaller token is
 * IDEM_ABORTED ("fenced", nothing written: abort the txn); an equal one passes; a
 * larger one is written as the new highest and passes. Call it first in the txn, then
 * check and write. On PostgreSQL the read locks the fence row, so concurrent fenced txns
 * of one lock serialise. token 0 or a bad name is IDEM_INVALID_ARGUMENT. */
IDEM_API idem_code idem_txn_fence(idem_txn *t, const char *scope, const char *name, uint64_t token);
/* idem_txn_fence with the lock's own scope, name and token. */
IDEM_API idem_code idem_txn_fence_lock(idem_txn *t, const idem_lock *lock);

/* ---- 一锁、二判、三更新: lock, check, update, release in one call ---- */

typedef enum idem_locked_outcome {
    IDEM_LOCKED_UPDATED = 1,  /* check said "to do": update ran and committed */
    IDEM_LOCKED_ALREADY_DONE, /* check said "done before": nothing written */
} idem_locked_outcome;

/* 1. acquires the lock (scope, name) with opts; 2. in one write txn: idem_txn_fence with
 * its token, then check(t, arg) (may be NULL): IDEM_OK means "to do", IDEM_ALREADY_EXISTS
 * means "done before" (the txn is rolled back, *outcome = IDEM_LOCKED_ALREADY_DONE), any
 * other code aborts and is returned; 3. update(t, arg), committed with the fence when it
 * returns IDEM_OK; 4. releases the lock. IDEM_OK with *outcome (may be NULL), or: the
 * acquire's codes (IDEM_ABORTED: busy for the whole wait), IDEM_ABORTED "fenced" when a
 * newer holder has written (this holder's lease had passed: nothing written), or
 * check's, update's or the commit's code. The release's outcome does not change the
 * result: the txn's fate is decided by the fence, and a lock that could not be released
 * ends with its lease. check and update run inside the txn: keep them short, no calls
 * to other services (use idem_lock_acquire and your own fenced txn for that). Not from
 * inside a store transaction (IDEM_FAILED_PRECONDITION, as idem_store_run_txn). */
IDEM_API idem_code idem_locked_update(idem_store *st, const char *scope, const char *name,
                                      const idem_lock_opts *opts, idem_txn_fn check,
                                      idem_txn_fn update, void *arg, idem_locked_outcome *outcome);

/* A check or update that is handed the held lock: idem_lock_token(lock) is the fencing
 * token this txn was fenced with (record it with the row, e.g. which holder wrote a
 * settlement). The lock is valid only during the call. */
typedef idem_code (*idem_locked_fn)(idem_txn *t, const idem_lock *lock, void *arg);

/* idem_locked_update whose check and update receive the lock (check may be NULL). */
IDEM_API idem_code idem_locked_update_with(idem_store *st, const char *scope, const char *name,
                                           const idem_lock_opts *opts, idem_locked_fn check,
                                           idem_locked_fn update, void *arg,
                                           idem_locked_outcome *outcome);

#ifdef __cplusplus
}
#endif
#endif
