/* Tombstones: what a COMPLETED record leaves once its result expired, so that a late
 * duplicate within the tombstone horizon is told "done, result gone" instead of running
 * again (docs/semantics.md "Tombstones").
 *
 * Invariants:
 *   - a key has a record or a tombstone, never both: the sweep turns an expired COMPLETED
 *     record into its tombstone in one txn, and a claim that acquires the key deletes
 *     the tombstone in the claim's txn;
 *   - a tombstone answers a claim only within the claim's horizon (the method's) and
 *     before its own until (the store's keep when it was swept): the sweep keeps each for
 *     the longest horizon of the servers on the store, each method reads its own;
 *   - an expired COMPLETED record the sweep has not reached answers as its tombstone. */
#include <string.h>

#include "lmdb_internal.h"

#define KEEP_NAME "tomb_keep" /* meta: be64 the longest keep any server asked for */
#define KEEP_NAME_LEN 9

/* IDEM_NOT_FOUND when key has none (or the store is older than tombstones). */
static idem_code tomb_read(lmdb_store *st, MDB_txn *txn, const rec_key *key, idem_tombstone *t)
{
    uint8_t h[IDEM__LMDB_TOMB_KEY_LEN];
    int rc = idem__lmdb_tomb_hash(h, key->bytes, key->len);
    return rc != 0 ? idem__lmdb_code(rc, "tombstone key") : idem__lmdb_tomb_find(st, txn, h, t);
}

/* The tombstone an expired COMPLETED record (v) stands for, kept for keep_ms. */
static void tomb_of_record(const MDB_val *v, uint64_t keep_ms, idem_tombstone *t)
{
    rec_hdr h;
    memcpy(&h, v->mv_data, sizeof(h));
    memset(t, 0, sizeof(*t));
    memcpy(t->fingerprint, h.fingerprint, IDEM_TOMBSTONE_FP_LEN);
    t->first_at_ms = h.first_at_ms;
    t->expired_at_ms = h.expires_ms;
    t->until_ms = idem__add_sat(h.expires_ms, keep_ms);
    t->code = idem__response_code((const uint8_t *)v->mv_data + sizeof(h), v->mv_size - sizeof(h));
}

idem_code idem__lmdb_tomb_look(lmdb_store *st, MDB_txn *txn, const rec_key *key,
                               const MDB_val *expired, const idem_claim_req *req,
                               idem_claim_outcome *outcome, idem_record *rec, bool *decided,
                               uint64_t *stale_until)
{
    idem_tombstone t;
    *stale_until = 0;
    if (expired != NULL) {
        tomb_of_record(expired, UINT64_MAX, &t); /* not swept: the claim's horizon bounds it */
    } else {
        idem_code code = tomb_read(st, txn, key, &t);
        if (code != IDEM_OK) {
            return code == IDEM_NOT_FOUND ? IDEM_OK : code;
        }
        *stale_until = t.until_ms;
    }
    if (!idem__tomb_decides(&t, req, req->now_ms)) {
        return IDEM_OK; /* past the horizon: the key is free */
    }
    *stale_until = 0;
    *decided = true;
    idem__tomb_answer(&t, req, outcome, rec);
    return IDEM_OK;
}

int idem__lmdb_tomb_delete(lmdb_store *st, MDB_txn *txn, const rec_key *key)
{
    uint8_t h[IDEM__LMDB_TOMB_KEY_LEN];
    int rc = idem__lmdb_tomb_hash(h, key->bytes, key->len);
    return rc != 0 ? rc : idem__lmdb_tomb_remove(st, txn, h);
}

/* The keep "meta" holds (0: none). */
static uint64_t meta_keep(const lmdb_store *st, MDB_txn *txn)
{
    MDB_val k = {KEEP_NAME_LEN, KEEP_NAME}, v;
    if (!st->has_meta || mdb_get(txn, st->meta, &k, &v) != 0 || v.mv_size != 8) {
        return 0;
    }
    return idem__get_be64(v.mv_data);
}

/* The longest keep any server asked for: this process's, or one kept in "meta". */
static uint64_t keep_of(lmdb_store *st, MDB_txn *txn)
{
    uint64_t keep = atomic_load(&st->tomb_keep_ms), kept = meta_keep(st, txn);
    return kept > keep ? kept : keep;
}

int idem__lmdb_tomb_leave(lmdb_store *st, MDB_txn *txn, const MDB_val *key, const MDB_val *v)
{
    rec_hdr h;
    uint8_t kh[IDEM__LMDB_TOMB_KEY_LEN];
    idem_tombstone t;
    if (!st->has_tomb_buckets || v->mv_size < sizeof(h)) {
        return 0;
    }
    memcpy(&h, v->mv_data, sizeof(h));
    uint64_t keep = h.magic == REC_MAGIC && h.state == IDEM_REC_COMPLETED ? keep_of(st, txn) : 0;
    if (keep == 0) {
        return 0;
    }
    tomb_of_record(v, keep, &t);
    int rc = idem__lmdb_tomb_hash(kh, key->mv_data, key->mv_size);
    return rc != 0 ? rc : idem__lmdb_tomb_put(st, txn, kh, &t);
}

static idem_code keep_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    uint8_t b[8];
    if (meta_keep(w->st, txn) >= w->ms) {
        return IDEM_OK;
    }
    idem__put_be64(b, w->ms);
    MDB_val k = {KEEP_NAME_LEN, KEEP_NAME}, v = {sizeof(b), b};
    int rc = mdb_put(txn, w->st->meta, &k, &v, 0);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "tombstone keep");
}

/* The longest keep any server on the store asked for, in this process and in "meta"
 * (so that every process's sweep, idemctl's too, keeps tombstones that long). */
idem_code idem__lmdb_tomb_keep(idem_store *base, uint64_t keep_ms)
{
    lmdb_store *st = (lmdb_store *)base;
    uint64_t cur = atomic_load(&st->tomb_keep_ms);
    while (keep_ms > cur && !atomic_compare_exchange_weak(&st->tomb_keep_ms, &cur, keep_ms)) {
    }
    if (keep_ms == 0 || !st->has_meta || st->read_only) {
        return IDEM_OK;
    }
    write_args w = {.st = st, .ms = keep_ms};
    return idem__lmdb_write(st, keep_apply, &w);
}

idem_code idem__lmdb_tomb_get(idem_store *base, const idem_key_ref *ref, idem_tombstone *out)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    rec_key key;
    idem_code code = idem__lmdb_rec_key_make(&key, ref);
    if (code != IDEM_OK) {
        return code;
    }
    int rc = idem__lmdb_read_begin(st, &txn);
    if (rc != 0) {
        return idem__lmdb_code(rc, "tombstone begin");
    }
    code = tomb_read(st, txn, &key, out);
    idem__lmdb_read_end(st, txn);
    return code;
}

static idem_code tomb_del_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    int rc = idem__lmdb_tomb_delete(w->st, txn, &w->key);
    return rc == 0              ? IDEM_OK
           : rc == MDB_NOTFOUND ? idem__err(IDEM_NOT_FOUND, "no tombstone") /* no write */
                                : idem__lmdb_code(rc, "tombstone delete");
}

idem_code idem__lmdb_tomb_del(idem_store *base, const idem_key_ref *ref)
{
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st};
    idem_code code = idem__lmdb_rec_key_make(&w.key, ref);
    if (code != IDEM_OK) {
        return code;
    }
    if (st->read_only) {
        return idem__err(IDEM_FAILED_PRECONDITION, "store opened read-only");
    }
    return idem__lmdb_write(st, tomb_del_apply, &w);
}

/* In one read txn: the earlier layouts' ("tombs"), then the present one's, each in hash
 * order; a tombstone that does not decode is skipped. */
idem_code idem__lmdb_tomb_foreach(idem_store *base, idem_tombstone_visit_fn fn, void *arg)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    int rc = idem__lmdb_read_begin(st, &txn);
    if (rc != 0) {
        return idem__lmdb_code(rc, "tombstone walk begin");
    }
    rc = idem__lmdb_tomb_walk(st, txn, fn, arg);
    idem__lmdb_read_end(st, txn);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "tombstone walk");
}
