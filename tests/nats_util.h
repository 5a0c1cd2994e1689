/* Helpers of the broker tests (test_nats.c, test_nats_faults.c): a stream of its own per
 * test on $IDEMRPC_TEST_NATS (skipped when unset) and a store of $IDEMRPC_TEST_BACKEND. */
#ifndef IDEMRPC_TEST_NATS_UTIL_H
#define IDEMRPC_TEST_NATS_UTIL_H

#include <nats/nats.h>

#include "nats_effect.h"
#include "testutil.h"

typedef struct nt {
    tu_backend b;
    idem_store *st;
    natsConnection *nc;
    jsCtx *js;
    const char *url;
    char stream[32], in[48], dead[48];
} nt;

/* A fresh stream "T<tag><random>" taking <stream>.in and <stream>.dead, and a store. */
void nt_setup(nt *e, const char *tag);
void nt_teardown(nt *e);
/* Publishes payload to <stream>.in; key and msg_id may be NULL (no such header). Retries
 * while the broker is away (a restart test). */
void nt_publish(nt *e, const char *key, const char *msg_id, const char *payload);
/* Consumer options for durable on <stream>.in, dead letters to <stream>.dead, ne_effect. */
void nt_opts(nt *e, idem_nats_consumer_opts *o, const char *durable);
idem_nats_consumer *nt_consumer(nt *e, idem_nats_consumer_opts *o);
/* True when the durable has nothing left to deliver and nothing delivered unacked. */
bool nt_settled(nt *e, const char *durable);
/* Polls c until the durable is settled (a hang guard fails the test). */
void nt_drain(nt *e, idem_nats_consumer *c, const char *durable);
/* effects[key] as a number (0 when absent). */
long nt_effects(nt *e, const char *key);
/* How many messages the test's stream holds (both subjects). */
uint64_t nt_stream_msgs(nt *e);
/* The test's stream forgets every message it acked (deleted and made again: what a power
 * cut of a broker whose file store had synced nothing of it does). */
void nt_forget_stream(nt *e);
/* An outbox relay from the test's store to its broker (defaults). */
idem_nats_relay *nt_relay(nt *e);
/* Reads every dead letter so far: their reasons (at most max) and the count. */
int nt_dead_letters(nt *e, char reasons[][256], int max);
/* Inside t: outbox messages msg_id "order-<i>", data "amount=1", for i in [from, to). */
idem_code nt_put_orders(idem_txn *t, const char *subject, int from, int to);
/* nt_put_orders in a transaction of its own. */
void nt_commit_orders(idem_store *st, const char *subject, int from, int to);
/* Commits orders [from, to) to subject and runs r until the outbox is empty, for up to
 * NT_RELAY_ROUNDS rounds (the broker may be starting: failed rounds are paced). */
#define NT_RELAY_ROUNDS 150
void nt_commit_and_relay(nt *e, idem_nats_relay *r, const char *subject, int from, int to);
/* The store as nats_worker's STORE argument ("lmdb:DIR" or "pg:CONNINFO"), static. */
const char *nt_store_spec(nt *e);

#endif
