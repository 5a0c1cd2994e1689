/* Group commit of LMDB writes; see group_commit.h for the protocol. */
#include <stdio.h>
#include <string.h>

#include "group_commit.h"

struct idem_write_op {
    idem_write_fn fn;
    void *ctx;
    idem_code code;
    bool done;
    char err[256]; /* the leader's idem_errmsg() for this op, handed to its writer */
    idem_write_op *next;
};

void idem__gc_init(idem_group_commit *gc, MDB_env *env, bool enabled, size_t max_batch)
{
    memset(gc, 0, sizeof(*gc));
    gc->env = env;
    gc->enabled = enabled;
    gc->max_batch = max_batch ? max_batch : 1;
    pthread_mutex_init(&gc->mu, NULL);
    pthread_cond_init(&gc->cv, NULL);
}

void idem__gc_fini(idem_group_commit *gc)
{
    pthread_cond_destroy(&gc->cv);
    pthread_mutex_destroy(&gc->mu);
}

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
    pthread_mutex_lock(&gc->mu);
    if (gc->tail != NULL) {
        gc->tail->next = &op;
    } else {
        gc->head = &op;
    }
    gc->tail = &op;
    while (!op.done) {
        if (gc->leader_active) {
            pthread_cond_wait(&gc->cv, &gc->mu);
            gc->early_wakeups += !op.done && gc->leader_active; /* back to sleep */
            continue;
        }
        /* Lead: take up to max_batch queued ops (ours among them, or a later batch). */
        gc->leader_active = true;
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
        pthread_mutex_unlock(&gc->mu);
        run_batch(gc, batch);
        pthread_mutex_lock(&gc->mu);
        for (idem_write_op *o = batch, *next; o != NULL; o = next) {
            next = o->next; /* o may be freed by its writer once done is set */
            o->done = true;
        }
        gc->leader_active = false;
        pthread_cond_broadcast(&gc->cv);
    }
    pthread_mutex_unlock(&gc->mu);
    if (op.code != IDEM_OK) {
        idem__err(op.code, "%s", op.err);
    }
    return op.code;
}
