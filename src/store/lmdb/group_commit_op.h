/* Group commit's private types, shared by its five files (the public contract and the
 * invariants of the whole are in group_commit.h):
 *   group_commit.c        the callers' side: the queue, its life cycle, waiting
 *   group_commit_batch.c  the writer thread: take, apply, hold open, commit, wake
 *   group_commit_redo.c   a batch whose commit failed, again one op per txn
 *   group_commit_pipe.c   committed batches whose callers wait for a later sync
 *   group_commit_sync.c   the file's syncs and what each vouches for (after a failed one)
 *
 * An op lives on its caller's stack (idem__gc_write, _end) or on the heap (a shared
 * claim: two references; an asynchronous end: freed once handed over), there in its
 * ctx's block when its caller gave op_mem (in_ctx: freed with the ctx, after the op's
 * last use). It is on the queue (gc->head, under gc->mu), then in exactly one batch,
 * owned by the writer thread until it is posted: after the commit holding it is durable
 * or has failed and been run again alone. The only op posted before its commit is a
 * shared claim that applied IDEM_OK: its caller runs while the batch is open, and a
 * failed commit re-applies it (redo); any other outcome of a shared claim (a refusal
 * read from the open txn) is posted like a plain write, once its batch is durable, or
 * decided again alone. */
#ifndef IDEMRPC_GROUP_COMMIT_OP_H
#define IDEMRPC_GROUP_COMMIT_OP_H

#include <semaphore.h>
#include <stdatomic.h>

#include "group_commit.h"

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
    size_t value_len; /* the largest value fn writes, beyond a record's usual size */
    /* OP_HELD: heap memory with two references, its caller's and the writer thread's
     * (until its batch ends: a failed batch re-applies it with redo), and ctx's own. */
    idem_write_fn redo;
    void (*unref)(void *ctx);
    atomic_int refs;
    /* Asynchronous (idem__gc_write_end_async): heap memory, handed to done, freed then. */
    void (*on_done)(void *ctx, idem_code code, const char *err);
    /* An asynchronous OP_HELD (idem__gc_write_held_async): its caller's reference is
     * dropped once this has been told the outcome, at the moment the caller would be
     * woken. */
    idem_gc_applied_fn on_applied;
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
    bool in_ctx;              /* in its caller's op_mem, not freed here */
};

_Static_assert(sizeof(idem_write_op) <= IDEM_GC_OP_BYTES, "IDEM_GC_OP_BYTES too small");

/* The ops of one batch, in the order they were applied. */
typedef struct idem_gc_batch {
    idem_write_op *head, *tail, *held;
    size_t n;
    bool plain; /* an OP_PLAIN in it: commit without waiting for shared completions */
    /* Pages the map had left when the batch began (less the commit's reserve), the most
     * its ops so far may take, and the map's page size (group_commit_batch.c). */
    size_t room, spent, psize;
} idem_gc_batch;

/* The batches committed and not yet known durable (group_commit_pipe.c), merged in
 * order; only the writer thread touches it. */
typedef struct idem_gc_pipe {
    idem_gc_batch b;    /* their ops not posted yet, and their shared claims */
    uint64_t ticket;    /* the last of them (0: none) */
    uint64_t txnid;     /* the LMDB state their answers rest on */
    uint64_t commit_us; /* how long the last one's commit took */
} idem_gc_pipe;

/* The batch of ticket has committed (ok) or run again alone: on a pipelined store its
 * callers wait in pipe for a later sync, else they are woken now (group_commit_pipe.c).
 * logged: its LMDB txnid when its write-ahead log entry is on disk (wal.h), else 0. */
void idem__gc_pipe_committed(idem_group_commit *gc, idem_gc_pipe *pipe, idem_gc_batch *b,
                             uint64_t ticket, bool ok, uint64_t commit_us, uint64_t logged);
/* A thread that now holds LMDB's writer lock syncs what a pipe left unsynced. */
void idem__gc_sync_pending(idem_group_commit *gc);
/* Syncs the file and wakes what pipe holds (with the sync's error if it failed). */
void idem__gc_pipe_flush(idem_group_commit *gc, idem_gc_pipe *pipe);
/* The batch of ticket has ended: its waiters wake, the writer's references go. */
void idem__gc_batch_ended(idem_group_commit *gc, idem_gc_batch *b, uint64_t ticket, bool ok,
                          uint64_t commit_us);

/* One operation in a txn of its own (group_commit_redo.c). */
idem_code idem__gc_write_alone(idem_group_commit *gc, idem_write_fn fn, void *ctx);

/* group_commit_sync.c: the file's syncs. mdb_txn_commit of a batch's txn, a failure
 * recorded; an LMDB rc. */
int idem__gc_commit_batch(idem_group_commit *gc, MDB_txn *txn);
/* Flushes the file: every meta page written before it is on disk then, unless a failed
 * sync came first (then EIO: only a re-write puts them on disk). An LMDB rc. Nothing to
 * do (0) when the state of txnid want (0: none named) is on disk by then. */
int idem__gc_sync_file(idem_group_commit *gc, uint64_t want);
/* The txnid of the newer meta page written (on disk or not); 0 if unknown. */
uint64_t idem__gc_last_txnid(MDB_env *env);
/* The state of txnid is on disk. */
void idem__gc_durable_raise(idem_group_commit *gc, uint64_t txnid);
/* op's result, and its message when it failed. */
void idem__gc_op_finish(idem_write_op *op, idem_code code);
/* Wakes op's caller, or hands an asynchronous op's result over; op may be gone once
 * this returns (unless it is an OP_HELD). */
void idem__gc_op_post(idem_write_op *op);
/* Drops one reference of an OP_HELD. */
void idem__gc_op_unref(idem_write_op *op);
/* A failed batch, again one op per txn in order (group_commit_redo.c). */
void idem__gc_redo(idem_group_commit *gc, idem_gc_batch *b);

/* The writer thread (group_commit_batch.c): one batch per turn while ops are queued. */
void *idem__gc_writer_main(void *arg);
/* Takes queued ops off the queue (gc->mu held): up to room of any kind while the batch
 * takes new shared claims (accept), else only the ends of shared claims. */
idem_write_op *idem__gc_queue_take(idem_group_commit *gc, bool accept, size_t room);
/* An OP_PLAIN is queued (gc->mu held). */
bool idem__gc_plain_queued(const idem_group_commit *gc);

#endif
