/* The transactional outbox: messages a handler writes in its own write txn, so that a
 * message exists if and only if the business change that owes it committed. A relay
 * (nats.h) publishes them in order and removes each only after the broker acked it (into
 * the kept log, outbox_kept.c, while the broker may still lose it); a crash between the
 * two publishes it again under the same msg_id.
 *
 * One business database, IDEM_OUTBOX_DB:
 *   'q'            → be64 head ‖ be64 next      live messages are in [head, next)
 *   'm' be64 seq   → be16 |subject| subject ‖ be16 |msg_id| msg_id ‖ data
 *   'p' be64 seq   → the same bytes: a parked message (the broker refuses it for good)
 *   'l'            → be64 max_payload            the broker's limit a relay recorded
 *   'K', 'k' be64 i → the kept log (outbox_kept.c): acked, the broker may still lose them
 *   'N'            → the kept log's newest message per stream (outbox_kept_streams.c)
 * put appends at next; remove (and park) deletes one message and moves head past every
 * removed one at the front (at most IDEM_OUTBOX_MAX_BATCH per txn), so head only grows,
 * but for kept messages put back after the broker lost them (idem_outbox_kept_restore:
 * head goes back to the oldest of them, at its own seq). */
#include <stdlib.h>
#include <string.h>

#include "toolkit_internal.h"

#include "idemrpc/toolkit.h"

#define MSG_KEY_LEN IDEM__OUTBOX_KEY_LEN

static const uint8_t LIMIT_KEY[1] = {'l'};
#define LIMIT_MAX ((uint64_t)1 << 31)

static void seq_key(uint8_t k[MSG_KEY_LEN], char kind, uint64_t seq)
{
    k[0] = (uint8_t)kind;
    idem__put_be64(k + 1, seq);
}

void idem__outbox_msg_key(uint8_t k[IDEM__OUTBOX_KEY_LEN], uint64_t seq)
{
    seq_key(k, 'm', seq);
}

static idem_code limit_decode(const void *v, size_t n, uint64_t *max_payload)
{
    if (n != 8) {
        return idem__err(IDEM_DATA_LOSS, "outbox: bad broker limit");
    }
    *max_payload = idem__get_be64(v);
    return IDEM_OK;
}

/* The most data put takes for a msg_id of li bytes: the broker's limit less the relay's
 * headers, at most IDEM_OUTBOX_MAX_DATA. */
static idem_code data_limit(idem_txn *t, size_t li, uint64_t *max_payload, size_t *max_data)
{
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, IDEM_OUTBOX_DB, LIMIT_KEY, sizeof(LIMIT_KEY), &v, &n);
    *max_payload = IDEM_OUTBOX_MAX_DATA;
    if (code == IDEM_OK) {
        code = limit_decode(v, n, max_payload);
    } else if (code == IDEM_NOT_FOUND) {
        code = IDEM_OK;
    }
    uint64_t headers = IDEM_OUTBOX_RELAY_HEADERS(li);
    uint64_t max = *max_payload > headers ? *max_payload - headers : 0;
    *max_data = max < IDEM_OUTBOX_MAX_DATA ? (size_t)max : IDEM_OUTBOX_MAX_DATA;
    return code;
}

idem_code idem_outbox_put(idem_txn *t, const char *subject, const char *msg_id, const void *data,
                          size_t len)
{
    size_t ls = idem__bounded_len(subject, IDEM_OUTBOX_MAX_SUBJECT);
    size_t li = idem__bounded_len(msg_id, IDEM_OUTBOX_MAX_MSG_ID);
    uint64_t head, next, max_payload;
    size_t max_data;
    uint8_t k[MSG_KEY_LEN];
    if (ls == 0 || li == 0 || len > IDEM_OUTBOX_MAX_DATA || (data == NULL && len > 0)) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "outbox: subject 1..%d bytes, msg_id 1..%d bytes, data up to %d bytes",
                         IDEM_OUTBOX_MAX_SUBJECT, IDEM_OUTBOX_MAX_MSG_ID, IDEM_OUTBOX_MAX_DATA);
    }
    idem_code code = data_limit(t, li, &max_payload, &max_data);
    if (code != IDEM_OK) {
        return code;
    }
    if (len > max_data) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "outbox: %zu bytes of data, over the %zu the broker takes with msg_id "
                         "%.*s (its max_payload %llu less the relay's %zu bytes of headers)",
                         len, max_data, (int)li, msg_id, (unsigned long long)max_payload,
                         IDEM_OUTBOX_RELAY_HEADERS(li));
    }
    uint8_t *v = malloc(4 + ls + li + len);
    if (v == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "outbox: out of memory");
    }
    v[0] = (uint8_t)(ls >> 8), v[1] = (uint8_t)ls;
    memcpy(v + 2, subject, ls);
    v[2 + ls] = (uint8_t)(li >> 8), v[3 + ls] = (uint8_t)li;
    memcpy(v + 4 + ls, msg_id, li);
    if (len > 0) {
        memcpy(v + 4 + ls + li, data, len);
    }
    code = idem__log_bounds_get(t, IDEM_OUTBOX_DB, &head, &next);
    if (code == IDEM_OK) {
        idem__outbox_msg_key(k, next);
        code = idem_txn_put(t, IDEM_OUTBOX_DB, k, sizeof(k), v, 4 + ls + li + len);
    }
    free(v);
    return code != IDEM_OK ? code : idem__log_bounds_put(t, IDEM_OUTBOX_DB, head, next + 1);
}

/* The subject and msg_id of a stored message v[0..n); *data: where its data begins. */
static idem_code msg_head(const uint8_t *v, size_t n, uint64_t seq, idem_outbox_msg *out,
                          size_t *data)
{
    size_t ls = n >= 2 ? (size_t)(v[0] << 8 | v[1]) : 0, li;
    if (ls == 0 || ls > IDEM_OUTBOX_MAX_SUBJECT || n < 4 + ls) {
        return idem__err(IDEM_DATA_LOSS, "outbox: bad message %llu", (unsigned long long)seq);
    }
    li = (size_t)(v[2 + ls] << 8 | v[3 + ls]);
    if (li == 0 || li > IDEM_OUTBOX_MAX_MSG_ID || n < 4 + ls + li) {
        return idem__err(IDEM_DATA_LOSS, "outbox: bad message %llu", (unsigned long long)seq);
    }
    out->seq = seq;
    memcpy(out->subject, v + 2, ls);
    out->subject[ls] = '\0';
    memcpy(out->msg_id, v + 4 + ls, li);
    out->msg_id[li] = '\0';
    *data = 4 + ls + li;
    return IDEM_OK;
}

idem_code idem__outbox_msg_id(const uint8_t *v, size_t n, uint64_t seq,
                              char msg_id[IDEM_OUTBOX_MAX_MSG_ID + 1])
{
    idem_outbox_msg m;
    size_t data;
    idem_code code = msg_head(v, n, seq, &m, &data);
    if (code == IDEM_OK) {
        memcpy(msg_id, m.msg_id, sizeof(m.msg_id));
    }
    return code;
}

idem_code idem__outbox_msg_decode(const uint8_t *v, size_t n, uint64_t seq, idem_outbox_msg *out)
{
    size_t data;
    idem_code code = msg_head(v, n, seq, out, &data);
    if (code != IDEM_OK) {
        return code;
    }
    out->len = n - data;
    if ((out->data = malloc(out->len + 1)) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "outbox: out of memory");
    }
    memcpy(out->data, v + data, out->len);
    ((char *)out->data)[out->len] = '\0';
    return IDEM_OK;
}

idem_code idem_outbox_pending(idem_store *st, uint64_t *pending)
{
    uint64_t head, next;
    idem_code code = idem__log_bounds_read(st, IDEM_OUTBOX_DB, &head, &next);
    *pending = code == IDEM_OK ? next - head : 0;
    return code;
}

idem_code idem_outbox_peek(idem_store *st, idem_outbox_msg *out, size_t max, size_t *n)
{
    uint64_t head, next;
    uint8_t k[MSG_KEY_LEN];
    void *v;
    size_t len;
    *n = 0;
    if (st == NULL || max > IDEM_OUTBOX_MAX_BATCH) {
        return idem__err(IDEM_INVALID_ARGUMENT, "outbox peek: a store, at most %d messages",
                         IDEM_OUTBOX_MAX_BATCH);
    }
    idem_code code = idem__log_bounds_read(st, IDEM_OUTBOX_DB, &head, &next);
    /* Looks at no more than 2·max slots: removed ones behind a slow head are skipped
     * (and a relay that finds only those moves head: idem__outbox_skip_removed). */
    for (uint64_t seq = head; code == IDEM_OK && seq < next && *n < max && seq - head < 2 * max;
         seq++) {
        idem__outbox_msg_key(k, seq);
        if ((code = idem_store_app_get(st, IDEM_OUTBOX_DB, k, sizeof(k), &v, &len)) ==
            IDEM_NOT_FOUND) {
            code = IDEM_OK;
            continue;
        }
        if (code == IDEM_OK) {
            code = idem__outbox_msg_decode(v, len, seq, &out[*n]);
            free(v);
            *n += code == IDEM_OK;
        }
    }
    if (code != IDEM_OK) {
        idem_outbox_msgs_free(out, *n);
        *n = 0;
    }
    return code;
}

static idem_code skip_txn(idem_txn *t, void *arg)
{
    uint64_t head, next, *moved_to = arg;
    idem_code code = idem__log_bounds_get(t, IDEM_OUTBOX_DB, &head, &next);
    if (code == IDEM_OK && head < next) {
        code = idem__outbox_advance(t, head, next);
    }
    if (code == IDEM_OK) {
        code = idem__log_bounds_get(t, IDEM_OUTBOX_DB, moved_to, &next);
        *moved_to = *moved_to != head ? *moved_to : 0;
    }
    return code;
}

idem_code idem__outbox_skip_removed(idem_store *st, bool *moved)
{
    uint64_t moved_to = 0;
    idem_code code = idem_store_run_txn(st, skip_txn, &moved_to);
    *moved = code == IDEM_OK && moved_to != 0;
    return code;
}

void idem_outbox_msgs_free(idem_outbox_msg *msgs, size_t n)
{
    for (size_t i = 0; msgs != NULL && i < n; i++) {
        free(msgs[i].data);
        msgs[i].data = NULL;
    }
}

typedef struct remove_args {
    const uint64_t *seqs;
    size_t n;
    bool park; /* keep each one's bytes under 'p' seq */
} remove_args;

/* Deletes message seq (IDEM_OK when gone before), parking its bytes first if asked. */
static idem_code remove_one(idem_txn *t, uint64_t seq, bool park)
{
    uint8_t k[MSG_KEY_LEN], pk[MSG_KEY_LEN];
    const void *v;
    size_t n;
    idem__outbox_msg_key(k, seq);
    idem_code code = park ? idem_txn_get(t, IDEM_OUTBOX_DB, k, sizeof(k), &v, &n) : IDEM_OK;
    if (park && code == IDEM_OK) {
        seq_key(pk, 'p', seq);
        code = idem_txn_put(t, IDEM_OUTBOX_DB, pk, sizeof(pk), v, n);
    }
    if (code == IDEM_OK) {
        code = idem_txn_del(t, IDEM_OUTBOX_DB, k, sizeof(k));
    }
    return code == IDEM_NOT_FOUND ? IDEM_OK : code; /* removed before (another relay) */
}

idem_code idem__outbox_advance(idem_txn *t, uint64_t head, uint64_t next)
{
    uint8_t k[MSG_KEY_LEN];
    const void *v;
    size_t n;
    uint64_t start = head;
    idem_code code = IDEM_OK;
    while (head < next && head - start < IDEM_OUTBOX_MAX_BATCH) {
        idem__outbox_msg_key(k, head);
        if ((code = idem_txn_get(t, IDEM_OUTBOX_DB, k, sizeof(k), &v, &n)) != IDEM_NOT_FOUND) {
            break;
        }
        code = IDEM_OK;
        head++;
    }
    if (code != IDEM_OK) {
        return code;
    }
    return head != start ? idem__log_bounds_put(t, IDEM_OUTBOX_DB, head, next) : IDEM_OK;
}

/* The bounds row first, as in put: on PostgreSQL writers then queue on it, no deadlock. */
static idem_code remove_txn(idem_txn *t, void *arg)
{
    remove_args *a = arg;
    uint64_t head, next;
    idem_code code = idem__log_bounds_get(t, IDEM_OUTBOX_DB, &head, &next);
    for (size_t i = 0; code == IDEM_OK && i < a->n; i++) {
        code = remove_one(t, a->seqs[i], a->park);
    }
    return code != IDEM_OK ? code : idem__outbox_advance(t, head, next);
}

static idem_code remove_or_park(idem_store *st, const uint64_t *seqs, size_t n, bool park)
{
    remove_args a = {seqs, n, park};
    if (st == NULL || (seqs == NULL && n > 0) || n > IDEM_OUTBOX_MAX_BATCH) {
        return idem__err(IDEM_INVALID_ARGUMENT, "outbox %s: a store, at most %d messages",
                         park ? "park" : "remove", IDEM_OUTBOX_MAX_BATCH);
    }
    return n == 0 ? IDEM_OK : idem_store_run_txn(st, remove_txn, &a);
}

idem_code idem_outbox_remove(idem_store *st, const uint64_t *seqs, size_t n)
{
    return remove_or_park(st, seqs, n, false);
}

idem_code idem_outbox_park(idem_store *st, const uint64_t *seqs, size_t n)
{
    return remove_or_park(st, seqs, n, true);
}

/* ---- the broker's limit ---- */

idem_code idem_outbox_broker_limit(idem_store *st, uint64_t *max_payload)
{
    void *v;
    size_t n;
    *max_payload = IDEM_OUTBOX_MAX_DATA;
    if (st == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "outbox limit: a store");
    }
    idem_code code = idem_store_app_get(st, IDEM_OUTBOX_DB, LIMIT_KEY, sizeof(LIMIT_KEY), &v, &n);
    if (code == IDEM_NOT_FOUND) {
        return IDEM_OK;
    }
    if (code == IDEM_OK) {
        code = limit_decode(v, n, max_payload);
        free(v);
    }
    return code;
}

static idem_code limit_txn(idem_txn *t, void *arg)
{
    uint8_t v[8];
    idem__put_be64(v, *(const uint64_t *)arg);
    return idem_txn_put(t, IDEM_OUTBOX_DB, LIMIT_KEY, sizeof(LIMIT_KEY), v, sizeof(v));
}

idem_code idem_outbox_set_broker_limit(idem_store *st, uint64_t max_payload)
{
    uint64_t now;
    if (max_payload == 0 || max_payload > LIMIT_MAX) {
        return idem__err(IDEM_INVALID_ARGUMENT, "outbox limit: 1..%llu bytes",
                         (unsigned long long)LIMIT_MAX);
    }
    idem_code code = idem_outbox_broker_limit(st, &now);
    if (code != IDEM_OK || now == max_payload) {
        return code;
    }
    return idem_store_run_txn(st, limit_txn, &max_payload);
}
