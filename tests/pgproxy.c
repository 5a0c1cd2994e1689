/* The fault proxy (pgproxy.h): an acceptor thread and one thread per connection, each
 * polling both of its sockets and forwarding what arrives unless the proxy is cut. A
 * connection's thread marks its slot done when either side closed; the acceptor joins it
 * and frees the slot (MAX_CONNS bounds the connections open at once, not in a run). */
#include <arpa/inet.h>
#include <errno.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "pgproxy.h"

#define MAX_CONNS 256
#define TICK_MS 10

typedef struct pconn {
    pgproxy *p;
    int down, up; /* the client's socket, PostgreSQL's */
    pthread_t t;
    atomic_bool done; /* conn_main returned: the acceptor may join and free it */
} pconn;

struct pgproxy {
    int lfd, port, up_port;
    atomic_bool cut, stop;
    atomic_uint delay_ms;
    pthread_t acceptor;
    pthread_mutex_t mu;
    pconn *conns[MAX_CONNS];
    int n;
};

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Forwards one chunk from one socket to the other; false when either side closed. */
static bool forward(pgproxy *p, int from, int to)
{
    char buf[16384];
    ssize_t n = recv(from, buf, sizeof(buf), 0);
    if (n <= 0) {
        return false;
    }
    unsigned d = atomic_load(&p->delay_ms);
    if (d > 0) {
        sleep_ms(d);
    }
    for (ssize_t off = 0; off < n;) {
        ssize_t w = send(to, buf + off, (size_t)(n - off), MSG_NOSIGNAL);
        if (w <= 0) {
            return false;
        }
        off += w;
    }
    return true;
}

static void *conn_main(void *arg)
{
    pconn *c = arg;
    pgproxy *p = c->p;
    while (!atomic_load(&p->stop)) {
        if (atomic_load(&p->cut)) {
            sleep_ms(TICK_MS); /* read nothing: the peers hear nothing, and no FIN */
            continue;
        }
        struct pollfd f[2] = {{.fd = c->down, .events = POLLIN}, {.fd = c->up, .events = POLLIN}};
        if (poll(f, 2, TICK_MS) <= 0 || atomic_load(&p->cut)) {
            continue;
        }
        if (((f[0].revents & (POLLIN | POLLHUP | POLLERR)) && !forward(p, c->down, c->up)) ||
            ((f[1].revents & (POLLIN | POLLHUP | POLLERR)) && !forward(p, c->up, c->down))) {
            break;
        }
    }
    shutdown(c->down, SHUT_RDWR);
    shutdown(c->up, SHUT_RDWR);
    atomic_store(&c->done, true);
    return NULL;
}

static void conn_free(pconn *c)
{
    pthread_join(c->t, NULL);
    close(c->down);
    close(c->up);
    free(c);
}

/* Frees the slots whose connection ended (p->mu held); the last slot fills the gap. */
static void reap_ended(pgproxy *p)
{
    for (int i = 0; i < p->n;) {
        if (atomic_load(&p->conns[i]->done)) {
            conn_free(p->conns[i]);
            p->conns[i] = p->conns[--p->n];
        } else {
            i++;
        }
    }
}

static int connect_up(const pgproxy *p)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p->up_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static void *accept_main(void *arg)
{
    pgproxy *p = arg;
    while (!atomic_load(&p->stop)) {
        struct pollfd f = {.fd = p->lfd, .events = POLLIN};
        if (poll(&f, 1, TICK_MS) <= 0 || atomic_load(&p->cut)) {
            continue; /* while cut, a connect waits in the backlog: it hears nothing */
        }
        int down = accept(p->lfd, NULL, NULL), up = down >= 0 ? connect_up(p) : -1;
        pconn *c = up >= 0 ? calloc(1, sizeof(*c)) : NULL;
        pthread_mutex_lock(&p->mu);
        reap_ended(p);
        bool room = c != NULL && p->n < MAX_CONNS;
        if (room) {
            *c = (pconn){.p = p, .down = down, .up = up};
            room = pthread_create(&c->t, NULL, conn_main, c) == 0;
        }
        if (room) {
            p->conns[p->n++] = c;
        }
        pthread_mutex_unlock(&p->mu);
        if (!room) {
            free(c);
            if (down >= 0) {
                close(down);
            }
            if (up >= 0) {
                close(up);
            }
        }
    }
    return NULL;
}

static int upstream_port(const char *conninfo)
{
    int port = 5432;
    PQconninfoOption *o = PQconninfoParse(conninfo, NULL);
    for (PQconninfoOption *i = o; i != NULL && i->keyword != NULL; i++) {
        if (strcmp(i->keyword, "port") == 0 && i->val != NULL) {
            port = atoi(i->val);
        }
    }
    PQconninfoFree(o);
    return port;
}

pgproxy *pgproxy_start(const char *conninfo)
{
    pgproxy *p = calloc(1, sizeof(*p));
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t alen = sizeof(a);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (p == NULL || (p->lfd = socket(AF_INET, SOCK_STREAM, 0)) < 0 ||
        bind(p->lfd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(p->lfd, 64) != 0 ||
        getsockname(p->lfd, (struct sockaddr *)&a, &alen) != 0) {
        abort();
    }
    p->port = ntohs(a.sin_port);
    p->up_port = upstream_port(conninfo);
    pthread_mutex_init(&p->mu, NULL);
    if (pthread_create(&p->acceptor, NULL, accept_main, p) != 0) {
        abort();
    }
    return p;
}

int pgproxy_port(const pgproxy *p)
{
    return p->port;
}

void pgproxy_cut(pgproxy *p, bool cut)
{
    atomic_store(&p->cut, cut);
}

void pgproxy_delay(pgproxy *p, unsigned ms)
{
    atomic_store(&p->delay_ms, ms);
}

void pgproxy_stop(pgproxy *p)
{
    atomic_store(&p->stop, true);
    pthread_join(p->acceptor, NULL);
    for (int i = 0; i < p->n; i++) {
        conn_free(p->conns[i]);
    }
    close(p->lfd);
    pthread_mutex_destroy(&p->mu);
    free(p);
}
