/* The HTTP front's own HTTP/1.1 server (http_conn.c): nng only as the byte stream.
 *
 * nng 1.5.2's HTTP server frames a request by Content-Length even when it also carries
 * Transfer-Encoding, ignores chunked request bodies, and after some of its own 400/404/
 * 405 answers reads the unread body as the next request (README "Security"): a request
 * smuggling hole that its handlers cannot close. So the front listens with an
 * nng_stream_listener (tcp, or tls+tcp for https) and frames every request with the
 * strict parser (http_parse.c); one request at a time per connection, answered in
 * order; a refusal is answered with Connection: close and ends the connection. */
#ifndef IDEMRPC_HTTP_CONN_H
#define IDEMRPC_HTTP_CONN_H

#include <nng/nng.h>
#include <pthread.h>
#include <stdatomic.h>
#include <nng/supplemental/tls/tls.h>

#include "http_parse.h"

/* ms as an nng duration (nng's is an int32 of ms): at most INT32_MAX. */
static inline nng_duration idem__hduration(uint64_t ms)
{
    return ms > INT32_MAX ? INT32_MAX : (nng_duration)ms;
}

typedef struct idem_hsrv idem_hsrv;
typedef struct idem_hconn idem_hconn;

/* A response being built: the status line and header lines, then the body. */
typedef struct idem_hres {
    char *buf;
    size_t len, cap;
    bool oom;
    bool close; /* send Connection: close and end the connection after it */
} idem_hres;

typedef struct idem_hsrv_cfg {
    uint64_t max_body;           /* a larger body is 413 and closes the connection */
    uint64_t request_timeout_ms; /* first byte to last byte of a request; also a send */
    uint64_t idle_timeout_ms;    /* between requests */
    size_t max_conns;            /* open connections (one whose request lapsed is closed) */
    uint64_t answer_timeout_ms;  /* a request with the front: then 504 and close */
    size_t max_buffered;         /* all connections' input and answer buffers beyond their first
                                    IDEM_HBUF_INITIAL bytes each */
    nng_tls_config *tls;         /* NULL: plain tcp */
    /* A complete request: answer it once with idem__hconn_send (now or from any thread
     * later). body is valid until then. */
    void (*on_request)(idem_hconn *c, const idem_hreq *r, const void *body, size_t blen, void *arg);
    void *arg;
} idem_hsrv_cfg;

/* Listens on url ("http://HOST:PORT" or "https://HOST:PORT"); *port is the bound one. */
int idem__hsrv_start(const char *url, const idem_hsrv_cfg *cfg, idem_hsrv **out, int *port);
/* Closes the listener and every connection and waits until all are gone: every request
 * handed to on_request must be answered (idem__hconn_send) for this to return. */
void idem__hsrv_stop(idem_hsrv *s);

/* ---- between the listener (http_listen.c) and the connections (http_conn.c) ---- */
struct idem_hsrv {
    idem_hsrv_cfg cfg;
    nng_stream_listener *l;
    nng_aio *acc;
    pthread_mutex_t mtx; /* conns, n, closing; taken before a connection's own */
    pthread_cond_t cv;   /* a connection went away */
    idem_hconn *conns;
    size_t n;               /* connections not freed yet */
    atomic_size_t open;     /* of them, not closed yet: at most cfg.max_conns */
    size_t max_buf;         /* a connection's buffer: head, body, one chunk line */
    atomic_size_t buffered; /* bytes of all buffers beyond their first (http_buf.c) */
    atomic_bool closing;
};
/* A connection serving st, linked into s (s->mtx held); NULL when out of memory. */
idem_hconn *idem__hconn_new(idem_hsrv *s, nng_stream *st);
/* Its first receive (s->mtx not held). */
void idem__hconn_start(idem_hconn *c);
/* Closes it; it unlinks and frees itself once nothing refers to it. */
void idem__hconn_close(idem_hconn *c);
idem_hconn *idem__hconn_next(const idem_hconn *c);

/* ---- a connection's input buffer and answers (http_buf.c) ---- */
#define IDEM_HBUF_INITIAL 4096
typedef enum { IDEM_HBUF_OK, IDEM_HBUF_FULL, IDEM_HBUF_TOO_LARGE } idem_hbuf_grow;
/* Doubles *buf (of *cap bytes, len used; r, if not NULL, points into it) up to
 * s->max_buf: FULL when that would pass cfg.max_buffered for all buffers together,
 * TOO_LARGE at s->max_buf or out of memory (*buf unchanged then). */
idem_hbuf_grow idem__hbuf_grow(idem_hsrv *s, char **buf, size_t *cap, size_t len, idem_hreq *r);
/* Back to IDEM_HBUF_INITIAL bytes when its len bytes fit (between requests). */
void idem__hbuf_shrink(idem_hsrv *s, char **buf, size_t *cap, size_t len);
void idem__hbuf_free(idem_hsrv *s, char *buf, size_t cap);
/* Whether a new request may be handed to the front: IDEM_HBUF_INITIAL bytes of the bound
 * (all of it, if smaller) are free. */
bool idem__hbuf_admits(const idem_hsrv *s);
/* Counts an answer of size bytes (its buffer's whole allocation) into the bound:
 * *counted is what was counted; false (nothing counted) when it would pass the bound. */
bool idem__hbuf_hold_answer(idem_hsrv *s, size_t size, size_t *counted);
/* Gives back *counted bytes of an answer and zeroes it. */
void idem__hbuf_release(idem_hsrv *s, size_t *counted);

void idem__hres_start(idem_hres *res, int status, const char *reason);
void idem__hres_header(idem_hres *res, const char *name, const char *value);
/* A refusal (400, 408, 413, 414, 417, 503 with Retry-After, 504, 505, 507; others 400):
 * its status line and headers into res, its JSON body ({"code","message"}) into json;
 * returns the body's length. */
size_t idem__hres_refusal(idem_hres *res, int status, const char *msg, char *json, size_t cap);
/* Replaces res by a bare 500 with Connection: close (res->buf NULL when even that fails). */
void idem__hres_oom(idem_hres *res);
/* An answer of size bytes (headers included) that does not fit in max_buffered is not
 * held: its refusal's status (503, or 507 when it can never fit) and message into msg. */
int idem__hres_unheld(size_t size, size_t max_buffered, char *msg, size_t cap);
/* Appends n bytes; out of memory sets res->oom and drops them (http_res.c). */
void idem__hres_append(idem_hres *res, const void *p, size_t n);
/* Makes res->buf exactly big enough for n more bytes (and a NUL) if it is not, so that
 * the appends that follow do not reallocate; out of memory sets res->oom. */
void idem__hres_room(idem_hres *res, size_t n);
/* Appends Content-Length (and Connection: close), then the body unless head_only, and
 * sends it on c; takes res->buf. Out of memory: a bare 500 and the connection closes. */
void idem__hconn_send(idem_hconn *c, idem_hres *res, const void *body, size_t blen);

#endif
