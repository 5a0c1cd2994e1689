/* Kept messages (toolkit.h): acked by a broker that may still lose them. A second log in
 * the outbox's database (IDEM_OUTBOX_DB; outbox.c has the first), dense:
 *   'K'          → be64 head ‖ be64 next          (log_bounds.c) kept are [head, next)
 *   'k' be64 i   → be64 seq ‖ be64 stream_seq ‖ be64 acked_ms ‖ be16 |stream| stream ‖
 *                  the message's outbox bytes (outbox.c)
 *   'N'          → the newest kept message per stream (outbox_kept_streams.c)
 *   'R'          → be64 restores                  how many restores committed
 * keep appends at next, in ack order; expire deletes at head; restore takes from the tail
 * (newest first) back into the outbox at its seq and lowers the outbox's head to it. So
 * [head, next) has no hole: count = next - head, the oldest at head, the newest at
 * next - 1. Writers take the outbox's bounds row first, as put and remove do. */
#include <stdlib.h>

#include "toolkit_internal.h"

#define KEPT_FIXED 26   /* the three be64 and be16 |stream| */
#define KEPT_BOUNDS 'K' /* the kept log's bounds row */
#define KEPT_LOOKS 4    /* reads of it that another relay's writes may spoil in a row */
#define RESTORES_KEY 'R'

static void kept_key(uint8_t k[IDEM__OUTBOX_KEY_LEN], uint64_t i)
{
    k[0] = 'k';
    idem__put_be64(k + 1, i);
}

/* Splits record v into its ack, ack time and outbox bytes (not copied). */
static idem_code kept_decode(const uint8_t *v, size_t n, idem_outbox_ack *a, uint64_t *acked_ms,
                             const uint8_t **msg, size_t *msg_len)
{
    size_t ls = n >= KEPT_FIXED ? (size_t)(v[24] << 8 | v[25]) : 0;
    if (ls == 0 || ls > IDEM_OUTBOX_MAX_STREAM || n < KEPT_FIXED + ls) {
        return idem__err(IDEM_DATA_LOSS, "outbox: bad kept message");
    }
    a->seq = idem__get_be64(v);
    a->stream_seq = idem__get_be64(v + 8);
    *acked_ms = idem__get_be64(v + 16);
    memcpy(a->stream, v + KEPT_FIXED, ls);
    a->stream[ls] = '\0';
    *msg = v + KEPT_FIXED + ls;
    *msg_len = n - KEPT_FIXED - ls;
    return IDEM_OK;
}

typedef struct keep_args {
    const idem_outbox_ack *acks;
    size_t n;
    uint64_t now_ms;
    uint64_t restores;   /* read before the acked messages were peeked (UINT64_MAX: any) */
    idem__kept_dir *dir; /* the stream directory, loaded in the txn */
} keep_args;

static idem_code restores_get(idem_txn *t, uint64_t *n)
{
    const uint8_t k = RESTORES_KEY;
    const void *v;
    size_t len;
    idem_code code = idem_txn_get(t, IDEM_OUTBOX_DB, &k, 1, &v, &len);
    *n = code == IDEM_OK && len == 8 ? idem__get_be64(v) : 0;
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

idem_code idem__outbox_restores(idem_store *st, uint64_t *n)
{
    const uint8_t k = RESTORES_KEY;
    void *v = NULL;
    size_t len = 0;
    idem_code code = idem_store_app_get(st, IDEM_OUTBOX_DB, &k, 1, &v, &len);
    *n = code == IDEM_OK && len == 8 ? idem__get_be64(v) : 0;
    free(v);
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

/* Appends ack's message (its outbox bytes m[0..n)) at *next. */
static idem_code keep_one(idem_txn *t, const idem_outbox_ack *a, uint64_t now_ms, const void *m,
                          size_t n, uint64_t *next)
{
    size_t ls = idem__bounded_len(a->stream, IDEM_OUTBOX_MAX_STREAM);
    uint8_t k[IDEM__OUTBOX_KEY_LEN], *v = malloc(KEPT_FIXED + ls + n);
    if (ls == 0 || v == NULL) {
        free(v);
        return idem__err(ls == 0 ? IDEM_INVALID_ARGUMENT : IDEM_RESOURCE_EXHAUSTED,
                         "outbox keep: a stream of 1..%d bytes (and memory)",
                         IDEM_OUTBOX_MAX_STREAM);
    }
    idem__put_be64(v, a->seq);
    idem__put_be64(v + 8, a->stream_seq);
    idem__put_be64(v + 16, now_ms);
    v[24] = (uint8_t)(ls >> 8), v[25] = (uint8_t)ls;
    memcpy(v + KEPT_FIXED, a->stream, ls);
    memcpy(v + KEPT_FIXED + ls, m, n);
    kept_key(k, (*next)++);
    idem_code code = idem_txn_put(t, IDEM_OUTBOX_DB, k, sizeof(k), v, KEPT_FIXED + ls + n);
    free(v);
    return code;
}

static idem_code keep_txn(idem_txn *t, void *arg)
{
    keep_args *a = arg;
    uint64_t head, next, khead, knext;
    uint8_t k[IDEM__OUTBOX_KEY_LEN];
    const void *v;
    size_t n;
    uint64_t restores = 0;
    idem_code code = a->restores == UINT64_MAX ? IDEM_OK : restores_get(t, &restores);
    if (code != IDEM_OK || (a->restores != UINT64_MAX && restores != a->restores)) {
        return code; /* restored since the peek: they stay in the outbox, published again */
    }
    code = idem__log_bounds_get(t, IDEM_OUTBOX_DB, &head, &next);
    if (code == IDEM_OK) {
        code = idem__log_bounds_get_at(t, IDEM_OUTBOX_DB, KEPT_BOUNDS, &khead, &knext);
    }
    if (code == IDEM_OK && (code = idem__kept_dir_load(t, a->dir)) == IDEM_OK && !a->dir->present &&
        khead < knext) {
        a->dir->overflow = true; /* kept by a release before the directory: in no entry */
    }
    for (size_t i = 0; code == IDEM_OK && i < a->n; i++) {
        idem__outbox_msg_key(k, a->acks[i].seq);
        code = idem_txn_get(t, IDEM_OUTBOX_DB, k, sizeof(k), &v, &n);
        if (code == IDEM_NOT_FOUND) { /* removed before (another relay) */
            code = IDEM_OK;
            continue;
        }
        if (code == IDEM_OK) {
            code = idem__kept_dir_note(a->dir, knext, &a->acks[i], v, n);
        }
        if (code == IDEM_OK) {
            code = keep_one(t, &a->acks[i], a->now_ms, v, n, &knext);
        }
        if (code == IDEM_OK) {
            code = idem_txn_del(t, IDEM_OUTBOX_DB, k, sizeof(k));
        }
    }
    if (code == IDEM_OK) {
        code = idem__log_bounds_put_at(t, IDEM_OUTBOX_DB, KEPT_BOUNDS, khead, knext);
    }
    if (code == IDEM_OK) {
        code = idem__kept_dir_store(t, a->dir);
    }
    return code != IDEM_OK ? code : idem__outbox_advance(t, head, next);
}

idem_code idem_outbox_keep(idem_store *st, const idem_outbox_ack *acks, size_t n, uint64_t now_ms)
{
    return idem__outbox_keep_since(st, acks, n, now_ms, UINT64_MAX);
}

idem_code idem__outbox_keep_since(idem_store *st, const idem_outbox_ack *acks, size_t n,
                                  uint64_t now_ms, uint64_t restores)
{
    keep_args a = {acks, n, now_ms, restores, NULL};
    if (st == NULL || (acks == NULL && n > 0) || n > IDEM_OUTBOX_MAX_BATCH) {
        return idem__err(IDEM_INVALID_ARGUMENT, "outbox keep: a store, at most %d messages",
                         IDEM_OUTBOX_MAX_BATCH);
    }
    if (n == 0) {
        return IDEM_OK;
    }
    if ((a.dir = malloc(sizeof(*a.dir))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "outbox keep: out of memory");
    }
    idem_code code = idem_store_run_txn(st, keep_txn, &a);
    free(a.dir);
    return code;
}

/* Record i of the kept log, read outside a txn: its ack, ack time and msg_id; NOT_FOUND
 * when another relay dropped or restored it since the bounds were read. */
static idem_code kept_read(idem_store *st, uint64_t i, idem_outbox_ack *a, uint64_t *acked_ms,
                           char msg_id[IDEM_OUTBOX_MAX_MSG_ID + 1])
{
    uint8_t k[IDEM__OUTBOX_KEY_LEN];
    const uint8_t *m;
    void *v;
    size_t n, mn;
    kept_key(k, i);
    idem_code code = idem_store_app_get(st, IDEM_OUTBOX_DB, k, sizeof(k), &v, &n);
    if (code == IDEM_OK && (code = kept_decode(v, n, a, acked_ms, &m, &mn)) == IDEM_OK &&
        msg_id != NULL) {
        code = idem__outbox_msg_id(m, mn, a->seq, msg_id);
    }
    free(v);
    return code;
}

/* The bounds, then both ends: three reads, not one snapshot. */
static idem_code kept_look(idem_store *st, idem_outbox_kept_info *out)
{
    uint64_t head, next, acked_ms;
    idem_outbox_ack oldest;
    memset(out, 0, sizeof(*out));
    idem_code code = idem__log_bounds_read_at(st, IDEM_OUTBOX_DB, KEPT_BOUNDS, &head, &next);
    if (code != IDEM_OK || head == next) {
        return code;
    }
    out->count = next - head;
    code = kept_read(st, head, &oldest, &out->oldest_ms, NULL);
    return code != IDEM_OK ? code
                           : kept_read(st, next - 1, &out->newest, &acked_ms, out->newest_msg_id);
}

idem_code idem_outbox_kept(idem_store *st, idem_outbox_kept_info *out)
{
    idem_code code = IDEM_NOT_FOUND;
    if (st == NULL) {
        memset(out, 0, sizeof(*out));
        return idem__err(IDEM_INVALID_ARGUMENT, "outbox kept: a store");
    }
    for (int i = 0; i < KEPT_LOOKS && code == IDEM_NOT_FOUND; i++) {
        code = kept_look(st, out);
    }
    return code != IDEM_NOT_FOUND
               ? code
               : idem__err(IDEM_ABORTED, "outbox kept: the log changed under %d looks in a row",
                           KEPT_LOOKS);
}

typedef struct kept_args {
    uint64_t before_ms;  /* expire: those acked before; restore: unused */
    idem__kept_dir *dir; /* the stream directory, pruned */
    size_t max, done;
} kept_args;

/* The stream directory after the kept log became [khead, knext). */
static idem_code dir_prune(idem_txn *t, idem__kept_dir *d, uint64_t khead, uint64_t knext)
{
    idem_code code = idem__kept_dir_load(t, d);
    if (code == IDEM_OK) {
        idem__kept_dir_prune(d, khead, knext);
        code = idem__kept_dir_store(t, d);
    }
    return code;
}

static idem_code expire_txn(idem_txn *t, void *arg)
{
    kept_args *a = arg;
    uint64_t head, next, khead, knext, acked_ms;
    uint8_t k[IDEM__OUTBOX_KEY_LEN];
    const uint8_t *m;
    const void *v;
    size_t n, mn;
    idem_outbox_ack ack;
    idem_code code = idem__log_bounds_get(t, IDEM_OUTBOX_DB, &head, &next);
    if (code == IDEM_OK) {
        code = idem__log_bounds_get_at(t, IDEM_OUTBOX_DB, KEPT_BOUNDS, &khead, &knext);
    }
    for (a->done = 0; code == IDEM_OK && khead < knext && a->done < a->max; a->done++, khead++) {
        kept_key(k, khead);
        if ((code = idem_txn_get(t, IDEM_OUTBOX_DB, k, sizeof(k), &v, &n)) != IDEM_OK ||
            (code = kept_decode(v, n, &ack, &acked_ms, &m, &mn)) != IDEM_OK ||
            acked_ms >= a->before_ms) {
            break;
        }
        code = idem_txn_del(t, IDEM_OUTBOX_DB, k, sizeof(k));
    }
    if (code != IDEM_OK || a->done == 0) {
        return code;
    }
    code = idem__log_bounds_put_at(t, IDEM_OUTBOX_DB, KEPT_BOUNDS, khead, knext);
    return code != IDEM_OK ? code : dir_prune(t, a->dir, khead, knext);
}

/* Runs fn on up to max kept messages in one write txn; *done (may be NULL): how many. */
static idem_code kept_run(idem_store *st, idem_txn_fn fn, uint64_t before_ms, size_t max,
                          size_t *done, const char *what)
{
    kept_args a = {before_ms, NULL, max, 0};
    if (st == NULL || max > IDEM_OUTBOX_MAX_BATCH) {
        return idem__err(IDEM_INVALID_ARGUMENT, "outbox kept %s: a store, at most %d", what,
                         IDEM_OUTBOX_MAX_BATCH);
    }
    if (max > 0 && (a.dir = malloc(sizeof(*a.dir))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "outbox kept %s: out of memory", what);
    }
    idem_code code = max == 0 ? IDEM_OK : idem_store_run_txn(st, fn, &a);
    free(a.dir);
    if (done != NULL) {
        *done = code == IDEM_OK ? a.done : 0;
    }
    return code;
}

idem_code idem_outbox_kept_expire(idem_store *st, uint64_t before_ms, size_t max, size_t *dropped)
{
    return kept_run(st, expire_txn, before_ms, max, dropped, "expire");
}

/* Puts kept record k back into the outbox at its seq; *seq = that seq. */
static idem_code restore_one(idem_txn *t, const uint8_t k[IDEM__OUTBOX_KEY_LEN], uint64_t *seq)
{
    uint8_t mk[IDEM__OUTBOX_KEY_LEN];
    const uint8_t *m;
    const void *v;
    size_t n, mn;
    uint64_t acked_ms;
    idem_outbox_ack ack;
    idem_code code = idem_txn_get(t, IDEM_OUTBOX_DB, k, IDEM__OUTBOX_KEY_LEN, &v, &n);
    if (code == IDEM_OK) {
        code = kept_decode(v, n, &ack, &acked_ms, &m, &mn);
    }
    if (code == IDEM_OK) {
        idem__outbox_msg_key(mk, *seq = ack.seq);
        code = idem_txn_put(t, IDEM_OUTBOX_DB, mk, sizeof(mk), m, mn);
    }
    return code != IDEM_OK ? code : idem_txn_del(t, IDEM_OUTBOX_DB, k, IDEM__OUTBOX_KEY_LEN);
}

static idem_code restore_txn(idem_txn *t, void *arg)
{
    kept_args *a = arg;
    uint64_t head, next, khead, knext, seq;
    uint8_t k[IDEM__OUTBOX_KEY_LEN];
    idem_code code = idem__log_bounds_get(t, IDEM_OUTBOX_DB, &head, &next);
    if (code == IDEM_OK) {
        code = idem__log_bounds_get_at(t, IDEM_OUTBOX_DB, KEPT_BOUNDS, &khead, &knext);
    }
    for (a->done = 0; code == IDEM_OK && khead < knext && a->done < a->max; a->done++) {
        kept_key(k, --knext);
        if ((code = restore_one(t, k, &seq)) == IDEM_OK && seq < head) {
            head = seq;
        }
    }
    if (code != IDEM_OK || a->done == 0) {
        return code;
    }
    code = idem__log_bounds_put_at(t, IDEM_OUTBOX_DB, KEPT_BOUNDS, khead, knext);
    if (code == IDEM_OK) {
        code = idem__log_bounds_put(t, IDEM_OUTBOX_DB, head, next);
    }
    if (code == IDEM_OK && (code = restores_get(t, &seq)) == IDEM_OK) {
        const uint8_t rk = RESTORES_KEY;
        uint8_t v[8];
        idem__put_be64(v, seq + 1); /* a keep of acks peeked before this one keeps nothing */
        code = idem_txn_put(t, IDEM_OUTBOX_DB, &rk, 1, v, sizeof(v));
    }
    return code != IDEM_OK ? code : dir_prune(t, a->dir, khead, knext);
}

idem_code idem_outbox_kept_restore(idem_store *st, size_t max, size_t *restored)
{
    return kept_run(st, restore_txn, 0, max, restored, "restore");
}
