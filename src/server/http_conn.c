/* The HTTP front's connections: nng streams, the strict parser, one request at a time.
 *
 * A connection reads into one buffer, frames the next request from it (http_parse.c),
 * hands a complete request to the front and reads nothing more until the front has
 * answered it and the answer is sent; then the bytes of that request are dropped and
 * the next one (pipelined, already buffered) is framed. A refused request is answered
 * with Connection: close, the connection then reads (and discards) what the client is
 * still sending until LINGER_MS of quiet, LINGER_MAX bytes or LINGER_TOTAL_MS, so that
 * the client sees the answer rather than a reset, and closes. Every state has a clock:
 * idle (idle_timeout_ms), reading a request (request_timeout_ms from its first byte),
 * sending an answer (request_timeout_ms from its first byte), lingering (the above),
 * a request with the front (answer_timeout_ms: then 504 and the connection closes, the
 * front's late answer is dropped); docs/operations.md. An answer that would pass
 * max_buffered is not held (http_buf.c) but refused 503 or 507. The head is parsed as it
 * arrives, each byte once. Each connection holds a reference per pending operation
 * (receive, send, a request with the front); the last one hands it to conn_free. */
#include <nng/nng.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"
#include "supplemental.h"

#define LINGER_MS 100          /* quiet time before a refused connection closes */
#define LINGER_MAX (64 * 1024) /* bytes discarded at most while lingering */
#define LINGER_TOTAL_MS 1000   /* time spent lingering at most, however the client trickles */

struct idem_hconn {
    idem_hsrv *srv;
    idem_hconn *prev, *next;
    nng_stream *st;
    nng_aio *rx, *tx, *wait; /* wait: the bound on a request with the front */
    nng_aio *fin;            /* runs conn_free once nothing refers to the connection */
    pthread_mutex_t mtx;
    int refs;
    bool closed, eof, busy, lapsed, wait_pending, rx_pending, head_done, head_only, close_after,
        lingering, interim, continued;
    char *buf;
    size_t len, cap, req_len, lingered;
    idem_hreq req;
    idem_hchunk ck;
    uint64_t req_start;  /* ms: the first byte of the request being read; 0 none */
    uint64_t send_end;   /* ms: the answer being sent must be taken by then */
    uint64_t linger_end; /* ms: lingering ends then at the latest */
    uint64_t answer_end; /* ms: the front must have answered the request by then */
    char *out;
    size_t out_len, out_off, out_counted; /* out_counted: of max_buffered (http_buf.c) */
};

static const char continue_100[] = "HTTP/1.1 100 Continue\r\n\r\n";

/* ---- connection life ---- */

static void out_free(idem_hconn *c)
{
    if (c->out != continue_100) {
        free(c->out);
    }
    c->out = NULL;
    idem__hbuf_release(c->srv, &c->out_counted);
}

static void conn_close_locked(idem_hconn *c)
{
    if (!c->closed) {
        c->closed = true;
        atomic_fetch_sub(&c->srv->open, 1);
        nng_stream_close(c->st); /* pending operations finish with NNG_ECLOSED */
        nng_aio_cancel(c->wait);
    }
}

/* The last reference went (conn_unlock): fin's callback, on a thread of nng's that is in
 * no callback of this connection's other aios, so it may wait for them. nng_aio_free
 * waits for an operation's callback and, in nng 1.5.2, also for the expire thread to be
 * done with a timed-out operation's cancel function, which locks the stream: that thread
 * takes the function, lets go of its lock, and calls it later, even after the operation
 * completed meanwhile (nng_aio_stop does not wait for that). So the aios go first and
 * the stream after them: freed first, the stream's mutex was destroyed under that late
 * cancel ("panic: pthread_mutex_lock: Invalid argument", issue 35). The buffers are
 * given back to s before s->n drops, as idem__hsrv_stop frees s once it is 0. */
static void conn_free(void *arg)
{
    idem_hconn *c = arg;
    idem_hsrv *s = c->srv;
    nng_aio_free(c->rx);
    nng_aio_free(c->tx);
    nng_aio_free(c->wait);
    nng_stream_free(c->st);
    out_free(c);
    idem__hbuf_free(s, c->buf, c->cap);
    pthread_mutex_lock(&s->mtx);
    *(c->prev != NULL ? &c->prev->next : &s->conns) = c->next;
    if (c->next != NULL) {
        c->next->prev = c->prev;
    }
    s->n--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mtx); /* s may be gone from here on */
    pthread_mutex_destroy(&c->mtx);
    nng_aio_reap(c->fin); /* its own callback: nng frees it once this returns */
    free(c);
}

/* Unlocks c; hands it to conn_free when nothing refers to it any more. The caller may be
 * a callback of c's aios (which conn_free waits for) or hold locks: hence fin. */
static void conn_unlock(idem_hconn *c)
{
    if (c->refs > 0) {
        pthread_mutex_unlock(&c->mtx);
        return;
    }
    conn_close_locked(c);
    pthread_mutex_unlock(&c->mtx);
    if (nng_aio_begin(c->fin)) { /* false only for a stopped aio; fin never is */
        nng_aio_finish(c->fin, 0);
    }
}

/* Sends the rest of c->out; the client takes all of it by c->send_end or is closed. */
static void start_send(idem_hconn *c)
{
    nng_iov iov = {.iov_buf = c->out + c->out_off, .iov_len = c->out_len - c->out_off};
    uint64_t now = idem__mono_ms();
    if (now >= c->send_end || nng_aio_set_iov(c->tx, 1, &iov) != 0) {
        conn_close_locked(c);
        return;
    }
    nng_aio_set_timeout(c->tx, idem__hduration(c->send_end - now));
    c->refs++;
    nng_stream_send(c->st, c->tx);
}

static void send_locked(idem_hconn *c, char *out, size_t len, bool close)
{
    c->out = out;
    c->out_len = len;
    c->out_off = 0;
    c->send_end = idem__mono_ms() + c->srv->cfg.request_timeout_ms;
    c->close_after = c->close_after || close;
    start_send(c);
}

/* Completes res (Content-Length, Connection, body) and sends it: 0, or the size of an
 * answer that does not fit in max_buffered (res->buf freed, nothing sent). */
static size_t respond_locked(idem_hconn *c, idem_hres *res, const void *body, size_t blen)
{
    char num[32];
    bool close = res->close || !c->req.keep_alive || c->srv->closing || c->closed;
    snprintf(num, sizeof(num), "%zu", blen);
    idem__hres_header(res, "Content-Length", num);
    if (close) {
        idem__hres_header(res, "Connection", "close");
    }
    size_t rest = 2 + (c->head_only ? 0 : blen);
    if (!res->oom && !idem__hbuf_hold_answer(c->srv, res->len + rest + 1, &c->out_counted)) {
        free(res->buf);
        return res->len + rest + 1;
    }
    idem__hres_room(res, rest);
    idem__hres_append(res, "\r\n", 2);
    if (!c->head_only) {
        idem__hres_append(res, body, blen);
    }
    if (res->oom) {
        idem__hres_oom(res);
        close = true;
        idem__hbuf_release(c->srv, &c->out_counted); /* a bare 500 is never counted */
    }
    if (c->closed || res->buf == NULL) {
        free(res->buf);
        idem__hbuf_release(c->srv, &c->out_counted);
        conn_close_locked(c);
    } else {
        send_locked(c, res->buf, res->len, close);
    }
    return 0;
}

/* After a refusal: the input buffer's bytes go back to max_buffered now, not when the
 * lingering connection closes (unless a receive or on_request still uses the buffer). */
static void drop_input(idem_hconn *c)
{
    if (c->rx_pending || c->busy) {
        return;
    }
    memset(&c->req, 0, sizeof(c->req)); /* it pointed into the buffer */
    c->len = 0;
    idem__hbuf_shrink(c->srv, &c->buf, &c->cap, 0);
}

/* A refusal: status, a JSON body, Connection: close; nothing after it is read. (While
 * a 100 Continue is still being sent, the connection just closes.) */
static void refuse(idem_hconn *c, int status, const char *msg)
{
    if (c->out != NULL) {
        conn_close_locked(c);
        return;
    }
    drop_input(c);
    char json[384];
    idem_hres res;
    size_t n = idem__hres_refusal(&res, status, msg, json, sizeof(json));
    res.close = true;
    c->head_only = false;
    (void)respond_locked(c, &res, json, n); /* under IDEM_HBUF_INITIAL: never refused */
}

/* Receives more: after the request's own deadline has passed, 408. */
static void need_more(idem_hconn *c)
{
    const idem_hsrv_cfg *cfg = &c->srv->cfg;
    if (c->eof || c->closed) {
        conn_close_locked(c); /* an incomplete request at the client's eof: nothing to do */
        return;
    }
    if (c->rx_pending) {
        return;
    }
    if (c->len == c->cap) {
        idem_hbuf_grow g = idem__hbuf_grow(c->srv, &c->buf, &c->cap, c->len, &c->req);
        if (g != IDEM_HBUF_OK) {
            g == IDEM_HBUF_FULL ? refuse(c, 503,
                                         "the server holds as many request bytes as it may "
                                         "(http_max_buffered); retry later")
                                : refuse(c, 400, "a request over the size bound");
            return;
        }
    }
    uint64_t ms = cfg->idle_timeout_ms, now = idem__mono_ms();
    if (c->req_start != 0) {
        if (now >= c->req_start + cfg->request_timeout_ms) {
            refuse(c, 408, "the request did not arrive within the request timeout");
            return;
        }
        ms = c->req_start + cfg->request_timeout_ms - now;
    }
    nng_iov iov = {.iov_buf = c->buf + c->len, .iov_len = c->cap - c->len};
    if (nng_aio_set_iov(c->rx, 1, &iov) != 0) {
        conn_close_locked(c);
        return;
    }
    nng_aio_set_timeout(c->rx, idem__hduration(ms));
    c->rx_pending = true;
    c->refs++;
    nng_stream_recv(c->st, c->rx);
}

/* While a body is awaited: 100 Continue once, if the client asked for it. */
static void maybe_continue(idem_hconn *c)
{
    if (c->req.expect_continue && !c->continued && c->out == NULL) {
        c->continued = c->interim = true;
        send_locked(c, (char *)continue_100, sizeof(continue_100) - 1, false);
    }
}

/* The body of a request whose head is parsed: true when complete. */
static bool have_body(idem_hconn *c, const void **body, size_t *blen)
{
    size_t hl = c->req.head_len;
    idem_hp_err err;
    if (!c->req.chunked) {
        if (c->len - hl < c->req.content_length) {
            return false;
        }
        *body = c->buf + hl;
        *blen = (size_t)c->req.content_length;
        c->req_len = hl + *blen;
        return true;
    }
    idem_hp hp = idem__http_dechunk(c->buf + hl, c->len - hl, &c->ck, c->srv->cfg.max_body, &err);
    if (hp == IDEM_HP_BAD) {
        refuse(c, err.status, err.msg);
        return false;
    }
    if (hp == IDEM_HP_MORE) { /* drop the framing decoded so far */
        memmove(c->buf + hl + c->ck.wpos, c->buf + hl + c->ck.rpos, c->len - hl - c->ck.rpos);
        c->len -= c->ck.rpos - c->ck.wpos;
        c->ck.rpos = c->ck.wpos;
        return false;
    }
    *body = c->buf + hl;
    *blen = c->ck.wpos;
    c->req_len = hl + c->ck.rpos;
    return true;
}

/* Frames the next request from the buffer: true when one is complete. */
static bool conn_advance(idem_hconn *c, const void **body, size_t *blen)
{
    idem_hp_err err;
    if (c->closed || c->busy || c->lingering || c->out != NULL) {
        return false;
    }
    if (!c->head_done) {
        c->req_start = c->req_start == 0 && c->len > 0 ? idem__mono_ms() : c->req_start;
        idem_hp hp = idem__http_parse_head_more(c->buf, c->len, &c->req, &err);
        if (hp != IDEM_HP_OK) {
            hp == IDEM_HP_BAD ? refuse(c, err.status, err.msg) : need_more(c);
            return false;
        }
        c->head_done = true;
        c->continued = false;
        memset(&c->ck, 0, sizeof(c->ck));
        if (c->req.content_length > c->srv->cfg.max_body) {
            refuse(c, 413, "a body over the size limit");
            return false;
        }
    }
    if (!have_body(c, body, blen)) {
        if (!c->closed && c->out == NULL) {
            maybe_continue(c);
            need_more(c); /* a receive may run beside the 100 Continue's send */
        }
        return false;
    }
    if (!idem__hbuf_admits(c->srv)) {
        refuse(c, 503, "the server holds as many bytes as it may (http_max_buffered); retry later");
        return false;
    }
    return true;
}

/* Runs the connection as far as it goes; c->mtx held on entry, released on return. */
static void conn_run(idem_hconn *c)
{
    const void *body;
    size_t blen;
    if (!conn_advance(c, &body, &blen)) {
        conn_unlock(c);
        return;
    }
    c->busy = true;
    c->refs++;
    c->head_only = c->req.mlen == 4 && memcmp(c->req.method, "HEAD", 4) == 0;
    c->answer_end = idem__mono_ms() + c->srv->cfg.answer_timeout_ms;
    if (!c->wait_pending) { /* else the pending one (being cancelled) re-arms itself */
        c->wait_pending = true;
        c->refs++;
        nng_sleep_aio(idem__hduration(c->srv->cfg.answer_timeout_ms), c->wait);
    }
    pthread_mutex_unlock(&c->mtx);
    c->srv->cfg.on_request(c, &c->req, body, blen, c->srv->cfg.arg);
}

void idem__hconn_send(idem_hconn *c, idem_hres *res, const void *body, size_t blen)
{
    size_t size; /* of an answer that does not fit */
    pthread_mutex_lock(&c->mtx);
    c->busy = false;
    c->refs--;
    if (c->lapsed) { /* answered 504 already */
        c->lapsed = false;
        free(res->buf);
    } else if ((size = respond_locked(c, res, body, blen)) != 0) {
        char msg[256];
        refuse(c, idem__hres_unheld(size, c->srv->cfg.max_buffered, msg, sizeof(msg)), msg);
    }
    nng_aio_cancel(c->wait);
    conn_unlock(c);
}

/* The bound on a request with the front: 504 once answer_end has passed (the call may
 * still complete; a retry with its key learns how), re-armed for a later request. */
static void wait_cb(void *arg)
{
    idem_hconn *c = arg;
    pthread_mutex_lock(&c->mtx);
    c->refs--;
    c->wait_pending = false;
    uint64_t now = idem__mono_ms();
    if (c->busy && !c->lapsed && !c->closed && now >= c->answer_end) {
        c->lapsed = true;
        refuse(c, 504,
               "no answer within the server's bound (max_run_ms); the call may "
               "still complete: retry with the same idempotency key");
    } else if (c->busy && !c->lapsed && !c->closed) {
        c->wait_pending = true;
        c->refs++;
        nng_sleep_aio(idem__hduration(c->answer_end - now), c->wait);
    }
    conn_unlock(c);
}

/* ---- aio callbacks ---- */

static void linger_more(idem_hconn *c)
{
    drop_input(c);
    nng_iov iov = {.iov_buf = c->buf, .iov_len = c->cap};
    uint64_t now = idem__mono_ms();
    if (c->eof || c->closed || c->lingered > LINGER_MAX || now >= c->linger_end ||
        nng_aio_set_iov(c->rx, 1, &iov) != 0) {
        conn_close_locked(c);
        return;
    }
    nng_aio_set_timeout(
        c->rx, idem__hduration(c->linger_end - now < LINGER_MS ? c->linger_end - now : LINGER_MS));
    c->rx_pending = true;
    c->refs++;
    nng_stream_recv(c->st, c->rx);
}

static void rx_cb(void *arg)
{
    idem_hconn *c = arg;
    int rv = nng_aio_result(c->rx);
    pthread_mutex_lock(&c->mtx);
    c->rx_pending = false;
    c->refs--;
    size_t n = rv == 0 ? nng_aio_count(c->rx) : 0;
    if (c->lingering) {
        c->lingered += n;
        rv == 0 ? linger_more(c) : conn_close_locked(c);
        conn_unlock(c);
        return;
    }
    if (rv == NNG_ECONNSHUT) {
        c->eof = true;
    } else if (rv == NNG_ETIMEDOUT && (c->req_start != 0 || c->head_done)) {
        refuse(c, 408, "the request did not arrive within the request timeout");
    } else if (rv != 0) {
        conn_close_locked(c);
    }
    c->len += n;
    conn_run(c);
}

static void tx_cb(void *arg)
{
    idem_hconn *c = arg;
    int rv = nng_aio_result(c->tx);
    pthread_mutex_lock(&c->mtx);
    c->refs--;
    c->out_off += rv == 0 ? nng_aio_count(c->tx) : 0;
    if (rv == 0 && c->out_off < c->out_len) {
        start_send(c);
        conn_unlock(c);
        return;
    }
    out_free(c);
    if (rv != 0) {
        conn_close_locked(c);
    } else if (c->interim) {
        c->interim = false;
    } else if (c->close_after) {
        c->lingering = true;
        c->linger_end = idem__mono_ms() + LINGER_TOTAL_MS;
        c->rx_pending ? (void)0 : linger_more(c);
    } else { /* the next request, if one is buffered */
        memmove(c->buf, c->buf + c->req_len, c->len - c->req_len);
        c->len -= c->req_len;
        if (!c->rx_pending) { /* never pending here; the buffer must not move under one */
            idem__hbuf_shrink(c->srv, &c->buf, &c->cap, c->len);
        }
        memset(&c->req, 0, sizeof(c->req));
        c->head_done = false;
        c->req_start = 0;
    }
    conn_run(c);
}

/* The listener's side: a new connection, its start, its close, the next one. */
idem_hconn *idem__hconn_new(idem_hsrv *s, nng_stream *st)
{
    idem_hconn *c = calloc(1, sizeof(*c));
    if (c == NULL || (c->buf = malloc(IDEM_HBUF_INITIAL)) == NULL ||
        nng_aio_alloc(&c->rx, rx_cb, c) != 0 || nng_aio_alloc(&c->tx, tx_cb, c) != 0 ||
        nng_aio_alloc(&c->wait, wait_cb, c) != 0 || nng_aio_alloc(&c->fin, conn_free, c) != 0) {
        if (c != NULL) { /* nng_aio_free(NULL) does nothing */
            nng_aio_free(c->rx);
            nng_aio_free(c->tx);
            nng_aio_free(c->wait);
            free(c->buf);
        }
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->mtx, NULL);
    c->srv = s;
    c->st = st;
    c->cap = IDEM_HBUF_INITIAL;
    c->next = s->conns;
    if (s->conns != NULL) {
        s->conns->prev = c;
    }
    s->conns = c;
    s->n++;
    atomic_fetch_add(&s->open, 1);
    return c;
}

void idem__hconn_start(idem_hconn *c)
{
    pthread_mutex_lock(&c->mtx);
    conn_run(c);
}

void idem__hconn_close(idem_hconn *c)
{
    pthread_mutex_lock(&c->mtx);
    conn_close_locked(c);
    pthread_mutex_unlock(&c->mtx);
}

idem_hconn *idem__hconn_next(const idem_hconn *c)
{
    return c->next;
}
