/* End-to-end tests of examples/payments: idemrpc-payments runs as a real child process on
 * ipc:// in a temp dir and is driven like production drives it: a channel replaying its
 * callback, a commission queue that redelivers and a consumer that throws or is killed,
 * a client that times out and replays. Each test checks the business tables (orders,
 * balances and their versions), not only the answers.
 *
 * One suite, both stores: as `payments` the service keeps everything in an LMDB
 * directory; as `payments_pg` (IDEMRPC_TEST_BACKEND=postgres) each test gets a schema of
 * its own, dropped after it, and most tests run TWO instances on it behind one client,
 * with the channel's callbacks spread over both. There the tests also read the
 * service's own tables (pay_order, pay_callback) with SQL. The tests that kill the
 * server restart it on the same directory or schema.
 *
 * As `payments_nats` / `payments_nats_pg` (PAYMENTS_BROKER=nats) every instance runs with
 * --nats $IDEMRPC_TEST_NATS on a stream of the test's own: the commission messages go
 * through the library's outbox, its relay and a JetStream durable consumer shared by the
 * instances, and the same checks must hold (skipped without IDEMRPC_TEST_NATS). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#if TU_HAVE_PG
#include <libpq-fe.h>
#endif

#include "idemrpc.pb-c.h"
#include "testutil.h"

#define MAX_ARGS 24
#define CHANNEL "alipay"
#define MERCHANT "m1"
#define ACCOUNT "merchant:" MERCHANT
#define INSTANCES 2

static char *dir;
static char urls[INSTANCES][256], db[256];
static char *pg; /* conninfo of this test's schema; NULL on LMDB */
static char schema[32];
static char nats_stream[32]; /* PAYMENTS_BROKER=nats: this test's stream */
/* The live servers, killed by teardown if a test fails. */
static tu_child servers[INSTANCES] = {{-1, NULL}, {-1, NULL}};
/* The one client in front of every live instance, opened by spawn and kept until stop.
 * Clients for a single call dial one instance only: closing a client while one of its
 * connections is still in the SP handshake stops the listener of nng before 1.6.0
 * (nanomsg/nng#1518), and a client of two URLs that made one call may well have such a
 * connection to the instance it did not use. */
static idem_client *shop;

static void shop_close(void)
{
    if (shop != NULL) {
        idem_client_close(shop);
        shop = NULL;
    }
}

static void setup(void)
{
    dir = tu_tempdir("payments");
    for (int i = 0; i < INSTANCES; i++) {
        snprintf(urls[i], sizeof(urls[i]), "ipc://%s/pay%d.sock", dir, i);
    }
    snprintf(db, sizeof(db), "%s/db", dir);
    pg = tu_backend_is_pg() ? tu_pg_schema_create(schema) : NULL;
    snprintf(nats_stream, sizeof(nats_stream), "PAY%08x", (unsigned)(getpid() ^ rand()));
}

/* --nats URL --nats-stream S when the suite runs on the broker; false when it should but
 * no broker was given. */
static bool broker_args(const char **argv, size_t *n)
{
    const char *broker = getenv("PAYMENTS_BROKER"), *url = getenv("IDEMRPC_TEST_NATS");
    if (broker == NULL) {
        return true;
    }
    if (url == NULL) {
        return false;
    }
    argv[(*n)++] = "--nats";
    argv[(*n)++] = url;
    argv[(*n)++] = "--nats-stream";
    argv[(*n)++] = nats_stream;
    return true;
}

static void teardown(void)
{
    shop_close();
    for (int i = 0; i < INSTANCES; i++) {
        if (servers[i].pid > 0) {
            kill(servers[i].pid, SIGKILL);
            tu_reap(&servers[i]);
        }
    }
    tu_rmtree(dir);
    if (pg != NULL) {
        tu_pg_schema_drop(schema);
        free(pg);
        pg = NULL;
    }
}

TestSuite(payments, .init = setup, .fini = teardown, .timeout = 120);

/* ---- the server processes ---- */

/* Starts instance i with extra options (NULL-terminated) on the test's store and waits
 * for "ready". */
static void spawn_instance(int i, const char *const *extra)
{
    const char *argv[MAX_ARGS] = {getenv("PAYMENTS_SERVER"), "--listen", urls[i],
                                  pg != NULL ? "--store" : "--db", pg != NULL ? pg : db};
    size_t n = 5;
    if (!broker_args(argv, &n)) {
        cr_skip_test("PAYMENTS_BROKER set without IDEMRPC_TEST_NATS");
    }
    for (; extra != NULL && *extra != NULL && n < MAX_ARGS - 1; extra++) {
        argv[n++] = *extra;
    }
    argv[n] = NULL;
    tu_spawn(&servers[i], argv);
}

/* How many instances run; instance i % live() is a live one. */
static int live(void)
{
    return servers[1].pid > 0 ? 2 : 1;
}

/* A client to the first n_urls instances. */
static idem_client *client(size_t n_urls, uint32_t attempt_ms, uint32_t deadline_ms,
                           uint32_t attempts)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = attempt_ms;
    o.deadline_ms = deadline_ms;
    o.retry.max_attempts = attempts;
    o.retry.period_ms = 50;
    o.retry.max_period_ms = 200;
    o.caller = "shop";
    const char *const to[] = {urls[0], urls[1]};
    cr_assert_eq(idem_client_open(&c, to, n_urls, &o), IDEM_OK);
    return c;
}

/* The service: two instances on one PostgreSQL schema, one process on an LMDB dir; and
 * the client in front of them. */
static void spawn(const char *const *extra)
{
    spawn_instance(0, extra);
    if (pg != NULL) {
        spawn_instance(1, extra);
    }
    shop = client((size_t)live(), 2000, 10000, 5);
}

/* One instance only: for tests that count what one dispatcher did, or kill it. */
static void spawn_single(const char *const *extra)
{
    spawn_instance(0, extra);
    shop = client(1, 2000, 10000, 5);
}

static void stop(void)
{
    shop_close();
    for (int i = 0; i < INSTANCES; i++) {
        if (servers[i].pid > 0) {
            kill(servers[i].pid, SIGTERM);
            int sig = tu_reap(&servers[i]);
            cr_expect_eq(sig, 0, "clean shutdown of instance %d on SIGTERM, not signal %d", i, sig);
        }
    }
}

/* ---- calls ---- */

/* One logical call through the client in front of the service. */
static idem_code call(const char *method, const char *key, const char *token, const char *payload,
                      idem_result *r)
{
    idem_request q = {.method = method,
                      .idempotency_key = key,
                      .token = token,
                      .payload = payload,
                      .payload_len = strlen(payload)};
    return idem_client_call(shop, &q, r);
}

/* Field `name` of a "k=v&k=v" payload as a number; -1 when absent. */
static long long field_ll(const char *form, const char *name)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "%s=", name);
    for (const char *p = form; p != NULL && (p = strstr(p, pat)) != NULL; p++) {
        if (p == form || p[-1] == '&') {
            return atoll(p + strlen(pat));
        }
    }
    return -1;
}

static bool field_is(const char *form, const char *name, const char *value)
{
    char pat[128];
    size_t n = (size_t)snprintf(pat, sizeof(pat), "%s=%s", name, value);
    for (const char *p = form; (p = strstr(p, pat)) != NULL; p++) {
        if ((p == form || p[-1] == '&') && (p[n] == '\0' || p[n] == '&')) {
            return true;
        }
    }
    return false;
}

static char *token(void)
{
    static char buf[64];
    cr_assert_eq(idem_client_issue_token(shop, NULL, buf, sizeof(buf), NULL), IDEM_OK, "%s",
                 idem_errmsg());
    return buf;
}

/* Submits an order with a fresh token; copies its id into id (32 bytes). */
static void create_order(long long amount, char *id)
{
    char payload[96];
    idem_result r;
    snprintf(payload, sizeof(payload), "merchant=%s&amount=%lld", MERCHANT, amount);
    cr_assert_eq(call("pay.Order/Create", NULL, token(), payload, &r), IDEM_OK, "%s", r.message);
    const char *p = strstr(r.payload, "order_id=");
    cr_assert_not_null(p);
    snprintf(id, 32, "%.12s", p + strlen("order_id="));
    idem_result_clear(&r);
}

/* The channel's callback to instance i % live(): a raw req0 frame without an
 * idempotency key, as a channel would send it, so that the server derives the key from
 * (channel, out_trade_no). Returns the code (IDEM_OK only with the body "success"), or
 * -1 when no answer came (the server is down). Asserts nothing: worker threads call it
 * too. */
static int notify_on(int i, const char *order_id, long long amount, bool *replayed)
{
    char payload[160];
    size_t len;
    snprintf(payload, sizeof(payload),
             "out_trade_no=%s&channel=" CHANNEL "&amount=%lld&trade_status=SUCCESS", order_id,
             amount);
    void *frame = tu_pack_request("pay.Callback/Notify", NULL, CHANNEL, payload, &len);
    Idem__V1__Response *resp = tu_raw_call_try(urls[i % live()], frame, len, 5000);
    free(frame);
    if (resp == NULL) {
        return -1;
    }
    int code = resp->code;
    if (code == IDEM_OK && (resp->payload.len != 7 || memcmp(resp->payload.data, "success", 7))) {
        code = -2; /* channels resend until they read "success" */
    }
    if (replayed != NULL) {
        *replayed = resp->replayed;
    }
    tu_response_free(resp);
    return code;
}

static int notify(const char *order_id, long long amount, bool *replayed)
{
    return notify_on(0, order_id, amount, replayed);
}

/* An order of amount cents, created and paid by one callback. */
static void create_paid_order(long long amount, char *id)
{
    create_order(amount, id);
    cr_assert_eq(notify(id, amount, NULL), IDEM_OK, "paying %s", id);
}

static long long balance(const char *account, uint64_t *version)
{
    char payload[96];
    idem_result r;
    snprintf(payload, sizeof(payload), "account=%s", account);
    cr_assert_eq(call("pay.Account/Balance", NULL, NULL, payload, &r), IDEM_OK, "%s", r.message);
    long long b = field_ll(r.payload, "balance");
    if (version != NULL) {
        *version = (uint64_t)field_ll(r.payload, "version");
    }
    idem_result_clear(&r);
    return b;
}

static bool order_is(const char *order_id, const char *state)
{
    char payload[64];
    idem_result r;
    snprintf(payload, sizeof(payload), "order_id=%s", order_id);
    cr_assert_eq(call("pay.Order/Get", NULL, NULL, payload, &r), IDEM_OK, "%s", r.message);
    bool is = field_is(r.payload, "state", state);
    idem_result_clear(&r);
    return is;
}

static long long order_count(void)
{
    idem_result r;
    cr_assert_eq(call("pay.Order/Count", NULL, NULL, "", &r), IDEM_OK, "%s", r.message);
    long long n = field_ll(r.payload, "orders");
    idem_result_clear(&r);
    return n;
}

static idem_code refund(const char *order_id, const char *key, idem_result *r)
{
    char payload[64];
    snprintf(payload, sizeof(payload), "order_id=%s", order_id);
    return call("pay.Order/Refund", key, NULL, payload, r);
}

/* Waits until the commission queue is empty; copies the broker's counters into stats. */
static void drain(char *stats, size_t cap)
{
    idem_client *c = client(1, 25000, 30000, 1);
    idem_request q = {.method = "pay.Commission/Drain",
                      .payload = "timeout_ms=20000",
                      .payload_len = strlen("timeout_ms=20000")};
    idem_result r;
    cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "drain: %s", r.message);
    snprintf(stats, cap, "%s", (const char *)r.payload);
    idem_result_clear(&r);
    idem_client_close(c);
}

/* ---- the service's own tables (PostgreSQL) ---- */

#if TU_HAVE_PG
/* The first column of the only row query returns ("(none)" for no row), read in the
 * test's schema. param ($1) may be NULL. */
static const char *sql_value(const char *query, const char *param)
{
    static char out[64];
    const char *const params[] = {param};
    PGconn *c = PQconnectdb(pg);
    cr_assert_eq(PQstatus(c), CONNECTION_OK, "%s", PQerrorMessage(c));
    PGresult *r = PQexecParams(c, query, param != NULL ? 1 : 0, NULL, params, NULL, NULL, 0);
    cr_assert_eq(PQresultStatus(r), PGRES_TUPLES_OK, "%s: %s", query, PQresultErrorMessage(r));
    cr_assert_leq(PQntuples(r), 1, "%s: one row at most", query);
    snprintf(out, sizeof(out), "%s", PQntuples(r) == 1 ? PQgetvalue(r, 0, 0) : "(none)");
    PQclear(r);
    PQfinish(c);
    return out;
}
#else
static const char *sql_value(const char *query, const char *param)
{
    (void)query, (void)param;
    cr_assert_fail("built without libpq");
    return NULL;
}
#endif

/* On PostgreSQL: pay_order holds the order in `status` after `moves` status changes, and
 * pay_callback holds `callbacks` rows of the channel's notification for it. LMDB has no
 * such tables (order_is reads the state machine there). */
static void expect_tables(const char *order_id, const char *status, int moves, int callbacks)
{
    char want[64];
    if (pg == NULL) {
        return;
    }
    snprintf(want, sizeof(want), "%s %d", status, moves);
    cr_expect_str_eq(sql_value("SELECT status || ' ' || version FROM pay_order"
                               " WHERE trade_no = $1",
                               order_id),
                     want, "pay_order row of %s", order_id);
    snprintf(want, sizeof(want), "%d", callbacks);
    cr_expect_str_eq(sql_value("SELECT count(*) FROM pay_callback"
                               " WHERE out_trade_no = $1 AND channel = '" CHANNEL "'",
                               order_id),
                     want, "pay_callback rows of %s", order_id);
}

/* On PostgreSQL: pay_order has n rows. */
static void expect_order_rows(int n)
{
    char want[16];
    if (pg != NULL) {
        snprintf(want, sizeof(want), "%d", n);
        cr_expect_str_eq(sql_value("SELECT count(*) FROM pay_order", NULL), want, "pay_order");
    }
}

/* Commission rules of the example: 2 % to the platform, 1 % to sales. */
static void expect_commissions(long long paid_total_bps200, long long paid_total_bps100)
{
    uint64_t v;
    cr_expect_eq(balance("commission:platform", &v), paid_total_bps200, "platform commission");
    cr_expect_eq(balance("commission:sales", &v), paid_total_bps100, "sales commission");
}

/* ---- the seed's checks ---- */

/* On PostgreSQL the ten callbacks alternate between the two instances. */
Test(payments, same_callback_ten_times_changes_the_business_table_once)
{
    char id[32], stats[256];
    uint64_t version;
    int replays = 0;
    spawn(NULL);
    create_order(10000, id);
    for (int i = 0; i < 10; i++) {
        bool replayed = false;
        cr_assert_eq(notify_on(i, id, 10000, &replayed), IDEM_OK, "callback %d", i);
        replays += replayed;
    }
    cr_expect_eq(replays, 9, "the first callback ran, nine replayed its answer");
    cr_expect(order_is(id, "PAID"));
    cr_expect_eq(balance(ACCOUNT, &version), 10000, "credited once");
    cr_expect_eq(version, 1, "one write to the merchant's balance");
    expect_tables(id, "PAID", 1, 1); /* one callback row; CREATED -> PAID, once */
    drain(stats, sizeof(stats));
    expect_commissions(200, 100);
    stop();
}

/* LMDB: the state machine finds the order PAID. PostgreSQL: the unique key of
 * pay_callback finds the notification recorded. */
Test(payments, callback_that_gets_past_the_cache_is_stopped_by_the_business_data)
{
    char id[32], payload[160];
    uint64_t version;
    idem_result r;
    spawn(NULL);
    create_paid_order(10000, id);
    snprintf(payload, sizeof(payload),
             "out_trade_no=%s&channel=" CHANNEL "&amount=10000&trade_status=SUCCESS", id);
    cr_expect_eq(call("pay.Callback/Notify", "proxy-key-1", NULL, payload, &r),
                 IDEM_INVALID_ARGUMENT, "a proxy's own key cannot bypass the business key");
    idem_result_clear(&r);
    /* The same notification under another caller scope (this client is "shop", the
     * first came from the channel) or after its record expired: the handler runs again
     * and finds it applied. */
    for (int i = 0; i < 2; i++) { /* the two-URL client may pick either instance */
        cr_assert_eq(call("pay.Callback/Notify", NULL, NULL, payload, &r), IDEM_OK, "%s",
                     r.message);
        cr_expect_eq(r.replayed, i > 0, "the first one is not a replay: the handler ran");
        idem_result_clear(&r);
    }
    cr_expect_eq(balance(ACCOUNT, &version), 10000);
    cr_expect_eq(version, 1, "the second run wrote nothing");
    expect_tables(id, "PAID", 1, 1);
    stop();
}

Test(payments, callback_replayed_with_another_amount_is_rejected)
{
    char id[32];
    uint64_t version;
    spawn(NULL);
    create_paid_order(10000, id);
    cr_expect_eq(notify_on(1, id, 99999, NULL), IDEM_INVALID_ARGUMENT,
                 "same key, other request: idempotency key reused");
    cr_expect_eq(balance(ACCOUNT, &version), 10000);
    cr_expect_eq(version, 1);
    expect_tables(id, "PAID", 1, 1);
    stop();
}

Test(payments, callback_with_a_wrong_amount_is_refused_and_the_order_stays_created)
{
    char id[32];
    uint64_t version;
    spawn(NULL);
    create_order(10000, id);
    cr_expect_eq(notify_on(1, id, 1, NULL), IDEM_FAILED_PRECONDITION);
    cr_expect(order_is(id, "CREATED"));
    cr_expect_eq(balance(ACCOUNT, &version), 0);
    cr_expect_eq(version, 0, "never written");
    expect_tables(id, "CREATED", 0, 0);
    stop();
}

Test(payments, callback_for_a_cancelled_order_is_refused_and_credits_nothing)
{
    char id[32], payload[64];
    uint64_t version;
    idem_result r;
    spawn(NULL);
    create_order(10000, id);
    snprintf(payload, sizeof(payload), "order_id=%s", id);
    cr_assert_eq(call("pay.Order/Cancel", "cancel-1", NULL, payload, &r), IDEM_OK, "%s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(notify_on(1, id, 10000, NULL), IDEM_FAILED_PRECONDITION);
    cr_expect(order_is(id, "CANCELLED"));
    cr_expect_eq(balance(ACCOUNT, &version), 0);
    cr_expect_eq(version, 0);
    expect_tables(id, "CANCELLED", 1, 0); /* the refused callback left no row */
    stop();
}

Test(payments, client_replaying_after_a_timeout_gets_the_first_order_not_a_second)
{
    const char *slow[] = {"--create-delay-ms", "1500", NULL};
    char tok[64];
    idem_result r;
    spawn(slow);
    snprintf(tok, sizeof(tok), "%s", token());
    idem_client *impatient = client(1, 300, 400, 1);
    idem_request q = {.method = "pay.Order/Create",
                      .token = tok,
                      .payload = "merchant=" MERCHANT "&amount=5000",
                      .payload_len = strlen("merchant=" MERCHANT "&amount=5000")};
    idem_code code = idem_client_call(impatient, &q, &r);
    cr_expect(code == IDEM_DEADLINE_EXCEEDED || code == IDEM_UNAVAILABLE,
              "the first attempt timed out: %s", idem_code_name(code));
    idem_result_clear(&r);
    idem_client_close(impatient);

    /* The caller does not know whether the order exists: it replays with the same token. */
    cr_assert_eq(call("pay.Order/Create", NULL, tok, q.payload, &r), IDEM_OK, "%s", r.message);
    cr_expect(r.replayed, "the first execution's result");
    cr_expect(field_is(r.payload, "order_id", "ORD-00000001"), "%s", (char *)r.payload);
    idem_result_clear(&r);
    cr_assert_eq(call("pay.Order/Create", NULL, tok, q.payload, &r), IDEM_OK);
    cr_expect(r.replayed && field_is(r.payload, "order_id", "ORD-00000001"));
    idem_result_clear(&r);
    cr_expect_eq(order_count(), 1, "one order, not two");
    expect_order_rows(1);
    stop();
}

Test(payments, retrying_client_gets_one_order_and_the_first_result)
{
    const char *slow[] = {"--create-delay-ms", "800", NULL};
    idem_result r;
    spawn(slow);
    idem_client *c = client((size_t)live(), 300, 10000, 10); /* lives past both handshakes */
    idem_request q = {.method = "pay.Order/Create",
                      .token = token(),
                      .payload = "merchant=" MERCHANT "&amount=5000",
                      .payload_len = strlen("merchant=" MERCHANT "&amount=5000")};
    cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s", r.message);
    cr_expect_gt(r.attempts, 1, "the first attempt timed out");
    cr_expect(r.replayed, "a later attempt got the first attempt's result");
    cr_expect(field_is(r.payload, "order_id", "ORD-00000001"));
    idem_result_clear(&r);
    idem_client_close(c);
    cr_expect_eq(order_count(), 1);
    expect_order_rows(1);
    stop();
}

/* Pays n orders of amounts 1000, 2000, ... and returns their total. */
static long long pay_orders(int n, char ids[][32])
{
    long long total = 0;
    for (int i = 0; i < n; i++) {
        create_paid_order(1000LL * (i + 1), ids[i]);
        total += 1000LL * (i + 1);
    }
    return total;
}

Test(payments, consumer_that_throws_is_retried_until_each_commission_is_credited_once)
{
    const char *flaky[] = {"--fail-rate", "0.5", "--redeliver-rate", "0.5", "--seed", "7", NULL};
    char ids[8][32], stats[256];
    spawn_single(flaky); /* the counters are one dispatcher's */
    long long total = pay_orders(8, ids);
    drain(stats, sizeof(stats));
    cr_expect_gt(field_ll(stats, "failures"), 0, "the consumer did throw: %s", stats);
    cr_expect_gt(field_ll(stats, "redeliveries"), 0, "messages were redelivered: %s", stats);
    cr_expect_eq(field_ll(stats, "consumed"), 16, "16 messages (8 orders x 2 rules): %s", stats);
    expect_commissions(total * 200 / 10000, total * 100 / 10000);
    cr_expect_eq(balance(ACCOUNT, NULL), total, "the payments themselves: once each");
    stop();
}

/* Kills the server at `point` of the third consume, restarts it on the same directory
 * (or schema) with a broker that redelivers, has the channel replay every callback, and
 * checks that every commission was credited exactly once. The kill may also catch a
 * callback after its claim: on LMDB the short lease lets the replay take it over instead
 * of waiting 30 s; on PostgreSQL the claim died with the session's transaction. */
static void kill_consumer_and_restart(const char *point)
{
    const char *crashing[] = {"--crash-at", point, "--crash-on", "3", "--lease-ms", "500", NULL};
    const char *redelivering[] = {"--redeliver-rate", "0.5", "--seed", "11",
                                  "--lease-ms",       "500", NULL};
    char ids[6][32], stats[256];
    long long total = 0;
    spawn_single(crashing);
    for (int i = 0; i < 6; i++) {
        create_order(1000LL * (i + 1), ids[i]);
        total += 1000LL * (i + 1);
    }
    for (int i = 0; i < 6; i++) {
        notify(ids[i], 1000LL * (i + 1), NULL); /* the server dies somewhere in here */
    }
    cr_assert_eq(tu_reap(&servers[0]), SIGKILL, "killed at %s", point);
    shop_close();

    spawn_single(redelivering);
    for (int i = 0; i < 6; i++) { /* channels resend until they hear "success" */
        cr_assert_eq(notify(ids[i], 1000LL * (i + 1), NULL), IDEM_OK);
    }
    drain(stats, sizeof(stats));
    expect_commissions(total * 200 / 10000, total * 100 / 10000);
    cr_expect_eq(balance(ACCOUNT, NULL), total);
    for (int i = 0; i < 6; i++) {
        cr_expect(order_is(ids[i], "PAID"));
        expect_tables(ids[i], "PAID", 1, 1);
    }
    stop();
}

Test(payments, consumer_killed_mid_consume_restarts_and_credits_once)
{
    kill_consumer_and_restart("consume");
}

Test(payments, consumer_killed_between_consume_and_ack_credits_once)
{
    kill_consumer_and_restart("before_ack");
}

/* ---- refunds ---- */

Test(payments, refund_moves_paid_to_refunded_and_debits_the_merchant_once)
{
    char id[32];
    uint64_t version;
    idem_result r;
    spawn(NULL);
    create_paid_order(10000, id);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(refund(id, "refund-1", &r), IDEM_OK, "%s", r.message);
        cr_expect_eq(r.replayed, i > 0);
        cr_expect_eq(field_ll(r.payload, "refunded"), 10000);
        idem_result_clear(&r);
    }
    cr_assert_eq(refund(id, "refund-2", &r), IDEM_OK, "another request for the same refund");
    cr_expect(field_is(r.payload, "already", "1"), "%s", (char *)r.payload);
    idem_result_clear(&r);
    cr_expect(order_is(id, "REFUNDED"));
    cr_expect_eq(balance(ACCOUNT, &version), 0);
    cr_expect_eq(version, 2, "one credit, one debit");
    expect_tables(id, "REFUNDED", 2, 1);
    stop();
}

Test(payments, refund_that_would_make_the_balance_negative_is_refused_and_writes_nothing)
{
    char id[32];
    uint64_t version;
    idem_result r;
    spawn(NULL);
    create_paid_order(10000, id);
    cr_assert_eq(
        call("pay.Merchant/Settle", "settle-1", NULL, "merchant=" MERCHANT "&amount=9000", &r),
        IDEM_OK, "%s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(refund(id, "refund-1", &r), IDEM_FAILED_PRECONDITION);
    cr_expect(strstr(r.message, "insufficient") != NULL, "%s", r.message);
    idem_result_clear(&r);
    cr_expect(order_is(id, "PAID"), "still paid");
    cr_expect_eq(balance(ACCOUNT, &version), 1000);
    cr_expect_eq(version, 2, "credit and settlement only");
    cr_expect_eq(
        call("pay.Merchant/Settle", "settle-2", NULL, "merchant=" MERCHANT "&amount=1001", &r),
        IDEM_FAILED_PRECONDITION, "a settlement cannot overdraw either");
    idem_result_clear(&r);
    cr_expect_eq(balance(ACCOUNT, NULL), 1000);
    expect_tables(id, "PAID", 1, 1);
    stop();
}

Test(payments, refund_of_an_unpaid_order_is_failed_precondition)
{
    char id[32];
    idem_result r;
    spawn(NULL);
    create_order(10000, id);
    cr_expect_eq(refund(id, "refund-1", &r), IDEM_FAILED_PRECONDITION);
    idem_result_clear(&r);
    cr_expect(order_is(id, "CREATED"));
    expect_tables(id, "CREATED", 0, 0);
    cr_expect_eq(refund("ORD-99999999", "refund-2", &r), IDEM_NOT_FOUND);
    idem_result_clear(&r);
    stop();
}

#define WORKERS 6

typedef struct worker {
    const char *id;
    int instance; /* where the callback goes: i / 2, so payers and refunders use both */
    long long amount;
    bool refunds; /* false: pay only */
    int paid, refunded;
} worker;

/* Pays its order and, for half of them, refunds it at once: the refunds' snapshots race
 * the other workers' credits to the same merchant balance. No asserts in the thread: the
 * test checks the results after the join. */
static void *pay_and_refund(void *arg)
{
    worker *w = arg;
    char key[48], payload[64];
    idem_result r;
    w->paid = notify_on(w->instance, w->id, w->amount, NULL);
    w->refunded = IDEM_OK;
    if (w->refunds) {
        snprintf(key, sizeof(key), "refund-%s", w->id);
        snprintf(payload, sizeof(payload), "order_id=%s", w->id);
        idem_request q = {.method = "pay.Order/Refund",
                          .idempotency_key = key,
                          .payload = payload,
                          .payload_len = strlen(payload)};
        w->refunded = idem_client_call(shop, &q, &r); /* one client, shared by the threads */
        idem_result_clear(&r);
    }
    return NULL;
}

Test(payments, concurrent_payments_and_refunds_of_one_merchant_lose_no_update)
{
    char ids[WORKERS][32];
    worker w[WORKERS];
    pthread_t th[WORKERS];
    long long expected = 0;
    uint64_t version;
    spawn(NULL);
    for (int i = 0; i < WORKERS; i++) {
        create_order(1000LL * (i + 1), ids[i]);
        w[i] = (worker){ids[i], i / 2, 1000LL * (i + 1), i % 2 == 0, -1, -1};
        expected += w[i].refunds ? 0 : w[i].amount;
    }
    for (int i = 0; i < WORKERS; i++) {
        cr_assert_eq(pthread_create(&th[i], NULL, pay_and_refund, &w[i]), 0);
    }
    for (int i = 0; i < WORKERS; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(w[i].paid, IDEM_OK, "payment %d", i);
        cr_expect_eq(w[i].refunded, IDEM_OK, "refund %d", i);
        if (w[i].refunds) {
            expect_tables(ids[i], "REFUNDED", 2, 1);
        } else {
            expect_tables(ids[i], "PAID", 1, 1);
        }
    }
    cr_expect_eq(balance(ACCOUNT, &version), expected);
    cr_expect_eq(version, WORKERS + WORKERS / 2, "one write per credit and per debit");
    stop();
}

/* ---- the daily settlement under the lock (一锁二判三更新) ---- */

struct settle_arg {
    int instance;
    const char *key;
    idem_result r;
    idem_code code;
};

/* Each instance's own scheduler: a client of its instance only, a key of its own. */
static void *settle_from(void *p)
{
    struct settle_arg *a = p;
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.caller = "scheduler";
    o.attempt_timeout_ms = 15000;
    o.deadline_ms = 20000;
    o.retry.max_attempts = 1;
    cr_assert_eq(idem_client_open(&c, (const char *[]){urls[a->instance]}, 1, &o), IDEM_OK);
    idem_request q = {.method = "pay.Merchant/SettleDay",
                      .idempotency_key = a->key,
                      .payload = "merchant=" MERCHANT "&day=2026-12-03",
                      .payload_len = strlen("merchant=" MERCHANT "&day=2026-12-03")};
    a->code = idem_client_call(c, &q, &a->r);
    idem_client_close(c);
    return NULL;
}

Test(payments, the_daily_settlement_runs_once_across_instances_under_the_lock)
{
    char id[32];
    spawn(NULL); /* on PostgreSQL two instances; on LMDB one process, two schedulers */
    create_paid_order(10000, id);
    struct settle_arg a = {.instance = 0, .key = "cron-a"};
    struct settle_arg b = {.instance = live() - 1, .key = "cron-b"};
    pthread_t ta, tb;
    pthread_create(&ta, NULL, settle_from, &a);
    pthread_create(&tb, NULL, settle_from, &b);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    cr_assert_eq(a.code, IDEM_OK, "%s", a.r.message);
    cr_assert_eq(b.code, IDEM_OK, "%s", b.r.message);
    bool a_settled = field_ll(a.r.payload, "settled") == 10000;
    bool b_settled = field_ll(b.r.payload, "settled") == 10000;
    cr_expect(a_settled != b_settled, "exactly one settles: '%s' / '%s'", (char *)a.r.payload,
              (char *)b.r.payload);
    cr_expect_eq(field_ll(a_settled ? b.r.payload : a.r.payload, "already_settled"), 10000,
                 "the other sees it settled");
    cr_expect_eq(balance(ACCOUNT, NULL), 0, "paid out once");
    idem_result_clear(&a.r);
    idem_result_clear(&b.r);
    stop();
}
