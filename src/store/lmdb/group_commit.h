/* Group commit: concurrent LMDB writes share one write transaction and one fsync.
 *
 * A writer queues its operation; whoever finds no batch running becomes the leader,
 * takes up to max_batch queued operations, applies them in order in one txn, commits,
 * and wakes their writers. Nobody lingers: a batch is what queued up while the previous
 * commit was running, so a lone writer pays nothing extra and 64 writers share an fsync.
 * Every writer returns only after the commit holding its write is durable (or has
 * failed). An operation that fails with a storage error (e.g. MDB_MAP_FULL) poisons the
 * txn; the batch is then aborted and each operation re-run in a txn of its own, so
 * every writer gets its own, exact result. */
#ifndef IDEMRPC_GROUP_COMMIT_H
#define IDEMRPC_GROUP_COMMIT_H

#include <lmdb.h>
#include <pthread.h>
#include <stdbool.h>

#include "internal.h"

/* The idem_code and message (idem_errmsg) of a failed LMDB call: IDEM_RESOURCE_EXHAUSTED
 * when the map or txn is full, IDEM_INTERNAL otherwise. The one mapping of an LMDB rc,
 * used by group commit and by every file of the LMDB store. */
idem_code idem__lmdb_code(int rc, const char *what);

/* Applies one operation inside txn. A code other than IDEM_OK must leave the txn
 * unchanged unless it is IDEM_RESOURCE_EXHAUSTED or IDEM_INTERNAL (storage errors). The
 * function may run more than once (after a batch failure), so it must set its outputs
 * afresh on every run. */
typedef idem_code (*idem_write_fn)(MDB_txn *txn, void *ctx);

typedef struct idem_write_op idem_write_op;

typedef struct idem_group_commit {
    MDB_env *env;
    bool enabled;
    size_t max_batch;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a batch finished */
    idem_write_op *head, *tail;
    bool leader_active;
    uint64_t commits, writes; /* batches run and operations in them (statistics) */
    uint64_t early_wakeups;   /* a writer woke, then had to wait again (statistics) */
} idem_group_commit;

void idem__gc_init(idem_group_commit *gc, MDB_env *env, bool enabled, size_t max_batch);
void idem__gc_fini(idem_group_commit *gc);

/* Runs fn in a committed write txn (shared with other writers when enabled). */
idem_code idem__gc_write(idem_group_commit *gc, idem_write_fn fn, void *ctx);

#endif
