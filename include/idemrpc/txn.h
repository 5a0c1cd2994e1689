/* Transactional handlers: the business write and the idempotency record commit in ONE
 * LMDB transaction.
 *
 * A method registered with IDEM_METHOD_TRANSACTIONAL runs its handler inside a write
 * transaction on the store's LMDB env. The handler reads and writes its own named
 * databases through idem_call_txn(); when it returns IDEM_OK, the COMPLETED record is
 * written into the same transaction and both commit together. A crash before the
 * commit leaves neither (the claim's lease then lets a retry run it again, and since
 * the effect never happened that is still exactly once). Any other code rolls the
 * business writes back: a final error (FAILED_PRECONDITION, ...) is recorded and
 * replayed without an effect, a transient one also releases the claim.
 *
 * Trade-off: LMDB has one writer per env, so transactional handlers of one store run
 * one at a time (keep them short: no network calls inside). Methods whose effect lives
 * elsewhere use the plain claim mode (IDEM_METHOD_CACHED): at-least-once after a crash
 * past the lease, exactly-once otherwise. */
#ifndef IDEMRPC_TXN_H
#define IDEMRPC_TXN_H

#include <stddef.h>

#include "chain.h"
#include "status.h"
#include "store.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_txn idem_txn;

#define IDEM_MAX_DB_NAME 64

/* The write transaction of a transactional handler; NULL in any other call. */
IDEM_API idem_txn *idem_call_txn(idem_call *call);

/* Database names are the caller's own namespace (1..64 bytes; they are stored with an
 * "app." prefix so they never meet idemrpc's own). *val points into the map and is
 * valid until the transaction ends. IDEM_NOT_FOUND when absent. */
IDEM_API idem_code idem_txn_get(idem_txn *t, const char *db, const void *key, size_t klen,
                                const void **val, size_t *vlen);
IDEM_API idem_code idem_txn_put(idem_txn *t, const char *db, const void *key, size_t klen,
                                const void *val, size_t vlen);
IDEM_API idem_code idem_txn_del(idem_txn *t, const char *db, const void *key, size_t klen);

/* Reads a business value outside a handler (own read txn); *val is malloc'd. */
IDEM_API idem_code idem_store_app_get(idem_store *st, const char *db, const void *key, size_t klen,
                                      void **val, size_t *vlen);

#ifdef __cplusplus
}
#endif
#endif
