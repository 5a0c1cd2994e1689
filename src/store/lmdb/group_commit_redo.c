/* Group commit: an op on its own, and a batch whose commit failed, again.
 *
 * A commit that fails (an I/O error: fdatasync said EIO) loses the whole batch, and
 * LMDB's writer lock is free until the redo takes it again. Invariants of the redo:
 *   - one op per txn, in the batch's order, so every caller gets its own exact result
 *     and message, and one op that fails again takes no other with it;
 *   - an op whose caller was not woken yet runs as if for the first time (fn), and is
 *     posted with that result: a refusal or a result read from the lost batch is never
 *     what its caller hears;
 *   - a shared claim its caller already holds (posted: it applied IDEM_OK) is re-applied
 *     with the owner it drew (redo), and with nothing else: never another owner, and not
 *     at all when the key or that owner's fence was taken meanwhile (claim.c says how
 *     it knows). Its caller learns how it went from the store: a completion finds its
 *     claim or "claim lost", and a fence is handed out only once read back from the disk
 *     (idem__store_claim_durable). */
#include <stdio.h>
#include <stdlib.h>

#include "group_commit_op.h"

#ifndef NDEBUG
_Thread_local uint64_t idem__gc_writes;
void (*idem__gc_on_bad_refusal)(const char *msg);

idem_code idem__gc_apply_fn(idem_write_fn fn, MDB_txn *txn, void *ctx)
{
    uint64_t before = idem__gc_writes;
    idem_code code = fn(txn, ctx);
    if (code == IDEM_OK || code == IDEM_RESOURCE_EXHAUSTED || code == IDEM_INTERNAL ||
        idem__gc_writes == before) {
        return code;
    }
    /* A bug in fn, not a fault: in a batch its writes would commit with the others'. */
    char msg[300];
    snprintf(msg, sizeof(msg),
             "a store write refused (%s: %s) after %llu write(s) of its own: every refusal "
             "must come before the first write (group_commit.h)",
             idem_code_name(code), idem_errmsg(), (unsigned long long)(idem__gc_writes - before));
    if (idem__gc_on_bad_refusal == NULL) {
        fprintf(stderr, "idemrpc: %s\n", msg);
        abort();
    }
    idem__gc_on_bad_refusal(msg);
    return idem__err(IDEM_INTERNAL, "%s", msg); /* the batch is run again, this txn alone */
}
#else
idem_code idem__gc_apply_fn(idem_write_fn fn, MDB_txn *txn, void *ctx)
{
    return fn(txn, ctx);
}
#endif

/* fn alone in a txn of its own; checked as in a batch unless it is a redo (which only
 * ever runs alone: its refusal after a write is aborted with its txn). */
static idem_code alone(idem_group_commit *gc, idem_write_fn fn, void *ctx, bool redo)
{
    MDB_txn *txn;
    int rc = mdb_txn_begin(gc->env, NULL, 0, &txn);
    if (rc != 0) {
        return idem__lmdb_code(rc, "write begin");
    }
    idem_code code = redo ? fn(txn, ctx) : idem__gc_apply_fn(fn, txn, ctx);
    if (code != IDEM_OK) {
        mdb_txn_abort(txn);
        return code;
    }
    return idem__gc_commit_durable(gc, txn); /* its own sync: no batch follows to flush it */
}

idem_code idem__gc_write_alone(idem_group_commit *gc, idem_write_fn fn, void *ctx)
{
    return alone(gc, fn, ctx, false);
}

void idem__gc_op_finish(idem_write_op *op, idem_code code)
{
    op->code = code;
    snprintf(op->err, sizeof(op->err), "%s", code == IDEM_OK ? "" : idem_errmsg());
}

void idem__gc_op_post(idem_write_op *op)
{
    op->posted = true;
    if (op->on_applied != NULL) { /* an asynchronous shared claim: told, not woken */
        op->on_applied(op->ctx, op->code, op->ticket, op->err);
        op->unref(op->ctx);    /* the caller's reference to ctx (op holds another) */
        idem__gc_op_unref(op); /* the caller's reference to op: may free ctx, op in it */
        return;
    }
    if (op->on_done != NULL) {
        bool in_ctx = op->in_ctx; /* on_done may free op with its ctx */
        op->on_done(op->ctx, op->code, op->err);
        if (!in_ctx) {
            free(op);
        }
        return;
    }
    sem_post(&op->done); /* its writer, and nobody else: cannot fail (0 → 1) */
}

void idem__gc_op_unref(idem_write_op *op)
{
    if (atomic_fetch_sub(&op->refs, 1) == 1) {
        void (*unref)(void *ctx) = op->unref;
        void *ctx = op->ctx;
        sem_destroy(&op->done);
        if (!op->in_ctx) {
            free(op);
        }
        unref(ctx); /* may free op with its ctx */
    }
}

void idem__gc_redo(idem_group_commit *gc, idem_gc_batch *b)
{
    for (idem_write_op *op = b->head, *next; op != NULL; op = next) {
        next = op->next; /* op may be gone once posted */
        if (op->kind == OP_HELD && op->posted) {
            /* A failure here: the claim is not in the store, and whoever asks finds so. */
            (void)alone(gc, op->redo, op->ctx, true);
            continue;
        }
        op->ticket = op->kind == OP_HELD ? 0 : op->ticket;
        idem__gc_op_finish(op, idem__gc_write_alone(gc, op->fn, op->ctx));
        idem__gc_op_post(op);
    }
}
