/* Group commit: concurrent LMDB writes share one write transaction and one fsync.
 *
 * Each store has one writer thread (started by idem__gc_init, stopped by idem__gc_fini
 * once it has run what is queued). A caller of idem__gc_write queues its operation and
 * sleeps on a semaphore of its own. The writer thread sleeps while the queue is empty;
 * the enqueue that finds it asleep (or holding a batch open, below) wakes it, once
 * (after releasing the queue's lock). It begins a txn, applies what is queued in order,
 * commits, and posts the semaphore of each operation of that batch, and of no other: no
 * broadcast, each caller is woken once, when its result is there.
 *
 * Shared commits (idem__gc_write_held): a claim whose completion is expected soon (a
 * cached handler that is not transactional and journals no steps) is applied in the
 * open txn and its caller woken at once, before the commit: the handler runs while the
 * txn stays open, and its completion (idem__gc_write_end with the claim's ticket) is
 * applied in the same txn, so the claim and its completion reach the disk in ONE commit.
 * The writer thread keeps a batch open while claims in it await their completions:
 *   - it takes new claims for ACCEPT (the time the last commit took, within bounds),
 *     then only completions, so that a batch ends;
 *   - it commits once no claim in it awaits its completion, or HOLD after it began, or
 *     at once when a write that is not a shared claim or completion is queued, when a
 *     handler needs its claim on disk (idem__gc_wait: its fence), when a thread of this
 *     process wants LMDB's writer lock for itself (idem__gc_lock_wanted), or when
 *     stopping.
 * A claim still awaiting its completion then commits alone (IN_PROGRESS), as without
 * sharing, and its completion joins a later batch.
 * A shared claim may also be queued without waiting (idem__gc_write_held_async: the
 * server's nng callback thread queues a new key's claim): the writer thread then tells
 * its caller's callback, at the moment it would have woken the caller (the same
 * outcome, ticket and error), and that callback hands the call to a worker. Everything
 * else about the claim (its batch, its redo, its ticket's end) is as above.
 *
 * Why this keeps the promise: the open txn holds LMDB's writer lock, so no other claim of
 * the same key can commit anywhere (another thread, another process) until this one has:
 * a second claimer waits for the lock and then reads the claim, or the result. Nothing
 * uncommitted is answered: a decision made on an uncommitted record (a shared claim that
 * found the key completed, or another request's) waits for that commit (idem__gc_wait)
 * before its caller answers, and the completion's caller is woken only after the commit.
 * What changes is what a crash loses: a process or machine crash while the handler runs
 * loses the uncommitted claim, so the retry runs at once instead of after the lease; an
 * effect outside the store may then run twice, exactly as after a crash between the
 * effect and a separately committed completion (README's at-least-once edge). The
 * handler's fence is the one value another system could remember: idem_call_fence
 * waits for the claim's batch to end and reads the claim back from the disk before
 * returning it (else it returns 0: refused), so a fence that left the process is on
 * disk and the counter never hands it out again.
 *
 * A write that finds nothing queued and nothing committing (neither the writer thread
 * nor another such write) and is not a shared claim is committed on its caller's
 * thread instead, in a txn of its own: when writes do not overlap that saves the two
 * hand-offs to the writer thread and back. Writes that arrive meanwhile queue for the
 * writer thread, which that caller wakes at its end. Either way each txn is begun and
 * committed by one thread, as LMDB requires, and only the writer thread uses a batch's.
 *
 * Every caller but a shared claim's returns only after the commit holding its write is
 * durable (or has failed), or, for a completion written asynchronously, hears of it
 * then (idem__gc_write_end_async: the server's worker does not wait for the disk).
 * Durable means recoverable after a power cut: on a pipelined store (MDB_NOMETASYNC, one
 * fdatasync per commit) with the store's write-ahead log (wal.h), once the batch's
 * commit and its log entry's flush (run at once) are done and the commit before it is
 * durable too; otherwise its callers wait for the next batch's commit, or for an
 * explicit sync when none follows, and a batch ends (idem__gc_wait) only then
 * (group_commit_pipe.c says why that sync flushes the page).
 * Each operation runs in the batch's txn itself while the map has room for every page
 * the batch's operations may take, so that none can meet a full map there; one that
 * fails with a storage error all the same poisons the txn (LMDB refuses it every further
 * operation), and the batch is re-run as after a failed commit (below). Near a full map
 * each runs in a child txn of the batch's instead: one that meets MDB_MAP_FULL undoes
 * only its own writes, and the batch commits the others, shared claims included. A
 * commit that fails (an I/O error) loses the batch; it is then re-run one operation per
 * txn, in order, so every caller gets its own, exact result and its own error message,
 * handed over with it; a shared claim that its caller already holds is re-applied with
 * the owner it drew (redo), so that its completion finds it. Between the failed commit
 * and the redo LMDB's writer lock is free: another writer may take the key, or draw the
 * same fence from the counter the failed commit rolled back, first; the redo then
 * applies nothing (a fence is never held by two claims), and the completion finds its
 * claim lost: on a disk that fails a write, the same at-least-once edge as a crash. A
 * shared claim refused from the open txn (a token another claim of the batch consumed)
 * is not answered before the commit: its caller is woken with the other writes, or
 * after deciding it again alone.
 * idem__gc_wait says only that a batch ended, not that it is durable: whoever needs a
 * shared claim on disk (a fence) reads it back from the store after the wait.
 *
 * A transactional handler's txn (txn.c) and a sweep are begun and committed on their own
 * thread, outside group commit, inside idem__gc_lock_wanted. LMDB's writer lock (one write txn
 * per env, across threads and processes) keeps them and group commit apart. A thread
 * holding a handler txn never queues here (txn.c refuses a nested write), so it never
 * waits for the writer thread while the writer thread waits for it.
 *
 * With enabled false (IDEM_STORE_NO_GROUP_COMMIT, or a read-only store) there is no
 * writer thread: each write is its own txn, on the caller's thread, and no claim is
 * shared. */
#ifndef IDEMRPC_GROUP_COMMIT_H
#define IDEMRPC_GROUP_COMMIT_H

#include <lmdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "internal.h"
#include "wal.h"

/* The idem_code and message (idem_errmsg) of a failed LMDB call: IDEM_RESOURCE_EXHAUSTED
 * when the map or txn is full, IDEM_INTERNAL otherwise. The one mapping of an LMDB rc,
 * used by group commit and by every file of the LMDB store. */
static inline idem_code idem__lmdb_code(int rc, const char *what)
{
    if (rc == MDB_MAP_FULL || rc == MDB_TXN_FULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "store full (%s): %s", what, mdb_strerror(rc));
    }
    return idem__err(IDEM_INTERNAL, "%s: %s", what, mdb_strerror(rc));
}

/* Applies one operation inside txn. A code other than IDEM_OK must leave the txn
 * unchanged unless it is IDEM_RESOURCE_EXHAUSTED or IDEM_INTERNAL (storage errors): every
 * check that refuses comes before the first write, since a batch commits what a refused
 * operation would have left in its txn. The function may run more than once (after a
 * batch failure), so it must set its outputs afresh on every run. It runs on the writer
 * thread: it must not depend on the caller's thread-local state.
 * Checked unless NDEBUG: every LMDB write of a file that includes this header is counted
 * on its thread (the wrappers below), and group commit aborts the process, naming the
 * refusal, when a function refused after a write of its own (idem__gc_apply_fn). A
 * database created by mdb_dbi_open is not counted: create it before any refusal. */
typedef idem_code (*idem_write_fn)(MDB_txn *txn, void *ctx);

/* fn(txn, ctx), and the check above. */
idem_code idem__gc_apply_fn(idem_write_fn fn, MDB_txn *txn, void *ctx);

#ifndef NDEBUG
/* Called instead of abort() with what was refused (tests set it): the write then fails
 * IDEM_INTERNAL, so that a batch holding it is run again one write per txn. */
extern void (*idem__gc_on_bad_refusal)(const char *msg);
extern _Thread_local uint64_t idem__gc_writes; /* LMDB writes made on this thread */
static inline int idem__gc_counted(int rc)
{
    idem__gc_writes += rc == 0; /* MDB_KEYEXIST, MDB_NOTFOUND: nothing written */
    return rc;
}
#else
static inline int idem__gc_counted(int rc)
{
    return rc;
}
#endif

/* The LMDB writes of every file that includes this header, counted (above) and, in a
 * batch of the writer thread with the write-ahead log on (wal.h), noted for its entry. */
static inline int idem__gc_put(MDB_txn *t, MDB_dbi d, MDB_val *k, MDB_val *v, unsigned f)
{
    int rc = mdb_put(t, d, k, v, f);
    if (rc == 0 && idem__wal_cur != NULL) {
        idem__wal_note(d, k);
    }
    return idem__gc_counted(rc);
}
static inline int idem__gc_del(MDB_txn *t, MDB_dbi d, MDB_val *k, MDB_val *v)
{
    int rc = mdb_del(t, d, k, v);
    if (rc == 0 && idem__wal_cur != NULL) {
        idem__wal_note(d, k);
    }
    return idem__gc_counted(rc);
}
static inline int idem__gc_cursor_put(MDB_cursor *c, MDB_val *k, MDB_val *v, unsigned f)
{
    int rc = mdb_cursor_put(c, k, v, f);
    if (rc == 0 && idem__wal_cur != NULL) {
        idem__wal_note_cursor(c);
    }
    return idem__gc_counted(rc);
}
static inline int idem__gc_cursor_del(MDB_cursor *c, unsigned f)
{
    if (idem__wal_cur != NULL) {
        idem__wal_note_cursor(c); /* its key, before it goes */
    }
    return idem__gc_counted(mdb_cursor_del(c, f));
}
static inline int idem__gc_db_drop(MDB_txn *t, MDB_dbi d, int del)
{
    idem__wal_unloggable();
    return idem__gc_counted(mdb_drop(t, d, del));
}
#define mdb_put(t, d, k, v, f) idem__gc_put(t, d, k, v, f)
#define mdb_del(t, d, k, v) idem__gc_del(t, d, k, v)
#define mdb_cursor_put(c, k, v, f) idem__gc_cursor_put(c, k, v, f)
#define mdb_cursor_del(c, f) idem__gc_cursor_del(c, f)
#define mdb_drop(t, d, del) idem__gc_db_drop(t, d, del)

typedef struct idem_write_op idem_write_op;

typedef struct idem_group_commit {
    MDB_env *env;
    bool enabled;
    size_t max_batch;
    pthread_mutex_t mu;       /* guards everything below */
    pthread_cond_t cv;        /* the writer thread's: work queued, a claim ended, stopping */
    pthread_cond_t done_cv;   /* idem__gc_wait's: a batch ended */
    pthread_cond_t inline_cv; /* idem__gc_fini's: an inline write ended */
    idem_write_op *head, *tail;
    bool writer_asleep;  /* in cv's wait with an empty queue: the next enqueue wakes it */
    bool writer_holding; /* in cv's timed wait with a batch open: enqueues wake it */
    bool writer_busy;    /* the writer thread runs a batch */
    bool inline_busy;    /* a caller commits its own write (nothing was queued or running) */
    bool stopping;
    bool started; /* the writer thread runs (enabled, and pthread_create succeeded) */
    pthread_t writer;
    /* The batch the writer has open (its ticket, 0: none), its shared claims still
     * awaiting their completion, and whether someone asked it to commit now. */
    uint64_t open_ticket, last_ticket, done_ticket;
    size_t awaiting;
    uint64_t accept_until; /* the open batch takes new shared claims until then (mono µs) */
    size_t lock_wanted;    /* threads waiting for LMDB's writer lock (idem__gc_lock_wanted) */
    bool flush;
    size_t done_waiters;                   /* threads in idem__gc_wait */
    uint64_t last_commit_us;               /* how long the last batch's commit took */
    uint64_t hold_us;                      /* the longest a batch stays open (HOLD; tests set it) */
    uint64_t accept_min_us, accept_max_us; /* ACCEPT's bounds (tests set them) */
    uint64_t commits, writes;              /* batches run and operations in them (statistics) */
    uint64_t shared;                       /* completions committed with their claim (statistics) */
    uint64_t wakeups;       /* times an enqueue woke the writer thread (statistics) */
    uint64_t early_wakeups; /* a writer woke, then had to wait again (statistics) */
    /* Called on the writer thread after a batch's commit failed, before its redo (NULL:
     * nothing). Tests set it, before the first write, to act in that window as another
     * process could. */
    void (*on_failed_commit)(void *arg);
    void *on_failed_commit_arg;
    /* Pipelined durability (group_commit_pipe.c): the env has MDB_NOMETASYNC, so a
     * batch's commit syncs its data but not its meta page, and its callers are woken
     * only once a later sync has flushed that page, or once its write-ahead log entry
     * is flushed (wal.h). pending_ticket: the last batch committed and not yet known
     * durable (0: none); durable_txnid: the newest LMDB txnid known recoverable, by a
     * meta page on disk or by the log (every txnid up to it is then recoverable too;
     * read without gc->mu). */
    bool pipelined;
    uint64_t pending_ticket;
    _Atomic uint64_t durable_txnid;
    /* After a failed sync (group_commit_sync.c): the newest txnid whose meta page was
     * written before it (0: none). No later sync vouches for those pages; a meta page
     * written after the failure does. sync_mu: one commit or sync of the file at a
     * time, its outcome recorded before the next begins. rewrite(txn, rewrite_ctx):
     * changes a key, so that a commit writes a new meta page (NULL: none; the store sets
     * it before its first write). */
    _Atomic uint64_t unsure_txnid;
    pthread_mutex_t sync_mu;
    idem_write_fn rewrite;
    void *rewrite_ctx;
    /* Built with -DIDEM_TEST_HOOKS (never by default) and $IDEMRPC_TEST_ANSWER_AT_COMMIT=1:
     * a batch's callers are woken at its commit, its meta page not on disk yet: the bug
     * tests/test_power_cut.c must catch. */
    bool answer_at_commit;
    /* The store's write-ahead log (wal.h; NULL: none, another process holds it), set
     * before the first write: a batch whose entry is flushed and whose chain holds is
     * answered then (group_commit_pipe.c); only the writer thread uses it. */
    idem_wal *wal;
} idem_group_commit;

/* Starts the writer thread when enabled. IDEM_RESOURCE_EXHAUSTED when it cannot. */
idem_code idem__gc_init(idem_group_commit *gc, MDB_env *env, bool enabled, size_t max_batch);
/* Runs what is queued, then stops and joins the writer thread. No idem__gc_write may
 * start once this has been called. */
void idem__gc_fini(idem_group_commit *gc);

/* Answers batches from wal's entries from now on (wal.h; NULL: no log), before the first
 * write; wal's start synced every commit so far (its epoch's among them). */
void idem__gc_log_to(idem_group_commit *gc, idem_wal *wal);

/* Runs fn in a committed write txn (shared with other writers when enabled). */
idem_code idem__gc_write(idem_group_commit *gc, idem_write_fn fn, void *ctx);

/* A claim that may share its commit with its completion (above): returns once fn has
 * been applied, usually before the commit. ctx is shared with the writer thread, which
 * may run redo(txn, ctx) after a batch failure (to re-apply a claim that fn applied:
 * it must not touch what the caller reads from ctx; it runs alone, so a refusal after a
 * write is allowed there) and calls unref(ctx) when done with it; the caller calls
 * unref(ctx) too once it has read fn's outputs. *ticket: nonzero
 * when fn returned IDEM_OK in an open batch: the claim's caller then ends it with
 * idem__gc_write_end (its completion or release) or idem__gc_drop (no write follows). */
idem_code idem__gc_write_held(idem_group_commit *gc, idem_write_fn fn, idem_write_fn redo,
                              void *ctx, void (*unref)(void *ctx), void *op_mem, uint64_t *ticket);
/* What an asynchronous shared claim's caller is told, on the writer thread, when its
 * caller would have been woken: fn's code (its idem_errmsg in err) and the ticket as
 * idem__gc_write_held would return them. It must not wait for a store write; ctx is
 * still the caller's (its reference) until it returns, when group commit drops that. */
typedef void (*idem_gc_applied_fn)(void *ctx, idem_code code, uint64_t ticket, const char *err);
/* idem__gc_write_held without waiting: IDEM_OK when queued (applied is then called once,
 * and the caller's reference to ctx is dropped after it), else an error, nothing queued
 * and both references to ctx still the caller's (no writer thread: write and wait). */
idem_code idem__gc_write_held_async(idem_group_commit *gc, idem_write_fn fn, idem_write_fn redo,
                                    void *ctx, void (*unref)(void *ctx), void *op_mem,
                                    idem_gc_applied_fn applied);
/* idem__gc_write of the write that ends a shared claim (ticket 0: none). value_len: the
 * size of the value fn writes (a response; 0 for a record's usual few hundred bytes), so
 * that the batch knows the map has room for it (group_commit_batch.c). */
idem_code idem__gc_write_end(idem_group_commit *gc, idem_write_fn fn, void *ctx, uint64_t ticket,
                             size_t value_len);
/* idem__gc_write_end without waiting: queued, and IDEM_OK, when the writer thread runs
 * and ticket is not 0, else an error and nothing queued. done(ctx, code, err) is called
 * once, on the writer thread, when the batch holding the write has ended (err: its
 * idem_errmsg when code is not IDEM_OK); it must not wait for a store write. */
idem_code idem__gc_write_end_async(idem_group_commit *gc, idem_write_fn fn, void *ctx,
                                   uint64_t ticket, size_t value_len,
                                   void (*done)(void *ctx, idem_code code, const char *err),
                                   void *op_mem);
/* op_mem of the two above: NULL, or IDEM_GC_OP_BYTES (aligned as malloc's) in ctx's own
 * block, for one allocation instead of two. The op is done with them before unref(ctx)
 * or done(ctx, ...), which may then free that block; err points into them: read it
 * before. */
#define IDEM_GC_OP_BYTES 400

/* No write will end the shared claim of ticket: its batch need not wait for one. */
void idem__gc_drop(idem_group_commit *gc, uint64_t ticket);
/* Returns once the batch of ticket has ended (committed, or failed and re-run one write
 * per txn), asking it to commit now. */
void idem__gc_wait(idem_group_commit *gc, uint64_t ticket);
/* A thread of this process is about to wait for LMDB's writer lock outside group commit
 * (wanting), or has it now (!wanting): while one waits, a batch commits as soon as it
 * can instead of holding for completions, whether it is open yet or not. */
void idem__gc_lock_wanted(idem_group_commit *gc, bool wanting);
/* Returns once the state of LMDB txnid is on disk (at once unless pipelined): a reader
 * that found a record in a snapshot of txnid calls it before answering from it. It asks
 * the writer thread to end its batch, or syncs itself when nothing of the writer thread
 * is pending. IDEM_INTERNAL when that sync fails. */
idem_code idem__gc_durable_wait(idem_group_commit *gc, uint64_t txnid);
/* mdb_txn_commit, then, on a MDB_NOMETASYNC env, mdb_env_sync: durable on IDEM_OK. Every
 * commit outside a batch goes through it (a failure is recorded: unsure_txnid). */
idem_code idem__gc_commit_durable(idem_group_commit *gc, MDB_txn *txn);

#endif
