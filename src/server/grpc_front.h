/* The gRPC front (grpc_front.c): the chain behind /{package.Service}/{Method} over
 * HTTP/2 (grpc_conn.h: its server on libnghttp2). */
#ifndef IDEMRPC_GRPC_FRONT_H
#define IDEMRPC_GRPC_FRONT_H

#include "dispatch.h"

typedef struct idem_gkv {
    const char *name, *value;
} idem_gkv;

/* A complete unary request: method is the :path without its leading '/'. Valid until
 * the stream is answered. */
typedef struct idem_greq {
    const char *method;
    const idem_gkv *meta; /* every other header, names lowercase */
    size_t n_meta;
    const uint8_t *msg; /* the one message, unframed */
    size_t len;
} idem_greq;

typedef struct idem_grpc idem_grpc;
typedef struct idem_grpc_cfg {
    idem_dispatch *dispatch;
    const char *caller_header;    /* as the HTTP front's, lowercased; NULL = "x-caller" */
    const idem_tls_listener *tls; /* NULL: h2c; else TLS (ALPN h2), client certificates */
    /* The server's, its defaults resolved (idem__server_opts_defaults): none is 0. */
    size_t max_msg, max_pending, max_conns, max_buffered;
    uint32_t max_streams, max_header_list, window;
    uint64_t request_timeout_ms, idle_timeout_ms, answer_timeout_ms;
} idem_grpc_cfg;
/* Listens on url (tcp://HOST:PORT), over TLS when cfg->tls. UNIMPLEMENTED in a build without
 * libnghttp2. */
idem_code idem__grpc_start(const char *url, const idem_grpc_cfg *cfg, idem_grpc **out);
int idem__grpc_port(const idem_grpc *g);
/* The idem.v1.Request frame a gRPC request becomes (malloc'd); NULL with *err set for a
 * request to refuse with INVALID_ARGUMENT, or with *err NULL when out of memory.
 * Exposed for the fuzz target. */
uint8_t *idem__grpc_request_frame(const idem_greq *r, const char *caller_header, size_t *len,
                                  const char **err);
/* Stops the listener and frees it; NULL is a no-op. */
void idem__grpc_stop(idem_grpc *g);

#endif
