/* Hostile input and resource bounds: every bad frame gets a clear code, nothing runs,
 * and the server keeps serving. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idemrpc.pb-c.h"
#include "testutil.h"

static tu_server S;
static atomic_int executions;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static bool gate_open;
static int entered;

static idem_code h_echo(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    atomic_fetch_add(&executions, 1);
    return idem_call_reply(call, IDEM_OK, p, n);
}

static idem_code h_gated(idem_call *call, void *arg)
{
    pthread_mutex_lock(&mu);
    entered++;
    pthread_cond_broadcast(&cv);
    while (!gate_open) {
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    return h_echo(call, arg);
}

/* Transactional, with a response big enough to fill a tiny map quickly. */
static idem_code h_big(idem_call *call, void *arg)
{
    (void)arg;
    static char blob[16 * 1024];
    size_t n;
    const void *key = idem_call_payload(call, &n);
    idem_code code = idem_txn_put(idem_call_txn(call), "blobs", key, n, blob, sizeof(blob));
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    atomic_fetch_add(&executions, 1);
    return idem_call_reply(call, IDEM_OK, blob, sizeof(blob));
}

/* Transactional: writes, then refuses. The refusal must leave no write behind. */
static idem_code h_write_then_refuse(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&executions, 1);
    if (idem_txn_put(idem_call_txn(call), "ledger", "acct", 4, "debited", 7) != IDEM_OK) {
        return idem_call_fail(call, IDEM_INTERNAL, "%s", idem_errmsg());
    }
    return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "insufficient balance");
}

/* Transactional: tries a second store write from inside its own write txn. */
static idem_code h_nested_write(idem_call *call, void *arg)
{
    (void)arg;
    idem_code code = idem_store_token_put(idem_server_store(S.srv), "nested", "", UINT64_MAX);
    const char *name = idem_code_name(code);
    return idem_call_reply(call, IDEM_OK, name, strlen(name));
}

static void start(size_t workers, size_t max_queue, size_t map_size)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.contexts = 16;
    o.workers = workers;
    o.max_queue = max_queue;
    o.map_size = map_size;
    atomic_store(&executions, 0);
    gate_open = false;
    entered = 0;
    tu_server_create(&S, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(S.srv, "t.Echo/Add", h_echo, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Gate/Wait", h_gated, NULL, NULL), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Big/Put", h_big, NULL, &tx), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Tx/Refuse", h_write_then_refuse, NULL, &tx),
                 IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Tx/Nested", h_nested_write, NULL, &tx), IDEM_OK);
    tu_server_listen(&S);
}

/* Replaces the suite's default server with one of other limits. */
static void restart(size_t workers, size_t max_queue, size_t map_size)
{
    tu_server_destroy(&S, false);
    start(workers, max_queue, map_size);
}

static void setup(void)
{
    start(4, 0, 0);
}

static void teardown(void)
{
    pthread_mutex_lock(&mu);
    gate_open = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    tu_server_destroy(&S, false);
}

TestSuite(hostile, .init = setup, .fini = teardown, .timeout = 60);

/* Sends a frame and expects code, no execution, and a server that still answers. */
static void expect_rejected(const void *frame, size_t len, int code, const char *what)
{
    Idem__V1__Response *r = tu_raw_call(S.url, frame, len, 5000);
    cr_assert_not_null(r, "%s: no answer", what);
    cr_expect_eq(r->code, code, "%s: got %d (%s)", what, r->code, r->message);
    cr_expect_gt(strlen(r->message), 0, "%s: the error says why", what);
    cr_expect_gt(strlen(r->request_id), 0, "%s: the error carries a request id", what);
    tu_response_free(r);
    cr_expect_eq(atomic_load(&executions), 0, "%s: nothing ran", what);

    size_t n;
    void *ok = tu_pack_request("t.Echo/Add", "still-serving", NULL, "1", &n);
    r = tu_raw_call(S.url, ok, n, 5000);
    cr_assert_not_null(r, "%s: server stopped serving", what);
    cr_expect_eq(r->code, IDEM__V1__CODE__OK, "%s: a good call afterwards", what);
    tu_response_free(r);
    free(ok);
    atomic_store(&executions, 0);
}

static void *pack(Idem__V1__Request *q, size_t *len)
{
    *len = idem__v1__request__get_packed_size(q);
    void *buf = malloc(*len ? *len : 1);
    idem__v1__request__pack(q, buf);
    return buf;
}

#define BAD IDEM__V1__CODE__INVALID_ARGUMENT

Test(hostile, truncated_protobuf)
{
    size_t len;
    void *frame = tu_pack_request("t.Echo/Add", "truncated", "caller", "payload", &len);
    expect_rejected(frame, len - 3, BAD, "truncated");
    free(frame);
}

Test(hostile, key_longer_than_255_bytes)
{
    char key[257];
    memset(key, 'k', 256);
    key[256] = '\0';
    size_t len;
    void *frame = tu_pack_request("t.Echo/Add", key, NULL, "1", &len);
    expect_rejected(frame, len, BAD, "256-byte key");
    free(frame);
}

Test(hostile, ten_thousand_metadata_entries)
{
    enum { N = 10000 };
    Idem__V1__Request q = IDEM__V1__REQUEST__INIT;
    Idem__V1__Request__MetadataEntry *e = calloc(N, sizeof(*e)), **p = calloc(N, sizeof(*p));
    char(*names)[16] = calloc(N, 16);
    for (int i = 0; i < N; i++) {
        idem__v1__request__metadata_entry__init(&e[i]);
        snprintf(names[i], 16, "m%d", i);
        e[i].key = names[i];
        e[i].value = "v";
        p[i] = &e[i];
    }
    q.method = "t.Echo/Add";
    q.idempotency_key = "meta";
    q.n_metadata = N;
    q.metadata = p;
    size_t len;
    void *frame = pack(&q, &len);
    expect_rejected(frame, len, BAD, "10k metadata entries");
    free(frame);
    free(names);
    free(p);
    free(e);
}

Test(hostile, invalid_utf8_in_each_string_field)
{
    static const char bad[] = "\xc3\x28 \xed\xa0\x80";
    Idem__V1__Request__MetadataEntry m = IDEM__V1__REQUEST__METADATA_ENTRY__INIT, *mp = &m;
    for (int field = 0; field < 5; field++) {
        Idem__V1__Request q = IDEM__V1__REQUEST__INIT;
        q.method = field == 0 ? (char *)bad : "t.Echo/Add";
        q.idempotency_key = field == 1 ? (char *)bad : "utf8";
        q.caller = field == 2 ? (char *)bad : "";
        q.request_id = field == 3 ? (char *)bad : "";
        m.key = "x-note";
        m.value = field == 4 ? (char *)bad : "fine";
        q.n_metadata = 1;
        q.metadata = &mp;
        size_t len;
        void *frame = pack(&q, &len);
        char what[32];
        snprintf(what, sizeof(what), "invalid UTF-8 in field #%d", field);
        expect_rejected(frame, len, BAD, what);
        free(frame);
    }
}

Test(hostile, method_name_garbage)
{
    static const char *const garbage[] = {
        "",      "NoSlash",        "/Method",          "pkg.Svc/",
        "a/b/c", "pkg Svc/Method", "pkg.Svc/Me\tthod", "pkg.Svc/\x7f"};
    for (size_t i = 0; i < sizeof(garbage) / sizeof(*garbage); i++) {
        size_t len;
        void *frame = tu_pack_request(garbage[i], "k", NULL, "1", &len);
        expect_rejected(frame, len, BAD, garbage[i]);
        free(frame);
    }
    char longname[200];
    memset(longname, 'm', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = '\0';
    longname[5] = '/';
    size_t len;
    void *frame = tu_pack_request(longname, "k", NULL, "1", &len);
    expect_rejected(frame, len, BAD, "199-byte method");
    free(frame);
}

struct raw_arg {
    const char *url;
    int code;
};

static void *raw_gate_call(void *p)
{
    struct raw_arg *a = p;
    size_t len;
    void *frame = tu_pack_request("t.Gate/Wait", NULL, NULL, "x", &len);
    Idem__V1__Response *r = tu_raw_call(a->url, frame, len, 10000);
    a->code = r != NULL ? (int)r->code : -1;
    tu_response_free(r);
    free(frame);
    return NULL;
}

Test(hostile, full_queue_answers_resource_exhausted_at_once)
{
    restart(1, 2, 0); /* one worker, two may wait: the rest is turned away */
    enum { CALLS = 8 };
    pthread_t t[CALLS];
    struct raw_arg a[CALLS];
    a[0].url = S.url;
    pthread_create(&t[0], NULL, raw_gate_call, &a[0]);
    pthread_mutex_lock(&mu); /* the only worker is busy */
    while (entered < 1) {
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    for (int i = 1; i < CALLS; i++) {
        a[i].url = S.url;
        pthread_create(&t[i], NULL, raw_gate_call, &a[i]);
    }
    /* The turned-away calls answer without the gate opening: join them first. */
    int busy = 0, ok = 0;
    bool done[CALLS] = {false};
    while (busy < CALLS - 3) {
        for (int i = 1; i < CALLS; i++) {
            if (!done[i] && pthread_tryjoin_np(t[i], NULL) == 0) {
                done[i] = true;
                cr_expect_eq(a[i].code, IDEM__V1__CODE__RESOURCE_EXHAUSTED);
                busy++;
            }
        }
        sched_yield();
    }
    pthread_mutex_lock(&mu);
    gate_open = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < CALLS; i++) {
        if (!done[i]) {
            pthread_join(t[i], NULL);
            ok += a[i].code == IDEM__V1__CODE__OK;
        }
    }
    cr_expect_eq(busy, CALLS - 3, "five calls turned away");
    cr_expect_eq(ok, 3, "the running call and the two queued ones complete");
}

Test(hostile, store_full_is_resource_exhausted_and_the_store_stays_intact)
{
    restart(2, 0, 1 << 20); /* 1 MiB map */
    idem_client *c = tu_client(S.url, 5000);
    int stored = 0;
    idem_code code = IDEM_OK;
    char key[32];
    idem_result r;
    for (int i = 0; i < 200 && code == IDEM_OK; i++) {
        snprintf(key, sizeof(key), "blob-%d", i);
        idem_request q = {.method = "t.Big/Put",
                          .idempotency_key = key,
                          .payload = key,
                          .payload_len = strlen(key)};
        code = idem_client_call(c, &q, &r);
        stored += code == IDEM_OK;
        idem_result_clear(&r);
    }
    cr_assert_eq(code, IDEM_RESOURCE_EXHAUSTED, "a 1 MiB map fills up");
    cr_assert_gt(stored, 0);
    cr_expect_eq(atomic_load(&executions), stored + 1, "the last handler ran, not committed");
    for (int i = 0; i < stored; i++) { /* every committed record still replays */
        snprintf(key, sizeof(key), "blob-%d", i);
        idem_request q = {.method = "t.Big/Put",
                          .idempotency_key = key,
                          .payload = key,
                          .payload_len = strlen(key)};
        cr_expect_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s: %s", key, r.message);
        cr_expect(r.replayed);
        cr_expect_eq(r.payload_len, 16 * 1024);
        idem_result_clear(&r);
    }
    idem_client_close(c);
}

Test(hostile, transactional_method_needs_result_cache_in_the_chain)
{
    tu_server_destroy(&S, false);
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.default_chain = false;
    tu_server_create(&S, &o);
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL};
    cr_assert_eq(idem_server_use_builtin(S.srv, IDEM_BUILTIN_REQUEST_ID), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Big/Put", h_big, NULL, &tx), IDEM_OK);
    cr_expect_eq(idem_server_listen(S.srv, "tcp://127.0.0.1:0"), IDEM_FAILED_PRECONDITION);
    cr_expect_neq(strstr(idem_errmsg(), "no result_cache"), NULL, "%s", idem_errmsg());
}

Test(hostile, replays_are_answered_while_every_worker_is_busy)
{
    restart(1, 0, 0);
    size_t len;
    void *frame = tu_pack_request("t.Echo/Add", "paid-1", NULL, "42", &len);
    Idem__V1__Response *r = tu_raw_call(S.url, frame, len, 5000);
    cr_assert_not_null(r);
    cr_assert_eq(r->code, IDEM__V1__CODE__OK);
    tu_response_free(r);

    pthread_t t;
    struct raw_arg a = {.url = S.url};
    pthread_create(&t, NULL, raw_gate_call, &a); /* occupies the only worker */
    pthread_mutex_lock(&mu);
    while (entered < 1) {
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    r = tu_raw_call(S.url, frame, len, 5000); /* answered from the nng callback */
    cr_assert_not_null(r, "a replay must not wait for a worker");
    cr_expect_eq(r->code, IDEM__V1__CODE__OK);
    cr_expect(r->replayed);
    tu_response_free(r);
    free(frame);
    pthread_mutex_lock(&mu);
    gate_open = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    pthread_join(t, NULL);
    cr_expect_eq(a.code, IDEM__V1__CODE__OK);
}

static char log_lines[64][1100];
static atomic_int n_log_lines;

static void capture_log(void *arg, idem_log_level level, const char *line)
{
    (void)arg, (void)level;
    int i = atomic_fetch_add(&n_log_lines, 1);
    if (i < 64) {
        snprintf(log_lines[i], sizeof(log_lines[i]), "%s", line);
    }
}

Test(hostile, logs_never_carry_tokens_or_payloads)
{
    tu_server_destroy(&S, false);
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.log_level = IDEM_LOG_INFO;
    o.log_fn = capture_log;
    tu_server_create(&S, &o);
    idem_method_opts tok = {.flags = IDEM_METHOD_TOKEN_REQUIRED};
    cr_assert_eq(idem_server_register(S.srv, "t.Order/Submit", h_echo, NULL, &tok), IDEM_OK);
    tu_server_listen(&S);
    idem_client *c = tu_client(S.url, 5000);
    char token[64];
    cr_assert_eq(idem_client_issue_token(c, "shop", token, sizeof(token), NULL), IDEM_OK);
    static const char secret[] = "card=4111111111111111";
    idem_request q = {.method = "t.Order/Submit",
                      .token = token,
                      .caller = "shop",
                      .payload = secret,
                      .payload_len = sizeof(secret) - 1};
    idem_result r;
    for (int i = 0; i < 2; i++) { /* executed, then replayed */
        cr_expect_eq(idem_client_call(c, &q, &r), IDEM_OK);
        idem_result_clear(&r);
    }
    idem_client_close(c);
    int n = atomic_load(&n_log_lines);
    cr_assert_geq(n, 3, "one line per call at info");
    for (int i = 0; i < n && i < 64; i++) {
        cr_expect_null(strstr(log_lines[i], token), "token in: %s", log_lines[i]);
        /* the whole secret: a random hex request id may well contain "4111" */
        cr_expect_null(strstr(log_lines[i], secret), "payload in: %s", log_lines[i]);
        cr_expect_null(strstr(log_lines[i], "card="), "payload in: %s", log_lines[i]);
    }
    cr_expect_neq(strstr(log_lines[n - 1], "outcome=replayed"), NULL, "%s", log_lines[n - 1]);
}

Test(hostile, transactional_final_error_is_replayed_without_its_writes)
{
    idem_client *c = tu_client(S.url, 5000);
    idem_request q = {.method = "t.Tx/Refuse", .idempotency_key = "debit-1"};
    idem_result r;
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(idem_client_call(c, &q, &r), IDEM_FAILED_PRECONDITION);
        cr_expect_eq(r.replayed, i == 1);
        idem_result_clear(&r);
    }
    idem_client_close(c);
    cr_expect_eq(atomic_load(&executions), 1);
    void *v;
    size_t n;
    cr_expect_eq(idem_store_app_get(idem_server_store(S.srv), "ledger", "acct", 4, &v, &n),
                 IDEM_NOT_FOUND, "the refused call's write was rolled back");
}

Test(hostile, a_store_write_inside_a_transactional_handler_fails_instead_of_deadlocking)
{
    idem_client *c = tu_client(S.url, 5000);
    idem_request q = {.method = "t.Tx/Nested", .idempotency_key = "nested-1"};
    idem_result r;
    cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "FAILED_PRECONDITION");
    idem_result_clear(&r);
    idem_client_close(c);
}
