/* The gRPC front's answers on a stream (see grpc_conn.h): an OK message as HEADERS, one
 * DATA of 5-byte framing and the trailers; any other status Trailers-Only (one HEADERS
 * with END_STREAM), as the gRPC over HTTP/2 protocol has them. grpc-message is
 * percent-encoded (bytes outside 0x20..0x7e, and '%'), cut at MAX_MESSAGE bytes; a
 * metadata entry whose name or value HTTP/2 cannot carry as text is left out. The
 * answer's bytes are counted in max_buffered until the stream is freed; an OK answer
 * that does not fit is RESOURCE_EXHAUSTED (the call ran: a retry with its key replays
 * it). c->mtx held throughout. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc_conn.h"
#include "supplemental.h"

#define MAX_MESSAGE 1024 /* bytes of grpc-message before encoding */
#define NV(n, v, vl)                                                                               \
    {                                                                                              \
        (uint8_t *)(n), (uint8_t *)(v), strlen(n), (vl), NGHTTP2_NV_FLAG_NONE                      \
    }

static bool name_ok(const char *n)
{
    if (*n == '\0') {
        return false;
    }
    for (; *n; n++) {
        if (!((*n >= 'a' && *n <= 'z') || (*n >= '0' && *n <= '9') || *n == '-' || *n == '_' ||
              *n == '.')) {
            return false;
        }
    }
    return true;
}

static bool value_ok(const char *v)
{
    for (; *v; v++) {
        if ((unsigned char)*v < 0x20 || (unsigned char)*v > 0x7e) {
            return false;
        }
    }
    return true;
}

/* m percent-encoded into out (at most 3 * MAX_MESSAGE + 1 bytes). */
static void percent_encode(const char *m, char *out)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (size_t i = 0; m[i] != '\0' && i < MAX_MESSAGE; i++) {
        unsigned char ch = (unsigned char)m[i];
        if (ch < 0x20 || ch > 0x7e || ch == '%') {
            out[o++] = '%';
            out[o++] = hex[ch >> 4];
            out[o++] = hex[ch & 15];
        } else {
            out[o++] = (char)ch;
        }
    }
    out[o] = '\0';
}

/* s->trailers: grpc-status, grpc-message (if any), then a's metadata; names and values
 * copied into one buffer of the stream's (a's are the call's: gone once it is answered,
 * while the trailers are sent later, from the DATA's read callback). */
static bool trailers_build(idem_gstream *s, const idem_gans *a)
{
    char status[16], msg[3 * MAX_MESSAGE + 1];
    snprintf(status, sizeof(status), "%d", a->status);
    percent_encode(a->message != NULL ? a->message : "", msg);
    size_t n = 2 + a->n_trailers, bytes = 32 + strlen(status) + strlen(msg) + 2;
    for (size_t i = 0; i < a->n_trailers; i++) {
        bytes += strlen(a->trailers[i].name) + strlen(a->trailers[i].value) + 2;
    }
    char *buf = malloc(bytes), *p = buf;
    nghttp2_nv *nv = calloc(n, sizeof(*nv));
    if (buf == NULL || nv == NULL) {
        free(buf);
        free(nv);
        return false;
    }
    s->trailer_buf = buf;
    s->trailers = nv;
    s->n_trailers = 0;
    for (size_t i = 0; i < n; i++) {
        const char *k = i == 0 ? "grpc-status" : i == 1 ? "grpc-message" : a->trailers[i - 2].name;
        const char *v = i == 0 ? status : i == 1 ? msg : a->trailers[i - 2].value;
        if ((i == 1 && *v == '\0') || (i >= 2 && (!name_ok(k) || !value_ok(v)))) {
            continue;
        }
        size_t kl = strlen(k), vl = strlen(v);
        memcpy(p, k, kl + 1);
        memcpy(p + kl + 1, v, vl + 1);
        nv[s->n_trailers++] =
            (nghttp2_nv){(uint8_t *)p, (uint8_t *)p + kl + 1, kl, vl, NGHTTP2_NV_FLAG_NONE};
        p += kl + vl + 2;
    }
    return true;
}

static ssize_t read_cb(nghttp2_session *ss, int32_t id, uint8_t *buf, size_t length,
                       uint32_t *flags, nghttp2_data_source *src, void *arg)
{
    idem_gstream *s = src->ptr;
    size_t n = s->ans_len - s->ans_sent < length ? s->ans_len - s->ans_sent : length;
    (void)arg;
    memcpy(buf, s->ans + s->ans_sent, n);
    s->ans_sent += n;
    if (s->ans_sent == s->ans_len) {
        *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
        if (nghttp2_submit_trailer(ss, id, s->trailers, s->n_trailers) != 0) {
            return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* the stream is reset */
        }
    }
    return (ssize_t)n;
}

/* The OK answer's DATA into s->ans: false when it does not fit in max_buffered. */
static bool frame_message(idem_gstream *s, const idem_gans *a)
{
    size_t len = 5 + a->len;
    if (a->len > UINT32_MAX || !idem__gbuf_reserve(s->conn->srv, len)) {
        return false;
    }
    s->ans_counted = len;
    if ((s->ans = malloc(len)) == NULL) {
        return false;
    }
    s->ans[0] = 0;
    for (int i = 0; i < 4; i++) {
        s->ans[1 + i] = (uint8_t)(a->len >> (24 - 8 * i));
    }
    memcpy(s->ans + 5, a->payload, a->len);
    s->ans_len = len;
    return true;
}

static int submit(idem_gstream *s, bool with_message)
{
    nghttp2_session *ss = s->conn->ss;
    nghttp2_nv nv[2 + 2 + 64] = {NV(":status", "200", 3),
                                 NV("content-type", "application/grpc", 16)};
    if (with_message) {
        nghttp2_data_provider prd = {.source.ptr = s, .read_callback = read_cb};
        return nghttp2_submit_response(ss, s->id, nv, 2, &prd);
    }
    size_t n = 2;
    for (size_t i = 0; i < s->n_trailers && n < sizeof(nv) / sizeof(nv[0]); i++) {
        nv[n++] = s->trailers[i];
    }
    return nghttp2_submit_response(ss, s->id, nv, n, NULL);
}

void idem__gsession_answer(idem_gstream *s, const idem_gans *a)
{
    idem_gsrv *srv = s->conn->srv;
    idem_gans ans = *a;
    s->answered = true;
    s->phase = GS_SENDING;
    s->deadline = idem__mono_ms() + srv->cfg.request_timeout_ms;
    if (!s->with_front) { /* the request's bytes; else the front may still read them */
        free(s->body);
        s->body = NULL;
        s->blen = s->bcap = 0;
        idem__gbuf_release(srv, &s->counted);
    }
    if (ans.status == 0 && !frame_message(s, &ans)) {
        idem__gbuf_release(srv, &s->ans_counted);
        ans = (idem_gans){.status = IDEM_RESOURCE_EXHAUSTED,
                          .message = "the call completed, but its answer does not fit in the "
                                     "server's grpc_max_buffered now: retry with the same "
                                     "idempotency key to read it",
                          .trailers = a->trailers,
                          .n_trailers = a->n_trailers};
    }
    if (!trailers_build(s, &ans) || submit(s, ans.status == 0) != 0) {
        (void)nghttp2_submit_rst_stream(s->conn->ss, NGHTTP2_FLAG_NONE, s->id,
                                        NGHTTP2_INTERNAL_ERROR);
    }
}
