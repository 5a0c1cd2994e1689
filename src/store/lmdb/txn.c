/* Transactional handlers (txn.h): business databases, idem_txn_* and the handler-txn ops.
 * A handler txn holds the write gate (gate.c) of its thread while it is open. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmdb_internal.h"

/* Business databases ("app.<name>") of transactional handlers.
 *
 * LMDB forbids mdb_dbi_open in concurrent txns, and a handle opened in a txn that aborts
 * dies with it. So handles are opened only in write txns (which LMDB serialises), and
 * enter the store's cache only once such a txn has committed; readers use the cache. */
#define TXN_NEW_DBS 8 /* databases one handler txn may create before it commits */

struct idem_txn {
    idem_txn_head head; /* first: store.c dispatches through it */
    lmdb_store *st;
    MDB_txn *txn;
    app_db opened[TXN_NEW_DBS]; /* opened here: cached if this txn commits */
    size_t n_opened;
};

/* store.c checked the name's length (idem__app_check). */
static void app_db_name(const char *db, char name[APP_DB_NAME])
{
    snprintf(name, APP_DB_NAME, "app.%s", db);
}

static bool app_db_cached(lmdb_store *st, const char *name, MDB_dbi *dbi)
{
    bool found = false;
    pthread_mutex_lock(&st->db_mu);
    for (size_t i = 0; i < st->n_dbs && !found; i++) {
        if (strcmp(st->dbs[i].name, name) == 0) {
            *dbi = st->dbs[i].dbi;
            found = true;
        }
    }
    pthread_mutex_unlock(&st->db_mu);
    return found;
}

static void app_db_cache(lmdb_store *st, const app_db *db)
{
    MDB_dbi ignored;
    if (app_db_cached(st, db->name, &ignored)) {
        return;
    }
    pthread_mutex_lock(&st->db_mu);
    if (st->n_dbs < IDEM_ARRAY_LEN(st->dbs)) {
        st->dbs[st->n_dbs++] = *db;
    }
    pthread_mutex_unlock(&st->db_mu);
}

/* The handle of a business database inside a handler's write txn. */
static idem_code txn_dbi(idem_txn *t, const char *db, MDB_dbi *dbi)
{
    char name[APP_DB_NAME];
    app_db_name(db, name);
    if (app_db_cached(t->st, name, dbi)) {
        return IDEM_OK;
    }
    for (size_t i = 0; i < t->n_opened; i++) {
        if (strcmp(t->opened[i].name, name) == 0) {
            *dbi = t->opened[i].dbi;
            return IDEM_OK;
        }
    }
    if (t->n_opened == TXN_NEW_DBS) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "at most %d new databases per transaction",
                         TXN_NEW_DBS);
    }
    int rc = mdb_dbi_open(t->txn, name, MDB_CREATE, dbi);
    if (rc != 0) {
        return idem__lmdb_code(rc, "open database");
    }
    app_db *o = &t->opened[t->n_opened++];
    snprintf(o->name, sizeof(o->name), "%s", name);
    o->dbi = *dbi;
    return IDEM_OK;
}

typedef struct dbi_open_args {
    lmdb_store *st;
    app_db db;
} dbi_open_args;

static idem_code dbi_open_apply(MDB_txn *txn, void *arg)
{
    dbi_open_args *a = arg;
    int rc = mdb_dbi_open(txn, a->db.name, MDB_CREATE, &a->db.dbi);
    if (rc == MDB_DBS_FULL) { /* refused before any write: the batch goes on */
        return idem__err(IDEM_FAILED_PRECONDITION, "at most %d business databases per store",
                         IDEM_LMDB_MAX_DBS - IDEM_LMDB_OWN_DBS);
    }
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "open database");
}

/* A read-only store can only find existing databases: a read txn opens the handle
 * (LMDB keeps it once the txn commits); st->db_mu keeps other openers out meanwhile. */
static idem_code dbi_open_read_only(lmdb_store *st, app_db *db)
{
    MDB_txn *txn;
    pthread_mutex_lock(&st->db_mu);
    int rc = mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn);
    if (rc == 0 && (rc = mdb_dbi_open(txn, db->name, 0, &db->dbi)) != 0) {
        mdb_txn_abort(txn);
    } else if (rc == 0) {
        rc = mdb_txn_commit(txn);
    }
    pthread_mutex_unlock(&st->db_mu);
    return rc == MDB_NOTFOUND ? idem__err(IDEM_NOT_FOUND, "no such database")
           : rc != 0          ? idem__lmdb_code(rc, "open database")
                              : IDEM_OK;
}

/* The handle of a business database for a reader: created by a write of its own (or,
 * on a read-only store, found by a read). */
static idem_code store_dbi(lmdb_store *st, const char *db, MDB_dbi *dbi)
{
    dbi_open_args a = {.st = st};
    app_db_name(db, a.db.name);
    if (app_db_cached(st, a.db.name, dbi)) {
        return IDEM_OK;
    }
    idem_code code =
        st->read_only ? dbi_open_read_only(st, &a.db) : idem__lmdb_write(st, dbi_open_apply, &a);
    if (code != IDEM_OK) {
        return code;
    }
    app_db_cache(st, &a.db);
    *dbi = a.db.dbi;
    return IDEM_OK;
}

idem_code idem__lmdb_txn_begin(idem_store *base, uint64_t idle_ms, idem_txn **out)
{
    (void)idle_ms; /* one process's lock: it goes with the process */
    lmdb_store *st = (lmdb_store *)base;
    idem_code code = idem__lmdb_gate_check();
    if (code != IDEM_OK) {
        return code;
    }
    idem_txn *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    int rc = idem__lmdb_write_begin(st, &t->txn);
    if (rc != 0) {
        free(t);
        return idem__lmdb_code(rc, "handler txn begin");
    }
    t->head.ops = &idem__lmdb_ops;
    t->st = st;
    idem__lmdb_gate_set(t);
    *out = t;
    return IDEM_OK;
}

void idem__lmdb_txn_abort(idem_txn *t)
{
    idem__lmdb_gate_set(NULL);
    mdb_txn_abort(t->txn);
    free(t);
}

idem_code idem__lmdb_txn_commit(idem_txn *t)
{
    idem__lmdb_gate_set(NULL);
    idem_code code = idem__lmdb_commit(t->st, t->txn);
    for (size_t i = 0; code == IDEM_OK && i < t->n_opened; i++) {
        app_db_cache(t->st, &t->opened[i]);
    }
    free(t);
    return code;
}

idem_code idem__lmdb_txn_complete_commit(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                         const void *response, size_t len, uint64_t expires_ms,
                                         uint64_t now_ms)
{
    (void)now_ms; /* LMDB keeps the callers' absolute times */
    idem_code code = idem__lmdb_complete_in(t->st, t->txn, ref, owner, response, len, expires_ms);
    if (code != IDEM_OK) {
        idem__lmdb_txn_abort(t);
        return code;
    }
    return idem__lmdb_txn_commit(t);
}

idem_code idem__lmdb_txn_get(idem_txn *t, const char *db, const void *key, size_t klen,
                             const void **val, size_t *vlen)
{
    MDB_dbi dbi;
    MDB_val k = {klen, (void *)key}, v; /* store.c checked klen (idem__app_check) */
    idem_code code;
    if ((code = txn_dbi(t, db, &dbi)) != IDEM_OK) {
        return code;
    }
    int rc = mdb_get(t->txn, dbi, &k, &v);
    if (rc == MDB_NOTFOUND) {
        return idem__err(IDEM_NOT_FOUND, "no such key");
    } else if (rc != 0) {
        return idem__lmdb_code(rc, "get");
    }
    *val = v.mv_data;
    *vlen = v.mv_size;
    return IDEM_OK;
}

idem_code idem__lmdb_txn_put(idem_txn *t, const char *db, const void *key, size_t klen,
                             const void *val, size_t vlen)
{
    MDB_dbi dbi;
    MDB_val k = {klen, (void *)key}, v = {vlen, (void *)val};
    idem_code code;
    if ((code = txn_dbi(t, db, &dbi)) != IDEM_OK) {
        return code;
    }
    int rc = mdb_put(t->txn, dbi, &k, &v, 0);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "put");
}

idem_code idem__lmdb_txn_del(idem_txn *t, const char *db, const void *key, size_t klen)
{
    MDB_dbi dbi;
    MDB_val k = {klen, (void *)key};
    idem_code code;
    if ((code = txn_dbi(t, db, &dbi)) != IDEM_OK) {
        return code;
    }
    int rc = mdb_del(t->txn, dbi, &k, NULL);
    if (rc == MDB_NOTFOUND) {
        return idem__err(IDEM_NOT_FOUND, "no such key");
    }
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "del");
}

/* A read txn and the handle of business database db, for the reads outside a txn. */
static idem_code app_read_begin(lmdb_store *st, const char *db, MDB_dbi *dbi, MDB_txn **txn)
{
    idem_code code = store_dbi(st, db, dbi);
    if (code != IDEM_OK) {
        return code;
    }
    int rc = idem__lmdb_read_begin(st, txn);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "read begin");
}

idem_code idem__lmdb_app_get(idem_store *base, const char *db, const void *key, size_t klen,
                             void **val, size_t *vlen)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    MDB_dbi dbi;
    MDB_val k = {klen, (void *)key}, v;
    idem_code code = app_read_begin(st, db, &dbi, &txn);
    if (code != IDEM_OK) {
        return code;
    }
    int rc = mdb_get(txn, dbi, &k, &v);
    if (rc == MDB_NOTFOUND) {
        code = idem__err(IDEM_NOT_FOUND, "no such key");
    } else if (rc != 0) {
        code = idem__lmdb_code(rc, "get");
    } else if ((*val = malloc(v.mv_size ? v.mv_size : 1)) == NULL) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    } else {
        memcpy(*val, v.mv_data, v.mv_size);
        *vlen = v.mv_size;
    }
    idem__lmdb_read_end(st, txn);
    return code;
}

/* Copies a cursor's key and value out of its read txn. */
static idem_code copy_entry(const MDB_val *k, const MDB_val *v, idem_app_entry *out)
{
    out->key = malloc(k->mv_size ? k->mv_size : 1);
    out->val = malloc(v->mv_size ? v->mv_size : 1);
    if (out->key == NULL || out->val == NULL) {
        idem__app_entry_clear(out);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    memcpy(out->key, k->mv_data, k->mv_size);
    memcpy(out->val, v->mv_data, v->mv_size);
    out->klen = k->mv_size;
    out->vlen = v->mv_size;
    return IDEM_OK;
}

idem_code idem__lmdb_app_next(idem_store *base, const char *db, const void *after, size_t alen,
                              idem_app_entry *out)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_dbi dbi;
    MDB_val k = {alen, (void *)after}, v;
    idem_code code = app_read_begin(st, db, &dbi, &txn);
    if (code != IDEM_OK) {
        return code;
    }
    int rc = mdb_cursor_open(txn, dbi, &cur);
    if (rc == 0) {
        /* The first key >= after (LMDB has no empty keys); the next when it is after. */
        rc = mdb_cursor_get(cur, &k, &v, alen == 0 ? MDB_FIRST : MDB_SET_RANGE);
        if (rc == 0 && k.mv_size == alen && memcmp(k.mv_data, after, alen) == 0) {
            rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
        }
        mdb_cursor_close(cur);
    }
    code = rc == MDB_NOTFOUND ? idem__err(IDEM_NOT_FOUND, "no key after it")
           : rc != 0          ? idem__lmdb_code(rc, "cursor")
                              : copy_entry(&k, &v, out);
    idem__lmdb_read_end(st, txn);
    return code;
}

idem_code idem__lmdb_txn_record(idem_txn *t, const idem_key_ref *ref, idem_record *rec)
{
    return idem__lmdb_rec_read(t->st, t->txn, ref, rec, false);
}

idem_code idem__lmdb_txn_claim(idem_txn *t, const idem_claim_req *req, idem_claim_outcome *outcome,
                               idem_record *rec)
{
    return idem__lmdb_claim_in(t->st, t->txn, req, outcome, rec);
}
