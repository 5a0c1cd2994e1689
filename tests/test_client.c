/* idem_client against a real server: the call's key resolved as the server resolves it
 * (field, metadata, token, generated), no resend of a keyless call whose outcome may
 * have happened, the last answer reported when the deadline ends the retries, and
 * derived keys that no two calls share. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "idemrpc.pb-c.h"
#include "testutil.h"

#include "idemrpc/downstream.h"

/* Read by LeakSanitizer in a sanitizer build, ignored otherwise. These tests drop
 * connections while requests and replies are in flight (vanishing peers, timed-out
 * attempts whose replies arrive late); nng 1.5.2 may then keep a dialer and its pipes on
 * a reaper that is stuck or still running when the test's process exits (see
 * src/supplemental/nng_close.c), which LSan reports as indirect leaks allocated inside
 * libnng (1 run in 8 of this program under ASan). Only this program ignores leaks
 * allocated inside libnng; every other test program still reports them. */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void)
{
    return "leak:libnng.so.1\n";
}

static tu_server S;
static idem_client *C;
static atomic_int executions;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static bool gate_open;

static idem_code h_count(idem_call *call, void *arg)
{
    (void)arg;
    char out[32];
    int n = snprintf(out, sizeof(out), "exec=%d", atomic_fetch_add(&executions, 1) + 1);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* Holds the call (its handler is running) until the test opens the gate. */
static idem_code h_gated(idem_call *call, void *arg)
{
    pthread_mutex_lock(&mu);
    while (!gate_open) {
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    return h_count(call, arg);
}

static idem_code h_down(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&executions, 1);
    return idem_call_fail(call, IDEM_UNAVAILABLE, "the ledger is down");
}

static void open_gate(void)
{
    pthread_mutex_lock(&mu);
    gate_open = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void setup(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.default_chain = false;
    atomic_store(&executions, 0);
    gate_open = false;
    tu_server_create(&S, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED};
    idem_method_opts required = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_use_builtin(S.srv, IDEM_BUILTIN_REQUEST_ID), IDEM_OK);
    cr_assert_eq(idem_server_use_builtin(S.srv, IDEM_BUILTIN_TOKEN), IDEM_OK);
    cr_assert_eq(idem_server_use_builtin(S.srv, IDEM_BUILTIN_RESULT_CACHE), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Pay/Cached", h_count, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Pay/Required", h_count, NULL, &required), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Pay/Gated", h_gated, NULL, NULL), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Pay/Down", h_down, NULL, &cached), IDEM_OK);
    tu_server_listen(&S);
    C = tu_client(S.url, 2000);
}

static void teardown(void)
{
    open_gate();
    idem_client_close(C);
    tu_server_destroy(&S, false);
}

TestSuite(client, .init = setup, .fini = teardown, .timeout = 60);

/* ---- the key: the client resolves it as the server does ---- */

static idem_code call_meta(const char *method, const char *field, const char *meta, idem_result *r)
{
    idem_metadata_kv kv = {"idempotency-key", meta};
    idem_request q = {.method = method,
                      .idempotency_key = field,
                      .metadata = meta != NULL ? &kv : NULL,
                      .metadata_count = meta != NULL,
                      .payload = "10",
                      .payload_len = 2};
    return idem_client_call(C, &q, r);
}

Test(client, a_metadata_key_is_the_calls_key_on_every_send)
{
    idem_result r1, r2;
    cr_assert_eq(call_meta("t.Pay/Cached", NULL, "order-7", &r1), IDEM_OK, "%s", r1.message);
    cr_assert_eq(call_meta("t.Pay/Cached", NULL, "order-7", &r2), IDEM_OK, "%s", r2.message);
    cr_expect_eq(atomic_load(&executions), 1, "the same call sent twice ran twice");
    cr_expect(r2.replayed);
    cr_expect_str_eq(r1.key, "order-7");
    cr_expect_str_eq(r2.key, "order-7");
    idem_result_clear(&r1);
    idem_result_clear(&r2);
}

Test(client, a_metadata_key_satisfies_a_key_required_method)
{
    idem_result r;
    cr_expect_eq(call_meta("t.Pay/Required", NULL, "order-8", &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.key, "order-8");
    idem_result_clear(&r);
}

Test(client, a_field_and_metadata_that_name_the_same_key_are_one_key)
{
    idem_result r1, r2;
    cr_assert_eq(call_meta("t.Pay/Required", "k-9", "k-9", &r1), IDEM_OK, "%s", r1.message);
    cr_assert_eq(call_meta("t.Pay/Required", "k-9", NULL, &r2), IDEM_OK, "%s", r2.message);
    cr_expect_eq(atomic_load(&executions), 1);
    cr_expect(r2.replayed);
    idem_result_clear(&r1);
    idem_result_clear(&r2);
}

Test(client, a_field_and_metadata_that_name_two_keys_are_refused_before_sending)
{
    idem_result r;
    cr_expect_eq(call_meta("t.Pay/Cached", "k-1", "k-2", &r), IDEM_INVALID_ARGUMENT);
    cr_expect_neq(strstr(r.message, "two different keys"), NULL, "%s", r.message);
    cr_expect_eq(r.attempts, 0);
    cr_expect_eq(atomic_load(&executions), 0);
    idem_result_clear(&r);
}

/* The signer covers the key the server resolves: a metadata key verifies. */
Test(client, a_signed_call_with_a_metadata_key_verifies_and_runs_once)
{
    static const idem_caller_secret secret = {.caller = "A", .secret = "secret-of-caller-A-0123"};
    idem_server_opts so;
    idem_server_opts_init(&so);
    so.caller_secrets = &secret;
    so.n_caller_secrets = 1;
    tu_server sg;
    tu_server_create(&sg, &so);
    idem_method_opts required = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(sg.srv, "t.Pay/Required", h_count, NULL, &required), IDEM_OK);
    tu_server_listen(&sg);
    idem_client_opts o;
    idem_client *sc;
    idem_client_opts_init(&o);
    o.caller = "A";
    o.signing_secret = secret.secret;
    cr_assert_eq(idem_client_open(&sc, (const char *[]){sg.url}, 1, &o), IDEM_OK);
    idem_metadata_kv kv = {"idempotency-key", "order-6"};
    idem_request q = {.method = "t.Pay/Required", .metadata = &kv, .metadata_count = 1};
    idem_result r1, r2;
    cr_expect_eq(idem_client_call(sc, &q, &r1), IDEM_OK, "%s", r1.message);
    cr_expect_eq(idem_client_call(sc, &q, &r2), IDEM_OK, "%s", r2.message);
    cr_expect_eq(atomic_load(&executions), 1);
    idem_result_clear(&r1);
    idem_result_clear(&r2);
    idem_client_close(sc);
    tu_server_destroy(&sg, false);
}

/* A raw Request with the field and up to two metadata entries (NULL name: none). */
static Idem__V1__Response *send_raw(const char *field, const char *n1, const char *v1,
                                    const char *n2, const char *v2)
{
    Idem__V1__Request m = IDEM__V1__REQUEST__INIT;
    Idem__V1__Request__MetadataEntry e[2], *p[2] = {&e[0], &e[1]};
    const char *names[2] = {n1, n2}, *values[2] = {v1, v2};
    for (size_t i = 0; i < 2 && names[i] != NULL; i++) {
        idem__v1__request__metadata_entry__init(&e[i]);
        e[i].key = (char *)names[i];
        e[i].value = (char *)values[i];
        m.n_metadata = i + 1;
    }
    m.metadata = p;
    m.method = "t.Pay/Cached";
    m.idempotency_key = (char *)field;
    size_t len = idem__v1__request__get_packed_size(&m);
    uint8_t *frame = malloc(len);
    cr_assert_not_null(frame);
    idem__v1__request__pack(&m, frame);
    Idem__V1__Response *r = tu_raw_call(S.url, frame, len, 5000);
    free(frame);
    cr_assert_not_null(r);
    return r;
}

Test(client, the_server_refuses_a_field_and_metadata_that_name_two_keys)
{
    Idem__V1__Response *r = send_raw("k-1", "idempotency-key", "k-2", NULL, NULL);
    cr_expect_eq(r->code, IDEM__V1__CODE__INVALID_ARGUMENT, "%s", r->message);
    cr_expect_neq(strstr(r->message, "two different keys"), NULL, "%s", r->message);
    cr_expect_eq(atomic_load(&executions), 0);
    tu_response_free(r);
}

/* What an older idem_client sends for a metadata key: a generated key in the field. */
Test(client, a_metadata_key_wins_over_a_key_an_older_client_generated)
{
    const char *gen = "idem-key-generated";
    Idem__V1__Response *r1 = send_raw("0000aaaa", gen, "1", "idempotency-key", "order-5");
    Idem__V1__Response *r2 = send_raw("0000bbbb", gen, "1", "idempotency-key", "order-5");
    cr_expect_eq(r1->code, IDEM__V1__CODE__OK, "%s", r1->message);
    cr_expect_eq(r2->code, IDEM__V1__CODE__OK, "%s", r2->message);
    cr_expect_eq(atomic_load(&executions), 1, "the same call sent twice ran twice");
    cr_expect(r2->replayed);
    tu_response_free(r1);
    tu_response_free(r2);
}

/* ---- a keyless call is resent only when it provably did not arrive ---- */

static idem_client *keyless_client(const char *url, uint32_t attempt_timeout_ms)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.never_generate_key = true;
    o.attempt_timeout_ms = attempt_timeout_ms;
    o.retry.max_attempts = 3;
    o.retry.period_ms = 10;
    o.retry.max_period_ms = 10;
    cr_assert_eq(idem_client_open(&c, &url, 1, &o), IDEM_OK, "%s", idem_errmsg());
    return c;
}

Test(client, a_keyless_call_whose_attempt_timed_out_is_not_resent)
{
    idem_client *kc = keyless_client(S.url, 200);
    idem_request q = {.method = "t.Pay/Gated", .payload = "10", .payload_len = 2};
    idem_result r;
    cr_expect_eq(idem_client_call(kc, &q, &r), IDEM_DEADLINE_EXCEEDED, "%s", r.message);
    cr_expect_eq(r.attempts, 1, "a call that may have run was sent %u times", r.attempts);
    cr_expect_str_eq(r.key, "");
    idem_result_clear(&r);
    idem_client_close(kc);
}

Test(client, a_keyless_call_that_never_left_is_resent)
{
    tu_server gone; /* its port, once it is gone: no attempt is ever handed to a peer */
    char url[sizeof(gone.url)];
    tu_server_create(&gone, NULL);
    tu_server_listen(&gone);
    memcpy(url, gone.url, sizeof(url));
    tu_server_destroy(&gone, false);
    idem_client *kc = keyless_client(url, 50);
    idem_request q = {.method = "t.Pay/Gated"};
    idem_result r;
    cr_expect_eq(idem_client_call(kc, &q, &r), IDEM_DEADLINE_EXCEEDED, "%s", r.message);
    cr_expect_eq(r.attempts, 3);
    idem_result_clear(&r);
    idem_client_close(kc);
}

/* A peer that takes the first request on url and goes away without answering (its
 * connection is lost after the send), then listens again on url: what reaches it now
 * was sent again. */
typedef struct vanishing_peer {
    char url[64];
    nng_socket sock;
    pthread_t thread;
    int rv; /* the first nng error of the peer's thread (asserted after the join) */
} vanishing_peer;

static void *vanish(void *arg)
{
    vanishing_peer *p = arg;
    nng_msg *m;
    if ((p->rv = nng_recvmsg(p->sock, &m, 0)) == 0) {
        nng_msg_free(m);
        if ((p->rv = nng_close(p->sock)) == 0 && (p->rv = nng_rep0_open(&p->sock)) == 0) {
            p->rv = nng_listen(p->sock, p->url, NULL, 0);
        }
    }
    return NULL;
}

static void vanishing_peer_start(vanishing_peer *p)
{
    nng_listener l;
    nng_sockaddr sa;
    cr_assert_eq(nng_rep0_open(&p->sock), 0);
    cr_assert_eq(nng_socket_set_ms(p->sock, NNG_OPT_RECVTIMEO, 30000), 0);
    cr_assert_eq(nng_listen(p->sock, "tcp://127.0.0.1:0", &l, 0), 0);
    cr_assert_eq(nng_listener_get_addr(l, NNG_OPT_LOCADDR, &sa), 0);
    snprintf(p->url, sizeof(p->url), "tcp://127.0.0.1:%u", ntohs(sa.s_in.sa_port));
    cr_assert_eq(pthread_create(&p->thread, NULL, vanish, p), 0);
}

Test(client, a_keyless_call_whose_connection_was_lost_after_the_send_is_not_resent)
{
    vanishing_peer p;
    nng_msg *again = NULL;
    vanishing_peer_start(&p);
    idem_client *kc = keyless_client(p.url, 1000);
    idem_request q = {.method = "t.Pay/Gated"};
    idem_result r;
    cr_expect_eq(idem_client_call(kc, &q, &r), IDEM_UNAVAILABLE, "%s", r.message);
    cr_expect_eq(r.attempts, 1, "a call that may have run was sent %u times", r.attempts);
    pthread_join(p.thread, NULL);
    cr_assert_eq(p.rv, 0, "peer: %s", nng_strerror(p.rv));
    cr_expect_eq(nng_recvmsg(p.sock, &again, NNG_FLAG_NONBLOCK), NNG_EAGAIN, "sent again");
    if (again != NULL) {
        nng_msg_free(again);
    }
    idem_result_clear(&r);
    idem_client_close(kc);
    nng_close(p.sock);
}

Test(client, a_keyed_call_whose_attempt_timed_out_is_resent_with_its_key)
{
    idem_client *kc = keyless_client(S.url, 200);
    idem_request q = {.method = "t.Pay/Gated", .idempotency_key = "k-3"};
    idem_result r;
    cr_expect_eq(idem_client_call(kc, &q, &r), IDEM_DEADLINE_EXCEEDED, "%s", r.message);
    cr_expect_eq(r.attempts, 3);
    idem_result_clear(&r);
    idem_client_close(kc);
}

/* ---- the deadline ends the retries: the last answer is the call's ---- */

Test(client, a_deadline_that_cuts_the_last_backoff_short_reports_the_last_answer)
{
    idem_client_opts o;
    idem_client *dc;
    idem_client_opts_init(&o);
    o.deadline_ms = 3000;
    o.retry.period_ms = o.retry.max_period_ms = 60000; /* far past the deadline */
    cr_assert_eq(idem_client_open(&dc, (const char *[]){S.url}, 1, &o), IDEM_OK);
    idem_request q = {.method = "t.Pay/Down", .idempotency_key = "k-4"};
    idem_result r;
    cr_expect_eq(idem_client_call(dc, &q, &r), IDEM_UNAVAILABLE, "%s", r.message);
    cr_expect_str_eq(r.message, "the ledger is down");
    cr_expect_eq(r.attempts, 1);
    idem_result_clear(&r);
    idem_client_close(dc);
}

/* ---- derived keys: one encoding, no two (step, generation, undo) alike ---- */

/* What 0cf25cb derived: the length-prefixed caller, method, key, step (and "undo"),
 * then the generation's 8 bytes when it is not 0. */
static void derived_before(const idem_call *call, const char *step, uint64_t gen, bool undo,
                           char out[IDEM_DERIVED_KEY_LEN + 1])
{
    const char *parts[5] = {idem_call_caller(call), idem_call_method(call), idem_call_key(call),
                            step, "undo"};
    uint8_t d[32], g[8];
    idem__put_be64(g, gen);
    cr_assert(idem__lp_sha256(parts, undo ? 5 : 4, gen ? g : NULL, sizeof(g), d));
    out[0] = 'd';
    out[1] = '-';
    idem__hex(out + 2, d, sizeof(d));
}

/* The derived key of step at generation gen (of its undo when undo), as a run of this
 * call would derive it. */
static void derived_now(idem_call *call, const char *step, uint64_t gen, bool undo,
                        char out[IDEM_DERIVED_KEY_LEN + 1])
{
    uint64_t was_gen = call->step_gen;
    const char *was_undoing = call->undoing;
    call->step_gen = gen;
    call->undoing = undo ? step : NULL;
    cr_assert_eq(idem_call_derive_key(call, step, out), IDEM_OK, "%s", idem_errmsg());
    call->step_gen = was_gen;
    call->undoing = was_undoing;
}

/* Answers "collisions=N changed=M": keys two different derivations share, and keys of
 * reachable generations that differ from what 0cf25cb derived. */
static idem_code h_derive(idem_call *call, void *arg)
{
    (void)arg;
    /* be64 of this generation is be32(4) "undo": the step's key at it was the undo's at 0 */
    const uint64_t crafted = 0x00000004756e646fULL;
    const uint64_t gens[] = {0, 1, 7, UINT32_MAX};
    char a[IDEM_DERIVED_KEY_LEN + 1], b[IDEM_DERIVED_KEY_LEN + 1], out[64];
    int collisions = 0, changed = 0;
    derived_now(call, "s", crafted, false, a);
    derived_now(call, "s", 0, true, b);
    collisions += strcmp(a, b) == 0;
    for (size_t i = 0; i < 2 * IDEM_ARRAY_LEN(gens); i++) {
        derived_now(call, "charge", gens[i / 2], i % 2, a);
        derived_before(call, "charge", gens[i / 2], i % 2, b);
        changed += strcmp(a, b) != 0;
    }
    int n = snprintf(out, sizeof(out), "collisions=%d changed=%d", collisions, changed);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

Test(client, no_two_steps_undos_or_generations_share_a_derived_key_and_old_keys_stay)
{
    idem_method_opts required = {.flags = IDEM_METHOD_KEY_REQUIRED};
    tu_server d;
    tu_server_create(&d, NULL);
    cr_assert_eq(idem_server_register(d.srv, "t.Order/Derive", h_derive, NULL, &required), IDEM_OK);
    tu_server_listen(&d);
    idem_client *dc = tu_client(d.url, 2000);
    idem_request q = {.method = "t.Order/Derive", .idempotency_key = "order-1"};
    idem_result r;
    cr_assert_eq(idem_client_call(dc, &q, &r), IDEM_OK, "%s", r.message);
    cr_expect_eq(r.payload_len, strlen("collisions=0 changed=0"));
    cr_expect_eq(memcmp(r.payload, "collisions=0 changed=0", r.payload_len), 0, "%.*s",
                 (int)r.payload_len, (const char *)r.payload);
    idem_result_clear(&r);
    idem_client_close(dc);
    tu_server_destroy(&d, false);
}
