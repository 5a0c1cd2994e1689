/* The gRPC front's HTTP/2 server (grpc_listen.c, grpc_conn.c, grpc_session.c): nng only
 * as the byte stream, libnghttp2's server session for the framing (no HTTP/2 is parsed
 * here), one mutex per connection around its session.
 *
 * A connection reads bytes into nghttp2_session_mem_recv and writes what
 * nghttp2_session_mem_send gives. Each request stream has one state (idem_gstream.phase)
 * and one deadline: READING (its headers and its one message arrive within
 * request_timeout_ms, else RST_STREAM CANCEL), WITH_FRONT (answered within
 * answer_timeout_ms, else DEADLINE_EXCEEDED and the late answer is dropped), SENDING
 * (the client takes the answer within request_timeout_ms, else RST_STREAM), and a
 * connection with no stream closes after idle_timeout_ms. A stream handed to the front
 * stays allocated until the front answers it, even if the client reset it: such
 * streams count against max_streams, so resetting calls does not let a client queue
 * more work than it could with open streams (rapid reset). */
#ifndef IDEMRPC_GRPC_CONN_H
#define IDEMRPC_GRPC_CONN_H

#include <nghttp2/nghttp2.h>
#include <nng/nng.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "grpc_front.h"

typedef struct idem_gsrv idem_gsrv;
typedef struct idem_gconn idem_gconn;
typedef struct idem_gstream idem_gstream;

/* An answer: OK with a message (headers, one DATA, trailers) or, for any other status,
 * a Trailers-Only response. message is raw (percent-encoded when sent). */
typedef struct idem_gans {
    int status;
    const char *message;
    const void *payload;
    size_t len;
    const idem_gkv *trailers; /* more metadata, sent with grpc-status */
    size_t n_trailers;
} idem_gans;

typedef struct idem_gsrv_cfg {
    uint64_t max_msg;            /* bytes of one message; more is RESOURCE_EXHAUSTED */
    uint32_t max_streams;        /* SETTINGS_MAX_CONCURRENT_STREAMS, and streams with the front */
    uint32_t max_header_list;    /* SETTINGS_MAX_HEADER_LIST_SIZE (RFC 9113 6.5.2 sizes) */
    uint32_t window;             /* SETTINGS_INITIAL_WINDOW_SIZE and the connection's window */
    uint64_t request_timeout_ms; /* a request's headers to its end; an answer's sending */
    uint64_t idle_timeout_ms;    /* a connection with no stream */
    uint64_t answer_timeout_ms;  /* a request with the front */
    size_t max_conns;
    size_t max_buffered; /* all streams' metadata, message and answer bytes together */
    SSL_CTX *tls;        /* NULL: h2c; else TLS with ALPN h2 (grpc_tls.c), not owned */
    /* A complete request: answer it once with idem__gstream_answer (now or from any
     * thread later), also after the client went away. */
    void (*on_request)(idem_gstream *s, const idem_greq *r, void *arg);
    void *arg;
} idem_gsrv_cfg;

/* Listens on url (tcp://HOST:PORT); *port is the bound one. */
int idem__gsrv_start(const char *url, const idem_gsrv_cfg *cfg, idem_gsrv **out, int *port);
/* Closes the listener and every connection and waits until all are gone: every request
 * handed to on_request must be answered for this to return. */
void idem__gsrv_stop(idem_gsrv *s);
/* Answers s (any thread); s is gone when this returns. */
void idem__gstream_answer(idem_gstream *s, const idem_gans *a);

/* ---- between the listener, the connections and their sessions ---- */
struct idem_gsrv {
    idem_gsrv_cfg cfg;
    nng_stream_listener *l;
    nng_aio *acc;
    pthread_mutex_t mtx; /* conns, n, closing; taken before a connection's own */
    pthread_cond_t cv;   /* a connection went away */
    idem_gconn *conns;
    size_t n;               /* connections not freed yet */
    atomic_size_t open;     /* of them, not closed yet: at most cfg.max_conns */
    atomic_size_t buffered; /* message and answer bytes of all streams */
    atomic_bool closing;
};

typedef enum { GS_READING, GS_WITH_FRONT, GS_SENDING } idem_gphase;

struct idem_gstream {
    idem_gconn *conn;
    idem_gstream *prev, *next; /* the connection's streams */
    int32_t id;
    idem_gphase phase;
    bool closed;     /* by nghttp2 (or its connection): freed once not with_front */
    bool with_front; /* handed to on_request and not answered by the front yet */
    bool answered;   /* an answer is queued in the session */
    idem_gstream *next_ready;
    uint64_t deadline; /* ms, of its phase */
    int refuse;        /* a gRPC status to answer at its end instead of handing it over */
    const char *refuse_msg;
    bool post, grpc_type;
    size_t hdr_bytes; /* of its header list, as SETTINGS_MAX_HEADER_LIST_SIZE counts */
    char *path;
    idem_gkv *meta;
    size_t n_meta, meta_cap;
    /* The framed message as received: the front may read it until it answers, so it is
     * freed at the answer only when not with_front, else with the stream. */
    uint8_t *body;
    size_t blen, bcap, counted; /* counted: body's bytes of srv->buffered */
    size_t meta_counted;        /* meta's bytes of srv->buffered */
    uint8_t *ans;               /* the OK answer's DATA (5-byte framing and the message) */
    size_t ans_len, ans_sent, ans_counted;
    char *trailer_buf; /* the answer's trailers (one allocation) */
    nghttp2_nv *trailers;
    size_t n_trailers;
};

struct idem_gconn {
    idem_gsrv *srv;
    idem_gconn *prev, *next;
    nng_stream *st;
    nng_aio *rx, *tx, *fin;
    pthread_mutex_t mtx;
    int refs; /* pending receive, send, each stream with the front */
    bool closed, rx_pending, tx_pending;
    nghttp2_session *ss;
    idem_gstream *streams;
    size_t n_streams;    /* allocated: open ones and those with the front */
    idem_gstream *ready; /* complete requests to hand to the front (next = link) */
    uint64_t idle_end;
    uint64_t rx_until;      /* the pending receive's timeout (ms) */
    SSL *ssl;               /* TLS: its memory BIOs between the stream and the session */
    uint64_t handshake_end; /* TLS: the handshake is over by then, else the connection */
    uint8_t in[16384];
    uint8_t *out;
    size_t out_len, out_off, out_cap;
};

/* grpc_session.c: the nghttp2 server session of c (settings queued); 0 or nghttp2's
 * error. */
int idem__gsession_new(idem_gconn *c);
/* Frees every stream of c that is not with the front (at the connection's end). */
void idem__gsession_free_streams(idem_gconn *c);
/* Acts on the streams whose deadline passed; returns the earliest deadline left (ms,
 * UINT64_MAX for none). c->mtx held. */
uint64_t idem__gsession_expire(idem_gconn *c, uint64_t now);
/* Queues the answer on its stream (c->mtx held, stream open). */
void idem__gsession_answer(idem_gstream *s, const idem_gans *a);
void idem__gstream_free(idem_gstream *s);
/* grpc_buf.c: reserves n bytes of cfg.max_buffered (false: over the bound); gives them back. */
bool idem__gbuf_reserve(idem_gsrv *s, size_t n);
void idem__gbuf_release(idem_gsrv *s, size_t *counted);

/* grpc_tls.c: a server context requiring a client certificate from tls's CA and ALPN h2;
 * a connection's SSL in accept state on two memory BIOs (NULL: out of memory); whether
 * its handshake is done; ciphertext in; plaintext out (> 0 bytes, 0: needs more input,
 * -1: the connection ends); plaintext to send (all of it, or false); ciphertext to send
 * (its length, 0: none). */
idem_code idem__gtls_ctx_new(const idem_tls_listener *tls, SSL_CTX **out);
SSL *idem__gtls_new(SSL_CTX *ctx);
bool idem__gtls_ready(SSL *ssl);
bool idem__gtls_feed(SSL *ssl, const void *p, size_t n);
int idem__gtls_read(SSL *ssl, uint8_t *buf, size_t cap);
bool idem__gtls_write(SSL *ssl, const void *p, size_t n);
size_t idem__gtls_take(SSL *ssl, uint8_t *buf, size_t cap);

/* grpc_conn.c */
idem_gconn *idem__gconn_new(idem_gsrv *s, nng_stream *st);
void idem__gconn_start(idem_gconn *c);
void idem__gconn_close(idem_gconn *c);
idem_gconn *idem__gconn_next(const idem_gconn *c);

#endif
