/* idem_server_opts: what idem_server_opts_init sets, and the default each field left 0
 * takes when the server is created (docs/operations.md and docs/semantics.md document
 * them). */
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "server_setup.h"
#include "store.h"

#define DEFAULT_MAX_FRAME ((size_t)4 << 20)
#define DEFAULT_CONTEXTS 256 /* parked duplicates hold a context, not a thread */

void idem_server_opts_init(idem_server_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->default_chain = true;
    opts->log_level = IDEM_LOG_ERROR;
}

void idem__server_opts_defaults(idem_server_opts *o)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    o->contexts = o->contexts ? o->contexts : DEFAULT_CONTEXTS;
    if (o->workers == 0) {
        o->workers = (size_t)(cores > 0 ? cores : 1) * 2;
    }
    o->max_frame = o->max_frame ? o->max_frame : DEFAULT_MAX_FRAME;
    o->result_ttl_ms = o->result_ttl_ms ? o->result_ttl_ms : 24 * 3600 * 1000ull;
    o->lease_ms = o->lease_ms ? o->lease_ms : 30 * 1000ull;
    o->token_ttl_ms = o->token_ttl_ms ? o->token_ttl_ms : 10 * 60 * 1000ull;
    o->max_wait_ms = o->max_wait_ms ? o->max_wait_ms : 10 * 1000ull;
    o->sweep_interval_ms = o->sweep_interval_ms ? o->sweep_interval_ms : 60 * 1000ull;
    o->sweep_batch = o->sweep_batch ? o->sweep_batch : 1000;
    o->max_run_ms = o->max_run_ms ? o->max_run_ms : 5 * 60 * 1000ull;
    o->max_waiters = o->max_waiters ? o->max_waiters : 4096;
    o->http_max_pending = o->http_max_pending ? o->http_max_pending : 1024;
    o->redrive_batch = o->redrive_batch ? o->redrive_batch : 16;
    o->redrive_max_runs = o->redrive_max_runs ? o->redrive_max_runs : 3;
    o->redrive_max_runs = o->redrive_max_runs < 254 ? o->redrive_max_runs : 254;
    o->signature_window_ms = o->signature_window_ms ? o->signature_window_ms : 5 * 60 * 1000ull;
    o->http_request_timeout_ms = o->http_request_timeout_ms ? o->http_request_timeout_ms : 10000;
    o->http_idle_timeout_ms = o->http_idle_timeout_ms ? o->http_idle_timeout_ms : 60000;
    o->http_max_conns = o->http_max_conns ? o->http_max_conns : 1024;
    o->grpc_max_streams = o->grpc_max_streams ? o->grpc_max_streams : 100;
    o->grpc_max_header_list = o->grpc_max_header_list ? o->grpc_max_header_list : 16384;
    o->grpc_window = o->grpc_window ? o->grpc_window : 65535;
    o->grpc_request_timeout_ms = o->grpc_request_timeout_ms ? o->grpc_request_timeout_ms : 10000;
    o->grpc_idle_timeout_ms = o->grpc_idle_timeout_ms ? o->grpc_idle_timeout_ms : 60000;
    o->grpc_max_conns = o->grpc_max_conns ? o->grpc_max_conns : 1024;
    o->grpc_max_pending = o->grpc_max_pending ? o->grpc_max_pending : 1024;
    if (o->grpc_max_buffered == 0) {
        o->grpc_max_buffered = o->max_frame > SIZE_MAX / 64 ? SIZE_MAX : 64 * o->max_frame;
    }
    if (o->http_max_buffered == 0) {
        o->http_max_buffered = o->max_frame > SIZE_MAX / 64 ? SIZE_MAX : 64 * o->max_frame;
    }
}

idem_code idem__tomb_keep_set(idem_store *st, const idem_server_opts *o, const idem_method *methods,
                              size_t n)
{
    uint64_t keep = o->tombstone_ttl_ms;
    for (size_t i = 0; i < n; i++) {
        uint64_t m = methods[i].opts.tombstone_ttl_ms;
        keep = m > keep ? m : keep;
    }
    return idem__store_tomb_keep(st, keep);
}
