/* Commissions on NATS JetStream (--nats URL): the broker replaces the in-store
 * dispatcher of commission.c, the rest of the service does not change.
 *
 *   Notify's txn ──idem_outbox_put──▶ outbox ──relay──▶ stream <prefix>, subject
 *   <prefix>.commission ──durable "commission"──▶ credit_commission in idem_consume
 *
 * A message exists iff the payment committed (the outbox is written in Notify's txn);
 * the relay removes it only after JetStream acked its publish, under Nats-Msg-Id
 * "<order_id>:<rule_id>"; the consumer keys it by the same business number, read from the
 * payload, and acks only after the credit and its marker committed. Every instance on a
 * shared PostgreSQL store runs a relay and a consumer on the one durable. The fault
 * options of the tests work here too: --fail-rate (the consumer throws after its write:
 * nak, redelivered), --crash-at consume | before_ack (SIGKILL mid-consume, or after the
 * commit before the ack: redelivered after the ack wait as a duplicate). */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "payments.h"

#define DURABLE "commission"
#define ACK_WAIT_MS 2000 /* a dead consumer's messages come back this fast */
#define MAX_DELIVER 20   /* --fail-rate 0.5 fails 20 in a row once in a million */
#define DRAIN_POLL_MS 20

/* The business number first: "<order_id>:<rule_id>" from the payload. */
static idem_code commission_key(const void *data, size_t len, char *key, size_t cap, void *arg)
{
    (void)arg;
    char order_id[PAY_MAX_FIELD], rule_id[PAY_MAX_FIELD];
    if (!pay_form_get(data, len, "order_id", order_id, sizeof(order_id)) ||
        !pay_form_get(data, len, "rule_id", rule_id, sizeof(rule_id))) {
        return IDEM_INVALID_ARGUMENT;
    }
    snprintf(key, cap, "%s:%s", order_id, rule_id);
    return IDEM_OK;
}

/* The consumer: credits the commission account in idem_consume's txn. */
static idem_code credit_commission(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    pay_service *svc = arg;
    char account[PAY_MAX_FIELD + 16];
    long long amount = 0;
    if (!pay_form_get(m->data, m->len, "account", account, sizeof(account))) {
        return IDEM_INVALID_ARGUMENT; /* dead-lettered: no redelivery fixes it */
    }
    pay_form_amount(m->data, m->len, "amount", &amount); /* 0 when it rounds to 0 */
    svc->consumes++;
    idem_code code = pay_ledger_add(t, account, amount, NULL);
    pay_maybe_crash(svc, "consume"); /* after the write, before the commit */
    if (code == IDEM_OK && pay_rand_unit(svc) < svc->faults.fail_rate) {
        pay_count(svc, &svc->stats.failures);
        return IDEM_UNAVAILABLE; /* the consumer throws after its write */
    }
    return code;
}

static void on_event(idem_nats_event ev, const idem_nats_msg *m, const char *reason, void *arg)
{
    pay_service *svc = arg;
    (void)m, (void)reason;
    if (ev == IDEM_NATS_COMMITTED) {
        pay_maybe_crash(svc, "before_ack"); /* committed, not acked: redelivered */
    }
}

static idem_code consumer_open(pay_service *svc)
{
    idem_nats_consumer_opts o;
    idem_nats_consumer_opts_init(&o);
    o.url = svc->nats_url;
    o.stream = svc->nats_stream;
    o.durable = DURABLE;
    o.filter_subject = svc->nats_subject;
    o.dead_letter_subject = svc->nats_dead;
    o.key_fn = commission_key;
    o.handler = credit_commission;
    o.handler_arg = svc;
    o.on_event = on_event;
    o.event_arg = svc;
    o.ack_wait_ms = ACK_WAIT_MS;
    o.max_deliver = MAX_DELIVER;
    o.backoff_ms = 10;
    o.backoff_max_ms = 200;
    o.fetch_wait_ms = 100;
    idem_code code = idem_nats_consumer_open(&svc->consumer, svc->store, &o);
    return code != IDEM_OK ? code : idem_nats_consumer_start(svc->consumer);
}

idem_code pay_broker_start(pay_service *svc)
{
    idem_nats_relay_opts ro;
    const char *subjects[] = {svc->nats_subject, svc->nats_dead};
    svc->rng = svc->faults.seed != 0 ? svc->faults.seed : UINT64_C(0x9e3779b97f4a7c15);
    idem_code code = idem_nats_ensure_stream(svc->nats_url, svc->nats_stream, subjects, 2);
    idem_nats_relay_opts_init(&ro);
    ro.url = svc->nats_url;
    ro.idle_ms = DRAIN_POLL_MS;
    if (code == IDEM_OK && (code = idem_nats_relay_open(&svc->relay, svc->store, &ro)) == IDEM_OK) {
        code = idem_nats_relay_start(svc->relay);
    }
    if (code == IDEM_OK) {
        code = consumer_open(svc);
    }
    if (code != IDEM_OK) {
        pay_set_errmsg("nats %s: %s", svc->nats_url, idem_errmsg());
        pay_broker_stop(svc);
    }
    return code;
}

void pay_broker_stop(pay_service *svc)
{
    idem_nats_consumer_close(svc->consumer);
    idem_nats_relay_close(svc->relay);
    svc->consumer = NULL;
    svc->relay = NULL;
}

/* Messages not yet acked or dead-lettered: in the outbox, or in the durable. */
static idem_code broker_pending(pay_service *svc, uint64_t *pending)
{
    uint64_t outbox = 0, durable = 0;
    idem_code code = idem_outbox_pending(svc->store, &outbox);
    if (code == IDEM_OK) {
        code = idem_nats_consumer_pending(svc->consumer, &durable);
    }
    *pending = outbox + durable;
    return code;
}

idem_code pay_broker_drain(idem_call *call, pay_service *svc, uint64_t wait_ms)
{
    struct timespec pause = {0, DRAIN_POLL_MS * 1000000L};
    uint64_t pending = UINT64_MAX;
    idem_nats_stats s;
    for (uint64_t waited = 0; waited <= wait_ms; waited += DRAIN_POLL_MS) {
        if (broker_pending(svc, &pending) == IDEM_OK && pending == 0) {
            break;
        }
        nanosleep(&pause, NULL);
    }
    if (pending != 0) {
        return idem_call_fail(call, IDEM_DEADLINE_EXCEEDED, "not drained: %llu pending",
                              (unsigned long long)pending);
    }
    idem_nats_consumer_stats(svc->consumer, &s);
    return pay_reply(call,
                     "pending=0&delivered=%llu&consumed=%llu&duplicates=%llu&failures=%llu&"
                     "redeliveries=%llu&dead_lettered=%llu",
                     (unsigned long long)s.fetched, (unsigned long long)s.committed,
                     (unsigned long long)s.duplicates, (unsigned long long)s.naked,
                     (unsigned long long)(s.fetched - (s.committed + s.dead_lettered)),
                     (unsigned long long)s.dead_lettered);
}
