/* Group commit: the file's syncs, and what each vouches for.
 *
 * A sync that fails (a commit's fdatasync, or mdb_env_sync) is not healed by the next
 * one that succeeds. Linux reports a writeback error once per open file and may mark
 * the pages that failed clean ("fsyncgate", 2018): a later fdatasync that succeeds need
 * not have written them, and says nothing about a page dirtied before the failure. The
 * data pages of a committed txn were synced by its own commit; what may be lost is a
 * meta page written since the last good sync. So:
 *   - a sync vouches only for meta pages written after the last failure (unsure_txnid);
 *     every commit and sync runs under sync_mu, so that the outcome of one is recorded
 *     before the next begins;
 *   - after a failure the writer thread re-writes instead of re-syncing: it commits a
 *     txn that changes one key (gc->rewrite: a new meta page, whose tree holds every
 *     earlier commit) and syncs it; the pipe's callers get IDEM_OK only when that
 *     worked, else its error (group_commit_pipe.c);
 *   - a later batch's commit vouches for nothing written before the failure (that
 *     batch joins the pipe), and a reader whose snapshot no sync can vouch for
 *     (idem__gc_durable_wait: IDEM_INTERNAL "sync") re-writes too (records.c).
 * tests/test_sync_failure.c proves it: a disk that fails one sync (the power-cut
 * recorder drops what that sync did not write) loses no answered result. */
#include <errno.h>

#include "group_commit_op.h"

uint64_t idem__gc_last_txnid(MDB_env *env)
{
    MDB_envinfo info;
    return mdb_env_info(env, &info) == 0 ? (uint64_t)info.me_last_txnid : 0;
}

void idem__gc_durable_raise(idem_group_commit *gc, uint64_t txnid)
{
    uint64_t cur = atomic_load(&gc->durable_txnid);
    while (cur < txnid && !atomic_compare_exchange_weak(&gc->durable_txnid, &cur, txnid)) {
    }
}

/* A commit or sync failed (sync_mu held): no later sync vouches for the meta pages
 * written before it. */
static void sync_failed(idem_group_commit *gc)
{
    uint64_t txnid = idem__gc_last_txnid(gc->env), cur = atomic_load(&gc->unsure_txnid);
    while (cur < txnid && !atomic_compare_exchange_weak(&gc->unsure_txnid, &cur, txnid)) {
    }
}

int idem__gc_sync_file(idem_group_commit *gc, uint64_t want)
{
    pthread_mutex_lock(&gc->sync_mu);
    if (want != 0 && atomic_load(&gc->durable_txnid) >= want) {
        /* The commit or sync this one waited for put it on disk: no second fdatasync
         * (readers of a commit still syncing would each add one, one after another). */
        pthread_mutex_unlock(&gc->sync_mu);
        return 0;
    }
    uint64_t txnid = idem__gc_last_txnid(gc->env);
    int rc = mdb_env_sync(gc->env, 1);
    if (rc != 0) {
        sync_failed(gc);
    } else if (txnid <= atomic_load(&gc->unsure_txnid)) {
        rc = EIO;
    } else {
        idem__gc_durable_raise(gc, txnid);
    }
    pthread_mutex_unlock(&gc->sync_mu);
    return rc;
}

idem_code idem__gc_commit_durable(idem_group_commit *gc, MDB_txn *txn)
{
    MDB_env *env = mdb_txn_env(txn);
    unsigned flags = 0;
    uint64_t txnid = mdb_txn_id(txn);
    pthread_mutex_lock(&gc->sync_mu);
    int rc = mdb_txn_commit(txn);
    const char *what = "commit";
    if (rc == 0 && mdb_env_get_flags(env, &flags) == 0 && (flags & MDB_NOMETASYNC) &&
        !(flags & MDB_NOSYNC)) {
        rc = mdb_env_sync(env, 1);
        what = "sync after commit";
    }
    if (rc != 0) {
        sync_failed(gc);
    } else if (txnid > atomic_load(&gc->unsure_txnid)) {
        idem__gc_durable_raise(gc, txnid); /* its meta page, written after any failure */
    }
    pthread_mutex_unlock(&gc->sync_mu);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, what);
}

int idem__gc_commit_batch(idem_group_commit *gc, MDB_txn *txn)
{
    pthread_mutex_lock(&gc->sync_mu);
    int rc = mdb_txn_commit(txn);
    if (rc != 0) {
        sync_failed(gc);
    }
    pthread_mutex_unlock(&gc->sync_mu);
    return rc;
}
