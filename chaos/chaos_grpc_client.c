/* The workload's gRPC client (chaos_workload.c): one unary call through a server's gRPC
 * front, on a connection of its own, framed by libnghttp2's client session. Its answer
 * is an idem_result as idem_client_call gives one (grpc-message percent-decoded, the
 * payload without its length prefix, idempotent-replayed), so the history records the
 * calls of both fronts alike and the checker compares them. A connection refused or cut
 * is UNAVAILABLE, no answer within the deadline + 1 s DEADLINE_EXCEEDED: neither is
 * definitive, the patient caller retries (through either front). */
#include <errno.h>
#include <nghttp2/nghttp2.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "chaos.h"

#define ANSWER_CAP 4096

typedef struct grpc_call {
    int fd;
    uint8_t req[5 + 64]; /* the message: length prefix and payload */
    size_t req_len, req_off;
    uint8_t answer[ANSWER_CAP]; /* DATA received */
    size_t answer_len;
    char status[8], message[512];
    bool replayed, closed;
} grpc_call;

static ssize_t on_send(nghttp2_session *s, const uint8_t *data, size_t len, int flags, void *u)
{
    grpc_call *c = u;
    (void)s;
    (void)flags;
    ssize_t n = send(c->fd, data, len, MSG_NOSIGNAL);
    return n < 0 ? NGHTTP2_ERR_CALLBACK_FAILURE : n;
}

static ssize_t on_read(nghttp2_session *s, int32_t id, uint8_t *buf, size_t len, uint32_t *flags,
                       nghttp2_data_source *src, void *u)
{
    grpc_call *c = u;
    (void)s;
    (void)id;
    (void)src;
    size_t n = c->req_len - c->req_off < len ? c->req_len - c->req_off : len;
    memcpy(buf, c->req + c->req_off, n);
    c->req_off += n;
    if (c->req_off == c->req_len) {
        *flags |= NGHTTP2_DATA_FLAG_EOF;
    }
    return (ssize_t)n;
}

static int on_data(nghttp2_session *s, uint8_t flags, int32_t id, const uint8_t *data, size_t len,
                   void *u)
{
    grpc_call *c = u;
    (void)s;
    (void)flags;
    (void)id;
    if (len > ANSWER_CAP - c->answer_len) {
        return NGHTTP2_ERR_CALLBACK_FAILURE; /* the chaos methods answer a line */
    }
    memcpy(c->answer + c->answer_len, data, len);
    c->answer_len += len;
    return 0;
}

/* grpc-message is percent-encoded (docs/deploying.md "gRPC"). */
static void percent_decode(char *out, size_t cap, const uint8_t *v, size_t len)
{
    size_t o = 0;
    for (size_t i = 0; i < len && o + 1 < cap; i++) {
        unsigned x;
        if (v[i] == '%' && i + 2 < len && sscanf((const char *)v + i + 1, "%2x", &x) == 1) {
            out[o++] = (char)x;
            i += 2;
        } else {
            out[o++] = (char)v[i];
        }
    }
    out[o] = '\0';
}

static int on_header(nghttp2_session *s, const nghttp2_frame *f, const uint8_t *name, size_t nlen,
                     const uint8_t *value, size_t vlen, uint8_t flags, void *u)
{
    grpc_call *c = u;
    (void)s;
    (void)f;
    (void)flags;
    if (nlen == 11 && memcmp(name, "grpc-status", 11) == 0) {
        snprintf(c->status, sizeof(c->status), "%.*s", (int)(vlen < 7 ? vlen : 7), value);
    } else if (nlen == 12 && memcmp(name, "grpc-message", 12) == 0) {
        percent_decode(c->message, sizeof(c->message), value, vlen);
    } else if (nlen == 19 && memcmp(name, "idempotent-replayed", 19) == 0) {
        c->replayed = vlen == 4 && memcmp(value, "true", 4) == 0;
    }
    return 0;
}

static int on_close(nghttp2_session *s, int32_t id, uint32_t err, void *u)
{
    (void)s;
    (void)id;
    (void)err;
    ((grpc_call *)u)->closed = true;
    return 0;
}

static nghttp2_session *session_new(grpc_call *c)
{
    nghttp2_session_callbacks *cb;
    nghttp2_session *s = NULL;
    if (nghttp2_session_callbacks_new(&cb) != 0) {
        return NULL;
    }
    nghttp2_session_callbacks_set_send_callback(cb, on_send);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, on_data);
    nghttp2_session_callbacks_set_on_header_callback(cb, on_header);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, on_close);
    if (nghttp2_session_client_new(&s, cb, c) != 0) {
        s = NULL;
    }
    nghttp2_session_callbacks_del(cb);
    return s;
}

#define NV(n, v)                                                                                   \
    {                                                                                              \
        (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, strlen(v), NGHTTP2_NV_FLAG_NONE             \
    }

static bool call_submit(nghttp2_session *s, grpc_call *c, const idem_request *q)
{
    char path[160], timeout[24];
    snprintf(path, sizeof(path), "/%s", q->method);
    snprintf(timeout, sizeof(timeout), "%um", q->deadline_ms);
    bool token = q->token != NULL;
    nghttp2_nv nv[] = {NV(":method", "POST"),
                       NV(":scheme", "http"),
                       NV(":authority", "chaos"),
                       NV(":path", path),
                       NV("content-type", "application/grpc"),
                       NV("te", "trailers"),
                       NV("grpc-timeout", timeout),
                       NV("x-caller", q->caller),
                       token ? (nghttp2_nv)NV("idem-token", q->token)
                             : (nghttp2_nv)NV("idempotency-key", q->idempotency_key)};
    nghttp2_data_provider body = {.read_callback = on_read};
    c->req_len = 5 + q->payload_len;
    c->req[0] = 0;
    c->req[1] = c->req[2] = c->req[3] = 0;
    c->req[4] = (uint8_t)q->payload_len;
    memcpy(c->req + 5, q->payload, q->payload_len);
    return nghttp2_submit_settings(s, NGHTTP2_FLAG_NONE, NULL, 0) == 0 &&
           nghttp2_submit_request(s, NULL, nv, sizeof(nv) / sizeof(nv[0]), &body, NULL) > 0 &&
           nghttp2_session_send(s) == 0;
}

/* Until the stream closed, the connection ended or end: true when it closed. */
static bool call_wait(nghttp2_session *s, grpc_call *c, uint64_t end)
{
    uint8_t buf[4096];
    while (!c->closed && chaos_now_ms() < end) {
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        if (poll(&p, 1, 50) < 0 && errno != EINTR) {
            return false;
        }
        ssize_t n = p.revents ? recv(c->fd, buf, sizeof(buf), 0) : -1;
        if (p.revents && (n <= 0 || nghttp2_session_mem_recv(s, buf, (size_t)n) < 0 ||
                          nghttp2_session_send(s) != 0)) {
            return c->closed;
        }
    }
    return c->closed;
}

/* r from what c received (or from what went wrong: code). */
static idem_code call_result(grpc_call *c, idem_code code, const char *why, idem_result *r)
{
    memset(r, 0, sizeof(*r));
    r->attempts = 1;
    if (code == IDEM_OK && c->status[0] == '\0') {
        code = IDEM_UNAVAILABLE, why = "grpc: the stream ended without grpc-status";
    } else if (code == IDEM_OK) {
        code = (idem_code)atoi(c->status);
        why = c->message;
    }
    r->code = code;
    r->replayed = c->replayed;
    r->message = strdup(why);
    size_t len = c->answer_len >= 5 ? ((size_t)c->answer[3] << 8 | c->answer[4]) : 0;
    if (code == IDEM_OK && len + 5 <= c->answer_len && (r->payload = malloc(len + 1)) != NULL) {
        memcpy(r->payload, c->answer + 5, len);
        r->payload_len = len;
    }
    return code;
}

idem_code chaos_grpc_call(int port, const idem_request *q, idem_result *r)
{
    grpc_call c = {.fd = -1};
    if (q->payload_len > sizeof(c.req) - 5) {
        return call_result(&c, IDEM_INVALID_ARGUMENT, "grpc: a payload over 64 bytes", r);
    }
    if ((c.fd = chaos_connect_local(port)) < 0) {
        return call_result(&c, IDEM_UNAVAILABLE, "grpc: no connection", r);
    }
    nghttp2_session *s = session_new(&c);
    uint64_t end = chaos_now_ms() + q->deadline_ms + 1000;
    idem_code code = IDEM_OK;
    const char *why = "";
    if (s == NULL || !call_submit(s, &c, q)) {
        code = IDEM_UNAVAILABLE, why = "grpc: the request could not be sent";
    } else if (!call_wait(s, &c, end)) {
        bool late = chaos_now_ms() >= end;
        code = late ? IDEM_DEADLINE_EXCEEDED : IDEM_UNAVAILABLE;
        why = late ? "grpc: no answer in time" : "grpc: the connection ended";
    }
    nghttp2_session_del(s);
    close(c.fd);
    return call_result(&c, code, why, r);
}
