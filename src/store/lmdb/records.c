/* Records: the stored format (rec_hdr, then the response of a COMPLETED record or the
 * kept token of an IN_PROGRESS one), the effective key, and the plain accesses: get,
 * delete, foreach, stats. The claim lifecycle that writes them is in claim.c. */
#include <stdlib.h>
#include <string.h>

#include "lmdb_internal.h"

idem_code idem__lmdb_rec_key_make(rec_key *k, const idem_key_ref *ref)
{
    idem_code code = idem__key_check(ref);
    if (code != IDEM_OK) {
        return code;
    }
    const char *caller = ref->caller != NULL ? ref->caller : "";
    size_t lc = strlen(caller), lm = strlen(ref->method), lk = strlen(ref->key);
    memcpy(k->bytes, caller, lc);
    k->bytes[lc] = 0;
    memcpy(k->bytes + lc + 1, ref->method, lm);
    k->bytes[lc + 1 + lm] = 0;
    memcpy(k->bytes + lc + lm + 2, ref->key, lk);
    k->len = lc + lm + lk + 2;
    return IDEM_OK;
}

/* Decodes a stored record; copies the response only when want_response. */
idem_code idem__lmdb_rec_decode(const MDB_val *v, idem_record *rec, bool want_response)
{
    rec_hdr h;
    if (v->mv_size < sizeof(h)) {
        return idem__err(IDEM_DATA_LOSS, "record truncated (%zu bytes)", v->mv_size);
    }
    memcpy(&h, v->mv_data, sizeof(h));
    if (h.magic != REC_MAGIC ||
        (h.state != IDEM_REC_IN_PROGRESS && h.state != IDEM_REC_COMPLETED)) {
        return idem__err(IDEM_DATA_LOSS, "record has unknown format %#x/%u", h.magic, h.state);
    }
    if (rec == NULL) {
        return IDEM_OK;
    }
    memset(rec, 0, sizeof(*rec));
    rec->state = (idem_record_state)h.state;
    memcpy(rec->fingerprint, h.fingerprint, sizeof(h.fingerprint));
    rec->owner = h.owner;
    rec->lease_until_ms = h.lease_until_ms;
    rec->first_at_ms = h.first_at_ms;
    rec->expires_ms = h.expires_ms;
    size_t n = h.state == IDEM_REC_COMPLETED ? v->mv_size - sizeof(h) : 0; /* else a token */
    rec->response_len = n; /* also without the copy: foreach reports the stored size */
    if (want_response && n > 0) {
        if ((rec->response = malloc(n)) == NULL) {
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        }
        memcpy(rec->response, (const uint8_t *)v->mv_data + sizeof(h), n);
    }
    return IDEM_OK;
}

int idem__lmdb_rec_put(lmdb_store *st, MDB_txn *txn, const rec_key *key, const rec_hdr *h,
                       const void *response, size_t len)
{
    MDB_val k = {key->len, (void *)key->bytes}, v = {sizeof(*h) + len, NULL};
    int rc = mdb_put(txn, st->records, &k, &v, MDB_RESERVE);
    if (rc == 0) {
        memcpy(v.mv_data, h, sizeof(*h));
        if (len > 0) {
            memcpy((uint8_t *)v.mv_data + sizeof(*h), response, len);
        }
    }
    return rc;
}

/* Deletes the record at key and its index entry; rc-style. */
int idem__lmdb_rec_delete(lmdb_store *st, MDB_txn *txn, const rec_key *key, uint64_t expires_ms)
{
    MDB_val k = {key->len, (void *)key->bytes};
    int rc = mdb_del(txn, st->records, &k, NULL);
    return rc != 0 ? rc : idem__lmdb_index_del(st, txn, expires_ms, key->bytes, key->len);
}

idem_code idem__lmdb_rec_read(lmdb_store *st, MDB_txn *txn, const idem_key_ref *ref,
                              idem_record *rec, bool want_response)
{
    rec_key key;
    MDB_val k, v;
    idem_code code = idem__lmdb_rec_key_make(&key, ref);
    if (code != IDEM_OK) {
        return code;
    }
    k = (MDB_val){key.len, key.bytes};
    int rc = mdb_get(txn, st->records, &k, &v);
    return rc == MDB_NOTFOUND ? idem__err(IDEM_NOT_FOUND, "no record")
           : rc != 0          ? idem__lmdb_code(rc, "get")
                              : idem__lmdb_rec_decode(&v, rec, want_response);
}

/* idem__gc_durable_wait; when a failed sync left the snapshot unsure (no later sync
 * vouches for it), a re-write puts it on disk first (group_commit_sync.c). */
static idem_code durable(lmdb_store *st, uint64_t txnid)
{
    idem_code code = idem__gc_durable_wait(&st->gc, txnid);
    if (code != IDEM_OK && st->gc.rewrite != NULL && txnid <= atomic_load(&st->gc.unsure_txnid) &&
        idem__lmdb_write(st, st->gc.rewrite, st->gc.rewrite_ctx) == IDEM_OK) {
        code = idem__gc_durable_wait(&st->gc, txnid);
    }
    return code;
}

idem_code idem__lmdb_get(idem_store *base, const idem_key_ref *ref, idem_record *rec)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    int rc = idem__lmdb_read_begin(st, &txn);
    if (rc != 0) {
        return idem__lmdb_code(rc, "get begin");
    }
    idem_code code = idem__lmdb_rec_read(st, txn, ref, rec, true);
    uint64_t snapshot = mdb_txn_id(txn);
    idem__lmdb_read_end(st, txn);
    /* An answer from a record of a batch whose meta page is not on disk yet waits. */
    if (code == IDEM_OK && (code = durable(st, snapshot)) != IDEM_OK) {
        idem_record_clear(rec);
    }
    return code;
}

static void read_end_borrowed(void *st, void *txn)
{
    idem__lmdb_read_end(st, txn);
}

/* The response stays in the map: the read transaction is lent with it. */
idem_code idem__lmdb_get_borrowed(idem_store *base, const idem_key_ref *ref, idem_record *rec,
                                  idem_borrow *borrow)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    rec_key key;
    MDB_val k, v;
    idem_code code = idem__lmdb_rec_key_make(&key, ref);
    int rc = code == IDEM_OK ? idem__lmdb_read_begin(st, &txn) : 0;
    if (code != IDEM_OK || rc != 0) {
        return code != IDEM_OK ? code : idem__lmdb_code(rc, "get begin");
    }
    k = (MDB_val){key.len, key.bytes};
    rc = mdb_get(txn, st->records, &k, &v);
    code = rc == MDB_NOTFOUND ? idem__err(IDEM_NOT_FOUND, "no record")
           : rc != 0          ? idem__lmdb_code(rc, "get")
                              : idem__lmdb_rec_decode(&v, rec, false);
    /* As idem__lmdb_get: an answer from a batch whose meta page is not on disk waits. */
    if (code == IDEM_OK && (code = durable(st, mdb_txn_id(txn))) != IDEM_OK) {
        idem_record_clear(rec);
    }
    if (code != IDEM_OK || rec->response_len == 0) {
        idem__lmdb_read_end(st, txn);
        return code;
    }
    rec->response = (uint8_t *)v.mv_data + (v.mv_size - rec->response_len);
    *borrow = (idem_borrow){read_end_borrowed, st, txn};
    return IDEM_OK;
}

static idem_code delete_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    MDB_val k = {w->key.len, (void *)w->key.bytes}, v;
    rec_hdr h;
    idem_code code;
    int rc = mdb_get(txn, w->st->records, &k, &v);
    if (rc == MDB_NOTFOUND) {
        return idem__err(IDEM_NOT_FOUND, "no record");
    } else if (rc != 0) {
        return idem__lmdb_code(rc, "delete get");
    } else if ((code = idem__lmdb_rec_decode(&v, NULL, false)) != IDEM_OK) {
        return code;
    }
    memcpy(&h, v.mv_data, sizeof(h));
    rc = idem__lmdb_rec_delete(w->st, txn, &w->key, h.expires_ms);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "delete");
}

idem_code idem__lmdb_delete(idem_store *base, const idem_key_ref *ref)
{
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st};
    idem_code code = idem__lmdb_rec_key_make(&w.key, ref);
    return code != IDEM_OK ? code : idem__lmdb_write(st, delete_apply, &w);
}

/* Splits stored key bytes caller \0 method \0 key into three C strings. */
static bool rec_key_split(const MDB_val *k, char *buf, idem_key_ref *ref)
{
    if (k->mv_size > sizeof(((rec_key *)0)->bytes)) {
        return false;
    }
    memcpy(buf, k->mv_data, k->mv_size);
    buf[k->mv_size] = '\0';
    char *m = memchr(buf, 0, k->mv_size);
    char *key = m != NULL ? memchr(m + 1, 0, k->mv_size - (size_t)(m + 1 - buf)) : NULL;
    if (key == NULL) {
        return false;
    }
    *ref = (idem_key_ref){buf, m + 1, key + 1};
    return true;
}

idem_code idem__lmdb_foreach(idem_store *base, idem_store_visit_fn fn, void *arg)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val k, v;
    char buf[sizeof(((rec_key *)0)->bytes) + 1];
    idem_code code = IDEM_OK;
    int rc;
    if ((rc = idem__lmdb_read_begin(st, &txn)) != 0) {
        return idem__lmdb_code(rc, "foreach begin");
    }
    if ((rc = mdb_cursor_open(txn, st->records, &cur)) != 0) {
        idem__lmdb_read_end(st, txn);
        return idem__lmdb_code(rc, "foreach cursor");
    }
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == 0;
         rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        idem_key_ref ref;
        idem_record rec;
        if (!rec_key_split(&k, buf, &ref) || idem__lmdb_rec_decode(&v, &rec, false) != IDEM_OK) {
            continue; /* not ours to interpret; the operator tool skips it */
        }
        if (!fn(arg, &ref, &rec)) {
            break;
        }
    }
    if (rc != 0 && rc != MDB_NOTFOUND) {
        code = idem__lmdb_code(rc, "foreach");
    }
    mdb_cursor_close(cur);
    idem__lmdb_read_end(st, txn);
    return code;
}

idem_code idem__lmdb_stats(idem_store *base, idem_store_stats *out)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val k, v;
    MDB_stat ms;
    MDB_envinfo info;
    int rc;

    memset(out, 0, sizeof(*out));
    if ((rc = mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn)) != 0) {
        return idem__lmdb_code(rc, "stats begin");
    }
    if ((rc = mdb_stat(txn, st->tokens, &ms)) != 0 ||
        (rc = mdb_cursor_open(txn, st->records, &cur)) != 0) {
        mdb_txn_abort(txn);
        return idem__lmdb_code(rc, "stats");
    }
    out->tokens = ms.ms_entries;
    if (st->has_tombs && (rc = mdb_stat(txn, st->tombs, &ms)) == 0) {
        out->tombstones = ms.ms_entries;
    }
    if (st->has_tomb_buckets && (rc = mdb_stat(txn, st->tomb_buckets, &ms)) == 0) {
        out->tombstones += ms.ms_entries;
    }
    while ((rc = mdb_cursor_get(cur, &k, &v, out->records ? MDB_NEXT : MDB_FIRST)) == 0) {
        out->records++;
        rec_hdr h;
        if (v.mv_size >= sizeof(h)) {
            memcpy(&h, v.mv_data, sizeof(h));
            out->in_progress += h.state == IDEM_REC_IN_PROGRESS;
            out->completed += h.state == IDEM_REC_COMPLETED;
        }
    }
    mdb_cursor_close(cur);
    mdb_txn_abort(txn);
    mdb_env_info(st->env, &info);
    mdb_env_stat(st->env, &ms);
    pthread_mutex_lock(&st->gc.mu);
    out->commits = st->gc.commits;
    out->writes = st->gc.writes;
    out->early_wakeups = st->gc.early_wakeups;
    out->shared_commits = st->gc.shared;
    pthread_mutex_unlock(&st->gc.mu);
    out->map_size = info.me_mapsize;
    out->map_used = (info.me_last_pgno + 1) * (size_t)ms.ms_psize;
    return rc == MDB_NOTFOUND ? IDEM_OK : idem__lmdb_code(rc, "stats scan");
}
