/* idemrpc-payments: a small payment service on idemrpc (see README.md).
 *
 *   orders.c      pay.Order/Create (token), Cancel, Get, Count; the order state machine
 *   callback.c    pay.Callback/Notify: the channel's payment callback, CREATED → PAID
 *   refund.c      pay.Order/Refund: PAID → REFUNDED with an optimistic balance debit
 *   ledger.c      versioned balances; pay.Merchant/Settle, pay.Merchant/SettleDay (the
 *                 daily payout under a lease lock), pay.Account/Balance
 *   commission.c  the outbox and its at-least-once dispatcher; pay.Commission/Drain
 *   commission_nats.c  the same on NATS JetStream (--nats): the library's outbox, its
 *                 relay and a durable consumer
 *   pg_tables.c   PostgreSQL: the service's own tables pay_order and pay_callback
 *   form.c        "k=v&k=v" payloads
 * Money is integer cents. Everything the service knows lives in one store: an LMDB
 * directory, or a PostgreSQL database shared by several instances. */
#ifndef PAYMENTS_H
#define PAYMENTS_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <idemrpc/idemrpc.h>
#include <idemrpc/nats.h>

#define PAY_MAX_AMOUNT 100000000000LL /* 1e9 units of currency, in cents */
#define PAY_MAX_FIELD 64
#define PAY_DB_ORDERS "orders"     /* order id → "merchant=..&amount=.." */
#define PAY_DB_SEQ "seq"           /* "order" → next order number */
#define PAY_DB_BALANCES "balances" /* account → versioned int64 cents */
#define PAY_DB_OUTBOX "outbox"     /* be64 seq → commission message; "q" → head, next */

/* Fault injection for the tests' at-least-once harness (all off by default). */
typedef struct pay_faults {
    uint64_t seed;            /* the dispatcher's PRNG */
    double fail_rate;         /* a consume throws after its write (0..1) */
    double redeliver_rate;    /* a message is delivered twice (0..1) */
    const char *crash_at;     /* "consume" (mid-consume) | "before_ack" | NULL */
    unsigned crash_on;        /* the n-th consume crashes (1 = the first) */
    unsigned create_delay_ms; /* a slow Create, for client timeouts */
} pay_faults;

/* The dispatcher's counters, reported by pay.Commission/Drain. */
typedef struct pay_stats {
    uint64_t delivered, consumed, duplicates, failures, redeliveries;
} pay_stats;

typedef struct pay_service {
    idem_store *store;
    bool pg; /* PostgreSQL: order status in the table pay_order, not the state machine */
    pay_faults faults;
    pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv;  /* CLOCK_MONOTONIC: a dispatcher round finished, or stopping */
    bool stopping;
    uint64_t pending; /* unacked messages when the last round started */
    uint64_t rounds;  /* dispatcher rounds finished */
    pay_stats stats;
    uint64_t rng;      /* dispatcher thread only */
    unsigned consumes; /* dispatcher thread only: consume calls, for crash_on */
    pthread_t dispatcher;
    /* --nats: commissions through JetStream instead of the in-store dispatcher */
    const char *nats_url;
    char nats_stream[PAY_MAX_FIELD], nats_subject[PAY_MAX_FIELD + 16],
        nats_dead[PAY_MAX_FIELD + 16];
    idem_nats_relay *relay;
    idem_nats_consumer *consumer;
} pay_service;

extern const idem_state_machine pay_order_machine;

/* ---- form.c ---- */
/* Copies field `name` of a "k=v&k=v" payload into out. Values are 1..cap-1 bytes of
 * [A-Za-z0-9_.:-]; false when absent or malformed. */
bool pay_form_get(const void *p, size_t n, const char *name, char *out, size_t cap);
/* An amount field: 1..PAY_MAX_AMOUNT decimal cents. */
bool pay_form_amount(const void *p, size_t n, const char *name, long long *out);
/* Formats into a stack buffer and replies OK with it. */
idem_code pay_reply(idem_call *call, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A store or SQL step failed: answered as a transient code (INTERNAL for a final one),
 * so the handler's txn rolls back, the key is freed and the client's retry runs again.
 * The message names the step and pay_errmsg(). */
idem_code pay_rollback(idem_call *call, idem_code code, const char *what);
/* The detail of the example's own last failure on this thread (pg_tables.c sets it,
 * NULL clears it); pay_errmsg() reports and clears it, or gives idem_errmsg(). */
void pay_set_errmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *pay_errmsg(void);

/* ---- orders.c ---- */
idem_code pay_order_load(idem_txn *t, const char *order_id, char *merchant, long long *amount);
/* The order's status: in the state machine on LMDB, in pay_order on PostgreSQL. move is
 * idem_sm_advance's compare-and-set (same codes and outcomes) on either; buf holds at
 * least IDEM_SM_MAX_STATE + 1 bytes. status_read reads outside a txn. */
idem_code pay_order_move(idem_txn *t, const char *order_id, const char *from, const char *to,
                         idem_sm_outcome *out);
idem_code pay_order_status(idem_txn *t, const char *order_id, char *buf, size_t cap);
idem_code pay_order_status_read(pay_service *svc, const char *order_id, char *buf, size_t cap);
idem_code pay_order_create(idem_call *call, void *arg);
idem_code pay_order_cancel(idem_call *call, void *arg);
idem_code pay_order_get(idem_call *call, void *arg);
idem_code pay_order_count(idem_call *call, void *arg);

/* ---- callback.c ---- */
bool pay_notify_key(const idem_call *call, char *buf, size_t cap, void *arg);
idem_code pay_callback_notify(idem_call *call, void *arg);

/* ---- refund.c ---- */
idem_code pay_order_refund(idem_call *call, void *arg);

/* ---- ledger.c ---- */
/* balance(account) += delta inside t; IDEM_FAILED_PRECONDITION (nothing written) when it
 * would go negative. new_balance may be NULL. */
idem_code pay_ledger_add(idem_txn *t, const char *account, long long delta, long long *new_balance);
/* Snapshot read: 0 at version 0 when the account has never been written. */
idem_code pay_ledger_read(idem_store *st, const char *account, long long *balance,
                          uint64_t *version);
/* In t: writes `balance` if the account is still at version `seen` (else IDEM_ABORTED). */
idem_code pay_ledger_cas(idem_txn *t, const char *account, uint64_t seen, long long balance);
idem_code pay_merchant_settle(idem_call *call, void *arg);
/* arg: the pay_service. */
idem_code pay_merchant_settle_day(idem_call *call, void *arg);
idem_code pay_account_balance(idem_call *call, void *arg);

/* ---- pg_tables.c (PostgreSQL only: t is a transaction of the PostgreSQL store) ---- */
/* CREATE TABLE IF NOT EXISTS pay_order, pay_callback. */
idem_code pay_sql_create_tables(idem_txn *t);
idem_code pay_sql_order_insert(idem_txn *t, const char *trade_no); /* status CREATED */
idem_code pay_sql_order_status(idem_txn *t, const char *trade_no, char *buf, size_t cap);
idem_code pay_sql_order_move(idem_txn *t, const char *trade_no, const char *from, const char *to,
                             idem_sm_outcome *out);
/* Records a notification; *first is false when (trade_no, channel) was recorded before. */
idem_code pay_sql_callback_insert(idem_txn *t, const char *trade_no, const char *channel,
                                  long long amount, bool *first);

/* ---- commission.c ---- */
/* Queues the commission messages of a paid order in t (the transactional outbox: the
 * example's own, or with --nats the library's, keyed "<order_id>:<rule_id>"). */
idem_code pay_commission_enqueue(pay_service *svc, idem_txn *t, const char *order_id,
                                 const char *merchant, long long amount);
idem_code pay_commission_start(pay_service *svc);
void pay_commission_stop(pay_service *svc);
idem_code pay_commission_drain(idem_call *call, void *arg);
/* The fault harness, shared with commission_nats.c: the PRNG of --seed, the crash of
 * --crash-at/--crash-on, a counter under mu. */
double pay_rand_unit(pay_service *svc);
void pay_maybe_crash(pay_service *svc, const char *point);
void pay_count(pay_service *svc, uint64_t *counter);

/* ---- commission_nats.c ---- */
/* Ensures the stream, starts the outbox relay and the commission consumer. */
idem_code pay_broker_start(pay_service *svc);
void pay_broker_stop(pay_service *svc);
/* pay.Commission/Drain with --nats: until the outbox and the durable are both empty. */
idem_code pay_broker_drain(idem_call *call, pay_service *svc, uint64_t wait_ms);

#endif
