/* Integration: who is calling (README "Security"). A real server on ipc://, tcp:// and
 * http:// at once, the real client, and raw frames for what the client never sends
 * (stale, future and tampered signatures). */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "idemrpc.pb-c.h"
#include "internal.h"
#include "testutil.h"

#define SECRET_A "secret-of-caller-A-0123"
#define SECRET_B "secret-of-caller-B-4567"
#define SECRET_GW "secret-of-the-gateway-89"
#define DEBIT "test.Pay/Debit"

static tu_server S;
static char ipc_url[256], *ipc_dir;
static int http_port;
static atomic_int executions;

/* "exec=N caller=X verified=0|1": which call ran, and as whom. */
static idem_code h_debit(idem_call *call, void *arg)
{
    (void)arg;
    char out[256];
    int n = snprintf(out, sizeof(out), "exec=%d caller=%s verified=%d",
                     atomic_fetch_add(&executions, 1) + 1, idem_call_caller(call),
                     idem_call_caller_verified(call));
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static const idem_caller_secret secrets[] = {
    {.caller = "A", .secret = SECRET_A},
    {.caller = "B", .secret = SECRET_B},
    {.caller = "gw", .secret = SECRET_GW, .proxy = true},
};

typedef enum { NOTHING, SIGNED, SIGNED_REQUIRED, IPC_AND_SIGNED_REQUIRED } setup_kind;

/* A server on ipc + tcp + http with the identity configuration of kind. */
static void serve(setup_kind kind)
{
    idem_server_opts o;
    idem_ipc_caller me = {.uid = getuid(), .caller = "A"};
    idem_server_opts_init(&o);
    if (kind != NOTHING) {
        o.caller_secrets = secrets;
        o.n_caller_secrets = IDEM_ARRAY_LEN(secrets);
    }
    o.require_verified_caller = kind == SIGNED_REQUIRED || kind == IPC_AND_SIGNED_REQUIRED;
    if (kind == IPC_AND_SIGNED_REQUIRED) {
        o.ipc_callers = &me;
        o.n_ipc_callers = 1;
    }
    atomic_store(&executions, 0);
    tu_server_create(&S, &o);
    memset(&me, 0xff, sizeof(me)); /* the server kept a copy, not this memory */
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    idem_method_opts token = {.flags = IDEM_METHOD_TOKEN_REQUIRED};
    cr_assert_eq(idem_server_register(S.srv, DEBIT, h_debit, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "test.Order/Submit", h_debit, NULL, &token), IDEM_OK);
    ipc_dir = tu_tempdir("ipc");
    snprintf(ipc_url, sizeof(ipc_url), "ipc://%s/s.ipc", ipc_dir);
    cr_assert_eq(idem_server_listen(S.srv, ipc_url), IDEM_OK, "%s", idem_errmsg());
    tu_server_listen(&S);
    cr_assert_eq(idem_server_listen_http(S.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    http_port = idem_server_http_port(S.srv);
}

static void teardown(void)
{
    tu_server_destroy(&S, false);
    tu_rmtree(ipc_dir);
}

TestSuite(identity, .fini = teardown, .timeout = 60);

static idem_client *client(const char *url, const char *caller, const char *secret,
                           const char *signer)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = 2000;
    o.retry.max_attempts = 1;
    o.caller = caller;
    o.signing_secret = secret;
    o.signer = signer;
    cr_assert_eq(idem_client_open(&c, &url, 1, &o), IDEM_OK, "%s", idem_errmsg());
    return c;
}

/* One debit; the reply payload (or message) into out. */
static idem_code debit(idem_client *c, const char *key, char *out, size_t cap, bool *replayed)
{
    idem_result r;
    idem_request q = {.method = DEBIT, .idempotency_key = key, .payload = "100", .payload_len = 3};
    idem_code code = idem_client_call(c, &q, &r);
    snprintf(out, cap, "%.*s", code == IDEM_OK ? (int)r.payload_len : (int)strlen(r.message),
             code == IDEM_OK ? (const char *)r.payload : r.message);
    if (replayed != NULL) {
        *replayed = r.replayed;
    }
    idem_result_clear(&r);
    return code;
}

/* ---- raw signed frames, for what idem_client never sends ---- */

typedef struct raw_req {
    const char *caller, *key, *payload, *secret;
    uint64_t ts;
} raw_req;

/* A Request signed over r, then changed by tamper_key / tamper_payload (NULL = not). */
static void *signed_frame(const raw_req *r, const char *tamper_key, const char *tamper_payload,
                          size_t *len)
{
    char sig[IDEM_SIGNATURE_HEX + 1], ts[24];
    idem_signed_fields f = {.caller = r->caller,
                            .method = DEBIT,
                            .key = r->key,
                            .token = "",
                            .payload = r->payload,
                            .payload_len = strlen(r->payload),
                            .timestamp_ms = r->ts};
    cr_assert(idem__signature(r->secret, &f, sig));
    snprintf(ts, sizeof(ts), "%llu", (unsigned long long)r->ts);
    Idem__V1__Request q = IDEM__V1__REQUEST__INIT;
    Idem__V1__Request__MetadataEntry e[2], *ep[2] = {&e[0], &e[1]};
    idem__v1__request__metadata_entry__init(&e[0]);
    idem__v1__request__metadata_entry__init(&e[1]);
    e[0].key = IDEM_META_SIGNATURE;
    e[0].value = sig;
    e[1].key = IDEM_META_TIMESTAMP;
    e[1].value = ts;
    const char *payload = tamper_payload != NULL ? tamper_payload : r->payload;
    q.method = DEBIT;
    q.caller = (char *)r->caller;
    q.idempotency_key = (char *)(tamper_key != NULL ? tamper_key : r->key);
    q.payload.data = (uint8_t *)payload;
    q.payload.len = strlen(payload);
    q.attempt = 1;
    q.n_metadata = 2;
    q.metadata = ep;
    *len = idem__v1__request__get_packed_size(&q);
    void *buf = malloc(*len);
    cr_assert_not_null(buf);
    idem__v1__request__pack(&q, buf);
    return buf;
}

/* Sends the frame over tcp and expects code with want in the message. */
static void expect_raw(void *frame, size_t len, idem_code code, const char *want)
{
    Idem__V1__Response *r = tu_raw_call(S.url, frame, len, 3000);
    free(frame);
    cr_assert_not_null(r);
    cr_expect_eq(r->code, (uint32_t)code, "code %s: %s", idem_code_name((idem_code)r->code),
                 r->message);
    cr_expect(strstr(r->message, want) != NULL, "message: %s", r->message);
    tu_response_free(r);
    cr_expect_eq(atomic_load(&executions), 0, "nothing ran");
}

/* ---- ipc: the peer uid is the caller ---- */

Test(identity, ipc_peer_uid_is_the_caller_and_a_claim_of_another_is_denied)
{
    serve(IPC_AND_SIGNED_REQUIRED);
    char out[512];
    bool replayed;
    idem_client *anon = client(ipc_url, NULL, NULL, NULL);
    cr_assert_eq(debit(anon, "k1", out, sizeof(out), NULL), IDEM_OK, "%s", out);
    cr_expect_str_eq(out, "exec=1 caller=A verified=1");
    idem_client *as_a = client(ipc_url, "A", NULL, NULL); /* fast path replay, same scope */
    cr_assert_eq(debit(as_a, "k1", out, sizeof(out), &replayed), IDEM_OK, "%s", out);
    cr_expect(replayed);
    cr_expect_str_eq(out, "exec=1 caller=A verified=1");
    idem_client *as_b = client(ipc_url, "B\"x", NULL, NULL);
    cr_assert_eq(debit(as_b, "k1", out, sizeof(out), NULL), IDEM_PERMISSION_DENIED, "%s", out);
    cr_expect_str_eq(out, "caller \"B\\x22x\" is not the verified caller of this connection "
                          "(\"A\")");
    cr_expect_eq(atomic_load(&executions), 1);
    idem_client_close(anon);
    idem_client_close(as_a);
    idem_client_close(as_b);
}

Test(identity, ipc_caller_a_results_and_tokens_are_not_b_s)
{
    serve(IPC_AND_SIGNED_REQUIRED);
    char out[512], token[64];
    bool replayed;
    idem_client *a = client(ipc_url, NULL, NULL, NULL);
    idem_client *b = client(S.url, "B", SECRET_B, NULL);
    cr_assert_eq(debit(a, "k1", out, sizeof(out), NULL), IDEM_OK, "%s", out);
    /* B, knowing A's key and payload, runs in its own scope: A's result stays A's. */
    cr_assert_eq(debit(b, "k1", out, sizeof(out), &replayed), IDEM_OK, "%s", out);
    cr_expect_not(replayed);
    cr_expect_str_eq(out, "exec=2 caller=B verified=1");
    cr_assert_eq(idem_client_issue_token(a, NULL, token, sizeof(token), NULL), IDEM_OK, "%s",
                 idem_errmsg());
    idem_result r;
    idem_request q = {.method = "test.Order/Submit", .token = token};
    cr_expect_eq(idem_client_call(b, &q, &r), IDEM_PERMISSION_DENIED, "B used A's token: %s",
                 r.message);
    idem_result_clear(&r);
    cr_expect_eq(idem_client_call(a, &q, &r), IDEM_OK, "%s", r.message); /* still A's */
    idem_result_clear(&r);
    idem_client_close(a);
    idem_client_close(b);
}

/* ---- signed nng ---- */

Test(identity, signed_b_with_a_name_and_b_secret_is_unauthenticated)
{
    serve(SIGNED);
    char out[512];
    idem_client *b = client(S.url, "A", SECRET_B, NULL);
    cr_assert_eq(debit(b, "k1", out, sizeof(out), NULL), IDEM_UNAUTHENTICATED, "%s", out);
    cr_expect(strstr(out, "idem-signature does not match the request") != NULL, "%s", out);
    cr_expect_eq(atomic_load(&executions), 0);
    idem_client_close(b);
}

Test(identity, signed_b_cannot_see_a_record_nor_use_a_token)
{
    serve(SIGNED);
    char out[512], token[64];
    bool replayed;
    idem_client *a = client(S.url, "A", SECRET_A, NULL);
    idem_client *b = client(S.url, "B", SECRET_B, NULL);
    cr_assert_eq(debit(a, "k1", out, sizeof(out), NULL), IDEM_OK, "%s", out);
    cr_expect_str_eq(out, "exec=1 caller=A verified=1");
    cr_assert_eq(debit(b, "k1", out, sizeof(out), &replayed), IDEM_OK, "%s", out);
    cr_expect_not(replayed);
    cr_expect_str_eq(out, "exec=2 caller=B verified=1");
    cr_assert_eq(debit(a, "k1", out, sizeof(out), &replayed), IDEM_OK, "%s", out);
    cr_expect(replayed);
    cr_expect_str_eq(out, "exec=1 caller=A verified=1");
    cr_assert_eq(idem_client_issue_token(a, NULL, token, sizeof(token), NULL), IDEM_OK, "%s",
                 idem_errmsg());
    idem_result r;
    idem_request q = {.method = "test.Order/Submit", .token = token};
    cr_expect_eq(idem_client_call(b, &q, &r), IDEM_PERMISSION_DENIED, "%s", r.message);
    idem_result_clear(&r);
    idem_client_close(a);
    idem_client_close(b);
}

Test(identity, unsigned_request_is_unauthenticated_when_required)
{
    serve(SIGNED_REQUIRED);
    char out[512];
    idem_client *c = client(S.url, "A", NULL, NULL);
    cr_assert_eq(debit(c, "k1", out, sizeof(out), NULL), IDEM_UNAUTHENTICATED, "%s", out);
    cr_expect(strstr(out, "verified callers only") != NULL, "%s", out);
    cr_expect_eq(atomic_load(&executions), 0);
    idem_client_close(c);
}

Test(identity, stale_signature_is_unauthenticated)
{
    serve(SIGNED);
    size_t len;
    raw_req r = {"A", "k1", "100", SECRET_A, idem__now_ms() - 6 * 60 * 1000};
    void *frame = signed_frame(&r, NULL, NULL, &len);
    expect_raw(frame, len, IDEM_UNAUTHENTICATED, "ms in the past");
}

Test(identity, future_signature_is_unauthenticated)
{
    serve(SIGNED);
    size_t len;
    raw_req r = {"A", "k1", "100", SECRET_A, idem__now_ms() + 6 * 60 * 1000};
    void *frame = signed_frame(&r, NULL, NULL, &len);
    expect_raw(frame, len, IDEM_UNAUTHENTICATED, "ms in the future");
}

Test(identity, tampered_payload_is_unauthenticated)
{
    serve(SIGNED);
    size_t len;
    raw_req r = {"A", "k1", "100", SECRET_A, idem__now_ms()};
    void *frame = signed_frame(&r, NULL, "100000", &len);
    expect_raw(frame, len, IDEM_UNAUTHENTICATED, "idem-signature does not match the request");
}

Test(identity, tampered_key_is_unauthenticated)
{
    serve(SIGNED);
    size_t len;
    raw_req r = {"A", "k1", "100", SECRET_A, idem__now_ms()};
    void *frame = signed_frame(&r, "k2", NULL, &len);
    expect_raw(frame, len, IDEM_UNAUTHENTICATED, "idem-signature does not match the request");
}

Test(identity, a_valid_raw_signature_inside_the_window_runs)
{
    serve(SIGNED);
    size_t len;
    raw_req r = {"A", "k1", "100", SECRET_A, idem__now_ms() - 60 * 1000};
    void *frame = signed_frame(&r, NULL, NULL, &len);
    /* A replay of the same signed frame inside the window: the same key, the stored
     * first result, nothing more (README "Security"). */
    for (int i = 0; i < 2; i++) {
        Idem__V1__Response *resp = tu_raw_call(S.url, frame, len, 3000);
        cr_assert_not_null(resp);
        cr_expect_eq(resp->code, IDEM_OK, "%s", resp->message);
        cr_expect_eq(resp->replayed, i == 1);
        cr_expect(resp->payload.len > 0 &&
                  strncmp((char *)resp->payload.data, "exec=1 caller=A", 15) == 0);
        tu_response_free(resp);
    }
    free(frame);
    cr_expect_eq(atomic_load(&executions), 1);
}

Test(identity, signature_of_an_unknown_caller_is_unauthenticated)
{
    serve(SIGNED);
    char out[512];
    idem_client *c = client(S.url, "C\n", "some-secret-of-length-16", NULL);
    cr_assert_eq(debit(c, "k1", out, sizeof(out), NULL), IDEM_INVALID_ARGUMENT, "%s", out);
    idem_client_close(c);
    c = client(S.url, "C", "some-secret-of-length-16", NULL);
    cr_assert_eq(debit(c, "k1", out, sizeof(out), NULL), IDEM_UNAUTHENTICATED, "%s", out);
    cr_expect_str_eq(out, "no signing secret is configured for \"C\"");
    idem_client_close(c);
}

Test(identity, only_a_proxy_signs_for_another_caller)
{
    serve(SIGNED_REQUIRED);
    char out[512];
    bool replayed;
    idem_client *b_for_a = client(S.url, "A", SECRET_B, "B");
    cr_assert_eq(debit(b_for_a, "k1", out, sizeof(out), NULL), IDEM_PERMISSION_DENIED, "%s", out);
    cr_expect_str_eq(out, "\"B\" is not a proxy: it signs only for itself, not for caller \"A\"");
    idem_client *gw_for_a = client(S.url, "A", SECRET_GW, "gw");
    cr_assert_eq(debit(gw_for_a, "k1", out, sizeof(out), NULL), IDEM_OK, "%s", out);
    cr_expect_str_eq(out, "exec=1 caller=A verified=1");
    idem_client *a = client(S.url, "A", SECRET_A, NULL);
    cr_assert_eq(debit(a, "k1", out, sizeof(out), &replayed), IDEM_OK, "%s", out);
    cr_expect(replayed, "the proxy's call for A is A's record");
    idem_client_close(b_for_a);
    idem_client_close(gw_for_a);
    idem_client_close(a);
}

/* ---- signed HTTP ---- */

/* POST /test.Pay/Debit as caller, signed with secret (NULL = unsigned). */
static void http_debit(tu_http *out, const char *caller, const char *key, const char *secret)
{
    char sig[IDEM_SIGNATURE_HEX + 1], h_caller[160], h_key[300], h_sig[100], h_ts[60];
    uint64_t now = idem__now_ms();
    idem_signed_fields f = {.caller = caller,
                            .method = DEBIT,
                            .key = key,
                            .payload = "100",
                            .payload_len = 3,
                            .timestamp_ms = now};
    snprintf(h_caller, sizeof(h_caller), "X-Caller: %s", caller);
    snprintf(h_key, sizeof(h_key), "Idempotency-Key: %s", key);
    const char *headers[4] = {h_caller, h_key, h_sig, h_ts};
    if (secret != NULL) {
        cr_assert(idem__signature(secret, &f, sig));
        snprintf(h_sig, sizeof(h_sig), "Idem-Signature: %s", sig);
        snprintf(h_ts, sizeof(h_ts), "Idem-Timestamp: %llu", (unsigned long long)now);
    }
    tu_http_post(out, http_port, "/" DEBIT, headers, secret != NULL ? 4 : 2, "100", 3);
}

Test(identity, signed_http_b_with_a_name_and_b_secret_is_401)
{
    serve(SIGNED);
    tu_http r;
    http_debit(&r, "A", "k1", SECRET_B);
    cr_expect_eq(r.status, 401, "%s", r.body);
    cr_expect(strstr(r.body, "\"code\":\"UNAUTHENTICATED\"") != NULL, "%s", r.body);
    tu_http_free(&r);
    cr_expect_eq(atomic_load(&executions), 0);
    tu_http_get(&r, http_port, "/metrics"); /* counted under its own reason, not "other" */
    cr_expect(strstr(r.body, "idem_rejected_total{reason=\"identity\"} 1") != NULL, "%s", r.body);
    tu_http_free(&r);
}

Test(identity, signed_http_b_cannot_see_a_record)
{
    serve(SIGNED_REQUIRED);
    char out[512];
    tu_http r;
    idem_client *a = client(S.url, "A", SECRET_A, NULL);
    cr_assert_eq(debit(a, "k1", out, sizeof(out), NULL), IDEM_OK, "%s", out);
    http_debit(&r, "B", "k1", SECRET_B);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect_str_eq(r.body, "exec=2 caller=B verified=1");
    tu_http_free(&r);
    http_debit(&r, "A", "k1", SECRET_A);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect_str_eq(r.body, "exec=1 caller=A verified=1");
    char v[16];
    cr_expect_not_null(tu_http_header(&r, "Idempotent-Replayed", v, sizeof(v)));
    tu_http_free(&r);
    http_debit(&r, "A", "k1", NULL);
    cr_expect_eq(r.status, 401, "unsigned, required: %s", r.body);
    tu_http_free(&r);
    idem_client_close(a);
}

/* ---- nothing configured ---- */

Test(identity, nothing_configured_keeps_the_self_declared_caller)
{
    serve(NOTHING);
    char out[512];
    bool replayed;
    idem_client *a = client(S.url, "A", NULL, NULL);
    idem_client *also_a = client(ipc_url, "A", SECRET_B, NULL); /* ignored: no secrets */
    cr_assert_eq(debit(a, "k1", out, sizeof(out), NULL), IDEM_OK, "%s", out);
    cr_expect_str_eq(out, "exec=1 caller=A verified=0");
    cr_assert_eq(debit(also_a, "k1", out, sizeof(out), &replayed), IDEM_OK, "%s", out);
    cr_expect(replayed, "trusted network only: whoever says A is A");
    idem_client_close(a);
    idem_client_close(also_a);
}

Test(identity, bad_configuration_is_refused_at_create)
{
    idem_caller_secret short_secret = {.caller = "A", .secret = "short"};
    idem_caller_secret twice[] = {{.caller = "A", .secret = SECRET_A},
                                  {.caller = "A", .secret = SECRET_B}};
    idem_ipc_caller uids[] = {{.uid = 1, .caller = "A"}, {.uid = 1, .caller = "B"}};
    idem_ipc_caller no_name = {.uid = 1, .caller = ""};
    struct {
        const idem_caller_secret *s;
        size_t ns;
        const idem_ipc_caller *u;
        size_t nu;
        const char *want;
    } cases[] = {
        {&short_secret, 1, NULL, 0, "the secret must be 16..256 bytes"},
        {twice, 2, NULL, 0, "a second secret for one caller"},
        {NULL, 0, uids, 2, "is mapped twice"},
        {NULL, 0, &no_name, 1, "the caller must be 1..127"},
    };
    for (size_t i = 0; i < IDEM_ARRAY_LEN(cases); i++) {
        idem_server_opts o;
        idem_server *srv;
        char *dir = tu_tempdir("cfg");
        idem_server_opts_init(&o);
        o.db_path = dir;
        o.caller_secrets = cases[i].s;
        o.n_caller_secrets = cases[i].ns;
        o.ipc_callers = cases[i].u;
        o.n_ipc_callers = cases[i].nu;
        cr_expect_eq(idem_server_create(&srv, &o), IDEM_INVALID_ARGUMENT, "case %zu", i);
        cr_expect(strstr(idem_errmsg(), cases[i].want) != NULL, "case %zu: %s", i, idem_errmsg());
        tu_rmtree(dir);
    }
    S.srv = NULL; /* teardown has nothing to stop */
    ipc_dir = NULL;
}

Test(identity, a_name_with_a_secret_is_never_taken_merely_declared)
{
    serve(SIGNED); /* secrets for A and B, verification not required */
    char out[512];
    idem_client *a = client(S.url, "A", SECRET_A, NULL), *fake = client(S.url, "A", NULL, NULL);
    cr_assert_eq(debit(a, "k1", out, sizeof(out), NULL), IDEM_OK, "%s", out);
    cr_expect_eq(debit(fake, "k1", out, sizeof(out), NULL), IDEM_PERMISSION_DENIED,
                 "an unsigned \"A\" would share A's records: %s", out);
    idem_client *other = client(S.url, "nobody-in-particular", NULL, NULL);
    cr_expect_eq(debit(other, "k1", out, sizeof(out), NULL), IDEM_OK, "%s", out);
    cr_expect_str_eq(out, "exec=2 caller=nobody-in-particular verified=0");
    idem_client_close(a);
    idem_client_close(fake);
    idem_client_close(other);
}
