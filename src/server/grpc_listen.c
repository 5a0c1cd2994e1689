/* The gRPC front's listener (see grpc_conn.h): accepts nng streams on tcp://, at most
 * max_conns at once, and hands each to grpc_conn.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc_conn.h"

static void accept_cb(void *arg)
{
    idem_gsrv *s = arg;
    int rv = nng_aio_result(s->acc);
    nng_stream *st = rv == 0 ? nng_aio_get_output(s->acc, 0) : NULL;
    idem_gconn *c = NULL;
    pthread_mutex_lock(&s->mtx);
    if (st != NULL && !s->closing && atomic_load(&s->open) < s->cfg.max_conns &&
        (c = idem__gconn_new(s, st)) != NULL) {
        st = NULL;
    }
    if (st != NULL) {
        nng_stream_free(st); /* over max_conns, out of memory, or closing */
    }
    if (!s->closing && rv != NNG_ECLOSED) {
        nng_stream_listener_accept(s->l, s->acc);
    }
    pthread_mutex_unlock(&s->mtx);
    if (c != NULL) {
        idem__gconn_start(c);
    }
}

int idem__gsrv_start(const char *url, const idem_gsrv_cfg *cfg, idem_gsrv **out, int *port)
{
    idem_gsrv *s = calloc(1, sizeof(*s));
    int rv;
    if (s == NULL) {
        return NNG_ENOMEM;
    }
    if (strncmp(url, "tcp://", 6) != 0) {
        free(s);
        return NNG_EADDRINVAL;
    }
    s->cfg = *cfg;
    pthread_mutex_init(&s->mtx, NULL);
    pthread_cond_init(&s->cv, NULL);
    if ((rv = nng_aio_alloc(&s->acc, accept_cb, s)) != 0 ||
        (rv = nng_stream_listener_alloc(&s->l, url)) != 0 ||
        (rv = nng_stream_listener_listen(s->l)) != 0 ||
        (rv = nng_stream_listener_get_int(s->l, NNG_OPT_TCP_BOUND_PORT, port)) != 0) {
        idem__gsrv_stop(s);
        return rv;
    }
    nng_stream_listener_accept(s->l, s->acc);
    *out = s;
    return 0;
}

void idem__gsrv_stop(idem_gsrv *s)
{
    if (s == NULL) {
        return;
    }
    pthread_mutex_lock(&s->mtx);
    s->closing = true;
    pthread_mutex_unlock(&s->mtx);
    if (s->l != NULL) {
        nng_stream_listener_close(s->l);
    }
    if (s->acc != NULL) {
        nng_aio_stop(s->acc); /* no accept callback runs after this */
    }
    pthread_mutex_lock(&s->mtx);
    for (idem_gconn *c = s->conns; c != NULL; c = idem__gconn_next(c)) {
        idem__gconn_close(c); /* it unlinks itself (waiting for s->mtx) once idle */
    }
    while (s->n > 0) {
        pthread_cond_wait(&s->cv, &s->mtx);
    }
    pthread_mutex_unlock(&s->mtx);
    nng_aio_free(s->acc);
    if (s->l != NULL) {
        nng_stream_listener_free(s->l);
    }
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mtx);
    free(s);
}
