/* Entry points into a server for tests and the fuzz target. */
#ifndef IDEMRPC_SERVER_INTERNAL_H
#define IDEMRPC_SERVER_INTERNAL_H

#include <nng/nng.h>

#include "dispatch.h"

/* ---- tests and the fuzz target ---- */
/* idem__dispatch_run on the server's dispatcher; a call that needs a worker is
 * discarded (false, nothing left to free). */
bool idem__server_run(idem_server *srv, const void *frame, size_t len, bool fast_only,
                      idem_served *out);
void idem__server_done(idem_server *srv, idem_served *s);
/* One request frame in, one response message out (the whole chain, no transport).
 * Returns NULL only when not even an INTERNAL answer could be allocated. The caller
 * frees the message. Safe to call on a server that does not listen. */
nng_msg *idem__server_serve_frame(idem_server *srv, const void *frame, size_t len);
/* The wall clock (ms since the epoch) of the server's lease and expiry arithmetic,
 * e.g. a skewed one. Before the first listen. */
void idem__server_set_clock(idem_server *srv, uint64_t (*now_ms)(void *arg), void *arg);
/* One whole pass of the re-driver, now, on its thread; returns when it has ended.
 * FAILED_PRECONDITION when the server runs no re-driver or does not listen yet. */
idem_code idem__server_redrive_now(idem_server *srv);
/* How many nng pipes have a cached identity (nng_peers.c): the open ones. */
size_t idem__server_pipe_peers(idem_server *srv);

#endif
