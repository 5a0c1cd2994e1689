/* Transactional handlers: the business write and the idempotency record commit in ONE
 * transaction, on either store.
 *
 * A method registered with IDEM_METHOD_TRANSACTIONAL runs its handler inside a write
 * transaction of the store. The handler reads and writes business key-value data
 * through idem_call_txn() and idem_txn_* (the same code on both stores), and on
 * PostgreSQL may run its own SQL on the transaction's connection (idem_txn_pg_conn).
 * When it returns IDEM_OK, the COMPLETED record is written into the same transaction
 * and both commit together. A crash before the commit leaves neither, and a retry runs
 * it again: since the effect never happened that is still exactly once. Any other code
 * rolls the business writes back: a final error (FAILED_PRECONDITION, ...) is recorded
 * and replayed without an effect, a transient one also frees the key.
 *
 * LMDB: the claim commits first, then the handler's txn holds the env's one writer
 * lock, so transactional handlers of one store run one at a time (keep them short: no
 * network calls inside). A crash leaves the claim until its lease ends.
 *
 * PostgreSQL: the claim itself is in the handler's transaction (BEGIN; claim; handler;
 * record; COMMIT), at READ COMMITTED, the server's default. A duplicate on any instance
 * does not wait on the open transaction's rows: it sees the key taken (an advisory
 * lock), waits parked (holding no connection) and replays the result when the
 * transaction commits. A session that dies, or sits idle in the transaction for
 * 5 minutes, rolls it back. A crash, or a lost connection, rolls everything back at
 * once: the next retry runs without waiting for a lease. idem_txn_* data lives in the
 * table idem_kv(db, k, v); a read locks the row (SELECT ... FOR UPDATE semantics, for
 * absent keys too), so read-modify-write sequences of concurrent handlers on the same
 * keys serialise instead of losing updates, and a deadlock between two handlers ends
 * one of them with IDEM_UNAVAILABLE (retried by the client, nothing committed).
 * Transactions run in parallel, one pool connection each: size the pool to the server's
 * workers.
 *
 * Methods whose effect lives elsewhere use the plain claim mode (IDEM_METHOD_CACHED):
 * at-least-once after a crash past the lease, exactly-once otherwise. */
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
 * "app." prefix on LMDB so they never meet idemrpc's own; on PostgreSQL they are the db
 * column of idem_kv; names starting "idem." belong to the toolkit). *val points into the map and is
 * valid until the transaction ends. IDEM_NOT_FOUND when absent. */
IDEM_API idem_code idem_txn_get(idem_txn *t, const char *db, const void *key, size_t klen,
                                const void **val, size_t *vlen);
IDEM_API idem_code idem_txn_put(idem_txn *t, const char *db, const void *key, size_t klen,
                                const void *val, size_t vlen);
IDEM_API idem_code idem_txn_del(idem_txn *t, const char *db, const void *key, size_t klen);

/* The PostgreSQL connection of any transaction on the PostgreSQL store, NULL on another
 * store. It works in every idem_txn:
 *   - a transactional handler's (idem_call_txn(call)): inside the transaction that
 *     will hold the record (READ COMMITTED, the claim already made);
 *   - idem_store_run_txn's fn: the transaction fn's return commits or aborts;
 *   - idem_consume's fn (a NATS consumer's handler, nats.h): the transaction that also
 *     writes the message's marker;
 *   - idem_locked_update's (and _with's) check and update: after the fence, so what
 *     they write commits with it (a superseded holder's writes are refused together).
 * Run your own SQL on it; do not COMMIT, ROLLBACK or change the isolation level: the
 * library ends the transaction. A failed statement aborts the transaction: return its
 * error code (IDEM_UNAVAILABLE for serialization failures and deadlocks, so that the
 * client or the caller retries). Valid only while that transaction runs; the type is
 * libpq's PGconn (include <libpq-fe.h>; `pkg-config --cflags --libs idemrpc` gives
 * libpq's flags when the library was built with it). */
IDEM_API struct pg_conn *idem_txn_pg_conn(idem_txn *t);

/* Reads a business value outside a handler (own read txn); *val is malloc'd. */
IDEM_API idem_code idem_store_app_get(idem_store *st, const char *db, const void *key, size_t klen,
                                      void **val, size_t *vlen);

#ifdef __cplusplus
}
#endif
#endif
