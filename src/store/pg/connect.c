/* Where the PostgreSQL store connects, and within what time: every connection (the
 * pool's, the lease keeper's, the listener's) is made asynchronously
 * (PQconnectStartParams, PQconnectPoll under poll) and never waits past its caller's
 * deadline.
 *
 * libpq walks a multi-host conninfo by itself only in a blocking connect, where each
 * host may take connect_timeout; an asynchronous one has no timeout at all. So the store
 * splits the conninfo's host, hostaddr and port lists once (idem__pg_hosts_parse) and
 * tries one host at a time: first the host that gave the last connection (libpq checked
 * it against target_session_attrs: with read-write, the leader), then the others in
 * their listed order. Each attempt gets at most connect_timeout (default 10 s) and an
 * equal share of what is left of the deadline, so that a host that accepts TCP and
 * never answers (a stopped or partitioned ex-leader) leaves time for the next one.
 * libpq resolves a host name synchronously (getaddrinfo): hosts given as addresses (or
 * hostaddr) keep a connect bounded. The lists are the conninfo's, else PGHOST's,
 * PGHOSTADDR's and PGPORT's; a service file's are walked by libpq, one attempt for all.
 * A notice is never printed on the application's stderr. */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "pg_internal.h"

#define HOST_MS_DEFAULT 10000 /* connect_timeout when the conninfo has none */
#define HOSTS_MAX 64

/* The store's own defaults, before the conninfo's options (which win). */
static const char *const default_keys[] = {"keepalives", "keepalives_idle", "keepalives_interval",
                                           "keepalives_count"};
static const char *const default_vals[] = {"1", "30", "10", "3"};
#define N_DEFAULTS (sizeof(default_keys) / sizeof(default_keys[0]))

enum { L_HOST, L_ADDR, L_PORT, N_LISTS }; /* the per-host keys, last in keys[] */
static const char *const list_keys[N_LISTS] = {"host", "hostaddr", "port"};

struct pg_hosts {
    PQconninfoOption *opts; /* owns the option strings that keys and vals point to */
    char *lists[N_LISTS];   /* the host, hostaddr and port lists, split in place */
    const char **keys;      /* defaults, the conninfo's other options, then list_keys */
    const char ***vals;     /* per host: keys' values, that host's last ("": default) */
    size_t nkeys, n;
    uint32_t host_ms; /* the longest attempt on one host (0: none, connect_timeout=0) */
    size_t good;      /* atomic: the host that gave the last connection */
};

/* Splits list (may be NULL) at its commas into at most HOSTS_MAX parts; their count (0
 * for no list). */
static size_t split(char *list, char *part[HOSTS_MAX])
{
    size_t n = 0;
    if (list == NULL || *list == '\0') {
        return 0;
    }
    for (char *p = list; n < HOSTS_MAX; p++) {
        part[n++] = p;
        if ((p = strchr(p, ',')) == NULL) {
            return n;
        }
        *p = '\0';
    }
    return HOSTS_MAX + 1; /* too many */
}

/* connect_timeout as libpq reads it: seconds, at least 2; 0 or less: none. */
static uint32_t host_ms_of(const char *v)
{
    if (v == NULL || *v == '\0') {
        return HOST_MS_DEFAULT;
    }
    long s = strtol(v, NULL, 10);
    return s <= 0 ? 0 : s < 2 ? 2000 : s > 3600 ? 3600000 : (uint32_t)s * 1000;
}

/* keys: the defaults and every option the conninfo sets but the lists, then list_keys;
 * vals[0] their values. */
static bool fill_keys(pg_hosts *h)
{
    size_t n = N_DEFAULTS + N_LISTS;
    for (PQconninfoOption *o = h->opts; o->keyword != NULL; o++) {
        n += o->val != NULL;
    }
    if ((h->keys = calloc(n + 1, sizeof(*h->keys))) == NULL ||
        (h->vals = calloc(h->n, sizeof(*h->vals))) == NULL ||
        (h->vals[0] = calloc(n + 1, sizeof(**h->vals))) == NULL) {
        return false;
    }
    memcpy(h->keys, default_keys, sizeof(default_keys));
    memcpy(h->vals[0], default_vals, sizeof(default_vals));
    h->nkeys = N_DEFAULTS;
    for (PQconninfoOption *o = h->opts; o->keyword != NULL; o++) {
        bool listed = false;
        for (int l = 0; l < N_LISTS; l++) {
            listed = listed || strcmp(o->keyword, list_keys[l]) == 0;
        }
        if (o->val != NULL && !listed) {
            h->keys[h->nkeys] = o->keyword;
            h->vals[0][h->nkeys++] = o->val;
        }
    }
    memcpy(h->keys + h->nkeys, list_keys, sizeof(list_keys));
    h->nkeys += N_LISTS;
    return true;
}

/* Splits the lists and gives each host its vals; INVALID_ARGUMENT when libpq could not
 * pair them either. */
static idem_code fill_hosts(pg_hosts *h)
{
    char *part[N_LISTS][HOSTS_MAX];
    size_t c[N_LISTS];
    for (int l = 0; l < N_LISTS; l++) {
        c[l] = split(h->lists[l], part[l]);
        if (c[l] > HOSTS_MAX) {
            return idem__err(IDEM_INVALID_ARGUMENT, "postgres conninfo: more than %d %ss",
                             HOSTS_MAX, list_keys[l]);
        }
    }
    h->n = c[L_HOST] > c[L_ADDR] ? c[L_HOST] : c[L_ADDR];
    h->n = h->n ? h->n : 1; /* none given: libpq's default */
    if (c[L_HOST] && c[L_ADDR] && c[L_HOST] != c[L_ADDR]) {
        return idem__err(IDEM_INVALID_ARGUMENT, "postgres conninfo: %zu hostaddrs for %zu hosts",
                         c[L_ADDR], c[L_HOST]);
    }
    if (c[L_PORT] > 1 && c[L_PORT] != h->n) {
        return idem__err(IDEM_INVALID_ARGUMENT, "postgres conninfo: %zu ports for %zu hosts",
                         c[L_PORT], h->n);
    }
    if (!fill_keys(h)) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t i = 0; i < h->n; i++) {
        if (i > 0 && (h->vals[i] = calloc(h->nkeys + 1, sizeof(**h->vals))) == NULL) {
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        }
        memcpy(h->vals[i], h->vals[0], (h->nkeys - N_LISTS) * sizeof(**h->vals));
        for (int l = 0; l < N_LISTS; l++) {
            h->vals[i][h->nkeys - N_LISTS + l] =
                c[l] == 0 ? "" : part[l][c[l] == 1 ? 0 : i]; /* "": ignored by libpq */
        }
    }
    return IDEM_OK;
}

/* The value the conninfo gives kw (NULL: none). */
static const char *option(const PQconninfoOption *o, const char *kw)
{
    for (; o->keyword != NULL; o++) {
        if (strcmp(o->keyword, kw) == 0) {
            return o->val;
        }
    }
    return NULL;
}

/* The host, hostaddr and port lists and connect_timeout: the conninfo's, else the
 * environment's, as libpq takes them (unless a service file is named: libpq reads its
 * lists, and walks them within one attempt). */
static idem_code take_lists(pg_hosts *h)
{
    static const char *const env[N_LISTS] = {"PGHOST", "PGHOSTADDR", "PGPORT"};
    bool service = option(h->opts, "service") != NULL || getenv("PGSERVICE") != NULL;
    for (int l = 0; l < N_LISTS; l++) {
        const char *v = option(h->opts, list_keys[l]);
        v = v == NULL && !service ? getenv(env[l]) : v;
        if (v != NULL && (h->lists[l] = strdup(v)) == NULL) {
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        }
    }
    const char *t = option(h->opts, "connect_timeout");
    h->host_ms = host_ms_of(t != NULL ? t : getenv("PGCONNECT_TIMEOUT"));
    return IDEM_OK;
}

idem_code idem__pg_hosts_parse(const char *conninfo, pg_hosts **out)
{
    char *why = NULL;
    pg_hosts *h = calloc(1, sizeof(*h));
    *out = NULL;
    if (h == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    if ((h->opts = PQconninfoParse(conninfo, &why)) == NULL) {
        idem_code code = why != NULL ? idem__err(IDEM_INVALID_ARGUMENT, "postgres conninfo: %.*s",
                                                 (int)strcspn(why, "\n"), why)
                                     : idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        PQfreemem(why);
        free(h);
        return code;
    }
    idem_code code = take_lists(h);
    if (code == IDEM_OK && (code = fill_hosts(h)) == IDEM_OK) {
        *out = h;
        return IDEM_OK;
    }
    idem__pg_hosts_free(h);
    return code;
}

void idem__pg_hosts_free(pg_hosts *h)
{
    if (h == NULL) {
        return;
    }
    for (size_t i = 0; h->vals != NULL && i < h->n; i++) {
        free(h->vals[i]);
    }
    free(h->vals);
    free(h->keys);
    for (int l = 0; l < N_LISTS; l++) {
        free(h->lists[l]);
    }
    PQconninfoFree(h->opts);
    free(h);
}

/* ---- connecting ---- */

/* The k-th host to try: the one that gave the last connection, then the others in their
 * listed order. */
static size_t nth_host(size_t k, size_t good)
{
    return k == 0 ? good : k - 1 < good ? k - 1 : k;
}

/* Where the attempt on one host ends when left hosts (this one included) remain: at
 * most host_ms, and an equal share of what is left before deadline (0: none). 0: no
 * bound at all. */
static uint64_t attempt_until(const pg_hosts *h, uint64_t deadline, size_t left)
{
    uint64_t now = idem__mono_ms(), until = h->host_ms ? now + h->host_ms : 0;
    if (deadline != 0) {
        uint64_t share = deadline > now ? now + (deadline - now) / left : now;
        until = until != 0 && until < share ? until : share;
    }
    return until;
}

/* Notices: "already exists, skipping", a FATAL before a terminated session's end. */
static void ignore_notice(void *arg, const char *message)
{
    (void)arg, (void)message;
}

/* Polls c's connection forward until it is made, fails, or until (monotonic ms, 0: no
 * bound) passes. */
static bool connect_poll(PGconn *c, uint64_t until, bool *late)
{
    PostgresPollingStatusType s = PGRES_POLLING_WRITING; /* as libpq asks at the start */
    *late = false;
    while (s != PGRES_POLLING_OK && s != PGRES_POLLING_FAILED && PQstatus(c) != CONNECTION_BAD) {
        uint64_t now = idem__mono_ms();
        if (until != 0 && now >= until) {
            *late = true;
            return false;
        }
        struct pollfd p = {.fd = PQsocket(c),
                           .events = s == PGRES_POLLING_READING ? POLLIN : POLLOUT};
        if (p.fd < 0) {
            return false;
        }
        uint64_t wait = until != 0 ? until - now : (uint64_t)INT_MAX;
        int rc = poll(&p, 1, wait < INT_MAX ? (int)wait : INT_MAX);
        if (rc < 0 && errno != EINTR) {
            return false;
        }
        if (rc > 0) {
            s = PQconnectPoll(c);
        }
    }
    return s == PGRES_POLLING_OK && PQstatus(c) == CONNECTION_OK;
}

/* One attempt on host i until the given time; the connection, nonblocking, or NULL and
 * why (appended). */
static PGconn *connect_host(const pg_hosts *h, size_t i, uint64_t until, FILE *why)
{
    const char *const *list = h->vals[i] + h->nkeys - N_LISTS;
    const char *host = *list[L_HOST] ? list[L_HOST] : *list[L_ADDR] ? list[L_ADDR] : "default";
    uint64_t start = idem__mono_ms();
    PGconn *c = PQconnectStartParams(h->keys, h->vals[i], 0);
    bool late = false;
    if (c != NULL && connect_poll(c, until, &late) && PQsetnonblocking(c, 1) == 0) {
        PQsetNoticeProcessor(c, ignore_notice, NULL);
        return c;
    }
    fputs(ftell(why) > 0 ? "; " : "", why);
    if (c == NULL) {
        fputs("out of memory", why);
    } else if (late) {
        fprintf(why, "host %s port %s: no answer within %llu ms", host,
                *list[L_PORT] ? list[L_PORT] : "default", (unsigned long long)(until - start));
    } else { /* libpq's first line names the host */
        const char *m = PQerrorMessage(c);
        fprintf(why, "%.*s", (int)strcspn(m, "\n"), m);
    }
    PQfinish(c);
    return NULL;
}

idem_code idem__pg_connect(pg_hosts *h, uint64_t deadline, PGconn **out)
{
    size_t good = __atomic_load_n(&h->good, __ATOMIC_RELAXED), len = 0;
    char *why = NULL;
    FILE *f = open_memstream(&why, &len);
    *out = NULL;
    if (f == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t k = 0; k < h->n && *out == NULL; k++) {
        if (deadline != 0 && idem__mono_ms() >= deadline) {
            fputs(k > 0 ? "; no time left for the other hosts" : "no time left", f);
            break;
        }
        size_t i = nth_host(k, good);
        if ((*out = connect_host(h, i, attempt_until(h, deadline, h->n - k), f)) != NULL) {
            __atomic_store_n(&h->good, i, __ATOMIC_RELAXED);
        }
    }
    bool written = fclose(f) == 0;
    idem_code code = *out != NULL ? IDEM_OK
                                  : idem__err(IDEM_UNAVAILABLE, "postgres connect: %.300s",
                                              written ? why : "failed");
    free(why);
    return code;
}
