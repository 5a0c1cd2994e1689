/* Integration: the HTTP front against hostile bytes (the HTTP twin of test_hostile.c).
 * A real server on http://127.0.0.1:<free port>, raw TCP sockets, one handler that
 * counts its runs. Every group ends with a good call that still works, and asserts that
 * no handler ran for a refused request. README "Security" lists the bounds. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

#define ADD "t.Count/Add"
#define REQ_TIMEOUT_MS 1000 /* short, so that the slow-sender test stays short */
#define MAX_RESP 8

static tu_server S;
static int port;
static atomic_int runs;
static unsigned good_seq;

static idem_code h_add(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&runs, 1);
    size_t n;
    const void *p = idem_call_payload(call, &n);
    return idem_call_reply(call, IDEM_OK, p, n);
}

static void serve(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.http_request_timeout_ms = REQ_TIMEOUT_MS;
    atomic_store(&runs, 0);
    tu_server_create(&S, &o);
    cr_assert_eq(idem_server_register(S.srv, ADD, h_add, NULL, NULL), IDEM_OK);
    tu_server_listen(&S);
    cr_assert_eq(idem_server_listen_http(S.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    port = idem_server_http_port(S.srv);
}

static void teardown(void)
{
    tu_server_destroy(&S, false);
}

TestSuite(http_hostile, .init = serve, .fini = teardown);

/* ---- raw connections ---- */

static int dial(void)
{
    return tu_dial(port, 10);
}

/* Reads until the server closes (eof = true) or the 10 s bound passes (eof = false). */
static char *read_to_eof(int fd, size_t *len, bool *eof)
{
    size_t cap = 1 << 14, used = 0;
    char *buf = malloc(cap);
    cr_assert_not_null(buf);
    *eof = false;
    for (;;) {
        if (used + 1 >= cap) {
            cr_assert_not_null(buf = realloc(buf, cap *= 2));
        }
        ssize_t n = recv(fd, buf + used, cap - used - 1, 0);
        if (n <= 0) {
            *eof = n == 0 || (n < 0 && errno == ECONNRESET);
            break;
        }
        used += (size_t)n;
    }
    buf[used] = '\0';
    *len = used;
    return buf;
}

typedef struct resp {
    int status;
    bool close;
    char body[64];
    size_t blen;
} resp;

/* Splits what arrived into responses (each framed by its Content-Length). */
static int parse_responses(const char *buf, size_t len, resp *out, int max)
{
    int n = 0;
    const char *p = buf, *end = buf + len;
    while (p < end && n < max) {
        const char *he = strstr(p, "\r\n\r\n");
        resp *r = &out[n];
        if (he == NULL || sscanf(p, "HTTP/1.%*d %d", &r->status) != 1) {
            break;
        }
        const char *cl = strcasestr(p, "\r\nContent-Length:");
        const char *conn = strcasestr(p, "\r\nConnection: close");
        size_t blen = cl != NULL && cl < he ? strtoul(cl + 17, NULL, 10) : 0;
        r->close = conn != NULL && conn < he;
        he += 4;
        if ((size_t)(end - he) < blen) {
            break;
        }
        snprintf(r->body, sizeof(r->body), "%.*s", (int)blen, he);
        r->blen = blen;
        p = he + blen;
        n++;
    }
    return n;
}

/* Sends raw (optionally closing our side), reads to eof, returns the responses. */
static int exchange(const void *raw, size_t len, bool shut, resp *out, bool *eof)
{
    int fd = dial();
    tu_send_all(fd, raw, len);
    if (shut) {
        shutdown(fd, SHUT_WR);
    }
    size_t got;
    char *buf = read_to_eof(fd, &got, eof);
    close(fd);
    int n = parse_responses(buf, got, out, MAX_RESP);
    free(buf);
    return n;
}

/* A good call on a connection of its own works and runs the handler once. */
static void good_call_works(void)
{
    char key[64], hdr[96];
    snprintf(key, sizeof(key), "good-%u", ++good_seq);
    snprintf(hdr, sizeof(hdr), "Idempotency-Key: %s", key);
    const char *h[] = {hdr};
    int before = atomic_load(&runs);
    tu_http r;
    tu_http_post(&r, port, "/" ADD, h, 1, "7", 1);
    cr_assert_eq(r.status, 200, "a good call after the group: %d", r.status);
    cr_assert_str_eq(r.body, "7");
    tu_http_free(&r);
    cr_assert_eq(atomic_load(&runs), before + 1);
}

/* raw is refused: one response, 4xx with Connection: close, then the server closes; the
 * handler never ran (not for the request, not for a request hidden in its body). */
static void refused(const char *what, const char *raw, int want_status)
{
    resp r[MAX_RESP];
    bool eof;
    int before = atomic_load(&runs);
    int n = exchange(raw, strlen(raw), false, r, &eof);
    cr_expect_eq(n, 1, "%s: %d responses (want exactly one)", what, n);
    cr_expect(eof, "%s: the connection stayed open", what);
    if (n >= 1) {
        cr_expect_eq(r[0].status, want_status, "%s: status %d, want %d", what, r[0].status,
                     want_status);
        cr_expect(r[0].close, "%s: no Connection: close", what);
    }
    cr_expect_eq(atomic_load(&runs), before, "%s: a handler ran", what);
}

#define HIDDEN                                                                                 \
    "POST /" ADD " HTTP/1.1\r\nHost: x\r\nX-Caller: mallory\r\nIdempotency-Key: hidden\r\n"   \
    "Content-Length: 3\r\n\r\n100"
#define POST_HEAD "POST /" ADD " HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\n"

/* ---- every truncation of a valid request ---- */

static void truncations_of(const char *valid)
{
    size_t len = strlen(valid);
    for (size_t cut = 0; cut < len; cut++) {
        resp r[MAX_RESP];
        bool eof;
        int before = atomic_load(&runs);
        int n = exchange(valid, cut, true, r, &eof);
        cr_assert(eof, "cut at %zu: the connection stayed open after the client's eof", cut);
        cr_assert(n == 0 || (n == 1 && r[0].status >= 400), "cut at %zu: %d responses", cut, n);
        cr_assert_eq(atomic_load(&runs), before, "cut at %zu of %zu: a handler ran", cut, len);
    }
}

Test(http_hostile, no_truncation_of_a_valid_request_runs_anything)
{
    truncations_of(POST_HEAD "Content-Length: 5\r\n\r\n12345");
    truncations_of(POST_HEAD "Transfer-Encoding: chunked\r\n\r\n3;x=y\r\n123\r\n2\r\n45\r\n"
                             "0\r\nTrailer-A: b\r\n\r\n");
    good_call_works();
}

Test(http_hostile, a_valid_chunked_request_is_decoded)
{
    resp r[MAX_RESP];
    bool eof;
    const char *raw = POST_HEAD "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                                "3\r\n123\r\nA\r\n4567890abc\r\n0\r\n\r\n";
    int n = exchange(raw, strlen(raw), false, r, &eof);
    cr_assert_eq(n, 1);
    cr_assert_eq(r[0].status, 200);
    cr_assert_str_eq(r[0].body, "1234567890abc");
    cr_assert_eq(atomic_load(&runs), 1);
}

/* A body far larger than the first read, sent in pieces (the buffer grows meanwhile). */
Test(http_hostile, a_large_body_sent_in_pieces_arrives_whole)
{
    enum { BIG = 200 * 1000 };
    char *body = malloc(BIG);
    cr_assert_not_null(body);
    memset(body, 'b', BIG);
    for (int chunked = 0; chunked < 2; chunked++) {
        char head[256];
        int n = chunked ? snprintf(head, sizeof(head), POST_HEAD "Transfer-Encoding: chunked\r\n"
                                   "Connection: close\r\n\r\n%x\r\n", BIG)
                        : snprintf(head, sizeof(head), POST_HEAD "Content-Length: %d\r\n"
                                   "Expect: 100-continue\r\nConnection: close\r\n\r\n", BIG);
        int fd = dial();
        tu_send_all(fd, head, (size_t)n);
        for (size_t off = 0; off < BIG; off += 10000) {
            tu_send_all(fd, body + off, 10000);
        }
        tu_send_all(fd, "\r\n0\r\n\r\n", chunked ? 7 : 0);
        size_t got;
        bool eof;
        char *buf = read_to_eof(fd, &got, &eof);
        close(fd);
        const char *final = strstr(buf, "HTTP/1.1 100 Continue\r\n\r\n") == buf ? buf + 25 : buf;
        resp r[MAX_RESP];
        cr_assert_eq(parse_responses(final, got - (size_t)(final - buf), r, MAX_RESP), 1);
        cr_assert_eq(r[0].status, 200, "chunked=%d: %d", chunked, r[0].status);
        cr_assert_eq(r[0].blen, (size_t)BIG);
        free(buf);
    }
    free(body);
    cr_assert_eq(atomic_load(&runs), 2);
}

/* ---- smuggling ---- */

/* POSTs body to target with key, on a connection of its own: how many responses came,
 * the first in *first. */
static int post_to(const char *target, const char *key, const char *body, resp *first)
{
    char raw[256];
    int len = snprintf(raw, sizeof(raw),
                       "POST %s HTTP/1.1\r\nHost: x\r\nIdempotency-Key: %s\r\n"
                       "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                       target, key, strlen(body), body);
    resp r[MAX_RESP];
    bool eof;
    int n = exchange(raw, (size_t)len, false, r, &eof);
    if (n > 0) {
        *first = r[0];
    }
    return n;
}

/* An absolute-form target (RFC 9112 3.2.2) names the method by its path. The front reads
 * the target inside the connection's buffer, which holds no NUL after it: a scan for the
 * end of "://" ran past the buffer (caught by ASan; found by the fuzz target). */
Test(http_hostile, an_absolute_form_target_names_the_method_by_its_path)
{
    static const char *const targets[] = {"http://x/" ADD, "HTTPS://edge.example:8443/" ADD "?q=1"};
    for (size_t i = 0; i < sizeof(targets) / sizeof(targets[0]); i++) {
        char key[16], body[4];
        snprintf(key, sizeof(key), "abs-%zu", i);
        snprintf(body, sizeof(body), "4%zu", i);
        resp r = {0};
        cr_assert_eq(post_to(targets[i], key, body, &r), 1, "%s: not one response", targets[i]);
        cr_assert_eq(r.status, 200, "%s: status %d", targets[i], r.status);
        cr_assert_str_eq(r.body, body);
    }
    cr_assert_eq(atomic_load(&runs), 2);
}

/* RFC 3986: in http://x?/M the path is empty ("?/M" is the query), and in http://x#/M
 * too: neither names method M (a proxy that routes by path sees another request than the
 * one that would run). A stranger's review found both ran M. */
Test(http_hostile, an_absolute_form_target_with_a_query_before_any_slash_names_no_method)
{
    static const char *const targets[] = {"http://x?/" ADD, "http://x#/" ADD};
    for (size_t i = 0; i < sizeof(targets) / sizeof(targets[0]); i++) {
        resp r = {0};
        cr_expect(post_to(targets[i], "q", "4", &r) == 1 && r.status != 200,
                  "%s: not one refusal (status %d): it ran " ADD, targets[i], r.status);
    }
    cr_expect_eq(atomic_load(&runs), 0, "the handler ran %d times", atomic_load(&runs));
}

/* A server must accept the absolute-form (RFC 9112 3.2.2): GET http://x/metrics is
 * GET /metrics. */
Test(http_hostile, an_absolute_form_get_of_the_metrics_path_is_served)
{
    static const char raw[] = "GET http://x/metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    resp r[MAX_RESP];
    bool eof;
    int n = exchange(raw, sizeof(raw) - 1, false, r, &eof);
    cr_assert_eq(n, 1);
    cr_expect_eq(r[0].status, 200, "GET http://x/metrics: status %d", r[0].status);
}

Test(http_hostile, content_length_with_transfer_encoding_is_refused)
{
    refused("CL.TE", POST_HEAD "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            HIDDEN, 400);
    refused("TE.CL", POST_HEAD "Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n"
            "5c\r\n" HIDDEN "\r\n0\r\n\r\n", 400);
    good_call_works();
}

Test(http_hostile, obfuscated_or_unknown_transfer_encoding_is_refused)
{
    static const char *const te[] = {
        "Transfer-Encoding: xchunked\r\n", "Transfer-Encoding: chunked, identity\r\n",
        "Transfer-Encoding: identity\r\n", "Transfer-Encoding: gzip, chunked\r\n",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n",
        "Transfer-Encoding : chunked\r\n", "Transfer-Encoding: \"chunked\"\r\n",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding:\r\n chunked\r\n", "X-Pad: a\r\n Transfer-Encoding: chunked\r\n",
        "Transfer-Encoding: chunk\xc3\xa9\r\n", "Transfer_Encoding: chunked\r\n",
    };
    for (size_t i = 0; i < sizeof(te) / sizeof(te[0]); i++) {
        char raw[1024];
        snprintf(raw, sizeof(raw), "%s%s\r\n0\r\n\r\n%s", POST_HEAD, te[i], HIDDEN);
        refused(te[i], raw, 400);
    }
    good_call_works();
}

Test(http_hostile, a_content_length_that_is_not_one_plain_number_is_refused)
{
    static const char *const cl[] = {
        "Content-Length: +3\r\n",        "Content-Length: -3\r\n",
        "Content-Length: 3 3\r\n",       "Content-Length: 3, 3\r\n",
        "Content-Length: 3\r\nContent-Length: 3\r\n", "Content-Length: 0x3\r\n",
        "Content-Length: 3\r\nContent-Length: 4\r\n", "Content-Length:\r\n",
        "Content-Length: 99999999999999999999999\r\n", "Content-Length : 3\r\n",
    };
    for (size_t i = 0; i < sizeof(cl) / sizeof(cl[0]); i++) {
        char raw[1024];
        snprintf(raw, sizeof(raw), "%s%s\r\n123%s", POST_HEAD, cl[i], HIDDEN);
        refused(cl[i], raw, 400);
    }
    good_call_works();
}

Test(http_hostile, bare_cr_or_lf_and_control_bytes_are_refused)
{
    refused("bare LF request line", "POST /" ADD " HTTP/1.1\nHost: x\r\n\r\n", 400);
    refused("bare LF header", POST_HEAD "X-A: b\nContent-Length: 3\r\n\r\n100", 400);
    refused("bare CR header", POST_HEAD "X-A: b\rContent-Length: 3\r\n\r\n100", 400);
    refused("bare CR request line", "POST /" ADD "\r HTTP/1.1\r\nHost: x\r\n\r\n", 400);
    refused("NUL in a value", POST_HEAD "X-A: b\x01" "c\r\nContent-Length: 0\r\n\r\n", 400);
    refused("space in a name", POST_HEAD "X A: b\r\nContent-Length: 0\r\n\r\n", 400);
    refused("no colon", POST_HEAD "X-A\r\nContent-Length: 0\r\n\r\n", 400);
    refused("two spaces", "POST  /" ADD " HTTP/1.1\r\nHost: x\r\n\r\n", 400);
    refused("two hosts", POST_HEAD "Host: y\r\nContent-Length: 0\r\n\r\n", 400);
    refused("a Host with a slash", "POST /" ADD " HTTP/1.1\r\nHost: a/b\r\n\r\n", 400);
    good_call_works();
}

Test(http_hostile, a_refused_or_unrouted_request_never_lets_its_body_be_a_request)
{
    char raw[1024];
    snprintf(raw, sizeof(raw), "POST /" ADD " HTTP/1.1\r\nContent-Length: %zu\r\n\r\n%s",
             strlen(HIDDEN), HIDDEN); /* no Host */
    refused("no Host", raw, 400);
    snprintf(raw, sizeof(raw), "GET /nothing/here HTTP/1.1\r\nHost: x\r\nContent-Length: %zu"
             "\r\nConnection: close\r\n\r\n%s", strlen(HIDDEN), HIDDEN);
    resp r[MAX_RESP];
    bool eof;
    int n = exchange(raw, strlen(raw), false, r, &eof);
    cr_expect_eq(n, 1, "unrouted: %d responses", n);
    cr_expect(n >= 1 && r[0].status >= 400 && r[0].status < 500);
    cr_expect_eq(atomic_load(&runs), 0, "the body of an unrouted request ran");
    good_call_works();
}

/* ---- bounds ---- */

static char *repeat(const char *prefix, char c, size_t n, const char *suffix)
{
    size_t pl = strlen(prefix), sl = strlen(suffix);
    char *s = malloc(pl + n + sl + 1);
    cr_assert_not_null(s);
    memcpy(s, prefix, pl);
    memset(s + pl, c, n);
    memcpy(s + pl + n, suffix, sl + 1);
    return s;
}

Test(http_hostile, oversized_lines_headers_and_chunks_are_refused)
{
    char *s = repeat("POST /", 'a', 9000, " HTTP/1.1\r\nHost: x\r\n\r\n");
    refused("request line of 9 KB", s, 414);
    free(s);
    s = repeat(POST_HEAD "X-Big: ", 'a', 9000, "\r\nContent-Length: 0\r\n\r\n");
    refused("header line of 9 KB", s, 400);
    free(s);
    char many[8192] = POST_HEAD;
    for (int i = 0; i < 70; i++) {
        snprintf(many + strlen(many), sizeof(many) - strlen(many), "X-H%d: v\r\n", i);
    }
    strcat(many, "Content-Length: 0\r\n\r\n");
    refused("70 header lines", many, 400);
    refused("chunk size of 17 hex digits",
            POST_HEAD "Transfer-Encoding: chunked\r\n\r\n10000000000000003\r\n123\r\n0\r\n\r\n",
            400);
    refused("chunk size over the body limit",
            POST_HEAD "Transfer-Encoding: chunked\r\n\r\nfffffff\r\n123\r\n0\r\n\r\n", 413);
    refused("chunk size not hex",
            POST_HEAD "Transfer-Encoding: chunked\r\n\r\n3x\r\n123\r\n0\r\n\r\n", 400);
    s = repeat(POST_HEAD "Transfer-Encoding: chunked\r\n\r\n", 'x', 0, "");
    for (int i = 0; i < 20; i++) { /* 20 chunks of one byte, each with a 4 KB extension */
        char *ext = repeat("1;e=", 'x', 4000, "\r\n1\r\n"), *t = s;
        s = repeat(t, 'x', 0, ext);
        free(t), free(ext);
    }
    refused("80 KB of chunk extensions for 20 bytes", s, 400);
    free(s);
    refused("chunk without its CRLF",
            POST_HEAD "Transfer-Encoding: chunked\r\n\r\n3\r\n1234\r\n0\r\n\r\n", 400);
    good_call_works();
}

/* ---- slow senders ---- */

Test(http_hostile, a_slow_sender_is_cut_off_and_others_are_served)
{
    const char *raw = POST_HEAD "Content-Length: 3\r\n\r\n100";
    int fd = dial();
    bool closed = false;
    struct timespec pace = {0, 200 * 1000 * 1000}; /* pacing the trickle, not a wait */
    for (size_t i = 0; i < strlen(raw) && !closed; i++) {
        if (send(fd, raw + i, 1, MSG_NOSIGNAL) != 1) {
            closed = true;
            break;
        }
        if (i == 2) {
            good_call_works(); /* while the trickle goes on */
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        closed = poll(&p, 1, 0) == 1;
        nanosleep(&pace, NULL);
    }
    size_t got;
    bool eof;
    char *buf = read_to_eof(fd, &got, &eof);
    close(fd);
    cr_assert(eof, "a request trickling a byte per 200 ms was not cut off");
    resp r[MAX_RESP];
    int n = parse_responses(buf, got, r, MAX_RESP);
    free(buf);
    cr_assert(n == 0 || (n == 1 && r[0].status == 408 && r[0].close), "%d responses", n);
    cr_assert_eq(atomic_load(&runs), 1, "only the good call ran");
    good_call_works();
}

/* ---- pipelining ---- */

Test(http_hostile, pipelined_requests_are_answered_in_order_each_once)
{
    const char *raw =
        "POST /" ADD " HTTP/1.1\r\nHost: x\r\nIdempotency-Key: p1\r\nContent-Length: 1\r\n\r\n1"
        "POST /" ADD " HTTP/1.1\r\nHost: x\r\nIdempotency-Key: p2\r\nTransfer-Encoding: "
        "chunked\r\n\r\n2\r\n22\r\n0\r\n\r\n"
        "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        "POST /" ADD " HTTP/1.1\r\nHost: x\r\nIdempotency-Key: p3\r\nContent-Length: 3\r\n"
        "Connection: close\r\n\r\n333";
    resp r[MAX_RESP];
    bool eof;
    int n = exchange(raw, strlen(raw), false, r, &eof);
    cr_assert_eq(n, 4, "%d responses", n);
    cr_assert(eof);
    cr_assert_eq(r[0].status, 200);
    cr_assert_str_eq(r[0].body, "1");
    cr_assert_eq(r[1].status, 200);
    cr_assert_str_eq(r[1].body, "22");
    cr_assert_eq(r[2].status, 200);
    cr_assert_eq(r[3].status, 200);
    cr_assert_str_eq(r[3].body, "333");
    cr_assert(r[3].close && !r[0].close);
    cr_assert_eq(atomic_load(&runs), 3);
    good_call_works();
}

/* ---- random bytes ---- */

static const char *const words[] = {
    "POST ", "GET ", "/" ADD, "/metrics", " HTTP/1.1", " HTTP/1.0", "\r\n", "\n", "\r",
    "Host: x", "Content-Length: ", "Transfer-Encoding: chunked", "Idempotency-Key: r", "0",
    "3", "ff", ":", " ", "\t", "chunked", ",", "100", "\r\n\r\n", "Connection: close",
};

static size_t random_input(char *buf, size_t cap, unsigned *seed)
{
    size_t len = 0, parts = (size_t)rand_r(seed) % 24;
    for (size_t i = 0; i < parts && len + 64 < cap; i++) {
        if (rand_r(seed) % 3 == 0) {
            size_t n = (size_t)rand_r(seed) % 16;
            for (size_t j = 0; j < n; j++) {
                buf[len++] = (char)rand_r(seed);
            }
        } else {
            const char *w = words[(size_t)rand_r(seed) % (sizeof(words) / sizeof(words[0]))];
            memcpy(buf + len, w, strlen(w));
            len += strlen(w);
        }
    }
    return len;
}

Test(http_hostile, random_bytes_never_crash_and_every_run_is_answered_once)
{
    unsigned seed = 2718;
    int oks = 0;
    for (int i = 0; i < 3000; i++) {
        char buf[2048];
        size_t len = random_input(buf, sizeof(buf), &seed);
        resp r[MAX_RESP];
        bool eof;
        int n = exchange(buf, len, true, r, &eof);
        cr_assert(eof, "input %d: the connection stayed open after the client's eof", i);
        for (int j = 0; j < n; j++) {
            oks += r[j].status == 200 && r[j].body[0] != '#'; /* not /metrics */
        }
    }
    /* every run was answered (200 with its payload; a replay is a 200 without a run) */
    cr_assert_leq(atomic_load(&runs), oks, "runs %d, answered %d", atomic_load(&runs), oks);
    good_call_works();
}
