/* Group commit: the writer thread and its batches.
 *
 * One batch per turn while ops are queued: begin a txn, apply what is queued (apply_op:
 * in the txn itself, or near a full map each op in a child txn), hold it open while
 * shared claims in it await their completions, commit, then post every op of the batch
 * not posted yet, and only those, once the commit is on disk meta page included
 * (group_commit_pipe.c: at the next batch's commit, or at a sync when nothing is
 * queued). Invariants:
 *   - only this thread uses a batch's txn, and it begins and commits it (LMDB's rule);
 *   - a caller is posted before its batch's commit only for a shared claim that applied
 *     IDEM_OK (its handler runs meanwhile); a shared claim refused from the open txn (a
 *     token another claim of the batch consumed, a full map) is posted with the others,
 *     once the commit is durable, or decided again alone when it failed;
 *   - a batch ends (done_ticket, done_cv) only after its commit is durable, or after the redo of
 *     a failed one (group_commit_redo.c): a waiter for a ticket then finds in the store
 *     whatever of it is durable, and nothing else. */
#include <errno.h>
#include <pthread.h>
#include <time.h>

#include "group_commit_op.h"

static void batch_add(idem_gc_batch *b, idem_write_op *op)
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

idem_write_op *idem__gc_queue_take(idem_group_commit *gc, bool accept, size_t room)
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

bool idem__gc_plain_queued(const idem_group_commit *gc)
{
    for (const idem_write_op *op = gc->head; op != NULL; op = op->next) {
        if (op->kind == OP_PLAIN) {
            return true;
        }
    }
    return false;
}

/* The most pages one op may take beside its value: its six B-tree changes at most
 * (records, expiry index twice, token and its index, fence counter) each copy their
 * path and may split a leaf and its parents, about 100 pages in trees of depth 9 (10 M
 * records of the longest keys); and the pages kept for the commit's own writes (the
 * free list). Counted in pages: a larger page holds more, and trees are shallower. */
#define OP_PAGES 128u
#define COMMIT_PAGES 1024u

/* Pages the map has left past the last one in use (read in the batch's txn: nobody else
 * can use them meanwhile), less the commit's; *psize: the page size. */
static size_t map_room(MDB_env *env, size_t *psize)
{
    MDB_envinfo info;
    MDB_stat stat;
    *psize = 4096; /* unless LMDB says: no room then, every op in a child txn */
    if (mdb_env_info(env, &info) != 0 || mdb_env_stat(env, &stat) != 0) {
        return 0;
    }
    size_t pages = info.me_mapsize / stat.ms_psize, used = info.me_last_pgno + 1 + COMMIT_PAGES;
    *psize = stat.ms_psize;
    return pages > used ? pages - used : 0;
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
    idem_code code = idem__gc_apply_fn(op->fn, child, op->ctx);
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

/* op->fn straight in the batch's txn while the map has room for every page the batch's
 * ops may take (OP_PAGES each and their values): it cannot meet a full map then, and a
 * child txn per op would cost its allocations and a copy of every page it touches. A
 * write that fails all the same (IDEM_RESOURCE_EXHAUSTED or IDEM_INTERNAL, the only
 * codes idem_write_fn lets leave txn changed) poisons the batch, which is then re-run one
 * op per txn (group_commit_redo.c). Near a full map, in a child txn: the write that meets
 * it fails alone. */
static idem_code apply_op(MDB_txn *txn, idem_write_op *op, idem_gc_batch *b, bool *poisoned)
{
    size_t pages = OP_PAGES + op->value_len / b->psize + 1;
    bool room = b->spent + pages <= b->room;
    b->spent += pages;
    if (!room) {
        return apply_nested(txn, op, poisoned);
    }
    idem_code code = idem__gc_apply_fn(op->fn, txn, op->ctx);
    if (code == IDEM_RESOURCE_EXHAUSTED || code == IDEM_INTERNAL) {
        *poisoned = true;
    }
    return code;
}

/* A shared claim applied IDEM_OK in the batch of ticket: counted as awaiting its end
 * (before its caller can drop it), and its caller woken at once. */
static void held_applied(idem_group_commit *gc, idem_write_op *op, uint64_t ticket)
{
    pthread_mutex_lock(&gc->mu);
    gc->awaiting++;
    pthread_mutex_unlock(&gc->mu);
    op->ticket = ticket;
    idem__gc_op_post(op);
}

/* Applies ops in txn (the batch of ticket) and adds them to b; false once the txn is
 * poisoned (the ops after it are added unapplied). */
static bool apply(idem_group_commit *gc, MDB_txn *txn, uint64_t ticket, idem_write_op *ops,
                  idem_gc_batch *b)
{
    bool poisoned = false;
    size_t ended = 0;
    for (idem_write_op *op = ops, *next; op != NULL; op = next) {
        next = op->next;
        batch_add(b, op);
        if (poisoned) {
            continue;
        }
        idem__gc_op_finish(op, apply_op(txn, op, b, &poisoned));
        if (poisoned) {
            continue;
        }
        if (op->kind == OP_HELD && op->code == IDEM_OK) {
            held_applied(gc, op, ticket);
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

/* Keeps the batch open until it should commit (group_commit.h), applying what comes.
 * Called and returns with gc->mu held; false when the txn is poisoned. */
static bool hold_open(idem_group_commit *gc, MDB_txn *txn, uint64_t ticket, uint64_t began,
                      idem_gc_batch *b)
{
    uint64_t accept_us = gc->last_commit_us < gc->accept_min_us   ? gc->accept_min_us
                         : gc->last_commit_us > gc->accept_max_us ? gc->accept_max_us
                                                                  : gc->last_commit_us;
    gc->accept_until = began + accept_us;
    for (;;) {
        uint64_t now = idem__mono_us();
        /* The first take always: what woke the writer thread is in it. */
        bool accept = (b->n == 0 || now < gc->accept_until) && b->n < gc->max_batch;
        idem_write_op *ops = idem__gc_queue_take(gc, accept, gc->max_batch - b->n);
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
            now >= began + gc->hold_us || idem__gc_plain_queued(gc) ||
            (gc->done_waiters > 0 && gc->pending_ticket != 0)) {
            return true;
        }
        uint64_t until = accept ? gc->accept_until : began + gc->hold_us;
        struct timespec ts = {(time_t)(until / 1000000u), (long)(until % 1000000u) * 1000};
        gc->writer_holding = true;
        pthread_cond_timedwait(&gc->cv, &gc->mu, &ts);
        gc->writer_holding = false;
    }
}

/* Opens the batch of ticket and holds it (gc->mu held); false: LMDB could not begin it,
 * or its txn is poisoned (what was taken is in b, to run alone). */
static bool open_batch(idem_group_commit *gc, MDB_txn *txn, int rc, uint64_t ticket, uint64_t began,
                       idem_gc_batch *b)
{
    if (rc == 0) {
        gc->open_ticket = ticket;
        return hold_open(gc, txn, ticket, began, b);
    }
    for (idem_write_op *op = idem__gc_queue_take(gc, true, gc->max_batch), *next; op != NULL;
         op = next) {
        next = op->next;
        batch_add(b, op); /* run alone, each txn begun again */
    }
    return false;
}

/* The write-ahead log's new epoch: its txn committed and synced (0), every commit before
 * it on disk, as any commit outside a batch is (a failed sync recorded), or an rc. */
static int wal_commit(MDB_txn *txn, void *gc)
{
    return idem__gc_commit_durable(gc, txn) == IDEM_OK ? 0 : EIO;
}

/* One batch: begin, apply and hold (hold_open), commit (its log entry flushed beside
 * it, wal.h), then its callers are woken, or wait in pipe for a later sync
 * (group_commit_pipe.c); on a storage error or a failed commit, the redo. */
static void run_batch(idem_group_commit *gc, idem_gc_pipe *pipe)
{
    idem_gc_batch b = {0};
    MDB_txn *txn = NULL;
    int rc = mdb_txn_begin(gc->env, NULL, 0, &txn);
    uint64_t began = idem__mono_us();
    b.room = rc == 0 ? map_room(gc->env, &b.psize) : 0;
    pthread_mutex_lock(&gc->mu);
    uint64_t ticket = ++gc->last_ticket;
    gc->awaiting = 0;
    gc->flush = false;
    if (idem__wal_on(gc->wal)) {
        idem__wal_batch_begin(gc->wal); /* notes what the batch writes */
    }
    bool ok = open_batch(gc, txn, rc, ticket, began, &b);
    gc->open_ticket = 0;
    gc->commits++;
    gc->writes += b.n;
    pthread_mutex_unlock(&gc->mu);

    uint64_t t0 = idem__mono_us();
    /* The batch's log entry is written and flushed while LMDB commits (wal.h). */
    bool logging = ok && idem__wal_batch_start(gc->wal, txn), logged = false;
    uint64_t txnid = ok ? mdb_txn_id(txn) : 0;
    if (ok && (rc = idem__gc_commit_batch(gc, txn)) != 0) {
        ok = false; /* commit freed the txn */
        txn = NULL;
    } else if (!ok && txn != NULL) {
        mdb_txn_abort(txn);
    }
    if (logging) { /* a batch whose writes all failed commits nothing: its txnid is free */
        logged = idem__wal_batch_end(gc->wal, ok, ok && idem__gc_last_txnid(gc->env) == txnid);
    }
    idem__wal_cur = NULL; /* a redo's writes are not logged: each syncs LMDB itself */
    uint64_t commit_us = idem__mono_us() - t0;
    if (!ok) {
        idem__gc_pipe_flush(gc, pipe); /* the redo's answers must not overtake these */
        if (gc->on_failed_commit != NULL) {
            gc->on_failed_commit(gc->on_failed_commit_arg);
        }
        idem__gc_redo(gc, &b);
    }
    idem__gc_pipe_committed(gc, pipe, &b, ticket, ok, commit_us, logged ? txnid : 0);
    idem__wal_wrap_due(gc->wal, wal_commit, gc);
}

/* Sleeps until ops are queued and no caller commits inline; false: stopping, nothing
 * left. What a pipe holds is synced first (nothing queued would flush it), or when a
 * thread wants LMDB's writer lock. Called and returns with gc->mu held. */
static bool await_work(idem_group_commit *gc, idem_gc_pipe *pipe)
{
    for (;;) {
        if (pipe->ticket != 0 && (gc->head == NULL || gc->lock_wanted > 0)) {
            pthread_mutex_unlock(&gc->mu);
            idem__gc_pipe_flush(gc, pipe);
            pthread_mutex_lock(&gc->mu);
            continue;
        }
        gc->writer_busy = false;
        if (gc->head != NULL && !gc->inline_busy) {
            return true;
        }
        if (gc->stopping && gc->head == NULL) {
            return false;
        }
        /* A caller committing inline (idem__gc_write) wakes it when it is done. */
        gc->writer_asleep = true;
        pthread_cond_wait(&gc->cv, &gc->mu);
        gc->writer_asleep = false;
    }
}

void *idem__gc_writer_main(void *arg)
{
    idem_group_commit *gc = arg;
    idem_gc_pipe pipe = {0};
    pthread_setname_np(pthread_self(), "idem:lmdb-gc"); /* for per-thread counts */
    pthread_mutex_lock(&gc->mu);
    while (await_work(gc, &pipe)) {
        gc->writer_busy = true;
        pthread_mutex_unlock(&gc->mu);
        run_batch(gc, &pipe);
        pthread_mutex_lock(&gc->mu);
    }
    pthread_mutex_unlock(&gc->mu);
    return NULL;
}
