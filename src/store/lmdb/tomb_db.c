/* Where an LMDB tombstone lives and how it is laid out (tombs.c decides what they mean).
 *
 * The present layout, "tomb_buckets" (MDB_DUPSORT | MDB_DUPFIXED): 16 buckets, keyed by
 * the first 4 bits of the tombstone's 16-byte key hash (one byte), each dup a 38-byte
 * item: the hash ‖ fingerprint[0..8] ‖ be48 (code << 43 | expired_at, ms until the year
 * 2248) ‖ be32 (until - expired_at) ‖ be32 (expired_at - first_at), each difference in
 * ms below 24.8 days, else in seconds (rounded up; the top bit set; at most 68 years).
 * A bucket's dups are sorted by the hash, so a lookup is exact (MDB_GET_BOTH_RANGE), and
 * a bucket of more than ~50 is a sub-database whose leaves hold bare items: no node
 * header, no per-item pointer. 8 bytes of fingerprint: another request under the same
 * key is taken for the first with probability 2^-64. docs/performance.md "Tombstones on
 * LMDB" has the numbers of this layout and of those it replaced.
 *
 * The earlier layouts, in "tombs" (key: the 16-byte hash), are read, deleted and swept
 * until none is left, and never written: 33 bytes (fingerprint[0..16] ‖ code ‖ be48
 * expired_at ‖ be40 kept ‖ be40 ran, no expiry entry: swept by the scan) and the first,
 * 44 bytes (fingerprint[0..16] ‖ be64 first_at ‖ be64 expired_at ‖ be64 until ‖ be32
 * code, with an expiry entry 'T' at until: swept through it). A key has at most one
 * tombstone in the two databases together. */
#include <errno.h>
#include <string.h>

#include "lmdb_internal.h"

#define HASH_LEN IDEM__LMDB_TOMB_KEY_LEN
#define BUCKETS 16
#define BUCKET_OF(h) ((uint8_t)((h)[0] >> 4)) /* the first 4 bits: 0 .. BUCKETS - 1 */
#define FP_KEPT 8
#define ITEM_LEN (HASH_LEN + FP_KEPT + 6 + 4 + 4)
#define OLD_LEN (IDEM_TOMBSTONE_FP_LEN + 1 + 6 + 5 + 5)
#define FIRST_LEN (IDEM_TOMBSTONE_FP_LEN + 3 * 8 + 4)
#define MAX43 ((UINT64_C(1) << 43) - 1) /* expired_at, beside the code */
#define SECONDS (UINT32_C(1) << 31)     /* a span in seconds */
#define SCAN_PER_DELETE 8 /* a scan reads up to this many tombstones per one it may delete */

int idem__lmdb_tomb_hash(uint8_t out[HASH_LEN], const void *key, size_t len)
{
    uint8_t digest[32];
    if (!idem__sha256((const void *const[]){key}, (const size_t[]){len}, 1, digest)) {
        return ENOMEM;
    }
    memcpy(out, digest, HASH_LEN);
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

/* 6b9f435's three times after the fingerprint and code: be48 expired_at ‖ be40 kept ‖
 * be40 ran. */
static void times_decode(const uint8_t *p, idem_tombstone *t)
{
    t->expired_at_ms = get_be(p, 6);
    t->until_ms = t->expired_at_ms + get_be(p + 6, 5);
    uint64_t ran = get_be(p + 11, 5);
    t->first_at_ms = ran <= t->expired_at_ms ? t->expired_at_ms - ran : 0;
}

/* A duration in 4 bytes: ms below 2^31 (24.8 days), else whole seconds, rounded up and
 * saturated at 68 years, with the top bit set. */
static uint32_t span_encode(uint64_t ms)
{
    if (ms < SECONDS) {
        return (uint32_t)ms;
    }
    uint64_t s = ms / 1000 + (ms % 1000 != 0);
    return SECONDS | (uint32_t)(s < SECONDS ? s : SECONDS - 1);
}

static uint64_t span_decode(uint32_t v)
{
    return v & SECONDS ? (uint64_t)(v & ~SECONDS) * 1000 : v;
}

static void item_encode(uint8_t out[ITEM_LEN], const uint8_t h[HASH_LEN], const idem_tombstone *t)
{
    uint64_t code = (unsigned)t->code < 32 ? (uint64_t)t->code : IDEM_UNKNOWN;
    uint64_t ran = t->first_at_ms <= t->expired_at_ms ? t->expired_at_ms - t->first_at_ms : 0;
    memcpy(out, h, HASH_LEN);
    memcpy(out + HASH_LEN, t->fingerprint, FP_KEPT);
    put_be(out + HASH_LEN + FP_KEPT,
           code << 43 | (t->expired_at_ms < MAX43 ? t->expired_at_ms : MAX43), 6);
    put_be(out + HASH_LEN + FP_KEPT + 6, span_encode(t->until_ms - t->expired_at_ms), 4);
    put_be(out + HASH_LEN + FP_KEPT + 10, span_encode(ran), 4);
}

/* A bucket's item v into *t (its key hash: the item's first HASH_LEN bytes). */
static idem_code item_decode(const MDB_val *v, idem_tombstone *t)
{
    const uint8_t *p = (const uint8_t *)v->mv_data + HASH_LEN;
    if (v->mv_size != ITEM_LEN) {
        return idem__err(IDEM_DATA_LOSS, "tombstone item has %zu bytes, not %d", v->mv_size,
                         ITEM_LEN);
    }
    memset(t, 0, sizeof(*t));
    memcpy(t->fingerprint, p, FP_KEPT);
    t->fingerprint_len = FP_KEPT;
    uint64_t done = get_be(p + FP_KEPT, 6),
             ran = span_decode((uint32_t)get_be(p + FP_KEPT + 10, 4));
    t->code = (idem_code)(done >> 43);
    t->expired_at_ms = done & MAX43;
    t->until_ms = t->expired_at_ms + span_decode((uint32_t)get_be(p + FP_KEPT + 6, 4));
    t->first_at_ms = ran <= t->expired_at_ms ? t->expired_at_ms - ran : 0;
    return IDEM_OK;
}

/* A "tombs" value, either earlier layout; *indexed: the first (an expiry entry at until). */
static idem_code old_decode(const MDB_val *v, idem_tombstone *t, bool *indexed)
{
    const uint8_t *p = v->mv_data;
    *indexed = v->mv_size == FIRST_LEN;
    if (v->mv_size != OLD_LEN && !*indexed) {
        return idem__err(IDEM_DATA_LOSS, "tombstone has %zu bytes, not %d or %d", v->mv_size,
                         OLD_LEN, FIRST_LEN);
    }
    memset(t, 0, sizeof(*t));
    memcpy(t->fingerprint, p, IDEM_TOMBSTONE_FP_LEN);
    t->fingerprint_len = IDEM_TOMBSTONE_FP_LEN;
    if (*indexed) {
        t->first_at_ms = idem__get_be64(p + 16);
        t->expired_at_ms = idem__get_be64(p + 24);
        t->until_ms = idem__get_be64(p + 32);
        t->code = (idem_code)idem__get_be32(p + 40);
        return IDEM_OK;
    }
    t->code = (idem_code)p[16];
    times_decode(p + 17, t);
    return IDEM_OK;
}

/* Puts cur on h's item in "tomb_buckets": 0, MDB_NOTFOUND, or an LMDB error. */
static int item_seek(MDB_cursor *cur, const uint8_t h[HASH_LEN], MDB_val *v)
{
    uint8_t probe[ITEM_LEN] = {0}, bucket = BUCKET_OF(h); /* h, then the least item of h */
    memcpy(probe, h, HASH_LEN);
    MDB_val k = {1, &bucket};
    *v = (MDB_val){sizeof(probe), probe};
    int rc = mdb_cursor_get(cur, &k, v, MDB_GET_BOTH_RANGE);
    if (rc == 0 && (v->mv_size != ITEM_LEN || memcmp(v->mv_data, h, HASH_LEN) != 0)) {
        rc = MDB_NOTFOUND;
    }
    return rc;
}

/* Whether "tomb_buckets" holds none (tombstones off): every claim of a new key looks,
 * and a look at an empty database needs no cursor to allocate. */
static bool buckets_empty(lmdb_store *st, MDB_txn *txn)
{
    MDB_stat s;
    return !st->has_tomb_buckets || (mdb_stat(txn, st->tomb_buckets, &s) == 0 && s.ms_entries == 0);
}

/* h's tombstone in either database into *t (NULL: only whether there is one), and
 * deleted when del, even one that does not decode (MDB_CORRUPTED without del).
 * rc-style: MDB_NOTFOUND when there is none. */
static int tomb_at(lmdb_store *st, MDB_txn *txn, const uint8_t h[HASH_LEN], idem_tombstone *t,
                   bool del)
{
    MDB_cursor *cur;
    MDB_val k = {HASH_LEN, (void *)h}, v;
    idem_tombstone tmp;
    bool ok, indexed = false;
    int rc = buckets_empty(st, txn) ? MDB_NOTFOUND : mdb_cursor_open(txn, st->tomb_buckets, &cur);
    t = t != NULL ? t : &tmp;
    if (rc == 0) {
        if ((rc = item_seek(cur, h, &v)) == 0) {
            ok = item_decode(&v, t) == IDEM_OK;
            rc = del ? mdb_cursor_del(cur, 0) : ok ? 0 : MDB_CORRUPTED;
        }
        mdb_cursor_close(cur);
    }
    if (rc != MDB_NOTFOUND) {
        return rc;
    }
    if (!st->has_tombs || (rc = mdb_get(txn, st->tombs, &k, &v)) != 0) {
        return st->has_tombs ? rc : MDB_NOTFOUND;
    }
    ok = old_decode(&v, t, &indexed) == IDEM_OK;
    if (!del) {
        return ok ? 0 : MDB_CORRUPTED;
    }
    if ((rc = mdb_del(txn, st->tombs, &k, NULL)) == 0 && ok && indexed) {
        rc = idem__lmdb_index_del(st, txn, t->until_ms, h, HASH_LEN);
    }
    return rc;
}

idem_code idem__lmdb_tomb_find(lmdb_store *st, MDB_txn *txn, const uint8_t h[HASH_LEN],
                               idem_tombstone *t)
{
    int rc = tomb_at(st, txn, h, t, false);
    return rc == 0               ? IDEM_OK
           : rc == MDB_NOTFOUND  ? IDEM_NOT_FOUND
           : rc == MDB_CORRUPTED ? idem__err(IDEM_DATA_LOSS, "a tombstone does not decode")
                                 : idem__lmdb_code(rc, "tombstone get");
}

int idem__lmdb_tomb_remove(lmdb_store *st, MDB_txn *txn, const uint8_t h[HASH_LEN])
{
    return tomb_at(st, txn, h, NULL, true);
}

/* MDB_APPENDDUP when item sorts after every item of its bucket (the key at cur: LMDB then
 * starts a new page instead of splitting the last in half, so that a sweep in key order
 * fills the pages), else 0. */
static unsigned put_flags(MDB_cursor *cur, MDB_val *k, const uint8_t item[ITEM_LEN])
{
    MDB_val v;
    if (mdb_cursor_get(cur, k, &v, MDB_SET_KEY) != 0 ||
        mdb_cursor_get(cur, k, &v, MDB_LAST_DUP) != 0) {
        return 0;
    }
    return v.mv_size == ITEM_LEN && memcmp(v.mv_data, item, ITEM_LEN) < 0 ? MDB_APPENDDUP : 0;
}

int idem__lmdb_tomb_put(lmdb_store *st, MDB_txn *txn, const uint8_t h[HASH_LEN],
                        const idem_tombstone *t)
{
    MDB_cursor *cur;
    uint8_t item[ITEM_LEN], bucket = BUCKET_OF(h);
    int rc = idem__lmdb_tomb_remove(st, txn, h); /* a key has one tombstone */
    if ((rc != 0 && rc != MDB_NOTFOUND) ||
        (rc = mdb_cursor_open(txn, st->tomb_buckets, &cur)) != 0) {
        return rc;
    }
    item_encode(item, h, t);
    MDB_val k = {1, &bucket}, v = {sizeof(item), item};
    unsigned flags = put_flags(cur, &k, item);
    k = (MDB_val){1, &bucket};
    rc = mdb_cursor_put(cur, &k, &v, flags);
    mdb_cursor_close(cur);
    return rc;
}

/* Visits "tombs", then "tomb_buckets" (what does not decode is skipped). rc-style. */
int idem__lmdb_tomb_walk(lmdb_store *st, MDB_txn *txn, idem_tombstone_visit_fn fn, void *arg)
{
    MDB_dbi dbs[2] = {st->tombs, st->tomb_buckets};
    bool has[2] = {st->has_tombs, st->has_tomb_buckets}, indexed;
    idem_tombstone t;
    int rc = 0;
    for (int d = 0; d < 2 && (rc == 0 || rc == MDB_NOTFOUND); d++) {
        MDB_cursor *cur;
        MDB_val k, v;
        if (!has[d] || (rc = mdb_cursor_open(txn, dbs[d], &cur)) != 0) {
            continue;
        }
        for (MDB_cursor_op op = MDB_FIRST; (rc = mdb_cursor_get(cur, &k, &v, op)) == 0;
             op = MDB_NEXT) {
            bool ok = d == 0 ? k.mv_size == HASH_LEN && old_decode(&v, &t, &indexed) == IDEM_OK
                             : item_decode(&v, &t) == IDEM_OK;
            if (ok && !fn(arg, NULL, d == 0 ? k.mv_data : v.mv_data, &t)) {
                mdb_cursor_close(cur);
                return 0;
            }
        }
        mdb_cursor_close(cur);
    }
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/* Puts cur where a scan of database d goes on: at pos or the first entry after it. */
static int scan_start(MDB_cursor *cur, int d, const uint8_t pos[HASH_LEN], MDB_val *k, MDB_val *v)
{
    uint8_t probe[ITEM_LEN] = {0}, bucket = BUCKET_OF(pos);
    if (d == 0) {
        *k = (MDB_val){HASH_LEN, (void *)pos};
        return mdb_cursor_get(cur, k, v, MDB_SET_RANGE);
    }
    memcpy(probe, pos, HASH_LEN);
    *k = (MDB_val){1, &bucket}, *v = (MDB_val){sizeof(probe), probe};
    int rc = mdb_cursor_get(cur, k, v, MDB_GET_BOTH_RANGE);
    if (rc != MDB_NOTFOUND || bucket == BUCKETS - 1) {
        return rc;
    }
    bucket++; /* the bucket holds none at or after pos: the next one */
    *k = (MDB_val){1, &bucket};
    return mdb_cursor_get(cur, k, v, MDB_SET_RANGE);
}

/* One database's part of idem__lmdb_tomb_scan (d 0: "tombs", 1: "tomb_buckets"), from
 * pos on, reading until *read reaches limit. */
static int scan_db(lmdb_store *st, MDB_txn *txn, int d, uint8_t pos[HASH_LEN], uint64_t now_ms,
                   size_t max, size_t limit, size_t *read, size_t *deleted)
{
    MDB_cursor *cur;
    MDB_val k, v;
    idem_tombstone t;
    bool indexed = false;
    int rc = mdb_cursor_open(txn, d == 0 ? st->tombs : st->tomb_buckets, &cur);
    if (rc != 0) {
        return rc;
    }
    for (rc = scan_start(cur, d, pos, &k, &v); rc == 0 && *deleted < max && *read < limit;
         rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT), ++*read) {
        idem_code code = d == 0 ? old_decode(&v, &t, &indexed) : item_decode(&v, &t);
        if (code == IDEM_OK && !indexed && t.until_ms <= now_ms) {
            if ((rc = mdb_cursor_del(cur, 0)) != 0) {
                break;
            }
            ++*deleted; /* MDB_NEXT after a delete reads the entry after it (sweep.c too) */
        }
    }
    if (rc == 0 && d == 0 && k.mv_size == HASH_LEN) {
        memcpy(pos, k.mv_data, HASH_LEN); /* go on from there */
    } else if (rc == 0 && d == 1 && v.mv_size == ITEM_LEN) {
        memcpy(pos, v.mv_data, HASH_LEN);
    } else if (rc == MDB_NOTFOUND) {
        memset(pos, 0, HASH_LEN); /* the end: the next scan from the first */
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/* Where the scan of database d goes on, kept in "meta" by the sweep's write txn (so that
 * a process that opens the store, after a restart or as idemctl purge, goes on where
 * the last one stopped; a rolled-back sweep leaves it as it was): a key hash, zero at
 * first. */
static const char *const scan_name[2] = {"tomb_scan", "bucket_scan"};

static void scan_pos_get(lmdb_store *st, MDB_txn *txn, int d, uint8_t pos[HASH_LEN])
{
    MDB_val k = {strlen(scan_name[d]), (void *)scan_name[d]}, v;
    memset(pos, 0, HASH_LEN);
    if (st->has_meta && mdb_get(txn, st->meta, &k, &v) == 0 && v.mv_size == HASH_LEN) {
        memcpy(pos, v.mv_data, HASH_LEN);
    }
}

/* scan_db from the kept position of d, keeping where it stopped when that moved. */
static int scan_kept(lmdb_store *st, MDB_txn *txn, int d, uint64_t now_ms, size_t max, size_t limit,
                     size_t *read, size_t *deleted)
{
    uint8_t was[HASH_LEN], pos[HASH_LEN];
    scan_pos_get(st, txn, d, was);
    memcpy(pos, was, HASH_LEN);
    int rc = scan_db(st, txn, d, pos, now_ms, max, limit, read, deleted);
    if (rc == 0 && st->has_meta && memcmp(pos, was, HASH_LEN) != 0) {
        MDB_val k = {strlen(scan_name[d]), (void *)scan_name[d]}, v = {HASH_LEN, pos};
        rc = mdb_put(txn, st->meta, &k, &v, 0);
    }
    return rc;
}

/* Deletes, from each database's scan position on, tombstones whose until <= now_ms: at
 * most max of them, reading at most SCAN_PER_DELETE · max, half of that at most in
 * "tombs" (the earlier layouts, drained as they come due) and the rest in
 * "tomb_buckets"; at a database's end its next scan starts from its first. The first
 * layout's are left to their expiry entries. The positions are kept in "meta" by the
 * write txn (scan_kept: deletions rolled back with it are met again on the next pass). A
 * pass over N tombstones takes about N / (SCAN_PER_DELETE · batch / 2) sweeps at worst:
 * a tombstone outlives its until by at most that, and answers no claim past it
 * (idem__tomb_decides). */
int idem__lmdb_tomb_scan(lmdb_store *st, MDB_txn *txn, uint64_t now_ms, size_t max, size_t *deleted)
{
    size_t read = 0, limit = SCAN_PER_DELETE * max;
    int rc = 0;
    *deleted = 0;
    if (max > 0 && st->has_tombs) {
        rc = scan_kept(st, txn, 0, now_ms, max, limit / 2, &read, deleted);
    }
    if (rc == 0 && max > 0 && st->has_tomb_buckets) {
        rc = scan_kept(st, txn, 1, now_ms, max, limit, &read, deleted);
    }
    return rc;
}
