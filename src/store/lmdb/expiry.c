/* The expiry index: one entry per record, token and tombstone, changed in the same txn
 * (the sweep that reads it: sweep.c). */
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
