/* The lease keeper (keeper.c): the heartbeat of running claims. A server's in-flight
 * table keeps the leases of its running handlers with one; a lock (toolkit/lock.c)
 * keeps its lease with the server's (taken through a call) or with one its store shares
 * between the locks held outside a server. */
#ifndef IDEMRPC_KEEPER_H
#define IDEMRPC_KEEPER_H

#include "call.h"
#include "store.h"

typedef struct idem_keeper idem_keeper;
typedef struct idem_keep idem_keep;

/* Starts the keeper thread. rt gives the wall clock and the log sink; NULL: this host's
 * clock, no log lines. Leases are renewed in st. */
idem_code idem__keeper_create(idem_keeper **out, idem_store *st, const idem_runtime *rt);
/* Stops the thread (a renewal in flight finishes first) and frees what is still kept. */
void idem__keeper_destroy(idem_keeper *k);

/* Renews the lease of (key, owner) to now + lease_ms every lease_ms/3 (every lease_ms/10
 * after a round that could not renew it), for up to max_run_ms, until
 * idem__keeper_unkeep. asked: idem__mono_ms() taken before the claim's request left;
 * the lease, the renewals and max_run_ms count from then (0 or a later value: now).
 * NULL (no renewal) only when out of memory. */
idem_keep *idem__keeper_keep(idem_keeper *k, const idem_key_ref *key, uint64_t owner,
                             uint64_t lease_ms, uint64_t max_run_ms, uint64_t asked);
/* Stops renewing and frees kp (NULL is a no-op). */
void idem__keeper_unkeep(idem_keeper *k, idem_keep *kp);
/* How an outcome recorded later is written: complete in place of idem__store_complete_at
 * (the same arguments and answers), e.g. with the call's step journal deleted in the
 * same txn as on the normal path. arg (malloc'd, may be NULL) becomes the keeper's, freed
 * once the outcome is over. A NULL with: idem__store_complete_at. */
typedef struct idem__record_with {
    idem_code (*complete)(void *arg, idem_store *st, const idem_key_ref *key, uint64_t owner,
                          const uint8_t *response, size_t len, uint64_t expires_ms,
                          uint64_t now_ms);
    void *arg;
} idem__record_with;
/* Hands kp over to the keeper with the claim's final outcome (response, malloc'd: the
 * keeper's now), which the store could not record: the keeper goes on renewing the lease
 * and completes the claim again, with a backoff, until it lands, the claim is lost or
 * kp's max run time passes (keeper.c); then it frees kp and calls on_end. kp's owner
 * must not use kp again. ttl_ms: how long the record is kept once it lands; with: how
 * (may be NULL). */
void idem__keeper_record_later(idem_keeper *k, idem_keep *kp, uint8_t *response, size_t len,
                               uint64_t ttl_ms, const idem__record_with *with);
/* fn(arg, key) runs on the keeper thread when an outcome recorded later has ended
 * (recorded or given up): the key's waiters should read the store again. */
void idem__keeper_on_end(idem_keeper *k, void (*fn)(void *arg, const idem_key_ref *key), void *arg);
/* True once a renewal of kp answered IDEM_ABORTED (the claim is no longer its owner's),
 * and while its lease has run out without a renewal (another claimer may take it). */
bool idem__keeper_lost(idem_keeper *k, const idem_keep *kp);
/* When kp's lease ran out by its owner's own count (wall ms, the records' clock; 0 while
 * it has not, or for NULL): what a line about a claim lost says, so that a reader can
 * tell this owner's lapse (a pause, a slow store) from a claim taken while it held. */
uint64_t idem__keeper_lapsed_at(idem_keeper *k, const idem_keep *kp);

#endif
