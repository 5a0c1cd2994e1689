/* Service chains (downstream.h): a handler of service `order` calls service `payment`
 * with idem_call_downstream. Two real servers, each with its own store, the real
 * client between them. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define TRACEPARENT "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

static tu_server order, payment;
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
        int n = snprintf(out, sizeof(out), "up_deadline=%llu %.*s",
                         (unsigned long long)idem_call_deadline_ms(call), (int)r.payload_len,
                         (const char *)r.payload);
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

    tu_server_create(&order, NULL);
    cr_assert_eq(idem_server_register(order.srv, "order.Order/Place", place, NULL, &m), IDEM_OK);
    cr_assert_eq(idem_server_register(order.srv, "order.Order/Keyless", keyless, NULL, NULL),
                 IDEM_OK);
    tu_server_listen(&order);
    payment_log[0] = '\0';
}

static void teardown(void)
{
    tu_server_destroy(&order, false);
    idem_client_close(to_payment);
    tu_server_destroy(&payment, false);
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
