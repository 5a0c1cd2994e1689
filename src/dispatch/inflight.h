/* The in-flight table (inflight.c): parked duplicates keyed by bucket, and the lease
 * keeper of running handlers. Owned by the server; the built-in result_cache uses it. */
#ifndef IDEMRPC_INFLIGHT_H
#define IDEMRPC_INFLIGHT_H

#include "dispatch.h"
#include "keeper.h"

/* resume(arg, job) hands a woken job back to the workers (from any thread); leases
 * are renewed in store. */
idem_code idem__inflight_create(idem_inflight **out, idem_runtime *rt, idem_store *store,
                                size_t max_parked, void (*resume)(void *arg, idem_job *job),
                                void *resume_arg);
/* Stops parking: returns the jobs still parked (the caller drops them); parking is
 * refused from now on and blocking waiters return false. Leases are still renewed. */
idem_job *idem__inflight_close(idem_inflight *t);
/* Stops the lease keeper too (after the handlers finished) and frees the table. */
void idem__inflight_destroy(idem_inflight *t);

uint32_t idem__inflight_bucket(const idem_key_ref *key);
/* The bucket of an idem__key_hash (a store's completion announcement). */
uint32_t idem__inflight_bucket_of(uint32_t key_hash);
/* Read before the store read that decides to wait. */
uint64_t idem__inflight_gen(idem_inflight *t, uint32_t bucket);

typedef enum idem_park {
    IDEM__PARKED,       /* the job belongs to the table until it is resumed */
    IDEM__PARK_CHANGED, /* the bucket moved on since seen_gen: read the store again now */
    IDEM__PARK_FULL,    /* max waiters reached (or stopping): answer without waiting */
} idem_park;
/* Parks job on bucket until a notify or until wake_ms (monotonic). */
idem_park idem__inflight_park(idem_inflight *t, idem_job *job, uint32_t bucket, uint64_t seen_gen,
                              uint64_t wake_ms);
/* After a completion or release committed: resumes every job parked on the bucket. */
void idem__inflight_notify(idem_inflight *t, uint32_t bucket);
/* For a call that cannot park: blocks until the bucket moves on or wait_ms pass. False
 * when the server is stopping. */
bool idem__inflight_wait(idem_inflight *t, uint32_t bucket, uint64_t seen_gen, uint64_t wait_ms);

/* Renews the lease of (key, owner) every lease_ms/3 for up to max_run_ms, until
 * idem__inflight_unkeep; asked as idem__keeper_keep's (the claim's ask). NULL (no
 * renewal) only when out of memory. */
idem_keep *idem__inflight_keep(idem_inflight *t, const idem_key_ref *key, uint64_t owner,
                               uint64_t lease_ms, uint64_t max_run_ms, uint64_t asked);
void idem__inflight_unkeep(idem_inflight *t, idem_keep *k);
/* Instead of unkeep, for a final outcome the store could not record: the keeper renews
 * the lease and records it later (idem__keeper_record_later); the key's waiters are
 * woken when that ends. */
void idem__inflight_record_later(idem_inflight *t, idem_keep *k, uint8_t *response, size_t len,
                                 uint64_t ttl_ms, const idem__record_with *with);
/* The table's keeper and store: a lock a handler takes through its call (lock.c) is
 * renewed by the same heartbeat as the handler's claim. */
idem_keeper *idem__inflight_keeper(idem_inflight *t);
idem_store *idem__inflight_store(idem_inflight *t);

#endif
