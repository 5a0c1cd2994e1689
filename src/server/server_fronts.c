/* The HTTP/1.1 and gRPC fronts of a server: their listeners, with the server's options
 * (the nng front's are in server.c). The first listen of any front checks the chain
 * and starts the workers (idem__server_start). */
#include <string.h>

#include "grpc_front.h"
#include "http_front.h"
#include "server_setup.h"
#include "server_state.h"

/* The longest run of any method: then the HTTP and gRPC fronts answer without it. */
static uint64_t longest_run_ms(const idem_server *srv)
{
    uint64_t run_ms = srv->opts.max_run_ms;
    for (size_t i = 0; i < srv->n_methods; i++) {
        uint64_t m = srv->methods[i].opts.max_run_ms;
        run_ms = m > run_ms ? m : run_ms;
    }
    return run_ms;
}

/* The first listen of any front checks the chain and starts the workers. */
static idem_code first_listen(idem_server *srv)
{
    idem_code code;
    if (!srv->started && ((code = idem__chain_check(&srv->chain, srv->methods, srv->n_methods,
                                                    srv->store)) != IDEM_OK ||
                          (code = idem__server_start(srv)) != IDEM_OK)) {
        return code;
    }
    return IDEM_OK;
}

static idem_code listen_http(idem_server *srv, const char *url, const idem_tls_listener *tls)
{
    idem__err_clear();
    if (srv->http != NULL) {
        return idem__err(IDEM_ALREADY_EXISTS, "the server already has an HTTP listener");
    }
    idem_code code = first_listen(srv);
    if (code != IDEM_OK) {
        return code;
    }
    idem_http_cfg cfg = {.dispatch = srv->dispatch,
                         .obs = srv->rt.obs,
                         .max_body = srv->opts.max_frame,
                         .caller_header = srv->opts.http_caller_header,
                         .max_pending = srv->opts.http_max_pending,
                         .tls = tls,
                         .request_timeout_ms = srv->opts.http_request_timeout_ms,
                         .idle_timeout_ms = srv->opts.http_idle_timeout_ms,
                         .max_conns = srv->opts.http_max_conns,
                         .answer_timeout_ms = longest_run_ms(srv),
                         .max_buffered = srv->opts.http_max_buffered};
    return idem__http_start(url, &cfg, &srv->http);
}

idem_code idem_server_listen_http(idem_server *srv, const char *url)
{
    return listen_http(srv, url, NULL);
}

idem_code idem_server_listen_https(idem_server *srv, const char *url, const idem_tls_listener *tls)
{
    if (tls == NULL || strncmp(url, "https://", 8) != 0) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "an HTTPS listener needs an https:// URL and options");
    }
    idem_code code = idem__server_tls_caller(srv, tls);
    return code != IDEM_OK ? code : listen_http(srv, url, tls);
}

static idem_code listen_grpc(idem_server *srv, const char *url, const idem_tls_listener *tls)
{
    if (srv->grpc != NULL) {
        return idem__err(IDEM_ALREADY_EXISTS, "the server already has a gRPC listener");
    }
    idem_code code = first_listen(srv);
    if (code != IDEM_OK) {
        return code;
    }
    const idem_server_opts *o = &srv->opts;
    idem_grpc_cfg cfg = {.dispatch = srv->dispatch,
                         .caller_header = o->http_caller_header,
                         .tls = tls,
                         .max_msg = o->max_frame,
                         .max_pending = o->grpc_max_pending,
                         .max_conns = o->grpc_max_conns,
                         .max_buffered = o->grpc_max_buffered,
                         .max_streams = o->grpc_max_streams,
                         .max_header_list = o->grpc_max_header_list,
                         .window = o->grpc_window,
                         .request_timeout_ms = o->grpc_request_timeout_ms,
                         .idle_timeout_ms = o->grpc_idle_timeout_ms,
                         .answer_timeout_ms = longest_run_ms(srv)};
    return idem__grpc_start(url, &cfg, &srv->grpc);
}

idem_code idem_server_listen_grpc(idem_server *srv, const char *url)
{
    idem__err_clear();
    if (url == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "a gRPC listener needs a tcp://HOST:PORT URL");
    }
    return listen_grpc(srv, url, NULL);
}

idem_code idem_server_listen_grpc_tls(idem_server *srv, const char *url,
                                      const idem_tls_listener *tls)
{
    idem__err_clear();
    if (url == NULL || tls == NULL || tls->cert_key_file == NULL || tls->client_ca_file == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "a gRPC TLS listener needs a tcp://HOST:PORT "
                                                "URL, cert_key_file, client_ca_file and a caller");
    }
    idem_code code = idem__server_tls_caller(srv, tls);
    return code != IDEM_OK ? code : listen_grpc(srv, url, tls);
}

int idem_server_grpc_port(const idem_server *srv)
{
    return idem__grpc_port(srv->grpc);
}

int idem_server_http_port(const idem_server *srv)
{
    return idem__http_port(srv->http);
}
