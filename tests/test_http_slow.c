/* Integration: slow and greedy HTTP clients against the HTTP front (the hostile HTTP
 * corpus, continued from test_http_hostile.c). A real server on http://127.0.0.1:<free
 * port>, raw TCP sockets: a refused client that keeps trickling, two of them holding
 * every connection slot, an answer read too slowly, a head that arrives a byte at a
 * time, and requests that would take the HTTP buffers of all connections past
 * http_max_buffered. docs/operations.md lists the bounds of every state of a connection. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <malloc.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "testutil.h"

#define ADD "t.Count/Add"
#define PACE_MS 10           /* a trickler sends a byte this often */
#define PATIENCE_ROUNDS 2000 /* rounds of PACE_MS: 20 s, twenty times the linger bound */
#define MAX_BUFFERED (1u << 20)
#define BIG "t.Big/Get"
#define HUNG "t.Hung/Wait"
#define BIG_REPLY (12u << 20)
#define MID "t.Mid/Get"
#define MID_REPLY (64u << 10)

static tu_server S;
static int port;
static atomic_int runs, mid_runs;
static unsigned seq;

static idem_code h_add(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&runs, 1);
    size_t n;
    const void *p = idem_call_payload(call, &n);
    return idem_call_reply(call, IDEM_OK, p, n);
}

/* BIG_REPLY bytes, more than the kernel's socket buffers hold (tcp_wmem's 4 MiB). */
static idem_code h_big(idem_call *call, void *arg)
{
    (void)arg;
    static char big[BIG_REPLY];
    return idem_call_reply(call, IDEM_OK, big, sizeof(big));
}

/* MID_REPLY bytes: past an answer's uncounted first 4 KiB, well within http_max_buffered;
 * cached, so that a retry with its key replays it. */
static idem_code h_mid(idem_call *call, void *arg)
{
    (void)arg;
    static char mid[MID_REPLY];
    atomic_fetch_add(&mid_runs, 1);
    return idem_call_reply(call, IDEM_OK, mid, sizeof(mid));
}

/* Runs until release_hung(): a handler that outlives the server's bound. */
static pthread_mutex_t hung_mtx = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hung_cv = PTHREAD_COND_INITIALIZER;
static bool hung_released;

static idem_code h_hung(idem_call *call, void *arg)
{
    (void)arg;
    pthread_mutex_lock(&hung_mtx);
    while (!hung_released) {
        pthread_cond_wait(&hung_cv, &hung_mtx);
    }
    pthread_mutex_unlock(&hung_mtx);
    return idem_call_reply(call, IDEM_OK, "late", 4);
}

static void release_hung(void)
{
    pthread_mutex_lock(&hung_mtx);
    hung_released = true;
    pthread_cond_broadcast(&hung_cv);
    pthread_mutex_unlock(&hung_mtx);
}

static idem_server_opts opts(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.max_frame = 2 * BIG_REPLY;
    return o;
}

static void serve(idem_server_opts *o)
{
    atomic_store(&runs, 0);
    atomic_store(&mid_runs, 0);
    tu_server_create(&S, o);
    cr_assert_eq(idem_server_register(S.srv, ADD, h_add, NULL, NULL), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, BIG, h_big, NULL, NULL), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, HUNG, h_hung, NULL, NULL), IDEM_OK);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(S.srv, MID, h_mid, NULL, &cached), IDEM_OK);
    tu_server_listen(&S);
    cr_assert_eq(idem_server_listen_http(S.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    port = idem_server_http_port(S.srv);
}

static void teardown(void)
{
    release_hung();
    tu_server_destroy(&S, false);
}

TestSuite(http_slow, .fini = teardown);

/* rcvbuf: 0, or the client's receive buffer (a small one makes the server's sends partial) */
static int dial_rcvbuf(int rcvbuf)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    cr_assert_geq(fd, 0);
    if (rcvbuf > 0) {
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    }
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {10, 0}; /* a bound, not synchronisation: a hung server fails */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

static int dial(void)
{
    return dial_rcvbuf(0);
}

static void send_all(int fd, const void *p, size_t len)
{
    for (size_t off = 0; off < len;) {
        ssize_t n = send(fd, (const char *)p + off, len - off, MSG_NOSIGNAL);
        cr_assert_gt(n, 0, "send: %s", strerror(errno));
        off += (size_t)n;
    }
}

/* ---- tricklers: refused, then a byte every PACE_MS for as long as they are let ---- */

typedef struct trickler {
    int fd;
    bool closed;
    char got[256]; /* the start of what the server answered */
    size_t len;
} trickler;

/* Connects and sends a request the server refuses (a bare LF: 400 + close). */
static void trickler_start(trickler *t)
{
    memset(t, 0, sizeof(*t));
    t->fd = dial();
    static const char bad[] = "POST /" ADD " HTTP/1.1\nHost: x\r\n\r\n";
    send_all(t->fd, bad, sizeof(bad) - 1);
}

/* One more byte, then what arrived: closed once the server has closed (eof, reset, or
 * a send that fails). Waits up to PACE_MS for the server: the trickle's pace. */
static void trickler_step(trickler *t)
{
    if (t->closed) {
        return;
    }
    if (send(t->fd, "x", 1, MSG_NOSIGNAL) != 1) {
        t->closed = true;
        return;
    }
    struct pollfd p = {.fd = t->fd, .events = POLLIN};
    if (poll(&p, 1, PACE_MS) != 1) {
        return;
    }
    char buf[4096];
    ssize_t n = recv(t->fd, buf, sizeof(buf), 0);
    if (n <= 0) {
        t->closed = true;
        return;
    }
    size_t keep = sizeof(t->got) - 1 - t->len < (size_t)n ? sizeof(t->got) - 1 - t->len : (size_t)n;
    memcpy(t->got + t->len, buf, keep);
    t->len += keep;
}

/* Steps t until the server closed it (the other thread may have stopped stepping it
 * just before it saw the close), then checks the refusal. */
static void trickler_end(trickler *t)
{
    for (int i = 0; i < PATIENCE_ROUNDS && !t->closed; i++) {
        trickler_step(t);
    }
    cr_assert(t->closed,
              "a refused client trickling a byte per %d ms was not closed within "
              "%d rounds",
              PACE_MS, PATIENCE_ROUNDS);
    cr_assert(strncmp(t->got, "HTTP/1.1 400 ", 13) == 0, "the refusal: %s", t->got);
    close(t->fd);
}

/* A call on a connection of its own; its status (0: closed unanswered). */
static int ordinary_call(size_t body_len)
{
    char hdr[64];
    snprintf(hdr, sizeof(hdr), "Idempotency-Key: ordinary-%u", ++seq);
    const char *h[] = {hdr};
    char *body = malloc(body_len + 1);
    cr_assert_not_null(body);
    memset(body, '7', body_len + 1);
    tu_http r;
    tu_http_post(&r, port, "/" ADD, h, 1, body, body_len);
    int status = r.status;
    if (status == 200) {
        cr_assert_eq(r.body_len, body_len);
    }
    tu_http_free(&r);
    free(body);
    return status;
}

Test(http_slow, a_refused_client_that_keeps_trickling_is_closed_within_the_linger_bound)
{
    idem_server_opts o = opts();
    serve(&o);
    trickler t;
    trickler_start(&t);
    for (int i = 0; i < PATIENCE_ROUNDS && !t.closed; i++) {
        trickler_step(&t);
    }
    trickler_end(&t);
    cr_assert_eq(ordinary_call(1), 200);
    cr_assert_eq(atomic_load(&runs), 1);
}

/* Two tricklers on a thread of their own, so that they keep their pace whatever the
 * ordinary client's calls take. */
typedef struct tricklers {
    trickler t[2];
    atomic_bool stop;
} tricklers;

static void *trickle(void *arg)
{
    tricklers *ts = arg;
    for (int i = 0; i < 2 * PATIENCE_ROUNDS && !atomic_load(&ts->stop); i++) {
        trickler_step(&ts->t[0]);
        trickler_step(&ts->t[1]);
    }
    return NULL;
}

Test(http_slow, an_ordinary_client_is_served_while_two_tricklers_hold_every_slot)
{
    idem_server_opts o = opts();
    o.http_max_conns = 2;
    serve(&o);
    tricklers ts = {.stop = false};
    trickler_start(&ts.t[0]);
    trickler_start(&ts.t[1]);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, trickle, &ts), 0);
    int status = 0;
    for (int i = 0; i < PATIENCE_ROUNDS && status != 200; i++) {
        poll(NULL, 0, PACE_MS);    /* pacing the attempts, not a wait */
        status = ordinary_call(1); /* 0 (closed unanswered) while both hold their slot */
    }
    atomic_store(&ts.stop, true);
    pthread_join(th, NULL);
    cr_assert_eq(status, 200, "an ordinary client was never served beside two tricklers");
    trickler_end(&ts.t[0]);
    trickler_end(&ts.t[1]);
}

/* A head of about 20 KiB sent a byte at a time: parsed as it arrives while the buffer
 * grows under it, and its first header (X-Request-Id) still read right at the end. */
Test(http_slow, a_head_arriving_a_byte_at_a_time_is_framed_as_if_sent_at_once)
{
    idem_server_opts o = opts();
    serve(&o);
    char *raw = malloc(32768);
    cr_assert_not_null(raw);
    int n = snprintf(raw, 32768,
                     "POST /" ADD " HTTP/1.1\r\nX-Request-Id: first-header\r\n"
                     "Host: x\r\nIdempotency-Key: bytewise\r\nConnection: close\r\n");
    for (int i = 0; i < 55; i++) { /* 64 header lines at most */
        n += snprintf(raw + n, 32768 - (size_t)n, "X-Pad-%d: %0340d\r\n", i, i);
    }
    n += snprintf(raw + n, 32768 - (size_t)n, "Content-Length: 3\r\n\r\n123");
    int fd = dial();
    for (int i = 0; i < n; i++) {
        send_all(fd, raw + i, 1);
    }
    char resp[1024];
    size_t got = 0;
    for (ssize_t r;
         got + 1 < sizeof(resp) && (r = recv(fd, resp + got, sizeof(resp) - got - 1, 0)) > 0;) {
        got += (size_t)r;
    }
    resp[got] = '\0';
    close(fd);
    free(raw);
    cr_assert(strncmp(resp, "HTTP/1.1 200 ", 13) == 0, "%s", resp);
    cr_assert_not_null(strstr(resp, "\r\nX-Request-Id: first-header\r\n"), "%s", resp);
    cr_assert_not_null(strstr(resp, "\r\n\r\n123"), "%s", resp);
}

/* What GET /metrics says the HTTP buffers hold. */
static size_t buffered_bytes(void)
{
    tu_http r;
    tu_http_get(&r, port, "/metrics");
    const char *v = r.body != NULL ? strstr(r.body, "\nidem_http_buffered_bytes ") : NULL;
    cr_assert_not_null(v, "no idem_http_buffered_bytes in /metrics");
    size_t n = strtoul(v + 26, NULL, 10);
    tu_http_free(&r);
    return n;
}

/* A client that sends all of a body but its last byte, so that the server holds its
 * buffer: 1 MiB, all of http_max_buffered but the buffer's uncounted first 4 KiB. */
static int hold_most_of_the_bound(void)
{
    enum { HELD = 700 * 1000 };
    int fd = dial();
    char head[256], *held = malloc(HELD);
    cr_assert_not_null(held);
    memset(held, 'h', HELD);
    int n = snprintf(head, sizeof(head),
                     "POST /" ADD " HTTP/1.1\r\nHost: x\r\n"
                     "Idempotency-Key: held\r\nContent-Length: %d\r\n\r\n",
                     HELD + 1);
    send_all(fd, head, (size_t)n);
    send_all(fd, held, HELD);
    free(held);
    size_t in = 0;
    for (int i = 0; i < PATIENCE_ROUNDS && in < MAX_BUFFERED - 4096; i++) {
        in = buffered_bytes();
    }
    cr_assert_eq(in, MAX_BUFFERED - 4096, "the held body's buffer");
    return fd;
}

/* A client holding a body that fills most of http_max_buffered: a request whose body
 * needs more is answered 503 (Retry-After, Connection: close) without running; a small
 * one is served; once the holder is gone the large one is served again. */
Test(http_slow, the_bound_on_all_buffers_refuses_new_bodies_with_503_and_serves_the_rest)
{
    idem_server_opts o = opts();
    o.http_max_buffered = MAX_BUFFERED;
    serve(&o);
    enum { ASKED = 100 * 1000 };
    int fd = hold_most_of_the_bound();
    size_t in;
    tu_http r;
    const char *h[] = {"Idempotency-Key: asked"};
    static char body[ASKED];
    tu_http_post(&r, port, "/" ADD, h, 1, body, ASKED);
    char v[64];
    cr_assert_eq(r.status, 503, "a body past http_max_buffered was not refused: %d", r.status);
    cr_assert_str_eq(tu_http_header(&r, "Retry-After", v, sizeof(v)), "1");
    cr_assert_str_eq(tu_http_header(&r, "Connection", v, sizeof(v)), "close");
    cr_assert_not_null(strstr(r.body, "\"code\":\"UNAVAILABLE\""), "%s", r.body);
    tu_http_free(&r);
    int ran = atomic_load(&runs);
    cr_assert_eq(ordinary_call(100), 200, "a small request beside the bound");
    cr_assert_eq(atomic_load(&runs), ran + 1);
    close(fd); /* the held body's memory goes back */
    int status = 0;
    for (int i = 0; i < PATIENCE_ROUNDS && status != 200; i++) {
        status = ordinary_call(ASKED);
    }
    cr_assert_eq(status, 200, "the bound was not given back when the holder left");
    for (int i = 0; i < PATIENCE_ROUNDS && (in = buffered_bytes()) != 0; i++) {
    } /* the last caller's connection drains, then goes */
    cr_assert_eq(in, 0, "buffers not given back");
}

/* A refused client that stays connected (its connection lingers up to a second) does
 * not keep the request bytes it was refused for counted: a small call right after the
 * 503 is served, not refused for what the refused one held. */
Test(http_slow, a_refused_body_gives_its_bytes_back_before_its_503_is_sent)
{
    idem_server_opts o = opts();
    o.http_max_buffered = MAX_BUFFERED;
    serve(&o);
    int held = hold_most_of_the_bound();
    enum { SENT = 12 * 1024 }; /* past the buffer's second size: refused there */
    int fd = dial();
    char head[256], *body = malloc(SENT);
    cr_assert_not_null(body);
    memset(body, 'r', SENT);
    int n = snprintf(head, sizeof(head),
                     "POST /" ADD " HTTP/1.1\r\nHost: x\r\n"
                     "Idempotency-Key: refused\r\nContent-Length: %d\r\n\r\n",
                     100 * 1000);
    send_all(fd, head, (size_t)n);
    send_all(fd, body, SENT);
    free(body);
    char resp[1024];
    ssize_t got = recv(fd, resp, sizeof(resp) - 1, 0);
    cr_assert_gt(got, 12);
    resp[got] = '\0';
    cr_assert(strncmp(resp, "HTTP/1.1 503 ", 13) == 0, "%s", resp);
    int ran = atomic_load(&runs);
    cr_assert_eq(ordinary_call(100), 200, "a small call while the refused client lingers");
    cr_assert_eq(atomic_load(&runs), ran + 1);
    close(fd);
    close(held);
}

/* A client that reads its answer steadily but slowly (16 KiB per PACE_MS, every partial
 * send of the server completes well within the timeout) is closed once the answer has
 * not been taken whole within http_request_timeout_ms of its first byte. */
Test(http_slow, an_answer_read_too_slowly_is_cut_off_at_the_request_timeout)
{
    idem_server_opts o = opts();
    o.http_request_timeout_ms = 2000; /* also the bound on sending an answer */
    serve(&o);
    int fd = dial_rcvbuf(16384);
    static const char req[] = "POST /" BIG " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              "Content-Length: 0\r\n\r\n";
    send_all(fd, req, sizeof(req) - 1);
    size_t taken = 0;
    bool closed = false;
    for (int i = 0; i < 4 * PATIENCE_ROUNDS && !closed; i++) {
        static char buf[16384];
        poll(NULL, 0, PACE_MS); /* the slow reader's pace, not a wait */
        ssize_t n = recv(fd, buf, sizeof(buf), 0);
        closed = n <= 0;
        taken += n > 0 ? (size_t)n : 0;
    }
    close(fd);
    cr_assert(closed, "the connection stayed open");
    cr_assert_lt(taken, BIG_REPLY,
                 "the whole answer (%zu bytes) was sent to a reader taking "
                 "16 KiB per %d ms",
                 taken, PACE_MS);
    cr_assert_gt(taken, 0, "nothing of the answer was sent");
}

/* A handler that outlives max_run_ms: its client is answered 504 (the outcome is not
 * known yet) and its connection closed then, instead of holding it until the handler
 * returns; the late answer is dropped, and other calls are served meanwhile. */
Test(http_slow, a_request_whose_handler_outlives_max_run_ms_is_answered_504)
{
    idem_server_opts o = opts();
    o.max_run_ms = 300;
    serve(&o);
    int fd = dial(); /* its receive gives up after 10 s */
    static const char req[] = "POST /" HUNG " HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";
    send_all(fd, req, sizeof(req) - 1);
    char got[1024];
    size_t len = 0;
    for (ssize_t n;
         len + 1 < sizeof(got) && (n = recv(fd, got + len, sizeof(got) - 1 - len, 0)) > 0;) {
        len += (size_t)n; /* to the server's close, or the 10 s bound */
    }
    got[len] = '\0';
    int status = ordinary_call(1); /* while the handler still runs */
    release_hung();
    close(fd);
    cr_assert(strncmp(got, "HTTP/1.1 504 ", 13) == 0, "%s", got);
    cr_assert_not_null(strstr(got, "\r\nConnection: close\r\n"), "%s", got);
    cr_assert_not_null(strstr(got, "DEADLINE_EXCEEDED"), "%s", got);
    cr_assert_eq(status, 200);
}

/* Bytes the process's heap holds (glibc's count; ASan's allocator is not seen here). */
static size_t heap_in_use(void)
{
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

/* An answer that can never fit in http_max_buffered (12 MiB against 1 MiB) is not held
 * for a client that does not read: the client gets 507 RESOURCE_EXHAUSTED + close at
 * once (the call ran; its answer stays with its idempotency key), and once every handler
 * has returned the server holds none of the answers. (The handlers' own reply copies,
 * workers x reply, are the call's memory, not the front's: see the test above.) */
Test(http_slow, an_answer_larger_than_http_max_buffered_is_refused_507_not_held)
{
    idem_server_opts o = opts();
    o.http_max_buffered = MAX_BUFFERED;
    o.http_request_timeout_ms = 60000;
    serve(&o);
    enum { READERS = 6 };
    int fds[READERS];
    static const char req[] = "POST /" BIG " HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";
    size_t before = heap_in_use(), held = SIZE_MAX;
    for (int i = 0; i < READERS; i++) {
        fds[i] = dial_rcvbuf(4096);
        send_all(fds[i], req, sizeof(req) - 1);
    }
    for (int i = 0; i < READERS; i++) {
        char got[13] = "";
        ssize_t n = recv(fds[i], got, sizeof(got) - 1, MSG_WAITALL);
        cr_assert_eq(n, (ssize_t)sizeof(got) - 1, "no answer: %s", strerror(errno));
        cr_assert_str_eq(got, "HTTP/1.1 507", "an unheld answer was sent");
    }
    for (int i = 0; i < PATIENCE_ROUNDS && held > 4u * MAX_BUFFERED; i++) {
        size_t now = heap_in_use(); /* the workers finish their calls after answering */
        held = now > before ? now - before : 0;
        poll(NULL, 0, PACE_MS);
    }
    for (int i = 0; i < READERS; i++) {
        close(fds[i]);
    }
    cr_assert_leq(held, 4u * MAX_BUFFERED, "%zu bytes of answers held", held);
    cr_assert_eq(buffered_bytes(), 0);
}

/* An answer that does not fit in what is left of http_max_buffered is not held: 503 +
 * Retry-After + close after the call ran once; once room is back, a retry with the key
 * replays the answer without running the call again. */
Test(http_slow, an_answer_that_does_not_fit_now_is_refused_503_and_replayed_by_its_key)
{
    idem_server_opts o = opts();
    o.http_max_buffered = MAX_BUFFERED;
    serve(&o);
    int fd = hold_most_of_the_bound();
    const char *h[] = {"Idempotency-Key: mid"};
    tu_http r;
    char v[64];
    tu_http_post(&r, port, "/" MID, h, 1, "", 0);
    cr_assert_eq(r.status, 503, "an answer past http_max_buffered was held: %d", r.status);
    cr_assert_str_eq(tu_http_header(&r, "Retry-After", v, sizeof(v)), "1");
    cr_assert_not_null(strstr(r.body, "does not fit now"), "%s", r.body);
    tu_http_free(&r);
    cr_assert_eq(atomic_load(&mid_runs), 1);
    close(fd); /* the held body's memory goes back */
    int status = 0;
    for (int i = 0; i < PATIENCE_ROUNDS && status != 200; i++) {
        tu_http_post(&r, port, "/" MID, h, 1, "", 0);
        status = r.status;
        cr_assert(status == 200 || status == 503, "%d", status);
        cr_assert(status != 200 || r.body_len == MID_REPLY, "%zu bytes", r.body_len);
        tu_http_free(&r);
    }
    cr_assert_eq(status, 200, "the answer was not replayed once the bound had room");
    cr_assert_eq(atomic_load(&mid_runs), 1, "the call ran again: %d runs", atomic_load(&mid_runs));
}
