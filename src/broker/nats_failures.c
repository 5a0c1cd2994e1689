/* A message's failure tally: the deliveries its handler really failed (it ran with the
 * store up and returned a transient code), kept in the store so that every consumer of a
 * durable, in any process and after a restart, counts the same. A delivery that failed
 * because the store did is not in it (the broker's delivery count is): a store outage
 * never spends a message's max_deliver. It is counted per stream copy (the stream
 * sequence), as the broker counts deliveries: a message id that relays published twice
 * past the broker's duplicate window is two copies, and their failures do not add up
 * (one copy must not reach max_deliver at its second delivery, issue 35's campaign).
 *   business database "idem.nats.failures": durable \0 key → (be64 stream seq, be64
 *   failures) per copy, at most MAX_COPIES (a new copy beyond takes the oldest's place)
 * A row lives from a message's first real failure until the delivery whose effect commits
 * (deleted in that txn: the other copies are duplicates from then on) or its dead letter. */
#include <string.h>

#include "nats_internal.h"

#include "idemrpc/toolkit.h"

#define FAILURES_DB "idem.nats.failures"
#define TALLY_KEY_MAX (IDEM_MAX_CONSUMER_GROUP + 1 + IDEM_MAX_MSG_KEY)

#define MAX_COPIES 16
#define COPY_LEN 16 /* be64 seq, be64 failures */

typedef struct tally {
    uint8_t key[TALLY_KEY_MAX];
    size_t klen;
    uint64_t seq, failures;
} tally;

/* durable and key are bounded by the consumer (opts_check, key_of). */
static void tally_key(tally *t, const char *durable, const char *key)
{
    size_t ld = strlen(durable), lk = strlen(key);
    memcpy(t->key, durable, ld);
    t->key[ld] = '\0';
    memcpy(t->key + ld + 1, key, lk);
    t->klen = ld + 1 + lk;
}

/* The slot of copy seq in row (n copies): its own, else a new one at the end, else the
 * oldest copy's (the smallest sequence). */
static size_t copy_slot(const uint8_t *row, size_t n, uint64_t seq)
{
    size_t oldest = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t s = idem__get_be64(row + i * COPY_LEN);
        if (s == seq) {
            return i;
        }
        oldest = s < idem__get_be64(row + oldest * COPY_LEN) ? i : oldest;
    }
    return n < MAX_COPIES ? n : oldest;
}

static idem_code count_txn(idem_txn *t, void *arg)
{
    tally *y = arg;
    const void *v;
    size_t len = 0, n = 0;
    uint8_t row[MAX_COPIES * COPY_LEN];
    idem_code code = idem_txn_get(t, FAILURES_DB, y->key, y->klen, &v, &len);
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    if (code == IDEM_OK && len % COPY_LEN == 0 && len <= sizeof(row)) {
        memcpy(row, v, len);
        n = len / COPY_LEN; /* anything else (a row of a release that counted per key): 0 */
    }
    size_t i = copy_slot(row, n, y->seq);
    y->failures = i < n && idem__get_be64(row + i * COPY_LEN) == y->seq
                      ? idem__get_be64(row + i * COPY_LEN + 8) + 1
                      : 1;
    idem__put_be64(row + i * COPY_LEN, y->seq);
    idem__put_be64(row + i * COPY_LEN + 8, y->failures);
    n = i < n ? n : n + 1;
    return idem_txn_put(t, FAILURES_DB, y->key, y->klen, row, n * COPY_LEN);
}

idem_code idem__nats_failure_count(idem_store *st, const char *durable, const char *key,
                                   uint64_t stream_seq, uint64_t *failures)
{
    tally y;
    tally_key(&y, durable, key);
    y.seq = stream_seq;
    idem_code code = idem_store_run_txn(st, count_txn, &y);
    *failures = code == IDEM_OK ? y.failures : 0;
    return code;
}

idem_code idem__nats_failure_forget_in(idem_txn *t, const char *durable, const char *key)
{
    tally y;
    tally_key(&y, durable, key);
    idem_code code = idem_txn_del(t, FAILURES_DB, y.key, y.klen);
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

static idem_code forget_txn(idem_txn *t, void *arg)
{
    const char *const *dk = arg;
    return idem__nats_failure_forget_in(t, dk[0], dk[1]);
}

idem_code idem__nats_failure_forget(idem_store *st, const char *durable, const char *key)
{
    const char *dk[2] = {durable, key};
    return idem_store_run_txn(st, forget_txn, dk);
}

bool idem__nats_transient(idem_code code)
{
    switch (code) {
    case IDEM_UNAVAILABLE:
    case IDEM_DEADLINE_EXCEEDED:
    case IDEM_INTERNAL:
    case IDEM_RESOURCE_EXHAUSTED:
    case IDEM_ABORTED:
    case IDEM_CANCELLED:
    case IDEM_UNKNOWN:
        return true;
    default:
        return false;
    }
}
