/* Integration: the gRPC front through a client nobody here wrote, Debian's
 * python3-grpcio (tests/test_grpc.py, one case per test). A real server on
 * tcp://127.0.0.1:<free port> with a counting method (t.Count/Add) and a gated one
 * (t.Gate/Do: its handler waits until the test opens the gate, once the calls the case
 * sends have all arrived); every test asserts how often a handler ran. The grpc_signed
 * suites give callers A and B signing secrets (README "Security"): the test signs the
 * calls of t.Pay/Debit (idem__signature), python3-grpcio sends the signature as
 * metadata. Skipped when /usr/bin/python3 cannot import grpc. The store is the one
 * $IDEMRPC_TEST_BACKEND names (tu_backend_open): `grpc` runs on LMDB, `grpc_pg` on
 * PostgreSQL. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "testutil.h"

#define PYTHON "/usr/bin/python3"
#define BOUND_S 30 /* a bound on every wait, never a synchronisation */
#define SECRET_A "secret-of-caller-A-0123"
#define SECRET_B "secret-of-caller-B-4567"
#define DEBIT "t.Pay/Debit"

static tu_server S;
static tu_backend B;
static int port;
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrivals; /* calls of t.Gate/Do that entered the chain */
    bool gate_open;
    atomic_int runs;
    char caller[64]; /* of the last t.Count/Add or t.Pay/Debit run */
} H = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static idem_code reply_run(idem_call *call)
{
    char out[128];
    size_t n;
    const char *p = idem_call_payload(call, &n);
    int len = snprintf(out, sizeof(out), "run=%d payload=%.*s", atomic_fetch_add(&H.runs, 1) + 1,
                       (int)(n < 64 ? n : 64), p);
    return idem_call_reply(call, IDEM_OK, out, (size_t)len);
}

static idem_code h_add(idem_call *call, void *arg)
{
    (void)arg;
    pthread_mutex_lock(&H.mu);
    snprintf(H.caller, sizeof(H.caller), "%s%s", idem_call_caller(call),
             idem_call_caller_verified(call) ? " (verified)" : "");
    pthread_mutex_unlock(&H.mu);
    return reply_run(call);
}

/* "run=N caller=X verified=0|1": which run answered, and as whom it ran. */
static idem_code h_debit(idem_call *call, void *arg)
{
    char out[160];
    (void)arg;
    pthread_mutex_lock(&H.mu);
    snprintf(H.caller, sizeof(H.caller), "%s%s", idem_call_caller(call),
             idem_call_caller_verified(call) ? " (verified)" : "");
    pthread_mutex_unlock(&H.mu);
    int len =
        snprintf(out, sizeof(out), "run=%d caller=%s verified=%d", atomic_fetch_add(&H.runs, 1) + 1,
                 idem_call_caller(call), idem_call_caller_verified(call));
    return idem_call_reply(call, IDEM_OK, out, (size_t)len);
}

static idem_code h_gate(idem_call *call, void *arg)
{
    struct timespec until;
    (void)arg;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += BOUND_S;
    pthread_mutex_lock(&H.mu);
    while (!H.gate_open && pthread_cond_timedwait(&H.cv, &H.mu, &until) == 0) {
    }
    pthread_mutex_unlock(&H.mu);
    return reply_run(call);
}

/* First in the chain: counts the gated method's arrivals, duplicates included. */
static idem_code count_arrivals(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    if (strcmp(idem_call_method(call), "t.Gate/Do") == 0) {
        pthread_mutex_lock(&H.mu);
        H.arrivals++;
        pthread_cond_broadcast(&H.cv);
        pthread_mutex_unlock(&H.mu);
    }
    return idem_call_next(call, next);
}

static char *tls_dir;

static const idem_caller_secret secrets[] = {
    {.caller = "A", .secret = SECRET_A},
    {.caller = "B", .secret = SECRET_B},
};

typedef enum { UNSIGNED, SIGNED, SIGNED_REQUIRED } identity_kind;

/* tls: the gRPC listener over TLS, for the client certificate of tu_make_certs; kind: the
 * callers' secrets (SIGNED), and verified callers only (SIGNED_REQUIRED). */
static void serve_with(uint64_t max_run_ms, bool tls, identity_kind kind)
{
    if (system(PYTHON " -c 'import grpc' 2>/dev/null") != 0) {
        cr_skip_test("no python3-grpcio for " PYTHON);
    }
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.workers = 8; /* waiting duplicates hold workers (count_arrivals is before the cache) */
    o.max_run_ms = max_run_ms;
    o.store = tu_backend_open(&B, "grpc");
    if (kind != UNSIGNED) {
        o.caller_secrets = secrets;
        o.n_caller_secrets = IDEM_ARRAY_LEN(secrets);
    }
    o.require_verified_caller = kind == SIGNED_REQUIRED;
    H.arrivals = 0;
    H.caller[0] = '\0';
    H.gate_open = false;
    atomic_store(&H.runs, 0);
    tu_server_create(&S, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_use_first(S.srv, "count_arrivals", count_arrivals, NULL), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Count/Add", h_add, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Gate/Do", h_gate, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, DEBIT, h_debit, NULL, &cached), IDEM_OK);
    tu_server_listen(&S);
    char cert[512], ca[512];
    idem_tls_listener l = {.cert_key_file = cert, .client_ca_file = ca, .caller = "client-a"};
    if (tls) {
        tls_dir = tu_make_certs("grpc-tls");
        snprintf(cert, sizeof(cert), "%s/server.pem", tls_dir);
        snprintf(ca, sizeof(ca), "%s/cca.crt", tls_dir);
    }
    cr_assert_eq(tls ? idem_server_listen_grpc_tls(S.srv, "tcp://127.0.0.1:0", &l)
                     : idem_server_listen_grpc(S.srv, "tcp://127.0.0.1:0"),
                 IDEM_OK, "%s", idem_errmsg());
    port = idem_server_grpc_port(S.srv);
    cr_assert_gt(port, 0);
}

static void serve(void)
{
    serve_with(0, false, UNSIGNED);
}

static void serve_tls(void)
{
    serve_with(0, true, UNSIGNED);
}

static void serve_signed(void)
{
    serve_with(0, false, SIGNED);
}

static void serve_signed_required(void)
{
    serve_with(0, false, SIGNED_REQUIRED);
}

/* The server answers a call DEADLINE_EXCEEDED after 500 ms (max_run_ms). */
static void serve_bounded(void)
{
    serve_with(500, false, UNSIGNED);
}

static void teardown(void)
{
    pthread_mutex_lock(&H.mu);
    H.gate_open = true; /* a failed case must not leave a handler waiting */
    pthread_cond_broadcast(&H.cv);
    pthread_mutex_unlock(&H.mu);
    if (S.srv != NULL) {
        tu_server_destroy(&S, false);
    }
    if (B.st != NULL) {
        tu_backend_close(&B);
    }
    if (tls_dir != NULL) {
        tu_rmtree(tls_dir);
        tls_dir = NULL;
    }
}

TestSuite(grpc, .init = serve, .fini = teardown, .timeout = 60);
TestSuite(grpc_bounded, .init = serve_bounded, .fini = teardown, .timeout = 60);
TestSuite(grpc_tls, .init = serve_tls, .fini = teardown, .timeout = 60);
TestSuite(grpc_signed, .init = serve_signed, .fini = teardown, .timeout = 60);
TestSuite(grpc_signed_required, .init = serve_signed_required, .fini = teardown, .timeout = 60);

/* Runs the case; opens the gate once `arrivals` gated calls are in (0: never). Returns
 * the script's exit status. */
static int run_case(const char *name, int arrivals)
{
    char port_s[16];
    snprintf(port_s, sizeof(port_s), "%d", port);
    const char *script = getenv("GRPC_PY");
    cr_assert_not_null(script, "GRPC_PY (tests/meson.build) names tests/test_grpc.py");
    char ca[512] = "", key[512] = "", crt[512] = "";
    if (tls_dir != NULL) {
        snprintf(ca, sizeof(ca), "%s/sca.crt", tls_dir);
        snprintf(key, sizeof(key), "%s/client.key", tls_dir);
        snprintf(crt, sizeof(crt), "%s/client.crt", tls_dir);
    }
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        execl(PYTHON, PYTHON, script, name, port_s, ca, key, crt, (char *)NULL);
        _exit(127);
    }
    if (arrivals > 0) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += BOUND_S;
        pthread_mutex_lock(&H.mu);
        while (H.arrivals < arrivals && pthread_cond_timedwait(&H.cv, &H.mu, &until) == 0) {
        }
        cr_expect_geq(H.arrivals, arrivals, "the case's calls did not all arrive");
        H.gate_open = true;
        pthread_cond_broadcast(&H.cv);
        pthread_mutex_unlock(&H.mu);
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

Test(grpc, plain_call_answers_the_handlers_result)
{
    cr_assert_eq(run_case("plain", 0), 0);
    cr_expect_eq(atomic_load(&H.runs), 1);
}

Test(grpc, same_key_replays_the_first_result_marked_replayed)
{
    cr_assert_eq(run_case("replay", 0), 0);
    cr_expect_eq(atomic_load(&H.runs), 1);
}

Test(grpc, key_reused_with_another_request_is_invalid_argument)
{
    cr_assert_eq(run_case("key_reused", 0), 0);
    cr_expect_eq(atomic_load(&H.runs), 1);
}

Test(grpc, duplicate_waits_for_the_running_first_call)
{
    cr_assert_eq(run_case("duplicate_waits", 2), 0);
    cr_expect_eq(atomic_load(&H.runs), 1);
}

Test(grpc, two_channels_sending_the_same_call_run_it_once)
{
    cr_assert_eq(run_case("hedged", 2), 0);
    cr_expect_eq(atomic_load(&H.runs), 1);
}

Test(grpc, deadline_exceeded_then_a_retry_with_the_key_gets_the_first_result)
{
    cr_assert_eq(run_case("deadline", 2), 0);
    cr_expect_eq(atomic_load(&H.runs), 1);
}

Test(grpc, health_check_answers_serving)
{
    cr_assert_eq(run_case("health", 0), 0);
    cr_expect_eq(atomic_load(&H.runs), 0);
}

Test(grpc_bounded, retry_policy_after_a_server_timeout_runs_once_and_gets_the_first_result)
{
    cr_assert_eq(run_case("retry_policy", 2), 0);
    cr_expect_eq(atomic_load(&H.runs), 1);
}

Test(grpc_tls, a_client_certificate_over_alpn_h2_calls_as_the_listeners_caller)
{
    cr_assert_eq(run_case("tls", 0), 0);
    cr_expect_eq(atomic_load(&H.runs), 1);
    cr_expect_str_eq(H.caller, "client-a (verified)");
}

Test(grpc_tls, a_client_without_a_certificate_cannot_call)
{
    cr_assert_eq(run_case("tls_no_cert", 0), 0);
    cr_expect_eq(atomic_load(&H.runs), 0);
}

/* ---- signed calls (grpc_signed*: callers A and B have secrets) ---- */

/* One call of t.Pay/Debit for test_grpc.py's case "signed": its five arguments. */
typedef struct signed_call {
    char caller[8], key[32], sig[IDEM_SIGNATURE_HEX + 1], ts[24];
    const char *want;
} signed_call;

/* A call as caller under key (payload "5"), signed with secret at ts_ms (secret NULL:
 * unsigned); want: the answer test_grpc.py must see ("ok ANSWER", "replay ANSWER" or
 * "CODE part of the details"). */
static signed_call sign(const char *caller, const char *key, const char *secret, uint64_t ts_ms,
                        const char *want)
{
    signed_call c = {.want = want};
    idem_signed_fields f = {.caller = caller,
                            .method = DEBIT,
                            .key = key,
                            .payload = "5",
                            .payload_len = 1,
                            .timestamp_ms = ts_ms};
    snprintf(c.caller, sizeof(c.caller), "%s", caller);
    snprintf(c.key, sizeof(c.key), "%s", key);
    if (secret != NULL) {
        cr_assert(idem__signature(secret, &f, c.sig));
        snprintf(c.ts, sizeof(c.ts), "%llu", (unsigned long long)ts_ms);
    }
    return c;
}

/* Runs test_grpc.py's case "signed" with the calls, in order, on one channel. */
static int run_signed(const signed_call *calls, size_t n)
{
    char port_s[16];
    const char *argv[4 + 5 * 4 + 1] = {PYTHON, getenv("GRPC_PY"), "signed", port_s};
    size_t a = 4;
    cr_assert_not_null(argv[1], "GRPC_PY (tests/meson.build) names tests/test_grpc.py");
    cr_assert_leq(n, 4);
    snprintf(port_s, sizeof(port_s), "%d", port);
    for (size_t i = 0; i < n; i++) {
        const char *args[5] = {calls[i].caller, calls[i].key, calls[i].sig, calls[i].ts,
                               calls[i].want};
        memcpy(&argv[a], args, sizeof(args));
        a += 5;
    }
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        execv(PYTHON, (char *const *)argv);
        _exit(127);
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

Test(grpc_signed, a_call_signed_as_a_runs_as_a_verified_and_its_replay_is_a_s_record)
{
    uint64_t now = idem__now_ms();
    signed_call calls[] = {
        sign("A", "sig-1", SECRET_A, now, "ok run=1 caller=A verified=1"),
        sign("A", "sig-1", SECRET_A, now + 1, "replay run=1 caller=A verified=1"),
        /* B under A's key runs in its own scope: A's record is not B's */
        sign("B", "sig-1", SECRET_B, now, "ok run=2 caller=B verified=1"),
        sign("A", "sig-1", SECRET_A, now + 2, "replay run=1 caller=A verified=1"),
    };
    cr_assert_eq(run_signed(calls, IDEM_ARRAY_LEN(calls)), 0);
    cr_expect_eq(atomic_load(&H.runs), 2);
    cr_expect_str_eq(H.caller, "B (verified)");
}

Test(grpc_signed, a_call_claiming_a_signed_with_b_s_secret_is_unauthenticated)
{
    signed_call c = sign("A", "sig-2", SECRET_B, idem__now_ms(),
                         "UNAUTHENTICATED idem-signature does not match the request");
    cr_assert_eq(run_signed(&c, 1), 0);
    cr_expect_eq(atomic_load(&H.runs), 0);
}

Test(grpc_signed, a_stale_timestamp_is_unauthenticated)
{
    signed_call c = sign("A", "sig-3", SECRET_A, idem__now_ms() - 6 * 60 * 1000,
                         "UNAUTHENTICATED ms in the past");
    cr_assert_eq(run_signed(&c, 1), 0);
    cr_expect_eq(atomic_load(&H.runs), 0);
}

Test(grpc_signed_required, an_unsigned_call_is_unauthenticated_and_a_signed_one_runs)
{
    signed_call calls[] = {
        sign("A", "sig-4", NULL, 0, "UNAUTHENTICATED verified callers only"),
        sign("nobody", "sig-4", NULL, 0, "UNAUTHENTICATED verified callers only"),
        sign("A", "sig-4", SECRET_A, idem__now_ms(), "ok run=1 caller=A verified=1"),
    };
    cr_assert_eq(run_signed(calls, IDEM_ARRAY_LEN(calls)), 0);
    cr_expect_eq(atomic_load(&H.runs), 1);
    cr_expect_str_eq(H.caller, "A (verified)");
}
