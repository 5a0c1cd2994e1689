/* Integration: the gRPC front against hostile HTTP/2 (the gRPC twin of
 * test_http_hostile.c). A real server on tcp://127.0.0.1:<free port> with small bounds,
 * raw TCP sockets writing frames by hand (header blocks from nghttp2's HPACK encoder, or
 * hand-made bombs). Every case asserts that the server ends the connection or the
 * stream within its bound, that no refused request ran a handler, and that a good call
 * still works afterwards. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <nghttp2/nghttp2.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

#define MAX_STREAMS 8
#define REQ_TIMEOUT_MS 1000
#define IDLE_MS 1000
#define MAX_BUFFERED (32 * 1024) /* grpc_max_buffered: metadata and messages of all streams */
#define BOUND_S 10               /* receive bound: a hung server fails the test */

static tu_server S;
static int port;
static atomic_int runs, arrivals;
static atomic_bool gate_open;

static idem_code h_add(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&arrivals, 1);
    for (int i = 0; i < 100 * BOUND_S && !atomic_load(&gate_open); i++) {
        usleep(10000); /* the gate: polled, bounded */
    }
    atomic_fetch_add(&runs, 1);
    return idem_call_reply(call, IDEM_OK, "ok", 2);
}

static void serve(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.workers = 4;
    o.grpc_max_streams = MAX_STREAMS;
    o.grpc_request_timeout_ms = REQ_TIMEOUT_MS;
    o.grpc_idle_timeout_ms = IDLE_MS;
    o.grpc_max_buffered = MAX_BUFFERED;
    atomic_store(&runs, 0);
    atomic_store(&arrivals, 0);
    atomic_store(&gate_open, true);
    tu_server_create(&S, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED};
    cr_assert_eq(idem_server_register(S.srv, "t.Count/Add", h_add, NULL, &cached), IDEM_OK);
    tu_server_listen(&S);
    cr_assert_eq(idem_server_listen_grpc(S.srv, "tcp://127.0.0.1:0"), IDEM_OK, "%s", idem_errmsg());
    port = idem_server_grpc_port(S.srv);
}

static void teardown(void)
{
    atomic_store(&gate_open, true);
    tu_server_destroy(&S, false);
}

TestSuite(grpc_hostile, .init = serve, .fini = teardown, .timeout = 60);

/* ---- a raw HTTP/2 client ---- */

static int dial(void)
{
    return tu_dial(port, BOUND_S);
}

static void frame(int fd, uint8_t type, uint8_t flags, uint32_t sid, const void *p, size_t len)
{
    uint8_t h[9] = {
        (uint8_t)(len >> 16), (uint8_t)(len >> 8),  (uint8_t)len,        type,        flags,
        (uint8_t)(sid >> 24), (uint8_t)(sid >> 16), (uint8_t)(sid >> 8), (uint8_t)sid};
    tu_send_all(fd, h, 9);
    tu_send_all(fd, p, len);
}

/* The client preface and an empty SETTINGS. */
static int dial_h2(void)
{
    static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    int fd = dial();
    tu_send_all(fd, preface, sizeof(preface) - 1);
    frame(fd, NGHTTP2_SETTINGS, 0, 0, NULL, 0);
    return fd;
}

#define NV(n, v)                                                                                   \
    {                                                                                              \
        (uint8_t *)(n), (uint8_t *)(v), strlen(n), strlen(v), NGHTTP2_NV_FLAG_NONE                 \
    }

/* A request's header block (nghttp2's HPACK encoder, one per connection): the usual
 * headers with this content-type, then extra[0..n_extra). */
static size_t headers_with(nghttp2_hd_deflater *d, const char *type, const nghttp2_nv *extra,
                           size_t n_extra, uint8_t *out, size_t cap)
{
    nghttp2_nv nv[16] = {NV(":method", "POST"),       NV(":scheme", "http"),
                         NV(":path", "/t.Count/Add"), NV(":authority", "x"),
                         NV("content-type", type),    NV("te", "trailers")};
    size_t n = 6;
    for (size_t i = 0; i < n_extra && n < 16; i++) {
        nv[n++] = extra[i];
    }
    ssize_t len = nghttp2_hd_deflate_hd(d, out, cap, nv, n);
    cr_assert_gt(len, 0);
    return (size_t)len;
}

static size_t request_headers(nghttp2_hd_deflater *d, const char *key, uint8_t *out, size_t cap)
{
    nghttp2_nv k[] = {NV("idempotency-key", key)};
    return headers_with(d, "application/grpc", k, 1, out, cap);
}

static const uint8_t message[] = {0, 0, 0, 0, 2, 'h', 'i'}; /* one framed message */

/* A whole request on stream sid; end: with END_STREAM on its DATA. */
static void request(int fd, nghttp2_hd_deflater *d, uint32_t sid, const char *key, bool end)
{
    uint8_t hb[512];
    size_t n = request_headers(d, key, hb, sizeof(hb));
    frame(fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, sid, hb, n);
    frame(fd, NGHTTP2_DATA, end ? NGHTTP2_FLAG_END_STREAM : 0, sid, message, sizeof(message));
}

static uint8_t last_payload[4096]; /* the start of the frame await_frame found */

/* Reads frames until one of type on stream sid (true) or the connection's end (false). */
static bool await_frame(int fd, uint8_t type, uint32_t sid)
{
    uint8_t h[9], skip[4096];
    for (;;) {
        if (recv(fd, h, 9, MSG_WAITALL) != 9) {
            return false;
        }
        size_t len = ((size_t)h[0] << 16) | ((size_t)h[1] << 8) | h[2], got = 0;
        uint32_t id =
            ((uint32_t)(h[5] & 0x7f) << 24) | ((uint32_t)h[6] << 16) | ((uint32_t)h[7] << 8) | h[8];
        for (size_t left = len; left > 0;) {
            ssize_t n = recv(fd, skip, left < sizeof(skip) ? left : sizeof(skip), 0);
            if (n <= 0) {
                return false;
            }
            memcpy(last_payload + got, skip,
                   got + (size_t)n <= sizeof(last_payload) ? (size_t)n : 0);
            got += (size_t)n;
            left -= (size_t)n;
        }
        if (h[3] == type && id == sid) {
            return true;
        }
    }
}

/* The error code of the connection's GOAWAY (-1: none came). */
static int goaway_code(int fd)
{
    if (!await_frame(fd, NGHTTP2_GOAWAY, 0)) {
        return -1;
    }
    const uint8_t *p = last_payload + 4;
    return (int)(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3]);
}

/* True when the server ends the connection within BOUND_S. */
static bool closed_by_server(int fd)
{
    char buf[4096];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n == 0 || (n < 0 && errno == ECONNRESET)) {
            return true;
        }
        if (n < 0) {
            return false; /* EAGAIN: the bound passed */
        }
    }
}

/* A good call on a fresh connection still gets its answer's trailers. */
static void good_call_works(const char *key)
{
    int fd = dial_h2();
    nghttp2_hd_deflater *d;
    cr_assert_eq(nghttp2_hd_deflate_new(&d, 4096), 0);
    request(fd, d, 1, key, true);
    cr_expect(await_frame(fd, NGHTTP2_DATA, 1), "no answer to a good call");
    nghttp2_hd_deflate_del(d);
    close(fd);
}

Test(grpc_hostile, bytes_that_are_not_http2_close_the_connection)
{
    int fd = dial();
    static const char req[] = "POST /t.Count/Add HTTP/1.1\r\nHost: x\r\n\r\n";
    tu_send_all(fd, req, sizeof(req) - 1);
    cr_expect(closed_by_server(fd));
    close(fd);
    good_call_works("after-garbage");
    cr_expect_eq(atomic_load(&runs), 1);
}

Test(grpc_hostile, malformed_frames_end_the_connection)
{
    uint8_t junk[32] = {0};
    int fd = dial_h2();
    frame(fd, NGHTTP2_DATA, 0, 0, junk, sizeof(junk)); /* DATA on stream 0 */
    cr_expect(closed_by_server(fd));
    close(fd);
    fd = dial_h2();
    frame(fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, junk, sizeof(junk)); /* bad HPACK */
    cr_expect(closed_by_server(fd));
    close(fd);
    fd = dial_h2();
    frame(fd, NGHTTP2_SETTINGS, 0, 0, junk, 5); /* a SETTINGS length not a multiple of 6 */
    cr_expect(closed_by_server(fd));
    close(fd);
    good_call_works("after-malformed");
    cr_expect_eq(atomic_load(&runs), 1);
}

/* One 4000-byte header into HPACK's dynamic table, then 1-byte references to it: a
 * 16 KiB block would expand to 64 MB of header list. */
Test(grpc_hostile, hpack_bomb_is_refused_without_running_anything)
{
    static uint8_t hb[16000];
    size_t n = 0;
    hb[n++] = 0x40; /* literal with incremental indexing, new name */
    hb[n++] = 1;    /* name length */
    hb[n++] = 'x';
    hb[n++] = 0x7f; /* value length 4000: 127 + 3873 as an HPACK integer */
    hb[n++] = (uint8_t)(0x80 | ((4000 - 127) & 0x7f));
    hb[n++] = (uint8_t)((4000 - 127) >> 7);
    memset(hb + n, 'a', 4000);
    n += 4000;
    while (n < sizeof(hb)) {
        hb[n++] = 0x80 | 62; /* indexed: the first dynamic entry */
    }
    int fd = dial_h2();
    frame(fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 1, hb, n);
    cr_expect(closed_by_server(fd));
    close(fd);
    good_call_works("after-bomb");
    cr_expect_eq(atomic_load(&runs), 1);
}

Test(grpc_hostile, stream_flood_is_refused_past_max_streams)
{
    nghttp2_hd_deflater *d;
    cr_assert_eq(nghttp2_hd_deflate_new(&d, 4096), 0);
    int fd = dial_h2();
    uint8_t hb[512];
    for (uint32_t sid = 1; sid < 2 * 200; sid += 2) { /* headers only: none ends */
        size_t n = request_headers(d, "flood", hb, sizeof(hb));
        frame(fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, sid, hb, n);
    }
    cr_expect(await_frame(fd, NGHTTP2_RST_STREAM, 2 * MAX_STREAMS + 1), "no REFUSED_STREAM");
    nghttp2_hd_deflate_del(d);
    close(fd);
    good_call_works("after-flood");
    cr_expect_eq(atomic_load(&runs), 1);
}

/* Rapid reset: each call sent whole and reset at once. The calls the front took keep
 * their slot until answered, so at most MAX_STREAMS run while the gate is shut. */
Test(grpc_hostile, rapid_reset_runs_at_most_max_streams_calls_at_once)
{
    nghttp2_hd_deflater *d;
    cr_assert_eq(nghttp2_hd_deflate_new(&d, 4096), 0);
    atomic_store(&gate_open, false);
    int fd = dial_h2();
    static const uint8_t cancel[4] = {0, 0, 0, NGHTTP2_CANCEL};
    for (uint32_t i = 0, sid = 1; i < 500; i++, sid += 2) {
        char key[32];
        snprintf(key, sizeof(key), "reset-%u", i);
        request(fd, d, sid, key, true);
        frame(fd, NGHTTP2_RST_STREAM, 0, sid, cancel, 4);
    }
    static const uint8_t opaque[8] = {0};
    frame(fd, NGHTTP2_PING, 0, 0, opaque, 8); /* its ACK: every frame before it was read */
    cr_expect(await_frame(fd, NGHTTP2_PING, 0), "no PING ACK");
    cr_expect_leq(atomic_load(&arrivals), MAX_STREAMS);
    atomic_store(&gate_open, true);
    nghttp2_hd_deflate_del(d);
    close(fd);
    good_call_works("after-reset");
    cr_expect_leq(atomic_load(&runs), MAX_STREAMS + 1);
}

Test(grpc_hostile, reset_mid_call_runs_nothing)
{
    nghttp2_hd_deflater *d;
    cr_assert_eq(nghttp2_hd_deflate_new(&d, 4096), 0);
    int fd = dial_h2();
    static const uint8_t cancel[4] = {0, 0, 0, NGHTTP2_CANCEL};
    request(fd, d, 1, "mid", false); /* the message, but not its end */
    frame(fd, NGHTTP2_RST_STREAM, 0, 1, cancel, 4);
    request(fd, d, 3, "mid-2", true);
    cr_expect(await_frame(fd, NGHTTP2_DATA, 3), "the next stream was not answered");
    nghttp2_hd_deflate_del(d);
    close(fd);
    cr_expect_eq(atomic_load(&runs), 1);
}

/* A client that trickles its message a byte at a time: the stream is reset once its
 * request timeout passes, and nothing runs. */
Test(grpc_hostile, trickling_client_is_reset_after_the_request_timeout)
{
    nghttp2_hd_deflater *d;
    cr_assert_eq(nghttp2_hd_deflate_new(&d, 4096), 0);
    int fd = dial_h2();
    uint8_t hb[512];
    size_t n = request_headers(d, "trickle", hb, sizeof(hb));
    frame(fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, hb, n);
    for (size_t i = 0; i < 3; i++) {
        frame(fd, NGHTTP2_DATA, 0, 1, message + i, 1);
    }
    cr_expect(await_frame(fd, NGHTTP2_RST_STREAM, 1), "the trickling stream was not reset");
    nghttp2_hd_deflate_del(d);
    close(fd);
    cr_expect_eq(atomic_load(&runs), 0);
}

Test(grpc_hostile, idle_connection_closes_after_the_idle_timeout)
{
    int fd = dial_h2();
    cr_expect_eq(goaway_code(fd), NGHTTP2_NO_ERROR, "no GOAWAY on an idle connection");
    cr_expect(closed_by_server(fd));
    close(fd);
}

/* The grpc-status of the answer on stream sid (-1: none came). */
static int await_status(int fd, uint32_t sid)
{
    nghttp2_hd_inflater *inf;
    uint8_t h[9], *block = malloc(1 << 16);
    int status = -1;
    cr_assert_eq(nghttp2_hd_inflate_new(&inf), 0);
    while (status < 0 && recv(fd, h, 9, MSG_WAITALL) == 9) {
        size_t len = ((size_t)h[0] << 16) | ((size_t)h[1] << 8) | h[2];
        uint32_t id =
            ((uint32_t)(h[5] & 0x7f) << 24) | ((uint32_t)h[6] << 16) | ((uint32_t)h[7] << 8) | h[8];
        if (len > (1 << 16) || (len > 0 && recv(fd, block, len, MSG_WAITALL) != (ssize_t)len)) {
            break;
        }
        for (size_t off = 0; h[3] == NGHTTP2_HEADERS && off < len;) {
            nghttp2_nv nv;
            int flags;
            ssize_t n = nghttp2_hd_inflate_hd2(inf, &nv, &flags, block + off, len - off, 1);
            cr_assert_geq(n, 0);
            off += (size_t)n;
            if ((flags & NGHTTP2_HD_INFLATE_EMIT) && id == sid && nv.namelen == 11 &&
                memcmp(nv.name, "grpc-status", 11) == 0) {
                status = atoi((const char *)nv.value);
            }
            if (flags & NGHTTP2_HD_INFLATE_FINAL) {
                nghttp2_hd_inflate_end_headers(inf);
                break;
            }
        }
    }
    nghttp2_hd_inflate_del(inf);
    free(block);
    return status;
}

/* Sends one request (its headers, then data as given) on a fresh connection and returns
 * the grpc-status answered. */
static int status_of(const char *type, const nghttp2_nv *extra, size_t n_extra, const void *data,
                     size_t dlen)
{
    nghttp2_hd_deflater *d;
    cr_assert_eq(nghttp2_hd_deflate_new(&d, 4096), 0);
    int fd = dial_h2();
    static uint8_t hb[1 << 16];
    size_t n = headers_with(d, type, extra, n_extra, hb, sizeof(hb));
    size_t first = n < 16384 ? n : 16384; /* the peer's SETTINGS_MAX_FRAME_SIZE */
    frame(fd, NGHTTP2_HEADERS, first == n ? NGHTTP2_FLAG_END_HEADERS : 0, 1, hb, first);
    if (first < n) {
        frame(fd, NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 1, hb + first, n - first);
    }
    frame(fd, NGHTTP2_DATA, NGHTTP2_FLAG_END_STREAM, 1, data, dlen);
    int status = await_status(fd, 1);
    nghttp2_hd_deflate_del(d);
    close(fd);
    return status;
}

Test(grpc_hostile, requests_the_front_cannot_take_are_refused_with_their_status)
{
    static const uint8_t compressed[] = {1, 0, 0, 0, 2, 'h', 'i'};
    static const uint8_t two[] = {0, 0, 0, 0, 1, 'a', 0, 0, 0, 0, 1, 'b'};
    static const uint8_t too_large[] = {0, 0, 0x50, 0, 0, 'x'}; /* declares 5 MiB */
    static char big[12000];
    memset(big, 'v', sizeof(big) - 1);
    nghttp2_nv key[] = {NV("idempotency-key", "k")};
    nghttp2_nv twice[] = {NV("idempotency-key", "k"), NV("idempotency-key", "j")};
    nghttp2_nv bulky[] = {NV("idempotency-key", "k"), NV("x-a", big), NV("x-b", big)};
    cr_expect_eq(status_of("application/grpc", key, 1, compressed, sizeof(compressed)), 12);
    cr_expect_eq(status_of("application/grpc", key, 1, two, sizeof(two)), 3);
    cr_expect_eq(status_of("application/grpc", key, 1, message, 3), 3); /* cut short */
    cr_expect_eq(status_of("application/grpc", key, 1, too_large, sizeof(too_large)), 8);
    cr_expect_eq(status_of("application/grpc", twice, 2, message, sizeof(message)), 3);
    cr_expect_eq(status_of("application/grpc", bulky, 3, message, sizeof(message)), 8);
    int st = status_of("text/plain", key, 1, message, sizeof(message));
    cr_expect_eq(st, 3, "text/plain: %d", st);
    cr_expect_eq(atomic_load(&runs), 0);
    cr_expect_eq(status_of("application/grpc+proto", key, 1, message, sizeof(message)), 0);
    cr_expect_eq(atomic_load(&runs), 1);
}

/* One message of 48 000 bytes (under max_frame, over the bound on all buffers): refused
 * before it runs, and the bytes it held are given back (a good call still works). */
Test(grpc_hostile, message_bytes_past_grpc_max_buffered_are_refused)
{
    static uint8_t chunk[16000];
    nghttp2_hd_deflater *d;
    uint8_t hb[512];
    cr_assert_eq(nghttp2_hd_deflate_new(&d, 4096), 0);
    int fd = dial_h2();
    size_t n = request_headers(d, "big", hb, sizeof(hb));
    frame(fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, hb, n);
    memset(chunk, 'b', sizeof(chunk));
    uint32_t len = 3 * sizeof(chunk) - 5;
    chunk[0] = 0;
    for (int i = 0; i < 4; i++) {
        chunk[1 + i] = (uint8_t)(len >> (24 - 8 * i));
    }
    for (int i = 0; i < 3; i++) {
        frame(fd, NGHTTP2_DATA, i == 2 ? NGHTTP2_FLAG_END_STREAM : 0, 1, chunk, sizeof(chunk));
        memset(chunk, 'b', 5);
    }
    cr_expect_eq(await_status(fd, 1), 8);
    nghttp2_hd_deflate_del(d);
    close(fd);
    cr_expect_eq(atomic_load(&runs), 0);
    good_call_works("after-big");
    cr_expect_eq(atomic_load(&runs), 1);
}

/* Streams opened and reset at once, 1 500 of them without a request's end: past the
 * budget of resets (1 000, then 33 a second) nghttp2 ends the connection with GOAWAY
 * INTERNAL_ERROR (not the idle timeout's NO_ERROR). */
Test(grpc_hostile, a_flood_of_resets_ends_the_connection)
{
    nghttp2_hd_deflater *d;
    uint8_t hb[512];
    static const uint8_t cancel[4] = {0, 0, 0, NGHTTP2_CANCEL};
    cr_assert_eq(nghttp2_hd_deflate_new(&d, 4096), 0);
    int fd = dial_h2();
    for (uint32_t i = 0, sid = 1; i < 1500; i++, sid += 2) {
        size_t n = request_headers(d, "flood", hb, sizeof(hb));
        frame(fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, sid, hb, n);
        frame(fd, NGHTTP2_RST_STREAM, 0, sid, cancel, 4);
    }
    int code = goaway_code(fd);
    cr_expect_eq(code, NGHTTP2_INTERNAL_ERROR, "GOAWAY %d", code);
    nghttp2_hd_deflate_del(d);
    close(fd);
    good_call_works("after-reset-flood");
    cr_expect_eq(atomic_load(&runs), 1);
}
