/* Integration: the gRPC front through a client nobody here wrote, Debian's
 * python3-grpcio (tests/test_grpc.py, one case per test). A real server on
 * tcp://127.0.0.1:<free port> with a counting method (t.Count/Add) and a gated one
 * (t.Gate/Do: its handler waits until the test opens the gate, once the calls the case
 * sends have all arrived); every test asserts how often a handler ran. Skipped when
 * /usr/bin/python3 cannot import grpc. The store is the one $IDEMRPC_TEST_BACKEND names
 * (tu_backend_open): `grpc` runs on LMDB, `grpc_pg` on PostgreSQL. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

#define PYTHON "/usr/bin/python3"
#define BOUND_S 30 /* a bound on every wait, never a synchronisation */

static tu_server S;
static tu_backend B;
static int port;
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrivals; /* calls of t.Gate/Do that entered the chain */
    bool gate_open;
    atomic_int runs;
    char caller[64]; /* of the last t.Count/Add run */
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

/* A CA, a server certificate for localhost signed by it (server.pem), and a client CA
 * with one client's certificate (client.crt, client.key): made with openssl for every
 * run, nothing committed can expire. */
static void make_certs(void)
{
    char cmd[4096];
#define KEYGEN "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
    tls_dir = tu_tempdir("grpc-tls");
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && (" KEYGEN
             "-x509 -days 2 -keyout sca.key -out sca.crt -subj /CN=sca && " KEYGEN
             "-x509 -days 2 -keyout cca.key -out cca.crt -subj /CN=cca && " KEYGEN
             "-keyout server.key -out server.csr -subj /CN=localhost && "
             "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext && "
             "openssl x509 -req -days 2 -in server.csr -CA sca.crt -CAkey sca.key "
             "-CAcreateserial -extfile san.ext -out server.crt && "
             "cat server.crt server.key > server.pem && " KEYGEN
             "-keyout client.key -out client.csr -subj /CN=client-a && "
             "openssl x509 -req -days 2 -in client.csr -CA cca.crt -CAkey cca.key "
             "-CAcreateserial -out client.crt) >/dev/null 2>&1",
             tls_dir);
    cr_assert_eq(system(cmd), 0, "openssl: %s", cmd);
}

/* tls: the gRPC listener over TLS, for the client certificate of make_certs. */
static void serve_with(uint64_t max_run_ms, bool tls)
{
    if (system(PYTHON " -c 'import grpc' 2>/dev/null") != 0) {
        cr_skip_test("no python3-grpcio for " PYTHON);
    }
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.workers = 8; /* waiting duplicates hold workers (count_arrivals is before the cache) */
    o.max_run_ms = max_run_ms;
    o.store = tu_backend_open(&B, "grpc");
    H.arrivals = 0;
    H.gate_open = false;
    atomic_store(&H.runs, 0);
    tu_server_create(&S, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_use_first(S.srv, "count_arrivals", count_arrivals, NULL), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Count/Add", h_add, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Gate/Do", h_gate, NULL, &cached), IDEM_OK);
    tu_server_listen(&S);
    char cert[512], ca[512];
    idem_tls_listener l = {.cert_key_file = cert, .client_ca_file = ca, .caller = "client-a"};
    if (tls) {
        make_certs();
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
    serve_with(0, false);
}

static void serve_tls(void)
{
    serve_with(0, true);
}

/* The server answers a call DEADLINE_EXCEEDED after 500 ms (max_run_ms). */
static void serve_bounded(void)
{
    serve_with(500, false);
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
