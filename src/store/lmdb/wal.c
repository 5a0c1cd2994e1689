/* The write-ahead log: a batch's notes, its entry, the log's thread, the epochs (wal.h
 * says what the log is and why it keeps the promise).
 *
 * Invariants: only the writer thread fills an entry, and only while the log's thread is
 * idle; the log's thread writes one entry at a time, at increasing offsets of one epoch,
 * and the writer thread waits for each before the next batch (idem__wal_batch_end), so a
 * torn entry is the last of its epoch; a new epoch starts only once LMDB's sync has put
 * every logged batch in data.mdb. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "supplemental.h"
#include "wal_priv.h"

_Thread_local idem_wal *idem__wal_cur;

uint32_t idem__wal_crc32(const uint8_t *p, size_t n)
{
    uLong c = crc32(0L, Z_NULL, 0);
    while (n > 0) { /* zlib takes a uInt length */
        uInt part = n > (1u << 30) ? (1u << 30) : (uInt)n;
        c = crc32(c, p, part);
        p += part;
        n -= part;
    }
    return (uint32_t)c;
}

/* Grows *p (of *cap bytes) to hold need; false when out of memory. */
static bool grow(void *p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) {
        return true;
    }
    size_t n = *cap ? *cap : 64;
    while (n < need) {
        n *= 2;
    }
    void *q = realloc(*(void **)p, n * elem);
    if (q == NULL) {
        return false;
    }
    *(void **)p = q;
    *cap = n;
    return true;
}

void idem__wal_unloggable(void)
{
    if (idem__wal_cur != NULL) {
        idem__wal_cur->unloggable = true;
    }
}

static uint32_t note_hash(uint8_t db, const uint8_t *k, size_t n)
{
    uint32_t h = 2166136261u ^ db;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ k[i]) * 16777619u;
    }
    return h;
}

void idem__wal_note(MDB_dbi dbi, const MDB_val *key)
{
    idem_wal *w = idem__wal_cur;
    uint8_t db = 0;
    while (db < WAL_DBS && w->dbis[db] != dbi) {
        db++;
    }
    if (db == WAL_DBS || key->mv_size > UINT16_MAX) {
        w->unloggable = true;
        return;
    }
    uint32_t h = note_hash(db, key->mv_data, key->mv_size) & (NOTE_SLOTS - 1);
    for (uint32_t i = 0; i < NOTE_SLOTS && w->slots[h] != 0; i++, h = (h + 1) & (NOTE_SLOTS - 1)) {
        const wal_note *n = &w->notes[w->slots[h] - 1];
        if (n->db == db && n->klen == key->mv_size &&
            memcmp(w->keys + n->koff, key->mv_data, n->klen) == 0) {
            return; /* noted already: its final state is encoded once */
        }
    }
    if (!grow(&w->notes, &w->cap_notes, w->n_notes + 1, sizeof(wal_note)) ||
        !grow(&w->keys, &w->keys_cap, w->keys_len + key->mv_size, 1)) {
        w->unloggable = true;
        return;
    }
    memcpy(w->keys + w->keys_len, key->mv_data, key->mv_size);
    w->notes[w->n_notes] = (wal_note){db, (uint16_t)key->mv_size, w->keys_len};
    w->keys_len += key->mv_size;
    if (w->slots[h] == 0 && w->n_notes + 1 < NOTE_SLOTS / 2) { /* else noted twice: harmless */
        w->slots[h] = (uint32_t)(w->n_notes + 1);
    }
    w->n_notes++;
}

void idem__wal_note_cursor(MDB_cursor *cur)
{
    MDB_val k, v;
    if (mdb_cursor_get(cur, &k, &v, MDB_GET_CURRENT) != 0) {
        idem__wal_unloggable();
        return;
    }
    idem__wal_note(mdb_cursor_dbi(cur), &k);
}

void idem__wal_batch_begin(idem_wal *wal)
{
    wal->n_notes = wal->keys_len = 0;
    wal->unloggable = false;
    memset(wal->slots, 0, sizeof(wal->slots));
    idem__wal_cur = wal;
}

/* Appends one record to the entry: op ‖ db ‖ be16 klen ‖ be32 vlen ‖ key ‖ value. */
static bool emit(idem_wal *w, uint8_t op, uint8_t db, const MDB_val *k, const MDB_val *v)
{
    size_t vlen = v != NULL ? v->mv_size : 0;
    if (vlen > UINT32_MAX || !grow(&w->buf, &w->cap, w->len + 8 + k->mv_size + vlen, 1)) {
        return false;
    }
    uint8_t *p = w->buf + w->len;
    p[0] = op;
    p[1] = db;
    p[2] = (uint8_t)(k->mv_size >> 8);
    p[3] = (uint8_t)k->mv_size;
    idem__put_be32(p + 4, (uint32_t)vlen);
    memcpy(p + 8, k->mv_data, k->mv_size);
    if (vlen > 0) {
        memcpy(p + 8 + k->mv_size, v->mv_data, vlen);
    }
    w->len += 8 + k->mv_size + vlen;
    return true;
}

/* The final state of one noted key in txn: every duplicate of a MDB_DUPSORT key after
 * a delete of the key, else its value or its delete. An LMDB rc, ENOMEM. */
static int encode_note(idem_wal *w, MDB_txn *txn, const wal_note *n)
{
    MDB_dbi dbi = w->dbis[n->db];
    MDB_val k = {n->klen, w->keys + n->koff}, v;
    unsigned flags = 0;
    int rc = mdb_dbi_flags(txn, dbi, &flags);
    if (rc != 0) {
        return rc;
    }
    if (!(flags & MDB_DUPSORT)) {
        rc = mdb_get(txn, dbi, &k, &v);
        if (rc != 0 && rc != MDB_NOTFOUND) {
            return rc;
        }
        return emit(w, rc == 0 ? REC_PUT : REC_DEL, n->db, &k, rc == 0 ? &v : NULL) ? 0 : ENOMEM;
    }
    MDB_cursor *cur;
    if (!emit(w, REC_DEL, n->db, &k, NULL)) {
        return ENOMEM;
    }
    if ((rc = mdb_cursor_open(txn, dbi, &cur)) != 0) {
        return rc;
    }
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_SET_KEY); rc == 0;
         rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT_DUP)) {
        if (!emit(w, REC_PUT, n->db, &k, &v)) {
            rc = ENOMEM;
            break;
        }
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

bool idem__wal_on(const idem_wal *w)
{
    return w != NULL && !w->off_for_good;
}

bool idem__wal_batch_start(idem_wal *w, MDB_txn *txn)
{
    idem__wal_cur = NULL;
    if (!idem__wal_on(w) || w->unloggable || w->n_notes == 0) {
        return false; /* a batch that wrote nothing commits nothing: no txnid to name */
    }
    int rc = 0;
    w->len = WAL_ENTRY_HDR;
    for (size_t i = 0; rc == 0 && i < w->n_notes; i++) {
        rc = encode_note(w, txn, &w->notes[i]);
    }
    if (rc != 0 || w->len - 8 > UINT32_MAX || !grow(&w->buf, &w->cap, w->len, 1)) {
        return false; /* not logged: the batch waits for LMDB's sync */
    }
    idem__put_be32(w->buf, (uint32_t)(w->len - 8));
    idem__put_be64(w->buf + 8, w->epoch);
    idem__put_be64(w->buf + 16, (uint64_t)mdb_txn_id(txn));
    idem__put_be32(w->buf + 4, idem__wal_crc32(w->buf + 8, w->len - 8));
    pthread_mutex_lock(&w->mu);
    w->busy = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return true;
}

/* Zeroes the header of the entry at w->off and flushes it: a replay stops there. */
static int void_entry(idem_wal *w)
{
    static const uint8_t zeros[WAL_ENTRY_HDR];
    int rc = idem__wal_pwrite(w->fd, zeros, sizeof(zeros), w->off);
    return rc == 0 && fdatasync(w->fd) != 0 ? errno : rc;
}

bool idem__wal_batch_end(idem_wal *w, bool committed, bool advanced)
{
    pthread_mutex_lock(&w->mu);
    while (w->busy) {
        pthread_cond_wait(&w->cv, &w->mu);
    }
    int rc = w->rc;
    pthread_mutex_unlock(&w->mu);
    bool kept = rc == 0 && committed && advanced;
    if (kept) {
        w->off += (off_t)w->len;
    } else if (rc == 0) {
        /* Its txnid is the next commit's (LMDB did not take it), so its entry must not
         * stand for that commit in a replay. */
        rc = void_entry(w);
    }
    /* A failed write or flush may have left a torn or lost entry that later ones would
     * follow; after a failed commit LMDB hands its txnid out again to a redo. */
    w->off_for_good |= rc != 0 || !committed;
    if (w->cap > (size_t)WAL_WRAP) { /* a large batch's buffer is not kept */
        free(w->buf);
        w->buf = NULL;
        w->cap = 0;
    }
    return kept;
}

void *idem__wal_thread(void *arg)
{
    idem_wal *w = arg;
    pthread_setname_np(pthread_self(), "idem:lmdb-log");
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->busy && !w->stopping) {
            pthread_cond_wait(&w->cv, &w->mu);
        }
        if (!w->busy) {
            break;
        }
        pthread_mutex_unlock(&w->mu);
        int rc = idem__wal_pwrite(w->fd, w->buf, w->len, w->off);
        if (rc == 0 && !w->no_flush && fdatasync(w->fd) != 0) {
            rc = errno;
        }
        pthread_mutex_lock(&w->mu);
        w->rc = rc;
        w->busy = false;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int idem__wal_pwrite(int fd, const void *p, size_t n, off_t off)
{
    for (size_t done = 0; done < n;) {
        ssize_t k = pwrite(fd, (const uint8_t *)p + done, n - done, off + (off_t)done);
        if (k <= 0 && !(k < 0 && errno == EINTR)) {
            return k < 0 ? errno : EIO; /* nothing written: no second try */
        }
        done += k > 0 ? (size_t)k : 0;
    }
    return 0;
}

int idem__wal_new_epoch(idem_wal *w, int (*commit)(MDB_txn *txn, void *arg), void *arg)
{
    uint8_t head[WAL_HEAD] = {0}, b[8];
    uint64_t epoch;
    while ((epoch = idem__random_u64()) == 0) { /* 0: no epoch started (wal_open.c) */
    }
    MDB_txn *txn;
    MDB_val k = {sizeof(WAL_EPOCH_KEY) - 1, WAL_EPOCH_KEY}, v = {sizeof(b), b};
    idem__put_be64(b, epoch);
    /* The store names the epoch on disk before the header does: a header the store does
     * not name would have a replay refuse entries that were answered from. */
    int rc = mdb_txn_begin(w->env, NULL, 0, &txn);
    if (rc == 0 && (rc = mdb_put(txn, w->dbis[WAL_META], &k, &v, 0)) != 0) {
        mdb_txn_abort(txn);
    } else if (rc == 0) {
        rc = commit(txn, arg);
    }
    if (rc != 0) {
        return rc;
    }
    memcpy(head, WAL_MAGIC, 8);
    idem__put_be64(head + 8, epoch);
    idem__put_be32(head + 16, idem__wal_crc32(head, 16));
    if ((rc = idem__wal_pwrite(w->fd, head, sizeof(head), 0)) == 0 && fdatasync(w->fd) != 0) {
        rc = errno;
    }
    w->epoch = epoch;
    w->off = WAL_HEAD;
    return rc;
}

void idem__wal_wrap_due(idem_wal *w, int (*commit)(MDB_txn *txn, void *arg), void *arg)
{
    if (!idem__wal_on(w) || w->off < WAL_WRAP) {
        return;
    }
    struct stat sb;
    if (idem__wal_new_epoch(w, commit, arg) != 0) {
        /* The store may name an epoch no header has, or the header be torn: no entry
         * written from here on would be replayed. */
        w->off_for_good = true;
    } else if (fstat(w->fd, &sb) == 0 && sb.st_size > WAL_SIZE &&
               (ftruncate(w->fd, WAL_SIZE) != 0 || fsync(w->fd) != 0)) {
        w->off_for_good = true; /* what a large batch grew is cut at the wrap */
    }
}
