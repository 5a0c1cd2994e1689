/* A bulk load of COMPLETED records in the store's own format (records.c's rec_hdr and
 * response, one expiry entry each), for the benchmark's scale stores: the records come
 * in ascending key order and ascending expiry, so both databases take them with
 * MDB_APPEND (no search), many per write txn. MDB_APPEND packs pages full; a store that
 * grew by random keys has its leaves about 2/3 full (a full page splits in halves), so
 * with src->every > 1 every every-th record is left out of the appends and put in a
 * second pass, splitting the packed pages it lands in as a live store's would be. Not a
 * path of the library: only idemrpc-bench calls it, on a store no server is using. */
#include <errno.h>
#include <string.h>

#include "lmdb_internal.h"

#define LOAD_TXN 100000 /* records per write txn */

typedef struct load_item {
    rec_key key;
    rec_hdr h;
} load_item;

static int load_item_at(const idem__lmdb_load_src *src, size_t i, load_item *it)
{
    idem_key_ref ref;
    it->h = (rec_hdr){.magic = REC_MAGIC,
                      .state = IDEM_REC_COMPLETED,
                      .owner = src->tmpl->owner,
                      .first_at_ms = src->tmpl->first_at_ms,
                      .lease_until_ms = src->tmpl->lease_until_ms};
    memcpy(it->h.fingerprint, src->tmpl->fingerprint, sizeof(it->h.fingerprint));
    src->key_at(src->arg, i, &ref, &it->h.expires_ms);
    return idem__lmdb_rec_key_make(&it->key, &ref) == IDEM_OK ? 0 : EINVAL;
}

/* Puts record i (flags: MDB_APPEND or 0); an LMDB error. */
static int load_record(lmdb_store *st, MDB_txn *txn, const idem__lmdb_load_src *src, size_t i,
                       unsigned flags)
{
    load_item it;
    int rc = load_item_at(src, i, &it);
    size_t len = src->tmpl->response_len;
    MDB_val k = {it.key.len, it.key.bytes}, v = {sizeof(it.h) + len, NULL};
    if (rc != 0 || (rc = mdb_put(txn, st->records, &k, &v, MDB_RESERVE | flags)) != 0) {
        return rc;
    }
    memcpy(v.mv_data, &it.h, sizeof(it.h));
    memcpy((uint8_t *)v.mv_data + sizeof(it.h), src->tmpl->response, len);
    return 0;
}

/* Appends record i's expiry entry (expiry.c's format); an LMDB error. */
static int load_index(lmdb_store *st, MDB_txn *txn, const idem__lmdb_load_src *src, size_t i)
{
    load_item it;
    uint8_t ik[IDEM__LMDB_INDEX_KEY_LEN];
    int rc = load_item_at(src, i, &it);
    if (rc != 0 || (rc = idem__lmdb_index_key(ik, it.h.expires_ms, it.key.bytes, it.key.len))) {
        return rc;
    }
    MDB_val k = {sizeof(ik), ik}, v = {it.key.len + 1, NULL};
    if ((rc = mdb_put(txn, st->expiry, &k, &v, MDB_RESERVE | MDB_APPEND)) == 0) {
        ((uint8_t *)v.mv_data)[0] = TYPE_RECORD;
        memcpy((uint8_t *)v.mv_data + 1, it.key.bytes, it.key.len);
    }
    return rc;
}

/* One pass: pass 0 appends the records kept for it, 1 puts the others, 2 appends the
 * index entries; LOAD_TXN records per txn. */
static idem_code load_pass(lmdb_store *st, const idem__lmdb_load_src *src, int pass)
{
    size_t every = src->every > 1 ? src->every : 0;
    for (size_t at = 0; at < src->n;) {
        MDB_txn *txn;
        int rc = idem__lmdb_write_begin(st, &txn);
        if (rc != 0) {
            return idem__lmdb_code(rc, "load begin");
        }
        size_t end = at + LOAD_TXN < src->n ? at + LOAD_TXN : src->n;
        for (; at < end && rc == 0; at++) {
            bool second = every > 0 && at % every == every - 1;
            rc = pass == 2              ? load_index(st, txn, src, at)
                 : pass == 0 && !second ? load_record(st, txn, src, at, MDB_APPEND)
                 : pass == 1 && second  ? load_record(st, txn, src, at, 0)
                                        : 0;
        }
        if (rc != 0) {
            mdb_txn_abort(txn);
            return rc == MDB_KEYEXIST
                       ? idem__err(IDEM_INVALID_ARGUMENT, "load: record %zu out of order", at - 1)
                       : idem__lmdb_code(rc, "load put");
        }
        idem_code code = idem__lmdb_commit(st, txn);
        if (code != IDEM_OK) {
            return code;
        }
    }
    return IDEM_OK;
}

idem_code idem__lmdb_load(idem_store *base, const idem__lmdb_load_src *src)
{
    lmdb_store *st = (lmdb_store *)base;
    if (base == NULL || base->ops != &idem__lmdb_ops || src->tmpl == NULL ||
        src->tmpl->state != IDEM_REC_COMPLETED) {
        return idem__err(IDEM_INVALID_ARGUMENT, "load: an LMDB store and a COMPLETED template");
    }
    idem_code code = IDEM_OK;
    for (int pass = 0; pass < 3 && code == IDEM_OK; pass++) {
        if (pass != 1 || src->every > 1) {
            code = load_pass(st, src, pass);
        }
    }
    return code;
}
