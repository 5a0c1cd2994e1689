/* Group commit: pipelined durability, one fdatasync per commit.
 *
 * Why one sync is enough (LMDB 0.9.24, libraries/liblmdb/mdb.c): mdb_txn_commit writes
 * the txn's dirty pages (mdb_page_flush: pwrite, or lseek + writev, on env->me_fd), then
 * calls mdb_env_sync(env, 0) (fdatasync(me_fd)), then mdb_env_write_meta, which picks
 *     mfd = (flags & (MDB_NOSYNC|MDB_NOMETASYNC)) ? env->me_fd : env->me_mfd;
 * me_mfd is the same file opened O_DSYNC: by default the meta write is a second flush.
 * With MDB_NOMETASYNC (env.c sets it on a durable store with group commit) it is a plain
 * pwrite on me_fd: the commit costs one fdatasync, and its meta page, the one pointer
 * to the new tree, waits in the page cache. fdatasync flushes the file's dirty pages,
 * whichever fd wrote them (me_fd and me_mfd name one inode), so the data fdatasync of
 * the NEXT commit, which begins only after this one ended (LMDB's writer lock), puts this
 * meta page on disk before that commit writes its own; mdb_env_sync(env, 1) does the same
 * when no commit follows. Integrity stays LMDB's ("preserves ACI"): a crash before that
 * flush finds the previous meta page, and its tree is whole, since a txn reuses only
 * pages freed two txns back (mdb_find_oldest: txnid - 1, or an older reader).
 *
 * With the store's write-ahead log (wal.h) a batch whose entry is flushed is answered
 * at once when the state before it is recoverable (durable_txnid is its txnid - 1 or
 * more: a replay's chain from the txnid LMDB recovers reaches it); durable_txnid then
 * counts it. Otherwise, and without the log, a batch's callers are woken only once its
 * state is known on disk:
 *   - after a later commit, when mdb_env_info's me_last_txnid (the newer meta page, read
 *     from the map) is past the pipe's txnid: a commit with a larger txnid wrote its meta
 *     page, which LMDB does only once that commit's fdatasync has returned;
 *   - at once, by mdb_env_sync(env, 1), when the writer thread finds nothing queued
 *     (idem__gc_pipe_flush), before the redo of a failed batch, and when stopping.
 * A batch that wrote nothing (its ops refused) did not sync, and its answers may rest on
 * the pending state: it joins the pipe behind it. A reader that found a record answers
 * from it only once its snapshot is durable (idem__gc_durable_wait), a handler txn syncs
 * what it finds pending (idem__gc_sync_pending, from idem__gc_lock_wanted), and every
 * commit outside a batch syncs itself (idem__gc_commit_durable): no answer rests on a
 * meta page that is not on disk.
 *
 * A failed sync is another matter (group_commit_sync.c): after one, the pipe is flushed
 * by a re-write (pipe_sync), and a later batch's commit vouches for it only when it was
 * written after the failure.
 * tests/test_power_cut.c proves it: a server whose unsynced writes are undone after a
 * SIGKILL loses no answered result, and fails when a batch is answered at its commit. */
#include <stdio.h>
#include <string.h>

#include "group_commit_op.h"

/* Syncs what a pipe holds: IDEM_OK once it is on disk, by a sync or, after a failed
 * one, by a re-write (group_commit_sync.c); else the error, its message set. */
static idem_code pipe_sync(idem_group_commit *gc, uint64_t txnid)
{
    int rc = idem__gc_sync_file(gc, txnid);
    if (rc == 0) {
        return IDEM_OK;
    }
    if (gc->rewrite == NULL) {
        return idem__lmdb_code(rc, "sync");
    }
    return idem__gc_write_alone(gc, gc->rewrite, gc->rewrite_ctx);
}

void idem__gc_sync_pending(idem_group_commit *gc)
{
    uint64_t last = idem__gc_last_txnid(gc->env);
    if (gc->pipelined && atomic_load(&gc->durable_txnid) < last) {
        (void)idem__gc_sync_file(gc, last); /* failed: the txn's own commit syncs, and says so */
    }
}

void idem__gc_batch_ended(idem_group_commit *gc, idem_gc_batch *b, uint64_t ticket, bool ok,
                          uint64_t commit_us)
{
    pthread_mutex_lock(&gc->mu);
    gc->last_commit_us = ok ? commit_us : gc->last_commit_us;
    gc->done_ticket = ticket;
    gc->pending_ticket = gc->pending_ticket <= ticket ? 0 : gc->pending_ticket;
    if (gc->done_waiters > 0) {
        pthread_cond_broadcast(&gc->done_cv);
    }
    pthread_mutex_unlock(&gc->mu);
    for (idem_write_op *op = b->held, *next; op != NULL; op = next) {
        next = op->held_next;
        idem__gc_op_unref(op);
    }
}

/* Wakes every op of b not woken yet, with IDEM_OK's result, or, when the sync failed,
 * with its code and this thread's idem_errmsg (copied: a post may set another). */
static void post_all(idem_gc_batch *b, idem_code sync)
{
    char msg[sizeof(b->head->err)];
    snprintf(msg, sizeof(msg), "%s", sync != IDEM_OK ? idem_errmsg() : "");
    for (idem_write_op *op = b->head, *next; op != NULL; op = next) {
        next = op->next; /* op may be gone once posted */
        if (!op->posted) {
            if (sync != IDEM_OK) {
                idem__gc_op_finish(op, idem__err(sync, "%s", msg));
            }
            idem__gc_op_post(op);
        }
    }
}

static void pipe_release(idem_group_commit *gc, idem_gc_pipe *pipe, idem_code sync)
{
    if (sync == IDEM_OK) {
        idem__gc_durable_raise(gc, pipe->txnid);
    }
    post_all(&pipe->b, sync);
    idem__gc_batch_ended(gc, &pipe->b, pipe->ticket, true, pipe->commit_us);
    memset(pipe, 0, sizeof(*pipe));
}

/* Appends batch b (committed, its state at txnid) to pipe. */
static void pipe_take(idem_gc_pipe *pipe, idem_gc_batch *b, uint64_t ticket, uint64_t txnid,
                      uint64_t commit_us)
{
    idem_gc_batch *p = &pipe->b;
    if (b->head != NULL) {
        *(p->tail != NULL ? &p->tail->next : &p->head) = b->head;
        p->tail = b->tail;
    }
    idem_write_op **hp = &p->held;
    while (*hp != NULL) {
        hp = &(*hp)->held_next;
    }
    *hp = b->held;
    p->n += b->n;
    pipe->ticket = ticket;
    pipe->txnid = txnid;
    pipe->commit_us = commit_us;
}

void idem__gc_pipe_flush(idem_group_commit *gc, idem_gc_pipe *pipe)
{
    if (pipe->ticket != 0) {
        pipe_release(gc, pipe, pipe_sync(gc, pipe->txnid));
    }
}

void idem__gc_pipe_committed(idem_group_commit *gc, idem_gc_pipe *pipe, idem_gc_batch *b,
                             uint64_t ticket, bool ok, uint64_t commit_us, uint64_t logged)
{
    if (!ok || !gc->pipelined || gc->answer_at_commit) {
        if (ok) { /* a failed batch's redo has posted every op, each txn durable */
            post_all(b, IDEM_OK);
        }
        idem__gc_batch_ended(gc, b, ticket, ok, commit_us);
        return;
    }
    uint64_t txnid = idem__gc_last_txnid(gc->env);
    /* This commit's fdatasync flushed the pipe's meta page, unless a failed sync came
     * between them: then it stays, to be flushed with this one's. */
    if (pipe->ticket != 0 &&
        (atomic_load(&gc->durable_txnid) >= pipe->txnid ||
         (txnid > pipe->txnid && pipe->txnid > atomic_load(&gc->unsure_txnid)))) {
        pipe_release(gc, pipe, IDEM_OK);
    }
    /* Logged, and the state it was built on is on disk or logged (the pipe, released
     * above when it is, holds nothing older): a replay reaches it (wal.h). */
    if (logged != 0 && pipe->ticket == 0 && atomic_load(&gc->durable_txnid) + 1 >= logged) {
        idem__gc_durable_raise(gc, logged);
        post_all(b, IDEM_OK);
        idem__gc_batch_ended(gc, b, ticket, true, commit_us);
        return;
    }
    pipe_take(pipe, b, ticket, txnid, commit_us);
    pthread_mutex_lock(&gc->mu);
    gc->pending_ticket = ticket;
    pthread_mutex_unlock(&gc->mu);
}

idem_code idem__gc_durable_wait(idem_group_commit *gc, uint64_t txnid)
{
    if (!gc->pipelined || atomic_load(&gc->durable_txnid) >= txnid) {
        return IDEM_OK;
    }
    pthread_mutex_lock(&gc->mu);
    /* The writer thread's pending batches end at its next commit, or at its sync when it
     * finds nothing queued; a waiter makes a batch it holds open commit now (hold_open). */
    while (atomic_load(&gc->durable_txnid) < txnid && gc->pending_ticket != 0) {
        if (gc->writer_holding) {
            gc->writer_holding = false;
            pthread_cond_signal(&gc->cv);
        }
        gc->done_waiters++;
        pthread_cond_wait(&gc->done_cv, &gc->mu);
        gc->done_waiters--;
    }
    pthread_mutex_unlock(&gc->mu);
    if (atomic_load(&gc->durable_txnid) >= txnid) {
        return IDEM_OK;
    }
    /* Nothing of the writer thread's pending: a commit that syncs itself, or another
     * process's, wrote it; flush it here. */
    int rc = idem__gc_sync_file(gc, txnid);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "sync");
}
