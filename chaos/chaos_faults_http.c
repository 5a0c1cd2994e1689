/* Slow and trickling HTTP clients against one server's HTTP front (chaos_faults.h): for
 * 5-8 s, SLOW_CONNS connections each send a byte every TRICKLE_MS:
 *   head     a request head that never ends: the front answers 408 and closes within
 *            CHAOS_HTTP_REQUEST_TIMEOUT_MS of its first byte;
 *   refused  a request the strict parser refuses (a header line without a colon),
 *            answered 400 with Connection: close, and then more bytes: the linger after
 *            a refusal must be bounded as well, or a few such clients hold the front's
 *            CHAOS_HTTP_MAX_CONNS for ever.
 * Then, with the slow clients still trickling, an ordinary client asks GET /metrics.
 * The fault's end records the longest time the server held a slow connection (from its
 * first byte until the server closed it, or until the fault ended), how many were still
 * open, and whether the ordinary request was answered: the checker wants no slow
 * connection still open when the fault ends (at least 5 s after its first byte: more
 * than twice the request timeout + 1 s, as one that waited for a free slot gets a
 * request timeout of its own once accepted; a time measured here, on a loaded machine,
 * may lag the server's close, so only a connection never closed counts) and the
 * ordinary request answered. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "chaos_faults.h"

#define SLOW_CONNS 6
#define TRICKLE_MS 10
#define PROBE_MS 5000

typedef struct slow_conn {
    int fd; /* -1: closed by the server (or never opened) */
    uint64_t from, held;
    const char *head; /* sent at once, then a byte per TRICKLE_MS */
} slow_conn;

static int http_port(size_t i)
{
    int port = 0;
    return sscanf(chaos_server_http(i), "http://127.0.0.1:%d", &port) == 1 ? port : -1;
}

/* One round of conn c: drains what the server said, notices its close, sends a byte. */
static void trickle(slow_conn *c, uint64_t now)
{
    char buf[512];
    ssize_t n;
    while ((n = recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0) {
    }
    bool closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
    if (!closed) {
        const char *next = c->head[0] != '\0' ? c->head : "x";
        size_t len = c->head[0] != '\0' ? strlen(c->head) : 1;
        closed = send(c->fd, next, len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno != EAGAIN;
        c->head = "";
    }
    c->held = now - c->from;
    if (closed) {
        close(c->fd);
        c->fd = -1;
    }
}

/* GET /metrics on a connection of its own: true when a status line came back. */
static bool probe(int port)
{
    static const char req[] = "GET /metrics HTTP/1.1\r\nHost: chaos\r\nConnection: close\r\n\r\n";
    char buf[16] = "";
    int fd = chaos_connect_local(port);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    bool answered = fd >= 0 && send(fd, req, sizeof(req) - 1, MSG_NOSIGNAL) > 0 &&
                    poll(&p, 1, PROBE_MS) == 1 && recv(fd, buf, sizeof(buf) - 1, 0) >= 12 &&
                    strncmp(buf, "HTTP/1.1 ", 9) == 0;
    if (fd >= 0) {
        close(fd);
    }
    return answered;
}

/* The fault's end: per kind of slow client the longest hold and how many were open. */
static void slow_http_end(size_t i, pid_t pid, const uint64_t held[2], const uint64_t open[2],
                          bool answered)
{
    char idx[8], p[16], h[2][24], o[2][8];
    snprintf(idx, sizeof(idx), "%zu", i);
    snprintf(p, sizeof(p), "%d", (int)pid);
    for (int k = 0; k < 2; k++) {
        snprintf(h[k], sizeof(h[k]), "%" PRIu64, held[k]);
        snprintf(o[k], sizeof(o[k]), "%" PRIu64, open[k]);
    }
    const char *f[] = {
        "kind",         "slow_http", "server",     idx,
        "pid",          p,           "head_ms",    h[0],
        "head_open",    o[0],        "refused_ms", h[1],
        "refused_open", o[1],        "probe",      answered ? "answered" : "unanswered"};
    chaos_history_event("fault_end", 8, f);
}

void chaos_slow_http(uint64_t *rng, size_t i)
{
    static const char *const heads[2] = {
        "POST /chaos.Counter/Add HTTP/1.1\r\nHost: chaos\r\nX-Trickle: ",
        "POST /chaos.Counter/Add HTTP/1.1\r\nHost: chaos\r\nno colon here\r\n\r\n"};
    slow_conn c[SLOW_CONNS];
    int port = http_port(i);
    pid_t pid = chaos_server_pid(i);
    chaos_server_event("fault", "slow_http", i, pid);
    uint64_t start = chaos_now_ms(), end = start + chaos_between(rng, 5000, 8000);
    for (int k = 0; k < SLOW_CONNS; k++) {
        c[k] = (slow_conn){chaos_connect_local(port), start, 0, heads[k % 2]};
    }
    for (uint64_t now = start; now < end; now = chaos_now_ms()) {
        for (int k = 0; k < SLOW_CONNS; k++) {
            if (c[k].fd >= 0) {
                trickle(&c[k], now);
            }
        }
        chaos_sleep_ms(TRICKLE_MS);
    }
    bool answered = probe(port); /* the slow connections still open stay open meanwhile */
    uint64_t held[2] = {0, 0}, open[2] = {0, 0}; /* per kind: head, refused */
    for (int k = 0; k < SLOW_CONNS; k++) {
        held[k % 2] = c[k].held > held[k % 2] ? c[k].held : held[k % 2];
        open[k % 2] += c[k].fd >= 0;
        if (c[k].fd >= 0) {
            close(c[k].fd);
        }
    }
    slow_http_end(i, pid, held, open, answered);
}
