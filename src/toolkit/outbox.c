/* The transactional outbox: messages a handler writes in its own write txn, so that a
 * message exists if and only if the business change that owes it committed. A relay
 * (nats.h) publishes them in order and removes each only after the broker acked it; a
 * crash between the two publishes it again under the same msg_id.
 *
 * One business database, IDEM_OUTBOX_DB:
 *   'q'            → be64 head ‖ be64 next      live messages are in [head, next)
 *   'm' be64 seq   → be16 |subject| subject ‖ be16 |msg_id| msg_id ‖ data
 * put appends at next; remove deletes one message and moves head past every removed one
 * at the front (at most IDEM_OUTBOX_MAX_BATCH per txn), so head only grows. */
#include <stdlib.h>
#include <string.h>

#include "toolkit_internal.h"

#include "idemrpc/toolkit.h"

#define MSG_KEY_LEN 9

static void msg_key(uint8_t k[MSG_KEY_LEN], uint64_t seq)
{
    k[0] = 'm';
    idem__put_be64(k + 1, seq);
}

idem_code idem_outbox_put(idem_txn *t, const char *subject, const char *msg_id, const void *data,
                          size_t len)
{
    size_t ls = idem__bounded_len(subject, IDEM_OUTBOX_MAX_SUBJECT);
    size_t li = idem__bounded_len(msg_id, IDEM_OUTBOX_MAX_MSG_ID);
    uint64_t head, next;
    uint8_t k[MSG_KEY_LEN];
    if (ls == 0 || li == 0 || len > IDEM_OUTBOX_MAX_DATA || (data == NULL && len > 0)) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "outbox: subject 1..%d bytes, msg_id 1..%d bytes, data up to %d bytes",
                         IDEM_OUTBOX_MAX_SUBJECT, IDEM_OUTBOX_MAX_MSG_ID, IDEM_OUTBOX_MAX_DATA);
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
    idem_code code = idem__log_bounds_get(t, IDEM_OUTBOX_DB, &head, &next);
    if (code == IDEM_OK) {
        msg_key(k, next);
        code = idem_txn_put(t, IDEM_OUTBOX_DB, k, sizeof(k), v, 4 + ls + li + len);
    }
    free(v);
    return code != IDEM_OK ? code : idem__log_bounds_put(t, IDEM_OUTBOX_DB, head, next + 1);
}

/* Splits a stored message into out (data copied). */
static idem_code msg_decode(const uint8_t *v, size_t n, uint64_t seq, idem_outbox_msg *out)
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
    out->len = n - 4 - ls - li;
    if ((out->data = malloc(out->len + 1)) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "outbox: out of memory");
    }
    memcpy(out->data, v + 4 + ls + li, out->len);
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
    /* Looks at no more than 2·max slots: removed ones behind a slow head are skipped. */
    for (uint64_t seq = head; code == IDEM_OK && seq < next && *n < max && seq - head < 2 * max;
         seq++) {
        msg_key(k, seq);
        if ((code = idem_store_app_get(st, IDEM_OUTBOX_DB, k, sizeof(k), &v, &len)) ==
            IDEM_NOT_FOUND) {
            code = IDEM_OK;
            continue;
        }
        if (code == IDEM_OK) {
            code = msg_decode(v, len, seq, &out[*n]);
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

void idem_outbox_msgs_free(idem_outbox_msg *msgs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(msgs[i].data);
        msgs[i].data = NULL;
    }
}

typedef struct remove_args {
    const uint64_t *seqs;
    size_t n;
} remove_args;

/* The bounds row first, as in put: on PostgreSQL writers then queue on it, no deadlock. */
static idem_code remove_txn(idem_txn *t, void *arg)
{
    remove_args *a = arg;
    uint64_t head, next;
    uint8_t k[MSG_KEY_LEN];
    const void *v;
    size_t n;
    idem_code code = idem__log_bounds_get(t, IDEM_OUTBOX_DB, &head, &next);
    for (size_t i = 0; code == IDEM_OK && i < a->n; i++) {
        msg_key(k, a->seqs[i]);
        if ((code = idem_txn_del(t, IDEM_OUTBOX_DB, k, sizeof(k))) == IDEM_NOT_FOUND) {
            code = IDEM_OK; /* removed before (another relay) */
        }
    }
    uint64_t start = head;
    while (code == IDEM_OK && head < next && head - start < IDEM_OUTBOX_MAX_BATCH) {
        msg_key(k, head);
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

idem_code idem_outbox_remove(idem_store *st, const uint64_t *seqs, size_t n)
{
    remove_args a = {seqs, n};
    if (st == NULL || (seqs == NULL && n > 0) || n > IDEM_OUTBOX_MAX_BATCH) {
        return idem__err(IDEM_INVALID_ARGUMENT, "outbox remove: a store, at most %d messages",
                         IDEM_OUTBOX_MAX_BATCH);
    }
    return n == 0 ? IDEM_OK : idem_store_run_txn(st, remove_txn, &a);
}
