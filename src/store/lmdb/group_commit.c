/* Group commit of LMDB writes by one writer thread per store; see group_commit.h. */
#include <errno.h>
#include <semaphore.h>
#include <stdio.h>
#include <string.h>

#include "group_commit.h"

struct idem_write_op {
    idem_write_fn fn;
    void *ctx;
    idem_code code;
    /* Posted by the writer thread once code and err are final; only this op's writer
     * waits on it. A semaphore rather than a condition variable: no mutex to take on
     * waking (a writer is woken once and runs), and its waiter may destroy it as soon as
     * sem_wait returns: no thread is blocked on it then (POSIX: safe to destroy), and
     * glibc's sem_post touches it no more than a futex wake by address, which at worst
     * is a spurious wake-up elsewhere (futex users retry on those). sem_post and
     * sem_wait order the memory of code and err (POSIX 4.12). */
    sem_t done;
    char err[256]; /* the writer thread's idem_errmsg() for this op, handed over */
    idem_write_op *next;
};

idem_code idem__lmdb_code(int rc, const char *what)
{
    if (rc == MDB_MAP_FULL || rc == MDB_TXN_FULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "store full (%s): %s", what, mdb_strerror(rc));
    }
    return idem__err(IDEM_INTERNAL, "%s: %s", what, mdb_strerror(rc));
}

/* A storage error (a code idem__lmdb_code returns) may leave the txn half-applied. */
static bool poisons_txn(idem_code code)
{
    return code == IDEM_RESOURCE_EXHAUSTED || code == IDEM_INTERNAL;
}

/* One operation in a txn of its own. */
static idem_code write_alone(MDB_env *env, idem_write_fn fn, void *ctx)
{
    MDB_txn *txn;
    int rc = mdb_txn_begin(env, NULL, 0, &txn);
    if (rc != 0) {
        return idem__lmdb_code(rc, "write begin");
    }
    idem_code code = fn(txn, ctx);
    if (code != IDEM_OK) {
        mdb_txn_abort(txn);
        return code;
    }
    rc = mdb_txn_commit(txn);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "commit");
}

static void op_finish(idem_write_op *op, idem_code code)
{
    op->code = code;
    snprintf(op->err, sizeof(op->err), "%s", code == IDEM_OK ? "" : idem_errmsg());
}

/* Applies a batch in one txn; on a storage error, falls back to one txn per op. */
static void run_batch(idem_group_commit *gc, idem_write_op *batch)
{
    MDB_txn *txn = NULL;
    int rc = mdb_txn_begin(gc->env, NULL, 0, &txn);
    bool poisoned = rc != 0;
    for (idem_write_op *op = batch; op != NULL && !poisoned; op = op->next) {
        op_finish(op, op->fn(txn, op->ctx));
        poisoned = poisons_txn(op->code);
    }
    if (!poisoned) {
        if ((rc = mdb_txn_commit(txn)) == 0) {
            return;
        }
        poisoned = true; /* commit freed the txn */
    } else if (txn != NULL && rc == 0) {
        mdb_txn_abort(txn);
    }
    for (idem_write_op *op = batch; op != NULL; op = op->next) {
        op_finish(op, write_alone(gc->env, op->fn, op->ctx));
    }
}

/* Takes up to max_batch queued ops off the queue (gc->mu held, the queue not empty). */
static idem_write_op *batch_take(idem_group_commit *gc)
{
    idem_write_op *batch = gc->head, *last = batch;
    size_t n = 1;
    for (; n < gc->max_batch && last->next != NULL; n++) {
        last = last->next;
    }
    gc->commits++;
    gc->writes += n;
    gc->head = last->next;
    if (gc->head == NULL) {
        gc->tail = NULL;
    }
    last->next = NULL;
    return batch;
}

/* The writer thread: one batch per turn while ops are queued; asleep otherwise. It stops
 * only once stopping is set and the queue is empty, so nothing queued is left behind. */
static void *writer_main(void *arg)
{
    idem_group_commit *gc = arg;
    pthread_mutex_lock(&gc->mu);
    for (;;) {
        /* A caller committing inline (idem__gc_write) wakes it when it is done. */
        while ((gc->head == NULL || gc->inline_busy) && !(gc->stopping && gc->head == NULL)) {
            gc->writer_asleep = true;
            pthread_cond_wait(&gc->cv, &gc->mu);
        }
        gc->writer_asleep = false;
        if (gc->head == NULL) { /* stopping, nothing left */
            break;
        }
        idem_write_op *batch = batch_take(gc);
        gc->writer_busy = true;
        pthread_mutex_unlock(&gc->mu);
        run_batch(gc, batch);
        for (idem_write_op *o = batch, *next; o != NULL; o = next) {
            next = o->next;     /* o may be gone once posted */
            sem_post(&o->done); /* its writer, and nobody else: cannot fail (0 → 1) */
        }
        pthread_mutex_lock(&gc->mu);
        gc->writer_busy = false;
    }
    pthread_mutex_unlock(&gc->mu);
    return NULL;
}

idem_code idem__gc_init(idem_group_commit *gc, MDB_env *env, bool enabled, size_t max_batch)
{
    memset(gc, 0, sizeof(*gc));
    gc->env = env;
    gc->enabled = enabled;
    gc->max_batch = max_batch ? max_batch : 1;
    pthread_mutex_init(&gc->mu, NULL);
    pthread_cond_init(&gc->cv, NULL);
    if (enabled) {
        if (pthread_create(&gc->writer, NULL, writer_main, gc) != 0) {
            pthread_cond_destroy(&gc->cv);
            pthread_mutex_destroy(&gc->mu);
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start the LMDB writer thread");
        }
        gc->started = true;
    }
    return IDEM_OK;
}

void idem__gc_fini(idem_group_commit *gc)
{
    if (gc->started) {
        pthread_mutex_lock(&gc->mu);
        gc->stopping = true;
        pthread_cond_broadcast(&gc->cv);
        while (gc->inline_busy) { /* a write its caller commits: the env must outlive it */
            pthread_cond_wait(&gc->cv, &gc->mu);
        }
        pthread_mutex_unlock(&gc->mu);
        pthread_join(gc->writer, NULL);
        gc->started = false;
    }
    pthread_cond_destroy(&gc->cv);
    pthread_mutex_destroy(&gc->mu);
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
    idem_code code = write_alone(gc->env, fn, ctx);
    pthread_mutex_lock(&gc->mu);
    gc->inline_busy = false;
    bool wake = gc->head != NULL && gc->writer_asleep;
    bool closing = gc->stopping; /* idem__gc_fini waits for this write */
    gc->writer_asleep = gc->writer_asleep && !wake;
    gc->wakeups += wake;
    pthread_mutex_unlock(&gc->mu);
    if (closing) {
        pthread_cond_broadcast(&gc->cv);
    } else if (wake) {
        pthread_cond_signal(&gc->cv);
    }
    return code;
}

idem_code idem__gc_write(idem_group_commit *gc, idem_write_fn fn, void *ctx)
{
    if (!gc->enabled) {
        pthread_mutex_lock(&gc->mu);
        gc->commits++;
        gc->writes++;
        pthread_mutex_unlock(&gc->mu);
        return write_alone(gc->env, fn, ctx);
    }
    idem_write_op op = {.fn = fn, .ctx = ctx};
    if (sem_init(&op.done, 0, 0) != 0) {
        return idem__err(IDEM_INTERNAL, "sem_init: %s", strerror(errno));
    }
    pthread_mutex_lock(&gc->mu);
    if (gc->head == NULL && !gc->writer_busy && !gc->inline_busy) {
        sem_destroy(&op.done);
        return write_inline(gc, fn, ctx); /* releases gc->mu */
    }
    if (gc->tail != NULL) {
        gc->tail->next = &op;
    } else {
        gc->head = &op;
    }
    gc->tail = &op;
    /* The first enqueue since the writer thread fell asleep wakes it, once. It is woken
     * after gc->mu is released, so that it does not wake only to wait for gc->mu: it is
     * in its wait (writer_asleep is set and cleared under gc->mu), so it cannot miss it. */
    bool wake = gc->writer_asleep && !gc->inline_busy;
    gc->writer_asleep = gc->writer_asleep && !wake;
    gc->wakeups += wake;
    pthread_mutex_unlock(&gc->mu);
    if (wake) {
        pthread_cond_signal(&gc->cv);
    }
    uint64_t early = 0;
    while (sem_wait(&op.done) != 0) { /* only EINTR (a signal handler ran): wait again */
        early++;
    }
    sem_destroy(&op.done);
    if (early > 0) {
        pthread_mutex_lock(&gc->mu);
        gc->early_wakeups += early;
        pthread_mutex_unlock(&gc->mu);
    }
    if (op.code != IDEM_OK) {
        idem__err(op.code, "%s", op.err);
    }
    return op.code;
}
