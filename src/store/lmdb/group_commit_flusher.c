/* Group commit: the flusher, a second thread that puts a batch's meta page on disk while
 * the writer thread already builds the next batch (issue 39, option b).
 *
 * Without it (group_commit_pipe.c) batch N's callers wait for batch N+1's commit, whose
 * fdatasync flushes N's meta page: N+1's whole life (taking ops, holding the txn open
 * for completions, committing) lies between N's commit and N's answers. With it the
 * writer thread hands N, committed, to the flusher (idem__gc_flusher_hand) and begins
 * N+1 at once; the flusher calls mdb_env_sync(env, 1) (idem__gc_sync_file) and wakes N's
 * callers. Reasoning, point by point:
 *
 * Two fdatasyncs on one inode. They are never in flight together: the flusher's sync and
 * every commit of the file run under gc->sync_mu (group_commit_sync.c), as before. A
 * second fdatasync racing a failing one may return 0 for pages whose writeback failed
 * under the first (Linux reports a writeback error once per open file; "fsyncgate"), so
 * the outcome of one must be recorded (unsure_txnid) before the next begins; and Linux
 * serialises them on the inode anyway (ext4: one jbd2 commit, and writeback of a page
 * already under I/O waits for it). What overlaps is the flusher's sync of N and the
 * writer's work on N+1 before its commit (begin, apply, hold open); N+1's commit waits
 * for sync_mu while the flusher syncs.
 *
 * No caller woken before its batch's meta page is durable. The flusher wakes N's callers
 * only after idem__gc_sync_file(gc, txnid of N) returned 0: either its own fdatasync
 * began after N's meta page was written (N was handed over after its commit returned)
 * and no failed sync came since that page was written (else EIO), or durable_txnid was
 * already past N's txnid. A later commit vouches too, as without the flusher: the
 * batch's commit raises durable_txnid to the txnid before its own (its fdatasync
 * flushed that meta page, unless a failed sync came between: unsure_txnid), so a
 * flusher that waited for sync_mu behind N+1's commit finds N durable and syncs nothing:
 * N's callers are woken by whichever of the two came first. Only the flusher wakes a
 * handed batch, one pipe at a time in the order handed: batches end in ticket order.
 *
 * A failed sync. On the flusher: pipe_sync re-writes (idem__gc_write_alone of
 * gc->rewrite: a new meta page, synced) on the flusher thread; it waits for LMDB's
 * writer lock behind the writer's open batch, which the writer commits within HOLD_US.
 * The callers get IDEM_OK only when the re-write worked, else its error. On the writer
 * (a batch's commit fails): before its redo, the writer drains the flusher
 * (idem__gc_flusher_drain), so the redo's answers never overtake the batches handed
 * before; the flusher never waits for the writer thread, only for LMDB's writer lock,
 * which the writer does not hold then.
 *
 * durable_txnid and its readers. It only grows (idem__gc_durable_raise), raised by the
 * flusher's sync, by a batch's commit (txnid - 1), and as before. idem__gc_durable_wait
 * waits while pending_ticket is set: the flusher clears it (idem__gc_batch_ended) when
 * it releases the last batch handed; idem__gc_sync_pending syncs itself, under sync_mu.
 *
 * Stopping. idem__gc_fini joins the writer thread first (it has handed every batch it
 * committed), then the flusher, which releases what it holds before it returns.
 *
 * Bounds. The flusher holds what the writer committed during one of its turns: none
 * while it syncs (a commit waits for sync_mu), some while it wakes callers, each batch
 * the ops of callers that wait (as many as the server's contexts at most), and its next
 * turn takes them all with one sync. Each turn is one fdatasync (or none), or, after a
 * failed one, one re-write, which waits for LMDB's writer lock at most until the
 * writer's open batch commits (HOLD_US). */
#include <stdlib.h>
#include <string.h>

#include "group_commit_op.h"

/* Syncs and releases one pipe (group_commit_pipe.c); the flusher thread. */
static void *flusher_main(void *arg)
{
    idem_group_commit *gc = arg;
    idem_gc_flusher *fl = gc->flusher;
    pthread_setname_np(pthread_self(), "idem:lmdb-flush"); /* for per-thread counts */
    pthread_mutex_lock(&fl->mu);
    for (;;) {
        while (fl->pipe.ticket == 0 && !fl->stopping) {
            pthread_cond_wait(&fl->cv, &fl->mu);
        }
        if (fl->pipe.ticket == 0) {
            break;
        }
        idem_gc_pipe pipe = fl->pipe;
        memset(&fl->pipe, 0, sizeof(fl->pipe));
        fl->busy = true;
        pthread_mutex_unlock(&fl->mu);
        idem__gc_pipe_flush(gc, &pipe);
        pthread_mutex_lock(&fl->mu);
        fl->busy = false;
        pthread_cond_broadcast(&fl->idle_cv);
    }
    pthread_mutex_unlock(&fl->mu);
    return NULL;
}

idem_code idem__gc_flusher_start(idem_group_commit *gc)
{
    idem_gc_flusher *fl = calloc(1, sizeof(*fl));
    if (fl == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory for the LMDB flusher");
    }
    pthread_mutex_init(&fl->mu, NULL);
    pthread_cond_init(&fl->cv, NULL);
    pthread_cond_init(&fl->idle_cv, NULL);
    gc->flusher = fl;
    if (pthread_create(&fl->thread, NULL, flusher_main, gc) != 0) {
        gc->flusher = NULL;
        pthread_cond_destroy(&fl->idle_cv);
        pthread_cond_destroy(&fl->cv);
        pthread_mutex_destroy(&fl->mu);
        free(fl);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start the LMDB flusher thread");
    }
    return IDEM_OK;
}

void idem__gc_flusher_stop(idem_group_commit *gc)
{
    idem_gc_flusher *fl = gc->flusher;
    if (fl == NULL) {
        return;
    }
    pthread_mutex_lock(&fl->mu);
    fl->stopping = true;
    pthread_cond_signal(&fl->cv);
    pthread_mutex_unlock(&fl->mu);
    pthread_join(fl->thread, NULL);
    gc->flusher = NULL;
    pthread_cond_destroy(&fl->idle_cv);
    pthread_cond_destroy(&fl->cv);
    pthread_mutex_destroy(&fl->mu);
    free(fl);
}

void idem__gc_flusher_hand(idem_group_commit *gc, idem_gc_batch *b, uint64_t ticket, uint64_t txnid,
                           uint64_t commit_us)
{
    idem_gc_flusher *fl = gc->flusher;
    pthread_mutex_lock(&fl->mu);
    bool idle = fl->pipe.ticket == 0;
    idem__gc_pipe_take(&fl->pipe, b, ticket, txnid, commit_us);
    pthread_mutex_unlock(&fl->mu);
    if (idle) { /* else it has been signalled and not taken the pipe yet */
        pthread_cond_signal(&fl->cv);
    }
}

void idem__gc_flusher_drain(idem_group_commit *gc)
{
    idem_gc_flusher *fl = gc->flusher;
    if (fl == NULL) {
        return;
    }
    pthread_mutex_lock(&fl->mu);
    while (fl->pipe.ticket != 0 || fl->busy) {
        pthread_cond_wait(&fl->idle_cv, &fl->mu);
    }
    pthread_mutex_unlock(&fl->mu);
}
