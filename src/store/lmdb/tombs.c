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
#include <errno.h>
#include <string.h>

#include "lmdb_internal.h"

/* A tombstone's value (33 bytes, tombs.c from 0.4.0 on): fingerprint[0..16] ‖ code
 * (1 byte) ‖ be48 expired_at ‖ be40 (until - expired_at) ‖ be40 (expired_at - first_at),
 * the differences saturated (34 years). It has no expiry entry: the sweep finds it by a
 * bounded scan of "tombs" (idem__lmdb_tomb_scan). The first layout (44 bytes:
 * fingerprint ‖ be64 first_at ‖ be64 expired_at ‖ be64 until ‖ be32 code, with an
 * expiry entry 'T' at until) is still read, and swept through its entry. */
#define TOMB_LEN (IDEM_TOMBSTONE_FP_LEN + 1 + 6 + 5 + 5)
#define TOMB_LEN_INDEXED (IDEM_TOMBSTONE_FP_LEN + 3 * 8 + 4)
#define MAX40 ((UINT64_C(1) << 40) - 1)
#define SCAN_PER_DELETE 8     /* a scan reads up to this many tombstones per one it may delete */
#define KEEP_NAME "tomb_keep" /* meta: be64 the longest keep any server asked for */
#define KEEP_NAME_LEN 9

/* rc-style (ENOMEM): the tombstone's key, a hash of the effective key. */
static int tomb_key(uint8_t out[IDEM__LMDB_TOMB_KEY_LEN], const void *key, size_t len)
{
    uint8_t digest[32];
    if (!idem__sha256((const void *const[]){key}, (const size_t[]){len}, 1, digest)) {
        return ENOMEM;
    }
    memcpy(out, digest, IDEM__LMDB_TOMB_KEY_LEN);
    return 0;
}

static void put_be(uint8_t *p, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--, v >>= 8) {
        p[i] = (uint8_t)v;
    }
}

static uint64_t get_be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        v = v << 8 | p[i];
    }
    return v;
}

static void tomb_encode(uint8_t out[TOMB_LEN], const idem_tombstone *t)
{
    uint64_t kept = t->until_ms - t->expired_at_ms, ran = t->expired_at_ms - t->first_at_ms;
    memcpy(out, t->fingerprint, IDEM_TOMBSTONE_FP_LEN);
    out[16] = (uint8_t)t->code;
    put_be(out + 17, t->expired_at_ms, 6);
    put_be(out + 23, kept < MAX40 ? kept : MAX40, 5);
    put_be(out + 28, t->first_at_ms <= t->expired_at_ms && ran < MAX40 ? ran : MAX40, 5);
}

/* Either layout; *indexed: the first (it has an expiry entry at until). */
static idem_code tomb_decode(const MDB_val *v, idem_tombstone *t, bool *indexed)
{
    const uint8_t *p = v->mv_data;
    *indexed = v->mv_size == TOMB_LEN_INDEXED;
    if (v->mv_size != TOMB_LEN && !*indexed) {
        return idem__err(IDEM_DATA_LOSS, "tombstone has %zu bytes, not %d or %d", v->mv_size,
                         TOMB_LEN, TOMB_LEN_INDEXED);
    }
    memcpy(t->fingerprint, p, IDEM_TOMBSTONE_FP_LEN);
    if (*indexed) {
        t->first_at_ms = idem__get_be64(p + 16);
        t->expired_at_ms = idem__get_be64(p + 24);
        t->until_ms = idem__get_be64(p + 32);
        t->code = (idem_code)idem__get_be32(p + 40);
        return IDEM_OK;
    }
    t->code = (idem_code)p[16];
    t->expired_at_ms = get_be(p + 17, 6);
    t->until_ms = t->expired_at_ms + get_be(p + 23, 5);
    uint64_t ran = get_be(p + 28, 5);
    t->first_at_ms = ran <= t->expired_at_ms ? t->expired_at_ms - ran : 0;
    return IDEM_OK;
}

/* IDEM_NOT_FOUND when key has none (or the store is older than tombstones). */
static idem_code tomb_read(lmdb_store *st, MDB_txn *txn, const void *key, size_t len,
                           idem_tombstone *t)
{
    uint8_t kb[IDEM__LMDB_TOMB_KEY_LEN];
    bool indexed;
    if (!st->has_tombs) {
        return IDEM_NOT_FOUND;
    }
    int rc = tomb_key(kb, key, len);
    MDB_val k = {sizeof(kb), kb}, v;
    if (rc != 0 || (rc = mdb_get(txn, st->tombs, &k, &v)) != 0) {
        return rc == MDB_NOTFOUND ? IDEM_NOT_FOUND : idem__lmdb_code(rc, "tombstone get");
    }
    return tomb_decode(&v, t, &indexed);
}

/* The tombstone an expired COMPLETED record (v) stands for, kept for keep_ms. */
static void tomb_of_record(const MDB_val *v, uint64_t keep_ms, idem_tombstone *t)
{
    rec_hdr h;
    memcpy(&h, v->mv_data, sizeof(h));
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
        idem_code code = tomb_read(st, txn, key->bytes, key->len, &t);
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

int idem__lmdb_tomb_delete(lmdb_store *st, MDB_txn *txn, const rec_key *key, uint64_t until)
{
    uint8_t kb[IDEM__LMDB_TOMB_KEY_LEN];
    int rc = tomb_key(kb, key->bytes, key->len);
    MDB_val k = {sizeof(kb), kb};
    if (rc != 0 || (rc = mdb_del(txn, st->tombs, &k, NULL)) != 0) {
        return rc;
    }
    return idem__lmdb_index_del(st, txn, until, kb, sizeof(kb));
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
    uint8_t kb[IDEM__LMDB_TOMB_KEY_LEN], vb[TOMB_LEN];
    idem_tombstone t;
    if (!st->has_tombs || v->mv_size < sizeof(h)) {
        return 0;
    }
    memcpy(&h, v->mv_data, sizeof(h));
    uint64_t keep = h.magic == REC_MAGIC && h.state == IDEM_REC_COMPLETED ? keep_of(st, txn) : 0;
    if (keep == 0) {
        return 0;
    }
    tomb_of_record(v, keep, &t);
    tomb_encode(vb, &t);
    int rc = tomb_key(kb, key->mv_data, key->mv_size);
    MDB_val k = {sizeof(kb), kb}, tv = {sizeof(vb), vb};
    return rc != 0 ? rc : mdb_put(txn, st->tombs, &k, &tv, 0);
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
    code = tomb_read(st, txn, key.bytes, key.len, out);
    idem__lmdb_read_end(st, txn);
    return code;
}

static idem_code tomb_del_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    idem_tombstone t;
    idem_code code = tomb_read(w->st, txn, w->key.bytes, w->key.len, &t);
    if (code != IDEM_OK) {
        return code; /* refused before any write */
    }
    int rc = idem__lmdb_tomb_delete(w->st, txn, &w->key, t.until_ms);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "tombstone delete");
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

/* In one read txn, in hash order; a tombstone that does not decode is skipped. */
idem_code idem__lmdb_tomb_foreach(idem_store *base, idem_tombstone_visit_fn fn, void *arg)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val k, v;
    idem_tombstone t;
    bool indexed;
    if (!st->has_tombs) {
        return IDEM_OK;
    }
    int rc = idem__lmdb_read_begin(st, &txn);
    if (rc != 0) {
        return idem__lmdb_code(rc, "tombstone walk begin");
    }
    if ((rc = mdb_cursor_open(txn, st->tombs, &cur)) == 0) {
        for (MDB_cursor_op op = MDB_FIRST; (rc = mdb_cursor_get(cur, &k, &v, op)) == 0;
             op = MDB_NEXT) {
            if (k.mv_size == IDEM_TOMBSTONE_KEY_HASH_LEN &&
                tomb_decode(&v, &t, &indexed) == IDEM_OK && !fn(arg, NULL, k.mv_data, &t)) {
                rc = MDB_NOTFOUND;
                break;
            }
        }
        mdb_cursor_close(cur);
    }
    idem__lmdb_read_end(st, txn);
    return rc == MDB_NOTFOUND ? IDEM_OK : idem__lmdb_code(rc, "tombstone walk");
}

/* Deletes, from the scan's position on, tombstones of this layout whose until <= now_ms:
 * at most max of them, reading at most SCAN_PER_DELETE · max; at the end of "tombs" the
 * next scan starts again from the first. The first layout's are left to their expiry
 * entries. The position is the process's, changed under the write txn (deletions rolled
 * back with it are met again on the next pass). A pass over N tombstones takes about
 * N / (SCAN_PER_DELETE · batch) sweeps: a tombstone outlives its until by at most that,
 * and answers no claim past it (idem__tomb_decides). */
int idem__lmdb_tomb_scan(lmdb_store *st, MDB_txn *txn, uint64_t now_ms, size_t max, size_t *deleted)
{
    MDB_cursor *cur;
    MDB_val k = {sizeof(st->tomb_scan), st->tomb_scan}, v;
    idem_tombstone t;
    bool indexed;
    size_t read = 0;
    *deleted = 0;
    if (!st->has_tombs || max == 0) {
        return 0;
    }
    int rc = mdb_cursor_open(txn, st->tombs, &cur);
    if (rc != 0) {
        return rc;
    }
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
         rc == 0 && *deleted < max && read < SCAN_PER_DELETE * max;
         rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT), read++) {
        if (tomb_decode(&v, &t, &indexed) == IDEM_OK && !indexed && t.until_ms <= now_ms) {
            if ((rc = mdb_cursor_del(cur, 0)) != 0) {
                break;
            }
            ++*deleted; /* MDB_NEXT after a delete reads the entry after it (sweep.c too) */
        }
    }
    if (rc == 0 && k.mv_size == sizeof(st->tomb_scan)) {
        memcpy(st->tomb_scan, k.mv_data, sizeof(st->tomb_scan)); /* go on from there */
    } else if (rc == MDB_NOTFOUND) {
        memset(st->tomb_scan, 0, sizeof(st->tomb_scan)); /* the end: the next from the first */
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}
