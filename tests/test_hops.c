/* Service chains (downstream.h): a handler of service `order` calls service `payment`
 * with idem_call_downstream, and journals its steps with idem_call_step. Two real
 * servers, each with its own store, the real client between them. One suite, both
 * stores for the order service's journal: `hops` (LMDB) and `hops_pg`. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

#define TRACEPARENT "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

static tu_server order, payment;
static tu_backend order_store;
static idem_client *to_payment;
static atomic_int charges, order_runs, fail_after_charge;
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char payment_log[8192];

static void keep_log(void *arg, idem_log_level level, const char *line)
{
    (void)arg, (void)level;
    pthread_mutex_lock(&log_mu);
    size_t n = strlen(payment_log);
    snprintf(payment_log + n, sizeof(payment_log) - n, "%s\n", line);
    pthread_mutex_unlock(&log_mu);
}

/* payment.Pay/Charge: says what it saw of the call. */
static idem_code charge(idem_call *call, void *arg)
{
    (void)arg;
    char out[512];
    const char *tp = idem_call_metadata(call, "traceparent");
    atomic_fetch_add(&charges, 1);
    int n = snprintf(out, sizeof(out), "key=%s caller=%s request_id=%s deadline=%llu trace=%s",
                     idem_call_key(call), idem_call_caller(call), idem_call_request_id(call),
                     (unsigned long long)idem_call_deadline_ms(call), tp != NULL ? tp : "-");
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* order.Order/Place: charges through the hop, then (while fail_after_charge lasts)
 * fails transiently, so that the client retries the whole order. */
static idem_code place(idem_call *call, void *arg)
{
    (void)arg;
    idem_request q = {.method = "pay.Pay/Charge", .payload = "100", .payload_len = 3};
    idem_result r;
    atomic_fetch_add(&order_runs, 1);
    idem_code code = idem_call_downstream(call, to_payment, "charge", &q, &r);
    if (code != IDEM_OK) {
        code = idem_call_fail(call, code, "charge: %s", r.message ? r.message : idem_errmsg());
    } else if (atomic_fetch_sub(&fail_after_charge, 1) > 0) {
        code = idem_call_fail(call, IDEM_UNAVAILABLE, "crashed after the charge");
    } else {
        char out[700];
        /* the upstream caller's whole call: what the hop's deadline is taken from */
        int n = snprintf(out, sizeof(out), "up_deadline=%llu %.*s",
                         (unsigned long long)idem_call_overall_deadline_ms(call),
                         (int)r.payload_len, (const char *)r.payload);
        code = idem_call_reply(call, IDEM_OK, out, (size_t)n);
    }
    idem_result_clear(&r);
    return code;
}

/* Without an upstream key there is nothing stable to derive from: refused, not guessed. */
static idem_code keyless(idem_call *call, void *arg)
{
    (void)arg;
    char key[IDEM_DERIVED_KEY_LEN + 1];
    idem_code a = idem_call_derive_key(call, "charge", key);
    idem_code b = idem_call_derive_key(call, "no spaces", key);
    char out[64];
    int n = snprintf(out, sizeof(out), "%s %s", idem_code_name(a), idem_code_name(b));
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* ---- journaled steps: order.Order/Checkout reserves, then charges ---- */

static atomic_int reserves, charged, checkout_runs, fail_between, fail_after, step_refusals;
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static atomic_int stall_first;   /* the first run stalls before its charge step */
static bool second_charged;      /* the run that took over recorded its charge */
static bool first_done;          /* the stalled run's charge step returned */
static atomic_int abandon_first; /* the first run stalls between its steps */
static bool abandoned_released;  /* ... until the test lets it go on */
static bool woken_done;          /* ... and its steps have returned */
static bool redriven, redriven_ok, journal_removed, not_rerun; /* the re-driver's log said */

static idem_code numbered(idem_step_result *out, char tag, int n)
{
    char buf[16];
    int len = snprintf(buf, sizeof(buf), "%c%d", tag, n);
    if ((out->data = malloc((size_t)len)) == NULL) {
        return IDEM_RESOURCE_EXHAUSTED;
    }
    memcpy(out->data, buf, (size_t)len);
    out->len = (size_t)len;
    return IDEM_OK;
}

static idem_code reserve_fn(idem_call *call, void *arg, idem_step_result *out)
{
    (void)call, (void)arg;
    return numbered(out, 'R', atomic_fetch_add(&reserves, 1) + 1);
}

static void stall_until_taken_over(void);

/* With stall_first, the first charge stalls (after its effect) until a run that took
 * over the claim has recorded its own. */
static idem_code charge_fn(idem_call *call, void *arg, idem_step_result *out)
{
    (void)call, (void)arg;
    int n = atomic_fetch_add(&charged, 1) + 1;
    if (n == 1 && atomic_load(&stall_first)) {
        stall_until_taken_over();
    }
    return numbered(out, 'C', n);
}

/* Waits (bounded at 5 s) for *flag. */
/* Waits for flag, at most seconds: a hang guard, not a timing assertion. */
static void await_flag_for(const bool *flag, int seconds)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += seconds;
    pthread_mutex_lock(&gate_mu);
    while (!*flag && pthread_cond_timedwait(&gate_cv, &gate_mu, &until) == 0) {
    }
    pthread_mutex_unlock(&gate_mu);
}

/* What a test awaits: generous, a loaded machine's re-driver may take a while. */
static void await_flag(const bool *flag)
{
    await_flag_for(flag, 30);
}

static void raise_flag(bool *flag)
{
    pthread_mutex_lock(&gate_mu);
    *flag = true;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}

/* The first run waits until a run that took over its claim has charged. */
static void stall_until_taken_over(void)
{
    await_flag(&second_charged);
}

/* After the charge step: the run that took over lets the stalled one record (or try)
 * before it completes the call and deletes the journal. */
static void handshake(int run)
{
    if (run == 1) {
        raise_flag(&first_done);
    } else {
        raise_flag(&second_charged);
        await_flag(&first_done);
    }
}

static idem_code checkout(idem_call *call, void *arg)
{
    (void)arg;
    idem_step_result r = {0}, c = {0};
    int run = atomic_fetch_add(&checkout_runs, 1) + 1;
    idem_code code = idem_call_step(call, "reserve", reserve_fn, NULL, &r);
    if (run == 1 && atomic_load(&abandon_first)) {
        await_flag_for(&abandoned_released, 5); /* its process "died": nobody renews its lease */
    }
    if (code == IDEM_OK && atomic_fetch_sub(&fail_between, 1) > 0) {
        code = idem_call_fail(call, IDEM_UNAVAILABLE, "crashed between the steps");
    } else if (code == IDEM_OK) {
        code = idem_call_step(call, "charge", charge_fn, NULL, &c);
        if (code == IDEM_ABORTED) {
            atomic_fetch_add(&step_refusals, 1);
        }
        if (atomic_load(&stall_first)) {
            handshake(run);
        }
    }
    if (run == 1 && atomic_load(&abandon_first)) {
        raise_flag(&woken_done);
    }
    if (code == IDEM_OK && atomic_fetch_sub(&fail_after, 1) > 0) {
        code = idem_call_fail(call, IDEM_UNAVAILABLE, "crashed after the steps");
    } else if (code == IDEM_OK) {
        char out[64];
        int n = snprintf(out, sizeof(out), "%.*s %.*s%s", (int)r.len, (const char *)r.data,
                         (int)c.len, (const char *)c.data, r.replayed ? " (reserve replayed)" : "");
        code = idem_call_reply(call, IDEM_OK, out, (size_t)n);
    } else if (idem_call_code(call) == IDEM_OK) {
        code = idem_call_fail(call, code, "step: %s", idem_errmsg());
    }
    idem_step_result_clear(&r);
    idem_step_result_clear(&c);
    return code;
}

static idem_code step_in_plain_method(idem_call *call, void *arg)
{
    (void)arg;
    idem_step_result r;
    idem_code code = idem_call_step(call, "reserve", reserve_fn, NULL, &r);
    return idem_call_reply(call, IDEM_OK, idem_code_name(code), strlen(idem_code_name(code)));
}

/* order.Order/ByCart's business key: the payload, and "-v2" once rekeyed (a deploy that
 * changed how keys are made). */
static atomic_int rekeyed;
static bool cart_key(const idem_call *call, char *buf, size_t cap, void *arg)
{
    size_t n;
    const void *p = idem_call_payload(call, &n);
    (void)arg;
    return snprintf(buf, cap, "%.*s%s", (int)n, (const char *)p,
                    atomic_load(&rekeyed) ? "-v2" : "") < (int)cap;
}

static void register_steps(idem_server *srv)
{
    idem_method_opts m = {.flags = IDEM_METHOD_STEPS};
    idem_method_opts by_cart = {.flags = IDEM_METHOD_STEPS, .extractor = cart_key};
    cr_assert_eq(idem_server_register(srv, "order.Order/Checkout", checkout, NULL, &m), IDEM_OK);
    cr_assert_eq(idem_server_register(srv, "order.Order/ByCart", checkout, NULL, &by_cart),
                 IDEM_OK);
    cr_assert_eq(idem_server_register(srv, "order.Order/Plain", step_in_plain_method, NULL, NULL),
                 IDEM_OK);
}

static void setup(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.log_level = IDEM_LOG_INFO;
    o.log_fn = keep_log;
    tu_server_create(&payment, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(payment.srv, "pay.Pay/Charge", charge, NULL, &m), IDEM_OK);
    tu_server_listen(&payment);

    idem_client_opts co;
    idem_client_opts_init(&co);
    co.caller = "order-svc";
    co.retry.period_ms = 10;
    cr_assert_eq(idem_client_open(&to_payment, (const char *[]){payment.url}, 1, &co), IDEM_OK);

    idem_server_opts oo;
    idem_server_opts_init(&oo);
    oo.lease_ms = 150;
    oo.max_run_ms = 150; /* a stalled run loses its claim soon (the takeover test) */
    if (tu_backend_is_pg()) {
        oo.store = tu_backend_open(&order_store, "hops");
    }
    tu_server_create(&order, &oo);
    register_steps(order.srv);
    cr_assert_eq(idem_server_register(order.srv, "order.Order/Place", place, NULL, &m), IDEM_OK);
    cr_assert_eq(idem_server_register(order.srv, "order.Order/Keyless", keyless, NULL, NULL),
                 IDEM_OK);
    tu_server_listen(&order);
    payment_log[0] = '\0';
}

static void close_kept_clients(void);

static void teardown(void)
{
    tu_server_destroy(&order, false);
    if (order_store.st != NULL) {
        tu_backend_close(&order_store);
    }
    idem_client_close(to_payment);
    tu_server_destroy(&payment, false);
    close_kept_clients();
}

TestSuite(hops, .init = setup, .fini = teardown, .timeout = 60);

static idem_code place_order(const char *caller, const char *key, uint32_t attempts, idem_result *r)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.retry.max_attempts = attempts;
    o.retry.period_ms = 10;
    o.deadline_ms = 4000;
    cr_assert_eq(idem_client_open(&c, (const char *[]){order.url}, 1, &o), IDEM_OK);
    idem_metadata_kv md[] = {{"traceparent", TRACEPARENT}};
    idem_request q = {.method = "order.Order/Place",
                      .idempotency_key = key,
                      .caller = caller,
                      .request_id = "rid-1",
                      .metadata = md,
                      .metadata_count = 1};
    idem_code code = idem_client_call(c, &q, r);
    idem_client_close(c);
    return code;
}

static const char *field(const char *payload, const char *name, char *buf, size_t cap)
{
    const char *p = strstr(payload, name);
    cr_assert_not_null(p, "no %s in '%s'", name, payload);
    p += strlen(name);
    size_t n = strcspn(p, " ");
    snprintf(buf, cap, "%.*s", (int)(n < cap ? n : cap - 1), p);
    return buf;
}

Test(hops, every_retry_of_the_upstream_call_sends_the_same_downstream_key)
{
    idem_result r;
    atomic_store(&fail_after_charge, 2); /* two upstream attempts fail after charging */
    cr_assert_eq(place_order("shop-1", "order-42", 5, &r), IDEM_OK, "%s", r.message);
    cr_expect_eq(atomic_load(&order_runs), 3, "the order handler ran three times");
    cr_expect_eq(atomic_load(&charges), 1, "payment charged once: the key was the same");
    char key[80], caller[64], buf[64];
    field(r.payload, "key=", key, sizeof(key));
    cr_expect_eq(strncmp(key, "d-", 2), 0, "%s", key);
    cr_expect_eq(strlen(key), IDEM_DERIVED_KEY_LEN);
    cr_expect_str_eq(field(r.payload, "caller=", caller, sizeof(caller)), "order-svc",
                     "the downstream caller is the calling service, not its caller");
    cr_expect_str_eq(field(r.payload, "request_id=", buf, sizeof(buf)), "rid-1");
    cr_expect_str_eq(field(r.payload, "trace=", buf, sizeof(buf)), TRACEPARENT);
    idem_result_clear(&r);
    pthread_mutex_lock(&log_mu);
    cr_expect_neq(
        strstr(payment_log, "request_id=\"rid-1\" trace_id=4bf92f3577b34da6a3ce929d0e0e4736"), NULL,
        "payment's log line names the request and the trace:\n%s", payment_log);
    pthread_mutex_unlock(&log_mu);
}

Test(hops, the_key_depends_on_caller_key_and_step_only)
{
    idem_result a, b, c;
    cr_assert_eq(place_order("shop-1", "order-1", 1, &a), IDEM_OK, "%s", a.message);
    cr_assert_eq(place_order("shop-2", "order-1", 1, &b), IDEM_OK, "%s", b.message);
    cr_assert_eq(place_order("shop-1", "order-2", 1, &c), IDEM_OK, "%s", c.message);
    char ka[80], kb[80], kc[80];
    field(a.payload, "key=", ka, sizeof(ka));
    field(b.payload, "key=", kb, sizeof(kb));
    field(c.payload, "key=", kc, sizeof(kc));
    cr_expect_str_neq(ka, kb, "another upstream caller, another downstream key");
    cr_expect_str_neq(ka, kc, "another upstream key, another downstream key");
    cr_expect_eq(atomic_load(&charges), 3);
    idem_result_clear(&a);
    idem_result_clear(&b);
    idem_result_clear(&c);
}

Test(hops, the_downstream_deadline_is_inside_the_upstream_one)
{
    idem_result r;
    char up[32], down[32];
    cr_assert_eq(place_order("shop-1", "order-7", 1, &r), IDEM_OK, "%s", r.message);
    unsigned long long u = strtoull(field(r.payload, "up_deadline=", up, sizeof(up)), NULL, 10);
    unsigned long long d = strtoull(field(r.payload, " deadline=", down, sizeof(down)), NULL, 10);
    cr_expect_gt(u, 0);
    cr_expect_gt(d, 0);
    cr_expect_lt(d, u, "downstream %llu must end before upstream %llu", d, u);
    idem_result_clear(&r);
}

Test(hops, a_call_without_a_key_or_a_bad_step_name_cannot_derive_one)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.never_generate_key = true;
    cr_assert_eq(idem_client_open(&c, (const char *[]){order.url}, 1, &o), IDEM_OK);
    idem_request q = {.method = "order.Order/Keyless"};
    idem_result r;
    cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "FAILED_PRECONDITION INVALID_ARGUMENT");
    idem_result_clear(&r);
    idem_client_close(c);
}

/* Clients whose attempts timed out get late answers (the parked duplicates of those
 * attempts are answered when the call completes). Debian's nng 1.5.2 can hang in
 * nng_close when a reply arrives on a tcp pipe while it closes (nanomsg/nng#1636, fixed
 * in 1.6.0), so these clients are closed at teardown, after the servers: by then their
 * connections are closed from the other side. */
#define MAX_KEPT 16
static idem_client *kept[MAX_KEPT];
static size_t n_kept;

static void close_kept_clients(void)
{
    while (n_kept > 0) {
        idem_client_close(kept[--n_kept]);
    }
}

static idem_code checkout_at(const char *url, const char *key, uint32_t attempts,
                             uint32_t attempt_ms, idem_result *r)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.retry.max_attempts = attempts;
    o.retry.period_ms = 20;
    o.attempt_timeout_ms = attempt_ms;
    o.deadline_ms = 8000;
    cr_assert_lt(n_kept, MAX_KEPT);
    cr_assert_eq(idem_client_open(&c, (const char *[]){url}, 1, &o), IDEM_OK);
    kept[n_kept++] = c;
    idem_request q = {.method = "order.Order/Checkout", .idempotency_key = key};
    return idem_client_call(c, &q, r);
}

static idem_code checkout_call(const char *key, uint32_t attempts, uint32_t attempt_ms,
                               idem_result *r)
{
    return checkout_at(order.url, key, attempts, attempt_ms, r);
}

Test(hops, a_run_after_a_failure_between_two_steps_replays_the_first_and_runs_the_second)
{
    idem_result r;
    atomic_store(&fail_between, 1);
    cr_assert_eq(checkout_call("cart-1", 3, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_eq(atomic_load(&checkout_runs), 2);
    cr_expect_eq(atomic_load(&reserves), 1, "stock reserved once");
    cr_expect_eq(atomic_load(&charged), 1);
    cr_expect_str_eq(r.payload, "R1 C1 (reserve replayed)");
    idem_result_clear(&r);
}

Test(hops, a_run_after_both_steps_replays_both_and_the_journal_is_gone_at_completion)
{
    idem_result r;
    atomic_store(&fail_after, 2);
    cr_assert_eq(checkout_call("cart-2", 5, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_eq(atomic_load(&checkout_runs), 3);
    cr_expect_eq(atomic_load(&reserves), 1);
    cr_expect_eq(atomic_load(&charged), 1, "charged once over three runs");
    cr_expect_str_eq(r.payload, "R1 C1 (reserve replayed)");
    idem_result_clear(&r);
    cr_assert_eq(checkout_call("cart-2", 1, 2000, &r), IDEM_OK);
    cr_expect(r.replayed, "the completed call replays");
    idem_result_clear(&r);

    /* With its record deleted (an operator, or the sweep after the TTL), the same key is
     * a new call: had the journal outlived the completion, its steps would replay. */
    idem_key_ref k = {"", "order.Order/Checkout", "cart-2"};
    cr_assert_eq(idem_store_delete(idem_server_store(order.srv), &k), IDEM_OK);
    cr_assert_eq(checkout_call("cart-2", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R2 C2", "the journal was deleted at completion");
    idem_result_clear(&r);
}

/* A run stalls past its lease (max_run_ms 150) inside its second step; the retry takes
 * the claim over and runs the call again: the first step replays, the second runs and
 * is recorded. When the stalled run resumes, recording its step is refused: it cannot
 * overwrite the new owner's journal, and the client gets the new owner's answer. */
Test(hops, a_run_that_lost_its_claim_cannot_record_a_step)
{
    idem_result r;
    atomic_store(&stall_first, 1);
    cr_assert_eq(checkout_call("cart-3", 50, 300, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R1 C2 (reserve replayed)");
    idem_result_clear(&r);
    tu_server_destroy(&order, false); /* lets the stalled run finish before counting */
    cr_expect_eq(atomic_load(&reserves), 1, "the takeover replayed the reserve step");
    cr_expect_eq(atomic_load(&step_refusals), 1, "the stalled run's step was refused");
    cr_expect_eq(atomic_load(&charged), 2,
                 "the stalled run's charge fn ran (give it the step's derived key) but was "
                 "not recorded");
}

Test(hops, steps_need_a_claim_mode_call)
{
    idem_client *c = tu_client(order.url, 2000);
    idem_request q = {.method = "order.Order/Plain"};
    idem_result r;
    cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "FAILED_PRECONDITION");
    idem_result_clear(&r);
    idem_client_close(c);
}

/* ---- the re-driver ---- */

static void redriver_log(void *arg, idem_log_level level, const char *line)
{
    (void)arg, (void)level;
    if (strstr(line, "redrive") != NULL && strstr(line, "ran it again") != NULL) {
        cr_log_info("%s", line);
        raise_flag(&redriven);
        if (strstr(line, "ran it again: OK") != NULL) {
            raise_flag(&redriven_ok);
        }
    } else if (strstr(line, "removed the step journal") != NULL) {
        raise_flag(&journal_removed);
    } else if (strstr(line, "redrive") != NULL && strstr(line, "did not run it") != NULL) {
        cr_log_info("%s", line);
        raise_flag(&not_rerun);
    }
}

/* An order server whose re-driver looks every 20 ms; leases end 150 ms after a run
 * stops renewing (max_run_ms 150). */
static void redriving_server(tu_server *ts, tu_backend *b, uint64_t result_ttl_ms)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.result_ttl_ms = result_ttl_ms;
    o.lease_ms = 150;
    o.max_run_ms = 150;
    o.redrive_interval_ms = 20;
    o.log_level = IDEM_LOG_INFO;
    o.log_fn = redriver_log;
    if (tu_backend_is_pg()) {
        o.store = tu_backend_open(b, "hops_rd");
    }
    tu_server_create(ts, &o);
    register_steps(ts->srv);
    tu_server_listen(ts);
}

static void redriving_server_destroy(tu_server *ts, tu_backend *b)
{
    tu_server_destroy(ts, false);
    if (b->st != NULL) {
        tu_backend_close(b);
    }
}

/* The first run reserves, then its owner "dies" between the steps (it stops, and its
 * lease lapses), and its client gives up after one attempt. With no client retry, the
 * re-driver runs the stored request again: the reserve replays, the charge runs once,
 * the outcome is recorded, and the client's later retry replays it. */
Test(hops, the_redriver_finishes_an_abandoned_call_from_its_stored_request)
{
    tu_server rd;
    tu_backend rd_store = {0};
    idem_result r;
    redriving_server(&rd, &rd_store, 0);
    atomic_store(&abandon_first, 1);
    cr_assert_neq(checkout_at(rd.url, "cart-rd", 1, 100, &r), IDEM_OK, "the client gave up");
    idem_result_clear(&r);

    await_flag(&redriven);
    cr_assert(redriven, "the re-driver ran the abandoned call");
    cr_expect_eq(atomic_load(&checkout_runs), 2);
    cr_expect_eq(atomic_load(&reserves), 1, "stock reserved once");
    cr_expect_eq(atomic_load(&charged), 1, "charged once");
    cr_assert_eq(checkout_at(rd.url, "cart-rd", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect(r.replayed, "the client's retry replays the re-driven outcome");
    cr_expect_str_eq(r.payload, "R1 C1 (reserve replayed)");
    idem_result_clear(&r);
    raise_flag(&abandoned_released);
    await_flag(&woken_done);
    cr_expect_eq(atomic_load(&charged), 1, "the dead run, woken, did not charge");
    redriving_server_destroy(&rd, &rd_store);
}

/* The same dead run wakes after the new owner completed the call (and deleted its
 * journal): its charge step is refused against the record before its fn runs, so it
 * neither charges again nor leaves a journal for a later call with the same key. */
Test(hops, a_run_that_wakes_after_the_call_completed_records_no_step)
{
    idem_result r;
    atomic_store(&abandon_first, 1);
    cr_assert_neq(checkout_call("cart-late", 1, 100, &r), IDEM_OK);
    idem_result_clear(&r);
    cr_assert_eq(checkout_call("cart-late", 50, 300, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R1 C1 (reserve replayed)");
    idem_result_clear(&r);
    raise_flag(&abandoned_released);
    await_flag(&woken_done);
    cr_expect_eq(atomic_load(&step_refusals), 1, "the woken run's charge step was refused");
    cr_expect_eq(atomic_load(&charged), 1, "... before its fn ran");
    idem_key_ref k = {"", "order.Order/Checkout", "cart-late"};
    cr_assert_eq(idem_store_delete(idem_server_store(order.srv), &k), IDEM_OK);
    cr_assert_eq(checkout_call("cart-late", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R2 C2", "no step of the old call replays");
    cr_expect_eq(atomic_load(&charged), 2);
    idem_result_clear(&r);
}

/* A completion whose journal deletion failed (a trigger refuses deletes from idem_kv)
 * leaves the journal; the re-driver removes it once it can, so that a later call with
 * the same key (its record deleted) runs its steps afresh. */
Test(hops, the_redriver_removes_a_journal_its_completion_could_not_delete)
{
    tu_server rd;
    tu_backend rd_store = {0};
    idem_result r;
    if (!tu_backend_is_pg()) {
        cr_skip_test("PostgreSQL only: a trigger makes the deletion fail");
    }
    redriving_server(&rd, &rd_store, 0);
    tu_pg_exec(rd_store.conninfo,
               "CREATE TABLE refuse_deletes (x int); INSERT INTO refuse_deletes VALUES (1);"
               "CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
               " IF EXISTS (SELECT 1 FROM refuse_deletes) THEN RAISE EXCEPTION 'refused';"
               " END IF; RETURN OLD; END $$;"
               "CREATE TRIGGER refuse BEFORE DELETE ON idem_kv FOR EACH ROW"
               " EXECUTE FUNCTION refuse_delete();");
    cr_assert_eq(checkout_at(rd.url, "cart-left", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R1 C1");
    idem_result_clear(&r);
    tu_pg_exec(rd_store.conninfo, "DELETE FROM refuse_deletes");
    await_flag(&journal_removed);
    cr_assert(journal_removed, "the re-driver removed the journal left after the outcome");
    idem_key_ref k = {"", "order.Order/Checkout", "cart-left"};
    cr_assert_eq(idem_store_delete(idem_server_store(rd.srv), &k), IDEM_OK);
    cr_assert_eq(checkout_at(rd.url, "cart-left", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R2 C2", "no step of the old call replays");
    idem_result_clear(&r);
    redriving_server_destroy(&rd, &rd_store);
}

static void sleep_ms(long ms)
{
    nanosleep(&(struct timespec){ms / 1000, (ms % 1000) * 1000000}, NULL);
}

/* A call released after a transient failure keeps its journal for the client's retry
 * however long it takes (past the result TTL, 300 ms here, and many re-driver passes):
 * each retry replays what earlier runs recorded, and nothing runs twice. */
Test(hops, a_released_call_keeps_its_journal_for_the_retry)
{
    tu_server rd;
    tu_backend rd_store = {0};
    idem_result r;
    redriving_server(&rd, &rd_store, 300);
    atomic_store(&fail_between, 1);
    cr_assert_eq(checkout_at(rd.url, "cart-slow", 1, 2000, &r), IDEM_UNAVAILABLE, "%s", r.message);
    idem_result_clear(&r);
    sleep_ms(400); /* past the TTL: time itself is what this test waits for */
    atomic_store(&fail_after, 1);
    cr_assert_eq(checkout_at(rd.url, "cart-slow", 1, 2000, &r), IDEM_UNAVAILABLE, "%s", r.message);
    idem_result_clear(&r);
    sleep_ms(400);
    cr_assert_eq(checkout_at(rd.url, "cart-slow", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R1 C1 (reserve replayed)");
    cr_expect_eq(atomic_load(&reserves), 1, "reserved once over three runs");
    cr_expect_eq(atomic_load(&charged), 1, "charged once over two runs");
    idem_result_clear(&r);
    redriving_server_destroy(&rd, &rd_store);
}

/* The re-run of an abandoned call fails transiently between its steps: its client is
 * gone, so the release keeps it listed, and the next pass runs it again (within
 * redrive_max_runs): the reserve replays, the charge runs once, the outcome is stored. */
Test(hops, a_rerun_released_after_a_transient_failure_is_run_again)
{
    tu_server rd;
    tu_backend rd_store = {0};
    idem_result r;
    redriving_server(&rd, &rd_store, 0);
    atomic_store(&abandon_first, 1);
    atomic_store(&fail_between, 1); /* run 1 stalls before it gets there: run 2 fails */
    cr_assert_neq(checkout_at(rd.url, "cart-again", 1, 100, &r), IDEM_OK, "the client gave up");
    idem_result_clear(&r);
    await_flag(&redriven_ok);
    cr_assert(redriven_ok, "a second re-run finished the call");
    cr_expect_eq(atomic_load(&checkout_runs), 3);
    cr_expect_eq(atomic_load(&reserves), 1);
    cr_expect_eq(atomic_load(&charged), 1);
    cr_assert_eq(checkout_at(rd.url, "cart-again", 1, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect(r.replayed);
    cr_expect_str_eq(r.payload, "R1 C1 (reserve replayed)");
    idem_result_clear(&r);
    raise_flag(&abandoned_released);
    redriving_server_destroy(&rd, &rd_store);
}

/* A run that stalled past its lease runs no further step even before anyone took the
 * call over: a takeover may start it again any moment. */
Test(hops, a_run_past_its_lease_starts_no_step)
{
    idem_result r;
    idem_record rec;
    idem_key_ref k = {"", "order.Order/Checkout", "cart-lapsed"};
    atomic_store(&abandon_first, 1);
    cr_assert_neq(checkout_call("cart-lapsed", 1, 100, &r), IDEM_OK);
    idem_result_clear(&r);
    for (int i = 0; i < 500; i++) { /* until the lease has run out (max_run_ms 150) */
        cr_assert_eq(idem_store_get(idem_server_store(order.srv), &k, &rec), IDEM_OK);
        uint64_t now = rec.now_ms ? rec.now_ms : (uint64_t)time(NULL) * 1000;
        bool lapsed = rec.lease_until_ms + 1000 < now; /* a second of margin: whole seconds */
        idem_record_clear(&rec);
        if (lapsed) {
            break;
        }
        sleep_ms(10); /* the clock: polled */
    }
    raise_flag(&abandoned_released);
    await_flag(&woken_done);
    cr_expect_eq(atomic_load(&step_refusals), 1, "the lapsed run's charge step was refused");
    cr_expect_eq(atomic_load(&charged), 0, "... before its fn ran");
    cr_assert_eq(checkout_call("cart-lapsed", 5, 2000, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "R1 C1 (reserve replayed)");
    idem_result_clear(&r);
}

/* A re-run claims the record its first run claimed, or nothing: when the request now
 * resolves to another key (the extractor changed), it is refused before any step
 * would run again under a fresh journal. */
Test(hops, a_rerun_that_resolves_another_key_runs_nothing)
{
    tu_server rd;
    tu_backend rd_store = {0};
    idem_client *c;
    idem_client_opts o;
    idem_result r;
    redriving_server(&rd, &rd_store, 0);
    atomic_store(&abandon_first, 1);
    idem_client_opts_init(&o);
    o.retry.max_attempts = 1;
    o.attempt_timeout_ms = 100;
    cr_assert_eq(idem_client_open(&c, (const char *[]){rd.url}, 1, &o), IDEM_OK);
    idem_request q = {.method = "order.Order/ByCart", .payload = "cart-9", .payload_len = 6};
    cr_assert_neq(idem_client_call(c, &q, &r), IDEM_OK, "the client gave up");
    idem_result_clear(&r);
    idem_client_close(c);
    atomic_store(&rekeyed, 1);
    await_flag(&not_rerun);
    cr_assert(not_rerun, "the re-driver's re-run was refused");
    cr_expect_eq(atomic_load(&checkout_runs), 1, "no second run");
    cr_expect_eq(atomic_load(&reserves), 1);
    raise_flag(&abandoned_released);
    redriving_server_destroy(&rd, &rd_store);
}

/* Off by default: without it, only the client's retry (after the lease) runs the call. */
Test(hops, without_the_redriver_an_abandoned_call_waits_for_a_client_retry)
{
    idem_server_opts o;
    idem_result r;
    idem_server_opts_init(&o);
    cr_assert_eq(o.redrive_interval_ms, 0, "the re-driver is off by default");
    atomic_store(&abandon_first, 1);
    cr_assert_neq(checkout_call("cart-nord", 1, 100, &r), IDEM_OK);
    idem_result_clear(&r);
    cr_assert_eq(checkout_call("cart-nord", 50, 300, &r), IDEM_OK, "%s", r.message);
    /* The retry ran it, nothing else did: two runs, the abandoned one and the retry's
     * (whose answer a later attempt may have replayed, on a loaded machine). */
    cr_expect_eq(atomic_load(&checkout_runs), 2, "the retry ran it (nothing else did)");
    cr_expect_str_eq(r.payload, "R1 C1 (reserve replayed)");
    idem_result_clear(&r);
    raise_flag(&abandoned_released);
}
