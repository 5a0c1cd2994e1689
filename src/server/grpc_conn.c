/* The gRPC front's connections: an nng stream through an nghttp2 server session.
 *
 * Every byte received goes to nghttp2_session_mem_recv, whose callbacks
 * (grpc_session.c) collect each stream's request; complete ones are handed to the
 * front after the connection's lock is let go (the front may answer at once, from the
 * same thread). What nghttp2_session_mem_send gives is copied into one output buffer
 * of at most OUT_MAX (plus a frame) and sent; nothing more is taken from the session
 * until it is. A receive waits at most until the earliest deadline of the connection's
 * streams (or its idle end), then they are expired (grpc_session.c) and it is re-armed.
 * A send must be taken within request_timeout_ms, else the connection closes. Each
 * connection holds a reference per pending receive, send and stream with the front;
 * the last one hands it to conn_free. */
#include <stdlib.h>
#include <string.h>

#include "grpc_conn.h"
#include "supplemental.h"

#define OUT_MAX (64 * 1024)

static nng_duration duration(uint64_t ms)
{
    return ms == 0 ? 1 : ms > INT32_MAX ? INT32_MAX : (nng_duration)ms;
}

static void conn_close_locked(idem_gconn *c)
{
    if (!c->closed) {
        c->closed = true;
        atomic_fetch_sub(&c->srv->open, 1);
        nng_stream_close(c->st); /* pending operations finish with NNG_ECLOSED */
    }
}

/* The last reference went: on fin's callback, which may wait for the other aios (the
 * order and the reason: http_conn.c conn_free). */
static void conn_free(void *arg)
{
    idem_gconn *c = arg;
    idem_gsrv *s = c->srv;
    nng_aio_free(c->rx);
    nng_aio_free(c->tx);
    nng_stream_free(c->st);
    idem__gsession_free_streams(c);
    nghttp2_session_del(c->ss);
    SSL_free(c->ssl);
    free(c->out);
    pthread_mutex_lock(&s->mtx);
    *(c->prev != NULL ? &c->prev->next : &s->conns) = c->next;
    if (c->next != NULL) {
        c->next->prev = c->prev;
    }
    s->n--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mtx); /* s may be gone from here on */
    pthread_mutex_destroy(&c->mtx);
    nng_aio_reap(c->fin);
    free(c);
}

/* The requests to hand to the front, in order; those the client reset meanwhile (in the
 * same read) are dropped here instead: they never reach the front. c->mtx held. */
static idem_gstream *take_ready(idem_gconn *c)
{
    idem_gstream *out = NULL, **tail = &out, *next;
    for (idem_gstream *s = c->ready; s != NULL; s = next) {
        next = s->next_ready;
        s->next_ready = NULL;
        if (s->closed) {
            s->with_front = false;
            c->refs--;
            idem__gstream_free(s);
            continue;
        }
        *tail = s;
        tail = &s->next_ready;
    }
    c->ready = NULL;
    return out;
}

/* Unlocks c, then hands the requests it completed to the front; hands c to conn_free
 * when nothing refers to it any more. */
static void conn_unlock(idem_gconn *c)
{
    idem_gstream *ready = take_ready(c);
    if (c->refs == 0) {
        conn_close_locked(c);
        pthread_mutex_unlock(&c->mtx);
        if (nng_aio_begin(c->fin)) {
            nng_aio_finish(c->fin, 0);
        }
        return; /* no stream is with the front, so none is ready */
    }
    pthread_mutex_unlock(&c->mtx);
    while (ready != NULL) { /* each holds a reference: c stays */
        idem_gstream *s = ready;
        ready = s->next_ready;
        idem_greq r = {.method = s->path + 1,
                       .meta = s->meta,
                       .n_meta = s->n_meta,
                       .msg = s->body + 5,
                       .len = s->blen - 5};
        c->srv->cfg.on_request(s, &r, c->srv->cfg.arg);
    }
}

static void start_send(idem_gconn *c)
{
    nng_iov iov = {.iov_buf = c->out + c->out_off, .iov_len = c->out_len - c->out_off};
    if (nng_aio_set_iov(c->tx, 1, &iov) != 0) {
        conn_close_locked(c);
        return;
    }
    nng_aio_set_timeout(c->tx, duration(c->srv->cfg.request_timeout_ms));
    c->tx_pending = true;
    c->refs++;
    nng_stream_send(c->st, c->tx);
}

static bool out_append(idem_gconn *c, const uint8_t *p, size_t n)
{
    if (c->out_len + n > c->out_cap) {
        size_t cap = c->out_len + n > OUT_MAX ? c->out_len + n : OUT_MAX;
        uint8_t *o = realloc(c->out, cap);
        if (o == NULL) {
            return false;
        }
        c->out = o;
        c->out_cap = cap;
    }
    memcpy(c->out + c->out_len, p, n);
    c->out_len += n;
    return true;
}

/* What the session has to send into c->out: at most OUT_MAX of it (plus a frame) at a
 * time; over TLS through SSL_write (only once the handshake is done), with the
 * handshake's own bytes. False: the connection must end. */
static bool gather(idem_gconn *c)
{
    bool h2 = c->ssl == NULL || idem__gtls_ready(c->ssl);
    for (size_t taken = 0; h2 && taken < OUT_MAX;) {
        const uint8_t *p;
        ssize_t n = nghttp2_session_mem_send(c->ss, &p);
        if (n < 0) {
            return false;
        }
        if (n == 0) {
            break;
        }
        taken += (size_t)n;
        if (c->ssl != NULL ? !idem__gtls_write(c->ssl, p, (size_t)n)
                           : !out_append(c, p, (size_t)n)) {
            return false;
        }
    }
    uint8_t cipher[16384];
    for (size_t n; c->ssl != NULL && (n = idem__gtls_take(c->ssl, cipher, sizeof(cipher))) > 0;) {
        if (!out_append(c, cipher, n)) {
            return false;
        }
    }
    return true;
}

/* Sends what there is to send, unless a send is pending; closes the connection once the
 * session wants neither to read nor to write (after a GOAWAY). */
static void flush_locked(idem_gconn *c)
{
    if (c->closed || c->tx_pending) {
        return;
    }
    c->out_len = c->out_off = 0;
    if (!gather(c)) {
        conn_close_locked(c);
    } else if (c->out_len > 0) {
        start_send(c);
    } else if (!nghttp2_session_want_read(c->ss) && !nghttp2_session_want_write(c->ss)) {
        conn_close_locked(c);
    }
}

/* Bytes received: to the session, through TLS when there is one. False: the connection
 * must end (nghttp2 queued a GOAWAY where it could; it is not waited for). */
static bool received(idem_gconn *c, const uint8_t *p, size_t n)
{
    if (c->ssl == NULL) {
        return nghttp2_session_mem_recv(c->ss, p, n) >= 0;
    }
    uint8_t plain[16384];
    int r;
    if (!idem__gtls_feed(c->ssl, p, n)) {
        return false;
    }
    while ((r = idem__gtls_read(c->ssl, plain, sizeof(plain))) > 0) {
        if (nghttp2_session_mem_recv(c->ss, plain, (size_t)r) < 0) {
            return false;
        }
    }
    return r == 0;
}

/* Expires what is due, then receives until the next deadline. */
static void start_recv(idem_gconn *c)
{
    uint64_t now = idem__mono_ms();
    uint64_t next = idem__gsession_expire(c, now);
    if (c->n_streams > 0) {
        c->idle_end = 0;
    } else if (c->idle_end == 0) {
        c->idle_end = now + c->srv->cfg.idle_timeout_ms;
    } else if (now >= c->idle_end) {
        nghttp2_session_terminate_session(c->ss, NGHTTP2_NO_ERROR); /* GOAWAY, then close */
    }
    next = c->idle_end != 0 && c->idle_end < next ? c->idle_end : next;
    if (c->ssl != NULL && !idem__gtls_ready(c->ssl)) { /* a handshake has a clock too */
        if (now >= c->handshake_end) {
            conn_close_locked(c);
            return;
        }
        next = c->handshake_end < next ? c->handshake_end : next;
    }
    flush_locked(c);
    if (c->closed || c->rx_pending || !nghttp2_session_want_read(c->ss)) {
        return;
    }
    nng_iov iov = {.iov_buf = c->in, .iov_len = sizeof(c->in)};
    if (nng_aio_set_iov(c->rx, 1, &iov) != 0) {
        conn_close_locked(c);
        return;
    }
    nng_duration wait = next > now ? duration(next - now) : 1;
    nng_aio_set_timeout(c->rx, wait);
    c->rx_until = now + (uint64_t)wait;
    c->rx_pending = true;
    c->refs++;
    nng_stream_recv(c->st, c->rx);
}

static void rx_cb(void *arg)
{
    idem_gconn *c = arg;
    int rv = nng_aio_result(c->rx);
    pthread_mutex_lock(&c->mtx);
    c->rx_pending = false;
    c->refs--;
    if (rv == 0 && !c->closed) {
        if (!received(c, c->in, nng_aio_count(c->rx))) {
            conn_close_locked(c);
        }
    } else if (rv != NNG_ETIMEDOUT && rv != NNG_ECANCELED) { /* canceled: see rearm_locked */
        conn_close_locked(c);
    }
    if (!c->closed) {
        start_recv(c);
    }
    conn_unlock(c);
}

static void tx_cb(void *arg)
{
    idem_gconn *c = arg;
    int rv = nng_aio_result(c->tx);
    pthread_mutex_lock(&c->mtx);
    c->tx_pending = false;
    c->refs--;
    c->out_off += rv == 0 ? nng_aio_count(c->tx) : 0;
    if (rv != 0) {
        conn_close_locked(c);
    } else if (c->out_off < c->out_len) {
        start_send(c);
    } else {
        flush_locked(c);
    }
    conn_unlock(c);
}

/* The receive waits until the earliest deadline it knew of when it was armed; an answer
 * from another thread starts its stream's sending clock (request_timeout_ms), usually
 * earlier than the answer's bound the receive waits for: the receive is cancelled, and
 * rx_cb re-arms it (expiring what is due) for the earliest deadline. */
static void rearm_locked(idem_gconn *c)
{
    if (c->rx_pending && !c->closed &&
        idem__mono_ms() + c->srv->cfg.request_timeout_ms < c->rx_until) {
        nng_aio_cancel(c->rx);
    }
}

void idem__gstream_answer(idem_gstream *s, const idem_gans *a)
{
    idem_gconn *c = s->conn;
    pthread_mutex_lock(&c->mtx);
    s->with_front = false;
    c->refs--;
    if (s->closed) {
        idem__gstream_free(s); /* reset by the client, or the connection is gone */
    } else if (s->phase == GS_WITH_FRONT) {
        idem__gsession_answer(s, a);
        flush_locked(c);
        rearm_locked(c);
    } /* else answered DEADLINE_EXCEEDED already (answer_timeout_ms) */
    conn_unlock(c);
}

idem_gconn *idem__gconn_new(idem_gsrv *s, nng_stream *st)
{
    idem_gconn *c = calloc(1, sizeof(*c));
    if (c != NULL) {
        c->srv = s; /* the session's settings are read from s */
    }
    if (c == NULL || nng_aio_alloc(&c->rx, rx_cb, c) != 0 || nng_aio_alloc(&c->tx, tx_cb, c) != 0 ||
        nng_aio_alloc(&c->fin, conn_free, c) != 0 || idem__gsession_new(c) != 0 ||
        (s->cfg.tls != NULL && (c->ssl = idem__gtls_new(s->cfg.tls)) == NULL)) {
        if (c != NULL) { /* nng_aio_free(NULL) does nothing */
            nng_aio_free(c->rx);
            nng_aio_free(c->tx);
            nng_aio_free(c->fin);
            nghttp2_session_del(c->ss);
        }
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->mtx, NULL);
    c->st = st;
    c->handshake_end = idem__mono_ms() + s->cfg.request_timeout_ms;
    c->next = s->conns;
    if (s->conns != NULL) {
        s->conns->prev = c;
    }
    s->conns = c;
    s->n++;
    atomic_fetch_add(&s->open, 1);
    return c;
}

void idem__gconn_start(idem_gconn *c)
{
    pthread_mutex_lock(&c->mtx);
    start_recv(c); /* sends the server's SETTINGS first */
    conn_unlock(c);
}

void idem__gconn_close(idem_gconn *c)
{
    pthread_mutex_lock(&c->mtx);
    conn_close_locked(c);
    pthread_mutex_unlock(&c->mtx);
}

idem_gconn *idem__gconn_next(const idem_gconn *c)
{
    return c->next;
}
