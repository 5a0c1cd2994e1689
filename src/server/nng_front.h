/* The nng front (nng_front.c): a rep0 socket whose contexts feed the dispatcher. */
#ifndef IDEMRPC_NNG_FRONT_H
#define IDEMRPC_NNG_FRONT_H

#include <nng/nng.h>

#include "dispatch.h"

typedef struct idem_nng_front idem_nng_front;

/* Opens the socket and its contexts (none receives yet). */
idem_code idem__nng_front_open(idem_nng_front **out, idem_dispatch *d, size_t contexts,
                               size_t max_frame);
/* tls: NULL for a plain listener, else required client certificates (tls.c). */
idem_code idem__nng_front_listen(idem_nng_front *f, const char *url, const idem_tls_listener *tls);
/* The pipes whose identity is cached (nng_peers.c): the open ones, for tests. */
size_t idem__nng_front_pipe_peers(idem_nng_front *f);
/* The port of the first tcp listener (for port 0), else 0. */
int idem__nng_front_port(const idem_nng_front *f);
/* Arms every context. fast_path: answer stored replays on nng's callback thread. */
void idem__nng_front_start(idem_nng_front *f, bool fast_path);
/* Stops the callbacks (cancel + wait), closes the socket, frees. NULL is a no-op. Call
 * after idem__dispatch_stop, so that every answer has been sent. */
void idem__nng_front_close(idem_nng_front *f);

/* One request frame in, one response message out (the whole chain on this thread).
 * NULL only when not even an INTERNAL answer could be allocated. */
nng_msg *idem__nng_serve_frame(idem_dispatch *d, const void *frame, size_t len);

#endif
