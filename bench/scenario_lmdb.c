/* The storage baselines, one thread, no transport and no idemrpc code:
 *   f  raw LMDB, one mdb_put of the payload per durable write transaction
 *   v  the disk: pwrite of the payload at offset 0 of one file, then fdatasync */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

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

static int fsync_open(bench_thread *t)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/fdatasync", t->cell->dir);
    if ((t->conn.fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)) < 0) {
        return thread_fail(t, "open %s: %s", path, strerror(errno));
    }
    return 0;
}

static int fsync_call(bench_thread *t)
{
    size_t n = t->cell->payload_len;
    if (pwrite(t->conn.fd, t->cell->payload, n, 0) != (ssize_t)n) {
        return thread_fail(t, "pwrite: %s", strerror(errno));
    }
    return fdatasync(t->conn.fd) == 0 ? 0 : thread_fail(t, "fdatasync: %s", strerror(errno));
}

static void fsync_close(bench_thread *t)
{
    if (t->conn.fd >= 0) {
        close(t->conn.fd);
    }
}

static const client_ops fsync_ops = {.open = fsync_open, .call = fsync_call, .close = fsync_close};

int run_fsync(const scenario *sc, cell *c, cell_stats *out)
{
    (void)sc;
    if ((c->dir = tmp_dir_create()) == NULL) {
        return cell_fail(out, "mkdtemp under /tmp failed");
    }
    c->warmup = WARMUP_CALLS;
    int rv = run_clients(&fsync_ops, c, out);
    tmp_dir_remove();
    return rv;
}
