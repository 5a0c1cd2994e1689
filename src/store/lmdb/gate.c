/* The write gate: every write outside a handler txn goes through group commit, and a
 * thread that holds a handler txn (txn.c) writes only inside it. */
#include "lmdb_internal.h"

/* The handler txn this thread holds, if any. LMDB's writer lock is not recursive: a
 * second write txn begun on this thread would wait for itself forever. */
static _Thread_local const void *thread_write_txn;

static idem_code nested_write(void)
{
    return idem__err(IDEM_FAILED_PRECONDITION,
                     "this thread holds a transactional handler's write txn: use idem_txn_* "
                     "inside it, not another store write");
}

/* Every write outside a handler txn goes through the group committer. */
idem_code idem__lmdb_write(lmdb_store *st, idem_write_fn fn, void *ctx)
{
    return thread_write_txn != NULL ? nested_write() : idem__gc_write(&st->gc, fn, ctx);
}

idem_code idem__lmdb_write_held(lmdb_store *st, idem_write_fn fn, idem_write_fn redo, void *ctx,
                                void (*unref)(void *ctx), void *op_mem, uint64_t *ticket)
{
    if (thread_write_txn != NULL) {
        *ticket = 0;
        unref(ctx); /* the writer thread's reference */
        return nested_write();
    }
    return idem__gc_write_held(&st->gc, fn, redo, ctx, unref, op_mem, ticket);
}

idem_code idem__lmdb_write_held_async(lmdb_store *st, idem_write_fn fn, idem_write_fn redo,
                                      void *ctx, void (*unref)(void *ctx), void *op_mem,
                                      idem_gc_applied_fn applied)
{
    return thread_write_txn != NULL
               ? nested_write()
               : idem__gc_write_held_async(&st->gc, fn, redo, ctx, unref, op_mem, applied);
}

idem_code idem__lmdb_write_end(lmdb_store *st, idem_write_fn fn, void *ctx, uint64_t ticket,
                               size_t value_len)
{
    if (thread_write_txn != NULL) {
        idem__gc_drop(&st->gc, ticket);
        return nested_write();
    }
    return idem__gc_write_end(&st->gc, fn, ctx, ticket, value_len);
}

idem_code idem__lmdb_write_end_async(lmdb_store *st, idem_write_fn fn, void *ctx, uint64_t ticket,
                                     size_t value_len,
                                     void (*done)(void *ctx, idem_code code, const char *err),
                                     void *op_mem)
{
    return thread_write_txn != NULL
               ? nested_write()
               : idem__gc_write_end_async(&st->gc, fn, ctx, ticket, value_len, done, op_mem);
}

int idem__lmdb_write_begin(lmdb_store *st, MDB_txn **txn)
{
    idem__gc_lock_wanted(&st->gc, true);
    int rc = mdb_txn_begin(st->env, NULL, 0, txn);
    idem__gc_lock_wanted(&st->gc, false);
    return rc;
}

idem_code idem__lmdb_gate_check(void)
{
    return thread_write_txn != NULL ? nested_write() : IDEM_OK;
}

void idem__lmdb_gate_set(const void *txn)
{
    thread_write_txn = txn;
}

void idem__lmdb_ticket_drop(idem_store *base, uint64_t ticket)
{
    idem__gc_drop(&((lmdb_store *)base)->gc, ticket);
}

void idem__lmdb_ticket_wait(idem_store *base, uint64_t ticket)
{
    idem__gc_wait(&((lmdb_store *)base)->gc, ticket);
}
