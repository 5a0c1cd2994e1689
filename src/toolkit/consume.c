/* Message-consume dedupe (防重表): an at-least-once message takes effect once per
 * (consumer group, message key).
 *
 * One business database, IDEM_CONSUME_DB, holds three kinds of keys:
 *   'm' group \0 key   → be64 consumed_at ‖ be64 seq       the marker (the unique key)
 *   'l' be64 seq       → be64 consumed_at ‖ marker key      consumption log, for purge
 *   'q'                → be64 head ‖ be64 next              live log is [head, next)
 *   'c' group          → be64 seq ‖ owner                   where the group's purge resumes,
 *                                                           and whose retention it follows
 * The marker, the log entry and the consumer's own writes commit in one write txn, so
 * "consumed" and "effect done" cannot disagree after a crash. The log orders markers by
 * consumption, which lets purge take the oldest first in bounded batches with only
 * get/put/del; a clock stepped back only makes purge stop early (markers kept longer). */
#include <stdlib.h>
#include <string.h>

#include "store.h"
#include "toolkit_internal.h"

#include "idemrpc/toolkit.h"

#define MARKER_MAX (1 + IDEM_MAX_CONSUMER_GROUP + 1 + IDEM_MAX_MSG_KEY)
#define LOG_KEY_LEN 9

typedef struct marker_key {
    uint8_t bytes[MARKER_MAX];
    size_t len;
} marker_key;

static idem_code marker_key_make(marker_key *k, const char *group, const char *msg_key)
{
    size_t lg = idem__bounded_len(group, IDEM_MAX_CONSUMER_GROUP);
    size_t lk = idem__bounded_len(msg_key, IDEM_MAX_MSG_KEY);
    if (lg == 0 || lk == 0) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "consume: group must be 1..%d bytes and message key 1..%d bytes",
                         IDEM_MAX_CONSUMER_GROUP, IDEM_MAX_MSG_KEY);
    }
    k->bytes[0] = 'm';
    memcpy(k->bytes + 1, group, lg);
    k->bytes[1 + lg] = 0;
    memcpy(k->bytes + 2 + lg, msg_key, lk);
    k->len = 2 + lg + lk;
    return IDEM_OK;
}

static void log_key(uint8_t out[LOG_KEY_LEN], uint64_t seq)
{
    out[0] = 'l';
    idem__put_be64(out + 1, seq);
}

/* The locking read of the marker: IDEM_NOT_FOUND when (group, key) is new, else
 * IDEM_ALREADY_EXISTS (and *consumed_at). On PostgreSQL the marker's row stays locked
 * until the txn ends, so a concurrent consumer of the same message waits here: bounded,
 * for the store's lock bound (IDEM_ABORTED past it: another txn consumes it now). */
static idem_code marker_check(idem_txn *t, const marker_key *k, bool bounded, uint64_t *consumed_at)
{
    const void *v;
    size_t n;
    idem_code code = bounded
                         ? idem__store_txn_get_bounded(t, IDEM_CONSUME_DB, k->bytes, k->len, &v, &n)
                         : idem_txn_get(t, IDEM_CONSUME_DB, k->bytes, k->len, &v, &n);
    if (code == IDEM_OK) {
        *consumed_at = n == 16 ? idem__get_be64(v) : 0;
        return idem__err(IDEM_ALREADY_EXISTS, "consume: message consumed before");
    }
    return code;
}

/* Writes the marker and its log entry. The log's bounds are one row every consumer
 * writes: taken last, just before the commit, so that consumers of different messages
 * wait for each other only that long, never for each other's fn. */
static idem_code marker_write(idem_txn *t, const marker_key *k, uint64_t now, uint64_t *consumed_at)
{
    uint64_t head, next;
    uint8_t mval[16], lkey[LOG_KEY_LEN], lval[8 + MARKER_MAX];
    idem_code code = idem__log_bounds_get(t, IDEM_CONSUME_DB, &head, &next);
    if (code != IDEM_OK) {
        return code;
    }
    idem__put_be64(mval, now);
    idem__put_be64(mval + 8, next);
    log_key(lkey, next);
    memcpy(lval, mval, 8);
    memcpy(lval + 8, k->bytes, k->len);
    if ((code = idem_txn_put(t, IDEM_CONSUME_DB, k->bytes, k->len, mval, 16)) != IDEM_OK ||
        (code = idem_txn_put(t, IDEM_CONSUME_DB, lkey, LOG_KEY_LEN, lval, 8 + k->len)) != IDEM_OK) {
        return code;
    }
    *consumed_at = now;
    return idem__log_bounds_put(t, IDEM_CONSUME_DB, head, next + 1);
}

/* Marks (group, key) consumed by t. IDEM_ALREADY_EXISTS (and *consumed_at) when marked
 * before. */
static idem_code mark(idem_txn *t, const marker_key *k, uint64_t now, uint64_t *consumed_at)
{
    idem_code code = marker_check(t, k, false, consumed_at);
    return code == IDEM_NOT_FOUND ? marker_write(t, k, now, consumed_at) : code;
}

idem_code idem_consume_mark(idem_txn *t, const char *group, const char *msg_key)
{
    marker_key k;
    uint64_t at;
    idem_code code = marker_key_make(&k, group, msg_key);
    return code != IDEM_OK ? code : mark(t, &k, idem__now_ms(), &at);
}

static idem_code lookup(idem_store *st, const marker_key *k, uint64_t *consumed_at)
{
    void *v;
    size_t n;
    idem_code code = idem_store_app_get(st, IDEM_CONSUME_DB, k->bytes, k->len, &v, &n);
    if (code == IDEM_OK) {
        *consumed_at = n == 16 ? idem__get_be64(v) : 0;
        free(v);
    }
    return code;
}

idem_code idem_consume_lookup(idem_store *st, const char *group, const char *msg_key,
                              uint64_t *consumed_at_ms)
{
    marker_key k;
    uint64_t at = 0;
    idem_code code = marker_key_make(&k, group, msg_key);
    if (code == IDEM_OK && (code = lookup(st, &k, &at)) == IDEM_OK && consumed_at_ms != NULL) {
        *consumed_at_ms = at;
    }
    return code;
}

static idem_consume_verdict verdict(idem_consume_info *info, idem_code code, bool duplicate,
                                    uint64_t at)
{
    info->code = code;
    info->duplicate = code == IDEM_OK && duplicate;
    info->consumed_at_ms = code == IDEM_OK ? at : 0;
    info->store_failed = false;
    info->in_progress = false;
    return code == IDEM_OK ? IDEM_CONSUME_ACK : IDEM_CONSUME_RETRY;
}

/* What idem_consume found wrong with the call itself, before fn: no redelivery helps. */
static idem_consume_verdict reject(idem_consume_info *info, idem_code code)
{
    verdict(info, code, false, 0);
    return IDEM_CONSUME_REJECT;
}

/* A store without transactions, or a call from inside one (FAILED_PRECONDITION). */
static bool hopeless(idem_code code)
{
    return code == IDEM_UNIMPLEMENTED || code == IDEM_FAILED_PRECONDITION;
}

idem_consume_verdict idem_consume_ex(idem_store *st, const char *group, const char *msg_key,
                                     idem_txn_fn fn, void *arg, idem_consume_info *info)
{
    idem_consume_info local;
    marker_key k;
    idem_txn *t;
    uint64_t at = 0;
    info = info != NULL ? info : &local;
    idem_code code = marker_key_make(&k, group, msg_key);
    if (code == IDEM_OK && (st == NULL || fn == NULL)) {
        code = idem__err(IDEM_INVALID_ARGUMENT, "consume needs a store and a function");
    }
    if (code != IDEM_OK) {
        return reject(info, code);
    }
    if ((code = lookup(st, &k, &at)) != IDEM_NOT_FOUND) { /* duplicates: a read only */
        return hopeless(code) ? reject(info, code) : verdict(info, code, true, at);
    }
    if ((code = idem__store_txn_begin(st, &t)) != IDEM_OK) {
        return hopeless(code) ? reject(info, code) : verdict(info, code, false, 0);
    }
    code = marker_check(t, &k, true, &at);
    if (code == IDEM_ALREADY_EXISTS) { /* a concurrent consumer committed first */
        idem__store_txn_abort(t);
        return verdict(info, IDEM_OK, true, at);
    }
    if (code == IDEM_ABORTED) { /* a concurrent consumer is in fn now */
        idem__store_txn_abort(t);
        verdict(info, code, false, 0);
        info->in_progress = true;
        return IDEM_CONSUME_RETRY;
    }
    if (code == IDEM_NOT_FOUND && (code = fn(t, arg)) == IDEM_OK) {
        code = marker_write(t, &k, idem__now_ms(), &at); /* the shared log row: last */
    }
    if (code != IDEM_OK) {
        bool broken = idem__store_txn_broken(t);
        idem__store_txn_abort(t); /* neither the marker nor fn's writes remain */
        idem_consume_verdict v = verdict(info, code, false, 0);
        info->store_failed = broken;
        return v;
    }
    return verdict(info, idem__store_txn_commit(t), false, at);
}

idem_consume_verdict idem_consume(idem_store *st, const char *group, const char *msg_key,
                                  idem_txn_fn fn, void *arg)
{
    return idem_consume_ex(st, group, msg_key, fn, arg, NULL);
}

typedef struct purge_args {
    uint64_t before_ms;
    size_t max, purged;
} purge_args;

/* Deletes log entry lkey (its value v, n > 8 bytes) and its marker if consumed before the
 * cutoff. *stop when not. */
static idem_code purge_entry(idem_txn *t, purge_args *a, const uint8_t *lkey, const void *v,
                             size_t n, bool *stop)
{
    *stop = idem__get_be64(v) >= a->before_ms;
    if (*stop) {
        return IDEM_OK;
    }
    idem_code code = idem_txn_del(t, IDEM_CONSUME_DB, (const uint8_t *)v + 8, n - 8);
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    if ((code = idem_txn_del(t, IDEM_CONSUME_DB, lkey, LOG_KEY_LEN)) == IDEM_OK) {
        a->purged++;
    }
    return code;
}

/* Reads log entry seq: IDEM_NOT_FOUND when nothing is left at seq. */
static idem_code log_entry(idem_txn *t, uint8_t lkey[LOG_KEY_LEN], uint64_t seq, const void **v,
                           size_t *n)
{
    log_key(lkey, seq);
    idem_code code = idem_txn_get(t, IDEM_CONSUME_DB, lkey, LOG_KEY_LEN, v, n);
    if (code == IDEM_OK && *n <= 8) {
        return idem__err(IDEM_DATA_LOSS, "consume: bad log entry");
    }
    return code;
}

/* Deletes log entry seq and its marker if consumed before the cutoff. *stop when not. */
static idem_code purge_one(idem_txn *t, purge_args *a, uint64_t seq, bool *stop)
{
    uint8_t lkey[LOG_KEY_LEN];
    const void *v;
    size_t n;
    idem_code code = log_entry(t, lkey, seq, &v, &n);
    *stop = false;
    if (code != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code; /* nothing left at this seq */
    }
    return purge_entry(t, a, lkey, v, n, stop);
}

static idem_code purge_txn(idem_txn *t, void *arg)
{
    purge_args *a = arg;
    uint64_t head, next, seq;
    bool stop = false;
    idem_code code = idem__log_bounds_get(t, IDEM_CONSUME_DB, &head, &next);
    /* At most max log slots are looked at, deleted or not: the txn stays bounded. */
    for (seq = head; code == IDEM_OK && seq < next && seq - head < a->max; seq++) {
        if ((code = purge_one(t, a, seq, &stop)) != IDEM_OK || stop) {
            break;
        }
    }
    if (code != IDEM_OK || seq == head) {
        return code;
    }
    return idem__log_bounds_put(t, IDEM_CONSUME_DB, seq, next);
}

idem_code idem_consume_purge(idem_store *st, uint64_t before_ms, size_t max, size_t *purged)
{
    purge_args a = {.before_ms = before_ms, .max = max};
    if (purged != NULL) {
        *purged = 0;
    }
    if (max > IDEM_CONSUME_MAX_PURGE) {
        return idem__err(IDEM_INVALID_ARGUMENT, "consume purge: at most %d per batch",
                         IDEM_CONSUME_MAX_PURGE);
    }
    if (max == 0) {
        return IDEM_OK;
    }
    idem_code code = idem_store_run_txn(st, purge_txn, &a);
    if (code == IDEM_OK && purged != NULL) {
        *purged = a.purged;
    }
    return code;
}

typedef struct group_purge_args {
    purge_args a;
    marker_key prefix; /* 'm' group \0: the group's markers start so */
    uint8_t ckey[1 + IDEM_MAX_CONSUMER_GROUP];
    size_t clen;
    uint64_t head, next;                    /* the log's bounds, read before the txn */
    uint8_t owner[IDEM__CONSUME_MAX_OWNER]; /* whose retention the purge follows */
    size_t olen;
    bool given; /* else a purge with the caller's own cutoff: the owner is forgotten */
} group_purge_args;

/* Log slot seq in the group's purge: deleted when it is the group's and consumed before
 * the cutoff; another group's, or nothing: passed over; the group's, consumed later:
 * *stop (the log is in consumption order). */
static idem_code group_purge_one(idem_txn *t, group_purge_args *g, uint64_t seq, bool *stop)
{
    uint8_t lkey[LOG_KEY_LEN];
    const void *v;
    size_t n, lp = g->prefix.len;
    idem_code code = log_entry(t, lkey, seq, &v, &n);
    *stop = false;
    if (code != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    if (n <= 8 + lp || memcmp((const uint8_t *)v + 8, g->prefix.bytes, lp) != 0) {
        return IDEM_OK;
    }
    return purge_entry(t, &g->a, lkey, v, n, stop);
}

/* Reads where the group's purge resumes (*from) and checks that the same owner purges:
 * a group whose markers two retentions purge would lose them to the shorter one. */
static idem_code cursor_read(idem_txn *t, group_purge_args *g, uint64_t *from, bool *owned)
{
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, IDEM_CONSUME_DB, g->ckey, g->clen, &v, &n);
    *owned = false;
    if (code != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    if (n < 8 || n - 8 > sizeof(g->owner)) {
        return idem__err(IDEM_DATA_LOSS, "consume: bad purge cursor");
    }
    const uint8_t *o = (const uint8_t *)v + 8;
    *from = idem__get_be64(v) > *from ? idem__get_be64(v) : *from;
    *owned = n > 8;
    if (*owned && g->given && (n - 8 != g->olen || memcmp(o, g->owner, g->olen) != 0)) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "consume purge: group %.*s follows the retention of %.*s, not %.*s (a "
                         "group consumes one stream)",
                         (int)(g->clen - 1), (const char *)g->ckey + 1, (int)(n - 8),
                         (const char *)o, (int)g->olen, (const char *)g->owner);
    }
    return IDEM_OK;
}

static idem_code group_purge_txn(idem_txn *t, void *arg)
{
    group_purge_args *g = arg;
    uint8_t cval[8 + IDEM__CONSUME_MAX_OWNER];
    uint64_t from = g->head, seq;
    bool stop = false, owned;
    idem_code code = cursor_read(t, g, &from, &owned);
    /* At most max slots looked at, as purge_txn. */
    for (seq = from; code == IDEM_OK && seq < g->next && seq - from < g->a.max; seq++) {
        if ((code = group_purge_one(t, g, seq, &stop)) != IDEM_OK || stop) {
            break;
        }
    }
    if (code != IDEM_OK || (seq == from && owned == (g->olen > 0))) {
        return code;
    }
    idem__put_be64(cval, seq);
    memcpy(cval + 8, g->owner, g->olen);
    return idem_txn_put(t, IDEM_CONSUME_DB, g->ckey, g->clen, cval, 8 + g->olen);
}

/* The group's own cursor 'c' group lets it pass over other groups' markers once, and
 * leaves the log's head to idem_consume_purge (slots purged here are holes it skips). */
idem_code idem__consume_purge_owned(idem_store *st, const char *group, const char *owner,
                                    uint64_t before_ms, size_t max, size_t *purged)
{
    group_purge_args g = {.a = {.before_ms = before_ms, .max = max}, .given = owner != NULL};
    if (purged != NULL) {
        *purged = 0;
    }
    idem_code code = marker_key_make(&g.prefix, group, "-"); /* checks group */
    if (code == IDEM_OK && (max == 0 || max > IDEM_CONSUME_MAX_PURGE)) {
        code = idem__err(IDEM_INVALID_ARGUMENT, "consume purge: 1..%d slots per batch",
                         IDEM_CONSUME_MAX_PURGE);
    }
    g.olen = owner != NULL ? idem__bounded_len(owner, sizeof(g.owner)) : 0;
    if (code == IDEM_OK && owner != NULL && g.olen == 0) {
        code = idem__err(IDEM_INVALID_ARGUMENT, "consume purge: owner 1..%d bytes",
                         IDEM__CONSUME_MAX_OWNER);
    }
    memcpy(g.owner, owner != NULL ? owner : "", g.olen);
    if (code != IDEM_OK) {
        return code;
    }
    g.prefix.len--; /* 'm' group \0 */
    g.ckey[0] = 'c';
    memcpy(g.ckey + 1, group, g.prefix.len - 2);
    g.clen = g.prefix.len - 1;
    /* Every slot below next is committed: a marker and the bounds commit together. */
    if ((code = idem__log_bounds_read(st, IDEM_CONSUME_DB, &g.head, &g.next)) != IDEM_OK ||
        (code = idem_store_run_txn(st, group_purge_txn, &g)) != IDEM_OK) {
        return code;
    }
    if (purged != NULL) {
        *purged = g.a.purged;
    }
    return IDEM_OK;
}

idem_code idem_consume_purge_group(idem_store *st, const char *group, uint64_t before_ms,
                                   size_t max, size_t *purged)
{
    return idem__consume_purge_owned(st, group, NULL, before_ms, max, purged);
}

/* Walks the markers 'm' group \0 *, contiguous in key order, one read each: at most
 * max + 1 reads. */
idem_code idem_consume_group_markers(idem_store *st, const char *group, size_t max,
                                     idem_consume_markers *out)
{
    marker_key after;
    memset(out, 0, sizeof(*out));
    idem_code code = marker_key_make(&after, group, "-"); /* checks group */
    if (code != IDEM_OK) {
        return code;
    }
    if (max == 0) {
        return idem__err(IDEM_INVALID_ARGUMENT, "consume markers: max must be at least 1");
    }
    size_t prefix = after.len - 1; /* 'm' group \0 */
    after.len = prefix;
    for (;;) {
        idem_app_entry e;
        if ((code = idem__store_app_next(st, IDEM_CONSUME_DB, after.bytes, after.len, &e)) !=
            IDEM_OK) {
            return code == IDEM_NOT_FOUND ? IDEM_OK : code;
        }
        bool mine =
            e.klen > prefix && e.klen <= MARKER_MAX && memcmp(e.key, after.bytes, prefix) == 0;
        if (mine && out->count == max) {
            out->more = true;
        } else if (mine) {
            uint64_t at = e.vlen == 16 ? idem__get_be64(e.val) : 0;
            out->oldest_ms = out->count == 0 || at < out->oldest_ms ? at : out->oldest_ms;
            out->count++;
            memcpy(after.bytes, e.key, e.klen);
            after.len = e.klen;
        }
        idem__app_entry_clear(&e);
        if (!mine || out->more) {
            return IDEM_OK;
        }
    }
}
