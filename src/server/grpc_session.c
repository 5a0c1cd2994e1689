/* The gRPC front's HTTP/2 sessions: nghttp2's server session callbacks, the streams they
 * collect, and the answers queued on them (see grpc_conn.h for the states).
 *
 * A request is a POST with content-type application/grpc, a :path /pkg.Svc/Method and
 * exactly one message of 5-byte gRPC framing (flag 0, a 4-byte big-endian length); a
 * stream that is not is refused with a Trailers-Only answer as soon as that is known,
 * never handed to the front (what the client still sends on it is dropped; its answer's
 * clock, request_timeout_ms, ends it). Bounds: a header list over max_header_list is
 * RESOURCE_EXHAUSTED (four times over: the connection ends), a message over max_msg
 * RESOURCE_EXHAUSTED, a compressed one UNIMPLEMENTED; metadata, message and answer bytes
 * of all streams together over max_buffered RESOURCE_EXHAUSTED. All callbacks run under
 * the connection's lock (inside mem_recv / mem_send). */
#include <stdlib.h>
#include <string.h>

#include "grpc_conn.h"
#include "supplemental.h"

/* Streams a client may reset: a burst, then a rate per second; past them nghttp2 ends the
 * connection (GOAWAY INTERNAL_ERROR): a flood of HEADERS + RST_STREAM costs the server
 * work even when nothing runs (rapid reset, CVE-2023-44487). */
#define RESET_BURST 1000
#define RESET_PER_S 33

static idem_gstream *stream_of(nghttp2_session *ss, int32_t id)
{
    return nghttp2_session_get_stream_user_data(ss, id);
}

void idem__gstream_free(idem_gstream *s)
{
    idem_gconn *c = s->conn;
    *(s->prev != NULL ? &s->prev->next : &c->streams) = s->next;
    if (s->next != NULL) {
        s->next->prev = s->prev;
    }
    c->n_streams--;
    idem__gbuf_release(c->srv, &s->counted);
    idem__gbuf_release(c->srv, &s->meta_counted);
    idem__gbuf_release(c->srv, &s->ans_counted);
    for (size_t i = 0; i < s->n_meta; i++) {
        free((char *)s->meta[i].name);
        free((char *)s->meta[i].value);
    }
    free(s->meta);
    free(s->path);
    free(s->body);
    free(s->ans);
    free(s->trailer_buf);
    free(s->trailers);
    free(s);
}

void idem__gsession_free_streams(idem_gconn *c)
{
    while (c->streams != NULL) {
        idem__gstream_free(c->streams);
    }
}

static void refuse(idem_gstream *s, int code, const char *msg)
{
    if (s->refuse == 0) {
        s->refuse = code;
        s->refuse_msg = msg;
    }
}

static int begin_headers_cb(nghttp2_session *ss, const nghttp2_frame *f, void *arg)
{
    idem_gconn *c = arg;
    if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST) {
        return 0;
    }
    idem_gstream *s = c->n_streams < c->srv->cfg.max_streams ? calloc(1, sizeof(*s)) : NULL;
    if (s == NULL) { /* streams with the front count too: a reset frees no slot */
        return nghttp2_submit_rst_stream(ss, NGHTTP2_FLAG_NONE, f->hd.stream_id,
                                         NGHTTP2_REFUSED_STREAM) == 0
                   ? 0
                   : NGHTTP2_ERR_CALLBACK_FAILURE;
    }
    s->conn = c;
    s->id = f->hd.stream_id;
    s->phase = GS_READING;
    s->deadline = idem__mono_ms() + c->srv->cfg.request_timeout_ms;
    s->next = c->streams;
    if (c->streams != NULL) {
        c->streams->prev = s;
    }
    c->streams = s;
    c->n_streams++;
    if (nghttp2_session_set_stream_user_data(ss, s->id, s) != 0) {
        idem__gstream_free(s);
        return NGHTTP2_ERR_CALLBACK_FAILURE;
    }
    return 0;
}

static bool add_meta(idem_gstream *s, const uint8_t *name, size_t nl, const uint8_t *v, size_t vl)
{
    if (s->n_meta == s->meta_cap) {
        size_t cap = s->meta_cap ? 2 * s->meta_cap : 8;
        idem_gkv *m = realloc(s->meta, cap * sizeof(*m));
        if (m == NULL) {
            return false;
        }
        s->meta = m;
        s->meta_cap = cap;
    }
    char *n = strndup((const char *)name, nl), *val = strndup((const char *)v, vl);
    if (n == NULL || val == NULL) {
        free(n);
        free(val);
        return false;
    }
    s->meta[s->n_meta++] = (idem_gkv){n, val};
    return true;
}

static bool is_grpc_type(const uint8_t *v, size_t vl)
{
    static const char t[] = "application/grpc";
    size_t n = sizeof(t) - 1;
    return vl >= n && memcmp(v, t, n) == 0 && (vl == n || v[n] == '+' || v[n] == ';');
}

static int header_cb(nghttp2_session *ss, const nghttp2_frame *f, const uint8_t *name, size_t nl,
                     const uint8_t *v, size_t vl, uint8_t flags, void *arg)
{
    idem_gconn *c = arg;
    idem_gstream *s = stream_of(ss, f->hd.stream_id);
    (void)flags;
    if (s == NULL || f->headers.cat != NGHTTP2_HCAT_REQUEST) {
        return 0; /* a refused stream, or trailers: a unary request needs none */
    }
    s->hdr_bytes += nl + vl + 32;
    if (s->hdr_bytes > 4 * (size_t)c->srv->cfg.max_header_list) {
        return NGHTTP2_ERR_CALLBACK_FAILURE; /* an HPACK bomb: the connection ends */
    }
    if (s->hdr_bytes > c->srv->cfg.max_header_list) {
        refuse(s, IDEM_RESOURCE_EXHAUSTED, "metadata over the server's header list size");
    }
    if (s->refuse != 0) {
        return 0;
    }
    if (nl == 7 && memcmp(name, ":method", 7) == 0) {
        s->post = vl == 4 && memcmp(v, "POST", 4) == 0;
    } else if (nl == 5 && memcmp(name, ":path", 5) == 0) {
        free(s->path);
        s->path = strndup((const char *)v, vl);
    } else if (nl == 12 && memcmp(name, "content-type", 12) == 0) {
        s->grpc_type = is_grpc_type(v, vl);
    } else if (nl > 0 && name[0] != ':') {
        if (!idem__gbuf_reserve(c->srv, nl + vl)) {
            refuse(s, IDEM_RESOURCE_EXHAUSTED,
                   "the server holds as many request bytes as it may (grpc_max_buffered)");
        } else {
            s->meta_counted += nl + vl;
            if (!add_meta(s, name, nl, v, vl)) {
                refuse(s, IDEM_RESOURCE_EXHAUSTED, "out of memory");
            }
        }
    }
    return 0;
}

/* The declared length of the framed message in s->body (5 bytes at least). */
static size_t framed_len(const idem_gstream *s)
{
    const uint8_t *b = s->body;
    return ((size_t)b[1] << 24) | ((size_t)b[2] << 16) | ((size_t)b[3] << 8) | b[4];
}

static bool body_append(idem_gstream *s, const uint8_t *d, size_t len)
{
    idem_gsrv *srv = s->conn->srv;
    if (s->blen + len > s->bcap) {
        size_t cap = s->bcap ? s->bcap : 1024;
        while (cap < s->blen + len) {
            cap *= 2;
        }
        cap = cap > srv->cfg.max_msg + 5 ? srv->cfg.max_msg + 5 : cap;
        if (!idem__gbuf_reserve(srv, cap - s->bcap)) {
            refuse(s, IDEM_RESOURCE_EXHAUSTED,
                   "the server holds as many message bytes as it may (grpc_max_buffered)");
            return false;
        }
        s->counted += cap - s->bcap;
        uint8_t *b = realloc(s->body, cap);
        if (b == NULL) {
            refuse(s, IDEM_RESOURCE_EXHAUSTED, "out of memory");
            return false;
        }
        s->body = b;
        s->bcap = cap;
    }
    memcpy(s->body + s->blen, d, len);
    s->blen += len;
    return true;
}

static int data_cb(nghttp2_session *ss, uint8_t flags, int32_t id, const uint8_t *d, size_t len,
                   void *arg)
{
    idem_gconn *c = arg;
    idem_gstream *s = stream_of(ss, id);
    (void)flags;
    if (s == NULL || s->refuse != 0 || s->phase != GS_READING) {
        return 0; /* dropped; nghttp2 still gives the window back */
    }
    if (s->blen + len > c->srv->cfg.max_msg + 5) {
        refuse(s, IDEM_RESOURCE_EXHAUSTED, "a message over the server's size limit (max_frame)");
        return 0;
    }
    if (!body_append(s, d, len) || s->blen < 5) {
        return 0;
    }
    if (s->body[0] != 0) {
        refuse(s, IDEM_UNIMPLEMENTED, "compressed messages are not supported");
    } else if (framed_len(s) > c->srv->cfg.max_msg) {
        refuse(s, IDEM_RESOURCE_EXHAUSTED, "a message over the server's size limit (max_frame)");
    }
    return 0;
}

/* At its end: the request checked, then handed to the front (via c->ready). */
static void request_end(idem_gconn *c, idem_gstream *s)
{
    if (s->refuse == 0 && (s->blen < 5 || s->blen != 5 + framed_len(s))) {
        refuse(s, IDEM_INVALID_ARGUMENT, "a unary call carries exactly one message");
    }
    if (s->refuse != 0) {
        return;
    }
    s->phase = GS_WITH_FRONT;
    s->with_front = true;
    s->deadline = idem__mono_ms() + c->srv->cfg.answer_timeout_ms;
    c->refs++;
    idem_gstream **tail = &c->ready;
    while (*tail != NULL) {
        tail = &(*tail)->next_ready;
    }
    *tail = s;
}

/* The head's checks, once the header block is complete. */
static void request_head(idem_gstream *s)
{
    if (!s->post) {
        refuse(s, IDEM_UNIMPLEMENTED, "a gRPC call is a POST");
    } else if (!s->grpc_type) {
        refuse(s, IDEM_INVALID_ARGUMENT, "content-type must be application/grpc");
    } else if (s->path == NULL || s->path[0] != '/' || strchr(s->path + 1, '/') == NULL) {
        refuse(s, IDEM_UNIMPLEMENTED, ":path must be /package.Service/Method");
    }
}

static int frame_recv_cb(nghttp2_session *ss, const nghttp2_frame *f, void *arg)
{
    idem_gconn *c = arg;
    bool end = (f->hd.flags & NGHTTP2_FLAG_END_STREAM) != 0;
    idem_gstream *s = stream_of(ss, f->hd.stream_id);
    if (s == NULL || (f->hd.type != NGHTTP2_HEADERS && f->hd.type != NGHTTP2_DATA) ||
        s->phase != GS_READING) {
        return 0;
    }
    if (f->hd.type == NGHTTP2_HEADERS && f->headers.cat == NGHTTP2_HCAT_REQUEST) {
        request_head(s);
    }
    if (end) {
        request_end(c, s);
    }
    if (s->refuse != 0 && !s->answered) { /* what the client still sends is dropped */
        idem_gans a = {.status = s->refuse, .message = s->refuse_msg};
        idem__gsession_answer(s, &a);
    }
    return 0;
}

static int stream_close_cb(nghttp2_session *ss, int32_t id, uint32_t err, void *arg)
{
    idem_gstream *s = stream_of(ss, id);
    (void)err;
    (void)arg;
    if (s == NULL) {
        return 0;
    }
    s->closed = true;
    if (!s->with_front) {
        idem__gstream_free(s);
    }
    return 0;
}

uint64_t idem__gsession_expire(idem_gconn *c, uint64_t now)
{
    uint64_t next = UINT64_MAX;
    for (idem_gstream *s = c->streams; s != NULL; s = s->next) {
        if (s->closed || s->deadline == UINT64_MAX) {
            continue;
        }
        if (s->deadline > now) {
            next = s->deadline < next ? s->deadline : next;
        } else if (s->phase == GS_WITH_FRONT) {
            idem_gans a = {.status = IDEM_DEADLINE_EXCEEDED,
                           .message = "no answer within the server's bound (max_run_ms); the "
                                      "call may still complete: retry with the same key"};
            idem__gsession_answer(s, &a); /* the front's late answer is dropped */
        } else {                          /* a request or an answer that did not move in time */
            s->deadline = UINT64_MAX;
            (void)nghttp2_submit_rst_stream(c->ss, NGHTTP2_FLAG_NONE, s->id, NGHTTP2_CANCEL);
        }
    }
    return next;
}

static int settings(idem_gconn *c)
{
    const idem_gsrv_cfg *cfg = &c->srv->cfg;
    nghttp2_settings_entry iv[] = {
        {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, cfg->max_streams},
        {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, cfg->window},
        {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, cfg->max_header_list},
    };
    int rv = nghttp2_submit_settings(c->ss, NGHTTP2_FLAG_NONE, iv, sizeof(iv) / sizeof(iv[0]));
    return rv != 0 ? rv
                   : nghttp2_session_set_local_window_size(c->ss, NGHTTP2_FLAG_NONE, 0,
                                                           (int32_t)cfg->window);
}

int idem__gsession_new(idem_gconn *c)
{
    nghttp2_session_callbacks *cb;
    nghttp2_option *opt;
    int rv = nghttp2_session_callbacks_new(&cb);
    if (rv != 0) {
        return rv;
    }
    if ((rv = nghttp2_option_new(&opt)) != 0) {
        nghttp2_session_callbacks_del(cb);
        return rv;
    }
    nghttp2_option_set_stream_reset_rate_limit(opt, RESET_BURST, RESET_PER_S);
    nghttp2_session_callbacks_set_on_begin_headers_callback(cb, begin_headers_cb);
    nghttp2_session_callbacks_set_on_header_callback(cb, header_cb);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, data_cb);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cb, frame_recv_cb);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, stream_close_cb);
    rv = nghttp2_session_server_new2(&c->ss, cb, c, opt);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cb);
    if (rv == 0 && (rv = settings(c)) != 0) {
        nghttp2_session_del(c->ss);
        c->ss = NULL;
    }
    return rv;
}
