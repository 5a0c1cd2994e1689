/* The server's state, for server.c (its life cycle) and server_fronts.c (the HTTP and
 * gRPC listeners) only. */
#ifndef IDEMRPC_SERVER_STATE_H
#define IDEMRPC_SERVER_STATE_H

#include "builtins.h"
#include "dispatch.h"
#include "grpc_front.h"
#include "http_front.h"
#include "identity.h"
#include "nng_front.h"
#include "redriver.h"
#include "sweeper.h"

struct idem_server {
    idem_server_opts opts;
    idem_store *store;
    idem_runtime rt;
    idem_token_cfg token;
    idem_cache_cfg cache;
    bool owns_store, started;

    idem_method *methods; /* sorted by name */
    size_t n_methods;
    idem_chain chain;
    size_t n_first; /* interceptors added with idem_server_use_first, at the front */

    idem_dispatch *dispatch;
    idem_nng_front *nng;
    idem_http *http;
    idem_grpc *grpc;
    idem_sweeper *sweeper;
    idem_redriver *redriver; /* NULL unless opts.redrive_interval_ms */
    idem_identity *identity; /* NULL: self-declared callers */
};

/* Checks nothing: starts the workers, the sweeper, the re-driver and the nng front's
 * contexts (server.c), once. */
idem_code idem__server_start(idem_server *srv);
/* The listener's caller is verified from now on: never accepted merely declared. */
idem_code idem__server_tls_caller(idem_server *srv, const idem_tls_listener *tls);

#endif
