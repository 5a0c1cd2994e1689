/* Commissions: every paid order owes one credit per rule, applied by the consumer of an
 * at-least-once queue exactly once per (order_id, rule_id) through idem_consume.
 *
 * The queue is a transactional outbox in the same store: Notify writes the messages in
 * the txn that marks the order PAID, so a message exists if and only if the payment
 * committed (no lost message, no message for a payment that rolled back). A dispatcher
 * thread plays the broker: it delivers each message to the consumer and deletes it only
 * after an ack, in a later txn. That is the at-least-once window real brokers have (a
 * crash between consume and delete redelivers), and idem_consume is what closes it.
 * On PostgreSQL every instance runs a dispatcher on the one shared outbox: two of them
 * may deliver the same message, and idem_consume makes the second a duplicate.
 * For the tests it also misbehaves on purpose: duplicate deliveries, consumers that throw
 * after writing, SIGKILL in the middle of a consume or between consume and ack.
 *
 * PAY_DB_OUTBOX: "q" → be64 head ‖ be64 next; 'm' be64 seq → "order_id=..&rule_id=..&
 * account=..&amount=..". Live messages are in [head, next); head passes acked ones. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "payments.h"

#define CONSUMER_GROUP "commission"
#define ROUND_MAX 256 /* messages looked at per dispatcher round */
#define POLL_MS 20    /* the dispatcher looks at an empty outbox this often */
#define RETRY_MS 2    /* and at one with messages left after a round this often */
#define DRAIN_MAX_MS 30000
#define MSG_MAX 256

typedef struct rule {
    const char *id, *account;
    long long bps; /* basis points of the order amount */
} rule;

static const rule rules[] = {
    {"platform-fee", "commission:platform", 200},
    {"sales-bonus", "commission:sales", 100},
};

static const char META_KEY[] = "q";

static void be64_put(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (56 - 8 * i));
    }
}

static uint64_t be64_get(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        v = v << 8 | p[i];
    }
    return v;
}

static void msg_key(uint8_t k[9], uint64_t seq)
{
    k[0] = 'm';
    be64_put(k + 1, seq);
}

static idem_code meta_decode(const void *v, size_t n, uint64_t *head, uint64_t *next)
{
    if (n != 16) {
        return IDEM_DATA_LOSS;
    }
    *head = be64_get(v);
    *next = be64_get((const uint8_t *)v + 8);
    return IDEM_OK;
}

static idem_code meta_get(idem_txn *t, uint64_t *head, uint64_t *next)
{
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, PAY_DB_OUTBOX, META_KEY, 1, &v, &n);
    *head = *next = 0;
    if (code == IDEM_NOT_FOUND) {
        return IDEM_OK;
    }
    return code != IDEM_OK ? code : meta_decode(v, n, head, next);
}

static idem_code meta_put(idem_txn *t, uint64_t head, uint64_t next)
{
    uint8_t v[16];
    be64_put(v, head);
    be64_put(v + 8, next);
    return idem_txn_put(t, PAY_DB_OUTBOX, META_KEY, 1, v, sizeof(v));
}

idem_code pay_commission_enqueue(pay_service *svc, idem_txn *t, const char *order_id,
                                 const char *merchant, long long amount)
{
    (void)merchant;
    uint64_t head = 0, next = 0;
    uint8_t k[9];
    char msg[MSG_MAX], id[2 * PAY_MAX_FIELD + 2];
    idem_code code = svc->nats_url != NULL ? IDEM_OK : meta_get(t, &head, &next);
    for (size_t i = 0; code == IDEM_OK && i < sizeof(rules) / sizeof(rules[0]); i++) {
        int n = snprintf(msg, sizeof(msg), "order_id=%s&rule_id=%s&account=%s&amount=%lld",
                         order_id, rules[i].id, rules[i].account, amount * rules[i].bps / 10000);
        if (svc->nats_url != NULL) { /* the library's outbox, relayed to JetStream */
            snprintf(id, sizeof(id), "%s:%s", order_id, rules[i].id);
            code = idem_outbox_put(t, svc->nats_subject, id, msg, (size_t)n);
            continue;
        }
        msg_key(k, next++);
        code = idem_txn_put(t, PAY_DB_OUTBOX, k, sizeof(k), msg, (size_t)n);
    }
    return code != IDEM_OK || svc->nats_url != NULL ? code : meta_put(t, head, next);
}

/* ---- the broker ---- */

double pay_rand_unit(pay_service *svc)
{
    uint64_t x = svc->rng; /* xorshift64*: reproducible from --seed */
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    svc->rng = x;
    return (double)((x * UINT64_C(2685821657736338717)) >> 11) / (double)(UINT64_C(1) << 53);
}

void pay_maybe_crash(pay_service *svc, const char *point)
{
    if (svc->faults.crash_at != NULL && strcmp(svc->faults.crash_at, point) == 0 &&
        svc->consumes == svc->faults.crash_on) {
        raise(SIGKILL); /* like kill -9: no cleanup, an open txn is simply gone */
    }
}

void pay_count(pay_service *svc, uint64_t *counter)
{
    pthread_mutex_lock(&svc->mu);
    (*counter)++;
    pthread_mutex_unlock(&svc->mu);
}

typedef struct delivery {
    pay_service *svc;
    const char *msg;
    size_t len;
} delivery;

/* The consumer: credits the commission account in idem_consume's txn. */
static idem_code credit_commission(idem_txn *t, void *arg)
{
    delivery *d = arg;
    char account[PAY_MAX_FIELD + 16];
    long long amount = 0;
    if (!pay_form_get(d->msg, d->len, "account", account, sizeof(account))) {
        return IDEM_DATA_LOSS;
    }
    pay_form_amount(d->msg, d->len, "amount", &amount); /* 0 when the commission rounds to 0 */
    d->svc->consumes++;
    idem_code code = pay_ledger_add(t, account, amount, NULL);
    pay_maybe_crash(d->svc, "consume"); /* after the write, before the commit */
    if (code == IDEM_OK && pay_rand_unit(d->svc) < d->svc->faults.fail_rate) {
        pay_count(d->svc, &d->svc->stats.failures);
        return IDEM_UNAVAILABLE; /* the consumer throws after its write */
    }
    return code;
}

/* Deletes message seq and moves head past every acked message at the front. The queue
 * row comes first, as in enqueue: on PostgreSQL, where a read locks its row until the
 * txn ends, the dispatchers of several instances then queue up instead of deadlocking. */
static idem_code ack_txn(idem_txn *t, void *arg)
{
    uint64_t seq = *(const uint64_t *)arg, head, next;
    uint8_t k[9];
    const void *v;
    size_t n;
    msg_key(k, seq);
    idem_code code = meta_get(t, &head, &next);
    if (code != IDEM_OK) {
        return code;
    }
    code = idem_txn_del(t, PAY_DB_OUTBOX, k, sizeof(k));
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    uint64_t start = head;
    while (head < next && head - start < ROUND_MAX) {
        msg_key(k, head);
        if ((code = idem_txn_get(t, PAY_DB_OUTBOX, k, sizeof(k), &v, &n)) != IDEM_NOT_FOUND) {
            break;
        }
        head++;
    }
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    return head == start ? IDEM_OK : meta_put(t, head, next);
}

/* Delivers one message, twice when the dice say so; acks after the first ACK. */
static void deliver(pay_service *svc, uint64_t seq, const char *msg, size_t len)
{
    char order_id[PAY_MAX_FIELD], rule_id[PAY_MAX_FIELD], key[2 * PAY_MAX_FIELD + 2];
    delivery d = {svc, msg, len};
    idem_consume_info info;
    if (!pay_form_get(msg, len, "order_id", order_id, sizeof(order_id)) ||
        !pay_form_get(msg, len, "rule_id", rule_id, sizeof(rule_id))) {
        return; /* unreadable: stays in the outbox for a person to look at */
    }
    snprintf(key, sizeof(key), "%s:%s", order_id, rule_id); /* one credit per (order, rule) */
    int copies = pay_rand_unit(svc) < svc->faults.redeliver_rate ? 2 : 1;
    bool acked = false;
    for (int i = 0; i < copies; i++) {
        pay_count(svc, i == 0 ? &svc->stats.delivered : &svc->stats.redeliveries);
        idem_consume_verdict v =
            idem_consume_ex(svc->store, CONSUMER_GROUP, key, credit_commission, &d, &info);
        if (v == IDEM_CONSUME_REJECT) { /* no redelivery can succeed: dead-letter it */
            fprintf(stderr, "commission: message %s rejected (%s), removed from the outbox\n", key,
                    idem_code_name(info.code));
            idem_store_run_txn(svc->store, ack_txn, &seq);
            return;
        }
        if (v != IDEM_CONSUME_ACK) {
            continue; /* RETRY: nothing recorded, the next round redelivers */
        }
        pay_count(svc, info.duplicate ? &svc->stats.duplicates : &svc->stats.consumed);
        if (!acked) {
            pay_maybe_crash(svc, "before_ack"); /* consumed, not yet acked: a redelivery follows */
            acked = idem_store_run_txn(svc->store, ack_txn, &seq) == IDEM_OK;
        }
    }
}

static idem_code outbox_bounds(idem_store *st, uint64_t *head, uint64_t *next)
{
    void *v;
    size_t n;
    idem_code code = idem_store_app_get(st, PAY_DB_OUTBOX, META_KEY, 1, &v, &n);
    *head = *next = 0;
    if (code == IDEM_NOT_FOUND) {
        return IDEM_OK;
    }
    if (code == IDEM_OK) {
        code = meta_decode(v, n, head, next);
        free(v);
    }
    return code;
}

/* One pass over the outbox; *pending = messages not yet acked when it started. */
static void dispatch_round(pay_service *svc, uint64_t *pending)
{
    uint64_t head, next;
    uint8_t k[9];
    void *v;
    size_t n;
    *pending = UINT64_MAX;
    if (outbox_bounds(svc->store, &head, &next) != IDEM_OK) {
        return;
    }
    *pending = next - head;
    for (uint64_t seq = head; seq < next && seq - head < ROUND_MAX; seq++) {
        msg_key(k, seq);
        if (idem_store_app_get(svc->store, PAY_DB_OUTBOX, k, sizeof(k), &v, &n) == IDEM_OK) {
            deliver(svc, seq, v, n);
            free(v);
        }
    }
}

static void *dispatcher_main(void *arg)
{
    pay_service *svc = arg;
    struct timespec ts;
    pthread_mutex_lock(&svc->mu);
    while (!svc->stopping) {
        pthread_mutex_unlock(&svc->mu);
        uint64_t pending;
        dispatch_round(svc, &pending);
        pthread_mutex_lock(&svc->mu);
        svc->pending = pending;
        svc->rounds++;
        pthread_cond_broadcast(&svc->cv);
        /* Idle: look again in POLL_MS. Messages left (retries): soon, but never spin. */
        long wait_ms = pending == 0 ? POLL_MS : RETRY_MS;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += wait_ms * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        while (!svc->stopping && pthread_cond_timedwait(&svc->cv, &svc->mu, &ts) == 0) {
        }
    }
    pthread_mutex_unlock(&svc->mu);
    return NULL;
}

idem_code pay_commission_start(pay_service *svc)
{
    if (svc->nats_url != NULL) {
        return pay_broker_start(svc);
    }
    svc->rng = svc->faults.seed != 0 ? svc->faults.seed : UINT64_C(0x9e3779b97f4a7c15);
    svc->pending = UINT64_MAX;
    if (pthread_create(&svc->dispatcher, NULL, dispatcher_main, svc) != 0) {
        return IDEM_INTERNAL;
    }
    return IDEM_OK;
}

void pay_commission_stop(pay_service *svc)
{
    if (svc->nats_url != NULL) {
        pay_broker_stop(svc);
        return;
    }
    pthread_mutex_lock(&svc->mu);
    svc->stopping = true;
    pthread_cond_broadcast(&svc->cv);
    pthread_mutex_unlock(&svc->mu);
    pthread_join(svc->dispatcher, NULL);
}

/* Waits (mu held) until a round that started after this call saw an empty outbox. */
static bool wait_drained(pay_service *svc, uint64_t wait_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)(wait_ms / 1000);
    ts.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    uint64_t start = svc->rounds; /* the round in progress may predate the caller's writes */
    while (!svc->stopping && (svc->rounds < start + 2 || svc->pending != 0)) {
        if (pthread_cond_timedwait(&svc->cv, &svc->mu, &ts) == ETIMEDOUT) {
            break;
        }
    }
    return svc->rounds >= start + 2 && svc->pending == 0;
}

/* pay.Commission/Drain "timeout_ms=N": waits until every queued commission is consumed
 * and acked, then reports the broker's counters. DEADLINE_EXCEEDED if it did not drain. */
idem_code pay_commission_drain(idem_call *call, void *arg)
{
    pay_service *svc = arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    long long wait_ms = 5000;
    pay_form_amount(p, n, "timeout_ms", &wait_ms); /* optional */
    wait_ms = wait_ms < DRAIN_MAX_MS ? wait_ms : DRAIN_MAX_MS;
    if (svc->nats_url != NULL) {
        return pay_broker_drain(call, svc, (uint64_t)wait_ms);
    }
    pthread_mutex_lock(&svc->mu);
    bool drained = wait_drained(svc, (uint64_t)wait_ms);
    pay_stats s = svc->stats;
    uint64_t pending = svc->pending;
    pthread_mutex_unlock(&svc->mu);
    if (!drained) {
        return idem_call_fail(call, IDEM_DEADLINE_EXCEEDED, "outbox not drained: %llu pending",
                              (unsigned long long)pending);
    }
    return pay_reply(call,
                     "pending=0&delivered=%llu&consumed=%llu&duplicates=%llu&failures=%llu&"
                     "redeliveries=%llu",
                     (unsigned long long)s.delivered, (unsigned long long)s.consumed,
                     (unsigned long long)s.duplicates, (unsigned long long)s.failures,
                     (unsigned long long)s.redeliveries);
}
