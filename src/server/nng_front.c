/* The nng front: rep0 contexts feeding the dispatcher.
 *
 * Each context is one in-flight call with ONE callback whose switch is its whole life:
 *
 *   INIT → RECV ──frame──▶ QUEUED (the dispatcher decodes, runs the chain) → SEND → RECV
 *
 * The callback never blocks: it answers what needs no worker (a stored replay, a bad
 * frame), queues a new key's claim for the store's writer thread (which then hands the
 * call to a worker: result_cache.c), hands the rest to the dispatcher and re-arms the
 * receive after a send. A
 * parked duplicate keeps its context, so at most half the contexts park; further
 * duplicates are answered "in progress" at once. The number of contexts bounds
 * in-flight work; nng holds further requests in its pipes (back-pressure). */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/transport/tcp/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nng_close.h"
#include "nng_front.h"
#include "nng_peers.h"
#include "tls.h"

#define FRAME_SLACK ((size_t)64 << 10) /* read this much past max_frame to answer it */

typedef enum work_state { WORK_INIT, WORK_RECV, WORK_QUEUED, WORK_SEND } work_state;

typedef struct work {
    idem_job job; /* first: the dispatcher sees works as jobs */
    work_state state;
    nng_aio *aio;
    nng_ctx ctx;
    nng_msg *msg;
    idem_nng_front *front;
} work;

#define MAX_TLS_LISTENERS 64

/* A tls+tcp listener and the caller its verified clients are. */
typedef struct tls_caller {
    uint32_t listener_id;
    char caller[IDEM_MAX_CALLER + 1];
} tls_caller;

struct idem_nng_front {
    idem_dispatch *d;
    atomic_size_t parked; /* works whose call is parked: they hold their context */
    nng_socket sock;
    bool sock_open, fast_path;
    work *works;
    size_t n_works;
    int port;
    pthread_mutex_t tls_mu; /* guards tls: listeners may be added while serving */
    tls_caller tls[MAX_TLS_LISTENERS];
    size_t n_tls;
    idem_pipe_peers peers; /* each open pipe's identity, read when it was added */
};

static idem_code nng_fail(int rv, const char *what)
{
    return idem__err(rv == NNG_ENOMEM ? IDEM_RESOURCE_EXHAUSTED : IDEM_UNAVAILABLE, "%s: %s", what,
                     nng_strerror(rv));
}

/* A message of len bytes for the encoding to fill (its body). */
static void *msg_for(void *arg, size_t len)
{
    nng_msg **msg = arg;
    return nng_msg_alloc(msg, len) == 0 ? nng_msg_body(*msg) : NULL;
}

/* Encodes the call's response; falls back to a bare INTERNAL answer on ENOMEM and to
 * NULL (no reply: the client times out and retries) when even that fails. */
static nng_msg *response_msg(idem_call *call)
{
    nng_msg *msg = NULL;
    if (call->replay_wire != NULL && call->meta_count == 0) {
        /* A replay as its stored bytes plus the per-call fields: what the encoding
         * below would write, without decoding and re-encoding the stored result. */
        uint8_t suffix[IDEM_REPLAY_SUFFIX_MAX];
        size_t len = idem__replay_suffix(call, suffix);
        if (nng_msg_alloc(&msg, call->replay_wire_len + len) != 0) {
            return NULL;
        }
        uint8_t *body = nng_msg_body(msg);
        memcpy(body, call->replay_wire, call->replay_wire_len);
        memcpy(body + call->replay_wire_len, suffix, len);
        return msg;
    }
    if (idem__call_materialize_replay(call) != IDEM_OK ||
        idem__call_set_meta(call, "request-id", call->request_id) != IDEM_OK ||
        idem__encode_call_response_to(call, true, msg_for, &msg) != IDEM_OK) {
        idem__call_reset_response(call);
        idem_call_fail(call, IDEM_INTERNAL, "out of memory encoding the response");
        if (idem__encode_call_response_to(call, true, msg_for, &msg) != IDEM_OK) {
            return NULL; /* nng_msg_alloc failing leaves msg unset */
        }
    }
    return msg;
}

/* The answer of a served call, which is then freed. */
static nng_msg *served_msg(idem_dispatch *d, idem_served *s)
{
    nng_msg *out = response_msg(&s->call);
    idem__dispatch_done(d, s);
    return out;
}

nng_msg *idem__nng_serve_frame(idem_dispatch *d, const void *frame, size_t len)
{
    idem_served s;
    idem__dispatch_run(d, frame, len, NULL, (idem_run_opts){.wire_reply = true}, &s);
    return served_msg(d, &s);
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

/* The caller of a verified client of a TLS listener into peer->tls_caller (empty when
 * the pipe came through another listener). */
static void tls_peer(idem_nng_front *f, nng_pipe p, idem_peer *peer)
{
    bool verified = false;
    uint32_t lid = (uint32_t)nng_listener_id(nng_pipe_listener(p));
    const char *caller = NULL;
    pthread_mutex_lock(&f->tls_mu);
    for (size_t i = 0; i < f->n_tls && caller == NULL; i++) {
        caller = f->tls[i].listener_id == lid ? f->tls[i].caller : NULL;
    }
    if (caller != NULL) {
        /* Fail closed: a pipe of a TLS listener whose verification cannot be read (it
         * closed meanwhile) is not taken as a self-declared caller. */
        if (nng_pipe_get_bool(p, NNG_OPT_TLS_VERIFIED, &verified) == 0 && verified) {
            snprintf(peer->tls_caller, sizeof(peer->tls_caller), "%s", caller);
        } else {
            peer->transport_unverified = true;
        }
    }
    pthread_mutex_unlock(&f->tls_mu);
}

/* What the transport knows of the sender: the kernel's peer uid on ipc:// (nng reads
 * SO_PEERCRED, a system call each time), the verified client of a TLS listener; other
 * transports answer NNG_ENOTSUP. */
static void pipe_peer(idem_nng_front *f, nng_pipe p, idem_peer *peer)
{
    peer->has_uid = nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_UID, &peer->uid) == 0;
    tls_peer(f, p, peer);
}

/* Pipe events (nng_peers.c): the identity is read once, before the pipe's first
 * message, and dropped when the pipe goes. */
static void pipe_event(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    idem_nng_front *f = arg;
    if (ev == NNG_PIPE_EV_ADD_PRE) {
        idem_peer peer = {0};
        pipe_peer(f, p, &peer);
        idem__pipe_peers_add(&f->peers, (uint32_t)nng_pipe_id(p), &peer);
    } else if (ev == NNG_PIPE_EV_REM_POST) {
        idem__pipe_peers_remove(&f->peers, (uint32_t)nng_pipe_id(p));
    }
}

/* The sender's identity: its pipe's entry, else read now (the cache was full). */
static idem_peer msg_peer(idem_nng_front *f, nng_msg *msg)
{
    idem_peer peer = {0};
    nng_pipe p = nng_msg_get_pipe(msg);
    if (nng_pipe_id(p) <= 0 || idem__pipe_peers_get(&f->peers, (uint32_t)nng_pipe_id(p), &peer)) {
        return peer;
    }
    pipe_peer(f, p, &peer);
    return peer;
}

/* A received frame: answered here when no worker is needed, else handed over. */
static void work_received(work *w)
{
    idem_dispatch *d = w->front->d;
    idem_served s;
    w->msg = nng_aio_get_msg(w->aio);
    w->state = WORK_QUEUED;
    w->job.frame = nng_msg_body(w->msg);
    w->job.len = nng_msg_len(w->msg);
    w->job.peer = msg_peer(w->front, w->msg);
    w->job.s.req = NULL;
    idem_run_opts fast = {
        .wire_reply = true, .frame_writable = true, .fast_only = true, .fast_claim = true};
    if (w->front->fast_path &&
        idem__dispatch_run(d, w->job.frame, w->job.len, &w->job.peer, fast, &w->job.s)) {
        work_reply(w, served_msg(d, &w->job.s));
        return;
    }
    idem_code code = idem__dispatch_enqueue(d, &w->job);
    if (code == IDEM_RESOURCE_EXHAUSTED) {
        idem__dispatch_busy(d, &s);
        work_reply(w, served_msg(d, &s));
    } else if (code != IDEM_OK) {
        nng_msg_free(w->msg); /* stopping: the client retries elsewhere */
        w->msg = NULL;
    }
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
            if (rv != NNG_ECLOSED && rv != NNG_ECANCELED && !idem__dispatch_stopping(w->front->d)) {
                work_recv(w); /* a transient receive error: keep serving */
            }
            break;
        }
        work_received(w);
        break;
    case WORK_SEND:
        if (nng_aio_result(w->aio) != 0) {
            nng_msg_free(nng_aio_get_msg(w->aio)); /* a failed send leaves us the msg */
        }
        if (!idem__dispatch_stopping(w->front->d)) {
            work_recv(w);
        }
        break;
    case WORK_QUEUED:
        break; /* no aio is outstanding in this state */
    }
}

static void work_answer(idem_job *job)
{
    work *w = (work *)job;
    work_reply(w, served_msg(w->front->d, &job->s));
}

static void work_drop(idem_job *job)
{
    work *w = (work *)job;
    nng_msg_free(w->msg); /* queued or parked, never answered */
    w->msg = NULL;
}

idem_code idem__nng_front_open(idem_nng_front **out, idem_dispatch *d, size_t contexts,
                               size_t max_frame)
{
    idem_nng_front *f = calloc(1, sizeof(*f));
    int rv;
    *out = NULL;
    if (f == NULL || (f->works = calloc(contexts, sizeof(work))) == NULL) {
        free(f);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    f->d = d;
    pthread_mutex_init(&f->tls_mu, NULL);
    idem__pipe_peers_init(&f->peers);
    *out = f; /* from here on, idem__nng_front_close frees whatever was opened */
    if ((rv = nng_rep0_open(&f->sock)) != 0) {
        return nng_fail(rv, "nng_rep0_open");
    }
    f->sock_open = true;
    if ((rv = nng_pipe_notify(f->sock, NNG_PIPE_EV_ADD_PRE, pipe_event, f)) != 0 ||
        (rv = nng_pipe_notify(f->sock, NNG_PIPE_EV_REM_POST, pipe_event, f)) != 0) {
        return nng_fail(rv, "nng_pipe_notify");
    }
    if ((rv = nng_socket_set_size(f->sock, NNG_OPT_RECVMAXSZ, max_frame + FRAME_SLACK)) != 0) {
        return nng_fail(rv, "set NNG_OPT_RECVMAXSZ");
    }
    for (size_t i = 0; i < contexts; i++) {
        work *w = &f->works[i];
        w->front = f;
        w->job.answer = work_answer;
        w->job.wire_reply = true;
        w->job.frame_writable = true; /* the received message, freed after the reply */
        w->job.drop = work_drop;
        /* Half the contexts at most wait on a running call: the rest keep receiving, so
         * one slow key cannot stall every other caller. */
        w->job.parked = &f->parked;
        w->job.max_parked = contexts / 2 > 0 ? contexts / 2 : 1;
        if ((rv = nng_aio_alloc(&w->aio, work_cb, w)) != 0) {
            return nng_fail(rv, "nng_aio_alloc");
        }
        f->n_works++;
        if ((rv = nng_ctx_open(&w->ctx, f->sock)) != 0) {
            return nng_fail(rv, "nng_ctx_open");
        }
    }
    return IDEM_OK;
}

/* Remembers that verified clients of listener l are tls->caller. */
static idem_code tls_remember(idem_nng_front *f, nng_listener l, const idem_tls_listener *tls)
{
    idem_code code = IDEM_OK;
    pthread_mutex_lock(&f->tls_mu);
    if (f->n_tls == MAX_TLS_LISTENERS) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "at most %d TLS listeners", MAX_TLS_LISTENERS);
    } else {
        tls_caller *t = &f->tls[f->n_tls++];
        t->listener_id = (uint32_t)nng_listener_id(l);
        snprintf(t->caller, sizeof(t->caller), "%s", tls->caller);
    }
    pthread_mutex_unlock(&f->tls_mu);
    return code;
}

/* Forgets listener l (it did not start). */
static void tls_forget(idem_nng_front *f, nng_listener l)
{
    uint32_t lid = (uint32_t)nng_listener_id(l);
    pthread_mutex_lock(&f->tls_mu);
    for (size_t i = 0; i < f->n_tls; i++) {
        if (f->tls[i].listener_id == lid) {
            f->tls[i] = f->tls[--f->n_tls];
            break;
        }
    }
    pthread_mutex_unlock(&f->tls_mu);
}

/* Sets a required-client-certificate TLS configuration on l. */
static idem_code tls_configure(nng_listener l, const idem_tls_listener *tls)
{
    nng_tls_config *cfg;
    idem_code code = idem__tls_server_config(&cfg, tls);
    if (code != IDEM_OK) {
        return code;
    }
    int rv = nng_listener_set_ptr(l, NNG_OPT_TLS_CONFIG, cfg);
    nng_tls_config_free(cfg); /* the listener holds its own reference */
    return rv != 0 ? nng_fail(rv, "set NNG_OPT_TLS_CONFIG") : IDEM_OK;
}

idem_code idem__nng_front_listen(idem_nng_front *f, const char *url, const idem_tls_listener *tls)
{
    nng_listener l;
    int rv;
    idem_code code;
    if ((rv = nng_listener_create(&l, f->sock, url)) != 0) {
        return nng_fail(rv, url);
    }
    if (tls != NULL && (code = tls_configure(l, tls)) != IDEM_OK) {
        nng_listener_close(l);
        return code;
    }
    /* Remembered before it starts: a pipe's identity is read once, when it is added. */
    if (tls != NULL && (code = tls_remember(f, l, tls)) != IDEM_OK) {
        nng_listener_close(l);
        return code;
    }
    if ((rv = nng_listener_start(l, 0)) != 0) {
        if (tls != NULL) {
            tls_forget(f, l);
        }
        nng_listener_close(l);
        return nng_fail(rv, url);
    }
    if (f->port == 0 && (strncmp(url, "tcp", 3) == 0 || strncmp(url, "tls+tcp", 7) == 0)) {
        int port = 0;
        if (nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port) == 0) {
            f->port = port;
        }
    }
    return IDEM_OK;
}

size_t idem__nng_front_pipe_peers(idem_nng_front *f)
{
    return idem__pipe_peers_count(&f->peers);
}

int idem__nng_front_port(const idem_nng_front *f)
{
    return f->port;
}

void idem__nng_front_start(idem_nng_front *f, bool fast_path)
{
    f->fast_path = fast_path;
    for (size_t i = 0; i < f->n_works; i++) {
        work_cb(&f->works[i]); /* INIT → RECV */
    }
}

void idem__nng_front_close(idem_nng_front *f)
{
    if (f == NULL) {
        return;
    }
    /* Callbacks answer fast calls themselves: stop them (cancel + wait) before the socket
     * goes, so that no send races nng_close. A stopped aio starts nothing new. */
    for (size_t i = 0; i < f->n_works; i++) {
        nng_aio_stop(f->works[i].aio);
    }
    /* A callback may have queued a new key's claim after the dispatcher stopped: wait
     * until the store has handed every such job back (and it was dropped) before the
     * works that hold them go. */
    idem__dispatch_stop(f->d);
    if (f->sock_open && !idem__nng_close_bounded(f->sock)) {
        /* nng is stuck closing the socket (src/supplemental/nng_close.c) and may still call
         * pipe_event with f: f and all it holds stay, as the socket does, till exit. */
        return;
    }
    for (size_t i = 0; i < f->n_works; i++) {
        nng_aio_free(f->works[i].aio);
    }
    idem__pipe_peers_fini(&f->peers); /* nng_close waited for every pipe's REM_POST */
    pthread_mutex_destroy(&f->tls_mu);
    free(f->works);
    free(f);
}
