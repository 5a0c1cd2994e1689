/* A message's failure tally: the deliveries its handler really failed (it ran with the
 * store up and returned a transient code), kept in the store so that every consumer of a
 * durable, in any process and after a restart, counts the same. A delivery that failed
 * because the store did is not in it (the broker's delivery count is): a store outage
 * never spends a message's max_deliver.
 *   business database "idem.nats.failures": durable \0 key → be64 failures
 * A row lives from a message's first real failure until the delivery whose effect commits
 * (deleted in that txn) or its dead letter. */
#include <string.h>

#include "nats_internal.h"

#include "idemrpc/toolkit.h"

#define FAILURES_DB "idem.nats.failures"
#define TALLY_KEY_MAX (IDEM_MAX_CONSUMER_GROUP + 1 + IDEM_MAX_MSG_KEY)

typedef struct tally {
    uint8_t key[TALLY_KEY_MAX];
    size_t klen;
    uint64_t failures;
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

static idem_code count_txn(idem_txn *t, void *arg)
{
    tally *y = arg;
    const void *v;
    size_t n;
    uint8_t out[8];
    idem_code code = idem_txn_get(t, FAILURES_DB, y->key, y->klen, &v, &n);
    y->failures = code == IDEM_OK && n == 8 ? idem__get_be64(v) : 0;
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    idem__put_be64(out, ++y->failures);
    return idem_txn_put(t, FAILURES_DB, y->key, y->klen, out, sizeof(out));
}

idem_code idem__nats_failure_count(idem_store *st, const char *durable, const char *key,
                                   uint64_t *failures)
{
    tally y;
    tally_key(&y, durable, key);
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
