/* Statistics and output: latency samples and their percentiles, the rows of the run
 * with their ratio to the echo baseline, and every way they are shown (the table on
 * stdout, the pg-vs-lmdb lines, CSV, JSON with the machine they were measured on).
 * Rows are appended on the main thread only, after their cell has finished. */
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "bench.h"
#include "json.h"

/* ---- latency samples ---- */

/* Keeps the first cap samples, then each later one with probability cap/seen (reservoir
 * sampling), so the kept set stays a uniform sample of all calls. */
void latency_record(latency_sample *s, uint64_t ns)
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

void latency_percentiles(uint64_t *all, size_t n, cell_stats *out)
{
    qsort(all, n, sizeof(*all), cmp_u64);
    out->p50_us = percentile_us(all, n, 0.50);
    out->p99_us = percentile_us(all, n, 0.99);
    out->p999_us = percentile_us(all, n, 0.999);
}

/* ---- results ---- */

typedef struct row {
    const scenario *sc;
    const char *transport;
    int clients;
    size_t payload;
    double calls_s, p50_us, p99_us, p999_us, ratio; /* NAN: none */
    proc_usage per_call; /* the cell's cost over its calls (ok or not); NAN: unknown */
    uint64_t errors;
} row;

static row rows[MAX_GRIDS * N_SCENARIOS * MAX_LIST * MAX_LIST * MAX_LIST];
static size_t n_rows;

/* (a) for the same transport, clients and payload; for f and v, (a) on the first
 * transport with the fewest clients. NULL when (a) was not run. */
static const row *baseline_of(const row *r)
{
    bool storage = storage_baseline(r->sc);
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

static const char *table_fmt =
    "%-20s %-9s %7s %7s %9s %9s %9s %9s %10s %9s %7s %7s %7s %8s %10s %6s\n";

static void print_header(void)
{
    printf(table_fmt, "scenario", "transport", "clients", "payload", "calls/s", "p50_us", "p99_us",
           "p999_us", "ratio_vs_a", "cpu_us/c", "vcsw/c", "ivcsw/c", "rwsys/c", "allocs/c",
           "peer_cpu/c", "errors");
}

/* v with fmt into buf, "-" for NAN. */
static const char *cellf(char *buf, size_t cap, const char *fmt, double v)
{
    snprintf(buf, cap, isnan(v) ? "-" : fmt, v);
    return buf;
}

static void print_row(const row *r)
{
    char cl[16], pl[16], cs[16], err[24], b[10][24];
    const proc_usage *u = &r->per_call;
    snprintf(cl, sizeof(cl), "%d", r->clients);
    snprintf(pl, sizeof(pl), "%zu", r->payload);
    snprintf(cs, sizeof(cs), "%.0f", r->calls_s);
    snprintf(err, sizeof(err), "%llu", (unsigned long long)r->errors);
    printf(table_fmt, r->sc->name, r->transport, cl, pl, cs, cellf(b[0], 24, "%.1f", r->p50_us),
           cellf(b[1], 24, "%.1f", r->p99_us), cellf(b[2], 24, "%.1f", r->p999_us),
           cellf(b[3], 24, "%.3f", r->ratio), cellf(b[4], 24, "%.1f", u->cpu_us),
           cellf(b[5], 24, "%.2f", u->vcsw), cellf(b[6], 24, "%.2f", u->ivcsw),
           cellf(b[7], 24, "%.2f", u->rw_syscalls), cellf(b[8], 24, "%.1f", u->allocs),
           cellf(b[9], 24, "%.1f", u->peer_cpu_us), err);
    fflush(stdout);
}

/* The cell's cost per call; all NAN when it made none. */
static proc_usage per_call(const cell_stats *s)
{
    double n = (double)(s->ok + s->errors);
    const proc_usage *c = &s->cost;
    if (n == 0) {
        return (proc_usage){NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN};
    }
    return (proc_usage){.cpu_us = c->cpu_us / n,
                        .vcsw = c->vcsw / n,
                        .ivcsw = c->ivcsw / n,
                        .rw_syscalls = c->rw_syscalls / n,
                        .allocs = c->allocs / n,
                        .minflt = c->minflt / n,
                        .majflt = c->majflt / n,
                        .peer_cpu_us = c->peer_cpu_us / n};
}

/* --switches: the cell's switches per call by thread kind, voluntary + involuntary. */
static void print_switches(const thread_switches *t, double calls)
{
    double total = 0;
    printf("  switches/call by thread (vol+invol):");
    for (int i = 0; calls > 0 && i < t->n; i++) {
        double per = (t->vcsw[i] + t->ivcsw[i]) / calls;
        total += per;
        if (per >= 0.005) {
            printf(" %s %.2f+%.2f", t->kind[i], t->vcsw[i] / calls, t->ivcsw[i] / calls);
        }
    }
    printf("; total %.2f\n", total);
}

/* Appends the row of a measured cell, with its ratio to (a) when (a) ran, and prints
 * it; its errors, if any, go to stderr after the row. */
void report_cell(const scenario *sc, const char *transport, int clients, size_t payload,
                 const cell_stats *s)
{
    row *r = &rows[n_rows++];
    *r = (row){.sc = sc,
               .transport = transport,
               .clients = clients,
               .payload = payload,
               .calls_s = s->seconds > 0 ? (double)s->ok / s->seconds : 0,
               .p50_us = s->p50_us,
               .p99_us = s->p99_us,
               .p999_us = s->p999_us,
               .per_call = per_call(s),
               .errors = s->errors,
               .ratio = NAN};
    const row *a = baseline_of(r);
    if (a != NULL && a->calls_s > 0) {
        r->ratio = r->calls_s / a->calls_s;
    }
    print_row(r);
    if (cfg.switches) {
        print_switches(&s->by_thread, (double)(s->ok + s->errors));
    }
    if (s->errors > 0) {
        fprintf(stderr, "  %s: %llu errors, first: %s\n", sc->name, (unsigned long long)s->errors,
                s->error);
    }
}

/* A cell that could not be measured: a table line with the reason, and no row. */
void report_failed(const scenario *sc, const char *transport, int clients, size_t payload,
                   const cell_stats *s)
{
    printf("%-20s %-9s %7d %7zu   FAILED: %s\n", sc->name, transport, clients, payload, s->error);
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

int report_write_csv(const char *path)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return -1;
    }
    fprintf(f, "scenario,transport,clients,payload,calls_per_s,p50_us,p99_us,p999_us,"
               "ratio_vs_a,cpu_us_per_call,vcsw_per_call,ivcsw_per_call,"
               "rw_syscalls_per_call,allocs_per_call,peer_cpu_us_per_call,errors\n");
    for (size_t i = 0; i < n_rows; i++) {
        const row *r = &rows[i];
        const proc_usage *u = &r->per_call;
        char b[10][32];
        fprintf(f, "%s,%s,%d,%zu,%.1f,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%llu\n", r->sc->name,
                r->transport, r->clients, r->payload, r->calls_s,
                num(b[0], 32, "%.1f", r->p50_us, ""), num(b[1], 32, "%.1f", r->p99_us, ""),
                num(b[2], 32, "%.1f", r->p999_us, ""), num(b[3], 32, "%.4f", r->ratio, ""),
                num(b[4], 32, "%.2f", u->cpu_us, ""), num(b[5], 32, "%.3f", u->vcsw, ""),
                num(b[6], 32, "%.3f", u->ivcsw, ""), num(b[7], 32, "%.3f", u->rw_syscalls, ""),
                num(b[8], 32, "%.2f", u->allocs, ""), num(b[9], 32, "%.2f", u->peer_cpu_us, ""),
                (unsigned long long)r->errors);
    }
    return fclose(f) == 0 ? 0 : -1;
}

/* What the cost columns measure; in the preamble and in the JSON config. */
static const char cost_note[] =
    "cost per call over the timed window (common start to last reply), of this whole "
    "process: server, store and clients all run in it. cpu_us: user+system CPU, vcsw/ivcsw: "
    "voluntary/involuntary context switches, both getrusage(RUSAGE_SELF). rwsys: "
    "read/write-family syscalls, /proc/self/io syscr+syscw (read, readv, pread, write, "
    "writev, pwrite; not sendmsg, recvmsg, epoll, futex, fdatasync: Linux has no cheap "
    "full per-process syscall count). allocs: malloc+calloc+realloc calls, counted by "
    "this binary's own wrappers (bench/alloc_count.c; \"-\" in a sanitizer build). A "
    "database server is another process, its CPU not in cpu_us: PostgreSQL's (g-i) is not "
    "measured, redis-server's (r-u) is peer_cpu, from INFO cpu at the same two moments.";

/* ---- the machine ---- */

static struct {
    long nproc;
    char kernel[128], cpu[128], lmdb[32], tmp_fs[32];
    const char *nng;
} machine;

int report_write_json(const char *path)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return -1;
    }
    fprintf(f, "{\"machine\": {\"nproc\": %ld, \"kernel\": ", machine.nproc);
    idem__json_fputs(f, machine.kernel);
    fprintf(f, ", \"cpu\": ");
    idem__json_fputs(f, machine.cpu);
    fprintf(f, ", \"nng\": \"%s\", \"lmdb\": \"%s\", \"tmp_fs\": \"%s\"},\n", machine.nng,
            machine.lmdb, machine.tmp_fs);
    fprintf(f,
            " \"config\": {\"seconds\": %g, \"count\": %llu, \"clients\": "
            "\"one idem_client per thread\", \"cost\": ",
            cfg.seconds, cfg.count);
    idem__json_fputs(f, cost_note);
    fprintf(f, "},\n \"rows\": [\n");
    for (size_t i = 0; i < n_rows; i++) {
        const row *r = &rows[i];
        const proc_usage *u = &r->per_call;
        char b[10][32];
        fprintf(
            f,
            "  {\"scenario\": \"%s\", \"transport\": \"%s\", \"clients\": %d, "
            "\"payload\": %zu, \"calls_per_s\": %.1f, \"p50_us\": %s, \"p99_us\": %s, "
            "\"p999_us\": %s, \"ratio_vs_a\": %s, \"cpu_us_per_call\": %s, "
            "\"vcsw_per_call\": %s, \"ivcsw_per_call\": %s, \"rw_syscalls_per_call\": %s, "
            "\"allocs_per_call\": %s, \"peer_cpu_us_per_call\": %s, \"errors\": %llu}%s\n",
            r->sc->name, r->transport, r->clients, r->payload, r->calls_s,
            num(b[0], 32, "%.1f", r->p50_us, "null"), num(b[1], 32, "%.1f", r->p99_us, "null"),
            num(b[2], 32, "%.1f", r->p999_us, "null"), num(b[3], 32, "%.4f", r->ratio, "null"),
            num(b[4], 32, "%.2f", u->cpu_us, "null"), num(b[5], 32, "%.3f", u->vcsw, "null"),
            num(b[6], 32, "%.3f", u->ivcsw, "null"), num(b[7], 32, "%.3f", u->rw_syscalls, "null"),
            num(b[8], 32, "%.2f", u->allocs, "null"), num(b[9], 32, "%.2f", u->peer_cpu_us, "null"),
            (unsigned long long)r->errors, i + 1 < n_rows ? "," : "");
    }
    fprintf(f, " ]}\n");
    return fclose(f) == 0 ? 0 : -1;
}

const char *fs_type_name(long type)
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
             statfs("/tmp", &sf) == 0 ? fs_type_name((long)sf.f_type) : "?");
}

/* "1,16,64" from a list of n numbers. */
static void print_list(const long *v, int n)
{
    for (int i = 0; i < n; i++) {
        printf("%s%ld", i > 0 ? "," : "", v[i]);
    }
}

/* The cells of the run, one line per grid. */
static void print_plan(void)
{
    for (int i = 0; i < cfg.n_grids; i++) {
        const bench_grid *g = &cfg.grids[i];
        printf("%s scenarios ", i == 0 ? "cells:" : "   and");
        for (int l = 0; l < N_LETTERS; l++) {
            if (g->want[l]) {
                putchar('a' + l);
            }
        }
        printf(" x clients ");
        print_list(g->clients, g->n_clients);
        printf(" x payload ");
        print_list(g->payloads, g->n_payloads);
        printf(" B x transport");
        for (int t = 0; t < cfg.n_transports; t++) {
            printf("%s%s", t > 0 ? "," : " ", cfg.transports[t]);
        }
        printf("\n");
    }
}

/* Whether any grid has a scenario from letter lo to hi. */
static bool any_wanted(char lo, char hi)
{
    for (int i = 0; i < cfg.n_grids; i++) {
        for (char l = lo; l <= hi; l++) {
            if (cfg.grids[i].want[l - 'a']) {
                return true;
            }
        }
    }
    return false;
}

static void print_preamble(void)
{
    printf("idemrpc-bench: nproc %ld, kernel %s, CPU %s\n", machine.nproc, machine.kernel,
           machine.cpu);
    printf("nng %s, LMDB %s; stores in /tmp (%s), durable = fdatasync per commit\n", machine.nng,
           machine.lmdb, machine.tmp_fs);
    print_plan();
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
    printf("f: one mdb_put per durable txn, v: pwrite + fdatasync of one file; 1 thread each, "
           "their ratio is vs a on %s with the fewest clients\n",
           cfg.transports[0]);
    printf("%s\n", cost_note);
    if (any_wanted('r', 'u')) {
        redis_preamble();
    }
    printf("\n");
}

void report_preamble(void)
{
    machine_probe();
    print_preamble();
    print_header();
}

/* Rows set against their counterparts of the same run: PostgreSQL against LMDB (g and
 * h vs c, i vs e, l vs k), transactional and journaled methods against a cached one
 * (k, m, n vs c), and idemrpc against the plain Redis peer (c vs r and d vs t, new
 * keys, durable and not; e vs s, replay). */
static const struct {
    char row, peer;
    const char *label;
} pairs[] = {
    {'g', 'c', "pg vs lmdb"},
    {'h', 'c', "pg vs lmdb"},
    {'i', 'e', "pg vs lmdb"},
    {'q', 'e', "pg vs lmdb"},
    {'q', 'i', "cached vs round trip"},
    {'l', 'k', "tx pg vs lmdb"},
    {'x', 'g', "ha vs single"},
    {'y', 'i', "ha vs single"},
    {'k', 'c', "tx vs cached"},
    {'m', 'c', "1 step vs cached"},
    {'n', 'c', "3 steps vs cached"},
    {'o', 'c', "1 step with undo vs cached"},
    {'p', 'c', "compensated vs cached"},
    {'c', 'r', "c vs redis-new(always)"},
    {'d', 't', "d vs redis-new(everysec)"},
    {'e', 's', "e vs redis-replay"},
};

/* The row of scenario `letter` in r's (transport, clients, payload); NULL when none. */
static const row *row_like(const row *r, char letter)
{
    for (size_t i = 0; i < n_rows; i++) {
        const row *l = &rows[i];
        if (l->sc->letter == letter && strcmp(l->transport, r->transport) == 0 &&
            l->clients == r->clients && l->payload == r->payload) {
            return l;
        }
    }
    return NULL;
}

void report_peer_ratios(void)
{
    for (size_t k = 0; k < sizeof(pairs) / sizeof(pairs[0]); k++) {
        for (size_t i = 0; i < n_rows; i++) {
            const row *p = &rows[i];
            const row *l = p->sc->letter == pairs[k].row ? row_like(p, pairs[k].peer) : NULL;
            if (l == NULL || l->calls_s <= 0) {
                continue;
            }
            printf("%s: %s / %s %s %d clients %zu B: %.3f", pairs[k].label, p->sc->name,
                   l->sc->name, p->transport, p->clients, p->payload, p->calls_s / l->calls_s);
            if (!isnan(l->per_call.peer_cpu_us)) {
                printf("; CPU per call %.0f us vs %.0f us + %.0f us in redis-server",
                       p->per_call.cpu_us, l->per_call.cpu_us, l->per_call.peer_cpu_us);
            }
            printf("\n");
        }
    }
}
