/* Group commit: concurrent LMDB writes share one write transaction and one fsync.
 *
 * Each store has one writer thread (started by idem__gc_init, stopped by idem__gc_fini
 * once it has run what is queued). A caller of idem__gc_write queues its operation and
 * sleeps on a semaphore of its own. The writer thread sleeps while the queue is empty;
 * the enqueue that finds it asleep wakes it, once (after releasing the queue's lock). It
 * takes up to max_batch queued operations, applies them in order in one txn, commits,
 * and posts the semaphore of each operation of that batch, and of no other: no
 * broadcast, each caller is woken once, when its result is there. Nobody lingers: a
 * batch is what queued up while the previous commit was running, so 64 callers share an
 * fsync.
 *
 * A write that finds nothing queued and nothing committing (neither the writer thread
 * nor another such write) is committed on its caller's thread instead, in a txn of its
 * own: when writes do not overlap that saves the two hand-offs to the writer thread and
 * back (bench d, MDB_NOSYNC, 16 clients: 10.5 → 5.9 context switches per call). Writes
 * that arrive meanwhile queue for the writer thread, which that caller wakes at its end.
 * Either way each txn is begun and committed by one thread, as LMDB requires.
 *
 * Every caller returns only after the commit holding its write is durable (or has
 * failed): claims, completions, releases and renewals alike, so a new key is two durable
 * commits (README, "Which writes reach the disk before which reply"). An operation that
 * fails with a storage error (e.g. MDB_MAP_FULL) poisons the txn; the batch is then
 * aborted and each operation re-run in a txn of its own, so every caller gets its own,
 * exact result and its own error message, handed over with it.
 *
 * A transactional handler's txn (txn.c) is begun and committed on the handler's thread,
 * outside group commit. LMDB's writer lock (one write txn per env, across threads and
 * processes) keeps it and group commit apart: the writer thread's (or an inline
 * caller's) mdb_txn_begin waits while a handler holds it. A thread holding a handler txn
 * never queues here (txn.c refuses a nested write), so it never waits for the writer
 * thread while the writer thread waits for it.
 *
 * With enabled false (IDEM_STORE_NO_GROUP_COMMIT, or a read-only store) there is no
 * writer thread: each write is its own txn, on the caller's thread. */
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
 * afresh on every run. It runs on the writer thread: it must not depend on the caller's
 * thread-local state. */
typedef idem_code (*idem_write_fn)(MDB_txn *txn, void *ctx);

typedef struct idem_write_op idem_write_op;

typedef struct idem_group_commit {
    MDB_env *env;
    bool enabled;
    size_t max_batch;
    pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv;  /* the writer thread's: work queued, or stopping */
    idem_write_op *head, *tail;
    bool writer_asleep; /* in cv's wait with an empty queue: the next enqueue wakes it */
    bool writer_busy;   /* the writer thread runs a batch */
    bool inline_busy;   /* a caller commits its own write (nothing was queued or running) */
    bool stopping;
    bool started; /* the writer thread runs (enabled, and pthread_create succeeded) */
    pthread_t writer;
    uint64_t commits, writes; /* batches run and operations in them (statistics) */
    uint64_t wakeups;         /* times an enqueue woke the writer thread (statistics) */
    uint64_t early_wakeups;   /* a writer woke, then had to wait again (statistics) */
} idem_group_commit;

/* Starts the writer thread when enabled. IDEM_RESOURCE_EXHAUSTED when it cannot. */
idem_code idem__gc_init(idem_group_commit *gc, MDB_env *env, bool enabled, size_t max_batch);
/* Runs what is queued, then stops and joins the writer thread. No idem__gc_write may
 * start once this has been called. */
void idem__gc_fini(idem_group_commit *gc);

/* Runs fn in a committed write txn (shared with other writers when enabled). */
idem_code idem__gc_write(idem_group_commit *gc, idem_write_fn fn, void *ctx);

#endif
