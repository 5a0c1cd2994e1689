/* The HTTP front: the same chain behind POST /{package.Service}/{Method}.
 *
 * Requests arrive framed by the front's own strict HTTP/1.1 server (http_conn.c over
 * nng streams; nng 1.5.2's HTTP server is not used: README "Security").
 *
 * An HTTP request becomes an idem.v1.Request frame (body = payload, Idempotency-Key =
 * key, X-Request-Id, the caller header, Idem-Token; Idem-Signature, Idem-Timestamp and
 * Idem-Signer as metadata for the identity step) and joins the same work queue as
 * the nng calls, so handlers, LMDB writes and duplicate waits stay on the workers; the
 * connection's callback only translates and hands over. Header values are taken whole:
 * their bounds are checked once, for both fronts, by the request decoder (a value over
 * its bound is a 400 naming the header, never a cut). Status mapping follows the IETF
 * Idempotency-Key draft where it speaks (400 missing key, 422 key reused with another
 * payload, 409 still in progress) and the gRPC-HTTP mapping elsewhere. At most
 * max_pending requests are queued or running; more get 429. */
#include <nng/nng.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"
#include "http_front.h"
#include "tls.h"
#include "json.h"

struct idem_http {
    idem_dispatch *d;
    idem_observer *obs;
    idem_hsrv *hs;
    size_t max_body, max_pending;
    atomic_size_t pending; /* requests handed to the workers and not yet answered */
    char caller_header[64];
    char tls_caller[IDEM_MAX_CALLER + 1]; /* https: the caller of every verified client */
    int port;
};

typedef struct http_job {
    idem_job job; /* first */
    idem_hconn *conn;
    uint8_t *frame;
    idem_http *h;
} http_job;

static const struct {
    idem_code code;
    uint16_t status;
} code_status[] = {
    {IDEM_OK, 200},
    {IDEM_CANCELLED, 499},
    {IDEM_UNKNOWN, 500},
    {IDEM_INVALID_ARGUMENT, 400},
    {IDEM_DEADLINE_EXCEEDED, 504},
    {IDEM_NOT_FOUND, 404},
    {IDEM_ALREADY_EXISTS, 409},
    {IDEM_PERMISSION_DENIED, 403},
    {IDEM_RESOURCE_EXHAUSTED, 429},
    {IDEM_FAILED_PRECONDITION, 400},
    {IDEM_ABORTED, 409},
    {IDEM_OUT_OF_RANGE, 400},
    {IDEM_UNIMPLEMENTED, 404},
    {IDEM_INTERNAL, 500},
    {IDEM_UNAVAILABLE, 503},
    {IDEM_DATA_LOSS, 500},
    {IDEM_UNAUTHENTICATED, 401},
};

static uint16_t http_status(const idem_call *call)
{
    if (call->reason != NULL && strcmp(call->reason, IDEM_REASON_KEY_REUSED) == 0) {
        return 422;
    }
    if (call->reason != NULL && strcmp(call->reason, IDEM_REASON_TOO_LARGE) == 0) {
        return 413;
    }
    if (call->reason != NULL && strcmp(call->reason, IDEM_REASON_RESULT_GONE) == 0) {
        return 410; /* done before, its result expired (a tombstone): never run again */
    }
    for (size_t i = 0; i < IDEM_ARRAY_LEN(code_status); i++) {
        if (code_status[i].code == call->code) {
            return code_status[i].status;
        }
    }
    return 500;
}

/* A header value we may copy into a response: no control characters. */
static bool header_safe(const char *v)
{
    for (; *v; v++) {
        if ((unsigned char)*v < 0x20 || *v == 0x7f) {
            return false;
        }
    }
    return true;
}

/* The token issue answer as JSON rather than a protobuf payload. */
static bool token_json(const idem_call *call, char *out, size_t cap)
{
    Idem__V1__IssueTokenResponse *t =
        idem__v1__issue_token_response__unpack(NULL, call->payload_len, call->payload);
    if (t == NULL) {
        return false;
    }
    char tok[160];
    bool ok = idem__json_string(tok, sizeof(tok), t->token);
    ok = ok && snprintf(out, cap, "{\"token\":%s,\"expires_unix_ms\":%llu}", tok,
                        (unsigned long long)t->expires_unix_ms) < (int)cap;
    idem__v1__issue_token_response__free_unpacked(t, NULL);
    return ok;
}

/* The body's content type, then sends the response on c. */
static void send_body(idem_hconn *c, idem_hres *res, const idem_call *call)
{
    char buf[IDEM_MAX_MESSAGE * 6 + 512], msg[IDEM_MAX_MESSAGE * 6 + 8];
    if (call->code == IDEM_OK && strcmp(call->req->method, IDEM_TOKEN_ISSUE_METHOD) == 0 &&
        token_json(call, buf, sizeof(buf))) {
        idem__hres_header(res, "Content-Type", "application/json");
        idem__hconn_send(c, res, buf, strlen(buf));
        return;
    }
    if (call->code == IDEM_OK) {
        idem__hres_header(res, "Content-Type", "application/octet-stream");
        idem__hconn_send(c, res, call->payload, call->payload_len);
        return;
    }
    if (!idem__json_string(msg, sizeof(msg), call->message != NULL ? call->message : "")) {
        strcpy(msg, "\"\"");
    }
    char rid[IDEM_MAX_REQUEST_ID * 6 + 8];
    if (!idem__json_string(rid, sizeof(rid), call->request_id)) {
        strcpy(rid, "\"\"");
    }
    int n = snprintf(buf, sizeof(buf), "{\"code\":\"%s\",\"message\":%s,\"request_id\":%s}",
                     idem_code_name(call->code), msg, rid);
    idem__hres_header(res, "Content-Type", "application/json");
    idem__hconn_send(c, res, buf, (size_t)n);
}

/* Metadata as headers: the library's own under their HTTP names, the rest Idem-Meta-*. */
static void set_headers(idem_hres *res, const idem_call *call)
{
    char name[IDEM_MAX_METADATA_NAME + 16], num[24];
    snprintf(num, sizeof(num), "%d", (int)call->code);
    idem__hres_header(res, "X-Request-Id", header_safe(call->request_id) ? call->request_id : "");
    idem__hres_header(res, "Grpc-Status", num);
    if (call->replayed) {
        idem__hres_header(res, "Idempotent-Replayed", "true");
    }
    for (size_t i = 0; i < call->meta_count; i++) {
        const idem_kv *kv = &call->meta[i];
        if (!header_safe(kv->name) || !header_safe(kv->value) || strchr(kv->name, ':') ||
            strcmp(kv->name, "request-id") == 0) {
            continue;
        }
        if (strcmp(kv->name, "retry-after-ms") == 0) {
            snprintf(num, sizeof(num), "%lu", (strtoul(kv->value, NULL, 10) + 999) / 1000);
            idem__hres_header(res, "Retry-After", num);
        } else if (strcmp(kv->name, "idem-first-at") == 0) {
            idem__hres_header(res, "Idem-First-At", kv->value);
        } else if (strcmp(kv->name, "idem-result-gone") == 0) {
            idem__hres_header(res, "Idem-Result-Gone", kv->value);
        } else if (strcmp(kv->name, "idem-key") == 0) {
            idem__hres_header(res, "Idem-Key", kv->value);
        } else {
            snprintf(name, sizeof(name), "Idem-Meta-%s", kv->name);
            idem__hres_header(res, name, kv->value);
        }
    }
}

static const char *reason_phrase(uint16_t status)
{
    static const struct {
        uint16_t status;
        const char *reason;
    } reasons[] = {
        {200, "OK"},
        {400, "Bad Request"},
        {401, "Unauthorized"},
        {403, "Forbidden"},
        {404, "Not Found"},
        {405, "Method Not Allowed"},
        {409, "Conflict"},
        {410, "Gone"},
        {413, "Content Too Large"},
        {422, "Unprocessable Content"},
        {429, "Too Many Requests"},
        {499, "Client Closed Request"},
        {500, "Internal Server Error"},
        {503, "Service Unavailable"},
        {504, "Gateway Timeout"},
    };
    for (size_t i = 0; i < IDEM_ARRAY_LEN(reasons); i++) {
        if (reasons[i].status == status) {
            return reasons[i].reason;
        }
    }
    return "Unknown";
}

/* Finishes the HTTP exchange with the call's answer. */
static void respond(idem_hconn *c, const idem_call *call)
{
    idem_hres res;
    uint16_t status = http_status(call);
    idem__hres_start(&res, status, reason_phrase(status));
    set_headers(&res, call);
    send_body(c, &res, call);
}

static void http_job_free(http_job *j)
{
    atomic_fetch_sub(&j->h->pending, 1);
    free(j->frame);
    free(j);
}

static void http_job_answer(idem_job *job)
{
    http_job *j = (http_job *)job;
    /* Its jobs do not ask for wire replies, so a replay is loaded already (a no-op). */
    if (idem__call_materialize_replay(&job->s.call) != IDEM_OK) {
        idem__call_reset_response(&job->s.call);
        idem_call_fail(&job->s.call, IDEM_INTERNAL, "out of memory loading the replay");
    }
    idem__dispatch_count(j->h->d, &job->s);
    respond(j->conn, &job->s.call);
    idem__dispatch_discard(&job->s);
    http_job_free(j);
}

/* At shutdown: answer 503 rather than leave the connection hanging. */
static void http_job_drop(idem_job *job)
{
    http_job *j = (http_job *)job;
    idem_hres res;
    static const char body[] = "{\"code\":\"UNAVAILABLE\",\"message\":\"server shutting down\"}";
    idem__hres_start(&res, 503, reason_phrase(503));
    idem__hres_header(&res, "Content-Type", "application/json");
    res.close = true;
    idem__hconn_send(j->conn, &res, body, sizeof(body) - 1);
    http_job_free(j);
}

static void respond_now(idem_hconn *c, idem_http *h, idem_served *s)
{
    idem__dispatch_count(h->d, s);
    respond(c, &s->call);
    idem__dispatch_discard(s);
}

/* Answers with a bare status (routing, out of memory). */
static void respond_status(idem_hconn *c, uint16_t status, const char *allow)
{
    idem_hres res;
    idem__hres_start(&res, status, reason_phrase(status));
    if (allow != NULL) {
        idem__hres_header(&res, "Allow", allow);
    }
    res.close = status >= 500;
    idem__hconn_send(c, &res, "", 0);
}

/* POST /{package.Service}/{Method}: runs on nng's thread, so it only hands over. */
static void http_call(idem_hconn *c, idem_http *h, const idem_hreq *r, const void *body,
                      size_t blen)
{
    idem_served s;
    http_job *j;
    const char *err = NULL;
    size_t len;
    if (atomic_fetch_add(&h->pending, 1) >= h->max_pending) {
        atomic_fetch_sub(&h->pending, 1);
        idem__dispatch_busy(h->d, &s);
        respond_now(c, h, &s);
        return;
    }
    if ((j = calloc(1, sizeof(*j))) == NULL ||
        (j->frame = idem__http_request_frame(r, h->caller_header, body, blen, &len, &err)) ==
            NULL) {
        atomic_fetch_sub(&h->pending, 1);
        free(j);
        if (err == NULL) {
            respond_status(c, 500, NULL);
            return;
        }
        idem__dispatch_reject(h->d, &s, IDEM_REASON_BAD_KEY, IDEM_INVALID_ARGUMENT, err);
        respond_now(c, h, &s);
        return;
    }
    j->conn = c;
    j->h = h;
    j->job.frame = j->frame;
    j->job.len = len;
    j->job.frame_built = true; /* the body <= max_frame, the head <= its bound */
    snprintf(j->job.peer.tls_caller, sizeof(j->job.peer.tls_caller), "%s", h->tls_caller);
    j->job.answer = http_job_answer;
    j->job.drop = http_job_drop;
    idem_code code = idem__dispatch_enqueue(h->d, &j->job);
    if (code == IDEM_OK) {
        return; /* a worker answers */
    }
    http_job_free(j);
    if (code == IDEM_RESOURCE_EXHAUSTED) {
        idem__dispatch_busy(h->d, &s);
    } else {
        idem__dispatch_reject(h->d, &s, NULL, IDEM_UNAVAILABLE, "server shutting down");
    }
    respond_now(c, h, &s);
}

/* GET /metrics: cheap enough to answer on nng's thread. The observer's metrics, then
 * the bytes the connections' buffers hold against http_max_buffered. */
static void http_metrics(idem_hconn *c, idem_http *h)
{
    char *text = idem__metrics_text(h->obs), line[160];
    if (text == NULL) {
        respond_status(c, 500, NULL);
        return;
    }
    int n = snprintf(line, sizeof(line),
                     "# TYPE idem_http_buffered_bytes gauge\nidem_http_buffered_bytes %zu\n",
                     atomic_load(&h->hs->buffered));
    idem_hres res;
    idem__hres_start(&res, 200, "OK");
    idem__hres_header(&res, "Content-Type", "text/plain; version=0.0.4");
    size_t tl = strlen(text);
    char *body = malloc(tl + (size_t)n);
    if (body == NULL) {
        free(text);
        free(res.buf);
        respond_status(c, 500, NULL);
        return;
    }
    memcpy(body, text, tl);
    memcpy(body + tl, line, (size_t)n);
    idem__hconn_send(c, &res, body, tl + (size_t)n);
    free(body);
    free(text);
}

static bool is_path(const idem_hreq *r, const char *path)
{
    size_t n;
    const char *p = idem__http_target_path(r, &n);
    return n == strlen(path) && memcmp(p, path, n) == 0;
}

/* A complete request from a connection: POST anything is a call, GET or HEAD
 * /metrics the metrics; the rest 405. */
static void http_request_cb(idem_hconn *c, const idem_hreq *r, const void *body, size_t blen,
                            void *arg)
{
    idem_http *h = arg;
    if (r->mlen == 4 && memcmp(r->method, "POST", 4) == 0) {
        http_call(c, h, r, body, blen);
    } else if (((r->mlen == 3 && memcmp(r->method, "GET", 3) == 0) ||
                (r->mlen == 4 && memcmp(r->method, "HEAD", 4) == 0)) &&
               is_path(r, "/metrics")) {
        http_metrics(c, h);
    } else {
        respond_status(c, 405, is_path(r, "/metrics") ? "GET, HEAD" : "POST");
    }
}

/* https: only clients with a certificate from the listener's CA connect, and every
 * request on it is that CA's caller. */
static idem_code https_configure(idem_http *h, const idem_tls_listener *tls, nng_tls_config **cfg)
{
    idem_code code = idem__tls_server_config(cfg, tls);
    if (code != IDEM_OK) {
        return code;
    }
    snprintf(h->tls_caller, sizeof(h->tls_caller), "%s", tls->caller);
    return IDEM_OK;
}

idem_code idem__http_start(const char *url, const idem_http_cfg *cfg, idem_http **out)
{
    idem_http *h = calloc(1, sizeof(*h));
    if (h == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    h->d = cfg->dispatch;
    h->obs = cfg->obs;
    h->max_body = cfg->max_body;
    h->max_pending = cfg->max_pending;
    snprintf(h->caller_header, sizeof(h->caller_header), "%s",
             cfg->caller_header != NULL ? cfg->caller_header : "X-Caller");
    idem_hsrv_cfg hc = {
        .max_body = cfg->max_body,
        .request_timeout_ms = cfg->request_timeout_ms,
        .idle_timeout_ms = cfg->idle_timeout_ms,
        .max_conns = cfg->max_conns,
        .answer_timeout_ms = cfg->answer_timeout_ms,
        .max_buffered = cfg->max_buffered,
        .on_request = http_request_cb,
        .arg = h,
    };
    idem_code code = cfg->tls != NULL ? https_configure(h, cfg->tls, &hc.tls) : IDEM_OK;
    if (code != IDEM_OK) {
        free(h);
        return code;
    }
    int rv = idem__hsrv_start(url, &hc, &h->hs, &h->port);
    if (hc.tls != NULL) {
        nng_tls_config_free(hc.tls); /* the listener holds its own reference */
    }
    if (rv != 0) {
        code = idem__err(IDEM_UNAVAILABLE, "http listen %s: %s", url, nng_strerror(rv));
        free(h);
        return code;
    }
    *out = h;
    return IDEM_OK;
}

int idem__http_port(const idem_http *h)
{
    return h != NULL ? h->port : 0;
}

void idem__http_stop(idem_http *h)
{
    if (h == NULL) {
        return;
    }
    idem__hsrv_stop(h->hs); /* every connection gone; the workers answered every job */
    free(h);
}
