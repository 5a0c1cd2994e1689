/* idem_server: the method registry, the chain, and the life cycle of a server.
 *
 *   idem_server_create ─ register / use ─ listen ─▶ fronts (nng_front.c; server_fronts.c:
 *                                                    http_front.c, grpc_front.c)
 *                                                    └─▶ dispatcher (src/dispatch) ─▶ chain
 *
 * The server builds the chain and owns the pieces; the fronts hand calls to the
 * dispatcher, which runs them on its workers. Registration ends at the first listen:
 * from then on the registry and the chain are read-only. */
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "server_internal.h"
#include "server_setup.h"
#include "server_state.h"
#include "store.h"

void idem__server_set_clock(idem_server *srv, uint64_t (*now_ms)(void *arg), void *arg)
{
    srv->rt.clock = (idem_clock){now_ms, arg};
}

idem_code idem__server_redrive_now(idem_server *srv)
{
    if (srv->redriver == NULL) {
        return idem__err(IDEM_FAILED_PRECONDITION, "no re-driver runs on this server");
    }
    idem__redriver_run_now(srv->redriver);
    return IDEM_OK;
}

size_t idem__server_pipe_peers(idem_server *srv)
{
    return idem__nng_front_pipe_peers(srv->nng);
}

static int method_cmp(const void *a, const void *b)
{
    return strcmp(((const idem_method *)a)->name, ((const idem_method *)b)->name);
}

static const idem_method *method_find(void *arg, const char *name)
{
    const idem_server *srv = arg;
    idem_method probe = {.name = (char *)name};
    if (srv->n_methods == 0) {
        return NULL;
    }
    return bsearch(&probe, srv->methods, srv->n_methods, sizeof(idem_method), method_cmp);
}

#define KNOWN_METHOD_FLAGS                                                                         \
    (IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED | IDEM_METHOD_TOKEN_REQUIRED |                  \
     IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_DEBOUNCE | IDEM_METHOD_STEPS)

/* What idem_server_register refuses: a name the wire would refuse (codec.c), a NULL
 * handler, unknown flag bits, a canonical fingerprint that cannot work (fingerprint.c). */
static idem_code register_check(const char *name, idem_handler_fn fn, const idem_method_opts *opts)
{
    if (idem__method_name_check(name) != IDEM_OK) {
        idem_errkeep keep;
        idem__err_keep(&keep);
        return idem__err(IDEM_INVALID_ARGUMENT, "cannot register method \"%s\": %s",
                         name != NULL ? name : "(null)", keep.msg);
    }
    if (fn == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "cannot register method %s: the handler is NULL",
                         name);
    }
    if (opts != NULL && (opts->flags & ~(unsigned)KNOWN_METHOD_FLAGS) != 0) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "cannot register method %s: unknown flag bits 0x%x in "
                         "idem_method_opts.flags (known: idem_method_flags)",
                         name, opts->flags & ~(unsigned)KNOWN_METHOD_FLAGS);
    }
    return opts != NULL ? idem__fingerprint_check(name, opts->fingerprint, opts->fingerprint_arg)
                        : IDEM_OK;
}

idem_code idem_server_register(idem_server *srv, const char *name, idem_handler_fn fn, void *arg,
                               const idem_method_opts *opts)
{
    idem_code code;
    idem__err_clear();
    if (srv->started) {
        return idem__err(IDEM_FAILED_PRECONDITION, "register before the first listen");
    }
    if ((code = register_check(name, fn, opts)) != IDEM_OK) {
        return code;
    }
    if (method_find(srv, name) != NULL) {
        return idem__err(IDEM_ALREADY_EXISTS, "method %s already registered", name);
    }
    idem_method *grown = realloc(srv->methods, (srv->n_methods + 1) * sizeof(*grown));
    if (grown == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    srv->methods = grown;
    idem_method m = {.name = strdup(name), .fn = fn, .arg = arg};
    if (m.name == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (opts != NULL) {
        m.opts = *opts;
    }
    if ((m.opts.flags & IDEM_METHOD_STEPS) && (m.opts.flags & IDEM_METHOD_TRANSACTIONAL)) {
        free(m.name);
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "cannot register method %s: journaled steps are for claim-mode "
                         "handlers, a transactional handler's writes already commit together",
                         name);
    }
    if (m.opts.flags & IDEM_METHOD_STEPS) {
        m.opts.flags |= IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED; /* a claim, a key */
    }
    if (m.opts.flags & IDEM_METHOD_TRANSACTIONAL) {
        m.opts.flags |= IDEM_METHOD_KEY_REQUIRED; /* no key, no claim, no transaction */
    }
    srv->methods[srv->n_methods++] = m;
    qsort(srv->methods, srv->n_methods, sizeof(idem_method), method_cmp);
    return IDEM_OK;
}

/* Inserts an interceptor at position at of the chain. */
static idem_code chain_insert(idem_server *srv, size_t at, const char *name, idem_interceptor_fn fn,
                              void *arg)
{
    idem__err_clear();
    if (srv->started) {
        return idem__err(IDEM_FAILED_PRECONDITION, "add interceptors before the first listen");
    }
    if (fn == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "interceptor %s: the function is NULL",
                         name != NULL ? name : "(unnamed)");
    }
    idem_interceptor *grown =
        realloc(srv->chain.items, (srv->chain.n + 1) * sizeof(idem_interceptor));
    if (grown == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    srv->chain.items = grown;
    char *copy = idem__strdup(name);
    if (copy == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    memmove(&srv->chain.items[at + 1], &srv->chain.items[at],
            (srv->chain.n - at) * sizeof(idem_interceptor));
    srv->chain.items[at] = (idem_interceptor){.name = copy, .fn = fn, .arg = arg};
    srv->chain.n++;
    return IDEM_OK;
}

idem_code idem_server_use(idem_server *srv, const char *name, idem_interceptor_fn fn, void *arg)
{
    return chain_insert(srv, srv->chain.n, name, fn, arg);
}

idem_code idem_server_use_first(idem_server *srv, const char *name, idem_interceptor_fn fn,
                                void *arg)
{
    idem_code code = chain_insert(srv, srv->n_first, name, fn, arg);
    srv->n_first += code == IDEM_OK;
    return code;
}

idem_code idem_server_use_builtin(idem_server *srv, idem_builtin which)
{
    idem_code code;
    switch (which) {
    case IDEM_BUILTIN_REQUEST_ID:
        code = idem_server_use(srv, "request_id", idem__request_id_interceptor, NULL);
        break;
    case IDEM_BUILTIN_TOKEN:
        code = idem_server_use(srv, "token", idem__token_interceptor, &srv->token);
        break;
    case IDEM_BUILTIN_RESULT_CACHE:
        code = idem_server_use(srv, "result_cache", idem__result_cache_interceptor, &srv->cache);
        srv->token.consume_with_claim = srv->token.consume_with_claim || code == IDEM_OK;
        break;
    case IDEM_BUILTIN_DEBOUNCE:
        if (srv->opts.debounce == NULL) {
            return idem__err(IDEM_INVALID_ARGUMENT, "no debounce window configured");
        }
        code = idem_server_use(srv, "debounce", idem__debounce_interceptor, srv->opts.debounce);
        break;
    default:
        return idem__err(IDEM_INVALID_ARGUMENT, "unknown built-in interceptor %d", (int)which);
    }
    if (code == IDEM_OK) {
        idem_interceptor *it = &srv->chain.items[srv->chain.n - 1];
        it->builtin = true;
        it->kind = which;
        /* All but debounce (a Redis round trip) never block when asked to be fast. */
        it->fast_safe = which != IDEM_BUILTIN_DEBOUNCE;
    }
    return code;
}

/* ---- test and fuzz entry points (server_internal.h) ---- */
bool idem__server_run(idem_server *srv, const void *frame, size_t len, bool fast_only,
                      idem_served *out)
{
    idem_run_opts opts = {.wire_reply = true, .fast_only = fast_only};
    bool answered = idem__dispatch_run(srv->dispatch, frame, len, NULL, opts, out);
    if (!answered) {
        idem__dispatch_discard(out); /* no worker here to hand it to */
    }
    return answered;
}

void idem__server_done(idem_server *srv, idem_served *s)
{
    idem__dispatch_done(srv->dispatch, s);
}

nng_msg *idem__server_serve_frame(idem_server *srv, const void *frame, size_t len)
{
    return idem__nng_serve_frame(srv->dispatch, frame, len);
}

/* ---- life cycle ---- */

static idem_code server_default_setup(idem_server *srv)
{
    idem_code code;
    idem_method_opts issue = {0};
    if ((code = idem_server_register(srv, IDEM_TOKEN_ISSUE_METHOD, idem__token_issue_handler,
                                     &srv->token, &issue)) != IDEM_OK) {
        return code;
    }
    if (!srv->opts.default_chain) {
        return IDEM_OK;
    }
    if ((code = idem_server_use_builtin(srv, IDEM_BUILTIN_REQUEST_ID)) != IDEM_OK ||
        (code = idem_server_use_builtin(srv, IDEM_BUILTIN_TOKEN)) != IDEM_OK ||
        (srv->opts.debounce != NULL &&
         (code = idem_server_use_builtin(srv, IDEM_BUILTIN_DEBOUNCE)) != IDEM_OK)) {
        return code;
    }
    return idem_server_use_builtin(srv, IDEM_BUILTIN_RESULT_CACHE);
}

/* The interceptors' configurations, the default methods and chain, the dispatcher and
 * the nng front (not started). */
static idem_code server_open(idem_server *srv)
{
    srv->token = (idem_token_cfg){.store = srv->store, .ttl_ms = srv->opts.token_ttl_ms};
    srv->cache = (idem_cache_cfg){.store = srv->store,
                                  .result_ttl_ms = srv->opts.result_ttl_ms,
                                  .lease_ms = srv->opts.lease_ms,
                                  .max_wait_ms = srv->opts.max_wait_ms,
                                  .max_run_ms = srv->opts.max_run_ms,
                                  .tombstone_ttl_ms = srv->opts.tombstone_ttl_ms};
    idem_dispatch_cfg d = {.chain = &srv->chain,
                           .find_method = method_find,
                           .find_arg = srv,
                           .rt = &srv->rt,
                           .store = srv->store,
                           .identity = srv->identity,
                           .workers = srv->opts.workers,
                           .max_queue = srv->opts.max_queue,
                           .max_frame = srv->opts.max_frame,
                           .max_waiters = srv->opts.max_waiters};
    idem_code code;
    if ((code = server_default_setup(srv)) != IDEM_OK ||
        (code = idem__dispatch_create(&srv->dispatch, &d)) != IDEM_OK) {
        return code;
    }
    return idem__nng_front_open(&srv->nng, srv->dispatch, srv->opts.contexts, srv->opts.max_frame);
}

idem_code idem_server_create(idem_server **out, const idem_server_opts *opts)
{
    idem_server *srv;
    idem_code code;
    idem__err_clear();
    *out = NULL;
    if ((srv = calloc(1, sizeof(*srv))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    srv->opts = *opts;
    idem__server_opts_defaults(&srv->opts);
    code = idem__identity_create(&srv->identity, &srv->opts);
    srv->opts.db_path = NULL;        /* not retained */
    srv->opts.caller_secrets = NULL; /* copied into srv->identity */
    srv->opts.ipc_callers = NULL;
    if (code != IDEM_OK) {
        goto fail;
    }
    srv->rt.clock = (idem_clock){idem__system_clock, NULL};
    srv->rt.redrive = srv->opts.redrive_interval_ms != 0;
    if ((srv->rt.obs = idem__observer_create(&srv->opts)) == NULL) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        goto fail;
    }
    srv->store = opts->store;
    if (srv->store == NULL) {
        code = idem_store_open_lmdb(&srv->store, opts->db_path, opts->map_size, opts->store_flags);
        if (code != IDEM_OK) {
            goto fail;
        }
        srv->owns_store = true;
    }
    if ((code = server_open(srv)) != IDEM_OK) {
        goto fail;
    }
    *out = srv;
    idem__err_clear();
    return IDEM_OK;
fail:;
    idem_errkeep keep;
    idem__err_keep(&keep);
    idem_server_destroy(srv);
    return idem__err_put(&keep, code);
}

idem_code idem__server_start(idem_server *srv)
{
    bool fast_path = idem__store_has(srv->store, IDEM__STORE_CAP_NONBLOCKING_READ);
    for (size_t i = 0; i < srv->chain.n; i++) {
        fast_path = fast_path && srv->chain.items[i].fast_safe;
    }
    srv->rt.can_park = idem__chain_can_park(&srv->chain);
    idem_code code;
    if ((code = idem__tomb_keep_set(srv->store, &srv->opts, srv->methods, srv->n_methods)) ||
        (code = idem__dispatch_start(srv->dispatch)) != IDEM_OK ||
        (code = idem__sweeper_start(&srv->sweeper, srv->store, srv->opts.sweep_interval_ms,
                                    srv->opts.sweep_batch, srv->rt.obs)) != IDEM_OK) {
        return code;
    }
    if (srv->opts.redrive_interval_ms != 0) {
        idem_redriver_cfg r = {.dispatch = srv->dispatch,
                               .store = srv->store,
                               .rt = &srv->rt,
                               .find_method = method_find,
                               .find_arg = srv,
                               .interval_ms = srv->opts.redrive_interval_ms,
                               .batch = srv->opts.redrive_batch,
                               .run_ms = srv->opts.max_run_ms,
                               .max_runs = srv->opts.redrive_max_runs};
        if ((code = idem__redriver_start(&srv->redriver, &r)) != IDEM_OK) {
            return code;
        }
    }
    idem__nng_front_start(srv->nng, fast_path);
    srv->started = true;
    return IDEM_OK;
}

static idem_code listen_nng(idem_server *srv, const char *url, const idem_tls_listener *tls)
{
    idem_code code;
    idem__err_clear();
    if (!srv->started && (code = idem__chain_check(&srv->chain, srv->methods, srv->n_methods,
                                                   srv->store)) != IDEM_OK) {
        return code;
    }
    if ((code = idem__nng_front_listen(srv->nng, url, tls)) != IDEM_OK) {
        return code;
    }
    return srv->started ? IDEM_OK : idem__server_start(srv);
}

idem_code idem_server_listen(idem_server *srv, const char *url)
{
    return listen_nng(srv, url, NULL);
}

idem_code idem__server_tls_caller(idem_server *srv, const idem_tls_listener *tls)
{
    return tls->caller != NULL ? idem__identity_add_tls_caller(srv->identity, tls->caller)
                               : IDEM_OK;
}

idem_code idem_server_listen_tls(idem_server *srv, const char *url, const idem_tls_listener *tls)
{
    if (tls == NULL || strncmp(url, "tls+tcp", 7) != 0) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "a TLS listener needs a tls+tcp:// URL and options");
    }
    idem_code code = idem__server_tls_caller(srv, tls);
    return code != IDEM_OK ? code : listen_nng(srv, url, tls);
}

int idem_server_port(const idem_server *srv)
{
    return idem__nng_front_port(srv->nng);
}

idem_store *idem_server_store(idem_server *srv)
{
    return srv->store;
}

idem_observer *idem__server_observer(idem_server *srv)
{
    return srv->rt.obs;
}

void idem_server_destroy(idem_server *srv)
{
    if (srv == NULL) {
        return;
    }
    /* Workers first: a running handler finishes and its front sends the reply while the
     * socket is still open; queued and parked calls are dropped (their clients retry).
     * Then the re-driver: a call it runs finishes (its wait as a duplicate has ended). */
    if (srv->dispatch != NULL) {
        idem__dispatch_stop(srv->dispatch);
    }
    idem__redriver_stop(srv->redriver);
    idem__sweeper_stop(srv->sweeper);
    idem__http_stop(srv->http); /* waits for its callbacks; none can queue any more */
    idem__grpc_stop(srv->grpc);
    idem__nng_front_close(srv->nng);
    idem__dispatch_destroy(srv->dispatch);
    for (size_t i = 0; i < srv->n_methods; i++) {
        free(srv->methods[i].name);
    }
    for (size_t i = 0; i < srv->chain.n; i++) {
        free(srv->chain.items[i].name);
    }
    if (srv->owns_store) {
        idem_store_close(srv->store);
    }
    idem__observer_destroy(srv->rt.obs);
    idem__identity_destroy(srv->identity);
    free(srv->methods);
    free(srv->chain.items);
    free(srv);
}
