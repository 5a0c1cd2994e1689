/* Group commit of LMDB writes by one writer thread per store; see group_commit.h. */
#include <errno.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "group_commit.h"

/* How long a batch takes new shared claims: the last commit's time, within these. A
 * claim that arrives meanwhile would otherwise wait for the next txn anyway. */
#define ACCEPT_MIN_US 50
#define ACCEPT_MAX_US 1000
/* How long a batch stays open for the completions of its shared claims: longer, and
 * another process waiting for LMDB's writer lock would wait longer too. */
#define HOLD_US 2000

enum op_kind {
    OP_PLAIN, /* idem__gc_write: a batch with one commits as soon as it can */
    OP_HELD,  /* idem__gc_write_held: its caller is woken once it is applied */
    OP_END,   /* idem__gc_write_end: may end a shared claim of its batch */
};

struct idem_write_op {
    idem_write_fn fn;
    void *ctx;
    enum op_kind kind;
    /* OP_END: the claim's ticket. OP_HELD: its batch's, once applied there with IDEM_OK
     * (0: not shared; set before its caller is woken). */
    uint64_t ticket;
    /* OP_HELD: heap memory with two references, its caller's and the writer thread's
     * (until its batch ends: a failed batch re-applies it with redo), and ctx's own. */
    idem_write_fn redo;
    void (*unref)(void *ctx);
    atomic_int refs;
    /* Asynchronous (idem__gc_write_end_async): heap memory, handed to done, freed then. */
    void (*on_done)(void *ctx, idem_code code, const char *err);
    bool posted; /* its caller was woken (an OP_HELD: maybe before the commit) */
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
    idem_write_op *held_next; /* OP_HELD ops of a batch, to drop the writer's reference */
};

/* The ops of one batch, in the order they were applied. */
typedef struct batch {
    idem_write_op *head, *tail, *held;
    size_t n;
    bool plain; /* an OP_PLAIN in it: commit without waiting for shared completions */
} batch;

idem_code idem__lmdb_code(int rc, const char *what)
{
    if (rc == MDB_MAP_FULL || rc == MDB_TXN_FULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "store full (%s): %s", what, mdb_strerror(rc));
    }
    return idem__err(IDEM_INTERNAL, "%s: %s", what, mdb_strerror(rc));
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

/* Wakes op's caller, or hands an asynchronous op's result over; op may be gone once
 * this returns (unless it is an OP_HELD). */
static void op_post(idem_write_op *op)
{
    op->posted = true;
    if (op->on_done != NULL) {
        op->on_done(op->ctx, op->code, op->err);
        free(op);
        return;
    }
    sem_post(&op->done); /* its writer, and nobody else: cannot fail (0 → 1) */
}

static void op_unref(idem_write_op *op)
{
    if (atomic_fetch_sub(&op->refs, 1) == 1) {
        sem_destroy(&op->done);
        op->unref(op->ctx);
        free(op);
    }
}

static void batch_add(batch *b, idem_write_op *op)
{
    op->next = NULL;
    if (b->tail != NULL) {
        b->tail->next = op;
    } else {
        b->head = op;
    }
    b->tail = op;
    b->n++;
    if (op->kind == OP_HELD) {
        op->held_next = b->held;
        b->held = op;
    }
}

/* Takes queued ops off the queue (gc->mu held): up to room of any kind while the batch
 * takes new shared claims (accept), else only the ends of shared claims (any number:
 * there are no more of them than claims). */
static idem_write_op *queue_take(idem_group_commit *gc, bool accept, size_t room)
{
    idem_write_op *got = NULL, **gt = &got, **pp = &gc->head;
    gc->tail = NULL;
    while (*pp != NULL) {
        idem_write_op *op = *pp;
        if (accept ? room == 0 : op->kind != OP_END) {
            gc->tail = op;
            pp = &op->next;
            continue;
        }
        room -= accept;
        *pp = op->next;
        op->next = NULL;
        *gt = op;
        gt = &op->next;
    }
    return got;
}

static bool plain_queued(const idem_group_commit *gc)
{
    for (const idem_write_op *op = gc->head; op != NULL; op = op->next) {
        if (op->kind == OP_PLAIN) {
            return true;
        }
    }
    return false;
}

/* op->fn in a child txn of txn: a storage error (a full map) then undoes op's writes
 * alone, where in txn itself it would leave txn unusable (LMDB refuses every further
 * operation of a txn whose write failed) and take every other write of the batch with
 * it, shared claims whose handlers already run included. *poisoned: LMDB could not
 * begin or merge the child. */
static idem_code apply_nested(MDB_txn *txn, idem_write_op *op, bool *poisoned)
{
    MDB_txn *child;
    int rc = mdb_txn_begin(mdb_txn_env(txn), txn, 0, &child);
    if (rc != 0) {
        *poisoned = true;
        return idem__lmdb_code(rc, "write begin");
    }
    idem_code code = op->fn(child, op->ctx);
    if (code != IDEM_OK) {
        mdb_txn_abort(child);
        return code;
    }
    if ((rc = mdb_txn_commit(child)) != 0) {
        *poisoned = true;
        return idem__lmdb_code(rc, "commit");
    }
    return IDEM_OK;
}

/* Applies ops in txn (the batch of ticket) and adds them to b; false once the txn is
 * poisoned (the ops after it are added unapplied). A shared claim's caller is woken at
 * once; the others when the batch ends. */
static bool apply(idem_group_commit *gc, MDB_txn *txn, uint64_t ticket, idem_write_op *ops, batch *b)
{
    bool poisoned = false;
    size_t ended = 0;
    for (idem_write_op *op = ops, *next; op != NULL; op = next) {
        next = op->next;
        batch_add(b, op);
        if (poisoned) {
            continue;
        }
        op_finish(op, apply_nested(txn, op, &poisoned));
        if (poisoned) {
            continue;
        }
        if (op->kind == OP_HELD) {
            if (op->code == IDEM_OK) {
                pthread_mutex_lock(&gc->mu);
                gc->awaiting++; /* before its caller can drop it */
                pthread_mutex_unlock(&gc->mu);
                op->ticket = ticket;
            }
            op_post(op);
        } else if (op->kind == OP_END && op->ticket == ticket) {
            ended++;
        } else if (op->kind == OP_PLAIN) {
            b->plain = true;
        }
    }
    pthread_mutex_lock(&gc->mu);
    gc->awaiting -= ended < gc->awaiting ? ended : gc->awaiting;
    gc->shared += ended;
    pthread_mutex_unlock(&gc->mu);
    return !poisoned;
}

/* A failed batch, again one op per txn in order: a shared claim its caller holds is
 * re-applied with its owner (redo), the other ops run as if for the first time. */
static void run_alone(idem_group_commit *gc, batch *b)
{
    for (idem_write_op *op = b->head, *next; op != NULL; op = next) {
        next = op->next;
        if (op->kind == OP_HELD && op->posted) {
            if (op->code == IDEM_OK) {
                write_alone(gc->env, op->redo, op->ctx); /* a failure: its completion says */
            }
            continue;
        }
        op->ticket = op->kind == OP_HELD ? 0 : op->ticket;
        op_finish(op, write_alone(gc->env, op->fn, op->ctx));
        op_post(op);
    }
}

/* Keeps the batch open until it should commit (group_commit.h), applying what comes.
 * Called and returns with gc->mu held; false when the txn is poisoned. */
static bool hold_open(idem_group_commit *gc, MDB_txn *txn, uint64_t ticket, uint64_t began,
                      batch *b)
{
    uint64_t accept_us = gc->last_commit_us < ACCEPT_MIN_US   ? ACCEPT_MIN_US
                         : gc->last_commit_us > ACCEPT_MAX_US ? ACCEPT_MAX_US
                                                              : gc->last_commit_us;
    gc->accept_until = began + accept_us;
    for (;;) {
        uint64_t now = idem__mono_us();
        /* The first take always: what woke the writer thread is in it. */
        bool accept = (b->n == 0 || now < gc->accept_until) && b->n < gc->max_batch;
        idem_write_op *ops = queue_take(gc, accept, gc->max_batch - b->n);
        if (ops != NULL) {
            pthread_mutex_unlock(&gc->mu);
            bool ok = apply(gc, txn, ticket, ops, b);
            pthread_mutex_lock(&gc->mu);
            if (!ok) {
                return false;
            }
            continue;
        }
        if (b->plain || gc->awaiting == 0 || gc->flush || gc->lock_wanted > 0 || gc->stopping ||
            now >= began + gc->hold_us || plain_queued(gc)) {
            return true;
        }
        uint64_t until = accept ? gc->accept_until : began + gc->hold_us;
        struct timespec ts = {(time_t)(until / 1000000u), (long)(until % 1000000u) * 1000};
        gc->writer_holding = true;
        pthread_cond_timedwait(&gc->cv, &gc->mu, &ts);
        gc->writer_holding = false;
    }
}

/* One batch: begin, apply and hold (hold_open), commit, wake; on a storage error or a
 * failed commit, run_alone. */
static void run_batch(idem_group_commit *gc)
{
    batch b = {0};
    MDB_txn *txn = NULL;
    int rc = mdb_txn_begin(gc->env, NULL, 0, &txn);
    uint64_t began = idem__mono_us();
    pthread_mutex_lock(&gc->mu);
    uint64_t ticket = ++gc->last_ticket;
    gc->awaiting = 0;
    gc->flush = false;
    bool ok = rc == 0;
    if (ok) {
        gc->open_ticket = ticket;
        ok = hold_open(gc, txn, ticket, began, &b);
    } else {
        for (idem_write_op *op = queue_take(gc, true, gc->max_batch), *next; op != NULL;
             op = next) {
            next = op->next;
            batch_add(&b, op); /* run alone below, each txn begun again */
        }
    }
    gc->open_ticket = 0;
    gc->commits++;
    gc->writes += b.n;
    pthread_mutex_unlock(&gc->mu);

    uint64_t t0 = idem__mono_us();
    if (ok && (rc = mdb_txn_commit(txn)) != 0) {
        ok = false; /* commit freed the txn */
        txn = NULL;
    } else if (!ok && txn != NULL) {
        mdb_txn_abort(txn);
    }
    uint64_t commit_us = idem__mono_us() - t0;
    if (ok) {
        for (idem_write_op *op = b.head, *next; op != NULL; op = next) {
            next = op->next; /* op may be gone once posted */
            if (!op->posted) {
                op_post(op);
            }
        }
    } else {
        run_alone(gc, &b);
    }
    pthread_mutex_lock(&gc->mu);
    gc->last_commit_us = ok ? commit_us : gc->last_commit_us;
    gc->done_ticket = ticket;
    if (gc->done_waiters > 0) {
        pthread_cond_broadcast(&gc->done_cv);
    }
    pthread_mutex_unlock(&gc->mu);
    for (idem_write_op *op = b.held, *next; op != NULL; op = next) {
        next = op->held_next;
        op_unref(op);
    }
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
        gc->writer_busy = true;
        pthread_mutex_unlock(&gc->mu);
        run_batch(gc);
        pthread_mutex_lock(&gc->mu);
        gc->writer_busy = false;
    }
    pthread_mutex_unlock(&gc->mu);
    return NULL;
}

idem_code idem__gc_init(idem_group_commit *gc, MDB_env *env, bool enabled, size_t max_batch)
{
    pthread_condattr_t ca;
    memset(gc, 0, sizeof(*gc));
    gc->env = env;
    gc->enabled = enabled;
    gc->max_batch = max_batch ? max_batch : 1;
    gc->hold_us = HOLD_US;
    pthread_mutex_init(&gc->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* hold_open's timed wait */
    pthread_cond_init(&gc->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&gc->done_cv, NULL);
    pthread_cond_init(&gc->inline_cv, NULL);
    if (enabled) {
        if (pthread_create(&gc->writer, NULL, writer_main, gc) != 0) {
            pthread_cond_destroy(&gc->inline_cv);
            pthread_cond_destroy(&gc->done_cv);
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
            pthread_cond_wait(&gc->inline_cv, &gc->mu);
        }
        pthread_mutex_unlock(&gc->mu);
        pthread_join(gc->writer, NULL);
        gc->started = false;
    }
    pthread_cond_destroy(&gc->inline_cv);
    pthread_cond_destroy(&gc->done_cv);
    pthread_cond_destroy(&gc->cv);
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
    idem_code code = write_alone(gc->env, fn, ctx);
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

static idem_code write_queued(idem_group_commit *gc, idem_write_fn fn, void *ctx,
                              enum op_kind kind, uint64_t ticket)
{
    if (!gc->enabled) {
        pthread_mutex_lock(&gc->mu);
        gc->commits++;
        gc->writes++;
        pthread_mutex_unlock(&gc->mu);
        return write_alone(gc->env, fn, ctx);
    }
    idem_write_op op = {.fn = fn, .ctx = ctx, .kind = kind, .ticket = ticket};
    if (sem_init(&op.done, 0, 0) != 0) {
        return idem__err(IDEM_INTERNAL, "sem_init: %s", strerror(errno));
    }
    pthread_mutex_lock(&gc->mu);
    if (gc->head == NULL && !gc->writer_busy && !gc->inline_busy) {
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
    return write_queued(gc, fn, ctx, OP_PLAIN, 0);
}

idem_code idem__gc_write_end(idem_group_commit *gc, idem_write_fn fn, void *ctx, uint64_t ticket)
{
    return write_queued(gc, fn, ctx, ticket != 0 ? OP_END : OP_PLAIN, ticket);
}

idem_code idem__gc_write_held(idem_group_commit *gc, idem_write_fn fn, idem_write_fn redo,
                              void *ctx, void (*unref)(void *ctx), uint64_t *ticket)
{
    *ticket = 0;
    if (!gc->started) {
        idem_code code = write_queued(gc, fn, ctx, OP_PLAIN, 0);
        unref(ctx); /* the writer's reference: there is none */
        return code;
    }
    idem_write_op *op = calloc(1, sizeof(*op));
    if (op == NULL || sem_init(&op->done, 0, 0) != 0) {
        free(op);
        unref(ctx);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory for a store write");
    }
    op->fn = fn;
    op->redo = redo;
    op->ctx = ctx;
    op->unref = unref;
    op->kind = OP_HELD;
    atomic_init(&op->refs, 2);
    pthread_mutex_lock(&gc->mu);
    enqueue(gc, op);
    /* A batch past taking claims has no use for it until it has committed. */
    wake_writer(gc, idem__mono_us() < gc->accept_until); /* releases gc->mu */
    idem_code code = op_wait(gc, op);
    *ticket = op->ticket;
    op_unref(op);
    return code;
}

idem_code idem__gc_write_end_async(idem_group_commit *gc, idem_write_fn fn, void *ctx,
                                   uint64_t ticket,
                                   void (*done)(void *ctx, idem_code code, const char *err))
{
    idem_write_op *op;
    if (!gc->started || ticket == 0 || (op = calloc(1, sizeof(*op))) == NULL) {
        return idem__err(IDEM_UNAVAILABLE, "no asynchronous write here: write and wait");
    }
    op->fn = fn;
    op->ctx = ctx;
    op->kind = OP_END;
    op->ticket = ticket;
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
}
