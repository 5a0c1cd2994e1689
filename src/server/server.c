/* idem_server: nng rep0 contexts feeding idemrpc's worker threads.
 *
 * Each context is one in-flight call with ONE callback whose switch is its whole life:
 *
 *   INIT → RECV ──frame──▶ QUEUED (worker decodes, runs the chain, encodes) → SEND → RECV
 *
 * The nng callback never blocks: it answers what needs no worker (a stored replay, a bad
 * frame), hands the rest to the work queue and re-arms the receive after a send.
 * Handlers and store writes run on the workers. A duplicate of a call still running
 * parks in the in-flight table (inflight.c) and gives its worker back; the completion
 * (or its re-read time) queues it again and it resumes at result_cache. The number of
 * contexts bounds in-flight work, parked ones included; nng holds further requests in
 * its pipes (back-pressure). */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/supplemental/util/platform.h>
#include <nng/transport/tcp/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "call.h"
#include "inflight.h"
#include "server_internal.h"

#define DEFAULT_MAX_FRAME ((size_t)4 << 20)
#define DEFAULT_CONTEXTS 256 /* parked duplicates hold a context, not a thread */
#define FRAME_SLACK ((size_t)64 << 10) /* read this much past max_frame to answer it */

typedef enum work_state { WORK_INIT, WORK_RECV, WORK_QUEUED, WORK_SEND } work_state;

typedef struct work {
    idem_job job; /* first: the queue sees works as jobs */
    work_state state;
    nng_aio *aio;
    nng_ctx ctx;
    nng_msg *msg;
    idem_server *srv;
} work;

struct idem_server {
    nng_socket sock;
    bool sock_open, started;
    idem_server_opts opts;
    idem_runtime rt;
    bool owns_store;

    idem_method *methods; /* sorted by name */
    size_t n_methods;
    idem_chain chain;

    work *works;
    size_t n_works;
    pthread_t *threads;
    size_t n_threads;
    pthread_t sweeper;
    bool sweeper_started;

    pthread_mutex_t mu;      /* guards queue, stopping */
    pthread_cond_t cv;       /* queue non-empty, or stopping */
    pthread_cond_t sweep_cv; /* stopping (wakes the sweeper early) */
    idem_job *head, *tail;
    size_t n_queued;
    bool stopping;
    bool fast_path; /* the whole chain is fast_safe and store reads never block */
    size_t result_cache_pos; /* where a parked call resumes */
    int port;
    idem_http *http;
};

static void work_cb(void *arg);

void idem_server_opts_init(idem_server_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->default_chain = true;
    opts->log_level = IDEM_LOG_ERROR;
}

static void opts_defaults(idem_server_opts *o)
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
}

static uint64_t system_clock(void *arg)
{
    (void)arg;
    return idem__now_ms();
}

uint64_t idem__rt_now_ms(const idem_runtime *rt)
{
    return rt->clock.now_ms(rt->clock.arg);
}

void idem__server_set_clock(idem_server *srv, uint64_t (*now_ms)(void *arg), void *arg)
{
    srv->rt.clock = (idem_clock){now_ms, arg};
}

static idem_code nng_fail(int rv, const char *what)
{
    return idem__err(rv == NNG_ENOMEM ? IDEM_RESOURCE_EXHAUSTED : IDEM_UNAVAILABLE, "%s: %s", what,
                     nng_strerror(rv));
}

static int method_cmp(const void *a, const void *b)
{
    return strcmp(((const idem_method *)a)->name, ((const idem_method *)b)->name);
}

static const idem_method *method_find(const idem_server *srv, const char *name)
{
    idem_method probe = {.name = (char *)name};
    if (srv->n_methods == 0) {
        return NULL;
    }
    return bsearch(&probe, srv->methods, srv->n_methods, sizeof(idem_method), method_cmp);
}

idem_code idem_server_register(idem_server *srv, const char *name, idem_handler_fn fn, void *arg,
                               const idem_method_opts *opts)
{
    if (srv->started) {
        return idem__err(IDEM_FAILED_PRECONDITION, "register before the first listen");
    }
    if (name == NULL || fn == NULL || strlen(name) > IDEM_MAX_METHOD || !strchr(name, '/')) {
        return idem__err(IDEM_INVALID_ARGUMENT, "method name must be \"pkg.Svc/Method\"");
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
    if (m.opts.flags & IDEM_METHOD_TRANSACTIONAL) {
        m.opts.flags |= IDEM_METHOD_KEY_REQUIRED; /* no key, no claim, no transaction */
    }
    srv->methods[srv->n_methods++] = m;
    qsort(srv->methods, srv->n_methods, sizeof(idem_method), method_cmp);
    return IDEM_OK;
}

idem_code idem_server_use(idem_server *srv, const char *name, idem_interceptor_fn fn, void *arg)
{
    if (srv->started) {
        return idem__err(IDEM_FAILED_PRECONDITION, "add interceptors before the first listen");
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
    srv->chain.items[srv->chain.n++] = (idem_interceptor){copy, fn, arg, false, false};
    if (fn == idem__result_cache_interceptor) {
        srv->rt.has_result_cache = true;
    }
    return IDEM_OK;
}

idem_code idem_server_use_builtin(idem_server *srv, idem_builtin which)
{
    idem_code code;
    switch (which) {
    case IDEM_BUILTIN_REQUEST_ID:
        code = idem_server_use(srv, "request_id", idem__request_id_interceptor, &srv->rt);
        break;
    case IDEM_BUILTIN_TOKEN:
        code = idem_server_use(srv, "token", idem__token_interceptor, &srv->rt);
        break;
    case IDEM_BUILTIN_RESULT_CACHE:
        code = idem_server_use(srv, "result_cache", idem__result_cache_interceptor, &srv->rt);
        break;
    case IDEM_BUILTIN_DEBOUNCE:
        if (srv->opts.debounce == NULL) {
            return idem__err(IDEM_INVALID_ARGUMENT, "no debounce window configured");
        }
        return idem_server_use(srv, "debounce", idem__debounce_interceptor, srv->opts.debounce);
    default:
        return idem__err(IDEM_INVALID_ARGUMENT, "unknown built-in interceptor %d", (int)which);
    }
    if (code == IDEM_OK) { /* these never block when asked to be fast (fast_only) */
        srv->chain.items[srv->chain.n - 1].fast_safe = true;
        srv->chain.items[srv->chain.n - 1].builtin = true;
    }
    return code;
}

/* ---- one call: frame in, frame out ---- */

/* Encodes the call's response; falls back to a bare INTERNAL answer on ENOMEM and to
 * NULL (no reply: the client times out and retries) when even that fails. */
static nng_msg *response_msg(idem_call *call)
{
    uint8_t *buf;
    size_t len;
    nng_msg *msg;
    if (idem__call_set_meta(call, "request-id", call->request_id) != IDEM_OK ||
        idem__encode_call_response(call, true, &buf, &len) != IDEM_OK) {
        idem__call_reset_response(call);
        idem_call_fail(call, IDEM_INTERNAL, "out of memory encoding the response");
        if (idem__encode_call_response(call, true, &buf, &len) != IDEM_OK) {
            return NULL;
        }
    }
    if (nng_msg_alloc(&msg, 0) != 0 || nng_msg_append(msg, buf, len) != 0) {
        free(buf);
        return NULL; /* nng_msg_alloc failing leaves msg unset; append failing frees nothing */
    }
    free(buf);
    return msg;
}

/* The key the call ran under, for the client (idem_result.key): a business key may
 * have replaced the one it sent. A token is not echoed. */
static void answer_key(idem_call *call)
{
    if (call->key_source != IDEM_KEY_NONE && call->key_source != IDEM_KEY_TOKEN) {
        idem__call_set_meta(call, "idem-key", call->key);
    }
}

/* Decode + chain. false: a fast_only call needs a worker, or (parkable) the call parked
 * in s->call.suspend; nothing to answer yet. */
static bool run(idem_server *srv, const void *frame, size_t len, bool fast_only, bool parkable,
                idem_served *out)
{
    uint64_t start = idem__mono_us();
    idem_code code;

    out->req = NULL;
    out->start_us = start;
    if (len > srv->opts.max_frame) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "frame of %zu bytes exceeds the %zu byte limit",
                         len, srv->opts.max_frame);
    } else {
        code = idem__decode_request(frame, len, &out->req);
    }
    if (code != IDEM_OK) {
        idem__server_reject(srv, out,
                            code == IDEM_RESOURCE_EXHAUSTED ? IDEM_REASON_TOO_LARGE
                                                            : IDEM_REASON_BAD_FRAME,
                            code, idem_errmsg());
        return true;
    }
    idem__call_init(&out->call, out->req, method_find(srv, out->req->method), &srv->rt);
    out->call.fast_only = fast_only;
    out->call.parkable = parkable;
    uint64_t deadline = out->req->deadline_unix_ms;
    if (deadline != 0 && deadline <= idem__rt_now_ms(&srv->rt)) {
        /* Nobody waits for the answer any more: run nothing, claim nothing. */
        idem__random_hex(out->call.request_id, 16);
        idem__reject(&out->call, IDEM_REASON_DEADLINE, IDEM_DEADLINE_EXCEEDED,
                     "deadline passed before the call started (deadline_unix_ms %llu)",
                     (unsigned long long)deadline);
        return true;
    }
    idem_call_next(&out->call, (idem_next){&srv->chain, 0});
    if (out->call.suspend == IDEM__SUSPEND_DEFER) {
        idem__call_fini(&out->call);
        idem__free_request(out->req);
        out->req = NULL;
        return false;
    }
    if (out->call.suspend == IDEM__SUSPEND_PARK) {
        return false;
    }
    if (out->call.request_id[0] == '\0') { /* a chain without request_id */
        idem__random_hex(out->call.request_id, 16);
    }
    answer_key(&out->call);
    return true;
}

bool idem__server_run(idem_server *srv, const void *frame, size_t len, bool fast_only,
                      idem_served *out)
{
    return run(srv, frame, len, fast_only, false, out);
}

void idem__server_done(idem_server *srv, idem_served *s)
{
    idem__observe_call(srv->rt.obs, &s->call, idem__mono_us() - s->start_us);
    idem__call_fini(&s->call);
    idem__free_request(s->req);
}

nng_msg *idem__server_serve_frame(idem_server *srv, const void *frame, size_t len)
{
    idem_served s;
    idem__server_run(srv, frame, len, false, &s);
    nng_msg *out = response_msg(&s.call);
    idem__server_done(srv, &s);
    return out;
}

/* On nng's callback thread: answers what needs no worker (replays of stored results,
 * malformed frames, key mismatches); false leaves the call for a worker. */
static bool serve_fast(idem_server *srv, nng_msg *frame, nng_msg **reply)
{
    idem_served s;
    if (!idem__server_run(srv, nng_msg_body(frame), nng_msg_len(frame), true, &s)) {
        return false;
    }
    *reply = response_msg(&s.call);
    idem__server_done(srv, &s);
    return true;
}

/* ---- the work queue and the context state machine ---- */

/* A resumed job skips the max_queue check: it was admitted once already. */
static idem_code enqueue(idem_server *srv, idem_job *job, bool fresh)
{
    pthread_mutex_lock(&srv->mu);
    if (srv->stopping) {
        pthread_mutex_unlock(&srv->mu);
        return IDEM_UNAVAILABLE;
    }
    if (fresh && srv->opts.max_queue > 0 && srv->n_queued >= srv->opts.max_queue) {
        pthread_mutex_unlock(&srv->mu);
        return IDEM_RESOURCE_EXHAUSTED;
    }
    job->next = NULL;
    if (srv->tail != NULL) {
        srv->tail->next = job;
    } else {
        srv->head = job;
    }
    srv->tail = job;
    srv->n_queued++;
    pthread_cond_signal(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
    if (fresh) {
        idem__observe_in_flight(srv->rt.obs, 1); /* until answered, parked time included */
    }
    return IDEM_OK;
}

idem_code idem__server_enqueue(idem_server *srv, idem_job *job)
{
    job->parked_before = false;
    return enqueue(srv, job, true);
}

/* The in-flight table hands back a woken job. */
static void resume_job(void *arg, idem_job *job)
{
    idem_server *srv = arg;
    if (enqueue(srv, job, false) != IDEM_OK) {
        idem__server_done(srv, &job->s); /* stopping: dropped like a queued call */
        job->drop(job);
    }
}

void idem__server_reject(idem_server *srv, idem_served *s, const char *reason, idem_code code,
                         const char *message)
{
    static const Idem__V1__Request empty = IDEM__V1__REQUEST__INIT;
    s->start_us = idem__mono_us();
    s->req = NULL;
    idem__call_init(&s->call, &empty, NULL, &srv->rt);
    idem__reject(&s->call, reason, code, "%s", message);
    idem__random_hex(s->call.request_id, 16);
}

void idem__server_busy(idem_server *srv, idem_served *s)
{
    char msg[96];
    snprintf(msg, sizeof(msg), "server busy: %zu calls queued; retry later", srv->opts.max_queue);
    idem__server_reject(srv, s, IDEM_REASON_BUSY, IDEM_RESOURCE_EXHAUSTED, msg);
    idem__call_set_meta(&s->call, "retry-after-ms", "100");
}

/* The answer to a call that found the queue full: cheap enough for the nng callback. */
static nng_msg *busy_msg(idem_server *srv)
{
    idem_served s;
    idem__server_busy(srv, &s);
    nng_msg *out = response_msg(&s.call);
    idem__server_done(srv, &s);
    return out;
}

/* NULL when stopping (queued jobs are then dropped, not run). */
static idem_job *queue_pop(idem_server *srv)
{
    idem_job *job = NULL;
    pthread_mutex_lock(&srv->mu);
    while (!srv->stopping && srv->head == NULL) {
        pthread_cond_wait(&srv->cv, &srv->mu);
    }
    if (!srv->stopping) {
        job = srv->head;
        srv->head = job->next;
        srv->n_queued--;
        if (srv->head == NULL) {
            srv->tail = NULL;
        }
    }
    pthread_mutex_unlock(&srv->mu);
    return job;
}

static bool is_stopping(idem_server *srv)
{
    pthread_mutex_lock(&srv->mu);
    bool s = srv->stopping;
    pthread_mutex_unlock(&srv->mu);
    return s;
}

static void work_recv(work *w)
{
    w->state = WORK_RECV;
    nng_ctx_recv(w->ctx, w->aio);
}

/* Frees the request and sends reply (NULL: no reply possible, receive the next). */
static void work_reply(work *w, nng_msg *reply)
{
    nng_msg_free(w->msg);
    w->msg = NULL;
    if (reply == NULL) {
        work_recv(w);
        return;
    }
    w->state = WORK_SEND;
    nng_aio_set_msg(w->aio, reply);
    nng_ctx_send(w->ctx, w->aio);
}

static void work_cb(void *arg)
{
    work *w = arg;
    int rv;

    switch (w->state) {
    case WORK_INIT:
        work_recv(w);
        break;
    case WORK_RECV:
        if ((rv = nng_aio_result(w->aio)) != 0) {
            if (rv != NNG_ECLOSED && rv != NNG_ECANCELED && !is_stopping(w->srv)) {
                work_recv(w); /* a transient receive error: keep serving */
            }
            break;
        }
        w->msg = nng_aio_get_msg(w->aio);
        w->state = WORK_QUEUED;
        w->job.frame = nng_msg_body(w->msg);
        w->job.len = nng_msg_len(w->msg);
        nng_msg *reply;
        if (w->srv->fast_path && serve_fast(w->srv, w->msg, &reply)) {
            work_reply(w, reply);
        } else if ((rv = idem__server_enqueue(w->srv, &w->job)) == IDEM_RESOURCE_EXHAUSTED) {
            work_reply(w, busy_msg(w->srv));
        } else if (rv != IDEM_OK) {
            nng_msg_free(w->msg); /* stopping: the client retries elsewhere */
            w->msg = NULL;
        }
        break;
    case WORK_SEND:
        if (nng_aio_result(w->aio) != 0) {
            nng_msg_free(nng_aio_get_msg(w->aio)); /* a failed send leaves us the msg */
        }
        if (!is_stopping(w->srv)) {
            work_recv(w);
        }
        break;
    case WORK_QUEUED:
        break; /* no aio is outstanding in this state */
    }
}

static void work_answer(idem_server *srv, idem_job *job)
{
    work *w = (work *)job;
    nng_msg *reply = response_msg(&job->s.call);
    idem__server_done(srv, &job->s);
    work_reply(w, reply);
}

static void work_drop(idem_job *job)
{
    work *w = (work *)job;
    nng_msg_free(w->msg); /* queued or parked, never answered */
    w->msg = NULL;
}

/* One turn of a job on a worker: decode and run the chain, or resume a parked call at
 * result_cache. A call that must wait parks (the job then belongs to the in-flight
 * table) unless its bucket moved on meanwhile (read again at once) or the table is
 * full (answered "in progress"). */
static void job_step(idem_server *srv, idem_job *job)
{
    idem_call *call = &job->s.call;
    bool answered = false;
    if (!job->parked_before) {
        answered = run(srv, job->frame, job->len, false, srv->rt.can_park, &job->s);
    }
    while (!answered) {
        if (call->suspend == IDEM__SUSPEND_PARK) {
            job->parked_before = true;
            call->suspend = IDEM__SUSPEND_NONE;
            switch (idem__inflight_park(srv->rt.inflight, job, call->park_bucket, call->park_gen,
                                        call->park_wake_ms)) {
            case IDEM__PARKED:
                return;
            case IDEM__PARK_CHANGED:
                break;
            case IDEM__PARK_FULL:
                call->park_refused = true;
                break;
            }
        }
        idem__call_reset_response(call);
        idem_call_next(call, (idem_next){&srv->chain, call->resume_pos});
        if (call->suspend == IDEM__SUSPEND_NONE) {
            answer_key(call);
            answered = true;
        }
    }
    job->parked_before = false;
    job->answer(srv, job);
    idem__observe_in_flight(srv->rt.obs, -1);
}

static void *worker_main(void *arg)
{
    idem_server *srv = arg;
    idem_job *job;
    while ((job = queue_pop(srv)) != NULL) {
        job_step(srv, job);
    }
    return NULL;
}

/* Deletes expired records in bounded batches every sweep_interval_ms. */
static void *sweeper_main(void *arg)
{
    idem_server *srv = arg;
    pthread_mutex_lock(&srv->mu);
    while (!srv->stopping) {
        struct timespec ts;
        idem__abs_timespec(&ts, srv->opts.sweep_interval_ms);
        pthread_cond_timedwait(&srv->sweep_cv, &srv->mu, &ts);
        if (srv->stopping) {
            break;
        }
        pthread_mutex_unlock(&srv->mu);
        size_t deleted;
        do {
            if (idem_store_sweep(srv->rt.store, idem__now_ms(), srv->opts.sweep_batch, &deleted) !=
                IDEM_OK) {
                idem__log(srv->rt.obs, IDEM_LOG_ERROR, "msg=\"sweep failed: %s\"", idem_errmsg());
                break;
            }
        } while (deleted == srv->opts.sweep_batch && !is_stopping(srv));
        pthread_mutex_lock(&srv->mu);
    }
    pthread_mutex_unlock(&srv->mu);
    return NULL;
}

/* ---- life cycle ---- */

static idem_code server_open_socket(idem_server *srv)
{
    int rv;
    if ((rv = nng_rep0_open(&srv->sock)) != 0) {
        return nng_fail(rv, "nng_rep0_open");
    }
    srv->sock_open = true;
    if ((rv = nng_socket_set_size(srv->sock, NNG_OPT_RECVMAXSZ,
                                  srv->opts.max_frame + FRAME_SLACK)) != 0) {
        return nng_fail(rv, "set NNG_OPT_RECVMAXSZ");
    }
    srv->works = calloc(srv->opts.contexts, sizeof(work));
    if (srv->works == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t i = 0; i < srv->opts.contexts; i++) {
        work *w = &srv->works[i];
        w->srv = srv;
        w->job.answer = work_answer;
        w->job.drop = work_drop;
        if ((rv = nng_aio_alloc(&w->aio, work_cb, w)) != 0) {
            return nng_fail(rv, "nng_aio_alloc");
        }
        srv->n_works++;
        if ((rv = nng_ctx_open(&w->ctx, srv->sock)) != 0) {
            return nng_fail(rv, "nng_ctx_open");
        }
    }
    return IDEM_OK;
}

static idem_code server_default_setup(idem_server *srv)
{
    idem_code code;
    idem_method_opts issue = {0};
    if ((code = idem_server_register(srv, IDEM_TOKEN_ISSUE_METHOD, idem__token_issue_handler,
                                     &srv->rt, &issue)) != IDEM_OK) {
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

idem_code idem_server_create(idem_server **out, const idem_server_opts *opts)
{
    idem_server *srv;
    idem_code code;

    *out = NULL;
    if ((srv = calloc(1, sizeof(*srv))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    srv->opts = *opts;
    opts_defaults(&srv->opts);
    srv->opts.db_path = NULL; /* not retained */
    pthread_mutex_init(&srv->mu, NULL);
    pthread_cond_init(&srv->cv, NULL);
    pthread_cond_init(&srv->sweep_cv, NULL);
    srv->rt.result_ttl_ms = srv->opts.result_ttl_ms;
    srv->rt.lease_ms = srv->opts.lease_ms;
    srv->rt.token_ttl_ms = srv->opts.token_ttl_ms;
    srv->rt.max_wait_ms = srv->opts.max_wait_ms;
    srv->rt.max_run_ms = srv->opts.max_run_ms;
    srv->rt.clock = (idem_clock){system_clock, NULL};
    if ((srv->rt.obs = idem__observer_create(&srv->opts)) == NULL) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        goto fail;
    }
    srv->rt.store = opts->store;
    if (srv->rt.store == NULL) {
        code =
            idem_store_open_lmdb(&srv->rt.store, opts->db_path, opts->map_size, opts->store_flags);
        if (code != IDEM_OK) {
            goto fail;
        }
        srv->owns_store = true;
    }
    if ((code = server_default_setup(srv)) != IDEM_OK ||
        (code = server_open_socket(srv)) != IDEM_OK ||
        (code = idem__inflight_create(&srv->rt.inflight, &srv->rt, srv->opts.max_waiters,
                                      resume_job, srv)) != IDEM_OK) {
        goto fail;
    }
    *out = srv;
    return IDEM_OK;
fail:;
    char keep[512];
    snprintf(keep, sizeof(keep), "%s", idem_errmsg());
    idem_server_destroy(srv);
    return idem__err(code, "%s", keep);
}

/* The registrations must be servable by the chain that was built. */
static idem_code server_check(const idem_server *srv)
{
    for (size_t i = 0; i < srv->n_methods; i++) {
        if (!(srv->methods[i].opts.flags & IDEM_METHOD_TRANSACTIONAL)) {
            continue;
        }
        if (!srv->rt.has_result_cache) {
            return idem__err(IDEM_FAILED_PRECONDITION,
                             "%s is transactional but the chain has no result_cache",
                             srv->methods[i].name);
        }
        if (strcmp(idem_store_backend(srv->rt.store), "lmdb") != 0) {
            return idem__err(IDEM_FAILED_PRECONDITION,
                             "%s is transactional: that needs the LMDB store, not %s",
                             srv->methods[i].name, idem_store_backend(srv->rt.store));
        }
    }
    return IDEM_OK;
}

/* A waiting call can leave the chain and resume at result_cache later only when every
 * interceptor before it is a built-in that just returns what the rest returned. */
static void find_resume_point(idem_server *srv)
{
    bool all_builtin = true;
    for (size_t i = 0; i < srv->chain.n; i++) {
        if (srv->chain.items[i].fn == idem__result_cache_interceptor) {
            srv->rt.can_park = all_builtin;
            return;
        }
        all_builtin = all_builtin && srv->chain.items[i].builtin;
    }
}

static idem_code server_start(idem_server *srv)
{
    srv->fast_path = strcmp(idem_store_backend(srv->rt.store), "lmdb") == 0;
    for (size_t i = 0; i < srv->chain.n; i++) {
        srv->fast_path = srv->fast_path && srv->chain.items[i].fast_safe;
    }
    find_resume_point(srv);
    srv->threads = calloc(srv->opts.workers, sizeof(pthread_t));
    if (srv->threads == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t i = 0; i < srv->opts.workers; i++) {
        if (pthread_create(&srv->threads[i], NULL, worker_main, srv) != 0) {
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start worker thread");
        }
        srv->n_threads++;
    }
    if (pthread_create(&srv->sweeper, NULL, sweeper_main, srv) != 0) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start sweeper thread");
    }
    srv->sweeper_started = true;
    for (size_t i = 0; i < srv->n_works; i++) {
        work_cb(&srv->works[i]); /* INIT → RECV */
    }
    srv->started = true;
    return IDEM_OK;
}

idem_code idem_server_listen(idem_server *srv, const char *url)
{
    nng_listener l;
    int rv;
    idem_code code;
    if (!srv->started && (code = server_check(srv)) != IDEM_OK) {
        return code;
    }
    if ((rv = nng_listener_create(&l, srv->sock, url)) != 0) {
        return nng_fail(rv, url);
    }
    if ((rv = nng_listener_start(l, 0)) != 0) {
        nng_listener_close(l);
        return nng_fail(rv, url);
    }
    if (srv->port == 0 && strncmp(url, "tcp", 3) == 0) {
        int port = 0;
        if (nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port) == 0) {
            srv->port = port;
        }
    }
    return srv->started ? IDEM_OK : server_start(srv);
}

int idem_server_port(const idem_server *srv)
{
    return srv->port;
}

idem_code idem_server_listen_http(idem_server *srv, const char *url)
{
    idem_code code;
    if (srv->http != NULL) {
        return idem__err(IDEM_ALREADY_EXISTS, "the server already has an HTTP listener");
    }
    if (!srv->started &&
        ((code = server_check(srv)) != IDEM_OK || (code = server_start(srv)) != IDEM_OK)) {
        return code;
    }
    return idem__http_start(srv, url, srv->opts.max_frame, srv->opts.http_caller_header,
                            srv->opts.http_max_pending, &srv->http);
}

int idem_server_http_port(const idem_server *srv)
{
    return idem__http_port(srv->http);
}

char *idem__server_metrics(idem_server *srv)
{
    return idem__metrics_text(srv->rt.obs);
}

idem_store *idem_server_store(idem_server *srv)
{
    return srv->rt.store;
}

void idem_server_destroy(idem_server *srv)
{
    if (srv == NULL) {
        return;
    }
    pthread_mutex_lock(&srv->mu);
    srv->stopping = true;
    pthread_cond_broadcast(&srv->cv);
    pthread_cond_broadcast(&srv->sweep_cv);
    pthread_mutex_unlock(&srv->mu);
    if (srv->rt.inflight != NULL) { /* parked duplicates are dropped like queued calls */
        for (idem_job *job = idem__inflight_stop(srv->rt.inflight), *next; job != NULL;
             job = next) {
            next = job->next;
            idem__server_done(srv, &job->s);
            job->drop(job);
        }
    }
    /* Workers first: a running handler finishes and sends its reply while the socket is
     * still open (nng must not see a send on a context that nng_close is tearing down). */
    for (size_t i = 0; i < srv->n_threads; i++) {
        pthread_join(srv->threads[i], NULL);
    }
    if (srv->sweeper_started) {
        pthread_join(srv->sweeper, NULL);
    }
    for (idem_job *job = srv->head, *next; job != NULL; job = next) {
        next = job->next; /* no job is queued once stopping is set */
        if (job->parked_before) {
            idem__server_done(srv, &job->s);
        }
        job->drop(job);
    }
    srv->head = srv->tail = NULL;
    idem__http_stop(srv->http); /* waits for its callbacks; none can queue any more */
    /* Callbacks answer fast calls themselves: stop them (cancel + wait) before the socket
     * goes, so that no send races nng_close. A stopped aio starts nothing new. */
    for (size_t i = 0; i < srv->n_works; i++) {
        nng_aio_stop(srv->works[i].aio);
    }
    if (srv->sock_open) {
        nng_close(srv->sock);
    }
    for (size_t i = 0; i < srv->n_works; i++) {
        nng_aio_free(srv->works[i].aio);
    }
    for (size_t i = 0; i < srv->n_methods; i++) {
        free(srv->methods[i].name);
    }
    for (size_t i = 0; i < srv->chain.n; i++) {
        free(srv->chain.items[i].name);
    }
    if (srv->owns_store) {
        idem_store_close(srv->rt.store);
    }
    idem__inflight_destroy(srv->rt.inflight);
    idem__observer_destroy(srv->rt.obs);
    pthread_cond_destroy(&srv->sweep_cv);
    pthread_cond_destroy(&srv->cv);
    pthread_mutex_destroy(&srv->mu);
    free(srv->methods);
    free(srv->chain.items);
    free(srv->works);
    free(srv->threads);
    free(srv);
}
