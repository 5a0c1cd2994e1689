/* The HTTP front (http_front.c): the chain behind POST /{package.Service}/{Method}. */
#ifndef IDEMRPC_HTTP_FRONT_H
#define IDEMRPC_HTTP_FRONT_H

#include <nng/nng.h>

#include "dispatch.h"
#include "http_parse.h"

typedef struct idem_http idem_http;
typedef struct idem_http_cfg {
    idem_dispatch *dispatch;
    idem_observer *obs; /* GET /metrics */
    size_t max_body, max_pending;
    const char *caller_header;    /* NULL = "X-Caller" */
    const idem_tls_listener *tls; /* NULL: plain HTTP; else https with client certificates */
    /* The server's, its defaults resolved (idem__server_opts_defaults): none is 0. */
    uint64_t request_timeout_ms, idle_timeout_ms;
    size_t max_conns;
    uint64_t answer_timeout_ms;
    size_t max_buffered;
} idem_http_cfg;
idem_code idem__http_start(const char *url, const idem_http_cfg *cfg, idem_http **out);
int idem__http_port(const idem_http *h);
/* The idem.v1.Request frame an HTTP request becomes (malloc'd); NULL with *err set for
 * a request to refuse with 400, or with *err NULL when out of memory. Exposed for the
 * fuzz target. */
uint8_t *idem__http_request_frame(const idem_hreq *r, const char *caller_header, const void *body,
                                  size_t blen, size_t *len, const char **err);
/* Stops the listener and frees it; NULL is a no-op. */
void idem__http_stop(idem_http *h);

#endif
