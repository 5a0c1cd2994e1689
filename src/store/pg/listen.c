/* Completion announcements on PostgreSQL: one thread per store LISTENs on PG_CHANNEL
 * on a connection of its own and hands each payload (a key hash) to the watchers, so
 * that a duplicate waiting here for a call that ran on another instance wakes when that
 * call commits instead of at its next re-read.
 *
 * The listener is an optimisation, never the truth: a woken waiter reads the store, and
 * waiters keep their re-read timers, so a lost notification, a listening connection
 * that is down (reconnected with backoff) or a store opened with no_notify only costs
 * latency; and every time it LISTENs (again) it tells its watchers that every key may
 * have changed (IDEM__STORE_WATCH_ALL): waiters re-read, the replay cache empties. A
 * self-pipe wakes the thread for shutdown. The listener knows only the
 * store's hosts (connect.c) and its watchers: the store starts and stops it (watch.c,
 * store_pg.c).
 *
 * A listening connection can go quiet without breaking: its server was partitioned
 * away, stopped, or demoted by a failover (NOTIFY is not replicated, so a standby
 * hears nothing). So every CHECK_MS the listener asks whether its server is still
 * a primary that answers (bounded by CHECK_BOUND_MS) and otherwise
 * listens anew: the multi-host conninfo leads it to the new leader (the host that gave
 * the store's last connection first). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pg_internal.h"

#define IDLE_MS 1000     /* longest poll */
#define RETRY_MIN_MS 100 /* reconnect backoff, doubling */
#define RETRY_MAX_MS 2000
#define CONNECT_MS 4000 /* the longest connect, every host included */
#define CHECK_MS 3000   /* how often the listener checks its server */
#define CHECK_BOUND_MS 2000

typedef struct watcher {
    idem__store_watch_fn fn;
    void *arg;
} watcher;

struct pg_listener {
    pg_hosts *hosts; /* borrowed: the store's, freed after idem__pg_listener_stop */
    pthread_t thread;
    int wake[2];        /* self-pipe: closing */
    pthread_mutex_t mu; /* watchers; held while they are called, so unwatch waits */
    watcher w[IDEM__STORE_MAX_WATCH];
    size_t n;
    bool stop;
    uint64_t listens; /* LISTENs made, each told to the watchers (atomic) */
};

static void deliver(pg_listener *l, uint32_t hash)
{
    pthread_mutex_lock(&l->mu);
    for (size_t i = 0; i < l->n; i++) {
        l->w[i].fn(l->w[i].arg, hash);
    }
    pthread_mutex_unlock(&l->mu);
}

/* Bounded (a stop waits for at most one connect, CONNECT_MS, and its LISTEN). */
static PGconn *listen_connect(pg_listener *l)
{
    PGconn *c;
    if (idem__pg_connect(l->hosts, idem__mono_ms() + CONNECT_MS, &c) != IDEM_OK) {
        return NULL;
    }
    if (idem__pg_conn_query(c, NULL, "LISTEN " PG_CHANNEL, CHECK_BOUND_MS, NULL) != IDEM_OK) {
        PQfinish(c);
        return NULL;
    }
    return c;
}

/* True when c's server answers in time and is a primary (not in recovery). */
static bool still_leader(PGconn *c)
{
    PGresult *r;
    if (idem__pg_conn_query(c, NULL, "SELECT pg_is_in_recovery()", CHECK_BOUND_MS, &r) != IDEM_OK) {
        return false;
    }
    bool primary = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 0), "f") == 0;
    PQclear(r);
    return primary;
}

/* Waits up to ms for the socket (or only for the wake pipe when fd < 0). False when
 * closing. */
static bool wait_readable(pg_listener *l, int fd, int ms)
{
    struct pollfd p[2] = {{.fd = l->wake[0], .events = POLLIN}, {.fd = fd, .events = POLLIN}};
    int rc = poll(p, fd >= 0 ? 2 : 1, ms);
    return !(rc > 0 && (p[0].revents & POLLIN)) && !(rc < 0 && errno != EINTR);
}

/* Reads what arrived; false when the connection broke. */
static bool drain(pg_listener *l, PGconn *c)
{
    if (!PQconsumeInput(c)) {
        return false;
    }
    for (PGnotify *n; (n = PQnotifies(c)) != NULL; PQfreemem(n)) {
        char *end;
        unsigned long h = strtoul(n->extra, &end, 10);
        if (end != n->extra && *end == '\0' && h <= UINT32_MAX) {
            deliver(l, (uint32_t)h);
        }
    }
    return PQstatus(c) == CONNECTION_OK;
}

static void *listen_main(void *arg)
{
    pg_listener *l = arg;
    PGconn *c = NULL;
    int backoff = RETRY_MIN_MS;
    uint64_t checked = idem__mono_ms();
    while (!__atomic_load_n(&l->stop, __ATOMIC_ACQUIRE)) {
        if (c == NULL && (c = listen_connect(l)) == NULL) {
            if (!wait_readable(l, -1, backoff)) {
                break;
            }
            backoff = backoff * 2 > RETRY_MAX_MS ? RETRY_MAX_MS : backoff * 2;
            continue;
        }
        if (backoff != 0) { /* listening (again): what was announced before is not heard */
            deliver(l, IDEM__STORE_WATCH_ALL);
            __atomic_add_fetch(&l->listens, 1, __ATOMIC_RELEASE);
        }
        if (backoff != 0 && !drain(l, c)) { /* what arrived during the connect */
            PQfinish(c);
            c = NULL;
            continue;
        }
        backoff = 0; /* connected: drained; the next failure starts at RETRY_MIN_MS */
        if (!wait_readable(l, PQsocket(c), IDLE_MS)) {
            break;
        }
        bool ok = drain(l, c);
        if (ok && idem__mono_ms() - checked >= CHECK_MS) {
            checked = idem__mono_ms();
            ok = still_leader(c) && drain(l, c); /* what arrived during the check */
        }
        if (!ok) {
            PQfinish(c); /* waiters re-read on their timers meanwhile */
            c = NULL;
            backoff = RETRY_MIN_MS;
        }
    }
    PQfinish(c);
    return NULL;
}

idem_code idem__pg_listener_start(pg_hosts *hosts, pg_listener **out)
{
    pg_listener *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    l->hosts = hosts;
    if (pipe2(l->wake, O_CLOEXEC) != 0) {
        free(l);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "pipe: %s", strerror(errno));
    }
    pthread_mutex_init(&l->mu, NULL);
    if (pthread_create(&l->thread, NULL, listen_main, l) != 0) {
        close(l->wake[0]);
        close(l->wake[1]);
        pthread_mutex_destroy(&l->mu);
        free(l);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "cannot start the postgres listener");
    }
    *out = l;
    return IDEM_OK;
}

idem_code idem__pg_listener_add(pg_listener *l, idem__store_watch_fn fn, void *arg)
{
    idem_code code = IDEM_OK;
    pthread_mutex_lock(&l->mu);
    if (l->n == IDEM__STORE_MAX_WATCH) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "at most %d servers share one postgres store",
                         IDEM__STORE_MAX_WATCH);
    } else {
        l->w[l->n++] = (watcher){fn, arg};
    }
    pthread_mutex_unlock(&l->mu);
    return code;
}

void idem__pg_listener_remove(pg_listener *l, idem__store_watch_fn fn, void *arg)
{
    pthread_mutex_lock(&l->mu);
    for (size_t i = 0; i < l->n; i++) {
        if (l->w[i].fn == fn && l->w[i].arg == arg) {
            l->w[i] = l->w[--l->n];
            break;
        }
    }
    pthread_mutex_unlock(&l->mu);
}

uint64_t idem__pg_listener_listens(pg_listener *l)
{
    return __atomic_load_n(&l->listens, __ATOMIC_ACQUIRE);
}

void idem__pg_listener_stop(pg_listener *l)
{
    if (l == NULL) {
        return;
    }
    __atomic_store_n(&l->stop, true, __ATOMIC_RELEASE);
    ssize_t w;
    do {
        w = write(l->wake[1], "x", 1);
    } while (w < 0 && errno == EINTR);
    pthread_join(l->thread, NULL);
    close(l->wake[0]);
    close(l->wake[1]);
    pthread_mutex_destroy(&l->mu);
    free(l);
}
