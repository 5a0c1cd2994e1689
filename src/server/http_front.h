/* The HTTP front (http_front.c): the chain behind POST /{package.Service}/{Method}. */
#ifndef IDEMRPC_HTTP_FRONT_H
#define IDEMRPC_HTTP_FRONT_H

#include "dispatch.h"

typedef struct idem_http idem_http;
typedef struct idem_http_cfg {
    idem_dispatch *dispatch;
    idem_observer *obs; /* GET /metrics */
    size_t max_body, max_pending;
    const char *caller_header;     /* NULL = "X-Caller" */
    const idem_tls_listener *tls; /* NULL: plain HTTP; else https with client certificates */
} idem_http_cfg;
idem_code idem__http_start(const char *url, const idem_http_cfg *cfg, idem_http **out);
int idem__http_port(const idem_http *h);
/* Stops the listener and frees it; NULL is a no-op. */
void idem__http_stop(idem_http *h);

#endif
