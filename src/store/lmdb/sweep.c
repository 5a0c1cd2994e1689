/* The sweep: deletes what the expiry index says is due, oldest first, in bounded
 * batches; an expired COMPLETED record leaves its tombstone (tombs.c), and the rest of a
 * batch goes to the bounded scan that deletes tombstones past their until. */
#include <string.h>

#include "lmdb_internal.h"

/* Deletes what one expiry entry points at; the cursor stays on the entry. */
static int sweep_one(lmdb_store *st, MDB_txn *txn, const MDB_val *iv)
{
    const uint8_t *p = iv->mv_data;
    if (iv->mv_size < 2) {
        return 0; /* malformed entry: dropping it below is all we can do */
    }
    rec_key name; /* a copy: the tombstone's writes below may move the entry's bytes */
    MDB_val k = {iv->mv_size - 1, name.bytes}, v;
    MDB_dbi dbi = p[0] == TYPE_TOKEN ? st->tokens : p[0] == TYPE_TOMB ? st->tombs : st->records;
    int rc = 0;
    if ((p[0] == TYPE_TOMB && !st->has_tombs) || k.mv_size > sizeof(name.bytes)) {
        return 0; /* (an entry longer than any key is malformed: dropped below) */
    }
    memcpy(name.bytes, p + 1, k.mv_size);
    if (p[0] == TYPE_RECORD && (rc = mdb_get(txn, dbi, &k, &v)) == 0) {
        rc = idem__lmdb_tomb_leave(st, txn, &k, &v); /* before the delete: v is the map's */
    }
    rc = rc != 0 ? rc : mdb_del(txn, dbi, &k, NULL);
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
    size_t tombs = 0;
    if ((rc == 0 || rc == MDB_NOTFOUND) && n < max) {
        rc = idem__lmdb_tomb_scan(st, txn, now_ms, max - n, &tombs);
        n += tombs;
    }
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
