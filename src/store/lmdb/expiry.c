/* The expiry index (one entry per record and token, changed in the same txn) and the
 * sweep that deletes what it says is due, oldest first. */
#include <errno.h>
#include <string.h>

#include "lmdb_internal.h"

#define INDEX_KEY_LEN IDEM__LMDB_INDEX_KEY_LEN

/* rc-style: ENOMEM when hashing could not allocate. */
int idem__lmdb_index_key(uint8_t out[INDEX_KEY_LEN], uint64_t expires, const void *name, size_t len)
{
    uint8_t digest[32];
    idem__put_be64(out, expires);
    if (!idem__sha256((const void *const[]){name}, (const size_t[]){len}, 1, digest)) {
        return ENOMEM;
    }
    memcpy(out + 8, digest, INDEX_KEY_LEN - 8);
    return 0;
}

int idem__lmdb_index_put(lmdb_store *st, MDB_txn *txn, uint64_t expires, uint8_t type,
                         const void *name, size_t len)
{
    uint8_t kb[INDEX_KEY_LEN];
    int rc = idem__lmdb_index_key(kb, expires, name, len);
    MDB_val k = {INDEX_KEY_LEN, kb}, v = {len + 1, NULL};
    rc = rc != 0 ? rc : mdb_put(txn, st->expiry, &k, &v, MDB_RESERVE);
    if (rc == 0) {
        ((uint8_t *)v.mv_data)[0] = type;
        memcpy((uint8_t *)v.mv_data + 1, name, len);
    }
    return rc;
}

int idem__lmdb_index_del(lmdb_store *st, MDB_txn *txn, uint64_t expires, const void *name,
                         size_t len)
{
    uint8_t kb[INDEX_KEY_LEN];
    int rc = idem__lmdb_index_key(kb, expires, name, len);
    MDB_val k = {INDEX_KEY_LEN, kb};
    rc = rc != 0 ? rc : mdb_del(txn, st->expiry, &k, NULL);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/* Deletes what one expiry entry points at; the cursor stays on the entry. */
static int sweep_one(lmdb_store *st, MDB_txn *txn, const MDB_val *iv)
{
    const uint8_t *p = iv->mv_data;
    if (iv->mv_size < 2) {
        return 0; /* malformed entry: dropping it below is all we can do */
    }
    MDB_val k = {iv->mv_size - 1, (void *)(p + 1)};
    MDB_dbi dbi = p[0] == TYPE_TOKEN ? st->tokens : st->records;
    int rc = mdb_del(txn, dbi, &k, NULL);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

idem_code idem__lmdb_sweep(idem_store *base, uint64_t now_ms, size_t max, size_t *deleted)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val ik, iv;
    size_t n = 0;
    int rc;

    *deleted = 0;
    if ((rc = idem__lmdb_write_begin(st, &txn)) != 0) {
        return idem__lmdb_code(rc, "sweep begin");
    }
    if ((rc = mdb_cursor_open(txn, st->expiry, &cur)) != 0) {
        mdb_txn_abort(txn);
        return idem__lmdb_code(rc, "sweep cursor");
    }
    for (rc = mdb_cursor_get(cur, &ik, &iv, MDB_FIRST); rc == 0 && n < max;
         rc = mdb_cursor_get(cur, &ik, &iv, MDB_NEXT)) {
        uint64_t exp = 0;
        for (size_t i = 0; i < 8 && i < ik.mv_size; i++) {
            exp = exp << 8 | ((const uint8_t *)ik.mv_data)[i];
        }
        if (exp > now_ms) {
            break; /* the index is ordered by expiry: nothing further is due */
        }
        if ((rc = sweep_one(st, txn, &iv)) != 0 || (rc = mdb_cursor_del(cur, 0)) != 0) {
            break;
        }
        n++;
    }
    mdb_cursor_close(cur);
    if (rc != 0 && rc != MDB_NOTFOUND) {
        mdb_txn_abort(txn);
        return idem__lmdb_code(rc, "sweep");
    }
    idem_code code = idem__lmdb_commit(st, txn);
    if (code == IDEM_OK) {
        *deleted = n;
    }
    return code;
}
