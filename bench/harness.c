/* The cell harness: the cell's helpers every scenario uses (URLs, server contexts, the
 * temporary store directory, the keys) and the one client loop: K threads open and warm up
 * untimed, wait at one gate, then call until the common deadline or the shared --count,
 * and wait at a second gate before they close.
 *
 * Invariant: each gate opens exactly once per run, after every started thread reached
 * it; a thread whose setup failed still passes both (so none waits forever) but makes
 * no timed call, and the run reports -1. The process counters (proc_usage) are read at
 * the opening of the first gate and of the second: set-up, warm-up and the closing of
 * connections stay out of a cell's cost. */
#include <ftw.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

/* ---- time, temporary directories ---- */

uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The store directory of the running cell; "" when none. */
static char live_dir[64];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

void tmp_dir_remove(void)
{
    if (live_dir[0] != '\0') {
        nftw(live_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
        live_dir[0] = '\0';
    }
}

const char *tmp_dir_create(void)
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

int cell_fail(cell_stats *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->error, sizeof(out->error), fmt, ap);
    va_end(ap);
    return -1;
}

size_t server_contexts(int clients)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    size_t floor = (size_t)(cores > 0 ? cores : 1) * 2;
    return (size_t)clients > floor ? (size_t)clients : floor;
}

/* Where a server of cell c listens; tcp binds port 0. */
void listen_url(const cell *c, int instance, char *buf, size_t cap)
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
void set_dial_url(cell *c, const char *listen, int port)
{
    if (strcmp(c->transport, "tcp") == 0) {
        snprintf(c->url, sizeof(c->url), "tcp://127.0.0.1:%d", port);
    } else {
        snprintf(c->url, sizeof(c->url), "%s", listen);
    }
}

/* In every key: a shared database outlives one run. Set before the first cell. */
static char run_tag[24];

void run_tag_init(void)
{
    snprintf(run_tag, sizeof(run_tag), "%lx", (unsigned long)time(NULL) ^ (unsigned long)getpid());
}

int cell_key_prefix(const cell *c, char *buf, size_t cap)
{
    return snprintf(buf, cap, "%s-c%u-", run_tag, c->id);
}

bool next_call_key(bench_thread *t, char *buf, size_t cap)
{
    bool replay = t->cell->sc->keys == KEYS_REPLAY;
    uint64_t n = replay ? t->seq % REPLAY_KEYS : t->seq;
    bool want_replayed = replay && t->seq >= REPLAY_KEYS;
    int len = cell_key_prefix(t->cell, buf, cap);
    snprintf(buf + len, cap - (size_t)len, "t%d-%c%llu", t->id, replay ? 'r' : 'n',
             (unsigned long long)n);
    t->seq++;
    return want_replayed;
}

/* ---- the client loop shared by every scenario ---- */

struct client_run {
    const client_ops *ops;
    const cell *cell;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ready;                /* threads done with open + warm-up */
    int finished;             /* threads done with their timed calls */
    bool go, abort;           /* set once, under mu */
    bool measured;            /* set once, under mu, after the end counters are read */
    uint64_t deadline_ns;     /* written before go */
    atomic_ullong issued;     /* calls started, for --count */
    thread_switches sw0, sw1; /* --switches: at the start and the end */
};

int thread_fail(bench_thread *t, const char *fmt, ...)
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

/* The process counters and the peer's CPU, if the scenario has a peer. */
static void peer_usage_now(client_run *r, proc_usage *at, thread_switches *sw)
{
    if (cfg.switches) {
        thread_switches_now(sw);
    }
    proc_usage_now(at);
    if (r->ops->peer_cpu_us != NULL) {
        at->peer_cpu_us = r->ops->peer_cpu_us(r->cell);
    }
}

/* Reports this thread's timed calls done and waits until the counters are read. */
static void gate_finish(client_run *r)
{
    pthread_mutex_lock(&r->mu);
    r->finished++;
    pthread_cond_broadcast(&r->cv);
    while (!r->measured) {
        pthread_cond_wait(&r->cv, &r->mu);
    }
    pthread_mutex_unlock(&r->mu);
}

/* Waits for `started` threads to be ready, reads the counters into *at, then starts
 * them all; returns the start. */
static uint64_t gate_open(client_run *r, int started, bool abort, proc_usage *at)
{
    pthread_mutex_lock(&r->mu);
    while (r->ready < started) {
        pthread_cond_wait(&r->cv, &r->mu);
    }
    peer_usage_now(r, at, &r->sw0);
    uint64_t start = now_ns();
    r->deadline_ns = start + (uint64_t)(cfg.seconds * 1e9);
    r->go = true;
    r->abort = abort;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return start;
}

/* Waits for `started` threads to finish their timed calls, reads the counters into
 * *at, then lets them close. */
static void gate_close(client_run *r, int started, proc_usage *at)
{
    pthread_mutex_lock(&r->mu);
    while (r->finished < started) {
        pthread_cond_wait(&r->cv, &r->mu);
    }
    peer_usage_now(r, at, &r->sw1);
    r->measured = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
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
    pthread_setname_np(pthread_self(), "bench:client"); /* a kind of its own (--switches) */
    int rv = r->ops->open(t);
    for (int i = 0; rv == 0 && i < r->cell->warmup; i++) {
        rv = r->ops->call(t);
    }
    t->setup_failed = rv != 0;
    if (gate_wait(t) && !t->setup_failed) {
        timed_loop(t);
    }
    t->end_ns = now_ns();
    gate_finish(r);
    r->ops->close(t);
    return NULL;
}

/* Sums the threads' counts and merges their latency samples into percentiles. */
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
    latency_percentiles(all, total, out);
    free(all);
    return 0;
}

int run_clients(const client_ops *ops, const cell *c, cell_stats *out)
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
    proc_usage u0, u1;
    uint64_t start = gate_open(&r, started, !setup_ok, &u0);
    gate_close(&r, started, &u1);
    proc_usage_diff(&u0, &u1, &out->cost);
    thread_switches_diff(&r.sw0, &r.sw1, &out->by_thread);
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
