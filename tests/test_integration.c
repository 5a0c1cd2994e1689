/* Integration: a real server on tcp://127.0.0.1:<free port>, the real client. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "idemrpc.pb-c.h"
#include "testutil.h"

#define STORM 16

/* What the test handlers count and how they behave. */
static struct {
    atomic_int executions;
    atomic_int arrivals;   /* calls seen by the first interceptor, before any dedupe */
    atomic_int entered;    /* Gated: handlers that have started */
    atomic_int fail_first; /* Flaky: answer UNAVAILABLE this many times */
    int slow_ms;           /* Slow: simulated work per execution */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool gate_open; /* Gated: the handler blocks until the test opens the gate */
} H = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static tu_server S;
static idem_client *C;

static idem_code reply_execution(idem_call *call)
{
    char out[64];
    size_t n;
    const char *p = idem_call_payload(call, &n);
    int no = atomic_fetch_add(&H.executions, 1) + 1;
    int len = snprintf(out, sizeof(out), "exec=%d payload=%.*s", no, (int)n, p);
    idem_call_set_response_metadata(call, "exec-no", out + 5);
    return idem_call_reply(call, IDEM_OK, out, (size_t)len);
}

static idem_code h_echo(idem_call *call, void *arg)
{
    (void)arg;
    return reply_execution(call);
}

/* Fills the handler's share of response metadata (60 entries) and tries one more. */
static idem_code h_meta(idem_call *call, void *arg)
{
    (void)arg;
    char name[16];
    for (int i = 0; i < 60; i++) {
        snprintf(name, sizeof(name), "m%d", i);
        if (idem_call_set_response_metadata(call, name, "v") != IDEM_OK) {
            return idem_call_fail(call, IDEM_INTERNAL, "entry %d refused", i);
        }
    }
    if (idem_call_set_response_metadata(call, "one-too-many", "v") != IDEM_RESOURCE_EXHAUSTED) {
        return idem_call_fail(call, IDEM_INTERNAL, "entry 61 accepted");
    }
    return reply_execution(call);
}

/* The business key of a payment callback: its payload is the out_trade_no. */
static bool out_trade_no(const idem_call *call, char *buf, size_t cap, void *arg)
{
    (void)arg;
    size_t n;
    const char *p = idem_call_payload(call, &n);
    return n > 0 && snprintf(buf, cap, "%.*s", (int)n, p) > 0;
}

static idem_code h_flaky(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&H.executions, 1);
    if (atomic_fetch_sub(&H.fail_first, 1) > 0) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "downstream unavailable");
    }
    return idem_call_reply(call, IDEM_OK, "done", 4);
}

static idem_code h_reject(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&H.executions, 1);
    return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "insufficient balance");
}

static idem_code h_slow(idem_call *call, void *arg)
{
    (void)arg;
    struct timespec ts = {H.slow_ms / 1000, (H.slow_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL); /* the work itself, not synchronisation */
    return reply_execution(call);
}

static idem_code h_gated(idem_call *call, void *arg)
{
    (void)arg;
    pthread_mutex_lock(&H.mu);
    atomic_fetch_add(&H.entered, 1);
    pthread_cond_broadcast(&H.cv);
    while (!H.gate_open) {
        pthread_cond_wait(&H.cv, &H.mu);
    }
    pthread_mutex_unlock(&H.mu);
    return reply_execution(call);
}

/* First in the chain: counts arrivals so a test can await "all duplicates are in". */
static idem_code count_arrivals(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    pthread_mutex_lock(&H.mu);
    atomic_fetch_add(&H.arrivals, 1);
    pthread_cond_broadcast(&H.cv);
    pthread_mutex_unlock(&H.mu);
    return idem_call_next(call, next);
}

static void setup(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.contexts = STORM + 4;
    o.workers = STORM + 4; /* count_arrivals before result_cache: waiters hold workers */
    o.default_chain = false;
    o.max_frame = 64 * 1024;
    atomic_store(&H.executions, 0);
    atomic_store(&H.arrivals, 0);
    atomic_store(&H.entered, 0);
    atomic_store(&H.fail_first, 0);
    H.gate_open = false;
    H.slow_ms = 0;
    tu_server_create(&S, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    idem_method_opts token = {.flags = IDEM_METHOD_TOKEN_REQUIRED};
    cr_assert_eq(idem_server_use(S.srv, "count_arrivals", count_arrivals, NULL), IDEM_OK);
    cr_assert_eq(idem_server_use_builtin(S.srv, IDEM_BUILTIN_REQUEST_ID), IDEM_OK);
    cr_assert_eq(idem_server_use_builtin(S.srv, IDEM_BUILTIN_TOKEN), IDEM_OK);
    cr_assert_eq(idem_server_use_builtin(S.srv, IDEM_BUILTIN_RESULT_CACHE), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "test.Echo/Add", h_echo, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "test.Echo/Plain", h_echo, NULL, NULL), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "test.Flaky/Do", h_flaky, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "test.Meta/Many", h_meta, NULL, &cached), IDEM_OK);
    idem_method_opts notify = {.flags = IDEM_METHOD_CACHED, .extractor = out_trade_no};
    cr_assert_eq(idem_server_register(S.srv, "test.Callback/Notify", h_echo, NULL, &notify),
                 IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "test.Reject/Do", h_reject, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "test.Slow/Do", h_slow, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "test.Gated/Do", h_gated, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "test.Order/Submit", h_echo, NULL, &token), IDEM_OK);
    tu_server_listen(&S);
    C = tu_client(S.url, 2000);
}

static void teardown(void)
{
    idem_client_close(C);
    tu_server_destroy(&S, false);
}

TestSuite(integration, .init = setup, .fini = teardown, .timeout = 60);

static idem_code call(const char *method, const char *key, const char *payload, idem_result *r)
{
    idem_request q = {.method = method,
                      .idempotency_key = key,
                      .payload = payload,
                      .payload_len = payload ? strlen(payload) : 0};
    return idem_client_call(C, &q, r);
}

Test(integration, same_key_ten_times_runs_handler_once)
{
    idem_result first, r;
    cr_assert_eq(call("test.Echo/Add", "order-1", "7", &first), IDEM_OK, "%s", first.message);
    cr_expect_not(first.replayed);
    int replayed = 0;
    for (int i = 0; i < 9; i++) {
        cr_assert_eq(call("test.Echo/Add", "order-1", "7", &r), IDEM_OK);
        cr_expect_eq(r.payload_len, first.payload_len);
        cr_expect_eq(memcmp(r.payload, first.payload, r.payload_len), 0);
        cr_expect_str_eq(idem_result_metadata(&r, "exec-no"), "1 payload=7");
        cr_expect_not_null(idem_result_metadata(&r, "idem-first-at"));
        replayed += r.replayed;
        idem_result_clear(&r);
    }
    cr_expect_eq(replayed, 9);
    cr_expect_eq(atomic_load(&H.executions), 1);
    idem_result_clear(&first);
}

struct storm_arg {
    idem_result r;
    idem_code code;
};

static void *storm_thread(void *p)
{
    struct storm_arg *a = p;
    a->code = call("test.Gated/Do", "storm", "x", &a->r);
    return NULL;
}

Test(integration, concurrent_duplicates_get_the_one_first_result)
{
    pthread_t t[STORM];
    struct storm_arg a[STORM];
    for (int i = 0; i < STORM; i++) {
        pthread_create(&t[i], NULL, storm_thread, &a[i]);
    }
    pthread_mutex_lock(&H.mu); /* all 16 inside the server, one holding the claim */
    while (atomic_load(&H.arrivals) < STORM) {
        pthread_cond_wait(&H.cv, &H.mu);
    }
    H.gate_open = true;
    pthread_cond_broadcast(&H.cv);
    pthread_mutex_unlock(&H.mu);
    int replayed = 0;
    for (int i = 0; i < STORM; i++) {
        pthread_join(t[i], NULL);
        cr_expect_eq(a[i].code, IDEM_OK, "%s", a[i].r.message);
        cr_expect_eq(a[i].r.attempts, 1);
        cr_expect_str_eq(a[i].r.payload, "exec=1 payload=x");
        replayed += a[i].r.replayed;
        idem_result_clear(&a[i].r);
    }
    cr_expect_eq(atomic_load(&H.executions), 1);
    cr_expect_eq(replayed, STORM - 1);
}

Test(integration, key_reused_with_other_payload_is_rejected)
{
    idem_result r;
    cr_assert_eq(call("test.Echo/Add", "k", "1", &r), IDEM_OK);
    idem_result_clear(&r);
    cr_expect_eq(call("test.Echo/Add", "k", "2", &r), IDEM_INVALID_ARGUMENT);
    cr_expect_str_eq(r.message, "idempotency key reused with a different request");
    cr_expect_eq(atomic_load(&H.executions), 1);
    idem_result_clear(&r);
}

Test(integration, transient_failure_releases_claim_and_retry_runs_again)
{
    idem_client_opts o;
    idem_client *once;
    idem_client_opts_init(&o);
    o.retry.max_attempts = 1;
    cr_assert_eq(idem_client_open(&once, (const char *[]){S.url}, 1, &o), IDEM_OK);
    atomic_store(&H.fail_first, 1);
    idem_request q = {.method = "test.Flaky/Do", .idempotency_key = "pay-1"};
    idem_result r;
    cr_expect_eq(idem_client_call(once, &q, &r), IDEM_UNAVAILABLE);
    idem_result_clear(&r);
    cr_expect_eq(idem_client_call(once, &q, &r), IDEM_OK);
    cr_expect_not(r.replayed, "a released claim runs again, it is not a replay");
    cr_expect_eq(atomic_load(&H.executions), 2);
    idem_result_clear(&r);
    idem_client_close(once);
}

Test(integration, retryer_recovers_from_transient_failure_with_the_same_key)
{
    atomic_store(&H.fail_first, 2);
    idem_result r;
    cr_expect_eq(call("test.Flaky/Do", "flaky-1", "", &r), IDEM_OK, "%s", r.message);
    cr_expect_eq(r.attempts, 3);
    cr_expect_str_eq(r.key, "flaky-1");
    cr_expect_eq(atomic_load(&H.executions), 3);
    idem_result_clear(&r);
    cr_expect_eq(call("test.Flaky/Do", "flaky-1", "", &r), IDEM_OK);
    cr_expect(r.replayed, "the success was stored under the key every attempt carried");
    idem_result_clear(&r);
}

Test(integration, generated_keys_are_fixed_for_every_attempt)
{
    atomic_store(&H.fail_first, 2);
    idem_result r;
    cr_expect_eq(call("test.Echo/Plain", NULL, "", &r), IDEM_OK, "%s", r.message);
    cr_expect_eq(strlen(r.key), 32, "a generated key is 32 hex digits");
    idem_result_clear(&r);
}

static uint64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A generated key leads with the unix ms it was made at (UUIDv7's layout), so a key made
 * later sorts later and a store's new records land next to each other instead of on a
 * random page of a large store (docs/performance.md, scenario z "ordered"). */
Test(integration, generated_keys_sort_in_the_order_they_were_made)
{
    idem_result a, b;
    uint64_t before = wall_ms();
    cr_assert_eq(call("test.Echo/Plain", NULL, "", &a), IDEM_OK, "%s", a.message);
    uint64_t between = wall_ms();
    while (wall_ms() == between) { /* the next key in a later millisecond */
    }
    cr_assert_eq(call("test.Echo/Plain", NULL, "", &b), IDEM_OK, "%s", b.message);
    uint64_t after = wall_ms();
    char ms_hex[13] = {0};
    memcpy(ms_hex, a.key, 12);
    uint64_t ms = strtoull(ms_hex, NULL, 16);
    cr_expect(ms >= before && ms <= between, "key %s: made at %llu, not in [%llu, %llu]", a.key,
              (unsigned long long)ms, (unsigned long long)before, (unsigned long long)between);
    cr_expect_lt(strcmp(a.key, b.key), 0, "%s then %s", a.key, b.key);
    memcpy(ms_hex, b.key, 12);
    cr_expect_leq(strtoull(ms_hex, NULL, 16), after);
    idem_result_clear(&a);
    idem_result_clear(&b);
}

Test(integration, final_business_error_is_stored_and_replayed)
{
    idem_result r;
    for (int i = 0; i < 3; i++) {
        cr_expect_eq(call("test.Reject/Do", "debit-9", "", &r), IDEM_FAILED_PRECONDITION);
        cr_expect_str_eq(r.message, "insufficient balance");
        cr_expect_eq(r.replayed, i > 0);
        idem_result_clear(&r);
    }
    cr_expect_eq(atomic_load(&H.executions), 1);
}

Test(integration, slow_first_attempt_then_retry_gets_the_first_result)
{
    idem_client *impatient = tu_client(S.url, 100);
    H.slow_ms = 400; /* > the client's 100 ms attempt timeout */
    idem_request q = {
        .method = "test.Slow/Do", .idempotency_key = "slow-1", .payload = "s", .payload_len = 1};
    idem_result r;
    cr_expect_eq(idem_client_call(impatient, &q, &r), IDEM_OK, "%s", r.message);
    cr_expect_gt(r.attempts, 1, "the first attempt timed out");
    cr_expect(r.replayed);
    cr_expect_str_eq(r.payload, "exec=1 payload=s");
    cr_expect_eq(atomic_load(&H.executions), 1);
    idem_result_clear(&r);
    idem_client_close(impatient);
}

Test(integration, keys_are_scoped_by_caller)
{
    idem_request q = {.method = "test.Echo/Add",
                      .idempotency_key = "same",
                      .payload = "1",
                      .payload_len = 1,
                      .caller = "tenant-a"};
    idem_result a, b;
    cr_assert_eq(idem_client_call(C, &q, &a), IDEM_OK);
    q.caller = "tenant-b";
    cr_assert_eq(idem_client_call(C, &q, &b), IDEM_OK);
    cr_expect_not(b.replayed, "caller B never receives caller A's stored response");
    cr_expect_str_neq(a.payload, b.payload);
    cr_expect_eq(atomic_load(&H.executions), 2);
    idem_result_clear(&a);
    idem_result_clear(&b);
}

Test(integration, token_is_single_use_and_retry_replays)
{
    char tok[64];
    uint64_t exp;
    cr_assert_eq(idem_client_issue_token(C, "shop", tok, sizeof(tok), &exp), IDEM_OK, "%s",
                 idem_errmsg());
    cr_expect_geq(strlen(tok), 22, "128 bits in base64url");
    idem_request q = {.method = "test.Order/Submit", .token = tok, .caller = "intruder"};
    idem_result r;
    cr_expect_eq(idem_client_call(C, &q, &r), IDEM_PERMISSION_DENIED);
    idem_result_clear(&r);
    q.caller = "shop";
    cr_expect_eq(idem_client_call(C, &q, &r), IDEM_OK, "%s", r.message);
    cr_expect_not(r.replayed);
    idem_result_clear(&r);
    cr_expect_eq(idem_client_call(C, &q, &r), IDEM_OK);
    cr_expect(r.replayed, "a retry with the used token replays the first result");
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&H.executions), 1);

    q.token = "bogus-token";
    cr_expect_eq(idem_client_call(C, &q, &r), IDEM_FAILED_PRECONDITION);
    idem_result_clear(&r);
    q.token = NULL;
    cr_expect_eq(idem_client_call(C, &q, &r), IDEM_FAILED_PRECONDITION);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&H.executions), 1);
}

Test(integration, unknown_method_is_unimplemented_and_carries_request_id)
{
    idem_result r;
    cr_expect_eq(call("no.Such/Method", NULL, "", &r), IDEM_UNIMPLEMENTED);
    cr_expect_eq(strlen(r.request_id), 32);
    cr_expect_str_eq(idem_result_metadata(&r, "request-id"), r.request_id);
    idem_result_clear(&r);
}

Test(integration, caller_request_id_is_kept)
{
    idem_request q = {.method = "test.Echo/Plain", .request_id = "trace-42"};
    idem_result r;
    cr_expect_eq(idem_client_call(C, &q, &r), IDEM_OK);
    cr_expect_str_eq(r.request_id, "trace-42");
    idem_result_clear(&r);
}

Test(integration, missing_key_on_key_required_method_is_rejected)
{
    size_t len;
    void *frame = tu_pack_request("test.Echo/Add", NULL, NULL, "1", &len);
    Idem__V1__Response *r = tu_raw_call(S.url, frame, len, 5000);
    cr_assert_not_null(r);
    cr_expect_eq(r->code, IDEM__V1__CODE__INVALID_ARGUMENT);
    cr_expect_neq(strstr(r->message, "requires an idempotency key"), NULL, "%s", r->message);
    cr_expect_eq(atomic_load(&H.executions), 0);
    tu_response_free(r);
    free(frame);
}

Test(integration, garbage_frame_is_invalid_argument_and_server_keeps_serving)
{
    static const unsigned char garbage[] = {0xff, 0xff, 0xff, 0xff, 0x0f, 0x42};
    Idem__V1__Response *r = tu_raw_call(S.url, garbage, sizeof(garbage), 5000);
    cr_assert_not_null(r, "garbage gets an answer, not silence");
    cr_expect_eq(r->code, IDEM__V1__CODE__INVALID_ARGUMENT);
    cr_expect_gt(strlen(r->request_id), 0);
    tu_response_free(r);

    r = tu_raw_call(S.url, "", 0, 5000);
    cr_assert_not_null(r);
    cr_expect_eq(r->code, IDEM__V1__CODE__INVALID_ARGUMENT);
    tu_response_free(r);

    idem_result ok;
    cr_expect_eq(call("test.Echo/Add", "after-garbage", "1", &ok), IDEM_OK);
    idem_result_clear(&ok);
}

Test(integration, oversize_frame_is_rejected_with_resource_exhausted)
{
    size_t big = 64 * 1024 + 100, len; /* server max_frame is 64 KiB */
    char *payload = malloc(big + 1);
    memset(payload, 'a', big);
    payload[big] = '\0';
    void *frame = tu_pack_request("test.Echo/Add", "big", NULL, payload, &len);
    Idem__V1__Response *r = tu_raw_call(S.url, frame, len, 5000);
    cr_assert_not_null(r);
    cr_expect_eq(r->code, IDEM__V1__CODE__RESOURCE_EXHAUSTED);
    cr_expect_eq(atomic_load(&H.executions), 0);
    tu_response_free(r);
    free(frame);
    free(payload);
}

Test(integration, duplicate_that_outwaits_its_deadline_gets_aborted_in_progress)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.retry.max_attempts = 1;
    o.deadline_ms = 300;
    cr_assert_eq(idem_client_open(&c, (const char *[]){S.url}, 1, &o), IDEM_OK);
    pthread_t t;
    struct storm_arg first;
    pthread_create(&t, NULL, storm_thread, &first); /* holds the claim on "storm" */
    pthread_mutex_lock(&H.mu);
    while (atomic_load(&H.entered) < 1) {
        pthread_cond_wait(&H.cv, &H.mu);
    }
    pthread_mutex_unlock(&H.mu);
    idem_request q = {
        .method = "test.Gated/Do", .idempotency_key = "storm", .payload = "x", .payload_len = 1};
    idem_result r;
    cr_expect_eq(idem_client_call(c, &q, &r), IDEM_ABORTED, "%s", r.message);
    cr_expect_str_eq(idem_result_metadata(&r, "retry-after-ms"), "100");
    idem_result_clear(&r);
    pthread_mutex_lock(&H.mu);
    H.gate_open = true;
    pthread_cond_broadcast(&H.cv);
    pthread_mutex_unlock(&H.mu);
    pthread_join(t, NULL);
    cr_expect_eq(first.code, IDEM_OK);
    idem_result_clear(&first.r);
    idem_client_close(c);
}

struct token_arg {
    const char *token;
    idem_result r;
    idem_code code;
};

static void *submit_with_token(void *p)
{
    struct token_arg *a = p;
    idem_request q = {.method = "test.Order/Submit", .token = a->token, .caller = "shop"};
    a->code = idem_client_call(C, &q, &a->r);
    return NULL;
}

Test(integration, one_token_submitted_64_times_at_once_runs_once)
{
    enum { N = 64 };
    char tok[64];
    pthread_t t[N];
    struct token_arg a[N];
    cr_assert_eq(idem_client_issue_token(C, "shop", tok, sizeof(tok), NULL), IDEM_OK);
    for (int i = 0; i < N; i++) {
        a[i].token = tok;
        pthread_create(&t[i], NULL, submit_with_token, &a[i]);
    }
    int replayed = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(t[i], NULL);
        cr_expect_eq(a[i].code, IDEM_OK, "%s", a[i].r.message);
        replayed += a[i].r.replayed;
        idem_result_clear(&a[i].r);
    }
    cr_expect_eq(atomic_load(&H.executions), 1, "exactly one submit consumed the token");
    cr_expect_eq(replayed, N - 1, "the other 63 replay its result");
}

Test(integration, full_handler_metadata_still_leaves_room_for_the_library)
{
    idem_result r;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(call("test.Meta/Many", "meta", "", &r), IDEM_OK, "%s", r.message);
        cr_expect_eq(r.replayed, i == 1);
        cr_expect_str_eq(idem_result_metadata(&r, "request-id"), r.request_id);
        cr_expect_str_eq(idem_result_metadata(&r, "m59"), "v");
        cr_expect_eq(idem_result_metadata(&r, "idem-first-at") != NULL, i == 1);
        idem_result_clear(&r);
    }
}

Test(integration, callback_resent_through_the_client_is_deduped_by_its_business_key)
{
    idem_result a, b;
    cr_assert_eq(call("test.Callback/Notify", NULL, "T-42", &a), IDEM_OK);
    cr_assert_eq(call("test.Callback/Notify", NULL, "T-42", &b), IDEM_OK);
    cr_expect_str_eq(a.key, "T-42", "the server's key (idem-key) replaces the generated one");
    cr_expect_str_eq(b.key, "T-42");
    cr_expect(b.replayed, "the out_trade_no, not the random key, decided");
    cr_expect_eq(atomic_load(&H.executions), 1);
    idem_result_clear(&a);
    idem_result_clear(&b);
}
