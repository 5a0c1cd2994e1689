/* Group commit, the callers' side: the queue, the writer thread's life cycle, and the
 * entry points that queue an op and wait for it (see group_commit.h for the contract,
 * group_commit_op.h for how the work is split between the three files).
 *
 * Invariants of the queue: gc->head..tail holds the ops not yet taken by a batch, in
 * the order they were queued, under gc->mu; an op is queued once and taken once. A
 * caller wakes the writer thread at most once per enqueue, after releasing gc->mu, and
 * only when it sleeps (or holds a batch open that can use the op). A write that finds
 * nothing queued and nothing committing commits on its caller's thread (write_inline),
 * and the writer thread then waits until it is done: LMDB has one writer at a time.
 * An inline write syncs its own meta page (idem__gc_commit_durable); it never starts
 * while the writer thread holds committed batches waiting for a sync (writer_busy stays
 * set until group_commit_pipe.c, which says why one fdatasync per commit is durable,
 * has woken them). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "group_commit_op.h"

/* How long a batch stays open for the completions of its shared claims: longer, and
 * another process waiting for LMDB's writer lock would wait longer too. */
#define HOLD_US 2000
/* How long a batch takes new shared claims: the last commit's time, within these. A
 * claim that arrives meanwhile would otherwise wait for the next txn anyway. */
#define ACCEPT_MIN_US 50
#define ACCEPT_MAX_US 1000
idem_code idem__gc_init(idem_group_commit *gc, MDB_env *env, bool enabled, size_t max_batch)
{
    pthread_condattr_t ca;
    memset(gc, 0, sizeof(*gc));
    gc->env = env;
    gc->enabled = enabled;
    gc->max_batch = max_batch ? max_batch : 1;
    gc->hold_us = HOLD_US;
    gc->accept_min_us = ACCEPT_MIN_US;
    gc->accept_max_us = ACCEPT_MAX_US;
    pthread_mutex_init(&gc->mu, NULL);
    pthread_mutex_init(&gc->sync_mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* hold_open's timed wait */
    pthread_cond_init(&gc->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&gc->done_cv, NULL);
    pthread_cond_init(&gc->inline_cv, NULL);
    unsigned flags = 0;
    MDB_envinfo info;
    gc->pipelined = enabled && mdb_env_get_flags(env, &flags) == 0 && (flags & MDB_NOMETASYNC) &&
                    !(flags & MDB_NOSYNC);
    /* The caller synced the env after opening it (env.c). */
    atomic_init(&gc->durable_txnid, mdb_env_info(env, &info) == 0 ? info.me_last_txnid : 0);
#ifdef IDEM_TEST_HOOKS /* never in a release: a library built for that test only */
    const char *bug = getenv("IDEMRPC_TEST_ANSWER_AT_COMMIT");
    gc->answer_at_commit = bug != NULL && strcmp(bug, "1") == 0;
#endif
    if (enabled) {
        if (pthread_create(&gc->writer, NULL, idem__gc_writer_main, gc) != 0) {
            pthread_cond_destroy(&gc->inline_cv);
            pthread_cond_destroy(&gc->done_cv);
            pthread_cond_destroy(&gc->cv);
            pthread_mutex_destroy(&gc->sync_mu);
            pthread_mutex_destroy(&gc->mu);
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start the LMDB writer thread");
        }
        gc->started = true;
    }
    return IDEM_OK;
}

void idem__gc_log_to(idem_group_commit *gc, idem_wal *wal)
{
    gc->wal = wal;
    if (wal != NULL) { /* its epoch's commit, synced: the first entry chains from it */
        idem__gc_durable_raise(gc, idem__gc_last_txnid(gc->env));
    }
}

void idem__gc_fini(idem_group_commit *gc)
{
    if (gc->started) {
        pthread_mutex_lock(&gc->mu);
        gc->stopping = true;
        pthread_cond_broadcast(&gc->cv);
        while (gc->inline_busy) { /* a write its caller commits: the env must outlive it */
            pthread_cond_wait(&gc->inline_cv, &gc->mu);
        }
        pthread_mutex_unlock(&gc->mu);
        pthread_join(gc->writer, NULL);
        gc->started = false;
    }
    pthread_cond_destroy(&gc->inline_cv);
    pthread_cond_destroy(&gc->done_cv);
    pthread_cond_destroy(&gc->cv);
    pthread_mutex_destroy(&gc->sync_mu);
    pthread_mutex_destroy(&gc->mu);
}

/* Wakes the writer thread if it sleeps, or (holding) if it holds a batch open: once,
 * after gc->mu is released (so that it does not wake only to wait for gc->mu); it is in
 * its wait then (both flags are set and cleared under gc->mu), so it cannot miss it.
 * Called with gc->mu held; releases it. */
static void wake_writer(idem_group_commit *gc, bool holding)
{
    bool wake = (gc->writer_asleep && !gc->inline_busy) || (holding && gc->writer_holding);
    gc->writer_asleep = gc->writer_asleep && !wake;
    gc->writer_holding = gc->writer_holding && !wake;
    gc->wakeups += wake;
    pthread_mutex_unlock(&gc->mu);
    if (wake) {
        pthread_cond_signal(&gc->cv);
    }
}

static void enqueue(idem_group_commit *gc, idem_write_op *op)
{
    op->next = NULL;
    if (gc->tail != NULL) {
        gc->tail->next = op;
    } else {
        gc->head = op;
    }
    gc->tail = op;
}

/* Nothing queued and nothing committing: the caller commits its write on its own thread,
 * which saves two hand-offs (to the writer thread and back) when writes do not overlap.
 * Writes that arrive meanwhile queue for the writer thread, woken at the end if asleep.
 * Called with gc->mu held; releases it. */
static idem_code write_inline(idem_group_commit *gc, idem_write_fn fn, void *ctx)
{
    gc->inline_busy = true;
    gc->commits++;
    gc->writes++;
    pthread_mutex_unlock(&gc->mu);
    /* Its own txn: its own exact result, and its message already on this thread. */
    idem_code code = idem__gc_write_alone(gc, fn, ctx);
    pthread_mutex_lock(&gc->mu);
    gc->inline_busy = false;
    if (gc->stopping) { /* idem__gc_fini waits for this write */
        pthread_cond_broadcast(&gc->inline_cv);
    }
    if (gc->head != NULL) {
        wake_writer(gc, true); /* releases gc->mu */
    } else {
        pthread_mutex_unlock(&gc->mu);
    }
    return code;
}

/* Waits for op's result, handing over its message. */
static idem_code op_wait(idem_group_commit *gc, idem_write_op *op)
{
    uint64_t early = 0;
    while (sem_wait(&op->done) != 0) { /* only EINTR (a signal handler ran): wait again */
        early++;
    }
    if (early > 0) {
        pthread_mutex_lock(&gc->mu);
        gc->early_wakeups += early;
        pthread_mutex_unlock(&gc->mu);
    }
    if (op->code != IDEM_OK) {
        idem__err(op->code, "%s", op->err);
    }
    return op->code;
}

static idem_code write_queued(idem_group_commit *gc, idem_write_fn fn, void *ctx, enum op_kind kind,
                              uint64_t ticket, size_t value_len)
{
    if (!gc->enabled) {
        pthread_mutex_lock(&gc->mu);
        gc->commits++;
        gc->writes++;
        pthread_mutex_unlock(&gc->mu);
        return idem__gc_write_alone(gc, fn, ctx);
    }
    idem_write_op op = {
        .fn = fn, .ctx = ctx, .kind = kind, .ticket = ticket, .value_len = value_len};
    if (sem_init(&op.done, 0, 0) != 0) {
        return idem__err(IDEM_INTERNAL, "sem_init: %s", strerror(errno));
    }
    pthread_mutex_lock(&gc->mu);
    /* With the write-ahead log every write goes to the writer thread: logged, it costs
     * one flush beside its commit, where an inline write syncs twice (wal.h). */
    if (gc->head == NULL && !gc->writer_busy && !gc->inline_busy && gc->wal == NULL) {
        sem_destroy(&op.done);
        return write_inline(gc, fn, ctx); /* releases gc->mu */
    }
    enqueue(gc, &op);
    wake_writer(gc, true); /* releases gc->mu */
    idem_code code = op_wait(gc, &op);
    sem_destroy(&op.done);
    return code;
}

idem_code idem__gc_write(idem_group_commit *gc, idem_write_fn fn, void *ctx)
{
    return write_queued(gc, fn, ctx, OP_PLAIN, 0, 0);
}

idem_code idem__gc_write_end(idem_group_commit *gc, idem_write_fn fn, void *ctx, uint64_t ticket,
                             size_t value_len)
{
    return write_queued(gc, fn, ctx, ticket != 0 ? OP_END : OP_PLAIN, ticket, value_len);
}

/* A zeroed op in op_mem, else on the heap; NULL when out of memory. */
static idem_write_op *op_new(void *op_mem)
{
    if (op_mem == NULL) {
        return calloc(1, sizeof(idem_write_op));
    }
    idem_write_op *op = memset(op_mem, 0, sizeof(*op));
    op->in_ctx = true;
    return op;
}

/* A shared claim's op (in op_mem, else on the heap): two references, its caller's and
 * the writer's. */
static idem_write_op *held_op(idem_write_fn fn, idem_write_fn redo, void *ctx,
                              void (*unref)(void *ctx), void *op_mem)
{
    idem_write_op *op = op_new(op_mem);
    if (op == NULL || sem_init(&op->done, 0, 0) != 0) {
        if (op != NULL && !op->in_ctx) {
            free(op);
        }
        idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory for a store write");
        return NULL;
    }
    op->fn = fn;
    op->redo = redo;
    op->ctx = ctx;
    op->unref = unref;
    op->kind = OP_HELD;
    atomic_init(&op->refs, 2);
    return op;
}

/* Queues a shared claim and wakes the writer thread if it can use it now. */
static void held_enqueue(idem_group_commit *gc, idem_write_op *op)
{
    pthread_mutex_lock(&gc->mu);
    enqueue(gc, op);
    /* A batch past taking claims has no use for it until it has committed. */
    wake_writer(gc, idem__mono_us() < gc->accept_until); /* releases gc->mu */
}

idem_code idem__gc_write_held(idem_group_commit *gc, idem_write_fn fn, idem_write_fn redo,
                              void *ctx, void (*unref)(void *ctx), void *op_mem, uint64_t *ticket)
{
    *ticket = 0;
    if (!gc->started) {
        idem_code code = write_queued(gc, fn, ctx, OP_PLAIN, 0, 0);
        unref(ctx); /* the writer's reference: there is none */
        return code;
    }
    idem_write_op *op = held_op(fn, redo, ctx, unref, op_mem);
    if (op == NULL) {
        unref(ctx);
        return IDEM_RESOURCE_EXHAUSTED;
    }
    held_enqueue(gc, op);
    idem_code code = op_wait(gc, op);
    *ticket = op->ticket;
    idem__gc_op_unref(op);
    return code;
}

idem_code idem__gc_write_held_async(idem_group_commit *gc, idem_write_fn fn, idem_write_fn redo,
                                    void *ctx, void (*unref)(void *ctx), void *op_mem,
                                    idem_gc_applied_fn applied)
{
    if (!gc->started) {
        return idem__err(IDEM_UNAVAILABLE, "no writer thread here: write and wait");
    }
    idem_write_op *op = held_op(fn, redo, ctx, unref, op_mem);
    if (op == NULL) {
        return IDEM_RESOURCE_EXHAUSTED;
    }
    op->on_applied = applied;
    held_enqueue(gc, op);
    return IDEM_OK;
}

idem_code idem__gc_write_end_async(idem_group_commit *gc, idem_write_fn fn, void *ctx,
                                   uint64_t ticket, size_t value_len,
                                   void (*done)(void *ctx, idem_code code, const char *err),
                                   void *op_mem)
{
    idem_write_op *op;
    if (!gc->started || ticket == 0 || (op = op_new(op_mem)) == NULL) {
        return idem__err(IDEM_UNAVAILABLE, "no asynchronous write here: write and wait");
    }
    op->fn = fn;
    op->ctx = ctx;
    op->kind = OP_END;
    op->ticket = ticket;
    op->value_len = value_len;
    op->on_done = done;
    pthread_mutex_lock(&gc->mu);
    enqueue(gc, op);
    wake_writer(gc, true); /* releases gc->mu */
    return IDEM_OK;
}

void idem__gc_drop(idem_group_commit *gc, uint64_t ticket)
{
    if (ticket == 0) {
        return;
    }
    pthread_mutex_lock(&gc->mu);
    if (ticket == gc->open_ticket && gc->awaiting > 0 && --gc->awaiting == 0) {
        wake_writer(gc, true); /* releases gc->mu */
        return;
    }
    pthread_mutex_unlock(&gc->mu);
}

void idem__gc_wait(idem_group_commit *gc, uint64_t ticket)
{
    pthread_mutex_lock(&gc->mu);
    while (ticket != 0 && gc->done_ticket < ticket) {
        if (ticket == gc->open_ticket && !gc->flush) {
            gc->flush = true;
            pthread_cond_signal(&gc->cv);
        }
        gc->done_waiters++;
        pthread_cond_wait(&gc->done_cv, &gc->mu);
        gc->done_waiters--;
    }
    pthread_mutex_unlock(&gc->mu);
}

void idem__gc_lock_wanted(idem_group_commit *gc, bool wanting)
{
    pthread_mutex_lock(&gc->mu);
    gc->lock_wanted += wanting ? 1 : (size_t)-1;
    if (wanting) {
        wake_writer(gc, true); /* releases gc->mu */
        return;
    }
    pthread_mutex_unlock(&gc->mu);
    /* It holds LMDB's writer lock now, and may answer from what it reads: a batch's
     * meta page still waiting for a sync goes to disk first. */
    idem__gc_sync_pending(gc);
}
