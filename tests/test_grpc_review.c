/* Integration: a stranger's review of the gRPC front (r7-revgrpc). Each case is a promise
 * of docs/deploying.md "gRPC" that the front broke when it was merged (2e4b593), driven
 * through python3-grpcio (tests/test_grpc_review.py) or raw HTTP/2 frames. The server
 * listens on tcp://127.0.0.1:$REVIEW_GRPC_PORT (0, a free port, when unset). Skipped when
 * /usr/bin/python3 cannot import grpc. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <nghttp2/nghttp2.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

#define PYTHON "/usr/bin/python3"
#define MAX_FRAME 65536
#define REQ_TIMEOUT_MS 500
#define MAX_RUN_MS 60000 /* the answer's bound: far longer than the request timeout */
#define BOUND_S 20

static tu_server S;
static int port;
static char *tls_dir;
static atomic_int runs, arrivals;
static atomic_bool gate_open;

/* Payload "CODE|name=value|...": sets each metadata entry, then answers CODE. */
static idem_code h_meta(idem_call *call, void *arg)
{
    char buf[1024], *save, *tok;
    size_t n;
    const char *p = idem_call_payload(call, &n);
    (void)arg;
    atomic_fetch_add(&runs, 1);
    snprintf(buf, sizeof(buf), "%.*s", (int)n, p);
    idem_code code = (idem_code)atoi(strtok_r(buf, "|", &save));
    while ((tok = strtok_r(NULL, "|", &save)) != NULL) {
        char *eq = strchr(tok, '=');
        if (eq != NULL) {
            *eq = '\0';
            cr_expect_eq(idem_call_set_response_metadata(call, tok, eq + 1), IDEM_OK);
        }
    }
    return code == IDEM_OK ? idem_call_reply(call, IDEM_OK, "fine", 4)
                           : idem_call_fail(call, code, "the handler failed");
}

static idem_code h_gate(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&arrivals, 1);
    for (int i = 0; i < 100 * BOUND_S && !atomic_load(&gate_open); i++) {
        usleep(10000); /* the gate: polled, bounded */
    }
    atomic_fetch_add(&runs, 1);
    return idem_call_reply(call, IDEM_OK, "ok", 2);
}

static idem_code h_len(idem_call *call, void *arg)
{
    char out[32];
    size_t n;
    (void)arg;
    (void)idem_call_payload(call, &n);
    atomic_fetch_add(&runs, 1);
    int len = snprintf(out, sizeof(out), "len=%zu", n);
    return idem_call_reply(call, IDEM_OK, out, (size_t)len);
}

static void serve_with(bool tls)
{
    if (system(PYTHON " -c 'import grpc' 2>/dev/null") != 0) {
        cr_skip_test("no python3-grpcio for " PYTHON);
    }
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.workers = 4;
    o.max_frame = MAX_FRAME;
    o.max_run_ms = MAX_RUN_MS;
    o.grpc_request_timeout_ms = REQ_TIMEOUT_MS;
    atomic_store(&runs, 0);
    atomic_store(&arrivals, 0);
    atomic_store(&gate_open, true);
    tu_server_create(&S, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED};
    cr_assert_eq(idem_server_register(S.srv, "t.Meta/Set", h_meta, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Gate/Do", h_gate, NULL, &cached), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "t.Len/Get", h_len, NULL, &cached), IDEM_OK);
    char url[64], cert[512], ca[512];
    snprintf(url, sizeof(url), "tcp://127.0.0.1:%s",
             getenv("REVIEW_GRPC_PORT") != NULL ? getenv("REVIEW_GRPC_PORT") : "0");
    idem_tls_listener l = {.cert_key_file = cert, .client_ca_file = ca, .caller = "client-a"};
    if (tls) {
        tls_dir = tu_make_certs("grpc-review-tls");
        snprintf(cert, sizeof(cert), "%s/server.pem", tls_dir);
        snprintf(ca, sizeof(ca), "%s/cca.crt", tls_dir);
    }
    cr_assert_eq(tls ? idem_server_listen_grpc_tls(S.srv, url, &l)
                     : idem_server_listen_grpc(S.srv, url),
                 IDEM_OK, "%s", idem_errmsg());
    port = idem_server_grpc_port(S.srv);
}

static void serve(void)
{
    serve_with(false);
}

static void serve_tls(void)
{
    serve_with(true);
}

static void teardown(void)
{
    atomic_store(&gate_open, true);
    if (S.srv != NULL) {
        tu_server_destroy(&S, false);
    }
    if (tls_dir != NULL) {
        tu_rmtree(tls_dir);
        tls_dir = NULL;
    }
}

TestSuite(grpc_review, .init = serve, .fini = teardown, .timeout = 60);
TestSuite(grpc_review_tls, .init = serve_tls, .fini = teardown, .timeout = 60);

static pid_t start_case(const char *name)
{
    char port_s[16], max_frame[16];
    snprintf(port_s, sizeof(port_s), "%d", port);
    snprintf(max_frame, sizeof(max_frame), "%d", MAX_FRAME);
    const char *script = getenv("GRPC_REVIEW_PY");
    cr_assert_not_null(script, "GRPC_REVIEW_PY (tests/meson.build) names test_grpc_review.py");
    setenv("MAX_FRAME", max_frame, 1); /* before the fork: setenv allocates (testutil.h) */
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        execl(PYTHON, PYTHON, script, name, port_s, tls_dir != NULL ? tls_dir : "", (char *)NULL);
        _exit(127);
    }
    return pid;
}

static int end_case(pid_t pid)
{
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int run_case(const char *name)
{
    return end_case(start_case(name));
}

/* ---- the answer's metadata ---- */

Test(grpc_review, a_handlers_grpc_status_metadata_does_not_change_the_calls_status)
{
    cr_expect_eq(run_case("meta_status"), 0);
}

Test(grpc_review, a_handlers_metadata_does_not_mark_a_first_run_replayed)
{
    cr_expect_eq(run_case("meta_replayed"), 0);
}

Test(grpc_review, a_handlers_mixed_case_metadata_reaches_the_client)
{
    cr_expect_eq(run_case("meta_case"), 0);
}

Test(grpc_review, a_handlers_bin_metadata_does_not_break_the_answer)
{
    cr_expect_eq(run_case("meta_bin"), 0);
}

/* ---- a closing server ---- */

static void *destroy_server(void *arg)
{
    (void)arg;
    tu_server_destroy(&S, false);
    return NULL;
}

Test(grpc_review, health_check_is_not_serving_while_the_server_closes)
{
    atomic_store(&gate_open, false);
    pid_t pid = start_case("health_closing");
    for (int i = 0; i < 100 * BOUND_S && atomic_load(&arrivals) == 0; i++) {
        usleep(10000);
    }
    cr_assert_eq(atomic_load(&arrivals), 1, "the held call did not arrive");
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, destroy_server, NULL), 0);
    int rc = end_case(pid); /* the handler holds the workers' stop until the gate opens */
    atomic_store(&gate_open, true);
    cr_assert_eq(pthread_join(t, NULL), 0);
    cr_expect_eq(rc, 0);
}

/* ---- bounds ---- */

Test(grpc_review, a_message_of_max_frame_bytes_is_taken)
{
    cr_expect_eq(run_case("max_frame"), 0);
}

static void frame(int fd, uint8_t type, uint8_t flags, uint32_t sid, const void *p, size_t len)
{
    uint8_t h[9] = {
        (uint8_t)(len >> 16), (uint8_t)(len >> 8),  (uint8_t)len,        type,        flags,
        (uint8_t)(sid >> 24), (uint8_t)(sid >> 16), (uint8_t)(sid >> 8), (uint8_t)sid};
    cr_assert_eq(send(fd, h, 9, MSG_NOSIGNAL), 9);
    cr_assert_eq(send(fd, p, len, MSG_NOSIGNAL), (ssize_t)len);
}

static double mono_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

#define NV(n, v)                                                                                   \
    {                                                                                              \
        (uint8_t *)(n), (uint8_t *)(v), strlen(n), strlen(v), NGHTTP2_NV_FLAG_NONE                 \
    }

/* A client whose window is 0 never takes its answer's DATA: the stream must be reset once
 * grpc_request_timeout_ms passes after the answer ("an answer's sending: RST_STREAM"),
 * not once the answer's own bound (max_run_ms) would have. */
Test(grpc_review, an_answer_the_client_never_takes_is_reset_after_the_request_timeout)
{
    static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    static const uint8_t window0[6] = {0, NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 0, 0, 0, 0};
    static const uint8_t msg[] = {0, 0, 0, 0, 1, '5'};
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {BOUND_S, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    cr_assert_eq(send(fd, preface, sizeof(preface) - 1, MSG_NOSIGNAL), sizeof(preface) - 1);
    frame(fd, NGHTTP2_SETTINGS, 0, 0, window0, sizeof(window0));
    nghttp2_hd_deflater *d;
    cr_assert_eq(nghttp2_hd_deflate_new(&d, 4096), 0);
    nghttp2_nv nv[] = {NV(":method", "POST"),
                       NV(":scheme", "http"),
                       NV(":path", "/t.Len/Get"),
                       NV(":authority", "x"),
                       NV("content-type", "application/grpc"),
                       NV("te", "trailers"),
                       NV("idempotency-key", "window-0")};
    uint8_t hb[512], h[9], buf[1 << 14];
    ssize_t n = nghttp2_hd_deflate_hd(d, hb, sizeof(hb), nv, sizeof(nv) / sizeof(nv[0]));
    cr_assert_gt(n, 0);
    frame(fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, hb, (size_t)n);
    frame(fd, NGHTTP2_DATA, NGHTTP2_FLAG_END_STREAM, 1, msg, sizeof(msg));
    double start = mono_s(), reset_after = -1;
    while (reset_after < 0 && recv(fd, h, 9, MSG_WAITALL) == 9) {
        size_t len = ((size_t)h[0] << 16) | ((size_t)h[1] << 8) | h[2];
        cr_assert_leq(len, sizeof(buf));
        cr_assert(len == 0 || recv(fd, buf, len, MSG_WAITALL) == (ssize_t)len);
        if (h[3] == NGHTTP2_SETTINGS && !(h[4] & NGHTTP2_FLAG_ACK)) {
            frame(fd, NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, NULL, 0);
        }
        if (h[3] == NGHTTP2_RST_STREAM && h[8] == 1) {
            reset_after = mono_s() - start;
        }
    }
    nghttp2_hd_deflate_del(d);
    close(fd);
    cr_expect_eq(atomic_load(&runs), 1);
    cr_expect(reset_after >= 0 && reset_after < 4.0 * REQ_TIMEOUT_MS / 1000,
              "the untaken answer's stream was reset after %.2f s (-1: not within %d s); "
              "grpc_request_timeout_ms is %d ms",
              reset_after, BOUND_S, REQ_TIMEOUT_MS);
}

/* ---- TLS ---- */

Test(grpc_review_tls, a_client_offering_no_alpn_is_not_served)
{
    cr_expect_eq(run_case("no_alpn"), 0);
    cr_expect_eq(atomic_load(&runs), 0);
}
