/* A broker that forgets what it acked (issue 41): JetStream acks a publish before its file
 * store synced it, so a crash of its host loses the messages acked since the last sync.
 * The test makes that power cut on a real nats-server (scripts/services.sh: freeze-nats
 * copies its store with the broker stopped; amnesia-nats kills it and starts it on the
 * copy) with the outbox relay and a durable consumer on either side, and every committed
 * message must still take effect once. Needs $IDEMRPC_TEST_NATS and $IDEMRPC_SERVICES;
 * runs on LMDB (nats_amnesia) and PostgreSQL (nats_amnesia_pg). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

#include "nats_util.h"

#define ORDERS 40
#define WAIT_ROUNDS 150 /* relay round + consumer poll each: a hang guard, not timing */

typedef struct put_args {
    int from, to;
    const char *subject;
} put_args;

static idem_code put_orders(idem_txn *t, void *arg)
{
    put_args *a = arg;
    char id[32];
    idem_code code = IDEM_OK;
    for (int i = a->from; code == IDEM_OK && i < a->to; i++) {
        snprintf(id, sizeof(id), "order-%d", i);
        code = idem_outbox_put(t, a->subject, id, "amount=1", 8);
    }
    return code;
}

/* Commits orders [from, to) with their outbox messages and relays them until acked. */
static void commit_and_relay(nt *e, idem_nats_relay *r, int from, int to)
{
    put_args a = {from, to, e->in};
    uint64_t pending = 1;
    cr_assert_eq(idem_store_run_txn(e->st, put_orders, &a), IDEM_OK, "%s", idem_errmsg());
    for (int i = 0; i < WAIT_ROUNDS && pending > 0; i++) {
        cr_assert_eq(idem_nats_relay_run_once(r, NULL), IDEM_OK, "%s", idem_errmsg());
        cr_assert_eq(idem_outbox_pending(e->st, &pending), IDEM_OK, "%s", idem_errmsg());
    }
    cr_assert_eq(pending, 0, "the broker never acked orders %d..%d", from, to - 1);
}

static void services(const char *what)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "%s %s", getenv("IDEMRPC_SERVICES"), what);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

static int applied(nt *e)
{
    char key[32];
    int n = 0;
    for (int i = 0; i < ORDERS; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        n += nt_effects(e, key) > 0;
    }
    return n;
}

Test(nats_amnesia, a_broker_that_loses_acked_messages_still_applies_each_committed_one_once)
{
    nt e;
    idem_nats_relay_opts ro;
    idem_nats_relay *r;
    idem_nats_consumer_opts co;
    char key[32];
    if (getenv("IDEMRPC_SERVICES") == NULL) {
        cr_skip_test("IDEMRPC_SERVICES not set: cannot cut the broker's power");
    }
    nt_setup(&e, "amnesia");
    idem_nats_relay_opts_init(&ro);
    ro.url = e.url;
    cr_assert_eq(idem_nats_relay_open(&r, e.st, &ro), IDEM_OK, "%s", idem_errmsg());
    nt_opts(&e, &co, "credit");
    co.fetch_wait_ms = 100;
    idem_nats_consumer *c = nt_consumer(&e, &co); /* the durable, before the copy */
    commit_and_relay(&e, r, 0, ORDERS / 2);
    services("freeze-nats");                     /* what the broker's disk holds now */
    commit_and_relay(&e, r, ORDERS / 2, ORDERS); /* acked, not on that disk */
    services("amnesia-nats");
    for (int i = 0; i < WAIT_ROUNDS && (applied(&e) < ORDERS || !nt_settled(&e, "credit")); i++) {
        (void)idem_nats_relay_run_once(r, NULL); /* fails while the broker is away */
        (void)idem_nats_consumer_poll(c, NULL);
    }
    for (int i = 0; i < ORDERS; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        cr_expect_eq(nt_effects(&e, key), 1, "%s: %ld effects", key, nt_effects(&e, key));
    }
    idem_nats_consumer_close(c);
    idem_nats_relay_close(r);
    nt_teardown(&e);
}
