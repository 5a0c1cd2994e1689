/* Scenario f, the storage baseline: raw LMDB, one mdb_put of the payload per durable
 * write transaction, one thread, no transport and no idemrpc code. */
#include <endian.h>

#include <lmdb.h>

#include "bench.h"

static int lmdb_fail(bench_thread *t, const char *what, int rc)
{
    return thread_fail(t, "%s: %s", what, mdb_strerror(rc));
}

static int lmdb_open(bench_thread *t)
{
    MDB_txn *txn;
    int rc;
    if ((rc = mdb_env_create(&t->conn.lmdb.env)) != 0) {
        t->conn.lmdb.env = NULL;
        return lmdb_fail(t, "mdb_env_create", rc);
    }
    MDB_env *env = t->conn.lmdb.env;
    if ((rc = mdb_env_set_mapsize(env, LMDB_MAP_SIZE)) != 0) {
        return lmdb_fail(t, "mdb_env_set_mapsize", rc);
    }
    if ((rc = mdb_env_open(env, t->cell->dir, 0, 0600)) != 0) { /* durable: no NOSYNC */
        return lmdb_fail(t, "mdb_env_open", rc);
    }
    if ((rc = mdb_txn_begin(env, NULL, 0, &txn)) != 0) {
        return lmdb_fail(t, "mdb_txn_begin", rc);
    }
    if ((rc = mdb_dbi_open(txn, NULL, 0, &t->conn.lmdb.dbi)) != 0) {
        mdb_txn_abort(txn);
        return lmdb_fail(t, "mdb_dbi_open", rc);
    }
    if ((rc = mdb_txn_commit(txn)) != 0) {
        return lmdb_fail(t, "mdb_txn_commit", rc);
    }
    return 0;
}

/* One put of the payload under a new big-endian key, in its own write transaction. */
static int lmdb_call(bench_thread *t)
{
    uint64_t k = htobe64(t->seq++);
    MDB_val key = {sizeof(k), &k};
    MDB_val val = {t->cell->payload_len, (void *)t->cell->payload};
    MDB_txn *txn;
    int rc;
    if ((rc = mdb_txn_begin(t->conn.lmdb.env, NULL, 0, &txn)) != 0) {
        return lmdb_fail(t, "mdb_txn_begin", rc);
    }
    if ((rc = mdb_put(txn, t->conn.lmdb.dbi, &key, &val, 0)) != 0) {
        mdb_txn_abort(txn);
        return lmdb_fail(t, "mdb_put", rc);
    }
    if ((rc = mdb_txn_commit(txn)) != 0) { /* commit frees txn even when it fails */
        return lmdb_fail(t, "mdb_txn_commit", rc);
    }
    return 0;
}

static void lmdb_close(bench_thread *t)
{
    if (t->conn.lmdb.env != NULL) {
        mdb_env_close(t->conn.lmdb.env);
    }
}

static const client_ops lmdb_ops = {.open = lmdb_open, .call = lmdb_call, .close = lmdb_close};

int run_lmdb(const scenario *sc, cell *c, cell_stats *out)
{
    (void)sc;
    if ((c->dir = tmp_dir_create()) == NULL) {
        return cell_fail(out, "mkdtemp under /tmp failed");
    }
    c->warmup = WARMUP_CALLS;
    int rv = run_clients(&lmdb_ops, c, out);
    tmp_dir_remove();
    return rv;
}
