/* The Redis debounce window against a real redis-server ($IDEMRPC_TEST_REDIS). */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "idemrpc.pb-c.h"
#include "testutil.h"

static tu_server S;
static idem_debounce *D;
static atomic_int executions;
static char key[48];

static idem_code h_submit(idem_call *call, void *arg)
{
    (void)arg;
    char out[32];
    int n = snprintf(out, sizeof(out), "order %d", atomic_fetch_add(&executions, 1) + 1);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static void setup(void)
{
    const char *url = getenv("IDEMRPC_TEST_REDIS");
    if (url == NULL) {
        cr_skip_test("IDEMRPC_TEST_REDIS not set (bash scripts/services.sh start sets it)");
    }
    cr_assert_eq(idem_debounce_create(&D, url, 300), IDEM_OK, "%s", idem_errmsg());
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.debounce = D;
    o.log_level = IDEM_LOG_OFF; /* the Redis-down test fails open on purpose */
    atomic_store(&executions, 0);
    tu_server_create(&S, &o);
    idem_method_opts m = {.flags =
                              IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED | IDEM_METHOD_DEBOUNCE};
    cr_assert_eq(idem_server_register(S.srv, "shop.Order/Submit", h_submit, NULL, &m), IDEM_OK);
    tu_server_listen(&S);
    snprintf(key, sizeof(key), "click-%llx",
             (unsigned long long)rand() ^ (unsigned long long)getpid());
}

static void teardown(void)
{
    tu_server_destroy(&S, false);
    idem_debounce_destroy(D);
}

TestSuite(debounce, .init = setup, .fini = teardown, .timeout = 60);

static idem_code submit(idem_client *c, idem_result *r)
{
    idem_request q = {.method = "shop.Order/Submit", .idempotency_key = key, .caller = "web"};
    return idem_client_call(c, &q, r);
}

static idem_client *single_attempt_client(void)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.retry.max_attempts = 1;
    cr_assert_eq(idem_client_open(&c, (const char *[]){S.url}, 1, &o), IDEM_OK);
    return c;
}

Test(debounce, a_double_click_within_the_window_is_duplicate_submit)
{
    idem_client *c = single_attempt_client();
    idem_result r;
    cr_expect_eq(submit(c, &r), IDEM_OK);
    idem_result_clear(&r);
    cr_expect_eq(submit(c, &r), IDEM_ALREADY_EXISTS);
    cr_expect_neq(strstr(r.message, "duplicate submit"), NULL, "%s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&executions), 1);

    /* After the window the repeat reaches the result cache, which replays. Polled:
     * the window's end is a time in Redis, so this waits for it, bounded to 5 s. */
    idem_code code;
    for (int i = 0; i < 250 && (code = submit(c, &r)) == IDEM_ALREADY_EXISTS; i++) {
        idem_result_clear(&r);
        nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
    }
    cr_expect_eq(code, IDEM_OK);
    cr_expect(r.replayed);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&executions), 1);
    idem_client_close(c);
}

/* Under the old key idem:{caller}:{method}:{key}, caller "X:M:b" with key "c" and caller
 * "X" with key "b:M:c" were one Redis key: the second caller's first click was
 * "duplicate submit". Each part is length-prefixed now. */
Test(debounce, callers_and_keys_with_colons_do_not_share_a_window)
{
    static const char m[] = "shop.Order/Submit";
    char caller1[128], key2[128];
    snprintf(caller1, sizeof(caller1), "%s:%s:b", key, m);
    snprintf(key2, sizeof(key2), "b:%s:c", m);
    idem_client *c = single_attempt_client();
    idem_request first = {.method = m, .idempotency_key = "c", .caller = caller1};
    idem_request second = {.method = m, .idempotency_key = key2, .caller = key};
    idem_result r;
    cr_expect_eq(idem_client_call(c, &first, &r), IDEM_OK, "%s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(idem_client_call(c, &second, &r), IDEM_OK, "another caller's window: %s",
                 r.message);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&executions), 2);
    cr_expect_eq(idem_client_call(c, &second, &r), IDEM_ALREADY_EXISTS, "its own repeat is");
    idem_result_clear(&r);
    idem_client_close(c);
}

/* A raw frame for key with the given attempt number. */
static Idem__V1__Response *send_attempt(uint32_t attempt)
{
    Idem__V1__Request q = IDEM__V1__REQUEST__INIT;
    q.method = "shop.Order/Submit";
    q.idempotency_key = key;
    q.caller = "web";
    q.attempt = attempt;
    uint8_t buf[256];
    size_t len = idem__v1__request__pack(&q, buf);
    return tu_raw_call(S.url, buf, len, 5000);
}

Test(debounce, a_retry_of_the_same_call_passes_to_the_result_cache)
{
    Idem__V1__Response *r = send_attempt(1);
    cr_assert_not_null(r);
    cr_expect_eq(r->code, IDEM__V1__CODE__OK);
    tu_response_free(r);
    r = send_attempt(2); /* the client timed out and retries: it must get the result */
    cr_assert_not_null(r);
    cr_expect_eq(r->code, IDEM__V1__CODE__OK);
    cr_expect(r->replayed);
    tu_response_free(r);
    r = send_attempt(1); /* a new click with the same key: debounced */
    cr_assert_not_null(r);
    cr_expect_eq(r->code, IDEM__V1__CODE__ALREADY_EXISTS);
    tu_response_free(r);
    cr_expect_eq(atomic_load(&executions), 1);
}

Test(debounce, redis_down_fails_open_and_calls_are_served)
{
    char cmd[512];
    const char *svc = getenv("IDEMRPC_SERVICES");
    if (svc == NULL) {
        cr_skip_test("IDEMRPC_SERVICES not set: cannot stop Redis");
    }
    snprintf(cmd, sizeof(cmd), "%s stop-redis", svc);
    cr_assert_eq(system(cmd), 0);
    idem_client *c = single_attempt_client();
    idem_result r;
    cr_expect_eq(submit(c, &r), IDEM_OK, "%s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(submit(c, &r), IDEM_OK, "without Redis the result cache still answers");
    cr_expect(r.replayed);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&executions), 1);
    idem_client_close(c);
    snprintf(cmd, sizeof(cmd), "%s start-redis", svc);
    cr_assert_eq(system(cmd), 0);
}
