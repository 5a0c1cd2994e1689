/* Scenario a, the transport baseline: a bare nng rep0 echo (contexts + aio, the reply
 * sent from the aio callback) against one raw req0 socket per client thread with
 * blocking send/recv. No idemrpc code runs: every other scenario's ratio is against
 * this one. The Redis peer (scenario_redis.c) opens its clients' sockets here too. */
#include <stdlib.h>
#include <string.h>

#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>

#include "bench.h"

/* One server context, as in nng's demo/async/server.c: the callback's switch is the
 * whole life of a request. */
typedef struct echo_work {
    enum { ECHO_INIT, ECHO_RECV, ECHO_SEND } state;
    nng_aio *aio;
    nng_ctx ctx;
} echo_work;

typedef struct echo_server {
    nng_socket sock;
    bool open;
    echo_work *works;
    size_t n; /* works with an aio */
} echo_server;

static void echo_cb(void *arg)
{
    echo_work *w = arg;
    int rv;

    switch (w->state) {
    case ECHO_INIT:
        break;
    case ECHO_RECV:
        if ((rv = nng_aio_result(w->aio)) != 0) {
            if (rv == NNG_ECLOSED || rv == NNG_ECANCELED) {
                return; /* shutting down */
            }
            break;
        }
        w->state = ECHO_SEND;
        nng_aio_set_msg(w->aio, nng_aio_get_msg(w->aio)); /* the request is the reply */
        nng_ctx_send(w->ctx, w->aio);
        return;
    case ECHO_SEND:
        if ((rv = nng_aio_result(w->aio)) != 0) {
            nng_msg_free(nng_aio_get_msg(w->aio)); /* a failed send leaves us the msg */
            if (rv == NNG_ECLOSED || rv == NNG_ECANCELED) {
                return;
            }
        }
        break;
    }
    w->state = ECHO_RECV;
    nng_ctx_recv(w->ctx, w->aio);
}

static int echo_server_start(echo_server *es, cell *c, cell_stats *out)
{
    size_t n = server_contexts(c->clients);
    char url[160];
    nng_listener l;
    int rv, port = 0;

    if ((rv = nng_rep0_open(&es->sock)) != 0) {
        return cell_fail(out, "nng_rep0_open: %s", nng_strerror(rv));
    }
    es->open = true;
    if ((rv = nng_socket_set_size(es->sock, NNG_OPT_RECVMAXSZ, 0)) != 0) {
        return cell_fail(out, "echo NNG_OPT_RECVMAXSZ: %s", nng_strerror(rv));
    }
    if ((es->works = calloc(n, sizeof(*es->works))) == NULL) {
        return cell_fail(out, "out of memory");
    }
    for (; es->n < n; es->n++) {
        echo_work *w = &es->works[es->n];
        if ((rv = nng_aio_alloc(&w->aio, echo_cb, w)) != 0) {
            return cell_fail(out, "nng_aio_alloc: %s", nng_strerror(rv));
        }
        if ((rv = nng_ctx_open(&w->ctx, es->sock)) != 0) {
            es->n++; /* its aio is freed by echo_server_stop */
            return cell_fail(out, "nng_ctx_open: %s", nng_strerror(rv));
        }
    }
    listen_url(c, 0, url, sizeof(url));
    if ((rv = nng_listener_create(&l, es->sock, url)) != 0 ||
        (rv = nng_listener_start(l, 0)) != 0) {
        return cell_fail(out, "echo listen %s: %s", url, nng_strerror(rv));
    }
    if (strcmp(c->transport, "tcp") == 0 &&
        (rv = nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port)) != 0) {
        return cell_fail(out, "echo NNG_OPT_TCP_BOUND_PORT: %s", nng_strerror(rv));
    }
    set_dial_url(c, url, port);
    for (size_t i = 0; i < es->n; i++) {
        echo_cb(&es->works[i]); /* ECHO_INIT: post the first receive */
    }
    return 0;
}

/* Also undoes a partial start. */
static void echo_server_stop(echo_server *es)
{
    if (es->open) {
        nng_close(es->sock); /* fails pending receives and sends with NNG_ECLOSED */
    }
    for (size_t i = 0; i < es->n; i++) {
        nng_aio_stop(es->works[i].aio); /* waits for a callback in progress */
    }
    for (size_t i = 0; i < es->n; i++) {
        nng_aio_free(es->works[i].aio);
    }
    free(es->works);
}

static int raw_fail(bench_thread *t, const char *what, int rv)
{
    return thread_fail(t, "%s: %s", what, nng_strerror(rv));
}

int req_open(bench_thread *t)
{
    nng_socket *s = &t->conn.sock;
    int rv;
    if ((rv = nng_req0_open(s)) != 0) {
        return raw_fail(t, "nng_req0_open", rv);
    }
    if ((rv = nng_socket_set_ms(*s, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE)) != 0 ||
        (rv = nng_socket_set_ms(*s, NNG_OPT_RECVTIMEO, CALL_TIMEOUT_MS)) != 0 ||
        (rv = nng_socket_set_ms(*s, NNG_OPT_SENDTIMEO, CALL_TIMEOUT_MS)) != 0 ||
        (rv = nng_socket_set_size(*s, NNG_OPT_RECVMAXSZ, 0)) != 0) {
        return raw_fail(t, "req0 socket options", rv);
    }
    if ((rv = nng_dial(*s, t->cell->url, NULL, 0)) != 0) {
        return raw_fail(t, t->cell->url, rv);
    }
    return 0;
}

/* One blocking request; the reply must be the payload echoed. */
static int raw_call(bench_thread *t)
{
    size_t len = t->cell->payload_len;
    nng_msg *m;
    int rv;
    if ((rv = nng_msg_alloc(&m, len)) != 0) {
        return raw_fail(t, "nng_msg_alloc", rv);
    }
    memcpy(nng_msg_body(m), t->cell->payload, len);
    if ((rv = nng_sendmsg(t->conn.sock, m, 0)) != 0) {
        nng_msg_free(m); /* still ours when the send fails */
        return raw_fail(t, "nng_sendmsg", rv);
    }
    if ((rv = nng_recvmsg(t->conn.sock, &m, 0)) != 0) {
        return raw_fail(t, "nng_recvmsg", rv);
    }
    bool echoed = nng_msg_len(m) == len && memcmp(nng_msg_body(m), t->cell->payload, len) == 0;
    nng_msg_free(m);
    return echoed ? 0 : thread_fail(t, "echo reply differs from the request");
}

void req_close(bench_thread *t)
{
    nng_close(t->conn.sock); /* NNG_ENOENT for a socket never opened: nothing to do */
}

static const client_ops raw_ops = {.open = req_open, .call = raw_call, .close = req_close};

int run_echo(const scenario *sc, cell *c, cell_stats *out)
{
    (void)sc;
    echo_server es = {.open = false};
    int rv = echo_server_start(&es, c, out);
    if (rv == 0) {
        c->warmup = WARMUP_CALLS;
        rv = run_clients(&raw_ops, c, out);
    }
    echo_server_stop(&es);
    return rv;
}
