/* The promises of issue 10, each through the real server and the real client (nng on
 * tcp://127.0.0.1:<free port>) and, where the promise is about HTTP, the HTTP front.
 *
 * Every test starts its own server (some need their own server options), so no state
 * leaks from one test into the next. Waits for "the handler has started" poll a counter
 * the handler sets, with a bound; sleeps appear only as simulated work in handlers and
 * where the scenario itself is "this much time has passed". */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "idemrpc.pb-c.h"
#include "testutil.h"

#define AWAIT_MS 5000 /* bound on every "wait until the server got there" */

/* What the handlers count, and how they behave. */
static struct {
    atomic_int executions;           /* handler runs that produced an answer */
    atomic_int entered;              /* handler runs that have started */
    atomic_int fail_first;           /* Flaky: answer UNAVAILABLE this many times */
    atomic_int slow_runs;            /* Slow handler runs (10: counted apart from the fast calls) */
    atomic_uint_fast64_t started_ms; /* monotonic ms when a slow handler began */
    int slow_ms;                     /* Slow: simulated work per execution */
    uint64_t fence[4];               /* idem_call_fence of executions 1..3 */
    idem_key_source key_source;      /* of the last execution */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool gate_open; /* Gated: the handler blocks until the test opens the gate */
} H = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* A call's code, with what came back when it is not the one wanted. */
#define EXPECT_CODE(expr, want, r)                                                                 \
    do {                                                                                           \
        idem_code got_ = (expr);                                                                   \
        cr_expect_eq(got_, want, "want %s, got %s: %s", idem_code_name(want),                      \
                     idem_code_name(got_), (r)->message ? (r)->message : "");                      \
    } while (0)
#define ASSERT_CODE(expr, want, r)                                                                 \
    do {                                                                                           \
        idem_code got_ = (expr);                                                                   \
        cr_assert_eq(got_, want, "want %s, got %s: %s", idem_code_name(want),                      \
                     idem_code_name(got_), (r)->message ? (r)->message : "");                      \
    } while (0)
/* A handler counter of H, with its value when it is not the one wanted. */
#define EXPECT_COUNT(counter, want, why)                                                           \
    cr_expect_eq(atomic_load(&H.counter), (want), "H." #counter " is %d, want %d %s",              \
                 atomic_load(&H.counter), (int)(want), why)

static tu_server S;
static int http_port;
static idem_client *C;

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* Polls *v until it reaches n; false when AWAIT_MS passed first (the test then fails
 * instead of hanging). */
static bool await_at_least(atomic_int *v, int n)
{
    for (uint64_t end = mono_ms() + AWAIT_MS; atomic_load(v) < n;) {
        if (mono_ms() >= end) {
            return false;
        }
        sleep_ms(1);
    }
    return true;
}

/* ---- handlers ---- */

/* Answers "exec=N payload=...": N tells a test which execution an answer came from. */
static idem_code reply_execution(idem_call *call)
{
    char out[96];
    size_t n;
    const char *p = idem_call_payload(call, &n);
    int no = atomic_fetch_add(&H.executions, 1) + 1;
    if (no < 4) {
        H.fence[no] = idem_call_fence(call);
    }
    H.key_source = idem_call_key_source(call);
    int len = snprintf(out, sizeof(out), "exec=%d payload=%.*s", no, (int)n, p);
    return idem_call_reply(call, IDEM_OK, out, (size_t)len);
}

static idem_code h_echo(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&H.entered, 1);
    return reply_execution(call);
}

static idem_code h_slow(idem_call *call, void *arg)
{
    (void)arg;
    atomic_store(&H.started_ms, mono_ms());
    atomic_fetch_add(&H.slow_runs, 1);
    atomic_fetch_add(&H.entered, 1);
    sleep_ms((unsigned)H.slow_ms); /* the work itself, not synchronisation */
    return reply_execution(call);
}

static idem_code h_gated(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&H.entered, 1);
    pthread_mutex_lock(&H.mu);
    while (!H.gate_open) {
        pthread_cond_wait(&H.cv, &H.mu);
    }
    pthread_mutex_unlock(&H.mu);
    return reply_execution(call);
}

static void open_gate(void)
{
    pthread_mutex_lock(&H.mu);
    H.gate_open = true;
    pthread_cond_broadcast(&H.cv);
    pthread_mutex_unlock(&H.mu);
}

/* A downstream that is unavailable the first fail_first times. */
static idem_code h_flaky(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&H.entered, 1);
    if (atomic_fetch_sub(&H.fail_first, 1) > 0) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "downstream unavailable");
    }
    return reply_execution(call);
}

/* Validates its input: "bad" is the caller's mistake, anything else runs. */
static idem_code h_validate(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const char *p = idem_call_payload(call, &n);
    atomic_fetch_add(&H.entered, 1);
    if (n == 3 && memcmp(p, "bad", 3) == 0) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "amount missing");
    }
    return reply_execution(call);
}

/* The business key of a payment callback: the whole payload is the out_trade_no. */
static bool key_is_payload(const idem_call *call, char *buf, size_t cap, void *arg)
{
    (void)arg;
    size_t n;
    const char *p = idem_call_payload(call, &n);
    return n > 0 && snprintf(buf, cap, "%.*s", (int)n, p) > 0;
}

/* A signed callback "out_trade_no|amount|sig=...": the key is the out_trade_no. */
static bool key_before_bar(const idem_call *call, char *buf, size_t cap, void *arg)
{
    (void)arg;
    size_t n;
    const char *p = idem_call_payload(call, &n);
    const char *bar = memchr(p, '|', n);
    return bar != NULL && bar > p && snprintf(buf, cap, "%.*s", (int)(bar - p), p) > 0;
}

/* What makes two callbacks the same: out_trade_no and amount, not the signature (a
 * channel re-signs each redelivery). */
static bool fingerprint_without_sig(const idem_call *call, void *buf, size_t cap, size_t *len,
                                    void *arg)
{
    (void)arg;
    size_t n;
    const char *p = idem_call_payload(call, &n);
    const char *bar = memchr(p, '|', n);
    const char *second = bar != NULL ? memchr(bar + 1, '|', n - (size_t)(bar + 1 - p)) : NULL;
    if (second == NULL || (size_t)(second - p) > cap) {
        return false;
    }
    *len = (size_t)(second - p);
    memcpy(buf, p, *len);
    return true;
}

/* ---- the server every test starts ---- */

enum { CACHED = IDEM_METHOD_CACHED };

static const struct {
    const char *name;
    idem_handler_fn fn;
    idem_method_opts opts;
} METHODS[] = {
    {"p.Echo/Do", h_echo, {.flags = CACHED}},
    {"p.Slow/Do", h_slow, {.flags = CACHED, .lease_ms = 300}}, /* 2: slower than its lease */
    {"p.Long/Do", h_slow, {.flags = CACHED}}, /* 10: slow, within the default lease */
    {"p.Gated/Do", h_gated, {.flags = CACHED}},
    {"p.Order/Submit", h_flaky, {.flags = IDEM_METHOD_TOKEN_REQUIRED}},
    {"p.KeyRequired/Do", h_echo, {.flags = CACHED | IDEM_METHOD_KEY_REQUIRED}},
    {"p.Notify/Do", h_echo, {.flags = CACHED, .extractor = key_is_payload}},
    {"p.Pay/Notify",
     h_echo,
     {.flags = CACHED, .extractor = key_before_bar, .fingerprint = fingerprint_without_sig}},
    {"p.PayNoFp/Notify", h_echo, {.flags = CACHED, .extractor = key_before_bar}},
    {"p.Validate/Do", h_validate, {.flags = CACHED}},
    {"p.ValidateStored/Do", h_validate, {.flags = CACHED, .store_invalid_argument = true}},
    {"p.Fast/Do", h_echo, {.flags = CACHED}},
    {"p.OrderByNo/Submit",
     h_echo,
     {.flags = IDEM_METHOD_TOKEN_REQUIRED, .extractor = key_is_payload}},
};

static void reset_handlers(void)
{
    atomic_store(&H.executions, 0);
    atomic_store(&H.entered, 0);
    atomic_store(&H.fail_first, 0);
    atomic_store(&H.slow_runs, 0);
    atomic_store(&H.started_ms, 0);
    memset(H.fence, 0, sizeof(H.fence));
    H.key_source = IDEM_KEY_NONE;
    H.slow_ms = 800;
    H.gate_open = false;
}

/* Starts S on nng and HTTP with every method of METHODS; o may be NULL. */
static void start_with(idem_server_opts *o)
{
    idem_server_opts local;
    if (o == NULL) {
        idem_server_opts_init(&local);
        o = &local;
    }
    o->store_flags |= IDEM_STORE_NOSYNC; /* tests never crash the machine */
    reset_handlers();
    tu_server_create(&S, o);
    for (size_t i = 0; i < sizeof(METHODS) / sizeof(METHODS[0]); i++) {
        cr_assert_eq(
            idem_server_register(S.srv, METHODS[i].name, METHODS[i].fn, NULL, &METHODS[i].opts),
            IDEM_OK, "%s", METHODS[i].name);
    }
    tu_server_listen(&S);
    cr_assert_eq(idem_server_listen_http(S.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    http_port = idem_server_http_port(S.srv);
    C = tu_client(S.url, 3000);
}

static void start(void)
{
    start_with(NULL);
}

static void stop(void)
{
    if (S.srv != NULL) {
        open_gate(); /* a failed test may leave handlers blocked */
        idem_client_close(C);
        C = NULL;
        tu_server_destroy(&S, false);
    }
}

TestSuite(promise, .fini = stop, .timeout = 30);

static idem_code call(const char *method, const char *key, const char *payload, idem_result *r)
{
    idem_request q = {.method = method,
                      .idempotency_key = key,
                      .payload = payload,
                      .payload_len = payload ? strlen(payload) : 0};
    return idem_client_call(C, &q, r);
}

static const char *meta_or_none(const idem_result *r, const char *name)
{
    const char *v = idem_result_metadata(r, name);
    return v != NULL ? v : "(none)";
}

static void post(tu_http *r, const char *method, const char *const *headers, size_t n,
                 const char *body)
{
    char path[160];
    snprintf(path, sizeof(path), "/%s", method);
    tu_http_post(r, http_port, path, headers, n, body, strlen(body));
}

static bool has_header(const tu_http *r, const char *name, const char *value)
{
    char buf[512];
    const char *v = tu_http_header(r, name, buf, sizeof(buf));
    return v != NULL && (value == NULL || strcmp(v, value) == 0);
}

/* "Name: " followed by n copies of c then tail; malloc'd. */
static char *long_header(const char *name, size_t n, char c, const char *tail)
{
    size_t nl = strlen(name), tl = strlen(tail);
    char *h = malloc(nl + 2 + n + tl + 1);
    cr_assert_not_null(h);
    memcpy(h, name, nl);
    memcpy(h + nl, ": ", 2);
    memset(h + nl + 2, c, n);
    memcpy(h + nl + 2 + n, tail, tl + 1);
    return h;
}

/* ---- 1. bounds are checked, never cut ---- */

Test(promise, http_keys_over_255_bytes_are_rejected_not_truncated)
{
    start();
    const char *tails[] = {"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
                           "BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"}; /* 255 + 45 = 300 */
    for (int i = 0; i < 2; i++) {
        char *key = long_header("Idempotency-Key", IDEM_MAX_KEY, 'k', tails[i]);
        tu_http r;
        post(&r, "p.Echo/Do", (const char *[]){key}, 1, "x");
        cr_expect_eq(r.status, 400, "key %d: status %d %s", i, r.status, r.body);
        cr_expect_neq(strstr(r.body ? r.body : "", "255"), NULL, "names the bound: %s", r.body);
        tu_http_free(&r);
        free(key);
    }
    EXPECT_COUNT(entered, 0, "two keys sharing 255 bytes must not meet");
}

Test(promise, http_keys_of_255_bytes_differing_in_the_last_byte_are_two_records)
{
    start();
    for (int i = 0; i < 2; i++) {
        char *key = long_header("Idempotency-Key", IDEM_MAX_KEY - 1, 'k', i ? "B" : "A");
        tu_http r;
        post(&r, "p.Echo/Do", (const char *[]){key}, 1, "x");
        cr_expect_eq(r.status, 200, "%s", r.body);
        cr_expect_not(has_header(&r, "Idempotent-Replayed", NULL));
        tu_http_free(&r);
        free(key);
    }
    EXPECT_COUNT(executions, 2, "");
}

Test(promise, nng_key_of_256_bytes_is_invalid_argument)
{
    start();
    char key[IDEM_MAX_KEY + 2];
    memset(key, 'k', IDEM_MAX_KEY + 1);
    key[IDEM_MAX_KEY + 1] = '\0';
    idem_result r;
    EXPECT_CODE(call("p.Echo/Do", key, "x", &r), IDEM_INVALID_ARGUMENT, &r);
    idem_result_clear(&r);
    /* The server's own bound, for clients other than idem_client. */
    size_t len;
    void *frame = tu_pack_request("p.Echo/Do", key, NULL, "x", &len);
    Idem__V1__Response *raw = tu_raw_call(S.url, frame, len, 5000);
    cr_assert_not_null(raw);
    cr_expect_eq(raw->code, IDEM__V1__CODE__INVALID_ARGUMENT, "%s", raw->message);
    tu_response_free(raw);
    free(frame);
    EXPECT_COUNT(entered, 0, "");
}

/* One header one byte over its bound, next to a valid key: 400, nothing runs. */
static void expect_header_rejected(const char *name, size_t n)
{
    char *h = long_header(name, n, 'c', "");
    tu_http r;
    post(&r, "p.Echo/Do", (const char *[]){"Idempotency-Key: bounds", h}, 2, "x");
    cr_expect_eq(r.status, 400, "%s of %zu bytes: %d %s", name, n, r.status, r.body);
    tu_http_free(&r);
    free(h);
}

Test(promise, http_caller_token_and_request_id_over_their_bounds_are_400)
{
    start();
    expect_header_rejected("X-Caller", IDEM_MAX_CALLER + 1);
    expect_header_rejected("Idem-Token", IDEM_MAX_TOKEN + 1);
    expect_header_rejected("X-Request-Id", 129); /* request ids: at most 128 bytes */
    EXPECT_COUNT(entered, 0, "");
}

Test(promise, http_two_idempotency_key_lines_or_a_list_are_400)
{
    start();
    tu_http r;
    post(&r, "p.Echo/Do", (const char *[]){"Idempotency-Key: a", "Idempotency-Key: b"}, 2, "x");
    cr_expect_eq(r.status, 400, "two lines: %d %s", r.status, r.body);
    tu_http_free(&r);
    post(&r, "p.Echo/Do", (const char *[]){"Idempotency-Key: \"a\", \"b\""}, 1, "x");
    cr_expect_eq(r.status, 400, "a list: %d %s", r.status, r.body);
    tu_http_free(&r);
    EXPECT_COUNT(entered, 0, "");
}

Test(promise, http_quoted_key_is_the_same_record_as_unquoted)
{
    start();
    tu_http a, b;
    post(&a, "p.Echo/Do", (const char *[]){"Idempotency-Key: \"abc\""}, 1, "x");
    post(&b, "p.Echo/Do", (const char *[]){"Idempotency-Key: abc"}, 1, "x");
    cr_expect_eq(a.status, 200, "%s", a.body);
    cr_expect_eq(b.status, 200, "%s", b.body);
    cr_expect(has_header(&b, "Idempotent-Replayed", "true"), "abc is \"abc\" unquoted");
    idem_result r;
    EXPECT_CODE(call("p.Echo/Do", "abc", "x", &r), IDEM_OK, &r);
    cr_expect(r.replayed, "the nng key abc names the same record");
    idem_result_clear(&r);
    EXPECT_COUNT(executions, 1, "");
    tu_http_free(&a);
    tu_http_free(&b);
}

/* ---- 2. a handler slower than its lease keeps its claim ---- */

struct nng_arg {
    idem_client *c;
    const char *method, *key, *payload;
    idem_result r;
    idem_code code;
    uint64_t done_ms; /* monotonic, when the answer arrived */
};

static void *nng_thread(void *p)
{
    struct nng_arg *a = p;
    idem_request q = {.method = a->method,
                      .idempotency_key = a->key,
                      .payload = a->payload,
                      .payload_len = strlen(a->payload)};
    a->code = idem_client_call(a->c, &q, &a->r);
    a->done_ms = mono_ms();
    return NULL;
}

/* Awaits the slow handler, then lets the scenario's 400 ms (> its 300 ms lease) pass. */
static void await_lease_overrun(void)
{
    cr_assert(await_at_least(&H.entered, 1), "the slow handler never started");
    uint64_t at = atomic_load(&H.started_ms) + 400;
    uint64_t now = mono_ms();
    if (now < at) {
        sleep_ms((unsigned)(at - now)); /* the scenario: the lease has run out by now */
    }
}

Test(promise, slow_handler_past_its_lease_runs_once_for_a_duplicate)
{
    start();
    pthread_t t;
    struct nng_arg a = {.c = C, .method = "p.Slow/Do", .key = "K", .payload = "s"};
    pthread_create(&t, NULL, nng_thread, &a);
    await_lease_overrun();
    idem_result b;
    EXPECT_CODE(call("p.Slow/Do", "K", "s", &b), IDEM_OK, &b);
    pthread_join(t, NULL);
    cr_expect_eq(a.code, IDEM_OK, "%s", a.r.message);
    EXPECT_COUNT(executions, 1, "the duplicate took over a live claim");
    cr_expect_str_eq(a.r.payload ? a.r.payload : "", "exec=1 payload=s");
    cr_expect_str_eq(b.payload ? b.payload : "", "exec=1 payload=s");
    idem_result_clear(&a.r);
    idem_result_clear(&b);
}

struct http_arg {
    const char *method, *body;
    const char *headers[2];
    size_t n_headers;
    tu_http r;
};

static void *http_thread(void *p)
{
    struct http_arg *a = p;
    post(&a->r, a->method, a->headers, a->n_headers, a->body);
    return NULL;
}

Test(promise, slow_handler_past_its_lease_runs_once_over_http)
{
    start();
    pthread_t t;
    struct http_arg a = {
        .method = "p.Slow/Do", .body = "h", .headers = {"Idempotency-Key: K"}, .n_headers = 1};
    pthread_create(&t, NULL, http_thread, &a);
    await_lease_overrun();
    tu_http b;
    post(&b, "p.Slow/Do", a.headers, 1, "h");
    pthread_join(t, NULL);
    cr_expect_eq(a.r.status, 200, "%s", a.r.body);
    cr_expect_eq(b.status, 200, "%s", b.body);
    EXPECT_COUNT(executions, 1, "the duplicate took over a live claim");
    cr_expect_str_eq(a.r.body ? a.r.body : "", "exec=1 payload=h");
    cr_expect_str_eq(b.body ? b.body : "", "exec=1 payload=h");
    tu_http_free(&a.r);
    tu_http_free(&b);
}

Test(promise, fence_is_nonzero_and_grows_with_each_claim)
{
    start();
    idem_result r;
    ASSERT_CODE(call("p.Echo/Do", "fence-1", "x", &r), IDEM_OK, &r);
    idem_result_clear(&r);
    ASSERT_CODE(call("p.Echo/Do", "fence-2", "x", &r), IDEM_OK, &r);
    idem_result_clear(&r);
    cr_expect_neq(H.fence[1], 0, "the handler runs under a claim");
    cr_expect_gt(H.fence[2], H.fence[1], "a later claim gets a larger fence");
}

/* ---- 4. a token comes back when the claim it was consumed with is released ---- */

static void issue_token(char *tok, size_t cap)
{
    cr_assert_eq(idem_client_issue_token(C, "shop", tok, cap, NULL), IDEM_OK, "%s", idem_errmsg());
}

Test(promise, token_survives_a_transient_failure_and_the_retry_runs)
{
    start();
    char tok[64];
    issue_token(tok, sizeof(tok));
    atomic_store(&H.fail_first, 1);
    idem_request q = {.method = "p.Order/Submit", .token = tok, .caller = "shop"};
    idem_result r;
    EXPECT_CODE(idem_client_call(C, &q, &r), IDEM_OK, &r);
    cr_expect_eq(r.attempts, 2, "one UNAVAILABLE, then the retry with the same token");
    cr_expect_not(r.replayed);
    cr_expect_null(idem_result_metadata(&r, "idem-key"), "a token key is not echoed");
    idem_result_clear(&r);
    EXPECT_CODE(idem_client_call(C, &q, &r), IDEM_OK, &r);
    cr_expect(r.replayed, "the token now names the stored success");
    idem_result_clear(&r);
    EXPECT_COUNT(entered, 2, "1 failure + 1 success");
    EXPECT_COUNT(executions, 1, "");
}

Test(promise, token_survives_a_transient_failure_over_http)
{
    start();
    char tok[64], header[96];
    issue_token(tok, sizeof(tok));
    snprintf(header, sizeof(header), "Idem-Token: %s", tok);
    const char *h[] = {header, "X-Caller: shop"};
    atomic_store(&H.fail_first, 1);
    tu_http r;
    post(&r, "p.Order/Submit", h, 2, "");
    cr_expect_eq(r.status, 503, "%d %s", r.status, r.body);
    tu_http_free(&r);
    post(&r, "p.Order/Submit", h, 2, "");
    cr_expect_eq(r.status, 200, "the released token is usable again: %d %s", r.status, r.body);
    cr_expect_not(has_header(&r, "Idem-Key", NULL), "a token key is not echoed");
    tu_http_free(&r);
    post(&r, "p.Order/Submit", h, 2, "");
    cr_expect_eq(r.status, 200, "%d %s", r.status, r.body);
    cr_expect(has_header(&r, "Idempotent-Replayed", "true"));
    tu_http_free(&r);
    EXPECT_COUNT(entered, 2, "");
}

/* ---- 5. KEY_REQUIRED means a key the caller chose ---- */

Test(promise, key_required_method_refuses_a_generated_key)
{
    start();
    idem_result r;
    EXPECT_CODE(call("p.KeyRequired/Do", NULL, "x", &r), IDEM_INVALID_ARGUMENT, &r);
    cr_expect_neq(strstr(r.message ? r.message : "", "chosen by the caller"), NULL, "%s",
                  r.message);
    idem_result_clear(&r);
    EXPECT_CODE(call("p.KeyRequired/Do", "mine", "x", &r), IDEM_OK, &r);
    idem_result_clear(&r);
    EXPECT_COUNT(entered, 1, "only the call with a chosen key ran");
}

Test(promise, key_required_method_without_any_key_says_key_required)
{
    start();
    idem_client_opts o;
    idem_client *bare;
    idem_client_opts_init(&o);
    o.never_generate_key = true;
    cr_assert_eq(idem_client_open(&bare, (const char *[]){S.url}, 1, &o), IDEM_OK);
    idem_request q = {.method = "p.KeyRequired/Do", .payload = "x", .payload_len = 1};
    idem_result r;
    EXPECT_CODE(idem_client_call(bare, &q, &r), IDEM_INVALID_ARGUMENT, &r);
    cr_expect_neq(strstr(r.message ? r.message : "", "requires an idempotency key"), NULL, "%s",
                  r.message);
    idem_result_clear(&r);
    idem_client_close(bare);
    EXPECT_COUNT(entered, 0, "");
}

Test(promise, generated_key_has_its_own_source_and_comes_back_as_idem_key)
{
    start();
    idem_result r;
    ASSERT_CODE(call("p.Echo/Do", NULL, "x", &r), IDEM_OK, &r);
    cr_expect_eq(H.key_source, IDEM_KEY_GENERATED);
    cr_expect_eq(strlen(r.key), 32);
    cr_expect_str_eq(meta_or_none(&r, "idem-key"), r.key);
    idem_result_clear(&r);
}

/* ---- 6. a method with an extractor: the extracted key is the key ---- */

Test(promise, extractor_method_refuses_a_different_explicit_key)
{
    start();
    idem_result r;
    EXPECT_CODE(call("p.Notify/Do", "K", "order-1", &r), IDEM_INVALID_ARGUMENT, &r);
    cr_expect_neq(strstr(r.message ? r.message : "", "derive"), NULL,
                  "says the key comes from the request: %s", r.message);
    idem_result_clear(&r);
    EXPECT_COUNT(entered, 0, "");
}

Test(promise, extractor_key_is_the_key_and_comes_back_as_idem_key)
{
    start();
    idem_result r;
    ASSERT_CODE(call("p.Notify/Do", NULL, "order-1", &r), IDEM_OK, &r);
    cr_expect_not(r.replayed);
    cr_expect_str_eq(r.key, "order-1");
    cr_expect_str_eq(meta_or_none(&r, "idem-key"), "order-1");
    idem_result_clear(&r);
    ASSERT_CODE(call("p.Notify/Do", NULL, "order-1", &r), IDEM_OK, &r);
    cr_expect(r.replayed, "a second generated key does not make a second order");
    idem_result_clear(&r);
    ASSERT_CODE(call("p.Notify/Do", "order-1", "order-1", &r), IDEM_OK, &r);
    cr_expect(r.replayed, "the explicit key equal to the business key is the same record");
    idem_result_clear(&r);
    EXPECT_COUNT(executions, 1, "");
}

Test(promise, extractor_key_over_http)
{
    start();
    tu_http r;
    post(&r, "p.Notify/Do", (const char *[]){"Idempotency-Key: other"}, 1, "order-1");
    cr_expect_eq(r.status, 400, "%d %s", r.status, r.body);
    tu_http_free(&r);
    post(&r, "p.Notify/Do", NULL, 0, "order-1");
    cr_expect_eq(r.status, 200, "%d %s", r.status, r.body);
    cr_expect(has_header(&r, "Idem-Key", "order-1"), "%s", r.head);
    tu_http_free(&r);
    EXPECT_COUNT(executions, 1, "");
}

/* ---- 7. the fingerprint a method chooses decides "same request" ---- */

Test(promise, fingerprint_extractor_makes_a_resigned_redelivery_a_replay)
{
    start();
    idem_result first, r;
    ASSERT_CODE(call("p.Pay/Notify", NULL, "order-9|100|sig=aaa", &first), IDEM_OK, &first);
    EXPECT_CODE(call("p.Pay/Notify", NULL, "order-9|100|sig=bbb", &r), IDEM_OK, &r);
    cr_expect(r.replayed, "only the signature differs");
    cr_expect_str_eq(r.payload ? r.payload : "", first.payload ? first.payload : "");
    idem_result_clear(&r);
    EXPECT_CODE(call("p.Pay/Notify", NULL, "order-9|200|sig=ccc", &r), IDEM_INVALID_ARGUMENT, &r);
    cr_expect_neq(strstr(r.message ? r.message : "", "reused"), NULL, "%s", r.message);
    idem_result_clear(&r);
    tu_http h;
    post(&h, "p.Pay/Notify", NULL, 0, "order-9|200|sig=ddd");
    cr_expect_eq(h.status, 422, "another amount over HTTP: %d %s", h.status, h.body);
    tu_http_free(&h);
    EXPECT_COUNT(executions, 1, "");
    idem_result_clear(&first);
}

Test(promise, without_fingerprint_extractor_a_resigned_redelivery_is_key_reused)
{
    start();
    idem_result r;
    ASSERT_CODE(call("p.PayNoFp/Notify", NULL, "order-9|100|sig=aaa", &r), IDEM_OK, &r);
    idem_result_clear(&r);
    /* The default fingerprint is the whole payload: a new signature is another request. */
    EXPECT_CODE(call("p.PayNoFp/Notify", NULL, "order-9|100|sig=bbb", &r), IDEM_INVALID_ARGUMENT,
                &r);
    idem_result_clear(&r);
    EXPECT_COUNT(executions, 1, "");
}

/* ---- 8. a request already past its deadline is not worth running ---- */

static void *frame_with_deadline(const char *method, const char *key, uint64_t deadline,
                                 size_t *len)
{
    Idem__V1__Request q = IDEM__V1__REQUEST__INIT;
    q.method = (char *)method;
    q.idempotency_key = (char *)key;
    q.payload.data = (uint8_t *)"x";
    q.payload.len = 1;
    q.attempt = 1;
    q.deadline_unix_ms = deadline;
    *len = idem__v1__request__get_packed_size(&q);
    void *buf = malloc(*len);
    cr_assert_not_null(buf);
    idem__v1__request__pack(&q, buf);
    return buf;
}

Test(promise, request_past_its_deadline_is_refused_and_writes_nothing)
{
    start();
    size_t len;
    void *frame = frame_with_deadline("p.Echo/Do", "late", unix_ms() - 1000, &len);
    Idem__V1__Response *r = tu_raw_call(S.url, frame, len, 5000);
    cr_assert_not_null(r);
    cr_expect_eq(r->code, IDEM__V1__CODE__DEADLINE_EXCEEDED, "got %s: %s", idem_code_name(r->code),
                 r->message);
    tu_response_free(r);
    free(frame);
    EXPECT_COUNT(entered, 0, "");
    idem_key_ref key = {"", "p.Echo/Do", "late"};
    idem_record rec;
    memset(&rec, 0, sizeof(rec));
    cr_expect_eq(idem_store_get(idem_server_store(S.srv), &key, &rec), IDEM_NOT_FOUND,
                 "no record (state %d) for a call that never ran", (int)rec.state);
    idem_record_clear(&rec);
}

/* ---- 9. INVALID_ARGUMENT from a handler is the caller's to correct ---- */

Test(promise, invalid_argument_is_not_stored_by_default)
{
    start();
    idem_result r;
    EXPECT_CODE(call("p.Validate/Do", "K", "bad", &r), IDEM_INVALID_ARGUMENT, &r);
    cr_expect_str_eq(r.message ? r.message : "", "amount missing");
    idem_result_clear(&r);
    EXPECT_CODE(call("p.Validate/Do", "K", "good", &r), IDEM_OK, &r);
    cr_expect_not(r.replayed);
    idem_result_clear(&r);
    EXPECT_COUNT(entered, 2, "the corrected request ran");
}

Test(promise, store_invalid_argument_keeps_the_refusal)
{
    start();
    idem_result r;
    EXPECT_CODE(call("p.ValidateStored/Do", "K", "bad", &r), IDEM_INVALID_ARGUMENT, &r);
    idem_result_clear(&r);
    EXPECT_CODE(call("p.ValidateStored/Do", "K", "good", &r), IDEM_INVALID_ARGUMENT, &r);
    cr_expect_neq(strstr(r.message ? r.message : "", "reused"), NULL, "%s", r.message);
    idem_result_clear(&r);
    EXPECT_COUNT(entered, 1, "");
}

/* ---- 10. duplicates waiting for a slow first call do not hold the workers ---- */

enum { DUPS = 64, FAST_THREADS = 8, FAST_EACH = 25 };

struct fast_arg {
    idem_client *c;
    int id;
    int ok;
    uint64_t done_ms;
};

static void *fast_thread(void *p)
{
    struct fast_arg *a = p;
    for (int i = 0; i < FAST_EACH; i++) {
        char key[32];
        snprintf(key, sizeof(key), "fast-%d-%d", a->id, i);
        idem_request q = {.method = "p.Fast/Do", .idempotency_key = key};
        idem_result r;
        a->ok += idem_client_call(a->c, &q, &r) == IDEM_OK;
        idem_result_clear(&r);
    }
    a->done_ms = mono_ms();
    return NULL;
}

static idem_client *patient_client(void)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = 5000;
    o.deadline_ms = 10000;
    cr_assert_eq(idem_client_open(&c, (const char *[]){S.url}, 1, &o), IDEM_OK);
    return c;
}

/* The server's gauge of calls received and not yet answered (GET /metrics): it counts
 * waiting duplicates however the server holds them, with no interceptor of ours in front
 * of result_cache (which would change how the server may hold them). */
static long long in_flight(void)
{
    tu_http r;
    tu_http_get(&r, http_port, "/metrics");
    const char *line = r.body != NULL ? strstr(r.body, "\nidem_in_flight ") : NULL;
    long long n = line != NULL ? strtoll(line + strlen("\nidem_in_flight "), NULL, 10) : -1;
    tu_http_free(&r);
    return n;
}

static bool await_in_flight(long long n)
{
    for (uint64_t end = mono_ms() + AWAIT_MS; in_flight() < n;) {
        if (mono_ms() >= end) {
            return false;
        }
        sleep_ms(1);
    }
    return true;
}

static bool same_payload(const idem_result *x, const idem_result *y)
{
    return x->payload_len == y->payload_len && x->payload_len > 0 &&
           memcmp(x->payload, y->payload, x->payload_len) == 0;
}

/* Runs the fast calls; returns when the last one finished (monotonic ms). */
static uint64_t run_fast_calls(idem_client *c)
{
    pthread_t t[FAST_THREADS];
    struct fast_arg a[FAST_THREADS];
    uint64_t last = 0;
    for (int i = 0; i < FAST_THREADS; i++) {
        a[i] = (struct fast_arg){.c = c, .id = i};
        pthread_create(&t[i], NULL, fast_thread, &a[i]);
    }
    for (int i = 0; i < FAST_THREADS; i++) {
        pthread_join(t[i], NULL);
        cr_expect_eq(a[i].ok, FAST_EACH, "fast thread %d", i);
        last = a[i].done_ms > last ? a[i].done_ms : last;
    }
    return last;
}

Test(promise, waiting_duplicates_do_not_stall_other_calls)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.workers = 4;
    o.contexts = 512;
    start_with(&o);
    H.slow_ms = 2000;
    idem_client *slow = patient_client(), *fast = tu_client(S.url, 5000);
    pthread_t t[DUPS];
    static struct nng_arg a[DUPS];
    for (int i = 0; i < DUPS; i++) {
        a[i] = (struct nng_arg){.c = slow, .method = "p.Long/Do", .key = "slow", .payload = "s"};
        pthread_create(&t[i], NULL, nng_thread, &a[i]);
    }
    cr_assert(await_at_least(&H.slow_runs, 1), "the slow handler never started");
    cr_assert(await_in_flight(DUPS), "only %lld of %d duplicates reached the server", in_flight(),
              DUPS);
    uint64_t last_fast = run_fast_calls(fast), first_slow = UINT64_MAX;
    for (int i = 0; i < DUPS; i++) {
        pthread_join(t[i], NULL);
        cr_expect_eq(a[i].code, IDEM_OK, "%s", a[i].r.message);
        cr_expect(same_payload(&a[i].r, &a[0].r), "answer %d differs", i);
        first_slow = a[i].done_ms < first_slow ? a[i].done_ms : first_slow;
    }
    for (int i = 0; i < DUPS; i++) {
        idem_result_clear(&a[i].r);
    }
    cr_expect_lt(last_fast, first_slow, "fast calls ended %lld ms after the first slow answer",
                 (long long)(last_fast - first_slow));
    EXPECT_COUNT(slow_runs, 1, "");
    idem_client_close(slow);
    idem_client_close(fast);
}

Test(promise, http_beyond_max_pending_gets_429)
{
    enum { PENDING = 4 };
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.workers = 8;
    o.http_max_pending = PENDING;
    start_with(&o);
    pthread_t t[PENDING];
    struct http_arg a[PENDING];
    char keys[PENDING][32];
    for (int i = 0; i < PENDING; i++) {
        snprintf(keys[i], sizeof(keys[i]), "Idempotency-Key: gate-%d", i);
        a[i] = (struct http_arg){
            .method = "p.Gated/Do", .body = "g", .headers = {keys[i]}, .n_headers = 1};
        pthread_create(&t[i], NULL, http_thread, &a[i]);
    }
    cr_assert(await_at_least(&H.entered, PENDING), "only %d handlers entered",
              atomic_load(&H.entered));
    tu_http r;
    post(&r, "p.Echo/Do", (const char *[]){"Idempotency-Key: fifth"}, 1, "x");
    cr_expect_eq(r.status, 429, "%d %s", r.status, r.body);
    cr_expect(has_header(&r, "Retry-After", NULL), "%s", r.head);
    tu_http_free(&r);
    open_gate();
    for (int i = 0; i < PENDING; i++) {
        pthread_join(t[i], NULL);
        cr_expect_eq(a[i].r.status, 200, "%s", a[i].r.body);
        tu_http_free(&a[i].r);
    }
    EXPECT_COUNT(entered, PENDING, "the fifth did not run");
}

/* ---- found in review: shutdown, contexts, tokens with business keys, echoes ---- */

struct destroy_arg {
    tu_server *ts;
};

static void *destroy_thread(void *p)
{
    tu_server_destroy(((struct destroy_arg *)p)->ts, false);
    return NULL;
}

Test(promise, a_server_shutting_down_keeps_renewing_the_lease_of_a_running_handler)
{
    char *dir;
    idem_store *st = tu_store_open("shared", &dir);
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = st;
    start_with(&o);
    H.slow_ms = 1500;
    tu_server other;
    idem_server_opts o2;
    idem_server_opts_init(&o2);
    o2.store = st;
    tu_server_create(&other, &o2);
    cr_assert_eq(idem_server_register(other.srv, "p.Slow/Do", h_slow, NULL, &METHODS[1].opts),
                 IDEM_OK);
    tu_server_listen(&other);
    pthread_t t, d;
    struct nng_arg a = {.c = C, .method = "p.Slow/Do", .key = "K", .payload = "s"};
    pthread_create(&t, NULL, nng_thread, &a);
    cr_assert(await_at_least(&H.slow_runs, 1), "the slow handler never started");
    struct destroy_arg da = {&S}; /* a rolling restart: S drains while its handler runs */
    pthread_create(&d, NULL, destroy_thread, &da);
    sleep_ms(600); /* the scenario: twice the 300 ms lease passes */
    idem_client *c2 = tu_client(other.url, 3000);
    idem_result b;
    idem_request q = {
        .method = "p.Slow/Do", .idempotency_key = "K", .payload = "s", .payload_len = 1};
    EXPECT_CODE(idem_client_call(c2, &q, &b), IDEM_OK, &b);
    pthread_join(t, NULL);
    pthread_join(d, NULL);
    S.srv = NULL;
    EXPECT_COUNT(executions, 1, "the other instance took over a claim whose handler ran");
    cr_expect_str_eq(b.payload ? b.payload : "", "exec=1 payload=s");
    idem_result_clear(&a.r);
    idem_result_clear(&b);
    idem_client_close(c2);
    idem_client_close(C);
    C = NULL;
    tu_server_destroy(&other, false);
    idem_store_close(st);
    tu_rmtree(dir);
}

Test(promise, duplicates_leave_half_the_nng_contexts_to_other_callers)
{
    enum { CONTEXTS = 16, WAITING = 24 };
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.workers = 4;
    o.contexts = CONTEXTS;
    start_with(&o);
    H.slow_ms = 2000;
    idem_client *slow = patient_client();
    pthread_t t[WAITING];
    static struct nng_arg a[WAITING];
    for (int i = 0; i < WAITING; i++) {
        a[i] = (struct nng_arg){.c = slow, .method = "p.Long/Do", .key = "slow", .payload = "s"};
        pthread_create(&t[i], NULL, nng_thread, &a[i]);
    }
    cr_assert(await_at_least(&H.slow_runs, 1), "the slow handler never started");
    idem_result r;
    EXPECT_CODE(call("p.Fast/Do", "other-caller", "f", &r), IDEM_OK, &r);
    uint64_t fast_done = mono_ms(), first_slow = UINT64_MAX;
    idem_result_clear(&r);
    int ok = 0;
    for (int i = 0; i < WAITING; i++) {
        pthread_join(t[i], NULL);
        /* Beyond the parked half, a duplicate hears "in progress" at once and retries;
         * its retries may run out before the 2 s call ends. */
        cr_expect(a[i].code == IDEM_OK || a[i].code == IDEM_ABORTED, "%s", a[i].r.message);
        if (a[i].code == IDEM_OK) {
            ok++;
            first_slow = a[i].done_ms < first_slow ? a[i].done_ms : first_slow;
        }
        idem_result_clear(&a[i].r);
    }
    cr_expect_geq(ok, CONTEXTS / 2, "the parked duplicates got the first result");
    cr_expect_lt(fast_done, first_slow, "the fast call waited for the slow one");
    EXPECT_COUNT(slow_runs, 1, "");
    idem_client_close(slow);
}

Test(promise, a_business_key_outranks_the_token_two_tokens_one_order)
{
    start();
    char t1[64], t2[64];
    cr_assert_eq(idem_client_issue_token(C, NULL, t1, sizeof(t1), NULL), IDEM_OK);
    cr_assert_eq(idem_client_issue_token(C, NULL, t2, sizeof(t2), NULL), IDEM_OK);
    idem_result r;
    idem_request q = {
        .method = "p.OrderByNo/Submit", .token = t1, .payload = "order-7", .payload_len = 7};
    EXPECT_CODE(idem_client_call(C, &q, &r), IDEM_OK, &r);
    cr_expect_str_eq(meta_or_none(&r, "idem-key"), "order-7");
    idem_result_clear(&r);
    q.token = t2; /* a second submit form for the same order */
    EXPECT_CODE(idem_client_call(C, &q, &r), IDEM_OK, &r);
    cr_expect(r.replayed, "the order number, not the token, decided");
    idem_result_clear(&r);
    EXPECT_COUNT(executions, 1, "");
}

/* How many times needle occurs in hay. */
static int occurrences(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay != NULL ? strstr(hay, needle) : NULL; p != NULL;
         p = strstr(p + 1, needle)) {
        n++;
    }
    return n;
}

Test(promise, echoed_request_ids_are_escaped_and_control_characters_refused)
{
    start();
    tu_http r;
    post(&r, "p.Missing/Do", (const char *[]){"X-Request-Id: x\",\"code\":\"OK"}, 1, "x");
    cr_expect_eq(r.status, 404, "%d %s", r.status, r.body);
    cr_expect_eq(occurrences(r.body, "\"code\":"), 1, "%s", r.body);
    tu_http_free(&r);
    size_t len;
    void *frame = tu_pack_request("p.Echo/Do", "K", "forged\nlevel=error", "x", &len);
    Idem__V1__Response *resp = tu_raw_call(S.url, frame, len, 3000);
    free(frame);
    cr_assert_not_null(resp);
    cr_expect_eq(resp->code, IDEM_INVALID_ARGUMENT);
    cr_expect_neq(strstr(resp->message, "control character"), NULL, "%s", resp->message);
    tu_response_free(resp);
    EXPECT_COUNT(executions, 0, "");
}

Test(promise, http_key_parameters_bad_escapes_and_trailing_text_are_400)
{
    start();
    const char *bad[] = {"Idempotency-Key: \"k\";a=1", "Idempotency-Key: \"k\\x\"",
                         "Idempotency-Key: \"k\" junk", "Idempotency-Key: \"k",
                         "Idempotency-Key: \"k\\"}; /* the last: found by the fuzzer */
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tu_http r;
        post(&r, "p.Echo/Do", &bad[i], 1, "x");
        cr_expect_eq(r.status, 400, "%s: %d %s", bad[i], r.status, r.body);
        cr_expect_neq(strstr(r.body, "Idempotency-Key"), NULL, "%s", r.body);
        tu_http_free(&r);
    }
    EXPECT_COUNT(executions, 0, "");
}
