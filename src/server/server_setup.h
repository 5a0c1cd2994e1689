/* What idem_server_create and the first listen use: the options' defaults
 * (server_opts.c) and the chain's checks (chain_check.c); the observer for
 * server_metrics.c. */
#ifndef IDEMRPC_SERVER_SETUP_H
#define IDEMRPC_SERVER_SETUP_H

#include "call.h"

/* Fills every field of o left 0 with its default (and caps redrive_max_runs). */
void idem__server_opts_defaults(idem_server_opts *o);

/* Tells st's sweep to keep tombstones for the longest horizon of the server (o) and its
 * methods (methods[0..n)); FAILED_PRECONDITION when there is one and st keeps none. */
idem_code idem__tomb_keep_set(idem_store *st, const idem_server_opts *o, const idem_method *methods,
                              size_t n);

/* The chain must keep the promises of every registered method (methods[0..n)) on this
 * store: FAILED_PRECONDITION, saying which, when it does not. */
idem_code idem__chain_check(const idem_chain *chain, const idem_method *methods, size_t n,
                            idem_store *store);
/* A waiting call can leave the chain and resume at result_cache later only when every
 * interceptor before it is a built-in that just returns what the rest returned. */
bool idem__chain_can_park(const idem_chain *chain);

/* The server's counters and log sink (server.c), for its metrics sources
 * (server_metrics.c). */
idem_observer *idem__server_observer(idem_server *srv);

#endif
