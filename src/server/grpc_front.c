/* The gRPC front: the same chain behind /{package.Service}/{Method} over HTTP/2.
 *
 * Streams arrive framed by the front's HTTP/2 server (grpc_conn.h: libnghttp2 over nng
 * streams). A request becomes an idem.v1.Request frame (grpc_frame.c: the message is the
 * payload; idempotency-key, x-request-id, the caller, idem-token, grpc-timeout and the
 * signature from the metadata) and joins the same work queue as the nng and HTTP calls;
 * the connection's thread only translates and hands over. The answer's grpc-status is
 * the call's code (idem_code is gRPC's numbering), its message grpc-message, and its
 * metadata (x-request-id, idempotent-replayed, idem-first-at, retry-after-ms, ...) go
 * in the trailers. grpc.health.v1.Health/Check is answered here, SERVING. At most
 * max_pending requests are queued or running; more get RESOURCE_EXHAUSTED. Over TLS
 * (grpc_tls.c) every call is the listener's caller, as on the other fronts. */
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc_conn.h"
#include "grpc_front.h"

#define HEALTH_CHECK "grpc.health.v1.Health/Check"

struct idem_grpc {
    idem_dispatch *d;
    idem_gsrv *gs;
    size_t max_pending;
    atomic_size_t pending; /* requests handed to the workers and not yet answered */
    char caller_header[64];
    char tls_caller[IDEM_MAX_CALLER + 1]; /* TLS: the caller of every verified client */
    SSL_CTX *tls;
    int port;
};

typedef struct grpc_job {
    idem_job job; /* first */
    idem_gstream *s;
    uint8_t *frame;
    idem_grpc *g;
} grpc_job;

/* Names the answer's own headers and trailers carry (or HTTP/2 forbids): a call's
 * metadata under one of them would change what the client reads (a second grpc-status
 * after the call's wins; idempotent-replayed on a first run), so it is left out. */
static bool reserved_name(const char *n)
{
    static const char *const names[] = {
        "content-type",      "te",      "connection", "keep-alive",   "proxy-connection",
        "transfer-encoding", "upgrade", "host",       "x-request-id", "idempotent-replayed"};
    if (n[0] == ':' || strncmp(n, "grpc-", 5) == 0) {
        return true;
    }
    for (size_t i = 0; i < IDEM_ARRAY_LEN(names); i++) {
        if (strcmp(n, names[i]) == 0) {
            return true;
        }
    }
    return false;
}

static bool is_bin(const char *n, size_t nl)
{
    return nl > 4 && strcmp(n + nl - 4, "-bin") == 0;
}

/* The call's metadata as gRPC metadata into tr (from *n, at most cap): names lowercased
 * (gRPC's are), reserved ones left out, "-bin" values base64 (gRPC's rule for binary
 * values). Returns the strings' buffer (the caller frees it after the answer is queued;
 * NULL: none, or out of memory and no metadata of the handler's). */
static char *call_metadata(const idem_call *call, idem_gkv *tr, size_t *n, size_t cap)
{
    size_t bytes = 0;
    for (size_t i = 0; i < call->meta_count; i++) {
        size_t nl = strlen(call->meta[i].name), vl = strlen(call->meta[i].value);
        bytes += nl + 1 + (is_bin(call->meta[i].name, nl) ? 4 * ((vl + 2) / 3) + 1 : 0);
    }
    char *buf = bytes > 0 ? malloc(bytes) : NULL, *p = buf;
    for (size_t i = 0; buf != NULL && i < call->meta_count && *n < cap; i++) {
        const char *name = call->meta[i].name, *value = call->meta[i].value;
        size_t nl = strlen(name);
        char *lower = p;
        for (size_t k = 0; k <= nl; k++) {
            lower[k] = (char)(name[k] >= 'A' && name[k] <= 'Z' ? name[k] - 'A' + 'a' : name[k]);
        }
        p += nl + 1;
        if (strcmp(lower, "request-id") == 0 || reserved_name(lower)) {
            continue;
        }
        if (is_bin(lower, nl)) {
            int el = EVP_EncodeBlock((unsigned char *)p, (const unsigned char *)value,
                                     (int)strlen(value));
            value = p;
            p += el + 1;
        }
        tr[(*n)++] = (idem_gkv){lower, value};
    }
    return buf;
}

/* The call's answer: its code, message, payload (OK), metadata as trailers. */
static void answer_call(idem_gstream *s, const idem_call *call)
{
    idem_gkv tr[IDEM_MAX_METADATA + 2];
    size_t n = 0;
    tr[n++] = (idem_gkv){"x-request-id", call->request_id};
    if (call->replayed) {
        tr[n++] = (idem_gkv){"idempotent-replayed", "true"};
    }
    char *strings = call_metadata(call, tr, &n, IDEM_ARRAY_LEN(tr));
    idem_gans a = {.status = (int)call->code,
                   .message = call->code != IDEM_OK ? call->message : NULL,
                   .payload = call->payload,
                   .len = call->payload_len,
                   .trailers = tr,
                   .n_trailers = n};
    idem__gstream_answer(s, &a); /* the trailers are copied */
    free(strings);
}

static void grpc_job_free(grpc_job *j)
{
    atomic_fetch_sub(&j->g->pending, 1);
    free(j->frame);
    free(j);
}

static void grpc_job_answer(idem_job *job)
{
    grpc_job *j = (grpc_job *)job;
    if (idem__call_materialize_replay(&job->s.call) != IDEM_OK) {
        idem__call_reset_response(&job->s.call);
        idem_call_fail(&job->s.call, IDEM_INTERNAL, "out of memory loading the replay");
    }
    idem__dispatch_count(j->g->d, &job->s);
    answer_call(j->s, &job->s.call);
    idem__dispatch_discard(&job->s);
    grpc_job_free(j);
}

/* At shutdown: UNAVAILABLE (a retry with the key is safe) rather than a hang. */
static void grpc_job_drop(idem_job *job)
{
    grpc_job *j = (grpc_job *)job;
    idem_gans a = {.status = IDEM_UNAVAILABLE, .message = "server shutting down"};
    idem__gstream_answer(j->s, &a);
    grpc_job_free(j);
}

static void answer_now(idem_gstream *s, idem_grpc *g, idem_served *sv)
{
    idem__dispatch_count(g->d, sv);
    answer_call(s, &sv->call);
    idem__dispatch_discard(sv);
}

/* grpc.health.v1.HealthCheckResponse{status}, hand-encoded (field 1, varint): SERVING (1),
 * or NOT_SERVING (2) once the server stops (every call is then refused UNAVAILABLE while
 * running handlers finish: an orchestrator must route elsewhere). */
static void health_check(idem_gstream *s, idem_grpc *g)
{
    static const uint8_t serving[] = {0x08, 0x01}, not_serving[] = {0x08, 0x02};
    bool stopping = idem__dispatch_stopping(g->d);
    idem_gans a = {.status = IDEM_OK, .payload = stopping ? not_serving : serving, .len = 2};
    idem__gstream_answer(s, &a);
}

/* A complete request, on the connection's thread: only hands over. */
static void grpc_request_cb(idem_gstream *s, const idem_greq *r, void *arg)
{
    idem_grpc *g = arg;
    idem_served sv;
    grpc_job *j;
    const char *err = NULL;
    size_t len;
    if (strcmp(r->method, HEALTH_CHECK) == 0) {
        health_check(s, g);
        return;
    }
    if (atomic_fetch_add(&g->pending, 1) >= g->max_pending) {
        atomic_fetch_sub(&g->pending, 1);
        idem__dispatch_busy(g->d, &sv);
        answer_now(s, g, &sv);
        return;
    }
    if ((j = calloc(1, sizeof(*j))) == NULL ||
        (j->frame = idem__grpc_request_frame(r, g->caller_header, &len, &err)) == NULL) {
        atomic_fetch_sub(&g->pending, 1);
        free(j);
        idem__dispatch_reject(g->d, &sv, err != NULL ? IDEM_REASON_BAD_KEY : NULL,
                              err != NULL ? IDEM_INVALID_ARGUMENT : IDEM_RESOURCE_EXHAUSTED,
                              err != NULL ? err : "out of memory");
        answer_now(s, g, &sv);
        return;
    }
    j->s = s;
    j->g = g;
    j->job.frame = j->frame;
    j->job.len = len;
    j->job.frame_writable = true;
    j->job.frame_built = true; /* the message <= max_frame, the metadata <= its bound */
    snprintf(j->job.peer.tls_caller, sizeof(j->job.peer.tls_caller), "%s", g->tls_caller);
    j->job.answer = grpc_job_answer;
    j->job.drop = grpc_job_drop;
    idem_code code = idem__dispatch_enqueue(g->d, &j->job);
    if (code == IDEM_OK) {
        return; /* a worker answers */
    }
    grpc_job_free(j);
    if (code == IDEM_RESOURCE_EXHAUSTED) {
        idem__dispatch_busy(g->d, &sv);
    } else {
        idem__dispatch_reject(g->d, &sv, NULL, IDEM_UNAVAILABLE, "server shutting down");
    }
    answer_now(s, g, &sv);
}

idem_code idem__grpc_start(const char *url, const idem_grpc_cfg *cfg, idem_grpc **out)
{
    idem_grpc *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    g->d = cfg->dispatch;
    g->max_pending = cfg->max_pending;
    snprintf(g->caller_header, sizeof(g->caller_header), "%s",
             cfg->caller_header != NULL ? cfg->caller_header : "x-caller");
    idem_gsrv_cfg gc = {
        .max_msg = cfg->max_msg,
        .max_streams = cfg->max_streams,
        .max_header_list = cfg->max_header_list,
        .window = cfg->window,
        .request_timeout_ms = cfg->request_timeout_ms,
        .idle_timeout_ms = cfg->idle_timeout_ms,
        .answer_timeout_ms = cfg->answer_timeout_ms,
        .max_conns = cfg->max_conns,
        .max_buffered = cfg->max_buffered,
        .on_request = grpc_request_cb,
        .arg = g,
    };
    idem_code code = cfg->tls != NULL ? idem__gtls_ctx_new(cfg->tls, &g->tls) : IDEM_OK;
    if (code != IDEM_OK) {
        free(g);
        return code;
    }
    if (cfg->tls != NULL) {
        snprintf(g->tls_caller, sizeof(g->tls_caller), "%s", cfg->tls->caller);
    }
    gc.tls = g->tls;
    int rv = idem__gsrv_start(url, &gc, &g->gs, &g->port);
    if (rv != 0) {
        code = idem__err(rv == NNG_EADDRINVAL ? IDEM_INVALID_ARGUMENT : IDEM_UNAVAILABLE,
                         "grpc listen %s (a tcp://HOST:PORT URL): %s", url, nng_strerror(rv));
        SSL_CTX_free(g->tls);
        free(g);
        return code;
    }
    *out = g;
    return IDEM_OK;
}

int idem__grpc_port(const idem_grpc *g)
{
    return g != NULL ? g->port : 0;
}

void idem__grpc_stop(idem_grpc *g)
{
    if (g == NULL) {
        return;
    }
    idem__gsrv_stop(g->gs); /* every connection gone; the workers answered every job */
    SSL_CTX_free(g->tls);
    free(g);
}
