/* TLS configurations for the fronts (tls.c): a server side that requires client
 * certificates from one CA. */
#ifndef IDEMRPC_TLS_H
#define IDEMRPC_TLS_H

#include <nng/nng.h>
#include <nng/supplemental/tls/tls.h>

#include "call.h"

/* A server configuration from tls (all three fields required), or an error naming
 * the file nng/mbedtls refused. */
idem_code idem__tls_server_config(nng_tls_config **out, const idem_tls_listener *tls);

#endif
