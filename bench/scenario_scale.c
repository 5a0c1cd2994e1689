/* z: cost against the store's size. For each size N of --scale-sizes (10k, 1M, 10M),
 * the store DIR/records-N of --scale-dir (scale_load.c: preloaded once, reused), and on
 * it four cells through the full chain (idem_client → idem_server, the default LMDB
 * store with group commit): new keys at 1 and 16 clients, each a random 64-bit key
 * that lands at a random place among the stored ones (a UUID's), and replays at 1 and
 * 16 clients, each of a stored record drawn at random (past the result cache: what a
 * retry of an older call costs), and new keys that each sort after the last one
 * ("ordered": a counter after a random prefix, as a time-ordered UUIDv7 or ULID would),
 * which all land next to each other. After a new-key cell its keys are deleted again,
 * so the store keeps N records from run to run.
 *
 * Each row: calls/s, p50/p99, CPU µs, page faults (minor, major) per call in the timed
 * window, the process's RSS after the cell, and the store's bytes on disk per record
 * (data.mdb's allocated blocks over N) and its records B-tree depth. The ratio lines
 * set each cell against the same cell on the smallest size of the same run. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench.h"
#include "scale.h"

enum scale_kind { KIND_NEW, KIND_REPLAY, KIND_ORDERED };

typedef struct scale_cell {
    uint64_t n;    /* records in the store */
    uint64_t salt; /* of this cell's new keys */
    enum scale_kind kind;
    _Atomic uint64_t next; /* KIND_ORDERED: its keys handed out */
} scale_cell;

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void new_key(char out[17], uint64_t salt, int thread, uint64_t seq)
{
    snprintf(out, 17, "%016llx",
             (unsigned long long)mix64(salt ^ ((uint64_t)thread << 40) ^ mix64(seq)));
}

/* The i-th ordered key of a cell: after every stored key ("g" sorts after hex digits),
 * the salt's 24 bits, then i. */
static void ordered_key(char out[17], uint64_t salt, uint64_t i)
{
    snprintf(out, 17, "g%06llx%09llx", (unsigned long long)(salt & 0xffffff),
             (unsigned long long)(i & 0xfffffffffull));
}

static int scale_open(bench_thread *t)
{
    idem_client_opts o;
    const char *urls[] = {t->cell->url};
    idem_client_opts_init(&o);
    o.caller = SCALE_CALLER;
    o.attempt_timeout_ms = CALL_TIMEOUT_MS;
    o.deadline_ms = CALL_TIMEOUT_MS;
    o.retry.max_attempts = 1;
    if (idem_client_open(&t->conn.client, urls, 1, &o) != IDEM_OK) {
        return thread_fail(t, "idem_client_open %s: %s", urls[0], idem_errmsg());
    }
    t->lat.rng = mix64((uint64_t)t->id + 1) | 1;
    return 0;
}

static int scale_call(bench_thread *t)
{
    const cell *c = t->cell;
    scale_cell *z = c->peer;
    bool replay = c->sc->keys == KEYS_REPLAY;
    char key[17];
    if (replay) {
        t->lat.rng = mix64(t->lat.rng);
        scale_key(key, z->n, t->lat.rng % z->n);
    } else if (z->kind == KIND_ORDERED) {
        ordered_key(key, z->salt, atomic_fetch_add(&z->next, 1));
    } else {
        new_key(key, z->salt, t->id, t->seq);
    }
    t->seq++;
    idem_request q = {.method = METHOD,
                      .idempotency_key = key,
                      .payload = c->payload,
                      .payload_len = c->payload_len};
    idem_result r;
    idem_code code = idem_client_call(t->conn.client, &q, &r);
    int rv = 0;
    if (code != IDEM_OK) {
        rv = thread_fail(t, "call %s: %s %s", key, idem_code_name(code),
                         r.message != NULL ? r.message : idem_errmsg());
    } else if (r.payload_len != c->payload_len || r.replayed != replay) {
        rv = thread_fail(t, "call %s: %zu bytes, replayed %d (want %zu, %d)", key, r.payload_len,
                         r.replayed, c->payload_len, replay);
    }
    idem_result_clear(&r);
    return rv;
}

static void scale_close(bench_thread *t)
{
    idem_client_close(t->conn.client);
}

static const client_ops scale_ops = {.open = scale_open, .call = scale_call, .close = scale_close};

static idem_code echo_handler(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    return idem_call_reply(call, IDEM_OK, p, n);
}

/* A server on st for cell c (its url set); NULL after saying why. */
static idem_server *server_start(cell *c, idem_store *st)
{
    idem_server_opts o;
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    idem_server *srv = NULL;
    char url[160];
    idem_server_opts_init(&o);
    o.store = st;
    o.contexts = server_contexts(c->clients);
    o.result_ttl_ms = SCALE_TTL_MS;
    listen_url(c, 0, url, sizeof(url));
    if (idem_server_create(&srv, &o) != IDEM_OK ||
        idem_server_register(srv, METHOD, echo_handler, NULL, &m) != IDEM_OK ||
        idem_server_listen(srv, url) != IDEM_OK) {
        fprintf(stderr, "idemrpc-bench: z: server %s: %s\n", url, idem_errmsg());
        idem_server_destroy(srv);
        return NULL;
    }
    set_dial_url(c, url, idem_server_port(srv));
    return srv;
}

int scale_template(idem_store *st, const char *transport, idem_record *out)
{
    static const scenario sc = {'z', "z:template", NULL, 0, KEYS_NEW, 0, NULL, 0};
    static char payload[SCALE_PAYLOAD];
    cell c = {.sc = &sc, .transport = transport, .clients = 1, .id = 9999};
    idem_key_ref ref = {SCALE_CALLER, METHOD, "template"};
    idem_server *srv = server_start(&c, st);
    bench_thread t = {.cell = &c};
    int rv = -1;
    memset(payload, 'p', sizeof(payload));
    c.payload = payload;
    c.payload_len = sizeof(payload);
    if (srv != NULL && scale_open(&t) == 0) {
        idem_request q = {.method = METHOD,
                          .idempotency_key = "template",
                          .payload = payload,
                          .payload_len = sizeof(payload)};
        idem_result r;
        if (idem_client_call(t.conn.client, &q, &r) == IDEM_OK) {
            rv = 0;
        }
        idem_result_clear(&r);
        scale_close(&t);
    }
    idem_server_destroy(srv);
    if (rv != 0 || idem_store_get(st, &ref, out) != IDEM_OK || idem_store_delete(st, &ref)) {
        fprintf(stderr, "idemrpc-bench: z: template record: %s\n", idem_errmsg());
        return -1;
    }
    return 0;
}

/* What one cell measured, for the ratio lines and --scale-csv. */
typedef struct scale_row {
    uint64_t n;
    const char *kind; /* "new", "replay", "ordered"; "grown": the grown store's bytes per
                       * record */
    int clients;
    double calls_s, p50_us, p99_us, cpu_us, minflt, majflt, rss_mib, bytes_per_rec;
    unsigned depth;       /* of the records B-tree */
    int round;            /* of --scale-rounds */
    double pages_per_cmt; /* bytes LMDB wrote (wchar) over the cell's commits, in pages */
} scale_row;

#define MAX_SCALE_ROWS 1024
static scale_row scale_rows[MAX_SCALE_ROWS];
static int n_scale_rows;

/* data.mdb's allocated bytes over n records. */
static double bytes_per_record(const char *dir, uint64_t n)
{
    char path[4300];
    struct stat sb;
    snprintf(path, sizeof(path), "%s/data.mdb", dir);
    return stat(path, &sb) == 0 ? (double)sb.st_blocks * 512 / (double)n : NAN;
}

/* Deletes the new keys of a cell's threads (each thread's run of seq from 0; a run of
 * misses ends it), on a NOSYNC open of the store: the next cell's opens find it as
 * loaded, N records. */
static void new_keys_delete(const char *dir, const scale_cell *z, int clients)
{
    idem_store *st;
    size_t gone = 0;
    if (idem_store_open_lmdb(&st, dir, SCALE_MAP_SIZE, IDEM_STORE_NOSYNC) != IDEM_OK) {
        fprintf(stderr, "idemrpc-bench: z: cleanup open %s: %s\n", dir, idem_errmsg());
        return;
    }
    for (uint64_t i = 0; z->kind == KIND_ORDERED && i < z->next; i++) {
        char key[17];
        ordered_key(key, z->salt, i);
        idem_key_ref ref = {SCALE_CALLER, METHOD, key};
        gone += idem_store_delete(st, &ref) == IDEM_OK;
    }
    for (int t = 0; z->kind == KIND_NEW && t < clients; t++) {
        int misses = 0;
        for (uint64_t seq = 0; misses < 64; seq++) {
            char key[17];
            new_key(key, z->salt, t, seq);
            idem_key_ref ref = {SCALE_CALLER, METHOD, key};
            bool hit = idem_store_delete(st, &ref) == IDEM_OK;
            misses = hit ? 0 : misses + 1;
            gone += hit;
        }
    }
    idem_store_close(st);
    scale_churn_add(dir, gone);
}

/* The cell's row and its line of the table. */
static void scale_report(const cell *c, const cell_stats *s, scale_row *r)
{
    double calls = (double)(s->ok + s->errors);
    r->calls_s = (double)s->ok / s->seconds;
    r->p50_us = s->p50_us;
    r->p99_us = s->p99_us;
    r->cpu_us = s->cost.cpu_us / calls;
    r->minflt = s->cost.minflt / calls;
    r->majflt = s->cost.majflt / calls;
    printf("%-15s %10llu %7d %10.0f %8.0f %8.0f %7.0f %7.2f %7.3f %7.0f %6.0f %5u %6.1f\n",
           c->sc->name, (unsigned long long)r->n, r->clients, r->calls_s, r->p50_us, r->p99_us,
           r->cpu_us, r->minflt, r->majflt, r->rss_mib, r->bytes_per_rec, r->depth,
           r->pages_per_cmt);
    if (s->errors > 0) {
        fprintf(stderr, "  %s: %llu errors, first: %s\n", c->sc->name,
                (unsigned long long)s->errors, s->error);
    }
    fflush(stdout);
}

/* Runs cell c on the store in dir with a server of its own; the store's counters into r. */
static int scale_measure(const char *dir, cell *c, cell_stats *s, scale_row *r)
{
    idem_store *st;
    idem_store_stats ss = {.commits = 0};
    if (idem_store_open_lmdb(&st, dir, SCALE_MAP_SIZE, 0) != IDEM_OK) {
        fprintf(stderr, "idemrpc-bench: z: open %s: %s\n", dir, idem_errmsg());
        return -1;
    }
    /* write_bytes: what this process dirtied in the page cache (LMDB's pwrite of each
     * page it commits; sockets do not count). */
    double dirtied = proc_self_field("io", "write_bytes:");
    idem_server *srv = server_start(c, st);
    int rv = srv != NULL ? run_clients(&scale_ops, c, s) : -1;
    r->rss_mib = proc_self_field("status", "VmRSS:") / 1024;
    idem_server_destroy(srv);
    (void)idem_store_stats_get(st, &ss);
    double written = proc_self_field("io", "write_bytes:") - dirtied;
    r->pages_per_cmt = ss.commits > 0 ? written / 4096 / (double)ss.commits : NAN;
    idem_store_close(st);
    return rv;
}

/* One cell on the store in dir; false when it could not be measured. */
static bool scale_cell_run(const char *dir, uint64_t n, enum scale_kind kind, int clients,
                           int round, unsigned depth)
{
    static const char *const names[] = {"new", "replay", "ordered"}; /* by scale_kind */
    static const scenario sc_new = {'z', "z:scale-new", NULL, 0, KEYS_NEW, 0, NULL, 0};
    static const scenario sc_rep = {'z', "z:scale-replay", NULL, 0, KEYS_REPLAY, 0, NULL, 0};
    static const scenario sc_ord = {'z', "z:scale-ordered", NULL, 0, KEYS_NEW, 0, NULL, 0};
    static const scenario *const scs[] = {&sc_new, &sc_rep, &sc_ord}; /* by scale_kind */
    static char payload[SCALE_PAYLOAD];
    static unsigned next_id = 5000;
    bool replay = kind == KIND_REPLAY;
    scale_cell z = {.n = n, .salt = mix64(now_ns()), .kind = kind};
    cell c = {.sc = scs[kind],
              .transport = cfg.transports[0],
              .clients = clients,
              .payload_len = sizeof(payload),
              .payload = payload,
              .id = next_id++,
              .warmup = WARMUP_CALLS,
              .peer = &z};
    cell_stats s = {.ok = 0};
    scale_row r = {.n = n,
                   .kind = names[kind],
                   .clients = clients,
                   .bytes_per_rec = bytes_per_record(dir, n),
                   .depth = depth,
                   .round = round};
    memset(payload, 'p', sizeof(payload));
    int rv = scale_measure(dir, &c, &s, &r);
    if (!replay) {
        new_keys_delete(dir, &z, clients);
    }
    if (rv != 0 || s.ok == 0 || n_scale_rows >= MAX_SCALE_ROWS) {
        fprintf(stderr, "idemrpc-bench: z: %s: %s\n", c.sc->name, s.error);
        return false;
    }
    scale_report(&c, &s, &r);
    scale_rows[n_scale_rows++] = r;
    return true;
}

/* Each row's calls/s over the same cell's on the run's first size. */
static void scale_ratios(void)
{
    printf("\nz: calls/s at N over the same cell at %ld records (this run)\n", cfg.scale_sizes[0]);
    for (int i = 0; i < n_scale_rows; i++) {
        const scale_row *r = &scale_rows[i];
        for (int j = 0; j < n_scale_rows; j++) {
            const scale_row *b = &scale_rows[j];
            if (b->n == (uint64_t)cfg.scale_sizes[0] && strcmp(b->kind, r->kind) == 0 &&
                b->round == r->round && strcmp(r->kind, "grown") != 0 && b->clients == r->clients &&
                r->n != b->n) {
                printf("  %-7s %2d clients at %10llu (round %d): %.2f\n", r->kind, r->clients,
                       (unsigned long long)r->n, r->round + 1, r->calls_s / b->calls_s);
            }
        }
    }
}

static int scale_csv(const char *path)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return -1;
    }
    fprintf(f, "records,kind,clients,calls_per_s,p50_us,p99_us,cpu_us_per_call,"
               "minflt_per_call,majflt_per_call,rss_mib,bytes_per_record,records_depth,round,"
               "pages_per_commit\n");
    for (int i = 0; i < n_scale_rows; i++) {
        const scale_row *r = &scale_rows[i];
        fprintf(f, "%llu,%s,%d,%.1f,%.1f,%.1f,%.1f,%.3f,%.4f,%.0f,%.1f,%u,%d,%.2f\n",
                (unsigned long long)r->n, r->kind, r->clients, r->calls_s, r->p50_us, r->p99_us,
                r->cpu_us, r->minflt, r->majflt, r->rss_mib, r->bytes_per_rec, r->depth, r->round,
                r->pages_per_cmt);
    }
    return fclose(f) == 0 ? 0 : -1;
}

#define GROWN_KEYS 100000

/* The template of the preloaded store in dir (record 0), for the grown store. */
static int template_of(const char *dir, uint64_t n, idem_record *out)
{
    idem_store *st;
    char key[17];
    scale_key(key, n, 0);
    idem_key_ref ref = {SCALE_CALLER, METHOD, key};
    if (idem_store_open_lmdb(&st, dir, SCALE_MAP_SIZE, IDEM_STORE_READONLY) != IDEM_OK) {
        return -1;
    }
    idem_code code = idem_store_get(st, &ref, out);
    idem_store_close(st);
    return code == IDEM_OK ? 0 : -1;
}

/* Bytes per record of a store grown by GROWN_KEYS keys as a server writes them (splits,
 * the claim's expiry entry replaced by the completion's), random or ascending keys, with
 * its shape. */
static void scale_grown_one(const char *dir, const idem_record *tmpl, bool ordered)
{
    scale_shape_t sh;
    uint64_t t0 = now_ns();
    if (scale_grow(dir, GROWN_KEYS, ordered, tmpl, &sh) != 0 || n_scale_rows >= MAX_SCALE_ROWS) {
        return;
    }
    double bpr = (double)sh.used_pages * 4096 / GROWN_KEYS;
    scale_rows[n_scale_rows++] =
        (scale_row){.n = GROWN_KEYS,
                    .kind = ordered ? "grown-ordered" : "grown",
                    .calls_s = GROWN_KEYS / ((double)(now_ns() - t0) / 1e9),
                    .p50_us = NAN,
                    .p99_us = NAN,
                    .cpu_us = NAN,
                    .minflt = NAN,
                    .majflt = NAN,
                    .rss_mib = NAN,
                    .bytes_per_rec = bpr,
                    .depth = sh.records_depth,
                    .pages_per_cmt = NAN};
    printf("z: grown by %d %s keys through claim + complete: %.0f B/record; records "
           "%zu pages (depth %u), expiry %zu pages (depth %u), %zu pages used in all\n",
           GROWN_KEYS, ordered ? "ascending" : "random", bpr, sh.records_pages, sh.records_depth,
           sh.expiry_pages, sh.expiry_depth, sh.used_pages);
}

static void scale_grown(const char *first_dir, uint64_t n)
{
    char dir[4200];
    idem_record tmpl;
    snprintf(dir, sizeof(dir), "%s/grown", cfg.scale_dir);
    if (template_of(first_dir, n, &tmpl) != 0) {
        fprintf(stderr, "idemrpc-bench: z: no template in %s: %s\n", first_dir, idem_errmsg());
        return;
    }
    scale_grown_one(dir, &tmpl, false);
    scale_grown_one(dir, &tmpl, true);
    idem_record_clear(&tmpl);
}

/* One cell on the store of size n (loaded or reused first); false when it failed. */
static bool size_cell(uint64_t n, enum scale_kind kind, int clients, int round)
{
    char dir[4200];
    scale_shape_t sh = {.records_depth = 0};
    snprintf(dir, sizeof(dir), "%s/records-%llu", cfg.scale_dir, (unsigned long long)n);
    if (scale_store_ready(dir, n, cfg.transports[0]) != 0) {
        return false;
    }
    scale_shape(dir, &sh); /* depth 0 when it cannot say */
    return scale_cell_run(dir, n, kind, clients, round, sh.records_depth);
}

/* Every (kind, clients) on every size in turn, --scale-rounds times: each size's cell
 * next to the smallest size's of the same round, under the same load of the machine. */
static bool scale_cells(void)
{
    static const long two[] = {1, 16};
    const long *ks = cfg.clients_given ? cfg.grids[0].clients : two;
    int n_ks = cfg.clients_given ? cfg.grids[0].n_clients : 2;
    static const unsigned bits[] = {[KIND_NEW] = 1, [KIND_REPLAY] = 2, [KIND_ORDERED] = 8};
    bool ok = true;
    for (enum scale_kind kind = KIND_NEW; kind <= KIND_ORDERED; kind++) {
        for (int k = 0; k < n_ks && (cfg.scale_kinds & bits[kind]); k++) {
            for (int round = 0; round < cfg.scale_rounds; round++) {
                for (int i = 0; i < cfg.n_scale_sizes && ok; i++) {
                    ok = size_cell((uint64_t)cfg.scale_sizes[i], kind, (int)ks[k], round);
                }
            }
        }
    }
    return ok;
}

int run_scale(void)
{
    if (cfg.scale_dir == NULL) {
        fprintf(stderr, "idemrpc-bench: z needs --scale-dir DIR (where its stores are kept)\n");
        return -1;
    }
    if (mkdir(cfg.scale_dir, 0700) != 0 && errno != EEXIST) {
        fprintf(stderr, "idemrpc-bench: mkdir %s: %s\n", cfg.scale_dir, strerror(errno));
        return -1;
    }
    printf("\n%-15s %10s %7s %10s %8s %8s %7s %7s %7s %7s %6s %5s %6s\n", "z: scale", "records",
           "clients", "calls/s", "p50us", "p99us", "cpu_us", "minflt", "majflt", "rssMiB", "B/rec",
           "depth", "pg/cmt");
    bool ok = scale_cells();
    if (ok && cfg.n_scale_sizes > 0 && (cfg.scale_kinds & 4)) {
        char first[4200];
        snprintf(first, sizeof(first), "%s/records-%ld", cfg.scale_dir, cfg.scale_sizes[0]);
        scale_grown(first, (uint64_t)cfg.scale_sizes[0]);
    }
    scale_ratios();
    if (cfg.scale_csv != NULL && scale_csv(cfg.scale_csv) != 0) {
        fprintf(stderr, "idemrpc-bench: cannot write %s\n", cfg.scale_csv);
        ok = false;
    }
    return ok ? 0 : -1;
}
