/* Slow, silent and resetting HTTP/2 clients against one server's gRPC front
 * (chaos_faults.h), framed by libnghttp2's client session. For 5-8 s, on connections of
 * their own:
 *   trickle  GRPC_STREAMS calls of chaos.Counter/Add whose message (a length prefix
 *            announcing MSG_LEN bytes) comes one byte a DATA frame every TRICKLE_MS:
 *            the front resets each (RST_STREAM) once CHAOS_GRPC_REQUEST_TIMEOUT_MS passed
 *            since its HEADERS, and nothing runs;
 *   nodata   GRPC_STREAMS calls that send their HEADERS and never any DATA: the same;
 *   reset    every RESET_MS a call that sends its HEADERS and half its message, then
 *            RST_STREAM CANCEL (a client giving up mid-call): nothing runs, nothing held.
 * Then, with the slow streams still open, an ordinary client asks
 * grpc.health.v1.Health/Check. The fault's end records, per slow kind, the longest time
 * a stream was held (from its HEADERS until the server reset or closed it, or until the
 * fault ended) and how many were still open, the resets sent, and whether the health
 * check was answered SERVING (grpc-status 0): the checker wants no slow stream still
 * open (at least 5 s after its HEADERS, five request timeouts) and the check answered.
 * The calls carry keys no workload op has, and none is ever complete: no effect. */
#include <errno.h>
#include <inttypes.h>
#include <nghttp2/nghttp2.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "chaos_faults.h"

#define GRPC_STREAMS 3
#define TRICKLE_MS 10
#define RESET_MS 200
#define PROBE_MS 5000
#define MSG_LEN 4000 /* announced by the trickled message: never all sent in 8 s */

enum { TRICKLE, NODATA, RESET, PROBE, N_CONNS };

typedef struct h2_stream {
    int32_t id;
    uint64_t from, held;
    bool open;
} h2_stream;

typedef struct h2_conn {
    int fd;
    int kind;
    nghttp2_session *s;
    h2_stream st[GRPC_STREAMS];
    size_t n;        /* streams opened */
    uint64_t resets; /* RESET: calls reset */
    bool sent;       /* TRICKLE: a byte went out in this round */
    char status[8];  /* PROBE: the grpc-status received */
} h2_conn;

static const uint8_t half_msg[] = {0, 0, 0, 0, 100, 'h', 'a', 'l', 'f'};

static ssize_t on_send(nghttp2_session *s, const uint8_t *data, size_t len, int flags, void *u)
{
    h2_conn *c = u;
    (void)s;
    (void)flags;
    ssize_t n = send(c->fd, data, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return NGHTTP2_ERR_WOULDBLOCK;
    }
    return n < 0 ? NGHTTP2_ERR_CALLBACK_FAILURE : n;
}

static h2_stream *stream_of(h2_conn *c, int32_t id)
{
    for (size_t k = 0; k < c->n; k++) {
        if (c->st[k].id == id) {
            return &c->st[k];
        }
    }
    return NULL;
}

static int on_close(nghttp2_session *s, int32_t id, uint32_t err, void *u)
{
    h2_stream *st = stream_of(u, id);
    (void)s;
    (void)err;
    if (st != NULL && st->open) {
        st->open = false;
        st->held = chaos_now_ms() - st->from;
    }
    return 0;
}

static int on_header(nghttp2_session *s, const nghttp2_frame *f, const uint8_t *name, size_t nlen,
                     const uint8_t *value, size_t vlen, uint8_t flags, void *u)
{
    h2_conn *c = u;
    (void)s;
    (void)f;
    (void)flags;
    if (nlen == 11 && memcmp(name, "grpc-status", 11) == 0) {
        snprintf(c->status, sizeof(c->status), "%.*s", (int)(vlen < 7 ? vlen : 7), value);
    }
    return 0;
}

/* The message source: TRICKLE gives one byte a round (the length prefix, then 'x'),
 * NODATA never a byte, RESET half a message, PROBE an empty message. */
static ssize_t on_read(nghttp2_session *s, int32_t id, uint8_t *buf, size_t len, uint32_t *flags,
                       nghttp2_data_source *src, void *u)
{
    static const uint8_t prefix[5] = {0, 0, 0, MSG_LEN >> 8, MSG_LEN & 0xff};
    h2_conn *c = u;
    size_t *off = src->ptr;
    (void)s;
    (void)id;
    if (c->kind == PROBE) {
        memset(buf, 0, 5);
        *flags |= NGHTTP2_DATA_FLAG_EOF;
        return 5;
    }
    if (c->kind == RESET && *off == 0 && len >= sizeof(half_msg)) {
        memcpy(buf, half_msg, sizeof(half_msg));
        *off = sizeof(half_msg);
        return (ssize_t)sizeof(half_msg);
    }
    if (c->kind != TRICKLE || c->sent || len == 0) {
        return NGHTTP2_ERR_DEFERRED;
    }
    buf[0] = *off < sizeof(prefix) ? prefix[*off] : 'x';
    (*off)++;
    c->sent = true;
    return 1;
}

static bool conn_open(h2_conn *c, int kind, int port)
{
    nghttp2_session_callbacks *cb;
    memset(c, 0, sizeof(*c));
    c->kind = kind;
    if ((c->fd = chaos_connect_local(port)) < 0 || nghttp2_session_callbacks_new(&cb) != 0) {
        return false;
    }
    nghttp2_session_callbacks_set_send_callback(cb, on_send);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, on_close);
    nghttp2_session_callbacks_set_on_header_callback(cb, on_header);
    int rv = nghttp2_session_client_new(&c->s, cb, c);
    nghttp2_session_callbacks_del(cb);
    return rv == 0 && nghttp2_submit_settings(c->s, NGHTTP2_FLAG_NONE, NULL, 0) == 0;
}

static void conn_close(h2_conn *c)
{
    nghttp2_session_del(c->s);
    if (c->fd >= 0) {
        close(c->fd);
    }
    c->s = NULL;
    c->fd = -1;
}

#define NV(n, v)                                                                                   \
    {                                                                                              \
        (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, strlen(v), NGHTTP2_NV_FLAG_NONE             \
    }

/* Opens a call of path; its stream is tracked unless track is false. off: the message's
 * progress, which must outlive the stream. */
static int32_t call_open(h2_conn *c, const char *path, const char *key, size_t *off, bool track)
{
    nghttp2_nv nv[] = {NV(":method", "POST"),
                       NV(":scheme", "http"),
                       NV(":authority", "chaos"),
                       NV(":path", path),
                       NV("content-type", "application/grpc"),
                       NV("te", "trailers"),
                       NV("idempotency-key", key)};
    nghttp2_data_provider body = {.source.ptr = off, .read_callback = on_read};
    int32_t id = nghttp2_submit_request(c->s, NULL, nv, sizeof(nv) / sizeof(nv[0]), &body, NULL);
    if (id > 0 && track && c->n < GRPC_STREAMS) {
        c->st[c->n++] = (h2_stream){id, chaos_now_ms(), 0, true};
    }
    return id;
}

/* One round of c: what the server sent, then what is due. False once the connection is
 * gone (the server closed it, or a frame it sent ended the session). */
static bool conn_round(h2_conn *c, short revents)
{
    uint8_t buf[4096];
    ssize_t n = 1;
    while ((revents & (POLLIN | POLLHUP | POLLERR)) &&
           (n = recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0) {
        if (nghttp2_session_mem_recv(c->s, buf, (size_t)n) < 0) {
            return false;
        }
    }
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
        return false;
    }
    for (size_t k = 0; c->kind == TRICKLE && k < c->n; k++) {
        c->sent = false;
        if (c->st[k].open) {
            nghttp2_session_resume_data(c->s, c->st[k].id);
            if (nghttp2_session_send(c->s) != 0) {
                return false;
            }
        }
    }
    return nghttp2_session_send(c->s) == 0;
}

/* Marks the streams of a connection the server closed as no longer open. */
static void conn_gone(h2_conn *c)
{
    for (size_t k = 0; k < c->n; k++) {
        on_close(c->s, c->st[k].id, 0, c);
    }
    conn_close(c);
}

/* The health check on a connection of its own: true when it answered grpc-status 0. */
static bool probe(int port)
{
    h2_conn c;
    size_t off = 0;
    bool ok = conn_open(&c, PROBE, port) &&
              call_open(&c, "/grpc.health.v1.Health/Check", "probe", &off, true) > 0;
    for (uint64_t end = chaos_now_ms() + PROBE_MS; ok && c.st[0].open && chaos_now_ms() < end;) {
        struct pollfd p = {.fd = c.fd, .events = POLLIN};
        ok = poll(&p, 1, 100) >= 0 && conn_round(&c, p.revents);
    }
    ok = ok && strcmp(c.status, "0") == 0;
    conn_close(&c);
    return ok;
}

/* RESET's round: a call with half its message, reset at once. */
static bool reset_round(h2_conn *c, const char *key)
{
    size_t off = 0;
    int32_t id = call_open(c, "/chaos.Counter/Add", key, &off, false);
    if (id <= 0 || nghttp2_session_send(c->s) != 0 ||
        nghttp2_submit_rst_stream(c->s, NGHTTP2_FLAG_NONE, id, NGHTTP2_CANCEL) != 0) {
        return false;
    }
    c->resets++;
    return nghttp2_session_send(c->s) == 0;
}

/* The fault's end: per slow kind the longest hold and the streams still open. */
static void slow_grpc_end(size_t i, pid_t pid, h2_conn *c, bool answered)
{
    char idx[8], p[16], h[2][24], o[2][8], resets[24];
    snprintf(idx, sizeof(idx), "%zu", i);
    snprintf(p, sizeof(p), "%d", (int)pid);
    snprintf(resets, sizeof(resets), "%" PRIu64, c[RESET].resets);
    for (int k = TRICKLE; k <= NODATA; k++) {
        uint64_t held = 0, open = 0, now = chaos_now_ms();
        for (size_t s = 0; s < c[k].n; s++) {
            uint64_t t = c[k].st[s].open ? now - c[k].st[s].from : c[k].st[s].held;
            held = t > held ? t : held;
            open += c[k].st[s].open;
        }
        snprintf(h[k], sizeof(h[k]), "%" PRIu64, held);
        snprintf(o[k], sizeof(o[k]), "%" PRIu64, open);
    }
    const char *f[] = {"kind",        "slow_grpc", "server",
                       idx,           "pid",       p,
                       "trickle_ms",  h[TRICKLE],  "trickle_open",
                       o[TRICKLE],    "nodata_ms", h[NODATA],
                       "nodata_open", o[NODATA],   "resets",
                       resets,        "probe",     answered ? "answered" : "unanswered"};
    chaos_history_event("fault_end", 9, f);
}

/* Opens the slow connections and their streams (keys of this fault only). */
static void slow_open(h2_conn *c, int port, size_t offs[2][GRPC_STREAMS], pid_t pid)
{
    for (int k = 0; k < N_CONNS - 1; k++) {
        if (!conn_open(&c[k], k, port)) {
            conn_close(&c[k]); /* the server refused it: nothing held */
            continue;
        }
        for (size_t s = 0; k != RESET && s < GRPC_STREAMS; s++) {
            char key[64];
            snprintf(key, sizeof(key), "slow-grpc-%d-%d-%zu", (int)pid, k, s);
            call_open(&c[k], "/chaos.Counter/Add", key, &offs[k][s], true);
        }
    }
}

void chaos_slow_grpc(uint64_t *rng, size_t i)
{
    h2_conn c[N_CONNS - 1];
    size_t offs[2][GRPC_STREAMS] = {{0}};
    int port = 0;
    pid_t pid = chaos_server_pid(i);
    sscanf(chaos_server_grpc(i), "tcp://127.0.0.1:%d", &port);
    chaos_server_event("fault", "slow_grpc", i, pid);
    uint64_t start = chaos_now_ms(), end = start + chaos_between(rng, 5000, 8000), next = 0;
    slow_open(c, port, offs, pid);
    for (uint64_t now = start; now < end; now = chaos_now_ms()) {
        struct pollfd p[N_CONNS - 1];
        for (int k = 0; k < N_CONNS - 1; k++) {
            p[k] = (struct pollfd){.fd = c[k].fd, .events = POLLIN};
        }
        poll(p, N_CONNS - 1, TRICKLE_MS);
        for (int k = 0; k < N_CONNS - 1; k++) {
            char key[64];
            snprintf(key, sizeof(key), "slow-grpc-%d-reset-%" PRIu64, (int)pid, c[k].resets);
            bool alive = c[k].fd < 0 || (conn_round(&c[k], p[k].revents) &&
                                         (k != RESET || now < next || reset_round(&c[k], key)));
            if (!alive) {
                conn_gone(&c[k]);
            }
        }
        next = now >= next ? now + RESET_MS : next;
    }
    bool answered = probe(port); /* the slow streams still open stay open meanwhile */
    slow_grpc_end(i, pid, c, answered);
    for (int k = 0; k < N_CONNS - 1; k++) {
        conn_close(&c[k]);
    }
}
