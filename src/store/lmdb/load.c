/* A bulk load of COMPLETED records in the store's own format (records.c's rec_hdr and
 * response, one expiry entry each), for the benchmark's scale stores: the records come
 * in ascending key order and ascending expiry, so both databases take them with
 * MDB_APPEND (full pages, no search), many per write txn. Not a path of the library:
 * only idemrpc-bench calls it, on a store no server is using. */
#include <errno.h>
#include <string.h>

#include "lmdb_internal.h"

#define LOAD_TXN 100000 /* records per write txn */

/* Appends record i of src in txn; an LMDB error (MDB_KEYEXIST: out of order). */
static int load_one(lmdb_store *st, MDB_txn *txn, const idem__lmdb_load_src *src, size_t i)
{
    idem_key_ref ref;
    rec_key key;
    rec_hdr h = {.magic = REC_MAGIC, .state = IDEM_REC_COMPLETED};
    uint8_t ik[IDEM__LMDB_INDEX_KEY_LEN];
    src->key_at(src->arg, i, &ref, &h.expires_ms);
    if (idem__lmdb_rec_key_make(&key, &ref) != IDEM_OK) {
        return EINVAL;
    }
    h.owner = src->tmpl->owner;
    h.first_at_ms = src->tmpl->first_at_ms;
    h.lease_until_ms = src->tmpl->lease_until_ms;
    memcpy(h.fingerprint, src->tmpl->fingerprint, sizeof(h.fingerprint));
    size_t len = src->tmpl->response_len;
    MDB_val k = {key.len, key.bytes}, v = {sizeof(h) + len, NULL};
    int rc = mdb_put(txn, st->records, &k, &v, MDB_RESERVE | MDB_APPEND);
    if (rc != 0) {
        return rc;
    }
    memcpy(v.mv_data, &h, sizeof(h));
    memcpy((uint8_t *)v.mv_data + sizeof(h), src->tmpl->response, len);
    if ((rc = idem__lmdb_index_key(ik, h.expires_ms, key.bytes, key.len)) != 0) {
        return rc;
    }
    k = (MDB_val){sizeof(ik), ik};
    v = (MDB_val){key.len + 1, NULL};
    if ((rc = mdb_put(txn, st->expiry, &k, &v, MDB_RESERVE | MDB_APPEND)) == 0) {
        ((uint8_t *)v.mv_data)[0] = TYPE_RECORD;
        memcpy((uint8_t *)v.mv_data + 1, key.bytes, key.len);
    }
    return rc;
}

idem_code idem__lmdb_load(idem_store *base, const idem__lmdb_load_src *src)
{
    lmdb_store *st = (lmdb_store *)base;
    if (base == NULL || base->ops != &idem__lmdb_ops || src->tmpl == NULL ||
        src->tmpl->state != IDEM_REC_COMPLETED) {
        return idem__err(IDEM_INVALID_ARGUMENT, "load: an LMDB store and a COMPLETED template");
    }
    for (size_t at = 0; at < src->n;) {
        MDB_txn *txn;
        int rc = idem__lmdb_write_begin(st, &txn);
        if (rc != 0) {
            return idem__lmdb_code(rc, "load begin");
        }
        size_t end = at + LOAD_TXN < src->n ? at + LOAD_TXN : src->n;
        for (; at < end && rc == 0; at++) {
            rc = load_one(st, txn, src, at);
        }
        if (rc != 0) {
            mdb_txn_abort(txn);
            return rc == MDB_KEYEXIST
                       ? idem__err(IDEM_INVALID_ARGUMENT, "load: record %zu out of order", at - 1)
                       : idem__lmdb_code(rc, "load put");
        }
        idem_code code = idem__lmdb_commit(txn);
        if (code != IDEM_OK) {
            return code;
        }
    }
    return IDEM_OK;
}
