/* The HTTP front: the same chain behind POST /{package.Service}/{Method}.
 *
 * An HTTP request becomes an idem.v1.Request frame (body = payload, Idempotency-Key =
 * key, X-Request-Id, the caller header, Idem-Token; Idem-Signature, Idem-Timestamp and
 * Idem-Signer as metadata for the identity step) and joins the same work queue as
 * the nng calls, so handlers, LMDB writes and duplicate waits stay on the workers; the
 * nng HTTP callback only translates and hands over. Header values are taken whole:
 * their bounds are checked once, for both fronts, by the request decoder (a value over
 * its bound is a 400 naming the header, never a cut). Status mapping follows the IETF
 * Idempotency-Key draft where it speaks (400 missing key, 422 key reused with another
 * payload, 409 still in progress) and the gRPC-HTTP mapping elsewhere. At most
 * max_pending requests are queued or running; more get 429. */
#include <arpa/inet.h>
#include <nng/nng.h>
#include <nng/supplemental/http/http.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_deadline.h"
#include "http_front.h"
#include "tls.h"
#include "json.h"

struct idem_http {
    idem_dispatch *d;
    idem_observer *obs;
    nng_http_server *hs;
    nng_url *url;
    size_t max_body, max_pending;
    atomic_size_t pending; /* requests handed to the workers and not yet answered */
    char caller_header[64];
    char tls_caller[IDEM_MAX_CALLER + 1]; /* https: the caller of every verified client */
    int port;
};

typedef struct http_job {
    idem_job job; /* first */
    nng_aio *aio;
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

static int set_body(nng_http_res *res, const idem_call *call)
{
    char buf[IDEM_MAX_MESSAGE * 6 + 512], msg[IDEM_MAX_MESSAGE * 6 + 8];
    int rv;
    if (call->code == IDEM_OK && strcmp(call->req->method, IDEM_TOKEN_ISSUE_METHOD) == 0 &&
        token_json(call, buf, sizeof(buf))) {
        return (rv = nng_http_res_set_header(res, "Content-Type", "application/json")) != 0
                   ? rv
                   : nng_http_res_copy_data(res, buf, strlen(buf));
    }
    if (call->code == IDEM_OK) {
        return (rv = nng_http_res_set_header(res, "Content-Type", "application/octet-stream")) != 0
                   ? rv
                   : nng_http_res_copy_data(res, call->payload, call->payload_len);
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
    if ((rv = nng_http_res_set_header(res, "Content-Type", "application/json")) != 0) {
        return rv;
    }
    return nng_http_res_copy_data(res, buf, (size_t)n);
}

/* Metadata as headers: the library's own under their HTTP names, the rest Idem-Meta-*. */
static int set_headers(nng_http_res *res, const idem_call *call)
{
    char name[IDEM_MAX_METADATA_NAME + 16], num[24];
    int rv = 0;
    snprintf(num, sizeof(num), "%d", (int)call->code);
    if ((rv = nng_http_res_set_header(res, "X-Request-Id", call->request_id)) != 0 ||
        (rv = nng_http_res_set_header(res, "Grpc-Status", num)) != 0) {
        return rv;
    }
    if (call->replayed && (rv = nng_http_res_set_header(res, "Idempotent-Replayed", "true")) != 0) {
        return rv;
    }
    for (size_t i = 0; i < call->meta_count && rv == 0; i++) {
        const idem_kv *kv = &call->meta[i];
        if (!header_safe(kv->name) || !header_safe(kv->value) || strchr(kv->name, ':') ||
            strcmp(kv->name, "request-id") == 0) {
            continue;
        }
        if (strcmp(kv->name, "retry-after-ms") == 0) {
            snprintf(num, sizeof(num), "%lu", (strtoul(kv->value, NULL, 10) + 999) / 1000);
            rv = nng_http_res_set_header(res, "Retry-After", num);
        } else if (strcmp(kv->name, "idem-first-at") == 0) {
            rv = nng_http_res_set_header(res, "Idem-First-At", kv->value);
        } else if (strcmp(kv->name, "idem-key") == 0) {
            rv = nng_http_res_set_header(res, "Idem-Key", kv->value);
        } else {
            snprintf(name, sizeof(name), "Idem-Meta-%s", kv->name);
            rv = nng_http_res_set_header(res, name, kv->value);
        }
    }
    return rv;
}

/* Finishes the HTTP exchange with the call's answer (or a bare 500 on ENOMEM). */
static void respond(nng_aio *aio, const idem_call *call)
{
    nng_http_res *res;
    int rv = nng_http_res_alloc(&res);
    if (rv != 0) {
        nng_aio_finish(aio, rv); /* nng answers 500 and closes the connection */
        return;
    }
    uint16_t status = http_status(call);
    if ((rv = nng_http_res_set_status(res, status)) != 0 ||
        (status == 422 && (rv = nng_http_res_set_reason(res, "Unprocessable Content")) != 0) ||
        (status == 499 && (rv = nng_http_res_set_reason(res, "Client Closed Request")) != 0) ||
        (rv = set_headers(res, call)) != 0 || (rv = set_body(res, call)) != 0) {
        nng_http_res_free(res);
        nng_aio_finish(aio, rv);
        return;
    }
    nng_aio_set_output(aio, 0, res);
    nng_aio_finish(aio, 0);
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
    respond(j->aio, &job->s.call);
    idem__dispatch_discard(&job->s);
    http_job_free(j);
}

/* At shutdown: answer 503 rather than leave the connection hanging. */
static void http_job_drop(idem_job *job)
{
    http_job *j = (http_job *)job;
    nng_http_res *res;
    if (nng_http_res_alloc_error(&res, 503) == 0) {
        nng_aio_set_output(j->aio, 0, res);
        nng_aio_finish(j->aio, 0);
    } else {
        nng_aio_finish(j->aio, NNG_ENOMEM);
    }
    http_job_free(j);
}

/* Idempotency-Key as the draft sends it, a structured-field string ("..." with \" and \\
 * escapes), or a bare token. A list ("a", "b"), which is also what nng makes of a
 * repeated header, is refused: one request, one key. Returns a malloc'd key ("" when
 * absent), or NULL with *err set (or with *err NULL when out of memory). */
static char *idempotency_key(nng_http_req *req, const char **err)
{
    static const char many[] = "more than one Idempotency-Key value (a list or a repeated "
                               "header is refused; quote a key that contains a comma)";
    const char *v = nng_http_req_get_header(req, "Idempotency-Key");
    v = v != NULL ? v : "";
    char *out = malloc(strlen(v) + 1), *o = out;
    *err = NULL;
    if (out == NULL) {
        return NULL;
    }
    if (v[0] != '"') {
        *err = strchr(v, ',') != NULL ? many : NULL;
        strcpy(out, v);
    } else {
        const char *p = v + 1;
        for (; *p != '\0' && *p != '"'; p++) {
            if (*p == '\\' && p[1] != '"' && p[1] != '\\') {
                /* only \" and \\ are escapes in a structured-field string (and a
                 * backslash at the end escapes nothing) */
                *err = "Idempotency-Key: invalid escape";
                break;
            }
            if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e) {
                *err = "Idempotency-Key: a quoted key is printable ASCII only";
                break;
            }
            p += *p == '\\';
            *o++ = *p;
        }
        *o = '\0';
        const char *after = *p == '"' ? p + 1 + strspn(p + 1, " \t") : p;
        if (*err != NULL) {
            /* already said */
        } else if (*p != '"') {
            *err = "Idempotency-Key: unterminated quoted string";
        } else if (*after == ';') {
            *err = "Idempotency-Key: parameters are not supported";
        } else if (*after == ',') {
            *err = many;
        } else if (*after != '\0') {
            *err = "Idempotency-Key: unexpected text after the quoted key";
        }
    }
    if (*err != NULL) {
        free(out);
        return NULL;
    }
    return out;
}

/* A header's whole value ("" when absent). */
static const char *header(nng_http_req *req, const char *name)
{
    const char *v = nng_http_req_get_header(req, name);
    return v != NULL ? v : "";
}

/* Headers carried into the request's metadata, for the identity step (identity.c). */
static const struct {
    const char *header, *meta;
} signature_headers[] = {
    {"Idem-Signature", IDEM_META_SIGNATURE},
    {"Idem-Timestamp", IDEM_META_TIMESTAMP},
    {"Idem-Signer", IDEM_META_SIGNER},
};

/* The Request frame for an HTTP call; NULL with *err set for a request to refuse (400),
 * or with *err NULL when out of memory. */
uint8_t *idem__http_request_frame(nng_http_req *req, const char *caller_header, const void *body,
                                  size_t blen, size_t *len, const char **err)
{
    Idem__V1__Request q = IDEM__V1__REQUEST__INIT;
    const char *uri = nng_http_req_get_uri(req);
    uri += uri[0] == '/';
    char *method = strndup(uri, strcspn(uri, "?#"));
    char *key = idempotency_key(req, err);
    uint8_t *frame = NULL;
    Idem__V1__Request__MetadataEntry meta[IDEM_ARRAY_LEN(signature_headers)];
    Idem__V1__Request__MetadataEntry *meta_ptrs[IDEM_ARRAY_LEN(signature_headers)];
    for (size_t i = 0; i < IDEM_ARRAY_LEN(signature_headers); i++) {
        const char *v = nng_http_req_get_header(req, signature_headers[i].header);
        if (v != NULL) { /* the value whole: the decoder checks its bounds */
            idem__v1__request__metadata_entry__init(&meta[q.n_metadata]);
            meta[q.n_metadata].key = (char *)signature_headers[i].meta;
            meta[q.n_metadata].value = (char *)v;
            meta_ptrs[q.n_metadata] = &meta[q.n_metadata];
            q.n_metadata++;
        }
    }
    q.metadata = meta_ptrs;
    if (method != NULL && key != NULL &&
        idem__http_deadline(req, idem__now_ms(), &q.deadline_unix_ms, &q.call_deadline_unix_ms,
                            err)) {
        q.method = method;
        q.idempotency_key = key;
        q.request_id = (char *)header(req, "X-Request-Id");
        q.caller = (char *)header(req, caller_header);
        q.token = (char *)header(req, "Idem-Token");
        q.payload.data = (uint8_t *)body;
        q.payload.len = blen;
        q.attempt = 1;
        *len = idem__v1__request__get_packed_size(&q);
        if ((frame = malloc(*len ? *len : 1)) != NULL) {
            idem__v1__request__pack(&q, frame);
        }
    }
    free(method);
    free(key);
    return frame;
}

static void respond_now(nng_aio *aio, idem_http *h, idem_served *s)
{
    idem__dispatch_count(h->d, s);
    respond(aio, &s->call);
    idem__dispatch_discard(s);
}

/* POST /{package.Service}/{Method}: runs on nng's thread, so it only hands over. */
static void http_call_cb(nng_aio *aio)
{
    nng_http_req *req = nng_aio_get_input(aio, 0);
    idem_http *h = nng_http_handler_get_data(nng_aio_get_input(aio, 1));
    void *body;
    size_t blen;
    idem_served s;
    http_job *j;

    const char *err = NULL;
    size_t len;

    nng_http_req_get_data(req, &body, &blen);
    if (blen > h->max_body) {
        char msg[96];
        snprintf(msg, sizeof(msg), "body of %zu bytes exceeds the %zu byte limit", blen,
                 h->max_body);
        idem__dispatch_reject(h->d, &s, IDEM_REASON_TOO_LARGE, IDEM_RESOURCE_EXHAUSTED, msg);
        respond_now(aio, h, &s);
        return;
    }
    if (atomic_fetch_add(&h->pending, 1) >= h->max_pending) {
        atomic_fetch_sub(&h->pending, 1);
        idem__dispatch_busy(h->d, &s);
        respond_now(aio, h, &s);
        return;
    }
    if ((j = calloc(1, sizeof(*j))) == NULL ||
        (j->frame = idem__http_request_frame(req, h->caller_header, body, blen, &len, &err)) ==
            NULL) {
        atomic_fetch_sub(&h->pending, 1);
        free(j);
        if (err == NULL) {
            nng_aio_finish(aio, NNG_ENOMEM);
            return;
        }
        idem__dispatch_reject(h->d, &s, IDEM_REASON_BAD_KEY, IDEM_INVALID_ARGUMENT, err);
        respond_now(aio, h, &s);
        return;
    }
    j->aio = aio;
    j->h = h;
    j->job.frame = j->frame;
    j->job.len = len;
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
    respond_now(aio, h, &s);
}

/* GET /metrics: cheap enough to answer on nng's thread. */
static void http_metrics_cb(nng_aio *aio)
{
    idem_http *h = nng_http_handler_get_data(nng_aio_get_input(aio, 1));
    nng_http_res *res;
    char *text = idem__metrics_text(h->obs);
    int rv = text == NULL ? NNG_ENOMEM : nng_http_res_alloc(&res);
    if (rv == 0 &&
        ((rv = nng_http_res_set_header(res, "Content-Type", "text/plain; version=0.0.4")) != 0 ||
         (rv = nng_http_res_copy_data(res, text, strlen(text))) != 0)) {
        nng_http_res_free(res);
    }
    free(text);
    if (rv != 0) {
        nng_aio_finish(aio, rv);
        return;
    }
    nng_aio_set_output(aio, 0, res);
    nng_aio_finish(aio, 0);
}

static int add_handler(idem_http *h, const char *path, const char *method, bool tree,
                       size_t max_body, void (*cb)(nng_aio *))
{
    nng_http_handler *hd;
    int rv = nng_http_handler_alloc(&hd, path, cb);
    if (rv != 0) {
        return rv;
    }
    if ((rv = nng_http_handler_set_method(hd, method)) != 0 ||
        (rv = nng_http_handler_collect_body(hd, true, max_body)) != 0 ||
        (tree && (rv = nng_http_handler_set_tree(hd)) != 0) ||
        (rv = nng_http_handler_set_data(hd, h, NULL)) != 0 ||
        (rv = nng_http_server_add_handler(h->hs, hd)) != 0) {
        nng_http_handler_free(hd);
    }
    return rv;
}

/* https: only clients with a certificate from the listener's CA connect, and every
 * request on it is that CA's caller. */
static idem_code https_configure(idem_http *h, const idem_tls_listener *tls)
{
    nng_tls_config *cfg;
    idem_code code = idem__tls_server_config(&cfg, tls);
    if (code != IDEM_OK) {
        return code;
    }
    int rv = nng_http_server_set_tls(h->hs, cfg);
    nng_tls_config_free(cfg); /* the server holds its own reference */
    if (rv != 0) {
        return idem__err(IDEM_UNAVAILABLE, "https: %s", nng_strerror(rv));
    }
    snprintf(h->tls_caller, sizeof(h->tls_caller), "%s", tls->caller);
    return IDEM_OK;
}

idem_code idem__http_start(const char *url, const idem_http_cfg *cfg, idem_http **out)
{
    idem_http *h = calloc(1, sizeof(*h));
    int rv;
    const char *caller_header = cfg->caller_header;
    size_t max_body = cfg->max_body;
    if (h == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    h->d = cfg->dispatch;
    h->obs = cfg->obs;
    h->max_body = max_body;
    h->max_pending = cfg->max_pending;
    snprintf(h->caller_header, sizeof(h->caller_header), "%s",
             caller_header != NULL ? caller_header : "X-Caller");
    nng_sockaddr sa;
    if ((rv = nng_url_parse(&h->url, url)) != 0 ||
        (rv = nng_http_server_hold(&h->hs, h->url)) != 0) {
        idem_code code = idem__err(IDEM_UNAVAILABLE, "http listen %s: %s", url, nng_strerror(rv));
        idem__http_stop(h);
        return code;
    }
    idem_code code = cfg->tls != NULL ? https_configure(h, cfg->tls) : IDEM_OK;
    if (code != IDEM_OK) {
        idem__http_stop(h);
        return code;
    }
    /* Bodies up to twice max_body are collected so that "too large" gets our 413; nng
     * answers anything larger with 400 itself (and reads no further). */
    if ((rv = add_handler(h, "/", "POST", true, 2 * max_body, http_call_cb)) != 0 ||
        (rv = add_handler(h, "/metrics", "GET", false, 0, http_metrics_cb)) != 0 ||
        (rv = nng_http_server_start(h->hs)) != 0 ||
        (rv = nng_http_server_get_addr(h->hs, &sa)) != 0) {
        code = idem__err(IDEM_UNAVAILABLE, "http listen %s: %s", url, nng_strerror(rv));
        idem__http_stop(h);
        return code;
    }
    h->port = sa.s_family == NNG_AF_INET6 ? ntohs(sa.s_in6.sa_port) : ntohs(sa.s_in.sa_port);
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
    if (h->hs != NULL) {
        nng_http_server_stop(h->hs);
        nng_http_server_release(h->hs);
    }
    if (h->url != NULL) {
        nng_url_free(h->url);
    }
    free(h);
}
