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

static tu_server inv, pay, order, plain;
static tu_backend order_store, plain_store;
static idem_client *to_inv, *to_pay;

/* Effects as the downstreams saw them. */
static atomic_int reserved, released, charged, charged_total, reserve_runs, charge_asks;
static atomic_int die_in_reserve; /* the next run "dies" inside its reserve step */
static atomic_int die_in_undo;    /* ... inside the undo of its reserve step */
static char reserve_keys[4][80];  /* the downstream keys of the reservations */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static bool redriven_ok, redriven_failed, dead_released, dead_done;

/* Waits for flag, at most seconds: a hang guard, not a timing assertion. */
static void await_flag_for(const bool *flag, int seconds)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += seconds;
    pthread_mutex_lock(&mu);
    while (!*flag && pthread_cond_timedwait(&cv, &mu, &until) == 0) {
    }
    pthread_mutex_unlock(&mu);
}

/* What a test awaits: generous, a loaded machine's re-driver may take a while. */
static void await_flag(const bool *flag)
{
    await_flag_for(flag, 30);
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
    int i = atomic_fetch_add(&reserved, 1);
    if (i < 4) {
        snprintf(reserve_keys[i], sizeof(reserve_keys[i]), "%s", idem_call_key(call));
    }
    int n = snprintf(out, sizeof(out), "R%d", i + 1);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* inv.Stock/Release "R<n>": gives a reservation back. */
static idem_code inv_release(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&released, 1);
    return idem_call_reply(call, IDEM_OK, "released", 8);
}

/* inv.Stock/Slow: work that takes 500 ms, longer than one attempt of the upstream
 * caller (its work, not a synchronisation), bound by its caller's deadline as a
 * statement timeout would be: it does not start what cannot finish in time. */
static atomic_int slow_runs;
static idem_code inv_slow(idem_call *call, void *arg)
{
    struct timespec now;
    (void)arg;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t now_ms = (uint64_t)now.tv_sec * 1000 + (uint64_t)now.tv_nsec / 1000000;
    uint64_t deadline = idem_call_deadline_ms(call);
    if (deadline != 0 && deadline < now_ms + 500) {
        return idem_call_fail(call, IDEM_DEADLINE_EXCEEDED, "not enough time left for the work");
    }
    atomic_fetch_add(&slow_runs, 1);
    nanosleep(&(struct timespec){0, 500 * 1000 * 1000}, NULL);
    return idem_call_reply(call, IDEM_OK, "slow", 4);
}

/* pay.Pay/Charge "AMOUNT": 0 is INVALID_ARGUMENT (released: fix and retry), over 100
 * is FAILED_PRECONDITION "insufficient funds" (stored: final). */
static idem_code pay_charge(idem_call *call, void *arg)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    char buf[32];
    (void)arg;
    atomic_fetch_add(&charge_asks, 1);
    snprintf(buf, sizeof(buf), "%.*s", (int)(n < 31 ? n : 31), p != NULL ? p : "");
    int amount = atoi(buf);
    if (amount <= 0) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "amount must be positive");
    }
    if (amount == 99) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "payment system down"); /* transient */
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
        await_flag_for(&dead_released, 5); /* its process "died": nobody renews its lease */
    }
    return code;
}

static idem_code charge_fn(idem_call *call, void *arg, idem_step_result *out)
{
    return call_hop(call, "charge", arg, out);
}

/* The reserve step's undo: the reservation goes back, with the undo's derived key. */
static idem_code unreserve(idem_call *call, const char *step, const idem_step_result *done,
                           void *arg)
{
    idem_request q = {
        .method = "inv.Stock/Release", .payload = done->data, .payload_len = done->len};
    idem_result r;
    (void)arg;
    idem_code code = idem_call_downstream(call, to_inv, step, &q, &r);
    idem_result_clear(&r);
    if (atomic_exchange(&die_in_undo, 0)) {
        await_flag_for(&dead_released, 5); /* its process "died" inside the undo */
    }
    return code;
}

static idem_code slow_fn(idem_call *call, void *arg, idem_step_result *out)
{
    hop h = {to_inv, "inv.Stock/Slow", "", 0};
    (void)arg;
    return call_hop(call, "slow", &h, out);
}

/* saga.Order/Slow: one step, a downstream slower than an upstream attempt. */
static idem_code order_slow(idem_call *call, void *arg)
{
    idem_step_result r;
    (void)arg;
    idem_code code = idem_call_step(call, "slow", slow_fn, NULL, &r);
    code = code == IDEM_OK ? idem_call_reply(call, IDEM_OK, r.data, r.len)
                           : idem_call_fail(call, code, "%s", idem_errmsg());
    idem_step_result_clear(&r);
    return code;
}

/* saga.Order/Place "SKU QTY AMOUNT": reserve (the whole order; undone by a release),
 * then charge AMOUNT. saga.Order/PlaceNoUndo: the same, its reservation cannot be undone. */
static idem_code place(idem_call *call, void *arg)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    const char *amount = p != NULL ? memrchr(p, ' ', n) : NULL;
    idem_step_result r = {0}, c = {0};
    hop reserve = {to_inv, "inv.Stock/Reserve", p, n};
    hop charge = {to_pay, "pay.Pay/Charge", amount != NULL ? amount + 1 : "",
                  amount != NULL ? (size_t)(p + n - amount - 1) : 0};
    idem_step_opts undo = {.undo = arg != NULL ? unreserve : NULL};
    idem_code code = idem_call_step_with(call, "reserve", reserve_fn, &reserve, &undo, &r);
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

/* saga.Order/StackArg "SKU QTY AMOUNT": the reserve step with a local of the handler as
 * its undo_arg, as the guide's example had it. Not ASan-instrumented, so that the
 * local stays on the thread's stack under detect_stack_use_after_return too. */
__attribute__((no_sanitize("address"))) static idem_code place_stack_arg(idem_call *call, void *arg)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    char sku[] = "sku-1";
    hop reserve = {to_inv, "inv.Stock/Reserve", p, n};
    idem_step_opts undo = {.undo = unreserve, .undo_arg = sku};
    idem_step_result r = {0};
    (void)arg;
    idem_code code = idem_call_step_with(call, "reserve", reserve_fn, &reserve, &undo, &r);
    code = code == IDEM_OK ? idem_call_reply(call, IDEM_OK, r.data, r.len)
                           : idem_call_fail(call, code, "%s", idem_errmsg());
    idem_step_result_clear(&r);
    return code;
}

static void order_log(void *arg, idem_log_level level, const char *line)
{
    (void)arg, (void)level;
    if (strstr(line, "redrive") != NULL || strstr(line, "compensation") != NULL) {
        cr_log_info("%s", line);
    }
    if (strstr(line, "redrive") != NULL && strstr(line, "ran it again: OK") != NULL) {
        raise_flag(&redriven_ok);
    }
    if (strstr(line, "redrive") != NULL &&
        strstr(line, "ran it again: FAILED_PRECONDITION") != NULL) {
        raise_flag(&redriven_failed);
    }
}

typedef struct method {
    const char *name;
    idem_handler_fn fn;
} ds_method;

static void downstream(tu_server *ts, const ds_method *methods, size_t n)
{
    idem_method_opts o = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    tu_server_create(ts, NULL);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(idem_server_register(ts->srv, methods[i].name, methods[i].fn, NULL, &o),
                     IDEM_OK);
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
    static const ds_method inv_methods[] = {{"inv.Stock/Reserve", inv_reserve},
                                            {"inv.Stock/Release", inv_release},
                                            {"inv.Stock/Slow", inv_slow}};
    static const ds_method pay_methods[] = {{"pay.Pay/Charge", pay_charge}};
    downstream(&inv, inv_methods, 3);
    downstream(&pay, pay_methods, 1);
    to_inv = client_of(inv.url);
    to_pay = client_of(pay.url);

    idem_server_opts o;
    idem_server_opts_init(&o);
    o.lease_ms = 400;    /* renewed every 133 ms: room for a loaded machine */
    o.max_run_ms = 1000; /* a dead run's lease ends soon; a busy machine still finishes a run */
    o.redrive_interval_ms = 20;
    o.log_level = IDEM_LOG_INFO;
    o.log_fn = order_log;
    if (tu_backend_is_pg()) {
        o.store = tu_backend_open(&order_store, "sagas");
    }
    tu_server_create(&order, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_STEPS | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(order.srv, "saga.Order/Place", place, "undo", &m), IDEM_OK);
    cr_assert_eq(idem_server_register(order.srv, "saga.Order/PlaceNoUndo", place, NULL, &m),
                 IDEM_OK);
    cr_assert_eq(idem_server_register(order.srv, "saga.Order/Slow", order_slow, NULL, &m), IDEM_OK);
    cr_assert_eq(idem_server_register(order.srv, "saga.Order/StackArg", place_stack_arg, NULL, &m),
                 IDEM_OK);
    cr_assert_eq(idem_server_listen_http(order.srv, "http://127.0.0.1:0"), IDEM_OK);
    tu_server_listen(&order);
}

static void teardown(void)
{
    raise_flag(&dead_released); /* a stalled run must not outlive its server */
    tu_server_destroy(&order, false);
    if (order_store.st != NULL) {
        tu_backend_close(&order_store);
    }
    if (plain.srv != NULL) {
        tu_server_destroy(&plain, false);
        plain.srv = NULL;
    }
    if (plain_store.st != NULL) {
        tu_backend_close(&plain_store);
    }
    idem_client_close(to_inv);
    idem_client_close(to_pay);
    tu_server_destroy(&inv, false);
    tu_server_destroy(&pay, false);
}

TestSuite(sagas, .init = setup, .fini = teardown, .timeout = 60);

static idem_code place_via(const char *method, const char *key, const char *payload,
                           uint32_t attempts, uint32_t attempt_ms, idem_result *r)
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
    idem_request q = {.method = method,
                      .idempotency_key = key,
                      .payload = payload,
                      .payload_len = strlen(payload)};
    idem_code code = idem_client_call(c, &q, r);
    idem_client_close(c);
    return code;
}

/* An order server without a re-driver (the key's generation is then read at the start
 * of a run and written with its first step's record, not at the claim). */
static void plain_start(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    if (tu_backend_is_pg()) {
        o.store = tu_backend_open(&plain_store, "sagas_plain");
    }
    tu_server_create(&plain, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_STEPS | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(plain.srv, "saga.Order/Place", place, "undo", &m), IDEM_OK);
    tu_server_listen(&plain);
}

static idem_code place_order(const char *key, const char *payload, uint32_t attempts,
                             uint32_t attempt_ms, idem_result *r)
{
    return place_via("saga.Order/Place", key, payload, attempts, attempt_ms, r);
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

/* ---- a failure after an effect ---- */

/* Case 1 without an undo: the charge refuses amount 0 after the reservation. The
 * reservation stands, so the INVALID_ARGUMENT is stored (not released as by default):
 * the same request replays it, the caller sees the payment's own reason, and the
 * corrected request is told by the order service itself to use a new key; the inventory
 * never sees the key again. */
Test(sagas, a_failure_after_a_step_without_undo_is_stored_with_the_downstreams_reason)
{
    idem_result r;
    cr_assert_eq(place_via("saga.Order/PlaceNoUndo", "cart-2", "sku-1 1 0", 1, 2000, &r),
                 IDEM_INVALID_ARGUMENT);
    cr_expect(strstr(r.message, "amount must be positive") != NULL, "the reason: '%s'", r.message);
    idem_result_clear(&r);
    cr_assert_eq(place_via("saga.Order/PlaceNoUndo", "cart-2", "sku-1 1 0", 1, 2000, &r),
                 IDEM_INVALID_ARGUMENT);
    cr_expect(r.replayed, "the stored failure replays: its effect stands");
    idem_result_clear(&r);
    cr_assert_eq(place_via("saga.Order/PlaceNoUndo", "cart-2", "sku-1 1 6", 1, 2000, &r),
                 IDEM_INVALID_ARGUMENT);
    cr_expect(strstr(r.message, "idempotency key reused") != NULL, "%s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&reserved), 1, "one reservation");
    cr_expect_eq(atomic_load(&charge_asks), 1, "one charge asked");
}

/* Case 1 with an undo: the reservation is released (compensated), the key is released,
 * and the corrected request runs afresh with new derived keys: a new reservation (no
 * "key reused" from the inventory, no replay of the first one), charged 6. */
Test(sagas, a_corrected_request_after_a_compensated_validation_error_runs_afresh)
{
    idem_result r;
    idem_code code = place_order("cart-3", "sku-1 1 0", 1, 2000, &r);
    cr_assert_eq(code, IDEM_INVALID_ARGUMENT, "%s: %s", idem_code_name(code), r.message);
    cr_expect(strstr(r.message, "amount must be positive") != NULL, "the reason: '%s'", r.message);
    cr_expect_str_eq(idem_result_metadata(&r, "idem-compensated"), "all");
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&released), 1, "the reservation was given back");
    cr_assert_eq(place_order("cart-3", "sku-1 1 6", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R2 C1", "a new reservation, then the charge");
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&reserved), 2);
    cr_expect_str_neq(reserve_keys[0], reserve_keys[1], "the run derived a new key");
    cr_expect_eq(atomic_load(&charged_total), 6, "charged 6, not an old amount");
    cr_assert_eq(place_order("cart-3", "sku-1 1 6", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect(r.replayed);
    idem_result_clear(&r);
}

/* Case 2: insufficient funds (a final failure) after the reservation: the undo gives it
 * back before the answer; the key is released, and the same request retried runs afresh
 * (new keys: a new reservation, given back again). */
Test(sagas, a_final_failure_after_a_step_gives_its_effect_back)
{
    idem_result r;
    cr_assert_eq(place_order("cart-4", "sku-1 1 500", 1, 2000, &r), IDEM_FAILED_PRECONDITION, "%s",
                 r.message);
    cr_expect(strstr(r.message, "insufficient funds") != NULL, "the reason: '%s'", r.message);
    cr_expect_str_eq(idem_result_metadata(&r, "idem-compensated"), "all");
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&reserved), 1);
    cr_expect_eq(atomic_load(&released), 1, "the reservation was given back");
    cr_assert_eq(place_order("cart-4", "sku-1 1 500", 1, 2000, &r), IDEM_FAILED_PRECONDITION, "%s",
                 r.message);
    cr_expect(!r.replayed, "released: the retry ran again");
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&reserved), 2, "a new reservation under a new key");
    cr_expect_str_neq(reserve_keys[0], reserve_keys[1]);
    cr_expect_eq(atomic_load(&released), 2);
    cr_expect_eq(atomic_load(&charged), 0);
}

/* An undo runs after the handler returned: an undo_arg on the handler's stack would be
 * read from a frame that is gone. The step refuses it before its effect, saying why. */
Test(sagas, a_step_whose_undo_arg_is_on_the_handlers_stack_is_refused_before_its_effect)
{
    idem_result r;
    cr_assert_eq(place_via("saga.Order/StackArg", "cart-stack", "sku-1 1 5", 1, 2000, &r),
                 IDEM_FAILED_PRECONDITION, "%s", r.message);
    cr_expect(strstr(r.message, "undo_arg points into the handler's stack") != NULL, "'%s'",
              r.message);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&reserve_runs), 0, "the step's effect did not run");
    cr_expect_eq(atomic_load(&reserved), 0);
}

/* The run dies inside the undo (after the inventory released): the re-driver finishes
 * the compensation: the reserve replays, the charge does not run again, the undo runs
 * again with its own derived key (the inventory replays: released once). */
Test(sagas, the_redriver_finishes_a_compensation_that_died_inside_an_undo)
{
    idem_result r;
    atomic_store(&die_in_undo, 1);
    cr_assert_neq(place_order("cart-5", "sku-1 1 500", 1, 100, &r), IDEM_OK, "the client gave up");
    idem_result_clear(&r);
    await_flag(&redriven_failed);
    cr_assert(redriven_failed, "the re-driver finished the compensation");
    cr_expect_eq(atomic_load(&reserved), 1);
    cr_expect_eq(atomic_load(&released), 1, "the undo's effect happened once");
    cr_expect_eq(atomic_load(&charge_asks), 1, "the charge was not asked again");
    raise_flag(&dead_released);
    cr_assert_eq(place_order("cart-5", "sku-1 1 50", 20, 300, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R2 C1", "released: the corrected request runs afresh");
    idem_result_clear(&r);
}

/* A transient failure keeps the journal for the same request's retry; a different
 * request that then claims the key (the caller changed the order) moves the key's
 * generation on: its derived keys are new, so the inventory reserves afresh instead
 * of answering "key reused with a different request". */
Test(sagas, another_request_after_a_transient_release_derives_new_keys)
{
    idem_result r;
    cr_assert_eq(place_order("cart-6", "sku-1 1 99", 1, 2000, &r), IDEM_UNAVAILABLE, "%s",
                 r.message);
    cr_expect(strstr(r.message, "payment system down") != NULL, "%s", r.message);
    idem_result_clear(&r);
    cr_assert_eq(place_order("cart-6", "sku-1 2 7", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R2 C1");
    idem_result_clear(&r);
    cr_expect_str_neq(reserve_keys[0], reserve_keys[1], "a new derived key");
}

/* The same two rules on a server without a re-driver. */
Test(sagas, without_a_redriver_a_compensated_or_changed_request_also_derives_new_keys)
{
    idem_client *c;
    idem_result r;
    plain_start();
    c = tu_client(plain.url, 2000);
    const char *const payloads[] = {"sku-1 1 0", "sku-1 1 6", "sku-1 1 99", "sku-1 2 7"};
    const char *const keys[] = {"cart-p1", "cart-p1", "cart-p2", "cart-p2"};
    const idem_code want[] = {IDEM_INVALID_ARGUMENT, IDEM_OK, IDEM_UNAVAILABLE, IDEM_OK};
    for (int i = 0; i < 4; i++) {
        idem_request q = {.method = "saga.Order/Place",
                          .idempotency_key = keys[i],
                          .payload = payloads[i],
                          .payload_len = strlen(payloads[i])};
        cr_assert_eq(idem_client_call(c, &q, &r), want[i], "%s: %s", payloads[i], r.message);
        idem_result_clear(&r);
    }
    idem_client_close(c);
    cr_expect_eq(atomic_load(&reserved), 4, "each run reserved under its own key");
    cr_expect_str_neq(reserve_keys[0], reserve_keys[1]);
    cr_expect_str_neq(reserve_keys[2], reserve_keys[3]);
    cr_expect_eq(atomic_load(&released), 1, "the compensated one was given back");
    cr_expect_eq(atomic_load(&charged_total), 13);
}

/* ---- case 4: whole-call deadlines ---- */

/* The inventory takes 500 ms; each attempt of the upstream client only 300 ms, its
 * whole call 8 s. The downstream call gets the whole call's deadline (less a margin),
 * not the attempt's: it finishes, the first attempt times out, the retry waits for the
 * run and replays its answer. (With the attempt's deadline every attempt failed with
 * DEADLINE_EXCEEDED and released.) */
Test(sagas, a_downstream_slower_than_an_attempt_gets_the_whole_calls_deadline)
{
    idem_result r;
    cr_assert_eq(place_via("saga.Order/Slow", "cart-slow", "", 20, 300, &r), IDEM_OK, "%s",
                 r.message);
    cr_expect_str_eq(r.payload, "slow");
    cr_expect_gt(r.attempts, 1, "the first attempt timed out");
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&slow_runs), 1, "the downstream ran once");
}

static int http_port(void)
{
    return idem_server_http_port(order.srv);
}

static void post_slow(tu_http *out, const char *key, const char *timeout)
{
    char k[64], t[64];
    snprintf(k, sizeof(k), "Idempotency-Key: %s", key);
    snprintf(t, sizeof(t), "Grpc-Timeout: %s", timeout != NULL ? timeout : "");
    const char *headers[] = {k, t};
    tu_http_post(out, http_port(), "/saga.Order/Slow", headers, timeout != NULL ? 2 : 1, "", 0);
}

/* Over HTTP the caller's deadline is Grpc-Timeout: a generous one lets the slow
 * downstream finish; a short one is what the downstream call gets (504). */
Test(sagas, an_http_request_carries_its_deadline_in_grpc_timeout)
{
    tu_http h;
    post_slow(&h, "http-1", "5S");
    cr_expect_eq(h.status, 200, "%s", h.body);
    tu_http_free(&h);
    post_slow(&h, "http-2", "200m");
    cr_expect_eq(h.status, 504, "the downstream call had 200 ms: %s", h.body);
    tu_http_free(&h);
}

Test(sagas, a_bad_grpc_timeout_is_a_400_naming_the_header)
{
    static const char *const bad[] = {"5",   "S",   "5s",        "123456789S",
                                      "5 S", "-5S", "99999999H", "5S, 6S"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tu_http h;
        post_slow(&h, "http-bad", bad[i]);
        cr_expect_eq(h.status, 400, "'%s' is refused", bad[i]);
        cr_expect(h.body != NULL && strstr(h.body, "Grpc-Timeout") != NULL, "'%s': %s", bad[i],
                  h.body);
        tu_http_free(&h);
    }
    cr_expect_eq(atomic_load(&slow_runs), 0, "nothing ran");
}
