/* idemrpc-bench: throughput and latency of idemrpc next to its two baselines, the nng
 * transport (a bare req/rep echo) and the storage (a raw LMDB put+commit loop).
 *
 *   idemrpc-bench [--clients 1,16,64] [--payload 64] [--transport tcp,ipc]
 *                 [--seconds 1.5 | --count N] [--scenarios a,b,c,d,e,f[,g,h,i]]
 *                 [--csv FILE] [--json FILE]
 *
 *   a  echo     bare nng rep0 echo: contexts + aio, the reply sent from the aio callback
 *   b  gc-off   default chain, a new key per call, durable store, one commit per write
 *   c  gc-on    same, group commit on (the store's default)
 *   d  nosync   same, IDEM_STORE_NOSYNC
 *   e  replay   each client cycles over its own 100 keys, all called once before the
 *               start: every timed call is a cache hit
 *   f  lmdb     raw LMDB, one put per durable transaction, one thread, no transport
 *   g  pg-new   as c, on the PostgreSQL store ($IDEMRPC_BENCH_PG, a libpq conninfo)
 *   h  pg-new2  as g, two server instances on the one database, clients dial both
 *   i  pg-replay as e, on PostgreSQL
 *   (g, h, i run only when asked for with --scenarios; "pg vs lmdb" lines follow)
 *
 * A cell is one (scenario, transport, payload, clients): a server and K client threads
 * in this process on loopback. Every thread connects and warms up untimed, then all
 * start together and stop by themselves after --seconds (or --count calls in all, at
 * most 60 s). ratio_vs_a is calls/s over (a)'s with the same transport, clients and
 * payload; for f, over (a) on the first transport with the fewest clients. Stores live
 * in mkdtemp directories under /tmp, removed after each cell (and at exit). */
#include <endian.h>
#include <ftw.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include <lmdb.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>

#include <idemrpc/idemrpc.h>

#define MAX_LIST 16
#define MAX_CLIENTS 1024
#define MAX_PAYLOAD (1 << 20)
#define WARMUP_CALLS 8            /* untimed calls per thread before the start */
#define REPLAY_KEYS 100           /* e: keys per client, called once before the start */
#define LATENCY_BUDGET (1u << 21) /* samples kept per cell over all threads (16 MiB) */
#define CALL_TIMEOUT_MS 10000     /* a call slower than this is an error, not a retry */
#define COUNT_TIME_CAP_S 60.0     /* --count alone is still bounded in time */
#define LMDB_MAP_SIZE ((size_t)1 << 30)
#define METHOD "bench.Echo/Echo"

static char run_tag[24]; /* in every key: a shared database outlives one run */

static struct {
    long clients[MAX_LIST], payloads[MAX_LIST];
    const char *transports[MAX_LIST];
    int n_clients, n_payloads, n_transports;
    bool want[9]; /* scenario a..i */
    double seconds;
    unsigned long long count; /* 0 = bounded by time only */
    const char *csv, *json;
} cfg;

/* ---- time, temporary directories ---- */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The store directory of the running cell; "" when none. At most one exists at a time. */
static char live_dir[64];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void tmp_dir_remove(void)
{
    if (live_dir[0] != '\0') {
        nftw(live_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
        live_dir[0] = '\0';
    }
}

static const char *tmp_dir_create(void)
{
    tmp_dir_remove();
    strcpy(live_dir, "/tmp/idemrpc-bench-XXXXXX");
    if (mkdtemp(live_dir) == NULL) {
        live_dir[0] = '\0';
        return NULL;
    }
    return live_dir;
}

/* ---- cells ---- */

typedef enum key_mode { KEYS_NONE, KEYS_NEW, KEYS_REPLAY } key_mode;

typedef struct cell cell;
typedef struct cell_stats cell_stats;
typedef struct scenario {
    char letter;
    const char *name; /* table label */
    int (*run)(const struct scenario *sc, cell *c, cell_stats *out);
    unsigned store_flags; /* b–e */
    key_mode keys;        /* b–e, g–i */
    int instances;        /* g–i: servers on one PostgreSQL database */
} scenario;

struct cell {
    const scenario *sc;
    const char *transport; /* "tcp", "ipc", "inproc"; "-" for f */
    int clients;
    size_t payload_len;
    const void *payload; /* payload_len bytes, read-only, shared by all threads */
    unsigned id;         /* unique in this process: keys and ipc paths */
    int warmup;          /* untimed calls per thread, set by the runner */
    char url[160];       /* what clients dial, set by the runner */
    char url2[160];      /* h: the second instance ("" when none) */
    const char *dir;     /* f: the LMDB directory */
};

struct cell_stats {
    uint64_t ok, errors;
    double seconds; /* from the common start to the last thread's last reply */
    double p50_us, p99_us, p999_us;
    char error[200]; /* the first error seen; "" when none */
};

static int cell_fail(cell_stats *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int cell_fail(cell_stats *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->error, sizeof(out->error), fmt, ap);
    va_end(ap);
    return -1;
}

static size_t server_contexts(int clients)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    size_t floor = (size_t)(cores > 0 ? cores : 1) * 2;
    return (size_t)clients > floor ? (size_t)clients : floor;
}

/* Where a server of cell c listens; tcp binds port 0. */
static void listen_url(const cell *c, int instance, char *buf, size_t cap)
{
    if (strcmp(c->transport, "tcp") == 0) {
        snprintf(buf, cap, "tcp://127.0.0.1:0");
    } else if (strcmp(c->transport, "ipc") == 0) {
        snprintf(buf, cap, "ipc:///tmp/idemrpc-bench-%d-%u-%d.sock", (int)getpid(), c->id,
                 instance);
    } else {
        snprintf(buf, cap, "inproc://idemrpc-bench-%u-%d", c->id, instance);
    }
}

/* What clients dial: the listen URL, with the port actually bound for tcp. */
static void set_dial_url(cell *c, const char *listen, int port)
{
    if (strcmp(c->transport, "tcp") == 0) {
        snprintf(c->url, sizeof(c->url), "tcp://127.0.0.1:%d", port);
    } else {
        snprintf(c->url, sizeof(c->url), "%s", listen);
    }
}

/* ---- latency samples: bounded, preallocated per thread ---- */

typedef struct latency_sample {
    uint64_t *ns;
    size_t n, cap;
    uint64_t seen;
    uint64_t rng; /* xorshift64 state, nonzero */
} latency_sample;

/* Keeps the first cap samples, then each later one with probability cap/seen (reservoir
 * sampling), so the kept set stays a uniform sample of all calls. */
static void latency_record(latency_sample *s, uint64_t ns)
{
    s->seen++;
    if (s->n < s->cap) {
        s->ns[s->n++] = ns;
        return;
    }
    s->rng ^= s->rng << 13;
    s->rng ^= s->rng >> 7;
    s->rng ^= s->rng << 17;
    uint64_t j = s->rng % s->seen;
    if (j < s->cap) {
        s->ns[j] = ns;
    }
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of sorted samples, in µs. */
static double percentile_us(const uint64_t *sorted, size_t n, double p)
{
    if (n == 0) {
        return NAN;
    }
    size_t rank = (size_t)ceil(p * (double)n);
    return (double)sorted[rank > 0 ? rank - 1 : 0] / 1e3;
}

/* ---- the client loop shared by every scenario ---- */

typedef struct client_run client_run;

typedef struct bench_thread {
    client_run *run;
    const cell *cell;
    int id;
    uint64_t seq; /* calls made by this thread, warm-up included */
    union {
        nng_socket sock;     /* a */
        idem_client *client; /* b–e */
        struct {
            MDB_env *env;
            MDB_dbi dbi;
        } lmdb; /* f */
    } conn;
    latency_sample lat;
    uint64_t ok, errors, end_ns;
    bool setup_failed;
    char error[200]; /* the first error of this thread */
    pthread_t tid;
} bench_thread;

/* What a client thread does; the timing around it is run_clients()'s. call returns 0
 * for a correct reply, -1 otherwise (after thread_fail). close also undoes a partial
 * open. */
typedef struct client_ops {
    int (*open)(bench_thread *t);
    int (*call)(bench_thread *t);
    void (*close)(bench_thread *t);
} client_ops;

struct client_run {
    const client_ops *ops;
    const cell *cell;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ready;            /* threads done with open + warm-up */
    bool go, abort;       /* set once, under mu */
    uint64_t deadline_ns; /* written before go */
    atomic_ullong issued; /* calls started, for --count */
};

static int thread_fail(bench_thread *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int thread_fail(bench_thread *t, const char *fmt, ...)
{
    if (t->error[0] == '\0') {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->error, sizeof(t->error), fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* Reports this thread ready and waits for the common start; false: do not run. */
static bool gate_wait(bench_thread *t)
{
    client_run *r = t->run;
    pthread_mutex_lock(&r->mu);
    r->ready++;
    pthread_cond_broadcast(&r->cv);
    while (!r->go) {
        pthread_cond_wait(&r->cv, &r->mu);
    }
    bool run = !r->abort;
    pthread_mutex_unlock(&r->mu);
    return run;
}

/* Waits for `started` threads to be ready, then starts them all; returns the start. */
static uint64_t gate_open(client_run *r, int started, bool abort)
{
    pthread_mutex_lock(&r->mu);
    while (r->ready < started) {
        pthread_cond_wait(&r->cv, &r->mu);
    }
    uint64_t start = now_ns();
    r->deadline_ns = start + (uint64_t)(cfg.seconds * 1e9);
    r->go = true;
    r->abort = abort;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return start;
}

/* The one timing loop: until the deadline (or the cell's count) is reached. */
static void timed_loop(bench_thread *t)
{
    client_run *r = t->run;
    for (;;) {
        if (cfg.count > 0 && atomic_fetch_add(&r->issued, 1) >= cfg.count) {
            break;
        }
        uint64_t t0 = now_ns();
        int rv = r->ops->call(t);
        uint64_t t1 = now_ns();
        latency_record(&t->lat, t1 - t0);
        if (rv == 0) {
            t->ok++;
        } else {
            t->errors++;
        }
        if (t1 >= r->deadline_ns) {
            break;
        }
    }
}

static void *client_thread_main(void *arg)
{
    bench_thread *t = arg;
    client_run *r = t->run;
    int rv = r->ops->open(t);
    for (int i = 0; rv == 0 && i < r->cell->warmup; i++) {
        rv = r->ops->call(t);
    }
    t->setup_failed = rv != 0;
    if (gate_wait(t) && !t->setup_failed) {
        timed_loop(t);
    }
    t->end_ns = now_ns();
    r->ops->close(t);
    return NULL;
}

/* Sums the threads' counts, merges and sorts their latency samples. */
static int collect(bench_thread *ts, int n, uint64_t start, cell_stats *out)
{
    size_t total = 0;
    uint64_t end = start;
    for (int i = 0; i < n; i++) {
        out->ok += ts[i].ok;
        out->errors += ts[i].errors;
        end = ts[i].end_ns > end ? ts[i].end_ns : end;
        total += ts[i].lat.n;
        if (out->error[0] == '\0' && ts[i].error[0] != '\0') {
            snprintf(out->error, sizeof(out->error), "%s", ts[i].error);
        }
    }
    out->seconds = (double)(end - start) / 1e9;
    uint64_t *all = malloc((total > 0 ? total : 1) * sizeof(*all));
    if (all == NULL) {
        return cell_fail(out, "out of memory for %zu latency samples", total);
    }
    for (int i = 0, k = 0; i < n; i++) {
        memcpy(all + k, ts[i].lat.ns, ts[i].lat.n * sizeof(*all));
        k += (int)ts[i].lat.n;
    }
    qsort(all, total, sizeof(*all), cmp_u64);
    out->p50_us = percentile_us(all, total, 0.50);
    out->p99_us = percentile_us(all, total, 0.99);
    out->p999_us = percentile_us(all, total, 0.999);
    free(all);
    return 0;
}

/* Runs c->clients threads of ops against c->url and measures them. -1 when a thread
 * could not be started or set up (out->error says why). */
static int run_clients(const client_ops *ops, const cell *c, cell_stats *out)
{
    client_run r = {.ops = ops, .cell = c};
    bench_thread *ts = calloc((size_t)c->clients, sizeof(*ts));
    size_t cap = LATENCY_BUDGET / (size_t)c->clients;
    int started = 0, rv = -1;

    pthread_mutex_init(&r.mu, NULL);
    pthread_cond_init(&r.cv, NULL);
    atomic_init(&r.issued, 0);
    for (int i = 0; ts != NULL && i < c->clients; i++) {
        bench_thread *t = &ts[i];
        *t = (bench_thread){.run = &r, .cell = c, .id = i};
        t->lat = (latency_sample){.ns = malloc(cap * sizeof(uint64_t)),
                                  .cap = cap,
                                  .rng = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1)};
        if (t->lat.ns == NULL || pthread_create(&t->tid, NULL, client_thread_main, t) != 0) {
            break;
        }
        started++;
    }
    bool setup_ok = ts != NULL && started == c->clients;
    uint64_t start = gate_open(&r, started, !setup_ok);
    for (int i = 0; i < started; i++) {
        pthread_join(ts[i].tid, NULL);
        setup_ok = setup_ok && !ts[i].setup_failed;
    }
    if (ts == NULL) {
        cell_fail(out, "out of memory");
    } else if (collect(ts, started, start, out) == 0) {
        rv = setup_ok ? 0 : -1;
        if (!setup_ok && out->error[0] == '\0') {
            cell_fail(out, "could not start %d client threads", c->clients);
        }
    }
    for (int i = 0; ts != NULL && i < c->clients; i++) {
        free(ts[i].lat.ns);
    }
    free(ts);
    pthread_cond_destroy(&r.cv);
    pthread_mutex_destroy(&r.mu);
    return rv;
}

/* ---- a: bare nng echo (the transport baseline) ---- */

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

static int raw_open(bench_thread *t)
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

static void raw_close(bench_thread *t)
{
    nng_close(t->conn.sock); /* NNG_ENOENT for a socket never opened: nothing to do */
}

static const client_ops raw_ops = {raw_open, raw_call, raw_close};

static int run_echo(const scenario *sc, cell *c, cell_stats *out)
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

/* ---- b–e: the full chain through idem_client ---- */

static idem_code echo_handler(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    return idem_call_reply(call, IDEM_OK, p, n);
}

static int chain_open(bench_thread *t)
{
    idem_client_opts o;
    const char *urls[] = {t->cell->url, t->cell->url2};
    const char *url = urls[0];
    idem_client_opts_init(&o);
    o.caller = "bench";
    o.attempt_timeout_ms = CALL_TIMEOUT_MS;
    o.deadline_ms = CALL_TIMEOUT_MS;
    o.retry.max_attempts = 1; /* a retry would hide a failure inside a latency */
    if (idem_client_open(&t->conn.client, urls, t->cell->url2[0] ? 2 : 1, &o) != IDEM_OK) {
        return thread_fail(t, "idem_client_open %s: %s", url, idem_errmsg());
    }
    return 0;
}

/* New keys: the thread's seq makes each unique. Replay: seq cycles over REPLAY_KEYS
 * keys; the first round (the warm-up) executes them, every later call must replay. */
static int chain_call(bench_thread *t)
{
    const cell *c = t->cell;
    bool replay = c->sc->keys == KEYS_REPLAY;
    uint64_t n = replay ? t->seq % REPLAY_KEYS : t->seq;
    bool want_replayed = replay && t->seq >= REPLAY_KEYS;
    char key[64];
    snprintf(key, sizeof(key), "%s-c%u-t%d-%c%llu", run_tag, c->id, t->id, replay ? 'r' : 'n',
             (unsigned long long)n);
    t->seq++;

    idem_request q = {.method = METHOD,
                      .idempotency_key = key,
                      .payload = c->payload,
                      .payload_len = c->payload_len};
    idem_result r;
    idem_code code = idem_client_call(t->conn.client, &q, &r);
    int rv = 0;
    if (code != IDEM_OK) {
        rv = thread_fail(t, "call: %s %s", idem_code_name(code),
                         r.message != NULL ? r.message : idem_errmsg());
    } else if (r.payload_len != c->payload_len || r.replayed != want_replayed) {
        rv = thread_fail(t, "call: %zu bytes, replayed %d (want %zu, %d)", r.payload_len,
                         r.replayed, c->payload_len, want_replayed);
    }
    idem_result_clear(&r);
    return rv;
}

static void chain_close(bench_thread *t)
{
    idem_client_close(t->conn.client);
}

static const client_ops chain_ops = {chain_open, chain_call, chain_close};

static int chain_server_start(cell *c, int instance, idem_store *st, idem_server **srv,
                              cell_stats *out)
{
    idem_server_opts o;
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    char url[160];

    idem_server_opts_init(&o);
    o.store = st;
    o.contexts = server_contexts(c->clients);
    if (idem_server_create(srv, &o) != IDEM_OK) {
        return cell_fail(out, "idem_server_create: %s", idem_errmsg());
    }
    listen_url(c, instance, url, sizeof(url));
    if (idem_server_register(*srv, METHOD, echo_handler, NULL, &m) != IDEM_OK ||
        idem_server_listen(*srv, url) != IDEM_OK) {
        return cell_fail(out, "server %s: %s", url, idem_errmsg());
    }
    set_dial_url(c, url, idem_server_port(*srv));
    return 0;
}

static int run_chain(const scenario *sc, cell *c, cell_stats *out)
{
    idem_store *st = NULL;
    idem_server *srv = NULL;
    const char *dir = tmp_dir_create();
    int rv = -1;

    if (dir == NULL) {
        return cell_fail(out, "mkdtemp under /tmp failed");
    }
    if (idem_store_open_lmdb(&st, dir, 0, sc->store_flags) != IDEM_OK) {
        cell_fail(out, "idem_store_open_lmdb %s: %s", dir, idem_errmsg());
        goto out;
    }
    if (chain_server_start(c, 0, st, &srv, out) == 0) {
        c->warmup = sc->keys == KEYS_REPLAY ? REPLAY_KEYS : WARMUP_CALLS;
        rv = run_clients(&chain_ops, c, out);
    }
out:
    idem_server_destroy(srv);
    if (st != NULL) {
        idem_store_close(st);
    }
    tmp_dir_remove();
    return rv;
}

/* g–i: the same chain on PostgreSQL, with one or two server instances. */
static int run_pg(const scenario *sc, cell *c, cell_stats *out)
{
    const char *conninfo = getenv("IDEMRPC_BENCH_PG");
    idem_store *st[2] = {NULL, NULL};
    idem_server *srv[2] = {NULL, NULL};
    int rv = -1;
    if (conninfo == NULL) {
        return cell_fail(out, "set IDEMRPC_BENCH_PG to a libpq conninfo");
    }
    for (int i = 0; i < sc->instances; i++) {
        if (idem_store_open_postgres(&st[i], conninfo, server_contexts(c->clients)) != IDEM_OK) {
            cell_fail(out, "idem_store_open_postgres: %s", idem_errmsg());
            goto out;
        }
        if (i == 1) {
            snprintf(c->url2, sizeof(c->url2), "%s", c->url); /* the next start sets url */
        }
        if (chain_server_start(c, i, st[i], &srv[i], out) != 0) {
            goto out;
        }
    }
    c->warmup = sc->keys == KEYS_REPLAY ? REPLAY_KEYS : WARMUP_CALLS;
    rv = run_clients(&chain_ops, c, out);
out:
    for (int i = 0; i < 2; i++) {
        idem_server_destroy(srv[i]);
        if (st[i] != NULL) {
            idem_store_close(st[i]);
        }
    }
    return rv;
}

/* ---- f: raw LMDB put + durable commit (the storage baseline) ---- */

static int lmdb_fail(bench_thread *t, const char *what, int rc)
{
    return thread_fail(t, "%s: %s", what, mdb_strerror(rc));
}

static int lmdb_open(bench_thread *t)
{
    MDB_txn *txn;
    int rc;
    if ((rc = mdb_env_create(&t->conn.lmdb.env)) != 0) {
        t->conn.lmdb.env = NULL;
        return lmdb_fail(t, "mdb_env_create", rc);
    }
    MDB_env *env = t->conn.lmdb.env;
    if ((rc = mdb_env_set_mapsize(env, LMDB_MAP_SIZE)) != 0) {
        return lmdb_fail(t, "mdb_env_set_mapsize", rc);
    }
    if ((rc = mdb_env_open(env, t->cell->dir, 0, 0600)) != 0) { /* durable: no NOSYNC */
        return lmdb_fail(t, "mdb_env_open", rc);
    }
    if ((rc = mdb_txn_begin(env, NULL, 0, &txn)) != 0) {
        return lmdb_fail(t, "mdb_txn_begin", rc);
    }
    if ((rc = mdb_dbi_open(txn, NULL, 0, &t->conn.lmdb.dbi)) != 0) {
        mdb_txn_abort(txn);
        return lmdb_fail(t, "mdb_dbi_open", rc);
    }
    if ((rc = mdb_txn_commit(txn)) != 0) {
        return lmdb_fail(t, "mdb_txn_commit", rc);
    }
    return 0;
}

/* One put of the payload under a new big-endian key, in its own write transaction. */
static int lmdb_call(bench_thread *t)
{
    uint64_t k = htobe64(t->seq++);
    MDB_val key = {sizeof(k), &k};
    MDB_val val = {t->cell->payload_len, (void *)t->cell->payload};
    MDB_txn *txn;
    int rc;
    if ((rc = mdb_txn_begin(t->conn.lmdb.env, NULL, 0, &txn)) != 0) {
        return lmdb_fail(t, "mdb_txn_begin", rc);
    }
    if ((rc = mdb_put(txn, t->conn.lmdb.dbi, &key, &val, 0)) != 0) {
        mdb_txn_abort(txn);
        return lmdb_fail(t, "mdb_put", rc);
    }
    if ((rc = mdb_txn_commit(txn)) != 0) { /* commit frees txn even when it fails */
        return lmdb_fail(t, "mdb_txn_commit", rc);
    }
    return 0;
}

static void lmdb_close(bench_thread *t)
{
    if (t->conn.lmdb.env != NULL) {
        mdb_env_close(t->conn.lmdb.env);
    }
}

static const client_ops lmdb_ops = {lmdb_open, lmdb_call, lmdb_close};

static int run_lmdb(const scenario *sc, cell *c, cell_stats *out)
{
    (void)sc;
    if ((c->dir = tmp_dir_create()) == NULL) {
        return cell_fail(out, "mkdtemp under /tmp failed");
    }
    c->warmup = WARMUP_CALLS;
    int rv = run_clients(&lmdb_ops, c, out);
    tmp_dir_remove();
    return rv;
}

static const scenario scenarios[] = {
    {'a', "a:echo", run_echo, 0, KEYS_NONE, 0},
    {'b', "b:gc-off", run_chain, IDEM_STORE_NO_GROUP_COMMIT, KEYS_NEW, 0},
    {'c', "c:gc-on", run_chain, 0, KEYS_NEW, 0},
    {'d', "d:nosync", run_chain, IDEM_STORE_NOSYNC, KEYS_NEW, 0},
    {'e', "e:replay", run_chain, 0, KEYS_REPLAY, 0},
    {'f', "f:lmdb", run_lmdb, 0, KEYS_NONE, 0},
    {'g', "g:pg-new", run_pg, 0, KEYS_NEW, 1},
    {'h', "h:pg-new2", run_pg, 0, KEYS_NEW, 2},
    {'i', "i:pg-rep", run_pg, 0, KEYS_REPLAY, 1},
};

/* ---- results ---- */

typedef struct row {
    const scenario *sc;
    const char *transport;
    int clients;
    size_t payload;
    double calls_s, p50_us, p99_us, p999_us, ratio; /* NAN: none */
    uint64_t errors;
} row;

static row rows[9 * MAX_LIST * MAX_LIST * MAX_LIST];
static size_t n_rows;

/* (a) for the same transport, clients and payload; for f, (a) on the first transport
 * with the fewest clients. NULL when (a) was not run. */
static const row *baseline_of(const row *r)
{
    bool storage = r->sc->letter == 'f';
    const char *transport = storage ? cfg.transports[0] : r->transport;
    const row *best = NULL;
    for (size_t i = 0; i < n_rows; i++) {
        const row *a = &rows[i];
        if (a->sc->letter != 'a' || strcmp(a->transport, transport) != 0 ||
            a->payload != r->payload || (!storage && a->clients != r->clients)) {
            continue;
        }
        if (best == NULL || a->clients < best->clients) {
            best = a;
        }
    }
    return best;
}

static const char *table_fmt = "%-10s %-9s %7s %7s %10s %10s %10s %10s %10s %7s\n";

static void print_header(void)
{
    printf(table_fmt, "scenario", "transport", "clients", "payload", "calls/s", "p50_us", "p99_us",
           "p999_us", "ratio_vs_a", "errors");
}

static void print_row(const row *r)
{
    char cl[16], pl[16], cs[16], p50[16], p99[16], p999[16], ratio[16], err[24];
    snprintf(cl, sizeof(cl), "%d", r->clients);
    snprintf(pl, sizeof(pl), "%zu", r->payload);
    snprintf(cs, sizeof(cs), "%.0f", r->calls_s);
    snprintf(p50, sizeof(p50), "%.1f", r->p50_us);
    snprintf(p99, sizeof(p99), "%.1f", r->p99_us);
    snprintf(p999, sizeof(p999), "%.1f", r->p999_us);
    snprintf(ratio, sizeof(ratio), isnan(r->ratio) ? "-" : "%.3f", r->ratio);
    snprintf(err, sizeof(err), "%llu", (unsigned long long)r->errors);
    printf(table_fmt, r->sc->name, r->transport, cl, pl, cs, p50, p99, p999, ratio, err);
    fflush(stdout);
}

/* A number for CSV/JSON; `none` ("" or "null") for NAN. */
static const char *num(char *buf, size_t cap, const char *fmt, double v, const char *none)
{
    if (isnan(v)) {
        return none;
    }
    snprintf(buf, cap, fmt, v);
    return buf;
}

static int write_csv(const char *path)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return -1;
    }
    fprintf(f, "scenario,transport,clients,payload,calls_per_s,p50_us,p99_us,p999_us,"
               "ratio_vs_a,errors\n");
    for (size_t i = 0; i < n_rows; i++) {
        const row *r = &rows[i];
        char b[4][32];
        fprintf(f, "%s,%s,%d,%zu,%.1f,%s,%s,%s,%s,%llu\n", r->sc->name, r->transport, r->clients,
                r->payload, r->calls_s, num(b[0], 32, "%.1f", r->p50_us, ""),
                num(b[1], 32, "%.1f", r->p99_us, ""), num(b[2], 32, "%.1f", r->p999_us, ""),
                num(b[3], 32, "%.4f", r->ratio, ""), (unsigned long long)r->errors);
    }
    return fclose(f) == 0 ? 0 : -1;
}

/* ---- the machine ---- */

static struct {
    long nproc;
    char kernel[128], cpu[128], lmdb[32], tmp_fs[32];
    const char *nng;
} machine;

static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s != '\0'; s++) {
        if (*s == '"' || *s == '\\') {
            fprintf(f, "\\%c", *s);
        } else if ((unsigned char)*s < 0x20) {
            fprintf(f, "\\u%04x", (unsigned char)*s);
        } else {
            fputc(*s, f);
        }
    }
    fputc('"', f);
}

static int write_json(const char *path)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return -1;
    }
    fprintf(f, "{\"machine\": {\"nproc\": %ld, \"kernel\": ", machine.nproc);
    json_str(f, machine.kernel);
    fprintf(f, ", \"cpu\": ");
    json_str(f, machine.cpu);
    fprintf(f, ", \"nng\": \"%s\", \"lmdb\": \"%s\", \"tmp_fs\": \"%s\"},\n", machine.nng,
            machine.lmdb, machine.tmp_fs);
    fprintf(f,
            " \"config\": {\"seconds\": %g, \"count\": %llu, \"clients\": "
            "\"one idem_client per thread\"},\n \"rows\": [\n",
            cfg.seconds, cfg.count);
    for (size_t i = 0; i < n_rows; i++) {
        const row *r = &rows[i];
        char b[4][32];
        fprintf(f,
                "  {\"scenario\": \"%s\", \"transport\": \"%s\", \"clients\": %d, "
                "\"payload\": %zu, \"calls_per_s\": %.1f, \"p50_us\": %s, \"p99_us\": %s, "
                "\"p999_us\": %s, \"ratio_vs_a\": %s, \"errors\": %llu}%s\n",
                r->sc->name, r->transport, r->clients, r->payload, r->calls_s,
                num(b[0], 32, "%.1f", r->p50_us, "null"), num(b[1], 32, "%.1f", r->p99_us, "null"),
                num(b[2], 32, "%.1f", r->p999_us, "null"), num(b[3], 32, "%.4f", r->ratio, "null"),
                (unsigned long long)r->errors, i + 1 < n_rows ? "," : "");
    }
    fprintf(f, " ]}\n");
    return fclose(f) == 0 ? 0 : -1;
}

static const char *fs_name(long type)
{
    switch (type) {
    case 0xEF53:
        return "ext4";
    case 0x01021994:
        return "tmpfs";
    case 0x58465342:
        return "xfs";
    case 0x9123683E:
        return "btrfs";
    case 0x794c7630:
        return "overlayfs";
    default:
        return "other";
    }
}

static void machine_probe(void)
{
    cpu_set_t set;
    struct utsname u;
    struct statfs sf;
    int maj, min, pat;

    machine.nproc = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                                 : sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(machine.kernel, sizeof(machine.kernel), "%s", uname(&u) == 0 ? u.release : "?");
    snprintf(machine.cpu, sizeof(machine.cpu), "?");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon != NULL) {
            snprintf(machine.cpu, sizeof(machine.cpu), "%s", colon + 2);
            machine.cpu[strcspn(machine.cpu, "\n")] = '\0';
            break;
        }
    }
    if (f != NULL) {
        fclose(f);
    }
    machine.nng = nng_version();
    mdb_version(&maj, &min, &pat);
    snprintf(machine.lmdb, sizeof(machine.lmdb), "%d.%d.%d", maj, min, pat);
    snprintf(machine.tmp_fs, sizeof(machine.tmp_fs), "%s",
             statfs("/tmp", &sf) == 0 ? fs_name((long)sf.f_type) : "?");
}

static void print_preamble(void)
{
    printf("idemrpc-bench: nproc %ld, kernel %s, CPU %s\n", machine.nproc, machine.kernel,
           machine.cpu);
    printf("nng %s, LMDB %s; stores in /tmp (%s), durable = fdatasync per commit\n", machine.nng,
           machine.lmdb, machine.tmp_fs);
    if (cfg.count > 0) {
        printf("cell: %llu calls (at most %.1f s)", cfg.count, cfg.seconds);
    } else {
        printf("cell: %.2f s", cfg.seconds);
    }
    printf("; server contexts = workers = max(clients, 2 x %ld cores); warm-up %d calls "
           "per thread untimed\n",
           sysconf(_SC_NPROCESSORS_ONLN), WARMUP_CALLS);
    printf("clients: K threads; b-e one idem_client per thread (own req0 socket, no "
           "retries), a one raw req0 socket per thread (blocking send/recv)\n");
    printf("latency: every call, up to %u samples per cell (uniform reservoir beyond); "
           "nearest-rank percentiles\n",
           LATENCY_BUDGET);
    printf("f: %s, 1 thread; its ratio is vs a on %s with the fewest clients\n\n",
           "one mdb_put per durable txn", cfg.transports[0]);
}

/* ---- command line ---- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: idemrpc-bench [--clients 1,16,64] [--payload 64[,4096]] "
            "[--transport tcp,ipc[,inproc]]\n"
            "                     [--seconds 1.5 | --count N] [--scenarios a,b,c,d,e,f] "
            "[--csv FILE] [--json FILE]\n"
            "  a echo  b chain gc off  c chain gc on  d chain nosync  e replay  f raw lmdb\n"
            "  --count N: N calls per cell, at most --seconds (default %.0f s then)\n",
            COUNT_TIME_CAP_S);
}

/* Parses "1,16,64" into out; false on a bad, out-of-range or too long list. */
static bool parse_longs(const char *s, long *out, int *n, long lo, long hi)
{
    char *end;
    for (*n = 0; *n < MAX_LIST; (*n)++) {
        out[*n] = strtol(s, &end, 10);
        if (end == s || out[*n] < lo || out[*n] > hi || (*end != ',' && *end != '\0')) {
            return false;
        }
        if (*end == '\0') {
            (*n)++;
            return true;
        }
        s = end + 1;
    }
    return false;
}

static bool parse_transports(char *s)
{
    cfg.n_transports = 0;
    for (char *tok = strtok(s, ","); tok != NULL; tok = strtok(NULL, ",")) {
        if (cfg.n_transports == MAX_LIST ||
            (strcmp(tok, "tcp") != 0 && strcmp(tok, "ipc") != 0 && strcmp(tok, "inproc") != 0)) {
            return false;
        }
        cfg.transports[cfg.n_transports++] = tok;
    }
    return cfg.n_transports > 0;
}

static bool parse_scenarios(const char *s)
{
    memset(cfg.want, 0, sizeof(cfg.want));
    for (; *s != '\0'; s++) {
        if (*s >= 'a' && *s <= 'i') {
            cfg.want[*s - 'a'] = true;
        } else if (*s != ',') {
            return false;
        }
    }
    return true;
}

static bool parse_args(int argc, char **argv)
{
    static char default_transports[] = "tcp,ipc";
    bool seconds_given = false, ok = true;
    cfg.clients[0] = 1, cfg.clients[1] = 16, cfg.clients[2] = 64, cfg.n_clients = 3;
    cfg.payloads[0] = 64, cfg.n_payloads = 1;
    cfg.seconds = 1.5;
    parse_transports(default_transports);
    parse_scenarios("abcdef");
    for (int i = 1; ok && i < argc; i += 2) {
        const char *flag = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (v == NULL) {
            ok = false;
        } else if (strcmp(flag, "--clients") == 0) {
            ok = parse_longs(v, cfg.clients, &cfg.n_clients, 1, MAX_CLIENTS);
        } else if (strcmp(flag, "--payload") == 0) {
            ok = parse_longs(v, cfg.payloads, &cfg.n_payloads, 0, MAX_PAYLOAD);
        } else if (strcmp(flag, "--transport") == 0) {
            ok = parse_transports(argv[i + 1]);
        } else if (strcmp(flag, "--seconds") == 0) {
            cfg.seconds = strtod(v, &end);
            ok = *end == '\0' && cfg.seconds > 0 && cfg.seconds <= 3600;
            seconds_given = true;
        } else if (strcmp(flag, "--count") == 0) {
            cfg.count = strtoull(v, &end, 10);
            ok = *end == '\0' && cfg.count > 0;
        } else if (strcmp(flag, "--scenarios") == 0) {
            ok = parse_scenarios(v);
        } else if (strcmp(flag, "--csv") == 0) {
            cfg.csv = v;
        } else if (strcmp(flag, "--json") == 0) {
            cfg.json = v;
        } else {
            ok = false;
        }
    }
    if (cfg.count > 0 && !seconds_given) {
        cfg.seconds = COUNT_TIME_CAP_S;
    }
    return ok;
}

/* The PostgreSQL rows against their LMDB counterparts of the same run: g and h vs c
 * (new keys, durable), i vs e (replay). */
static void print_pg_ratios(void)
{
    for (size_t i = 0; i < n_rows; i++) {
        const row *p = &rows[i];
        char want = p->sc->letter == 'i' ? 'e' : 'c';
        if (p->sc->letter < 'g') {
            continue;
        }
        for (size_t j = 0; j < n_rows; j++) {
            const row *l = &rows[j];
            if (l->sc->letter == want && strcmp(l->transport, p->transport) == 0 &&
                l->clients == p->clients && l->payload == p->payload && l->calls_s > 0) {
                printf("pg vs lmdb: %s / %s %s %d clients %zu B: %.3f\n", p->sc->name, l->sc->name,
                       p->transport, p->clients, p->payload, p->calls_s / l->calls_s);
            }
        }
    }
}

/* ---- main ---- */

static unsigned next_cell_id;

/* Runs one cell and appends its row; false when it could not be measured. */
static bool run_cell(const scenario *sc, const char *transport, int clients, long payload,
                     const void *buf)
{
    cell c = {.sc = sc,
              .transport = transport,
              .clients = clients,
              .payload_len = (size_t)payload,
              .payload = buf,
              .id = next_cell_id++};
    cell_stats s = {.ok = 0};
    if (sc->run(sc, &c, &s) != 0) {
        printf("%-10s %-9s %7d %7ld   FAILED: %s\n", sc->name, transport, clients, payload,
               s.error);
        return false;
    }
    row *r = &rows[n_rows++];
    *r = (row){.sc = sc,
               .transport = transport,
               .clients = clients,
               .payload = (size_t)payload,
               .calls_s = s.seconds > 0 ? (double)s.ok / s.seconds : 0,
               .p50_us = s.p50_us,
               .p99_us = s.p99_us,
               .p999_us = s.p999_us,
               .errors = s.errors,
               .ratio = NAN};
    const row *a = baseline_of(r);
    if (a != NULL && a->calls_s > 0) {
        r->ratio = r->calls_s / a->calls_s;
    }
    print_row(r);
    if (s.errors > 0) {
        fprintf(stderr, "  %s: %llu errors, first: %s\n", sc->name, (unsigned long long)s.errors,
                s.error);
    }
    return true;
}

int main(int argc, char **argv)
{
    snprintf(run_tag, sizeof(run_tag), "%lx", (unsigned long)time(NULL) ^ (unsigned long)getpid());
    if (!parse_args(argc, argv)) {
        usage(stderr);
        return 2;
    }
    atexit(tmp_dir_remove);
    machine_probe();
    print_preamble();
    print_header();

    static char buf[MAX_PAYLOAD];
    memset(buf, 'p', sizeof(buf));
    bool all_ok = true;
    /* (a) first in every (transport, payload, clients) group: the others' ratio needs it */
    for (int t = 0; t < cfg.n_transports; t++) {
        for (int p = 0; p < cfg.n_payloads; p++) {
            for (int k = 0; k < cfg.n_clients; k++) {
                for (int s = 0; s < 9; s++) {
                    if (cfg.want[s] && s != 5) {
                        all_ok &= run_cell(&scenarios[s], cfg.transports[t], (int)cfg.clients[k],
                                           cfg.payloads[p], buf);
                    }
                }
            }
        }
    }
    for (int p = 0; cfg.want[5] && p < cfg.n_payloads; p++) {
        all_ok &= run_cell(&scenarios[5], "-", 1, cfg.payloads[p], buf);
    }
    print_pg_ratios();
    if (cfg.csv != NULL && write_csv(cfg.csv) != 0) {
        fprintf(stderr, "idemrpc-bench: cannot write %s\n", cfg.csv);
        all_ok = false;
    }
    if (cfg.json != NULL && write_json(cfg.json) != 0) {
        fprintf(stderr, "idemrpc-bench: cannot write %s\n", cfg.json);
        all_ok = false;
    }
    return all_ok ? 0 : 1;
}
