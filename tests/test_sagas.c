/* Service chains as a payments team runs them (issue 26): an order service (the store
 * under test, its re-driver on) reserves stock at an inventory service, then charges at
 * a payment service, each hop with its derived key. The downstreams are idemrpc servers
 * of their own that dedupe on the key and count their effects. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

static tu_server inv, pay, order;
static tu_backend order_store;
static idem_client *to_inv, *to_pay;

/* Effects as the downstreams saw them. */
static atomic_int reserved, released, charged, charged_total, reserve_runs;
static atomic_int die_in_reserve; /* the next run "dies" inside its reserve step */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static bool redriven_ok, dead_released, dead_done;

static void await_flag(const bool *flag)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 5;
    pthread_mutex_lock(&mu);
    while (!*flag && pthread_cond_timedwait(&cv, &mu, &until) == 0) {
    }
    pthread_mutex_unlock(&mu);
}

static void raise_flag(bool *flag)
{
    pthread_mutex_lock(&mu);
    *flag = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

/* ---- the downstreams ---- */

/* inv.Stock/Reserve "SKU QTY AMOUNT" → "R<n>" (one reservation per key). */
static idem_code inv_reserve(idem_call *call, void *arg)
{
    char out[16];
    (void)arg;
    int n = snprintf(out, sizeof(out), "R%d", atomic_fetch_add(&reserved, 1) + 1);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* inv.Stock/Release "R<n>": gives a reservation back. */
static idem_code inv_release(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&released, 1);
    return idem_call_reply(call, IDEM_OK, "released", 8);
}

/* pay.Pay/Charge "AMOUNT": 0 is INVALID_ARGUMENT (released: fix and retry), over 100
 * is FAILED_PRECONDITION "insufficient funds" (stored: final). */
static idem_code pay_charge(idem_call *call, void *arg)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    char buf[32];
    (void)arg;
    snprintf(buf, sizeof(buf), "%.*s", (int)(n < 31 ? n : 31), p != NULL ? p : "");
    int amount = atoi(buf);
    if (amount <= 0) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "amount must be positive");
    }
    if (amount > 100) {
        return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "insufficient funds");
    }
    atomic_fetch_add(&charged, 1);
    atomic_fetch_add(&charged_total, amount);
    char out[16];
    int len = snprintf(out, sizeof(out), "C%d", atomic_load(&charged));
    return idem_call_reply(call, IDEM_OK, out, (size_t)len);
}

/* ---- the order service ---- */

typedef struct hop {
    idem_client *to;
    const char *method;
    const char *payload;
    size_t len;
} hop;

/* A step's work: the downstream call with the step's derived key; its answer is the
 * output, its failure the step's (message kept in idem_errmsg by the library). */
static idem_code call_hop(idem_call *call, const char *step, const hop *h, idem_step_result *out)
{
    idem_request q = {.method = h->method, .payload = h->payload, .payload_len = h->len};
    idem_result r;
    idem_code code = idem_call_downstream(call, h->to, step, &q, &r);
    if (code == IDEM_OK) {
        out->data = r.payload;
        out->len = r.payload_len;
        r.payload = NULL;
    }
    idem_result_clear(&r);
    return code;
}

static idem_code reserve_fn(idem_call *call, void *arg, idem_step_result *out)
{
    atomic_fetch_add(&reserve_runs, 1);
    idem_code code = call_hop(call, "reserve", arg, out);
    if (atomic_exchange(&die_in_reserve, 0)) {
        await_flag(&dead_released); /* its process "died" here: nobody renews its lease */
    }
    return code;
}

static idem_code charge_fn(idem_call *call, void *arg, idem_step_result *out)
{
    return call_hop(call, "charge", arg, out);
}

/* saga.Order/Place "SKU QTY AMOUNT": reserve (the whole order), then charge AMOUNT. */
static idem_code place(idem_call *call, void *arg)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    const char *amount = p != NULL ? memrchr(p, ' ', n) : NULL;
    idem_step_result r = {0}, c = {0};
    hop reserve = {to_inv, "inv.Stock/Reserve", p, n};
    hop charge = {to_pay, "pay.Pay/Charge", amount != NULL ? amount + 1 : "",
                  amount != NULL ? (size_t)(p + n - amount - 1) : 0};
    (void)arg;
    idem_code code = idem_call_step(call, "reserve", reserve_fn, &reserve, &r);
    bool dead = code != IDEM_OK && atomic_load(&die_in_reserve) == 0 && dead_released;
    if (code == IDEM_OK) {
        code = idem_call_step(call, "charge", charge_fn, &charge, &c);
    }
    if (code == IDEM_OK) {
        char out[64];
        int len = snprintf(out, sizeof(out), "%.*s %.*s", (int)r.len, (const char *)r.data,
                           (int)c.len, (const char *)c.data);
        code = idem_call_reply(call, IDEM_OK, out, (size_t)len);
    } else {
        code = idem_call_fail(call, code, "%s", idem_errmsg());
    }
    idem_step_result_clear(&r);
    idem_step_result_clear(&c);
    if (dead) {
        raise_flag(&dead_done);
    }
    return code;
}

static void order_log(void *arg, idem_log_level level, const char *line)
{
    (void)arg, (void)level;
    if (strstr(line, "redrive") != NULL && strstr(line, "ran it again: OK") != NULL) {
        raise_flag(&redriven_ok);
    }
}

static void downstream(tu_server *ts, const char *m1, idem_handler_fn f1, const char *m2,
                       idem_handler_fn f2)
{
    idem_method_opts o = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    tu_server_create(ts, NULL);
    cr_assert_eq(idem_server_register(ts->srv, m1, f1, NULL, &o), IDEM_OK);
    if (m2 != NULL) {
        cr_assert_eq(idem_server_register(ts->srv, m2, f2, NULL, &o), IDEM_OK);
    }
    tu_server_listen(ts);
}

static idem_client *client_of(const char *url)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.caller = "order-svc";
    o.retry.period_ms = 10;
    cr_assert_eq(idem_client_open(&c, (const char *[]){url}, 1, &o), IDEM_OK);
    return c;
}

static void setup(void)
{
    downstream(&inv, "inv.Stock/Reserve", inv_reserve, "inv.Stock/Release", inv_release);
    downstream(&pay, "pay.Pay/Charge", pay_charge, NULL, NULL);
    to_inv = client_of(inv.url);
    to_pay = client_of(pay.url);

    idem_server_opts o;
    idem_server_opts_init(&o);
    o.lease_ms = 150;
    o.max_run_ms = 150; /* a dead run's lease ends soon */
    o.redrive_interval_ms = 20;
    o.log_level = IDEM_LOG_INFO;
    o.log_fn = order_log;
    if (tu_backend_is_pg()) {
        o.store = tu_backend_open(&order_store, "sagas");
    }
    tu_server_create(&order, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_STEPS | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(order.srv, "saga.Order/Place", place, NULL, &m), IDEM_OK);
    tu_server_listen(&order);
}

static void teardown(void)
{
    raise_flag(&dead_released); /* a stalled run must not outlive its server */
    tu_server_destroy(&order, false);
    if (order_store.st != NULL) {
        tu_backend_close(&order_store);
    }
    idem_client_close(to_inv);
    idem_client_close(to_pay);
    tu_server_destroy(&inv, false);
    tu_server_destroy(&pay, false);
}

TestSuite(sagas, .init = setup, .fini = teardown, .timeout = 60);

static idem_code place_order(const char *key, const char *payload, uint32_t attempts,
                             uint32_t attempt_ms, idem_result *r)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.caller = "shop-web";
    o.retry.max_attempts = attempts;
    o.retry.period_ms = 20;
    o.attempt_timeout_ms = attempt_ms;
    o.deadline_ms = 8000;
    cr_assert_eq(idem_client_open(&c, (const char *[]){order.url}, 1, &o), IDEM_OK);
    idem_request q = {.method = "saga.Order/Place",
                      .idempotency_key = key,
                      .payload = payload,
                      .payload_len = strlen(payload)};
    idem_code code = idem_client_call(c, &q, r);
    idem_client_close(c);
    return code;
}

/* ---- item 3: a run that dies inside its first step ---- */

/* The first run's process "dies" while its reserve (step 1) is at the inventory, its
 * client gives up after one attempt. The call was listed for the re-driver in its
 * claim's own commit, so the re-driver finishes it: the reserve runs again with the
 * same derived key (the inventory replays: one reservation), the charge runs once. */
Test(sagas, the_redriver_finishes_a_call_that_died_inside_its_first_step)
{
    idem_result r;
    atomic_store(&die_in_reserve, 1);
    cr_assert_neq(place_order("cart-1", "sku-1 1 5", 1, 100, &r), IDEM_OK, "the client gave up");
    idem_result_clear(&r);
    await_flag(&redriven_ok);
    cr_assert(redriven_ok, "the re-driver finished the call");
    cr_expect_eq(atomic_load(&reserve_runs), 2, "the reserve step ran again");
    cr_expect_eq(atomic_load(&reserved), 1, "... with its derived key: one reservation");
    cr_expect_eq(atomic_load(&charged), 1, "charged once");
    cr_assert_eq(place_order("cart-1", "sku-1 1 5", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect(r.replayed, "the client's retry replays the re-driven outcome");
    cr_expect_str_eq(r.payload, "R1 C1");
    idem_result_clear(&r);
    raise_flag(&dead_released);
    await_flag(&dead_done);
    cr_expect_eq(atomic_load(&reserved), 1, "the dead run, woken, reserved nothing more");
}
