/* The HTTP front's listener (see http_conn.h): accepts nng streams (tcp://, or
 * tls+tcp:// for https), at most max_conns at once, and hands each to http_conn.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"

static void accept_cb(void *arg)
{
    idem_hsrv *s = arg;
    int rv = nng_aio_result(s->acc);
    nng_stream *st = rv == 0 ? nng_aio_get_output(s->acc, 0) : NULL;
    idem_hconn *c = NULL;
    pthread_mutex_lock(&s->mtx);
    if (st != NULL && !s->closing && atomic_load(&s->open) < s->cfg.max_conns &&
        (c = idem__hconn_new(s, st)) != NULL) {
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
        idem__hconn_start(c);
    }
}

/* http://H:P → tcp://H:P, https://H:P → tls+tcp://H:P. */
static int stream_url(const char *url, bool tls, char *out, size_t cap)
{
    nng_url *u;
    int rv = nng_url_parse(&u, url);
    if (rv != 0) {
        return rv;
    }
    bool v6 = strchr(u->u_hostname, ':') != NULL;
    int n = snprintf(out, cap, "%s://%s%s%s:%s", tls ? "tls+tcp" : "tcp", v6 ? "[" : "",
                     u->u_hostname, v6 ? "]" : "", u->u_port);
    rv = strcmp(u->u_scheme, tls ? "https" : "http") != 0 || n >= (int)cap ? NNG_EADDRINVAL : 0;
    nng_url_free(u);
    return rv;
}

int idem__hsrv_start(const char *url, const idem_hsrv_cfg *cfg, idem_hsrv **out, int *port)
{
    char surl[512];
    idem_hsrv *s = calloc(1, sizeof(*s));
    int rv = s == NULL ? NNG_ENOMEM : stream_url(url, cfg->tls != NULL, surl, sizeof(surl));
    if (rv != 0) {
        free(s);
        return rv;
    }
    s->cfg = *cfg;
    s->max_buf = IDEM_HTTP_MAX_HEAD + 2 * IDEM_HTTP_MAX_LINE + (size_t)cfg->max_body + 64;
    pthread_mutex_init(&s->mtx, NULL);
    pthread_cond_init(&s->cv, NULL);
    if ((rv = nng_aio_alloc(&s->acc, accept_cb, s)) != 0 ||
        (rv = nng_stream_listener_alloc(&s->l, surl)) != 0 ||
        (cfg->tls != NULL &&
         (rv = nng_stream_listener_set_ptr(s->l, NNG_OPT_TLS_CONFIG, cfg->tls)) != 0) ||
        (rv = nng_stream_listener_listen(s->l)) != 0 ||
        (rv = nng_stream_listener_get_int(s->l, NNG_OPT_TCP_BOUND_PORT, port)) != 0) {
        idem__hsrv_stop(s);
        return rv;
    }
    nng_stream_listener_accept(s->l, s->acc);
    *out = s;
    return 0;
}

void idem__hsrv_stop(idem_hsrv *s)
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
    for (idem_hconn *c = s->conns; c != NULL; c = idem__hconn_next(c)) {
        idem__hconn_close(c); /* it unlinks itself (waiting for s->mtx) once idle */
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
