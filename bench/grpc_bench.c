/* idemrpc-grpc-bench: the gRPC front's cost, as ratios to a bare nng echo measured in
 * the same run (docs/performance.md "gRPC front").
 *
 * One process: a bare nng rep0 echo on tcp (a thread answering with blocking
 * recv/send, no idemrpc code) and an idemrpc server (LMDB store in a temporary
 * directory, durable commits) serving gRPC (h2c) on 127.0.0.1. One client at a time
 * makes sequential unary calls for --seconds each:
 *   nng echo        req0 blocking send/recv against the bare echo: the baseline
 *   grpc echo       a plain method (no key, no store): HTTP/2 + the front + dispatch
 *   grpc replay     a cached method, 100 keys called once before: stored answers
 *   grpc new key    a cached method, a fresh key per call: claim, run, durable record
 * The gRPC client writes frames itself on a blocking socket (one connection, header
 * blocks from nghttp2's HPACK encoder, its receive windows opened wide) and reads
 * frames until the trailers (END_STREAM): an answer without DATA counts as an error.
 *   idemrpc-grpc-bench [--seconds S] [--payload BYTES] */
#include <arpa/inet.h>
#include <ftw.h>
#include <getopt.h>
#include <nghttp2/nghttp2.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>

#define MAX_SAMPLES (1 << 22)
#define NV(n, v, vl)                                                                               \
    {                                                                                              \
        (uint8_t *)(n), (uint8_t *)(v), strlen(n), (vl), NGHTTP2_NV_FLAG_NONE                      \
    }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

typedef struct result {
    double rate, p50_us;
    unsigned long calls, errors;
} result;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Runs call(arg, i) for `seconds`; its rate and median latency. */
static result measure(bool (*call)(void *arg, unsigned long i), void *arg, double seconds)
{
    static double lat[MAX_SAMPLES];
    result r = {0};
    double start = now_s(), t = start;
    for (; t - start < seconds && r.calls < MAX_SAMPLES; r.calls++) {
        double t0 = t;
        r.errors += !call(arg, r.calls);
        t = now_s();
        lat[r.calls] = (t - t0) * 1e6;
    }
    qsort(lat, r.calls, sizeof(lat[0]), cmp_double);
    r.rate = (double)r.calls / (t - start);
    r.p50_us = r.calls > 0 ? lat[r.calls / 2] : 0;
    return r;
}

/* ---- the bare nng echo ---- */

static void *echo_thread(void *arg)
{
    nng_socket *s = arg;
    nng_msg *m;
    while (nng_recvmsg(*s, &m, 0) == 0) {
        if (nng_sendmsg(*s, m, 0) != 0) {
            nng_msg_free(m);
        }
    }
    return NULL;
}

typedef struct nng_client {
    nng_socket s;
    const void *payload;
    size_t len;
} nng_client;

static bool nng_call(void *arg, unsigned long i)
{
    nng_client *c = arg;
    void *buf;
    size_t n;
    (void)i;
    if (nng_send(c->s, (void *)c->payload, c->len, 0) != 0 ||
        nng_recv(c->s, &buf, &n, NNG_FLAG_ALLOC) != 0) {
        return false;
    }
    nng_free(buf, n);
    return n == c->len;
}

/* ---- a minimal gRPC client on raw frames ---- */

typedef struct grpc_client {
    int fd;
    uint32_t sid;
    nghttp2_hd_deflater *d;
    const char *path;
    const uint8_t *msg; /* framed */
    size_t msg_len;
    const char *key_fmt; /* NULL: no key; else with the call's number (new key) or % 100 */
    unsigned long key_mod;
    uint8_t buf[1 << 16];
} grpc_client;

static bool send_all(int fd, const void *p, size_t n)
{
    for (size_t off = 0; off < n;) {
        ssize_t k = send(fd, (const char *)p + off, n - off, MSG_NOSIGNAL);
        if (k <= 0) {
            return false;
        }
        off += (size_t)k;
    }
    return true;
}

static bool frame(int fd, uint8_t type, uint8_t flags, uint32_t sid, const void *p, size_t len)
{
    uint8_t h[9] = {
        (uint8_t)(len >> 16), (uint8_t)(len >> 8),  (uint8_t)len,        type,        flags,
        (uint8_t)(sid >> 24), (uint8_t)(sid >> 16), (uint8_t)(sid >> 8), (uint8_t)sid};
    return send_all(fd, h, 9) && (len == 0 || send_all(fd, p, len));
}

/* Reads frames until stream sid ends; true when it carried DATA. */
static bool await_answer(grpc_client *c, uint32_t sid)
{
    bool data = false;
    for (;;) {
        uint8_t h[9];
        if (recv(c->fd, h, 9, MSG_WAITALL) != 9) {
            return false;
        }
        size_t len = ((size_t)h[0] << 16) | ((size_t)h[1] << 8) | h[2];
        uint32_t id =
            ((uint32_t)(h[5] & 0x7f) << 24) | ((uint32_t)h[6] << 16) | ((uint32_t)h[7] << 8) | h[8];
        if (len > sizeof(c->buf) ||
            (len > 0 && recv(c->fd, c->buf, len, MSG_WAITALL) != (ssize_t)len)) {
            return false;
        }
        if (h[3] == NGHTTP2_SETTINGS && !(h[4] & NGHTTP2_FLAG_ACK) &&
            !frame(c->fd, NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, NULL, 0)) {
            return false;
        }
        data = data || (h[3] == NGHTTP2_DATA && id == sid);
        if (id == sid && (h[3] == NGHTTP2_RST_STREAM ||
                          (h[3] == NGHTTP2_HEADERS && (h[4] & NGHTTP2_FLAG_END_STREAM)))) {
            return data && h[3] == NGHTTP2_HEADERS;
        }
    }
}

static bool grpc_call(void *arg, unsigned long i)
{
    grpc_client *c = arg;
    char key[64];
    snprintf(key, sizeof(key), c->key_fmt != NULL ? c->key_fmt : "",
             c->key_mod ? i % c->key_mod : i);
    nghttp2_nv nv[] = {NV(":method", "POST", 4),
                       NV(":scheme", "http", 4),
                       NV(":path", c->path, strlen(c->path)),
                       NV(":authority", "bench", 5),
                       NV("content-type", "application/grpc", 16),
                       NV("te", "trailers", 8),
                       NV("idempotency-key", key, strlen(key))};
    size_t n_nv = c->key_fmt != NULL ? 7 : 6;
    ssize_t hl = nghttp2_hd_deflate_hd(c->d, c->buf, sizeof(c->buf), nv, n_nv);
    uint32_t sid = c->sid;
    c->sid += 2;
    return hl > 0 &&
           frame(c->fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, sid, c->buf, (size_t)hl) &&
           frame(c->fd, NGHTTP2_DATA, NGHTTP2_FLAG_END_STREAM, sid, c->msg, c->msg_len) &&
           await_answer(c, sid);
}

/* One connection: the preface, SETTINGS with the widest stream window, and the widest
 * connection window (the answers never wait for a WINDOW_UPDATE). */
static bool grpc_connect(grpc_client *c, int port)
{
    static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const uint8_t settings[6] = {0, NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 0x7f, 0xff, 0xff, 0xff};
    const uint32_t inc = 0x7fffffff - 65535;
    const uint8_t wu[4] = {(uint8_t)(inc >> 24), (uint8_t)(inc >> 16), (uint8_t)(inc >> 8),
                           (uint8_t)inc};
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    int one = 1;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    c->sid = 1;
    return c->fd >= 0 && connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
           setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) == 0 &&
           nghttp2_hd_deflate_new(&c->d, 4096) == 0 &&
           send_all(c->fd, preface, sizeof(preface) - 1) &&
           frame(c->fd, NGHTTP2_SETTINGS, 0, 0, settings, sizeof(settings)) &&
           frame(c->fd, NGHTTP2_WINDOW_UPDATE, 0, 0, wu, sizeof(wu));
}

/* ---- the idemrpc server ---- */

static idem_code h_echo(idem_call *call, void *arg)
{
    size_t n;
    const void *p = idem_call_payload(call, &n);
    (void)arg;
    return idem_call_reply(call, IDEM_OK, p, n);
}

static idem_server *serve(const char *dir, int *port)
{
    idem_server_opts o;
    idem_server *srv;
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    idem_server_opts_init(&o);
    o.db_path = dir;
    if (idem_server_create(&srv, &o) != IDEM_OK ||
        idem_server_register(srv, "bench.Echo/Plain", h_echo, NULL, NULL) != IDEM_OK ||
        idem_server_register(srv, "bench.Echo/Echo", h_echo, NULL, &cached) != IDEM_OK ||
        idem_server_listen_grpc(srv, "tcp://127.0.0.1:0") != IDEM_OK) {
        fprintf(stderr, "idemrpc-grpc-bench: %s\n", idem_errmsg());
        exit(1);
    }
    *port = idem_server_grpc_port(srv);
    return srv;
}

static int rm_entry(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)type;
    (void)ftw;
    return remove(path);
}

static void usage(FILE *f)
{
    fputs("usage: idemrpc-grpc-bench [--seconds S (0.1..600, default 2)] [--payload BYTES "
          "(1..65536, default 64)]\n"
          "  The gRPC front (echo, replay, new key) as ratios to a bare nng echo, one client.\n",
          f);
}

/* The options into *seconds and *payload; exits 2 (naming what was wrong) on a bad one. */
static void parse(int argc, char **argv, double *seconds, size_t *payload)
{
    static const struct option longs[] = {{"seconds", required_argument, NULL, 's'},
                                          {"payload", required_argument, NULL, 'p'},
                                          {"help", no_argument, NULL, 'h'},
                                          {NULL, 0, NULL, 0}};
    int opt;
    while ((opt = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        char *end = NULL;
        double v = opt == 's' || opt == 'p' ? strtod(optarg, &end) : 0;
        if (opt == 's' && v >= 0.1 && v <= 600 && *end == '\0') {
            *seconds = v;
        } else if (opt == 'p' && v >= 1 && v <= 65536 && v == (size_t)v && *end == '\0') {
            *payload = (size_t)v;
        } else {
            if (opt == 's' || opt == 'p') {
                fprintf(stderr, "idemrpc-grpc-bench: --%s: out of range or not a number\n",
                        opt == 's' ? "seconds" : "payload");
            }
            usage(opt == 'h' ? stdout : stderr);
            exit(opt == 'h' ? 0 : 2);
        }
    }
    if (optind < argc) {
        fprintf(stderr, "idemrpc-grpc-bench: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        exit(2);
    }
}

static result bare_echo(const uint8_t *payload, size_t len, double seconds)
{
    nng_socket rep, req;
    nng_listener l;
    pthread_t t;
    int port;
    char url[64];
    nng_client c = {.payload = payload, .len = len};
    if (nng_rep0_open(&rep) != 0 || nng_listener_create(&l, rep, "tcp://127.0.0.1:0") != 0 ||
        nng_listener_start(l, 0) != 0 ||
        nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port) != 0 || nng_req0_open(&c.s) != 0) {
        fputs("idemrpc-grpc-bench: the bare echo did not start\n", stderr);
        exit(1);
    }
    snprintf(url, sizeof(url), "tcp://127.0.0.1:%d", port);
    req = c.s;
    if (nng_dial(req, url, NULL, 0) != 0 || pthread_create(&t, NULL, echo_thread, &rep) != 0) {
        fputs("idemrpc-grpc-bench: the bare echo did not connect\n", stderr);
        exit(1);
    }
    result r = measure(nng_call, &c, seconds);
    nng_close(req);
    nng_close(rep); /* its thread's receive fails: the thread ends */
    pthread_join(t, NULL);
    return r;
}

static result grpc_row(int port, const char *path, const char *key_fmt, unsigned long key_mod,
                       const uint8_t *msg, size_t len, double seconds)
{
    static grpc_client c;
    memset(&c, 0, sizeof(c));
    c.path = path;
    c.key_fmt = key_fmt;
    c.key_mod = key_mod;
    c.msg = msg;
    c.msg_len = len;
    if (!grpc_connect(&c, port)) {
        fputs("idemrpc-grpc-bench: cannot connect to the gRPC front\n", stderr);
        exit(1);
    }
    for (unsigned long i = 0; key_mod != 0 && i < key_mod; i++) {
        (void)grpc_call(&c, i); /* replay: every key stored before the start */
    }
    result r = measure(grpc_call, &c, seconds);
    nghttp2_hd_deflate_del(c.d);
    close(c.fd);
    return r;
}

int main(int argc, char **argv)
{
    double seconds = 2;
    size_t payload = 64;
    char dir[] = "/tmp/idemrpc-grpc-bench-XXXXXX", fmt[32];
    int port;
    parse(argc, argv, &seconds, &payload);
    uint8_t *msg = calloc(1, 5 + payload);
    if (msg == NULL || mkdtemp(dir) == NULL) {
        perror("idemrpc-grpc-bench");
        return 1;
    }
    for (int i = 0; i < 4; i++) {
        msg[1 + i] = (uint8_t)(payload >> (24 - 8 * i));
    }
    memset(msg + 5, 'x', payload);
    result rows[4];
    rows[0] = bare_echo(msg + 5, payload, seconds);
    idem_server *srv = serve(dir, &port);
    snprintf(fmt, sizeof(fmt), "new-%d-%%lu", (int)getpid());
    rows[1] = grpc_row(port, "/bench.Echo/Plain", NULL, 0, msg, 5 + payload, seconds);
    rows[2] = grpc_row(port, "/bench.Echo/Echo", "replay-%lu", 100, msg, 5 + payload, seconds);
    rows[3] = grpc_row(port, "/bench.Echo/Echo", fmt, 0, msg, 5 + payload, seconds);
    idem_server_destroy(srv);
    nftw(dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    free(msg);
    static const char *const names[] = {"nng echo (bare)", "grpc echo", "grpc replay",
                                        "grpc new key"};
    printf("%-16s %10s %9s %8s %7s  (1 client, %zu B, %.1f s each)\n", "scenario", "calls/s",
           "p50_us", "vs_bare", "errors", payload, seconds);
    for (int i = 0; i < 4; i++) {
        printf("%-16s %10.0f %9.1f %8.3f %7lu\n", names[i], rows[i].rate, rows[i].p50_us,
               rows[i].rate / rows[0].rate, rows[i].errors);
    }
    return 0;
}
