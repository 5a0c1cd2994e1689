/* Server internals reachable from tests and the fuzz target. */
#ifndef IDEMRPC_SERVER_INTERNAL_H
#define IDEMRPC_SERVER_INTERNAL_H

#include <nng/nng.h>

#include "idemrpc/server.h"

/* One request frame in, one response message out (the whole chain, no transport).
 * Returns NULL only when not even an INTERNAL answer could be allocated. The caller
 * frees the message. Safe to call on a server that does not listen. */
nng_msg *idem__server_serve_frame(idem_server *srv, const void *frame, size_t len);

#endif
